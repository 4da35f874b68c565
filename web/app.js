// pagedchat's browser UI: a sidebar of server-kept sessions, a conversation streamed token by token, and the
// settings a chat needs. The URL carries the open session (`/?s=ID`), so reload and back/forward work.
import { Alternatives } from "./alternatives.js";
import { api, ApiError, describeError, readChunks } from "./api.js";
import { BranchTree, noteOpened, showSwitchers } from "./branches.js";
import { ChatMenu } from "./chat_menu.js";
import { ChatSettings, copyChatOverrides, forgetChat, ModelPicker, samplingFor, setChatOverrides } from "./chat_settings.js";
import { openEditor } from "./edit.js";
import { preloadMath } from "./math.js";
import { MessageView } from "./message_view.js";
import { ReplyStream } from "./reply_stream.js";
import { Search } from "./search.js";
import { Sidebar } from "./sidebar.js";
import { Settings } from "./settings.js";
import { bindShortcuts } from "./shortcuts.js";
import { warmOnFocus } from "./warm.js";

const $ = (id) => document.getElementById(id);
const el = {
  messages: $("messages"), input: $("composer-input"), composer: $("composer"), send: $("send"),
  stop: $("stop"), title: $("chat-title"), sessionStats: $("session-stats"), draft: $("draft-options"),
  preset: $("preset-select"), system: $("system-input"), systemView: $("system-view"),
  systemText: $("system-text"), error: $("error"), errorText: $("error-text"), status: $("status"),
};

const state = { session: null, streaming: null, loadToken: 0 };
const settings = new Settings({ onSaved: afterSettingsSaved });
const sidebar = new Sidebar({ onSelect: (id) => navigate(id), onDeleted: onSessionDeleted, onError: showError });
const search = new Search({
  onSelect: (id) => {
    if (sidebar.isOpen()) sidebar.setOpen(false); // the phone's drawer
    navigate(id);
  },
  onError: showError,
});
const picker = new ModelPicker();
const chatSettings = new ChatSettings({
  getSession: () => state.session,
  picker,
  onSaved: (session) => {
    if (!state.session || state.session.id !== session.id) return;
    state.session.system = session.system;
    showSystem(session);
  },
});
new ChatMenu({ // the header's ⋯ menu
  getSession: () => state.session,
  onSettings: () => chatSettings.open(),
  sidebar,
  onChanged: () => sidebar.refresh(), // (a rename reaches the header through the "session-renamed" event)
  onImported: (session) => sidebar.refresh(session.id).then(() => navigate(session.id)),
  onError: showError,
});

// ---- navigation -------------------------------------------------------------------------------------

const sessionIdFromUrl = () => new URLSearchParams(location.search).get("s");

function navigate(id, { replace = false } = {}) {
  const url = id ? `?s=${encodeURIComponent(id)}` : location.pathname;
  if (id !== sessionIdFromUrl()) history[replace ? "replaceState" : "pushState"]({ s: id }, "", url);
  return openSession(id);
}

async function openSession(id) {
  stopStreaming();
  hideError();
  const token = ++state.loadToken; // a slower earlier load must not overwrite a later one
  sidebar.setCurrent(id);
  if (!id) return showDraft();
  try {
    const session = await api.getSession(id);
    if (token === state.loadToken) showSession(session);
  } catch (err) {
    if (token !== state.loadToken) return;
    showDraft();
    if (err.status === 404) {
      history.replaceState({ s: null }, "", location.pathname);
      showError(new ApiError(404, "That chat no longer exists."));
    } else showError(err);
  }
}

function showDraft() {
  state.session = null;
  el.title.textContent = "New chat";
  document.title = "pagedchat";
  el.sessionStats.textContent = "";
  el.draft.hidden = false;
  el.systemView.hidden = true;
  el.messages.replaceChildren();
  updateButtons();
  el.input.focus();
}

function showSession(session) {
  state.session = session;
  el.draft.hidden = true;
  setTitle(session);
  showSystem(session);
  showSessionStats(session.stats);
  el.messages.replaceChildren(...messages.nodes(session.messages));
  noteOpened(session.id);
  showBranches();
  updateButtons();
  scrollToEnd(true);
  el.input.focus();
}

function showSystem(session) {
  el.systemView.hidden = !session.system;
  el.systemText.textContent = session.system || "";
}

