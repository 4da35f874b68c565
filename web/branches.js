// Branches of a conversation, derived from the server's fork links: a session forked from `parent_id` at
// `forked_at_turn` N shows its parent's first N turns and its own from turn N on. The sessions that differ at
// a turn (an edited message, a regenerated reply) are that turn's variants, switched with a `< 2/3 >` control.
// Which branch of a conversation was opened last is kept in this browser (localStorage), so the sidebar's one
// entry per conversation opens it again.

const OPENED_KEY = "pagedchat.opened";

function loadOpened() {
  try {
    return JSON.parse(localStorage.getItem(OPENED_KEY) || "{}");
  } catch {
    return {};
  }
}

// Notes that session `id` was opened now (the branch a conversation reopens at).
export function noteOpened(id) {
  const opened = loadOpened();
  opened[id] = Date.now();
  const ids = Object.keys(opened);
  if (ids.length > 500) ids.sort((a, b) => opened[a] - opened[b]).slice(0, 100).forEach((k) => delete opened[k]);
  localStorage.setItem(OPENED_KEY, JSON.stringify(opened));
}

export class BranchTree {
  // `sessions`: the list's summaries (id, parent_id, forked_at_turn, created_at, updated_at).
  constructor(sessions) {
    this.byId = new Map(sessions.map((s) => [s.id, s]));
    this.children = new Map();
    for (const s of sessions) {
      if (!this.parentOf(s)) continue;
      if (!this.children.has(s.parent_id)) this.children.set(s.parent_id, []);
      this.children.get(s.parent_id).push(s);
    }
  }

  parentOf(s) {
    return s && s.parent_id ? this.byId.get(s.parent_id) || null : null;
  }

  rootOf(id) {
    let s = this.byId.get(id);
    while (this.parentOf(s)) s = this.parentOf(s);
    return s ? s.id : id;
  }

  isRoot(s) {
    return !this.parentOf(s);
  }

  // The session in `id`'s line where its turn `t` was written.
  ownerOf(id, t) {
    let s = this.byId.get(id);
    while (s && this.parentOf(s) && (s.forked_at_turn ?? 0) > t) s = this.parentOf(s);
    return s || null;
  }

  // The sessions whose turn `t` differs while their earlier turns are those of `id`, oldest first (one when
  // the turn was never edited or regenerated).
  variantsAt(id, t) {
    let first = this.ownerOf(id, t);
    if (!first) return [];
    while (this.parentOf(first) && first.forked_at_turn === t) first = this.ownerOf(first.parent_id, t);
    const variants = [first];
    const walk = (s) => {
      for (const child of this.children.get(s.id) || []) {
        if (child.forked_at_turn !== t) continue;
        variants.push(child);
        walk(child);
      }
    };
    walk(first);
    return variants.sort((a, b) => a.created_at - b.created_at);
  }

  // The session to open for variant `id` of turn `t` (t = -1: anywhere in the conversation): the one opened
  // last in this browser among those that keep its turn t, else the last updated.
  latestUnder(id, t = -1) {
    const start = this.byId.get(id);
    if (!start) return id;
    const candidates = [start];
    const walk = (s) => {
      for (const child of this.children.get(s.id) || []) {
        if ((child.forked_at_turn ?? 0) <= t) continue;
        candidates.push(child);
        walk(child);
      }
    };
    walk(start);
    const opened = loadOpened();
    const score = (s) => [opened[s.id] || 0, s.updated_at || 0];
    candidates.sort((a, b) => {
      const [oa, ua] = score(a);
      const [ob, ub] = score(b);
      return ob - oa || ub - ua;
    });
    return candidates[0].id;
  }

  // `id` and every session forked from it, directly or not (parents before their forks).
  descendants(id) {
    const out = [];
    const walk = (s) => {
      out.push(s.id);
      (this.children.get(s.id) || []).forEach(walk);
    };
    const start = this.byId.get(id);
    if (start) walk(start);
    return out.length ? out : [id];
  }

  // The latest update anywhere in the conversation rooted at `rootId` (the sidebar's order).
  lastUpdate(rootId) {
    let latest = 0;
    const walk = (s) => {
      latest = Math.max(latest, s.updated_at || 0);
      (this.children.get(s.id) || []).forEach(walk);
    };
    const root = this.byId.get(rootId);
    if (root) walk(root);
    return latest;
  }
}

// The switch pressed last ({id: the session it opens, turn, label}): once that session shows, the same switch
// takes the focus back, so a keyboard user stays where they were (opening a chat focuses the message box).
let refocus = null;

// Puts a `< i/n >` control on each user message whose turn has variants; `onSwitch(id)` opens one.
export function showSwitchers(messagesEl, sessionId, tree, onSwitch) {
  messagesEl.querySelectorAll(".branch-switch").forEach((node) => node.remove());
  const users = messagesEl.querySelectorAll(".message.user");
  users.forEach((node, t) => {
    const variants = tree.variantsAt(sessionId, t);
    if (variants.length < 2) return;
    const owner = tree.ownerOf(sessionId, t);
    const index = variants.findIndex((v) => v.id === owner.id);
    node.querySelector(".message-footer").prepend(switcher(index, variants, t, tree, onSwitch));
  });
  if (refocus && refocus.id === sessionId) focusSwitch(messagesEl, refocus);
}

// Focuses the pressed switch's button at its turn (the other one when it is now at an end, so disabled), after
// the app has finished showing the chat.
function focusSwitch(messagesEl, { turn, label }) {
  refocus = null;
  const box = messagesEl.querySelectorAll(".message.user")[turn]?.querySelector(".branch-switch");
  if (!box) return;
  const buttons = [...box.querySelectorAll("button:not(:disabled)")];
  const target = buttons.find((b) => b.getAttribute("aria-label") === label) || buttons[0];
  if (target) queueMicrotask(() => target.focus());
}

function switcher(index, variants, t, tree, onSwitch) {
  const box = document.createElement("span");
  box.className = "branch-switch small";
  box.setAttribute("role", "group");
  box.setAttribute("aria-label", `Versions of this message: ${index + 1} of ${variants.length}`);
  const button = (label, text, to) => {
    const b = document.createElement("button");
    b.type = "button";
    b.className = "icon branch-step";
    b.textContent = text;
    b.setAttribute("aria-label", label);
    b.disabled = to < 0 || to >= variants.length;
    b.addEventListener("click", () => {
      const id = tree.latestUnder(variants[to].id, t);
      refocus = { id, turn: t, label };
      onSwitch(id);
    });
    return b;
  };
  const position = document.createElement("span");
  position.className = "branch-position";
  position.textContent = `${index + 1}/${variants.length}`;
  box.append(button("Previous version", "‹", index - 1), position, button("Next version", "›", index + 1));
  return box;
}
