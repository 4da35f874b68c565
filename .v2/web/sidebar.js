// The sessions sidebar: the server's list (most recently updated first), with rename and delete.
import { api } from "./api.js";

export class Sidebar {
  constructor({ onSelect, onDeleted, onError }) {
    this.list = document.getElementById("session-list");
    this.empty = document.getElementById("sessions-empty");
    this.openButton = document.getElementById("open-sidebar");
    this.onSelect = onSelect;
    this.onDeleted = onDeleted;
    this.onError = onError;
    this.current = null;
    this.openButton.addEventListener("click", () => this.setOpen(true));
    document.getElementById("close-sidebar").addEventListener("click", () => this.setOpen(false));
    // the drawer (phone width) closes on Escape or a tap beside it
    document.addEventListener("keydown", (e) => {
      if (e.key === "Escape" && this.isOpen()) this.setOpen(false, true);
    });
    document.querySelector(".main").addEventListener("click", (e) => {
      if (this.isOpen() && !this.openButton.contains(e.target)) this.setOpen(false);
    });
  }

  // On narrow screens the sidebar is a drawer over the chat.
  setOpen(open, returnFocus = false) {
    document.body.classList.toggle("sidebar-open", open);
    this.openButton.setAttribute("aria-expanded", String(open));
    if (open) (this.list.querySelector("a") || document.getElementById("new-chat")).focus();
    else if (returnFocus) this.openButton.focus();
  }

  isOpen() {
    return document.body.classList.contains("sidebar-open");
  }

  setCurrent(id) {
    this.current = id;
    for (const item of this.list.children) {
      const link = item.querySelector(".session-link");
      if (item.dataset.id === id) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
  }

  async refresh(currentId = this.current) {
    try {
      const sessions = (await api.listSessions()).data;
      this.list.replaceChildren(...sessions.map((s) => this.item(s)));
      this.empty.hidden = sessions.length > 0;
      this.setCurrent(currentId);
    } catch (err) {
      this.onError(err);
    }
  }

  item(session) {
    const node = document.getElementById("session-template").content.firstElementChild.cloneNode(true);
    const title = session.title || "Untitled chat";
    node.dataset.id = session.id;
    const link = node.querySelector(".session-link");
    link.href = `?s=${encodeURIComponent(session.id)}`;
    link.title = `${title} — updated ${new Date(session.updated_at * 1000).toLocaleString()}`;
    node.querySelector(".session-title").textContent = title;
    link.addEventListener("click", (e) => {
      if (e.ctrlKey || e.metaKey || e.shiftKey || e.button !== 0) return; // let the browser open a tab
      e.preventDefault();
      this.setOpen(false);
      this.onSelect(session.id);
    });
    node.querySelector(".rename").setAttribute("aria-label", `Rename “${title}”`);
    node.querySelector(".delete").setAttribute("aria-label", `Delete “${title}”`);
    node.querySelector(".rename").addEventListener("click", () => this.startRename(node, session));
    node.querySelector(".delete").addEventListener("click", () => this.remove(session));
    return node;
  }

  startRename(node, session) {
    const link = node.querySelector(".session-link");
    const input = document.createElement("input");
    input.className = "rename-input";
    input.value = session.title || "";
    input.setAttribute("aria-label", "New title");
    link.replaceWith(input);
    input.focus();
    input.select();
    let done = false;
    const finish = async (save) => {
      if (done) return;
      done = true;
      const title = input.value.trim();
      if (save && title && title !== session.title) {
        try {
          await api.renameSession(session.id, title);
          document.dispatchEvent(new CustomEvent("session-renamed", { detail: { id: session.id, title } }));
        } catch (err) {
          this.onError(err);
        }
      }
      await this.refresh();
      this.list.querySelector(`[data-id="${CSS.escape(session.id)}"] .rename`)?.focus();
    };
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") finish(true);
      else if (e.key === "Escape") finish(false);
    });
    input.addEventListener("blur", () => finish(true));
  }

  async remove(session) {
    if (!confirm(`Delete the chat “${session.title || "Untitled chat"}”? This cannot be undone.`)) return;
    try {
      await api.deleteSession(session.id);
      this.onDeleted(session.id);
    } catch (err) {
      this.onError(err);
    }
    await this.refresh();
  }
}