// The `< 2/3 >` controls at the turns where this chat's branches differ (from the sidebar's list of sessions).
// An API chat is not in the sidebar's list unless "Show API chats" is on: its branches are looked up apart.
async function showBranches() {
  if (!state.session) return;
  const id = state.session.id;
  let tree = sidebar.tree;
  if (!tree.byId.has(id)) {
    if (!sidebar.loaded) return; // (it calls again once the list is in)
    const all = await api.listSessions().catch(() => null);
    if (!all || !state.session || state.session.id !== id) return;
    tree = new BranchTree(all.data);
  }
  showSwitchers(el.messages, id, tree, (to) => navigate(to));
}

function setTitle(session) {
  el.title.textContent = session.title || "Untitled chat";
  document.title = `${session.title || "Untitled chat"} · pagedchat`;
}

function showSessionStats(stats) {
  if (!stats || !stats.num_turns) return void (el.sessionStats.textContent = "");
  const cached = stats.prompt_tokens ? Math.round((100 * stats.cached_tokens) / stats.prompt_tokens) : 0;
  el.sessionStats.textContent = `${stats.num_turns} turns · ${stats.num_tokens} tokens · ${cached}% of prompts cached`;
}

function onSessionDeleted(id) {
  forgetChat(id);
  if (state.session && state.session.id === id) navigate(null, { replace: true });
}

// ---- messages ---------------------------------------------------------------------------------------

const messages = new MessageView({ regenerate, regenerateAlternatives, continueReply, editMessage });

function updateButtons() {
  const streaming = state.streaming !== null;
  el.send.hidden = streaming;
  el.stop.hidden = !streaming;
  el.input.setAttribute("aria-busy", String(streaming));
  const replies = el.messages.querySelectorAll(".message.assistant");
  replies.forEach((node, i) => {
    const hidden = streaming || i !== replies.length - 1 || !isLastNode(node);
    node.querySelector(".regenerate").hidden = streaming || !state.session; // any reply: a new branch
    node.querySelector(".regenerate-alternatives").hidden = hidden;
    node.querySelector(".continue").hidden = hidden || node.dataset.cut !== "true";
    node.querySelector(".copy-reply").hidden = node.classList.contains("streaming");
  });
  el.messages.querySelectorAll(".message.user").forEach((node) => {
    node.querySelector(".edit").hidden = streaming || !state.session;
  });
}

const isLastNode = (node) => node === el.messages.lastElementChild;

function scrollToEnd(force = false) {
  const box = el.messages;
  const nearEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 120;
  if (force || nearEnd) box.scrollTop = box.scrollHeight;
}

// ---- sending and streaming --------------------------------------------------------------------------

async function sendMessage() {
  const text = el.input.value;
  if (!text.trim() || state.streaming) return;
  hideError();
  closeAlternatives();
  let session = state.session;
  if (!session) {
    session = await createSession();
    if (!session) return;
  }
  const userNode = messages.element("user", text);
  el.messages.append(userNode);
  scrollToEnd(true);
  await streamTurn(session, { content: text }, { userNode, typed: text });
}

async function createSession() {
  const body = { source: "ui" };
  if (el.preset.value) body.preset = el.preset.value;
  else if (el.system.value.trim()) body.system = el.system.value.trim();
  try {
    const session = await api.createSession(body);
    if (picker.picked()) setChatOverrides(session.id, { model: picker.picked() });
    history.pushState({ s: session.id }, "", `?s=${encodeURIComponent(session.id)}`);
    state.loadToken++;
    showSession(session);
    el.system.value = "";
    el.preset.value = "";
    sidebar.refresh(session.id);
    return session;
  } catch (err) {
    showError(err);
    return null;
  }
}

// Continue: a new turn asking the model to go on from where its reply was cut (shown as the user's message).
async function continueReply() {
  if (state.streaming || !state.session) return;
  hideError();
  const text = "Continue.";
  const userNode = messages.element("user", text);
  el.messages.append(userNode);
  scrollToEnd(true);
  await streamTurn(state.session, { content: text }, { userNode });
}

// The number of turns before `node`'s turn (a turn: a user message and the replies after it).
const turnOf = (node) => {
  let turn = 0;
  for (let n = node.previousElementSibling; n; n = n.previousElementSibling) turn += n.dataset.role === "user";
  return node.dataset.role === "user" ? turn : turn - 1;
};

// Regenerate (any reply): a new branch forked before the reply's turn, its user message sent again there.
function regenerate(e) {
  const node = e.target.closest(".message");
  const turn = turnOf(node);
  const users = el.messages.querySelectorAll(".message.user");
  if (turn >= 0 && users[turn]) branchAt(turn, users[turn].dataset.text);
}

// Edit (a user message): the edited text sent on a new branch forked before it.
function editMessage(node) {
  if (state.streaming || !state.session) return;
  openEditor(node, node.dataset.text, (text) => branchAt(turnOf(node), text));
}

