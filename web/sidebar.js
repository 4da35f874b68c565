// The sessions sidebar: one entry per conversation (a chat and its branches: web/branches.js), pinned ones
// first, then the most recently updated; rename and delete. It lists the chats the UI created unless "Show
// API chats" is on (sessions made by scripts through the API).
import { api } from "./api.js";
import { BranchTree } from "./branches.js";

const SHOW_API_KEY = "pagedchat.showApiChats";

export class Sidebar {
  constructor({ onSelect, onDeleted, onError }) {
    this.list = document.getElementById("session-list");
    this.empty = document.getElementById("sessions-empty");
    this.openButton = document.getElementById("open-sidebar");
    this.onSelect = onSelect;
    this.onDeleted = onDeleted;
    this.onError = onError;
    this.current = null;
    this.tree = new BranchTree([]);
    this.loaded = false; // the list came once
    this.showApi = document.getElementById("show-api-chats");
    this.showApi.checked = localStorage.getItem(SHOW_API_KEY) === "true";
    this.showApi.addEventListener("change", () => {
      localStorage.setItem(SHOW_API_KEY, String(this.showApi.checked));
      this.refresh();
    });
    this.openButton.addEventListener("click", () => this.setOpen(true));
    document.getElementById("close-sidebar").addEventListener("click", () => this.setOpen(false));
    // the drawer (phone width) closes on Escape, a tap beside it, or when the window grows past phone width
    document.addEventListener("keydown", (e) => {
      if (e.key === "Escape" && this.isOpen()) this.setOpen(false, true);
    });
    const drawer = document.getElementById("sidebar");
    document.addEventListener("click", (e) => {
      if (this.isOpen() && !drawer.contains(e.target) && !this.openButton.contains(e.target)) this.setOpen(false);
    });
    matchMedia("(max-width: 720px)").addEventListener("change", (e) => {
      if (!e.matches && this.isOpen()) this.setOpen(false);
    });
  }

  // On narrow screens the sidebar is a drawer over the chat: while it is open the chat behind it is inert
  // (neither the keyboard nor a screen reader reaches it; a tap there lands on the document and closes it).
  setOpen(open, returnFocus = false) {
    document.body.classList.toggle("sidebar-open", open);
    document.querySelector(".main").inert = open;
    this.openButton.setAttribute("aria-expanded", String(open));
    if (open) (this.list.querySelector("a") || document.getElementById("new-chat")).focus();
    else if (returnFocus) this.openButton.focus();
  }

  isOpen() {
    return document.body.classList.contains("sidebar-open");
  }

  setCurrent(id) {
    this.current = id;
    const root = id ? this.tree.rootOf(id) : null;
    for (const item of this.list.children) {
      const link = item.querySelector(".session-link");
      if (item.dataset.id === root) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
  }

  async refresh(currentId = this.current) {
    try {
      const sessions = (await api.listSessions({ source: this.showApi.checked ? null : "ui" })).data;
      this.tree = new BranchTree(sessions);
      const roots = sessions.filter((s) => this.tree.isRoot(s));
      const order = (s) => [s.pinned ? 1 : 0, this.tree.lastUpdate(s.id)];
      roots.sort((a, b) => {
        const [pa, ua] = order(a);
        const [pb, ub] = order(b);
        return pb - pa || ub - ua;
      });
      this.list.replaceChildren(...roots.map((s) => this.item(s)));
      this.empty.hidden = roots.length > 0;
      this.loaded = true;
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
    node.querySelector(".pinned-mark").hidden = !session.pinned;
    link.addEventListener("click", (e) => {
      if (e.ctrlKey || e.metaKey || e.shiftKey || e.button !== 0) return; // let the browser open a tab
      e.preventDefault();
      this.setOpen(false);
      this.onSelect(this.tree.latestUnder(session.id)); // the branch opened last
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
          await this.renameConversation(session.id, title);
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

  // Renames the conversation of `id`: the chat and its branches (they show one title).
  async renameConversation(id, title) {
    for (const each of this.tree.descendants(this.tree.rootOf(id))) {
      await api.renameSession(each, title);
      document.dispatchEvent(new CustomEvent("session-renamed", { detail: { id: each, title } }));
    }
  }

  // The conversation's entry (its root's summary) for the session `id`.
  rootSummary(id) {
    return this.tree.byId.get(this.tree.rootOf(id)) || null;
  }

  // Deletes the conversation: the chat and its branches (forks first).
  async remove(session) {
    const ids = this.tree.descendants(session.id);
    const branches = ids.length > 1 ? ` and its ${ids.length - 1} other branch(es)` : "";
    if (!confirm(`Delete the chat “${session.title || "Untitled chat"}”${branches}? This cannot be undone.`)) return;
    const at = [...this.list.children].findIndex((item) => item.dataset.id === session.id);
    try {
      for (const id of ids.reverse()) {
        await api.deleteSession(id);
        this.onDeleted(id);
      }
    } catch (err) {
      this.onError(err);
    }
    await this.refresh();
    this.keepFocus(at);
  }

  // After the list was rebuilt under the focus (its ✕ is gone): the focus goes to the chat now at `index` (the
  // one after the deleted), else the last, else New chat, rather than back to the top of the page.
  keepFocus(index) {
    if (document.activeElement !== document.body) return; // (it moved somewhere on its own)
    const links = this.list.querySelectorAll(".session-link");
    (links[Math.min(index, links.length - 1)] || document.getElementById("new-chat")).focus();
  }
}
