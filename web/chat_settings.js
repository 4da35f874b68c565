// Per-chat settings: the chat's model (when the server serves several names: a picker), its system prompt (kept
// by the server: PATCH /v1/sessions/{id}) and its sampling (temperature, top-p, max tokens per reply: kept in this
// browser, per chat, over the defaults of the ⚙ settings).
import { api, loadSettings } from "./api.js";

const KEY = "pagedchat.chat-settings";
const MAX_CHATS = 500; // the oldest chats' settings are forgotten past this many

function loadAll() {
  try {
    const all = JSON.parse(localStorage.getItem(KEY) || "{}");
    return all && typeof all === "object" ? all : {};
  } catch {
    return {};
  }
}

function saveAll(all) {
  const ids = Object.keys(all);
  if (ids.length > MAX_CHATS) {
    ids.sort((a, b) => (all[a].at || 0) - (all[b].at || 0));
    for (const id of ids.slice(0, ids.length - MAX_CHATS)) delete all[id];
  }
  localStorage.setItem(KEY, JSON.stringify(all));
}

// The chat's own settings ({model, temperature, topP, maxTokens}, each optional).
export const chatOverrides = (id) => (id && loadAll()[id]) || {};

export function setChatOverrides(id, overrides) {
  const all = loadAll();
  if (Object.keys(overrides).length) all[id] = { ...overrides, at: Date.now() };
  else delete all[id];
  saveAll(all);
}

// A branch starts with its parent's settings.
export function copyChatOverrides(from, to) {
  const { at, ...overrides } = chatOverrides(from);
  if (Object.keys(overrides).length) setChatOverrides(to, overrides);
}

export const forgetChat = (id) => setChatOverrides(id, {});

// The sampling fields of a request for chat `id`: the ⚙ defaults, then the chat's own.
export function samplingFor(id) {
  const defaults = loadSettings();
  const own = chatOverrides(id);
  const body = {
    temperature: Number(own.temperature ?? defaults.temperature),
    max_tokens: Number(own.maxTokens ?? defaults.maxTokens),
  };
  if (own.topP != null && Number(own.topP) < 1) body.top_p = Number(own.topP);
  if (own.model) body.model = own.model;
  return body;
}

// The served model names: the draft's picker (a new chat's model) and the dialog's, shown only when there are
// several.
export class ModelPicker {
  constructor() {
    this.names = [];
    this.draftRow = document.getElementById("model-row");
    this.draft = document.getElementById("model-select");
  }

  setModels(names) {
    this.names = names;
    const keep = this.draft.value;
    fill(this.draft, names);
    if (names.includes(keep)) this.draft.value = keep;
    this.draftRow.hidden = names.length < 2;
  }

  // The model picked for a new chat (null: the server's primary name).
  picked() {
    return this.names.length > 1 && this.draft.value !== this.names[0] ? this.draft.value : null;
  }
}

function fill(select, names) {
  select.replaceChildren(...names.map((name) => new Option(name, name)));
}

// The dialog (the ⋯ menu's "Chat settings…"): onSaved(session) after a change of system prompt was stored.
export class ChatSettings {
  constructor({ getSession, picker, onSaved }) {
    this.getSession = getSession;
    this.picker = picker;
    this.onSaved = onSaved;
    const $ = (id) => document.getElementById(id);
    this.dialog = $("chat-settings");
    this.form = $("chat-settings-form");
    this.f = {
      modelRow: $("chat-model-row"), model: $("chat-model"), system: $("chat-system"),
      temperature: $("chat-temperature"), temperatureValue: $("chat-temperature-value"),
      topP: $("chat-top-p"), topPValue: $("chat-top-p-value"), maxTokens: $("chat-max-tokens"),
      error: $("chat-settings-error"),
    };
    this.f.temperature.addEventListener("input", () => this.showValues());
    this.f.topP.addEventListener("input", () => this.showValues());
    $("chat-settings-cancel").addEventListener("click", () => this.dialog.close());
    $("chat-settings-reset").addEventListener("click", () => this.fillSampling({}));
    this.form.addEventListener("submit", (e) => this.save(e));
  }

  open() {
    const session = this.getSession();
    if (!session) return;
    const own = chatOverrides(session.id);
    fill(this.f.model, this.picker.names);
    this.f.modelRow.hidden = this.picker.names.length < 2;
    this.f.model.value = own.model && this.picker.names.includes(own.model) ? own.model : this.picker.names[0] || "";
    this.f.system.value = session.system || "";
    this.fillSampling(own);
    this.showError("");
    if (!this.dialog.open) this.dialog.showModal();
    this.f.system.focus();
  }

  // The sampling fields from `own` (the chat's settings) over the ⚙ defaults.
  fillSampling(own) {
    const defaults = loadSettings();
    this.f.temperature.value = own.temperature ?? defaults.temperature;
    this.f.topP.value = own.topP ?? 1;
    this.f.maxTokens.value = own.maxTokens ?? defaults.maxTokens;
    this.f.maxTokens.max = document.getElementById("max-tokens").max || "";
    this.showValues();
  }

  showValues() {
    this.f.temperatureValue.textContent = Number(this.f.temperature.value).toFixed(2);
    this.f.topPValue.textContent = Number(this.f.topP.value).toFixed(2);
  }

  showError(text) {
    this.f.error.textContent = text;
    this.f.error.hidden = !text;
  }

  async save(event) {
    event.preventDefault();
    const session = this.getSession();
    if (!session || !this.form.reportValidity()) return;
    const system = this.f.system.value.trim();
    if (system !== (session.system || "")) {
      try {
        this.onSaved(await api.updateSession(session.id, { system: system || null }));
      } catch (err) {
        return this.showError(err.message || String(err));
      }
    }
    const defaults = loadSettings();
    const own = {
      temperature: Number(this.f.temperature.value),
      topP: Number(this.f.topP.value),
      maxTokens: Math.max(1, Math.round(Number(this.f.maxTokens.value))),
    };
    if (!this.f.modelRow.hidden && this.f.model.value !== this.picker.names[0]) own.model = this.f.model.value;
    const same = own.temperature === Number(defaults.temperature) && own.topP === 1 && !own.model
      && own.maxTokens === Number(defaults.maxTokens);
    setChatOverrides(session.id, same ? {} : own); // (the defaults as they are: follow later changes of them)
    this.dialog.close();
  }
}
