// Warming a chat's KV cache: when the message box gets focus in a chat that has a session, the server is asked
// (POST /v1/sessions/{id}/warm) to start bringing the session's cached blocks back to the device from its lower
// tiers (host memory, disk, Redis) while the user types, so the next turn's first token comes sooner. Fire and
// forget: at most once per WARM_EVERY_MS per session, and a failure is no concern of the user's.
import { api } from "./api.js";

const WARM_EVERY_MS = 30_000;

export function warmOnFocus(input, currentSessionId) {
  const lastWarm = new Map(); // session id -> performance.now() of its last warm
  input.addEventListener("focus", () => {
    const id = currentSessionId();
    if (!id) return;
    const now = performance.now();
    if (lastWarm.has(id) && now - lastWarm.get(id) < WARM_EVERY_MS) return;
    lastWarm.set(id, now);
    api.warmSession(id).catch(() => {});
  });
}