// Forks the open chat keeping its first `turn` turns (they share the cached prefix) and sends `text` there;
// the old branch stays, a `< 1/2 >` control at that turn switches between them.
async function branchAt(turn, text) {
  if (state.streaming || !state.session) return;
  hideError();
  closeAlternatives();
  const parentId = state.session.id;
  let fork;
  try {
    fork = await api.forkSession(parentId, turn);
  } catch (err) {
    return showError(err);
  }
  copyChatOverrides(parentId, fork.id);
  history.pushState({ s: fork.id }, "", `?s=${encodeURIComponent(fork.id)}`);
  state.loadToken++;
  showSession(fork);
  const userNode = messages.element("user", text);
  el.messages.append(userNode);
  scrollToEnd(true);
  const abandon = () => api.deleteSession(fork.id).catch(() => {}).then(() => navigate(parentId, { replace: true }));
  await streamTurn(fork, { content: text }, { userNode, abandon });
}

// Three alternatives to the last reply, streamed side by side below it (web/alternatives.js): shown, not saved.
async function regenerateAlternatives() {
  if (state.streaming || !state.session) return;
  hideError();
  const sampling = samplingFor(state.session.id);
  const turn = { controller: new AbortController() };
  const panel = new Alternatives({ temperature: sampling.temperature, onClose: closeAlternatives,
    onRender: () => scrollToEnd() });
  state.streaming = turn;
  el.messages.append(panel.element);
  updateButtons();
  scrollToEnd(true);
  setStatus("The model is writing three alternatives…");
  try {
    await panel.stream(state.session.id, sampling, turn.controller.signal);
  } catch (err) {
    if (err.name !== "AbortError") showError(err instanceof ApiError ? err : new ApiError(0, err.message));
    if (!panel.answered) panel.element.remove(); // refused (or stopped) before the server answered
  }
  panel.finish();
  if (state.streaming === turn) state.streaming = null;
  updateButtons();
  setStatus(turn.controller.signal.aborted ? "Alternatives stopped." : "Alternatives complete.");
}

function closeAlternatives() {
  el.messages.querySelectorAll(".alternatives").forEach((panel) => panel.remove());
  updateButtons();
}

// Streams one turn into a new reply element; `undo` says what to put back if the server refuses the turn.
async function streamTurn(session, body, undo) {
  const controller = new AbortController();
  const turn = { controller, started: performance.now(), loadToken: state.loadToken };
  state.streaming = turn;
  updateButtons();
  setStatus("Waiting for the reply…");
  const request = {
    ...body, stream: true, stream_options: { include_usage: true }, ...samplingFor(session.id),
  };
  let response;
  try {
    response = await postTurn(session.id, request, controller.signal);
  } catch (err) {
    state.streaming = null;
    setStatus("");
    // stopped before the server answered: it may or may not have taken the turn, so show what it has
    if (err.name === "AbortError") {
      if (state.loadToken === turn.loadToken) openSession(session.id); // (else the user went elsewhere)
      return;
    }
    restoreAfterRefusal(undo);
    updateButtons();
    showError(err);
    return;
  }
  if (undo.typed !== undefined && el.input.value === undo.typed) el.input.value = "";
  await readReply(response, turn, session);
}

// A 409 right after a reply ended or was stopped means the server is still saving that turn: retry briefly.
async function postTurn(id, request, signal) {
  for (let attempt = 0; ; attempt++) {
    try {
      return await api.postMessage(id, request, signal);
    } catch (err) {
      if (err.status !== 409 || attempt >= 4) throw err;
      await new Promise((resolve) => setTimeout(resolve, 200 * 2 ** attempt));
      if (signal.aborted) throw new DOMException("stopped", "AbortError");
    }
  }
}

function restoreAfterRefusal(undo) {
  if (undo.abandon) undo.abandon(); // a branch whose first turn was refused is not kept
  if (undo.userNode) undo.userNode.remove();
  if (undo.removed) el.messages.append(undo.removed);
}

async function readReply(response, turn, session) {
  const node = messages.element("assistant", "");
  const reply = new ReplyStream(node, { started: turn.started, onStatus: setStatus, onRender: () => scrollToEnd() });
  el.messages.append(node);
  scrollToEnd(true);
  let stopped = false;
  try {
    for await (const chunk of readChunks(response)) reply.handle(chunk);
  } catch (err) {
    if (err.name === "AbortError") stopped = true;
    else showError(err instanceof ApiError ? err : new ApiError(0, `The reply broke off: ${err.message}`));
  }
  stopped ||= turn.controller.signal.aborted;
  reply.finish(stopped);
  state.streaming = null;
  updateButtons();
  setStatus(stopped ? "Reply stopped." : "Reply complete.");
  scrollToEnd();
  await afterTurn(session);
}

