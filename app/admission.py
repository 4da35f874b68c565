"""Admission: the one gate of every request that generates, built once at start-up. It answers 404 for a name
the model is not served as, 503 while the engine is down, 429 when the queue (or the tenant's part of it) is full or
the key's quota is spent (app/key_quota.py) and 400 for a request the engine refuses; it says whose request it is
(tenant, scheduling tenant, admin) and which prefix-cache salt it gets; and it hands the request to the engine, as a
TimedStream that records its latencies."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from starlette.requests import Request

from app.errors import APIError, EngineUnavailable
from app.key_quota import KeyQuota, KeyTicket
from app.metrics import ServerMetrics
from app.request_body import ClientDisconnected
from app.request_budget import request_tokens
from app.timed_stream import TimedStream
from engine.async_engine import EngineDeadError
from engine.engine_client import EngineClient
from engine.sampling_params import SamplingParams

_RETRY_AFTER_S = "1"


@dataclass(frozen=True, slots=True, eq=False)
class Admission:
    engine: EngineClient
    metrics: ServerMetrics
    served_names: tuple[str, ...]  # the model's names in the API, the primary first
    max_queue: int  # this front's share of --max-queue (requests waiting for their first token)
    max_queue_per_tenant: int  # this front's share of --max-queue-per-tenant
    tenant_salt_from_api_key: bool = False  # each API key's prefix blocks its own
    # this front's share of --max-tokens-per-minute-per-key and --max-concurrent-requests-per-key
    quota: KeyQuota = field(default_factory=KeyQuota)

    @property
    def model_name(self) -> str:
        """The primary name: an answer's ``model`` when the request gave none, the metrics' label."""
        return self.served_names[0]

    def check_model(self, requested: str | None) -> str:
        """The name the answer carries (the requested one, or the primary); 404 for a name not served here."""
        if requested is None:
            return self.model_name
        if requested not in self.served_names:
            served = ", ".join(map(repr, self.served_names))
            raise APIError(
                404,
                f"model: {requested!r} is not served here (this server serves {served})",
                param="model",
                code="model_not_found",
            )
        return requested

    @staticmethod
    def tenant(request: Request) -> str:
        """Who sent the request: a hash of its API key, or "" when the server has no keys (app/security.py)."""
        return request.scope.get("state", {}).get("tenant", "")

    @staticmethod
    def scheduling_tenant(request: Request | None) -> str:
        """Whose share of the engine a request takes: its API key's tenant, or without keys its client's address
        (behind a proxy of --forwarded-allow-ips, the address it forwards); "" for the server's own."""
        if request is None:
            return ""
        tenant = request.scope.get("state", {}).get("tenant", "")
        if tenant:
            return tenant
        client = request.scope.get("client")
        return f"addr:{client[0]}" if client else ""

    @staticmethod
    def is_admin(request: Request) -> bool:
        """The admin key (or a server without keys): may manage shared presets."""
        return bool(request.scope.get("state", {}).get("admin", False))

    def cache_salt(self, request: Request, requested: str | None) -> str | None:
        """The salt that keys a request's prefix blocks: with ``tenant_salt_from_api_key`` each API key is
        its own tenant, whose blocks no other key's requests can hit (a per-request salt narrows further)."""
        tenant = self.tenant(request) if self.tenant_salt_from_api_key else ""
        if not tenant:
            return requested
        return f"{tenant}/{requested}" if requested is not None else tenant

    def reserve(
        self, request: Request | None, prompt_lengths: list[int], params: list[SamplingParams]
    ) -> KeyTicket | None:
        """Take, from the request's key, the most tokens its prompts can take (app/request_budget.py) and a
        place among its requests in flight, or raise the 429 (400 when it could never fit) that says why not;
        None when the quotas are off or the request is the server's own. A request of several prompts
        reserves once for all of them and passes the ticket to each ``submit``."""
        if request is None:
            return None
        return self.quota.admit(self.tenant(request), request_tokens(prompt_lengths, params))

    async def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
        arrival: float,
        request: Request | None = None,
        priority: int = 0,
        retain: bool = False,
        ticket: KeyTicket | None = None,
    ) -> TimedStream:
        """Hand the request to the engine now, or raise the APIError that says why not. A response_format's
        schema is compiled first, off the event loop (once per request, whatever its n). With the HTTP
        ``request``, the engine shares its steps fairly between the request's tenant and others
        (``scheduling_tenant``), the key's quotas are charged (``reserve``, unless ``ticket`` is the request's
        reservation already) and given back when the stream ends, and the stream's numbers go to its access-log
        line (app/access_log.py). ``retain``: a session's turn, whose blocks the engine keeps ahead of one-off
        requests' (and on its lower KV tiers) for the next turn."""
        try:
            if not self.engine.healthy:
                raise EngineUnavailable()
            tenant = self.scheduling_tenant(request)
            self._check_queue(tenant)
            if ticket is None:
                ticket = self.reserve(request, [len(prompt_ids)], [params])
            timed = await self._hand_over(
                prompt_ids, params, cache_salt, arrival, request, priority, retain, tenant
            )
        except BaseException:
            if ticket is not None and ticket.idle:
                ticket.close()
            raise
        if ticket is not None:
            ticket.hold(timed)
        return timed

    async def _hand_over(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
        arrival: float,
        request: Request | None,
        priority: int,
        retain: bool,
        tenant: str,
    ) -> TimedStream:
        spec = params.structured_output
        if spec is not None and spec.grammar is None:
            try:
                compiled = await self.engine.compile_structured_output(spec)
                params = dataclasses.replace(params, structured_output=compiled)
            except ValueError as exc:
                if spec.kind == "lark":  # (the grammar of a request's tools)
                    exc = ValueError(str(exc).replace("response_format:", "tools:", 1))
                raise APIError.from_value_error(exc) from None
            except EngineDeadError as exc:
                raise EngineUnavailable(f"the engine is not running: {exc}") from None
        # (a connect-and-drop storm costs no engine work)
        if request is not None and await request.is_disconnected():
            raise ClientDisconnected()
        # (again, with no await before the submission: the compile above took time)
        self._check_queue(tenant)
        try:
            stream = self.engine.generate(
                prompt_ids,
                params,
                cache_salt=cache_salt,
                tenant=tenant,
                priority=priority,
                retain=retain,
            )
        except EngineDeadError as exc:
            raise EngineUnavailable(f"the engine is not running: {exc}") from None
        except ValueError as exc:
            raise APIError.from_value_error(exc) from None
        timed = TimedStream(stream, self.metrics, arrival, params.num_samples, len(prompt_ids))
        if request is not None:
            request.scope.setdefault("state", {}).setdefault("generations", []).append(timed)
        return timed

    def _check_queue(self, tenant: str) -> None:
        """429 when the queue (requests waiting for their first token) is full, or this tenant's part of it."""
        queued = self.engine.num_queued
        if queued >= self.max_queue:
            raise APIError(
                429,
                f"the server is busy: {queued} requests are waiting; retry shortly",
                code="queue_full",
                headers={"Retry-After": _RETRY_AFTER_S},
            )
        if self.engine.num_queued_for(tenant) >= self.max_queue_per_tenant:
            raise APIError(
                429,
                f"too many of your requests are waiting ({self.max_queue_per_tenant}); retry once "
                "some have started",
                code="tenant_queue_full",
                headers={"Retry-After": _RETRY_AFTER_S},
            )
