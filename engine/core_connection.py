"""CoreConnection: one front's link to an engine core process, the ZeroMQ sockets and the process itself.

front -> core: a PUSH socket with no high-water mark, so a send never waits (it queues until the core reads);
core -> front: a PULL socket, read on the event loop. By default the connection launches its own core. Given a
``CoreEndpoint`` (``--api-server-count``: several front processes share one core, started by the process that
runs them), it attaches to that core as one of its clients instead: the core's life is then its starter's, and
this side only watches it (a pidfd: its exit is seen at once).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import select
from typing import Any

import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.runtime.core_messages import Ready, Shutdown, StartFailed, encoder, from_core_decoder
from engine.runtime.core_prestart import take_prestarted
from engine.runtime.core_process import CoreEndpoint, LaunchedCore, launch_core

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 10.0  # the core's own shutdown; then it is killed
_START_POLL_MS = 200  # while the core starts: how often its process is looked at


class EngineStartError(RuntimeError):
    """The engine core could not start (the model did not load, no device memory, ...)."""


class CoreConnection:
    """The sockets to one engine core and its process: launched by ``open`` (no endpoint given) or attached to."""

    def __init__(
        self, config: EngineConfig, endpoint: CoreEndpoint | None, log_format: str = "text"
    ) -> None:
        self._config = config
        self._log_format = log_format  # of the core this connection launches (text | json)
        # a core started elsewhere, or None until ``open`` launches our own
        self.endpoint = endpoint
        self.launched: LaunchedCore | None = None
        self.process: multiprocessing.process.BaseProcess | AttachedProcess | None = None
        self._context: zmq.asyncio.Context | None = None
        self._inputs: zmq.Socket | None = None  # front -> core (a plain socket: sends never wait)
        self._outputs: zmq.asyncio.Socket | None = None  # core -> front

    def open(self) -> None:
        """Launch the core (or attach to the given one) and connect to it; ``wait_ready`` waits for it."""
        if self.endpoint is None:
            # (the core ``pagedchat serve`` started first, if it configured itself as this config says)
            prestarted = take_prestarted()
            level = logging.getLogger().getEffectiveLevel()
            self.launched = (
                prestarted.take(self._config, level, self._log_format, 1) if prestarted else None
            ) or launch_core(self._config, log_format=self._log_format)
            self.endpoint, self.process = self.launched.endpoints[0], self.launched.process
        else:
            self.process = AttachedProcess(self.endpoint.pid)
        self._context = zmq.asyncio.Context()
        self._inputs = zmq.Context.instance().socket(zmq.PUSH)
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        self._inputs.connect(self.endpoint.inputs)
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._outputs.connect(self.endpoint.outputs)

    async def wait_ready(self) -> Ready:
        """The core's Ready, once it has loaded the model and sized the KV cache; ValueError for a configuration
        mistake, EngineStartError for anything else."""
        while not await self._outputs.poll(_START_POLL_MS):
            if not self.process.is_alive():
                raise EngineStartError(
                    f"{self.exited()} before it was ready; its log above says why"
                )
        message = from_core_decoder.decode(await self._outputs.recv())
        if isinstance(message, StartFailed):
            raise (ValueError if message.config_error else EngineStartError)(message.message)
        assert isinstance(message, Ready), message
        return message

    async def receive(self) -> Any:
        """The core's next message."""
        frame = await self._outputs.recv(copy=False)
        return from_core_decoder.decode(frame.buffer)

    def send(self, message: Any) -> None:
        """Never waits: the socket connects to the core's, so it queues (unbounded) until the core reads; with
        the core gone, there is no one to tell."""
        try:
            self._inputs.send(encoder.encode(message), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.debug("engine core not connected: %s dropped", type(message).__name__)

    async def stop(self) -> None:
        """Shut a launched core down (killed if it takes over ``_STOP_TIMEOUT_S``); an attached core is left to
        its starter."""
        if self.launched is None:
            return
        if self.process.is_alive():
            self.send(Shutdown())
        await asyncio.to_thread(self.process.join, _STOP_TIMEOUT_S)
        if self.process.is_alive():
            logger.warning(
                "the engine core did not stop within %.0f s; killing it", _STOP_TIMEOUT_S
            )
            self.process.kill()
            await asyncio.to_thread(self.process.join)

    def close(self) -> None:
        if self.launched is not None and self.process.is_alive():
            self.process.kill()
        for sock in (self._inputs, self._outputs):
            if sock is not None:
                sock.close(linger=0)
        if self._context is not None:
            self._context.term()
        if self.launched is not None:
            self.launched.close()
        elif isinstance(self.process, AttachedProcess):
            self.process.close()

    def exited(self) -> str:
        # (None for a core this process did not start: its parent reaps it)
        status = self.process.exitcode
        return "the engine core process exited" + (
            f" (status {status})" if status is not None else ""
        )


class AttachedProcess:
    """A process this one did not start (a shared core), watched through a pidfd: readable once it exits."""

    def __init__(self, pid: int) -> None:
        if not hasattr(os, "pidfd_open"):
            raise EngineStartError("attaching to a shared engine core needs Linux (pidfd_open)")
        self.pid = pid
        try:
            self.sentinel = os.pidfd_open(pid)
        except ProcessLookupError:
            raise EngineStartError(f"the engine core process {pid} is gone") from None
        self.exitcode: int | None = None  # (its parent reaps it: the status is not ours to read)

    def is_alive(self) -> bool:
        if self.sentinel < 0:
            return False
        readable, _, _ = select.select([self.sentinel], [], [], 0)
        return not readable

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1