// After a turn: the sidebar's order and the header's totals changed; a chat without a title gets one from
// its first message.
async function afterTurn(session) {
  const replies = el.messages.querySelectorAll(".message.assistant").length;
  try {
    let fresh = await api.getSession(session.id);
    if ((fresh.stats.num_turns || 0) < replies) waitForStoredTurn(session, replies);
    if (!fresh.title && fresh.messages.length) {
      fresh = await api.renameSession(session.id, titleFrom(fresh.messages[0].content));
    }
    if (state.session && state.session.id === fresh.id) {
      state.session = fresh;
      setTitle(fresh);
      showSessionStats(fresh.stats);
    }
    await sidebar.refresh(state.session ? state.session.id : null);
    showBranches();
  } catch (err) {
    showError(err);
  }
}

// A stopped reply is stored a moment after its stream ends (once the engine has let go of it): asks again
// until the server has it, then does what afterTurn does (the header's totals, the title).
async function waitForStoredTurn(session, replies) {
  for (let attempt = 0; attempt < 30; attempt++) {
    await new Promise((resolve) => setTimeout(resolve, Math.min(100 * 2 ** attempt, 1000)));
    if (!state.session || state.session.id !== session.id || state.streaming) return;
    const fresh = await api.getSession(session.id).catch(() => null);
    if (fresh && fresh.stats.num_turns >= replies) return afterTurn(session);
  }
}

const titleFrom = (text) => {
  const line = (text || "").trim().split("\n")[0];
  return line.length > 48 ? `${line.slice(0, 47)}…` : line;
};

function stopStreaming() {
  if (state.streaming) state.streaming.controller.abort();
}

// ---- errors and status ------------------------------------------------------------------------------

function showError(err) {
  el.errorText.textContent = describeError(err);
  el.error.hidden = false;
  if (err.status === 401) settings.open("This server needs an API key. Enter it below.");
}

function hideError() {
  el.error.hidden = true;
}

function setStatus(text) {
  el.status.textContent = text;
}

// ---- start-up ---------------------------------------------------------------------------------------

async function showWhereChatsLive() {
  try {
    const health = await api.health();
    document.getElementById("sessions-volatile").hidden = health.sessions !== "memory";
  } catch {
    // no answer: the other calls report the server's state
  }
}

async function refreshModelInfo() {
  showWhereChatsLive();
  try {
    const models = await api.model();
    settings.setModel(models.data[0]);
    picker.setModels(models.data.map((m) => m.id));
    await Promise.all([loadPresets(), sidebar.refresh(state.session ? state.session.id : sessionIdFromUrl())]);
    showBranches();
  } catch (err) {
    showError(err);
  }
}

function afterSettingsSaved() {
  hideError();
  refreshModelInfo();
  const id = sessionIdFromUrl();
  if (id && !state.session) openSession(id); // it may have failed for want of the API key
}

async function loadPresets() {
  const presets = (await api.presets()).data;
  const keep = el.preset.value;
  el.preset.replaceChildren(new Option("(none)", ""), ...presets.map((p) => new Option(p.name, p.name)));
  el.preset.value = presets.some((p) => p.name === keep) ? keep : "";
  el.preset.closest("section").classList.toggle("no-presets", presets.length === 0);
}

function bindEvents() {
  el.composer.addEventListener("submit", (e) => {
    e.preventDefault();
    sendMessage();
  });
  el.input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      sendMessage();
    }
  });
  bindShortcuts({
    focusSearch: () => {
      if (getComputedStyle($("sidebar")).visibility === "hidden") sidebar.setOpen(true); // the phone's drawer
      search.focus();
    },
    newChat: () => navigate(null),
    stop: stopStreaming,
    isStreaming: () => state.streaming !== null,
    focusInput: () => el.input.focus(),
  });
  el.stop.addEventListener("click", () => {
    stopStreaming();
    el.input.focus();
  });
  $("new-chat").addEventListener("click", () => navigate(null));
  $("error-close").addEventListener("click", hideError);
  $("open-settings").addEventListener("click", () => settings.open());
  window.addEventListener("popstate", () => openSession(sessionIdFromUrl()));
  document.addEventListener("session-renamed", (e) => {
    if (!state.session || state.session.id !== e.detail.id) return;
    state.session.title = e.detail.title;
    setTitle(state.session);
  });
}

bindEvents();
warmOnFocus(el.input, () => (state.session ? state.session.id : null));
openSession(sessionIdFromUrl());
refreshModelInfo();
(window.requestIdleCallback || setTimeout)(preloadMath);
