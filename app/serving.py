"""Serving: the services the route handlers use, built once at start-up by ``build_serving`` and kept on
``app.state.server``. Each service holds only what it needs:

* ``admission`` (app/admission.py): the gate of every generating request (model name, engine health, queue
  limits, tenants, the prefix-cache salt), handing it to the engine as a TimedStream;
* ``replies`` (app/replies.py): renders chats, makes SamplingParams, writes chat replies and logprob texts;
* ``sessions`` (app/sessions/service.py): the session store, its outbox and the session limits, for the session
  and preset routes; ``session_chat`` is their chat-in-a-session, which the stateless chat route hands a request
  with a session id to without importing the session routes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from app.admission import Admission
from app.background import BackgroundTasks
from app.chat_format.formats import detect_chat_format
from app.front import Front
from app.generation_config import model_sampling_defaults
from app.key_quota import KeyQuota
from app.metrics import ServerMetrics
from app.prompts import PromptRenderer
from app.replies import ReplyWriter
from app.sessions.outbox import TurnOutbox
from app.sessions.service import SessionChat, SessionLimits, SessionService
from app.sessions.store import SessionStore
from app.settings import ServerSettings
from engine.engine_client import EngineClient


@dataclass(frozen=True, slots=True, eq=False)
class Serving:
    engine: EngineClient
    metrics: ServerMetrics
    admission: Admission
    replies: ReplyWriter
    sessions: SessionService
    session_chat: SessionChat
    background: BackgroundTasks
    max_request_bytes: int  # request bodies above it get 413
    started: int  # unix time the server came up (the model card's "created")

    @property
    def model_name(self) -> str:
        return self.admission.model_name

    @property
    def served_names(self) -> tuple[str, ...]:
        return self.admission.served_names

    @property
    def max_model_len(self) -> int:
        return self.replies.max_model_len

    @property
    def prompts(self) -> PromptRenderer:
        return self.replies.prompts


def build_serving(
    settings: ServerSettings,
    engine: EngineClient,
    front: Front,
    served_names: tuple[str, ...],
    store: SessionStore,
    session_chat: SessionChat,
) -> Serving:
    """Every service, once: this front's share of the queue limits, the model's sampling defaults (with
    ``--generation-config auto``), the store's outbox."""
    metrics = ServerMetrics(served_names[0], engine.stats, multiprocess=front.shared)
    prompts = PromptRenderer(engine.tokenizer)
    background = BackgroundTasks()
    admission = Admission(
        engine,
        metrics,
        served_names,
        max_queue=front.queue_share(settings.max_queue),
        max_queue_per_tenant=front.queue_share(settings.tenant_queue),
        tenant_salt_from_api_key=settings.tenant_salt_from_api_key,
        quota=KeyQuota(
            front.queue_share(settings.max_tokens_per_minute_per_key),
            front.queue_share(settings.max_concurrent_requests_per_key),
            on_refused=metrics.observe_quota_refusal,
        ),
    )
    defaults = (
        model_sampling_defaults(engine.info.model_path)
        if settings.generation_config == "auto"
        else {}
    )
    tokenizer = engine.tokenizer
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    replies = ReplyWriter(
        prompts,
        served_names[0],
        engine.info.max_model_len,
        settings.default_max_tokens,
        defaults,
        settings.max_request_tokens,
        detect_chat_format(template, tokenizer, settings.tool_call_format)
        if tokenizer is not None
        else None,
        template if isinstance(template, str) else None,
    )
    sessions = SessionService(
        store,
        TurnOutbox(store, background.spawn),
        admission,
        replies,
        prompts,
        engine,
        SessionLimits.of(settings),
        background,
    )
    return Serving(
        engine,
        metrics,
        admission,
        replies,
        sessions,
        session_chat,
        background,
        settings.max_request_bytes,
        int(time.time()),
    )
