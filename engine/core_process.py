"""The engine core's process: a busy loop of drain inputs -> step -> push outputs, nothing else on its thread.

Started by the front (async_engine.py) with the spawn method; it loads the model, sizes the KV cache, says
``Ready`` (or ``StartFailed``) and loops until told to stop. Its life is tied to the front's: it dies with it
(PR_SET_PDEATHSIG on Linux, and a parent check whenever it is idle), ignores Ctrl-C (the front drains and then
stops it), and a failed step is reported as ``CoreFailed`` before it exits non-zero.
"""
from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
import time
from typing import Any

import zmq

from engine.config import EngineConfig
from engine.core_messages import (
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

logger = logging.getLogger("engine.core")

_STATS_PERIOD_S = 0.05  # a stats snapshot rides on a step's outputs at most this often
_IDLE_POLL_MS = 500  # while idle: how often the parent is looked for
_PR_SET_PDEATHSIG = 1


def run_engine_core(config: EngineConfig, inputs_address: str, outputs_address: str, log_level: int) -> None:
    """The process's entry point (picklable: spawn imports it by name)."""
    parent = os.getppid()
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the front decides
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    inputs, outputs = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    inputs.connect(inputs_address)
    outputs.connect(outputs_address)
    try:
        core = _start(config, outputs)
        if core is not None:
            CoreLoop(core, inputs, outputs, parent).run()
    finally:
        outputs.close(linger=2000)  # the last message (a failure) must leave before the process does
        inputs.close(linger=0)
        context.term()


def _start(config: EngineConfig, outputs: zmq.Socket) -> Any | None:
    from engine.engine_core import EngineCore

    try:
        core = EngineCore(config)
    except ValueError as exc:
        outputs.send(encoder.encode(StartFailed(str(exc), True)))
        return None
    except Exception as exc:  # noqa: BLE001 - the front reports it and exits
        logger.exception("the engine core failed to start")
        outputs.send(encoder.encode(StartFailed(f"{type(exc).__name__}: {exc}", False)))
        return None
    outputs.send(encoder.encode(Ready(core.info, core.stats())))
    return core


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the front's process ends (no orphan holds device memory)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class CoreLoop:
    def __init__(self, core: Any, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = parent_pid
        self._stats_time = 0.0
        self._stats_due = False  # something changed since the last snapshot sent

    def run(self) -> None:
        core = self.core
        try:
            while True:
                busy = core.has_unfinished_requests()
                if not busy and not self._wait_for_input():
                    continue
                if not self._drain():
                    return
                if core.has_unfinished_requests():
                    self._send_step(core.step())
                elif self._stats_due:
                    self._send(StepOutputs([], self._snapshot()))
        except Exception as exc:  # noqa: BLE001 - the whole step failed: every stream must hear of it
            logger.exception("the engine core failed")
            self._send(CoreFailed(f"{type(exc).__name__}: {exc}"))
            raise SystemExit(1) from exc

    def _wait_for_input(self) -> bool:
        """Idle: block until a message comes; exit if the front is gone."""
        if self.inputs.poll(_IDLE_POLL_MS):
            return True
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
                if deltas and message.index is None:  # (a sample the front ended itself needs no word back)
                    self._send(StepOutputs(deltas))
            elif isinstance(message, UtilityCall):
                self._call(message)
            elif isinstance(message, Shutdown):
                return False

    def _add(self, message: AddRequest) -> None:
        try:
            self.core.add_request(message.request_id, message.prompt_token_ids, message.params, message.cache_salt)
        except ValueError as exc:  # this request's fault only: tell its consumer, keep serving
            self._send(AddFailed(message.request_id, str(exc), True))
        except Exception as exc:  # noqa: BLE001 - add_request registers nothing before it can fail
            logger.exception("request %s could not be added", message.request_id)
            self._send(AddFailed(message.request_id, f"{type(exc).__name__}: {exc}", False))

    def _call(self, message: UtilityCall) -> None:
        try:
            target, args = pickle.loads(message.payload)
            result = getattr(self.core, target)(*args) if isinstance(target, str) else target(self.core, *args)
            reply = UtilityResult(message.call_id, True, pickle.dumps(result))
        except Exception as exc:  # noqa: BLE001 - the caller's problem, raised in the caller
            reply = UtilityResult(message.call_id, False, _pickled_error(exc))
        self._send(reply)

    def _send_step(self, deltas: list) -> None:
        now = time.monotonic()
        stats = None
        if now - self._stats_time >= _STATS_PERIOD_S or not self.core.has_unfinished_requests():
            stats = self._snapshot(now)
        if deltas or stats is not None:
            self._send(StepOutputs(deltas, stats))

    def _snapshot(self, now: float | None = None) -> Any:
        self._stats_time = time.monotonic() if now is None else now
        self._stats_due = False
        return self.core.stats()

    def _send(self, message: Any) -> None:
        self.outputs.send(encoder.encode(message), copy=False)


def _pickled_error(exc: Exception) -> bytes:
    try:
        return pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as its text
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
