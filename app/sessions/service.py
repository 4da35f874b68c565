"""SessionService: what the session and preset routes need, built once at start-up: the store and the outbox of
turns waiting for it, the admission gate and reply writer the stateless routes use too, the prompt renderer, the
engine client (for preset pins and the model's end-of-sequence ids) and the session limits. The routes
(app/sessions/api.py, turn_api.py, presets.py) and a turn's recorder (turns.py) are written against it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.admission import Admission
from app.background import BackgroundTasks
from app.prompts import PromptRenderer
from app.protocol.completions import ChatCompletionRequest
from app.replies import ReplyWriter
from app.sessions.outbox import TurnOutbox
from app.sessions.store import SessionStore
from app.settings import ServerSettings
from engine.engine_client import EngineClient


@dataclass(frozen=True, slots=True)
class SessionLimits:
    """The server options (app/settings.py) that bound sessions and presets."""

    max_request_bytes: int
    session_lock_s: float
    session_write_timeout_s: float
    max_sessions_per_key: int
    max_session_bytes: int
    max_system_prompt_chars: int
    preset_pin_share: float
    preset_pin_share_per_key: float
    max_presets_per_key: int

    @classmethod
    def of(cls, settings: ServerSettings) -> SessionLimits:
        return cls(**{name: getattr(settings, name) for name in cls.__dataclass_fields__})


@dataclass(frozen=True, slots=True, eq=False)
class SessionService:
    store: SessionStore
    outbox: TurnOutbox  # turns waiting for the store to come back
    admission: Admission
    replies: ReplyWriter
    prompts: PromptRenderer
    engine: EngineClient
    limits: SessionLimits
    background: BackgroundTasks
    # sessions whose warm (POST /v1/sessions/{id}/warm: warm_api.py) runs now in this front
    warming: set[str] = field(default_factory=set)

    @property
    def max_model_len(self) -> int:
        return self.replies.max_model_len

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """A background task the server keeps referenced (and waits for at shutdown)."""
        return self.background.spawn(coro)


# a chat completion in a session (app/sessions/turn_api.py's chat_in_session): the stateless route hands it over
# through Serving without importing the session routes
SessionChat = Callable[
    [Request, SessionService, ChatCompletionRequest, str, float], Awaitable[Response]
]
