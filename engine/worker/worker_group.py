"""Tensor parallelism's processes: the engine core is rank 0 and starts ranks 1 .. N-1, one process per device.

Rank 0 schedules once and drives every rank's model runner: each command its runner carries out on its own
device (size or allocate the KV cache, capture graphs, run a step) goes first to the other ranks over ZeroMQ,
one message each, then runs at rank 0. A step's message is the packed input buffer rank 0 built
(engine/worker/step_inputs.py) plus its layout and block copies; the ranks then meet only in the layers' collectives
and in the broadcast of the sampled ids (torch.distributed: NCCL on CUDA, gloo on the CPU). Replies come back
only where rank 0 needs one (start-up, free memory).

A rank that dies ends the engine: a gloo collective fails at once, and rank 0's watcher notices the exit; on
CUDA, where an NCCL collective would wait for the lost peer, the watcher ends the process (exit status 3, the
engine's death) after a short grace. The workers (tp_worker.py: a rank's process, which carries out the commands
defined here) die with rank 0's process (PR_SET_PDEATHSIG) and on ``stop``.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from engine.distributed import parallel_state, peer_memory
from engine.config import EngineConfig
from engine.worker.step_inputs import StepLayout

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # a rank loading its shard of a large model from a slow disk
_LEAVE_TIMEOUT_S = 30.0  # leaving the process group at shutdown, before giving up on it
# CUDA: how long rank 0's own collective may take to fail before the watcher ends it
_DEATH_GRACE_S = 10.0


# rank 0 -> the other ranks -------------------------------------------------------------------------------


@dataclass(slots=True)
class RunStep:
    layout: StepLayout
    pad: int | None  # a decode-only step padded to this CUDA-graph size
    num_sampled: int  # rows whose sampled ids rank 0 broadcasts after the step
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class AllocateKv:
    num_blocks: int
    max_model_len: int


@dataclass(slots=True)
class ReserveLogits:
    """Rank 0's logits in symmetric memory, where the group sums through it (``parallel_state.reserve_logits``)."""

    max_rows: int
    width: int


@dataclass(slots=True)
class AllocateHostCache:
    num_blocks: int


@dataclass(slots=True)
class CaptureGraphs:
    sizes: list[int]


@dataclass(slots=True)
class ReleaseKv:
    """The warm-up's scratch KV cache and graphs are dropped (KV sizing, on CUDA)."""


@dataclass(slots=True)
class MemoryInfo:
    """Reply with the device's (free, total) bytes."""


@dataclass(slots=True)
class Stop:
    pass


# the other ranks -> rank 0 -------------------------------------------------------------------------------


@dataclass(slots=True)
class WorkerReady:
    rank: int


@dataclass(slots=True)
class WorkerFailed:
    rank: int
    error: str


@dataclass(slots=True)
class Reply:
    rank: int
    value: Any


@dataclass(slots=True)
class WorkerSpec:
    """What a worker process is started with (pickled on its stdin)."""

    config: EngineConfig
    rank: int
    size: int
    rendezvous: str
    commands: str  # its ZeroMQ address for rank 0's commands
    replies: str  # rank 0's address for replies
    log_level: int
    # the group's all-reduce path, decided by rank 0 (every rank must take the same)
    all_reduce: str


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """cuda:<rank> on CUDA (the core's device is cuda:0), the CPU otherwise."""
    return torch.device("cuda", rank) if config.torch_device.type == "cuda" else torch.device("cpu")


