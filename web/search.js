// Search over the chats (GET /v1/sessions?q=: titles and message contents, server side): typing waits a
// moment before asking, the results (title and the matching snippet) replace the chat list while the box is
// not empty, Enter opens the first one, Escape clears the box. How many chats matched is said in the page's
// status region (a screen reader announces it without moving the focus from the box).
import { api } from "./api.js";

const DEBOUNCE_MS = 250;

export class Search {
  constructor({ onSelect, onError }) {
    this.input = document.getElementById("chat-search");
    this.results = document.getElementById("search-results");
    this.sessionList = document.getElementById("session-list");
    this.status = document.getElementById("status");
    this.onSelect = onSelect;
    this.onError = onError;
    this.timer = null;
    this.asked = 0; // a slower earlier answer must not replace a later one
    this.input.addEventListener("input", () => {
      clearTimeout(this.timer);
      this.timer = setTimeout(() => this.run(), DEBOUNCE_MS);
    });
    this.input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") {
        e.preventDefault();
        clearTimeout(this.timer);
        this.run().then(() => this.results.querySelector("a")?.click());
      } else if (e.key === "Escape" && this.input.value) {
        e.stopPropagation();
        this.clear();
      }
    });
  }

  focus() {
    this.input.focus();
    this.input.select();
  }

  clear() {
    this.input.value = "";
    this.show(null);
  }

  async run() {
    const q = this.input.value.trim();
    const asked = ++this.asked;
    if (!q) return this.show(null);
    try {
      const found = (await api.listSessions({ q, limit: 50 })).data;
      if (asked === this.asked) this.show(found);
    } catch (err) {
      this.onError(err);
    }
  }

  // Results in place of the chat list, or the chat list back (null).
  show(found) {
    this.sessionList.hidden = found !== null;
    this.results.hidden = found === null;
    if (found === null) return this.results.replaceChildren();
    this.status.textContent = countOf(found.length);
    if (!found.length) {
      const none = document.createElement("li");
      none.className = "muted small search-none";
      none.textContent = "No chat matches.";
      return this.results.replaceChildren(none);
    }
    this.results.replaceChildren(...found.map((s) => this.item(s)));
  }

  item(session) {
    const li = document.createElement("li");
    li.className = "search-result";
    li.dataset.id = session.id;
    const link = document.createElement("a");
    link.href = `?s=${encodeURIComponent(session.id)}`;
    const title = document.createElement("span");
    title.className = "session-title";
    title.textContent = session.title || "Untitled chat";
    const snippet = document.createElement("span");
    snippet.className = "snippet muted small";
    snippet.textContent = session.snippet || "";
    link.append(title, snippet);
    link.addEventListener("click", (e) => {
      if (e.ctrlKey || e.metaKey || e.shiftKey || e.button !== 0) return;
      e.preventDefault();
      this.onSelect(session.id);
    });
    li.append(link);
    return li;
  }
}

const countOf = (n) => (n ? `${n} chat${n === 1 ? "" : "s"} found.` : "No chat matches.");
