// The settings dialog: temperature, max tokens and the API key, kept in localStorage.
import { loadSettings, saveSettings } from "./api.js";

export class Settings {
  constructor({ onSaved }) {
    this.dialog = document.getElementById("settings");
    this.form = document.getElementById("settings-form");
    this.temperature = document.getElementById("temperature");
    this.temperatureValue = document.getElementById("temperature-value");
    this.maxTokens = document.getElementById("max-tokens");
    this.apiKey = document.getElementById("api-key");
    this.note = document.getElementById("settings-note");
    this.modelInfo = document.getElementById("model-info");
    this.onSaved = onSaved;
    this.temperature.addEventListener("input", () => this.showTemperature());
    document.getElementById("settings-cancel").addEventListener("click", () => this.dialog.close());
    this.form.addEventListener("submit", (e) => this.save(e));
  }

  open(note = "") {
    const s = loadSettings();
    this.temperature.value = s.temperature;
    this.maxTokens.value = s.maxTokens;
    this.apiKey.value = s.apiKey;
    this.showTemperature();
    this.note.textContent = note;
    this.note.hidden = !note;
    // the note is about the key: read out with it when the key's field takes the focus
    if (note) this.apiKey.setAttribute("aria-describedby", this.note.id);
    else this.apiKey.removeAttribute("aria-describedby");
    if (!this.dialog.open) this.dialog.showModal();
    (note ? this.apiKey : this.temperature).focus();
  }

  showTemperature() {
    this.temperatureValue.textContent = Number(this.temperature.value).toFixed(2);
  }

  save(event) {
    event.preventDefault();
    if (!this.form.reportValidity()) return;
    saveSettings({
      temperature: Number(this.temperature.value),
      maxTokens: Math.max(1, Math.round(Number(this.maxTokens.value))),
      apiKey: this.apiKey.value.trim(),
    });
    this.dialog.close();
    this.onSaved();
  }

  // The served model: its name, and the longest reply it allows.
  setModel(model) {
    if (!model) return;
    this.modelInfo.textContent = `Model: ${model.id}` + (model.max_model_len ? ` (context ${model.max_model_len} tokens)` : "");
    if (model.max_model_len) this.maxTokens.max = model.max_model_len;
  }
}