class WorkerGroup:
    """Rank 0's handle on ranks 1 .. N-1."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.tensor_parallel_size
        self.size = size
        self.failure: str | None = None  # why a rank is gone
        self._stopping = False
        self._dir = tempfile.mkdtemp(prefix="pagedchat-tp-")
        self._context = zmq.Context()
        self._replies = self._context.socket(zmq.PULL)
        self._replies.bind(f"ipc://{self._dir}/replies")
        self._commands: list[zmq.Socket] = []
        self.processes: list[subprocess.Popen] = []
        os.environ.update(parallel_state.NCCL_SAFETY_ENV)  # (the workers inherit them)
        rendezvous = f"file://{self._dir}/rendezvous"
        level = logging.getLogger().getEffectiveLevel()
        # rank 0 decides for all: a process sets a PeerAllReduce up once, and the workers are always fresh
        all_reduce = "nccl" if parallel_state.peer_all_reduce_spent() else config.all_reduce
        for rank in range(1, size):
            address = f"ipc://{self._dir}/commands-{rank}"
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.bind(address)
            self._commands.append(socket)
            spec = WorkerSpec(
                config,
                rank,
                size,
                rendezvous,
                address,
                f"ipc://{self._dir}/replies",
                level,
                all_reduce,
            )
            process = subprocess.Popen(
                [sys.executable, "-m", "engine.worker.tp_worker"], stdin=subprocess.PIPE
            )
            process.stdin.write(pickle.dumps(spec))
            process.stdin.close()
            self.processes.append(process)
        logger.info("tensor parallel: %d ranks, workers %s", size, [p.pid for p in self.processes])
        try:
            parallel_state.init_tensor_parallel(
                0, size, rank_device(config, 0), rendezvous, START_TIMEOUT_S, all_reduce
            )
        except Exception:
            self.stop()
            raise
        logger.info(
            "tensor parallel: all-reduce through %s",
            "symmetric memory from %d to %d MiB, NCCL otherwise"
            % (
                peer_memory.PEER_ALL_REDUCE_MIN_BYTES >> 20,
                peer_memory.PEER_ALL_REDUCE_BYTES >> 20,
            )
            if parallel_state.peer_all_reduce_active()
            else "NCCL"
            if config.torch_device.type == "cuda"
            else "gloo",
        )
        self._watcher = threading.Thread(target=self._watch, name="tp-watcher", daemon=True)
        self._watcher.start()

    def wait_ready(self) -> None:
        """Block until every worker has loaded its shard; RuntimeError (ValueError for a configuration mistake)
        with the first failure."""
        ready: set[int] = set()
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(ready) < self.size - 1:
            message = self._receive(deadline)
            if isinstance(message, WorkerFailed):
                self.failure = f"rank {message.rank} failed to start"
                self.stop()
                kind = ValueError if message.error.startswith("ValueError") else RuntimeError
                raise kind(f"tensor-parallel rank {message.rank} failed to start: {message.error}")
            ready.add(message.rank)

    def send(self, command: Any, payload: memoryview | None = None) -> None:
        """``command`` to every worker (``payload``: a raw buffer sent beside it, outside the pickle)."""
        if self.failure is not None:
            raise RuntimeError(f"tensor parallel: {self.failure}")
        frame = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        for socket in self._commands:
            if payload is None:
                socket.send(frame)
            else:
                # (copied: the buffer is reused two steps later)
                socket.send_multipart([frame, payload])

    def gather(self, command: Any) -> list[Any]:
        """Send ``command`` and return the workers' replies, by rank (1 .. N-1)."""
        self.send(command)
        values: dict[int, Any] = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(values) < self.size - 1:
            message = self._receive(deadline)
            if isinstance(message, WorkerFailed):
                raise RuntimeError(f"tensor-parallel rank {message.rank} failed: {message.error}")
            values[message.rank] = message.value
        return [values[rank] for rank in sorted(values)]

    def _receive(self, deadline: float) -> Any:
        while not self._replies.poll(500):
            if self.failure is not None:
                raise RuntimeError(f"tensor parallel: {self.failure}")
            if time.monotonic() > deadline:
                raise RuntimeError("tensor parallel: no reply from the workers in time")
        return pickle.loads(self._replies.recv())

    def _watch(self) -> None:
        """A rank that exits while the engine runs ends it (see the module docstring)."""
        while not self._stopping:
            for rank, process in enumerate(self.processes, start=1):
                code = process.poll()
                if code is not None and not self._stopping:
                    self.failure = f"rank {rank} (pid {process.pid}) exited with status {code}"
                    logger.error("tensor parallel: %s; the engine cannot go on", self.failure)
                    if (
                        torch.distributed.is_initialized()
                        and torch.distributed.get_backend() == "nccl"
                    ):
                        time.sleep(_DEATH_GRACE_S)
                        if not self._stopping:
                            os._exit(3)
                    return
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop the workers and leave the group (the engine is done, or failed to start)."""
        if self._stopping:
            return
        self._stopping = True
        if self.failure is None:
            try:
                for socket in self._commands:
                    socket.send(pickle.dumps(Stop()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        _leave_group()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for socket in [*self._commands, self._replies]:
            socket.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def _leave_group() -> None:
    """Leave the process group, on a thread given ``_LEAVE_TIMEOUT_S``: an NCCL teardown that waits on a peer
    (or on work captured in CUDA graphs still alive) must not hang the caller's shutdown."""
    leaving = threading.Thread(
        target=parallel_state.destroy_tensor_parallel, name="tp-leave", daemon=True
    )
    leaving.start()
    leaving.join(_LEAVE_TIMEOUT_S)
    if leaving.is_alive():
        logger.warning(
            "tensor parallel: leaving the process group took over %.0f s; left behind",
            _LEAVE_TIMEOUT_S,
        )
