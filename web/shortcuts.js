// Keyboard shortcuts: Ctrl/Cmd+K search, Ctrl/Cmd+Shift+O new chat, Escape stops a streaming reply, `/`
// focuses the message box (when not typing somewhere else).

const isTyping = (target) =>
  target instanceof HTMLElement &&
  (target.isContentEditable || ["INPUT", "TEXTAREA", "SELECT"].includes(target.tagName));

export function bindShortcuts({ focusSearch, newChat, stop, isStreaming, focusInput }) {
  document.addEventListener("keydown", (e) => {
    if (e.defaultPrevented || e.isComposing || e.altKey) return;
    const mod = e.ctrlKey || e.metaKey;
    const key = e.key.toLowerCase();
    if (mod && !e.shiftKey && key === "k") {
      e.preventDefault();
      focusSearch();
    } else if (mod && e.shiftKey && key === "o") {
      e.preventDefault();
      newChat();
    } else if (e.key === "Escape" && isStreaming()) {
      stop();
    } else if (e.key === "/" && !mod && !isTyping(e.target) && !document.querySelector("dialog[open]")) {
      e.preventDefault();
      focusInput();
    }
  });
}
