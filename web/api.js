// The server's HTTP API (docs/API.md) as the UI uses it: JSON requests, errors in OpenAI's shape, and the
// SSE streams of POST /v1/sessions/{id}/messages and /v1/chat/completions read through fetch (EventSource
// cannot POST).

const SETTINGS_KEY = "pagedchat.settings";
const DEFAULT_SETTINGS = { temperature: 0.7, maxTokens: 512, apiKey: "" };

export function loadSettings() {
  try {
    return { ...DEFAULT_SETTINGS, ...JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") };
  } catch {
    return { ...DEFAULT_SETTINGS };
  }
}

export function saveSettings(settings) {
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
}

export class ApiError extends Error {
  constructor(status, message, retryAfter = null) {
    super(message);
    this.status = status;
    this.retryAfter = retryAfter;
  }
}

function headers(sessionId, json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  // a load balancer routes a session's requests to the replica whose prefix cache holds it
  if (sessionId) h["X-Session-ID"] = sessionId;
  const key = loadSettings().apiKey;
  if (key) h["Authorization"] = `Bearer ${key}`;
  return h;
}

async function send(method, path, { body, sessionId, signal } = {}) {
  let response;
  try {
    response = await fetch(path, {
      method,
      headers: headers(sessionId, body !== undefined),
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
    });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, "Cannot reach the server. Is it running?");
  }
  if (!response.ok) throw await errorFrom(response);
  return response;
}

// What an ApiError says to the person at the screen.
export function describeError(err) {
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

async function errorFrom(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch {
    // not JSON (a proxy's page): the status line says enough
  }
  return new ApiError(response.status, message, response.headers.get("Retry-After"));
}

async function json(method, path, options) {
  return (await send(method, path, options)).json();
}

const sessionPath = (id) => `/v1/sessions/${encodeURIComponent(id)}`;

export const api = {
  model: () => json("GET", "/v1/models"),
  // 200 or 503, JSON either way: {status, sessions: "redis" | "sqlite" | "memory" | "unavailable"}
  health: async () => (await fetch("/health", { headers: { Accept: "application/json" } })).json(),
  presets: () => json("GET", "/v1/presets"),
  // {source: "ui"} lists only the chats the UI created; {q} searches titles and contents (each with a snippet)
  listSessions: ({ limit = 1000, source = null, q = null } = {}) => {
    const query = new URLSearchParams({ limit: String(limit) });
    if (source) query.set("source", source);
    if (q) query.set("q", q);
    return json("GET", `/v1/sessions?${query}`);
  },
  createSession: (body) => json("POST", "/v1/sessions", { body }),
  getSession: (id) => json("GET", sessionPath(id), { sessionId: id }),
  renameSession: (id, title) => json("PATCH", sessionPath(id), { body: { title }, sessionId: id }),
  updateSession: (id, patch) => json("PATCH", sessionPath(id), { body: patch, sessionId: id }),
  // A new session with the first `turn` turns of `id` (sharing their cached prefix): {id, parent_id, ...}.
  forkSession: (id, turn) => json("POST", `${sessionPath(id)}/fork`, { body: { turn }, sessionId: id }),
  // The chat as a file: {blob, filename} (format "json" or "markdown").
  exportSession: async (id, format) => {
    const response = await send("GET", `${sessionPath(id)}/export?format=${format}`, { sessionId: id });
    const disposition = response.headers.get("Content-Disposition") || "";
    const match = disposition.match(/filename="?([^";]+)"?/);
    return { blob: await response.blob(), filename: match ? match[1] : `chat-${id}.${format === "json" ? "json" : "md"}` };
  },
  importSession: (exported) => json("POST", "/v1/sessions/import", { body: exported }),
  deleteSession: (id) => json("DELETE", sessionPath(id), { sessionId: id }),
  // Resolves once the server accepted the turn (headers received); the body is read by readChunks.
  postMessage: (id, body, signal) =>
    send("POST", `${sessionPath(id)}/messages`, { body, sessionId: id, signal }),
  // Starts bringing the session's cached KV blocks back to the device: {id, object: "session.warm", blocks}.
  warmSession: (id) => json("POST", `${sessionPath(id)}/warm`, { sessionId: id }),
  // Stateless: no X-Session-ID, which would make the request a turn of that session.
  chatCompletions: (body, signal) => send("POST", "/v1/chat/completions", { body, signal }),
};

// Yields each `data:` payload of an SSE response parsed as JSON, until `[DONE]`. Events are separated by a
// blank line; an event's data lines are joined with "\n" (the SSE spec); comments (":") and other fields
// are ignored.
export async function* readChunks(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      // CRLF may be split across reads: normalise the joined text (a trailing "\r" waits for its "\n")
      buffer = (buffer + value).replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const data = eventData(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
        if (data === null) continue;
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

function eventData(event) {
  const lines = event.split("\n").filter((line) => line.startsWith("data:"));
  if (lines.length === 0) return null;
  return lines.map((line) => line.slice(line.startsWith("data: ") ? 6 : 5)).join("\n");
}
