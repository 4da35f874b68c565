// Editing a sent message in place: its text becomes a textarea with Save and Cancel. Saving hands the new text
// to `onSave` (app.js forks the chat before that message and sends it there); Cancel (or Escape) puts the
// message back as it was.

export function openEditor(node, text, onSave) {
  if (node.querySelector(".message-editor")) return;
  const content = node.querySelector(".content");
  const form = document.createElement("form");
  form.className = "message-editor";
  const area = document.createElement("textarea");
  area.value = text;
  area.rows = Math.min(12, Math.max(2, text.split("\n").length));
  area.setAttribute("aria-label", "Edit your message");
  const save = document.createElement("button");
  save.type = "submit";
  save.className = "primary small-button";
  save.textContent = "Save and send";
  const cancel = document.createElement("button");
  cancel.type = "button";
  cancel.className = "small-button";
  cancel.textContent = "Cancel";
  const buttons = document.createElement("div");
  buttons.className = "editor-buttons";
  buttons.append(save, cancel);
  form.append(area, buttons);
  content.hidden = true;
  node.classList.add("editing");
  content.after(form);
  const close = () => {
    form.remove();
    content.hidden = false;
    node.classList.remove("editing");
    node.querySelector(".edit")?.focus();
  };
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const edited = area.value;
    if (!edited.trim()) return;
    form.remove();
    content.hidden = false;
    node.classList.remove("editing");
    onSave(edited);
  });
  cancel.addEventListener("click", close);
  area.addEventListener("keydown", (e) => {
    if (e.key === "Escape") {
      e.stopPropagation();
      close();
    } else if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      form.requestSubmit();
    }
  });
  area.focus();
  area.setSelectionRange(area.value.length, area.value.length);
}
