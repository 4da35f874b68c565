"""The engine core's process: a busy loop of drain inputs -> step -> push outputs, nothing else on its thread.

``launch_core`` starts it with the spawn method, for one front (the server's process, async_engine.py) or for
several (``--api-server-count``: front processes sharing one core). It loads the model, sizes the KV cache, says
``Ready`` (or ``StartFailed``) to every front and loops until told to stop. The core binds its sockets: one input
every front connects to, and one output per front, to which it sends the outputs of the requests that front
submitted. Its life is tied to its parent's (the front, or the process that runs the fronts): it dies with it
(PR_SET_PDEATHSIG on Linux, and a parent check whenever it is idle), ignores Ctrl-C and SIGTERM (the fronts drain,
then it is stopped), and a failed step is reported as ``CoreFailed`` to every front before it exits non-zero.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import zmq

from engine.config import EngineConfig
from engine.runtime.core_messages import (
    AbortRequest,
    AddFailed,
    AddRequest,
    CoreFailed,
    Ready,
    Shutdown,
    StartFailed,
    StepOutputs,
    UtilityCall,
    UtilityResult,
    encoder,
    to_core_decoder,
)
from engine.child_process import die_with_parent, name_process
from engine.log_format import configure_logging
from engine.output.outputs import SampleDelta

logger = logging.getLogger("engine.core")

_STATS_PERIOD_S = 0.05  # a stats snapshot rides on a step's outputs at most this often
# while idle (or waiting for a front to connect): how often the parent is looked for
_IDLE_POLL_MS = 500


@dataclass(frozen=True, slots=True)
class CoreEndpoint:
    """What one front needs to reach a running core: the core's input socket, its output socket for this front,
    this front's client number, and the core's process id (watched: its exit is the engine's death)."""

    inputs: str
    outputs: str
    client: int
    pid: int


@dataclass(slots=True, eq=False)
class LaunchedCore:
    """A core process started by ``launch_core``; ``close()`` after it has exited removes its socket directory."""

    process: multiprocessing.process.BaseProcess
    endpoints: list[CoreEndpoint]
    ipc_dir: str

    def close(self) -> None:
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def launch_core(
    config: EngineConfig,
    num_clients: int = 1,
    log_level: int | None = None,
    log_format: str = "text",
) -> LaunchedCore:
    """Start a core process for ``num_clients`` fronts (it loads the model meanwhile: a front learns the outcome
    from its first message, ``Ready`` or ``StartFailed``). The sockets live in a fresh 0700 directory, so only
    this user reaches them."""
    if num_clients < 1:
        raise ValueError(f"num_clients: must be >= 1, got {num_clients}")
    ipc_dir = tempfile.mkdtemp(prefix="pagedchat-")
    inputs = f"ipc://{ipc_dir}/inputs"
    outputs = [f"ipc://{ipc_dir}/outputs-{i}" for i in range(num_clients)]
    level = logging.getLogger().getEffectiveLevel() if log_level is None else log_level
    process = multiprocessing.get_context("spawn").Process(
        target=run_engine_core,
        name="pagedchat-engine-core",
        daemon=True,
        args=(config, inputs, outputs, level, log_format),
    )
    process.start()
    endpoints = [CoreEndpoint(inputs, address, i, process.pid) for i, address in enumerate(outputs)]
    return LaunchedCore(process, endpoints, ipc_dir)


def run_engine_core(
    config: EngineConfig,
    inputs_address: str,
    outputs_addresses: list[str],
    log_level: int,
    log_format: str = "text",
) -> None:
    """The process's entry point (picklable: spawn imports it by name)."""
    parent = os.getppid()
    die_with_parent()
    name_process("pagedchat-core")
    # Ctrl-C reaches the whole process group, and systemd's stop SIGTERMs every process of the unit: the fronts
    # drain their streams first, then stop the core (Shutdown, or the runner's SIGKILL), or it dies with its parent
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(logging.getLevelName(log_level), log_format, "engine core")
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.setsockopt(zmq.RCVHWM, 0)
    inputs.bind(inputs_address)
    outputs = []
    for address in outputs_addresses:
        socket = context.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.bind(address)
        outputs.append(socket)
    try:
        core = _start(config, outputs, parent)
        if core is not None:
            if os.environ.get("PAGEDCHAT_CORE_GC_FREEZE", "1") == "1":
                # what start-up made (the model, the block pool: a million long-lived objects on a big GPU) is
                # never garbage: out of the collector's sight, a full collection in the loop costs little
                gc.collect()
                gc.freeze()
            try:
                CoreLoop(core, inputs, outputs, parent, StepLog(config.log_stats_interval_s)).run()
            finally:
                core.shutdown()
    finally:
        for socket in outputs:
            # the last message (a failure) must leave before the process does
            socket.close(linger=2000)
        inputs.close(linger=0)
        context.term()


def _start(config: EngineConfig, outputs: list[zmq.Socket], parent_pid: int) -> Any | None:
    from engine.runtime.engine_core import EngineCore

    try:
        core = EngineCore(config, tokenizer_in_background=True)
    except ValueError as exc:
        _tell_every_front(outputs, StartFailed(str(exc), True), parent_pid)
        return None
    except Exception as exc:  # noqa: BLE001 - the fronts report it and exit
        logger.exception("the engine core failed to start")
        _tell_every_front(outputs, StartFailed(f"{type(exc).__name__}: {exc}", False), parent_pid)
        return None
    _tell_every_front(outputs, Ready(core.info, core.stats()), parent_pid)
    return core


def _tell_every_front(outputs: list[zmq.Socket], message: Any, parent_pid: int) -> None:
    """Wait until each front has connected (a bound PUSH socket holds nothing for a peer not there yet) and send
    it ``message``; exit if the parent is gone meanwhile."""
    frame = encoder.encode(message)
    for socket in outputs:
        while not socket.poll(_IDLE_POLL_MS, zmq.POLLOUT):
            if os.getppid() != parent_pid:
                raise SystemExit(0)
        socket.send(frame)


class CoreLoop:
    """Drain inputs -> step -> push outputs. With several fronts, each step's deltas are split by the front that
    submitted each request (one message per front and step); with one, they go out as they come."""

    def __init__(
        self,
        core: Any,
        inputs: zmq.Socket,
        outputs: list[zmq.Socket],
        parent_pid: int,
        step_log: StepLog | None = None,
    ) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = parent_pid
        self.step_log = step_log or StepLog(0)
        self._client_of: dict[str, int] = {}  # request id -> its front (several fronts only)
        self._stats_time = 0.0
        self._stats_due = False  # something changed since the last snapshot sent
        # idle polls since the start (the grammar library's warm-up waits for a few)
        self._idle_polls = 0

    def run(self) -> None:
        core = self.core
        try:
            while True:
                busy = core.has_unfinished_requests()
                if not busy and not self._wait_for_input():
                    self._idle_polls += 1
                    # llguidance's tokenizer holds the GIL for seconds as it is built: once idle after a
                    # request (the front's warm-up), or after 5 s of none, not while the core starts
                    if core.counters.steps or self._idle_polls >= 10:
                        core.grammars.warm_in_background()
                    continue
                if not self._drain():
                    return
                if core.has_unfinished_requests():
                    start = time.perf_counter()
                    deltas = core.step()
                    self.step_log.record(time.perf_counter() - start, core)
                    self._send_step(deltas)
                elif self._stats_due:
                    self._broadcast(StepOutputs([], self._snapshot()))
        except Exception as exc:  # noqa: BLE001 - the whole step failed: every stream must hear of it
            logger.exception("the engine core failed")
            self._broadcast(CoreFailed(f"{type(exc).__name__}: {exc}"))
            raise SystemExit(1) from exc

    def _wait_for_input(self) -> bool:
        """Idle: block until a message comes; exit if the parent is gone."""
        if self.inputs.poll(_IDLE_POLL_MS):
            return True
        workers = getattr(self.core, "workers", None)
        # (a rank died while the engine was idle)
        if workers is not None and workers.failure is not None:
            raise RuntimeError(f"tensor parallel: {workers.failure}")
        if os.getppid() != self.parent_pid:
            logger.warning("the front process is gone; the engine core exits")
            raise SystemExit(0)
        return False

    def _drain(self) -> bool:
        """Apply every queued message; False once told to stop."""
        while True:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            message = to_core_decoder.decode(frame.buffer)
            self._stats_due = True
            if isinstance(message, AddRequest):
                self._add(message)
            elif isinstance(message, AbortRequest):
                deltas = self.core.abort_request(message.request_id, message.index, message.reason)
                # (a sample the front ended itself needs no word back)
                if deltas and message.index is None:
                    self._send_deltas(deltas, None)
            elif isinstance(message, UtilityCall):
                self._call(message)
            elif isinstance(message, Shutdown):
                return False

    def _add(self, message: AddRequest) -> None:
        request_id, client = message.request_id, message.client
        try:
            self.core.add_request(
                request_id,
                message.prompt_token_ids,
                message.params,
                message.cache_salt,
                message.tenant,
                message.priority,
                message.retain,
            )
        except ValueError as exc:  # this request's fault only: tell its consumer, keep serving
            self._send(client, AddFailed(request_id, str(exc), True))
            return
        except Exception as exc:  # noqa: BLE001 - add_request registers nothing before it can fail
            logger.exception("request %s could not be added", request_id)
            self._send(client, AddFailed(request_id, f"{type(exc).__name__}: {exc}", False))
            return
        if len(self.outputs) > 1:
            self._client_of[request_id] = client

    def _call(self, message: UtilityCall) -> None:
        try:
            target, args = pickle.loads(message.payload)
            result = (
                getattr(self.core, target)(*args)
                if isinstance(target, str)
                else target(self.core, *args)
            )
            reply = UtilityResult(message.call_id, True, pickle.dumps(result))
        except Exception as exc:  # noqa: BLE001 - the caller's problem, raised in the caller
            reply = UtilityResult(message.call_id, False, _pickled_error(exc))
        self._send(message.client, reply)

    def _send_step(self, deltas: list[SampleDelta]) -> None:
        now = time.monotonic()
        stats = None
        if now - self._stats_time >= _STATS_PERIOD_S or not self.core.has_unfinished_requests():
            stats = self._snapshot(now)
        if deltas or stats is not None:
            self._send_deltas(deltas, stats)

    def _send_deltas(self, deltas: list[SampleDelta], stats: Any | None) -> None:
        if len(self.outputs) == 1:
            self._send(0, StepOutputs(deltas, stats))
            return
        by_client: list[list[SampleDelta]] = [[] for _ in self.outputs]
        client_of = self._client_of
        for delta in deltas:
            by_client[client_of.get(delta.request_id, 0)].append(delta)
        for client, batch in enumerate(by_client):
            if batch or stats is not None:  # (every front gets the stats snapshot)
                self._send(client, StepOutputs(batch, stats))
        has_request = self.core.has_request
        for delta in deltas:
            if delta.finish_reason is not None and not has_request(delta.request_id):
                client_of.pop(delta.request_id, None)

    def _snapshot(self, now: float | None = None) -> Any:
        self._stats_time = time.monotonic() if now is None else now
        self._stats_due = False
        return self.core.stats()

    def _send(self, client: int, message: Any) -> None:
        """A front that is gone (its socket has no peer) is skipped: its process runner ends the server."""
        try:
            self.outputs[client].send(encoder.encode(message), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.debug("front %d is not connected: %s dropped", client, type(message).__name__)

    def _broadcast(self, message: Any) -> None:
        for client in range(len(self.outputs)):
            self._send(client, message)


class StepLog:
    """Every ``interval_s`` while the core works, one line of its own numbers: steps per second and their mean
    time (the whole step as the loop sees it, host and device), the share of the wall time spent stepping, prompt
    tokens computed (prefill chunks as they run: a long prompt shows its speed) and generated tokens per second,
    running and waiting requests, KV usage and the prefix-cache hit rate over the interval; with the KV tiers below
    the host, a second line of their hits, bytes and restore time. Nothing while idle."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._since = 0.0  # the interval's start
        self._last_step = float("-inf")
        self._steps = 0
        self._step_s = 0.0
        self._start_stats: Any = None  # the stats at the interval's start

    def record(self, seconds: float, core: Any) -> None:
        if not self.interval_s:
            return
        now = time.monotonic()
        # the first step after start-up or an idle spell
        if now - self._last_step > self.interval_s:
            self._since, self._steps, self._step_s, self._start_stats = (
                now - seconds,
                0,
                0.0,
                core.stats(),
            )
        self._last_step = now
        self._steps += 1
        self._step_s += seconds
        if now - self._since >= self.interval_s:
            stats = core.stats()
            self._log(self._start_stats, stats, now - self._since)
            self._since, self._steps, self._step_s, self._start_stats = now, 0, 0.0, stats

    def _log(self, first: Any, stats: Any, wall_s: float) -> None:
        queries = stats.prefix_queries - first.prefix_queries
        hits = stats.prefix_hits - first.prefix_hits
        logger.info(
            "engine: %.1f steps/s, %.2f ms per step (stepping %.0f%% of the time); prompt %.0f tok/s, "
            "generation %.0f tok/s; running %d, waiting %d, swapped %d; KV usage %.1f%%; prefix cache hit "
            "rate %.1f%%; preemptions %d",
            self._steps / wall_s,
            1000 * self._step_s / self._steps,
            100 * self._step_s / wall_s,
            (stats.prefill_tokens - first.prefill_tokens) / wall_s,
            (stats.generation_tokens - first.generation_tokens) / wall_s,
            stats.num_running,
            stats.num_waiting,
            stats.num_swapped,
            100 * stats.kv_usage,
            100 * hits / queries if queries else 0.0,
            stats.preemptions - first.preemptions,
        )
        if (drafted := stats.spec_draft_tokens - first.spec_draft_tokens) > 0:
            verified = stats.spec_verifications - first.spec_verifications
            accepted = stats.spec_accepted_tokens - first.spec_accepted_tokens
            logger.info(
                "speculative decoding: %d drafts verified, %.1f%% accepted, %.2f tokens a verification (drafts kept + 1)",
                drafted,
                100 * accepted / drafted,
                (accepted + verified) / verified,
            )
        if stats.kv_tier_read_bytes or stats.kv_tier_written_bytes or stats.num_disk_blocks:
            logger.info(
                "KV tiers: %d prompt tokens from disk, %d from Redis; %.1f MiB read, %.1f MiB written; "
                "restores took %.2f s; %d blocks on disk; %d refused (recomputed)",
                stats.prefix_disk_hits - first.prefix_disk_hits,
                stats.prefix_redis_hits - first.prefix_redis_hits,
                (stats.kv_tier_read_bytes - first.kv_tier_read_bytes) / 2**20,
                (stats.kv_tier_written_bytes - first.kv_tier_written_bytes) / 2**20,
                stats.kv_tier_restore_seconds - first.kv_tier_restore_seconds,
                stats.num_disk_blocks,
                stats.kv_tier_rejected_blocks - first.kv_tier_rejected_blocks,
            )


def _pickled_error(exc: Exception) -> bytes:
    try:
        return pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as its text
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
