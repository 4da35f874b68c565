// pagedchat's browser UI: a sidebar of server-kept sessions, a conversation streamed token by token, and the
// settings a chat needs. The URL carries the open session (`/?s=ID`), so reload and back/forward work.
import { Alternatives } from "./alternatives.js";
import { api, ApiError, loadSettings, readChunks } from "./api.js";
import { renderInto } from "./markdown.js";
import { Reasoning } from "./reasoning.js";
import { Sidebar } from "./sidebar.js";
import { Settings } from "./settings.js";
import { ToolCalls } from "./tool_calls.js";
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
  el.systemView.hidden = !session.system;
  el.systemText.textContent = session.system || "";
  showSessionStats(session.stats);
  el.messages.replaceChildren(...messageNodes(session.messages));
  updateButtons();
  scrollToEnd(true);
  el.input.focus();
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
  if (state.session && state.session.id === id) navigate(null, { replace: true });
}

// ---- messages ---------------------------------------------------------------------------------------

const ROLE_LABELS = { user: "You said:", assistant: "The model said:", tool: "A tool returned:" };

// A stored conversation's elements: a tool-role message goes on the card of its call in the reply before it
// (or stands alone when that reply has no call with its id).
function messageNodes(messages) {
  const nodes = [];
  for (const m of messages) {
    const last = nodes[nodes.length - 1];
    if (m.role === "tool" && last && last.toolCalls && last.toolCalls.attachResult(m)) continue;
    nodes.push(messageElement(m.role, m.content, m));
  }
  return nodes;
}

function messageElement(role, text, stored = null) {
  const node = $("message-template").content.firstElementChild.cloneNode(true);
  node.classList.add(role);
  node.dataset.role = role;
  node.querySelector(".role-label").textContent = ROLE_LABELS[role] || `${role}:`;
  node.querySelector(".regenerate").addEventListener("click", regenerate);
  node.querySelector(".regenerate-alternatives").addEventListener("click", regenerateAlternatives);
  node.querySelector(".continue").addEventListener("click", continueReply);
  setText(node, text);
  if (stored && role === "assistant") showStoredReply(node, stored);
  return node;
}

function setText(node, text) {
  node.dataset.text = text ?? ""; // a reply of only tool calls has content null
  renderInto(node.querySelector(".content"), text ?? "");
}

function showStoredReply(node, message) {
  new Reasoning(node).showStored(message);
  node.toolCalls = new ToolCalls(node);
  node.toolCalls.showStored(message.tool_calls);
  showStoredStats(node, message);
}

function showStoredStats(node, message) {
  const usage = message.usage || {};
  const timing = message.timing || {};
  writeStats(node, {
    ttftMs: timing.ttft_s != null ? 1000 * timing.ttft_s : null,
    tokensPerS: timing.decode_tokens_per_s, promptTokens: usage.prompt_tokens,
    cachedTokens: usage.cached_tokens, completionTokens: usage.completion_tokens,
    stopped: message.finish_reason === "abort", cut: message.finish_reason === "length",
  });
  markCut(node, message.finish_reason === "length");
}

// A reply that ended at its token limit says so, and (as the last reply) offers Continue.
function markCut(node, cut) {
  node.dataset.cut = cut ? "true" : "";
}

function writeStats(node, s) {
  const parts = [];
  if (s.ttftMs != null) parts.push(`first token ${Math.round(s.ttftMs)} ms`);
  if (s.tokensPerS) parts.push(`${s.tokensPerS.toFixed(1)} tokens/s`);
  if (s.completionTokens != null) parts.push(`${s.completionTokens} tokens`);
  if (s.promptTokens != null) parts.push(`prompt ${s.promptTokens} tokens (${s.cachedTokens ?? 0} cached)`);
  if (s.stopped) parts.push("stopped");
  if (s.cut) parts.push("cut at the token limit");
  const stats = node.querySelector(".stats");
  stats.textContent = parts.join(" · ");
  if (s.promptTokens != null) stats.dataset.promptTokens = s.promptTokens;
  if (s.cachedTokens != null) stats.dataset.cachedTokens = s.cachedTokens;
}

