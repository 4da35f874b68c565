// The open chat's menu (⋯ in the header): its settings, rename, pin, export as Markdown or JSON (a download), import a
// chat exported before (a file picker; the server makes it a new chat) and delete.
//
// It follows the ARIA menu-button pattern: opening it focuses its first item; ArrowDown and ArrowUp move among
// the items (wrapping), Home and End go to the first and last; Escape closes it and puts the focus back on the
// button; Tab closes it and moves on from the button. ArrowDown/ArrowUp on the button open it at the first/last.
import { api, ApiError } from "./api.js";

export class ChatMenu {
  // getSession() -> the open session or null; sidebar: the conversation's root (pinned), its rename and delete;
  // onChanged() after a rename or pin; onImported(session); onSettings() opens the chat's settings.
  constructor({ getSession, sidebar, onChanged, onImported, onError, onSettings }) {
    this.getSession = getSession;
    this.sidebar = sidebar;
    this.onChanged = onChanged;
    this.onImported = onImported;
    this.onError = onError;
    this.button = document.getElementById("chat-menu-button");
    this.panel = document.getElementById("chat-menu");
    this.file = document.getElementById("import-file");
    this.button.addEventListener("click", () => this.setOpen(this.panel.hidden));
    this.button.addEventListener("keydown", (e) => {
      if (e.key !== "ArrowDown" && e.key !== "ArrowUp") return;
      e.preventDefault();
      this.setOpen(true);
      if (e.key === "ArrowUp") this.focusItem(-1);
    });
    this.panel.addEventListener("keydown", (e) => this.onKey(e));
    document.addEventListener("click", (e) => {
      if (!this.panel.hidden && !this.panel.contains(e.target) && !this.button.contains(e.target)) {
        this.setOpen(false);
      }
    });
    const actions = {
      "menu-chat-settings": () => onSettings(),
      "menu-rename": () => this.rename(),
      "menu-pin": () => this.togglePin(),
      "menu-export-markdown": () => this.download("markdown"),
      "menu-export-json": () => this.download("json"),
      "menu-import": () => this.file.click(),
      "menu-delete": () => this.sidebar.remove(this.root()),
    };
    for (const [id, action] of Object.entries(actions)) {
      document.getElementById(id).addEventListener("click", () => {
        this.setOpen(false, true);
        action();
      });
    }
    this.file.addEventListener("change", () => this.importFile());
  }

  setOpen(open, returnFocus = false) {
    const session = this.getSession();
    for (const id of ["menu-chat-settings", "menu-rename", "menu-pin", "menu-export-markdown", "menu-export-json", "menu-delete"]) {
      document.getElementById(id).disabled = !session;
    }
    document.getElementById("menu-pin").textContent = session && this.root().pinned ? "Unpin" : "Pin";
    this.panel.hidden = !open;
    this.button.setAttribute("aria-expanded", String(open));
    if (open) this.focusItem(0);
    else if (returnFocus) this.button.focus();
  }

  // The items that take the focus (a disabled one is skipped).
  items() {
    return [...this.panel.querySelectorAll('[role="menuitem"]:not(:disabled)')];
  }

  // Focuses item `index` of items(), counted from the end when negative and wrapping past either end.
  focusItem(index) {
    const items = this.items();
    if (items.length) items[((index % items.length) + items.length) % items.length].focus();
  }

  onKey(e) {
    const at = this.items().indexOf(document.activeElement);
    const moves = { ArrowDown: at + 1, ArrowUp: at - 1, Home: 0, End: -1 };
    if (e.key in moves) {
      e.preventDefault();
      this.focusItem(moves[e.key]);
    } else if (e.key === "Escape") {
      e.stopPropagation();
      this.setOpen(false, true);
    } else if (e.key === "Tab") {
      this.setOpen(false, true); // (not prevented: the Tab moves on from the button)
    }
  }

  // The open chat's conversation as the sidebar lists it (the chat itself until the list has it).
  root() {
    return this.sidebar.rootSummary(this.getSession().id) || this.getSession();
  }

  async rename() {
    const session = this.getSession();
    const title = prompt("New title for this chat", session.title || "");
    if (title === null || !title.trim() || title.trim() === session.title) return;
    await this.act(() => this.sidebar.renameConversation(session.id, title.trim()));
  }

  // Pins (or unpins) the conversation: its root, which the sidebar lists.
  async togglePin() {
    const root = this.root();
    await this.act(() => api.updateSession(root.id, { pinned: !root.pinned }));
  }

  async act(change) {
    try {
      await change();
      this.onChanged();
    } catch (err) {
      this.onError(err);
    }
  }

  async download(format) {
    const session = this.getSession();
    try {
      const { blob, filename } = await api.exportSession(session.id, format);
      const link = document.createElement("a");
      link.href = URL.createObjectURL(blob);
      link.download = filename;
      document.body.append(link);
      link.click();
      link.remove();
      setTimeout(() => URL.revokeObjectURL(link.href), 10_000);
    } catch (err) {
      this.onError(err);
    }
  }

  async importFile() {
    const [file] = this.file.files;
    this.file.value = "";
    if (!file) return;
    let exported;
    try {
      exported = JSON.parse(await file.text());
    } catch {
      return this.onError(new ApiError(0, `${file.name} is not a JSON export of a chat.`));
    }
    try {
      // imported here, it is one of the UI's chats (whoever made the exported one)
      this.onImported(await api.importSession({ ...exported, source: "ui" }));
    } catch (err) {
      this.onError(err);
    }
  }
}
