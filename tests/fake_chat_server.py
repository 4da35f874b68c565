"""A stand-in for pagedchat's HTTP API, for the browser UI's tests that need no model: it serves web/ and the
few routes the UI calls, keeps sessions in a dict, and answers a turn (POST /v1/sessions/{id}/messages) with a
scripted SSE stream of chat.completion chunks. A script may hold a threading.Event where the stream is to wait,
so a test can look at the page mid-stream without timing guesses, and a number where it is to pause that many
seconds (a stream paced like a model's)."""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WEB_DIR = Path(__file__).resolve().parents[1] / "web"
# the longest a scripted stream waits at an Event the test never set (the test then fails on what it sees)
PAUSE_TIMEOUT_S = 30.0

Chunk = dict[str, Any] | threading.Event | float


@dataclass
class FakeChat:
    """What the fake server knows: its sessions, the next turn's script, and the turns asked of it."""

    sessions: dict[str, dict[str, Any]] = field(default_factory=dict)
    script: list[Chunk] = field(default_factory=list)
    reply_to_store: dict[str, Any] = field(default_factory=dict)
    turns: list[dict[str, Any]] = field(default_factory=list)
    models: list[str] = field(
        default_factory=lambda: ["fake"]
    )  # the served names, the primary first
    patches: list[dict[str, Any]] = field(default_factory=list)  # PATCH /v1/sessions/{id} bodies
    refuse_patch: tuple[int, str] | None = None  # (status, message) to answer the next PATCHes with

    def add_session(self, session_id: str, messages: list[dict[str, Any]], title: str = "") -> None:
        now = time.time()
        self.sessions[session_id] = {
            "id": session_id,
            "title": title,
            "system": None,
            "messages": messages,
            "stats": {"num_turns": 0},
            "created_at": now,
            "updated_at": now,
        }


def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    """One chat.completion.chunk of choice 0."""
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    return {"object": "chat.completion.chunk", "model": "fake", "choices": [choice]}


def usage_chunk(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    return {"object": "chat.completion.chunk", "model": "fake", "choices": [], "usage": usage}


class _Handler(http.server.SimpleHTTPRequestHandler):
    fake: FakeChat

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        if path == "/health":
            return self._json({"status": "ok", "sessions": "memory"})
        if path == "/v1/models":
            cards = [{"id": name, "object": "model"} for name in self.fake.models]
            return self._json({"object": "list", "data": cards})
        if path == "/v1/presets":
            return self._json({"object": "list", "data": []})
        if path == "/v1/sessions":
            return self._json({"object": "list", "data": list(self.fake.sessions.values())})
        if path.startswith("/v1/sessions/"):
            return self._with_session(path, lambda session: self._json(session))
        super().do_GET()

    def do_POST(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        body = self._body()
        if path == "/v1/sessions":
            session_id = f"fake{len(self.fake.sessions):018d}"
            self.fake.add_session(session_id, [])
            return self._json(self.fake.sessions[session_id])
        if path.startswith("/v1/sessions/") and path.endswith("/fork"):
            return self._with_session(path[: -len("/fork")], lambda s: self._fork(s, body))
        if path.startswith("/v1/sessions/") and path.endswith("/messages"):
            return self._with_session(path[: -len("/messages")], lambda s: self._turn(s, body))
        self._json({"error": {"message": f"no route {path}"}}, status=404)

    def do_PATCH(self) -> None:
        body = self._body()
        path = urllib.parse.urlsplit(self.path).path
        self.fake.patches.append(body)
        if self.fake.refuse_patch:
            status, message = self.fake.refuse_patch
            return self._json({"error": {"message": message, "param": "system"}}, status=status)

        def update(session: dict[str, Any]) -> None:
            session.update({k: v for k, v in body.items() if k in ("title", "pinned", "system")})
            self._json(session)

        self._with_session(path, update)

    def _turn(self, session: dict[str, Any], body: dict[str, Any]) -> None:
        self.fake.turns.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        for item in self.fake.script:
            if isinstance(item, threading.Event):
                item.wait(PAUSE_TIMEOUT_S)
                continue
            if isinstance(item, float):
                time.sleep(item)
                continue
            self.wfile.write(f"data: {json.dumps(item)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        user = {"role": "user", "content": body.get("content", "")}
        session["messages"] += [user, self.fake.reply_to_store]

    def _fork(self, parent: dict[str, Any], body: dict[str, Any]) -> None:
        """A new session with the parent's first ``turn`` turns (a turn: a user message and a reply)."""
        session_id = f"fake{len(self.fake.sessions):018d}"
        self.fake.add_session(session_id, parent["messages"][: 2 * body["turn"]], parent["title"])
        fork = self.fake.sessions[session_id]
        fork.update(system=parent["system"], parent_id=parent["id"], forked_at_turn=body["turn"])
        self._json(fork, status=201)

    def _with_session(self, path: str, answer: Any) -> None:
        session = self.fake.sessions.get(path.rsplit("/", 1)[-1])
        if session is None:
            return self._json({"error": {"message": "no such session"}}, status=404)
        answer(session)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"{}")

    def _json(self, body: Any, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextlib.contextmanager
def fake_chat_server(fake: FakeChat) -> Iterator[str]:
    """Serve web/ and the fake API on a free local port; yields the base URL."""
    handler = type("FakeHandler", (_Handler,), {"fake": fake})
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(WEB_DIR))
    )
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