function updateButtons() {
  const streaming = state.streaming !== null;
  el.send.hidden = streaming;
  el.stop.hidden = !streaming;
  el.input.setAttribute("aria-busy", String(streaming));
  const replies = el.messages.querySelectorAll(".message.assistant");
  replies.forEach((node, i) => {
    const hidden = streaming || i !== replies.length - 1 || !isLastNode(node);
    node.querySelector(".regenerate").hidden = hidden;
    node.querySelector(".regenerate-alternatives").hidden = hidden;
    node.querySelector(".continue").hidden = hidden || node.dataset.cut !== "true";
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
  const userNode = messageElement("user", text);
  el.messages.append(userNode);
  scrollToEnd(true);
  await streamTurn(session, { content: text }, { userNode, typed: text });
}

async function createSession() {
  const body = {};
  if (el.preset.value) body.preset = el.preset.value;
  else if (el.system.value.trim()) body.system = el.system.value.trim();
  try {
    const session = await api.createSession(body);
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
  const userNode = messageElement("user", text);
  el.messages.append(userNode);
  scrollToEnd(true);
  await streamTurn(state.session, { content: text }, { userNode });
}

function regenerate() {
  if (state.streaming || !state.session) return;
  const last = el.messages.lastElementChild;
  if (!last || last.dataset.role !== "assistant") return;
  hideError();
  last.remove();
  streamTurn(state.session, { regenerate: true }, { removed: last });
}

// Three alternatives to the last reply, streamed side by side below it (web/alternatives.js): shown, not saved.
async function regenerateAlternatives() {
  if (state.streaming || !state.session) return;
  hideError();
  const s = loadSettings();
  const turn = { controller: new AbortController() };
  const panel = new Alternatives({ temperature: Number(s.temperature), onClose: closeAlternatives,
    onRender: () => scrollToEnd() });
  state.streaming = turn;
  el.messages.append(panel.element);
  updateButtons();
  scrollToEnd(true);
  setStatus("The model is writing three alternatives…");
  try {
    await panel.stream(state.session.id, s, turn.controller.signal);
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
  const s = loadSettings();
  const controller = new AbortController();
  const turn = { controller, started: performance.now(), firstToken: null, text: "", usage: null,
    loadToken: state.loadToken };
  state.streaming = turn;
  updateButtons();
  setStatus("Waiting for the reply…");
  const request = {
    ...body, stream: true, stream_options: { include_usage: true },
    temperature: Number(s.temperature), max_tokens: Number(s.maxTokens),
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
  if (undo.userNode) undo.userNode.remove();
  if (undo.removed) el.messages.append(undo.removed);
}

async function readReply(response, turn, session) {
  const node = messageElement("assistant", "");
  turn.reasoning = new Reasoning(node);
  turn.toolCalls = node.toolCalls = new ToolCalls(node);
  const content = node.querySelector(".content");
  content.setAttribute("aria-live", "polite");
  content.setAttribute("aria-busy", "true"); // screen readers read the reply once, when it is complete
  node.classList.add("streaming");
  el.messages.append(node);
  scrollToEnd(true);
  let stopped = false;
  try {
    for await (const chunk of readChunks(response)) handleChunk(chunk, turn, node);
  } catch (err) {
    if (err.name === "AbortError") stopped = true;
    else showError(err instanceof ApiError ? err : new ApiError(0, `The reply broke off: ${err.message}`));
  }
  finishReply(node, turn, stopped || turn.controller.signal.aborted);
  await afterTurn(session);
}

function handleChunk(chunk, turn, node) {
  if (chunk.error) throw new ApiError(0, `The reply broke off: ${chunk.error.message || "server error"}`);
  if (chunk.usage) turn.usage = chunk.usage;
  if (chunk.choices && chunk.choices[0] && chunk.choices[0].finish_reason) {
    turn.finishReason = chunk.choices[0].finish_reason;
  }
  const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
  const calls = delta && delta.tool_calls && delta.tool_calls.length ? delta.tool_calls : null;
  if (!delta || !(delta.content || delta.reasoning_content || calls)) return;
  if (turn.firstToken === null) {
    turn.firstToken = performance.now(); // the first token of any kind: thinking, answer or tool call
    setStatus(delta.reasoning_content ? "The model is thinking…" : "The model is replying…");
  }
  if (delta.reasoning_content) turn.reasoning.append(delta.reasoning_content);
  if ((delta.content || calls) && turn.reasoning.end()) setStatus("The model is replying…");
  if (delta.content) turn.text += delta.content;
  if (calls) turn.toolCalls.apply(calls);
  scheduleRender(node, turn);
}

// Re-renders the whole reply at most once a frame: markdown (a code fence, a table) only makes sense whole.
function scheduleRender(node, turn) {
  if (turn.frame) return;
  turn.frame = requestAnimationFrame(() => {
    turn.frame = null;
    turn.reasoning.render();
    setText(node, turn.text);
    scrollToEnd();
  });
}

function finishReply(node, turn, stopped) {
  if (turn.frame) cancelAnimationFrame(turn.frame);
  turn.reasoning.end();
  turn.toolCalls.finish();
  setText(node, turn.text);
  const content = node.querySelector(".content");
  content.setAttribute("aria-busy", "false");
  node.classList.remove("streaming");
  const end = performance.now();
  const usage = turn.usage || {};
  const completion = usage.completion_tokens;
  const decodeS = turn.firstToken !== null ? (end - turn.firstToken) / 1000 : 0;
  writeStats(node, {
    ttftMs: turn.firstToken !== null ? turn.firstToken - turn.started : null,
    tokensPerS: completion > 1 && decodeS > 0 ? (completion - 1) / decodeS : null,
    promptTokens: usage.prompt_tokens, completionTokens: completion,
    cachedTokens: usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : undefined,
    stopped, cut: !stopped && turn.finishReason === "length",
  });
  markCut(node, !stopped && turn.finishReason === "length");
  state.streaming = null;
  updateButtons();
  setStatus(stopped ? "Reply stopped." : "Reply complete.");
  scrollToEnd();
}

// After a turn: the sidebar's order and the header's totals changed; a chat without a title gets one from
// its first message.
async function afterTurn(session) {
  try {
    let fresh = await api.getSession(session.id);
    if (!fresh.title && fresh.messages.length) {
      fresh = await api.renameSession(session.id, titleFrom(fresh.messages[0].content));
    }
    if (state.session && state.session.id === fresh.id) {
      state.session = fresh;
      setTitle(fresh);
      showSessionStats(fresh.stats);
    }
    await sidebar.refresh(state.session ? state.session.id : null);
  } catch (err) {
    showError(err);
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

function describeError(err) {
  const detail = err.message || String(err);
  switch (err.status) {
    case 401: return `Not authorised (401): ${detail}`;
    case 409: return `This chat is still answering another message (409). Wait for it, then send again.`;
    case 429: return `The server is busy (429)${err.retryAfter ? `; try again in ${err.retryAfter} s` : ""}: ${detail}`;
    case 503: return `The server cannot answer right now (503: the engine or the session store is down): ${detail}`;
    case 0: return detail;
    default: return `Error ${err.status || ""}: ${detail}`;
  }
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
    await Promise.all([loadPresets(), sidebar.refresh(state.session ? state.session.id : sessionIdFromUrl())]);
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
    } else if (e.key === "Escape" && state.streaming) stopStreaming();
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
