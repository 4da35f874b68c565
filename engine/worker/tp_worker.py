"""A tensor-parallel rank's process (ranks 1 .. N-1): it joins the process group, loads its shard of the model
and carries out rank 0's commands (engine/worker/worker_group.py) on its own device until told to stop.

Started by ``WorkerGroup`` as ``python -m engine.worker.tp_worker`` with its ``WorkerSpec`` pickled on stdin. It
dies with rank 0's process (PR_SET_PDEATHSIG) and ignores Ctrl-C and SIGTERM (rank 0 stops it); a failure to
start is reported to rank 0 as ``WorkerFailed``.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import signal
import sys
import traceback

import torch
import zmq

from engine.child_process import die_with_parent, name_process
from engine.distributed import parallel_state
from engine.log_format import configure_logging
from engine.worker.loader import load_model
from engine.worker.model_runner import ModelRunner
from engine.worker.worker_group import (
    START_TIMEOUT_S,
    AllocateHostCache,
    AllocateKv,
    CaptureGraphs,
    MemoryInfo,
    ReleaseKv,
    Reply,
    ReserveLogits,
    RunStep,
    Stop,
    WorkerFailed,
    WorkerReady,
    WorkerSpec,
    rank_device,
)

logger = logging.getLogger(__name__)


def run_worker(spec: WorkerSpec) -> None:
    """Rank ``spec.rank``'s life: join the group, load its shard, say ready, then carry out rank 0's commands."""
    die_with_parent()
    name_process(f"pagedchat-tp{spec.rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # (kill -USR1: every thread's stack on stderr, for a rank that seems stuck)
    faulthandler.register(signal.SIGUSR1)
    configure_logging(logging.getLevelName(spec.log_level), "text", f"tp rank {spec.rank}")
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(spec.commands)
    replies = context.socket(zmq.PUSH)
    replies.connect(spec.replies)
    try:
        device = rank_device(spec.config, spec.rank)
        parallel_state.init_tensor_parallel(
            spec.rank, spec.size, device, spec.rendezvous, START_TIMEOUT_S, spec.all_reduce
        )
        # (its device stays "cuda": the current device, this rank's, set by the group)
        config = spec.config
        parallel_state.set_rank_threads(config.num_threads, spec.size, device)
        torch.manual_seed(config.seed)
        model, _ = load_model(config)
        runner = ModelRunner(config, model)
        replies.send(pickle.dumps(WorkerReady(spec.rank)))
        _serve(runner, commands, replies, spec.rank)
    except Exception as exc:  # noqa: BLE001 - rank 0 reports it
        logger.error("tensor-parallel rank %d failed:\n%s", spec.rank, traceback.format_exc())
        replies.send(pickle.dumps(WorkerFailed(spec.rank, f"{type(exc).__name__}: {exc}")))
        replies.close(linger=2000)
        raise SystemExit(1) from None
    replies.close(linger=0)
    commands.close(linger=0)
    parallel_state.destroy_tensor_parallel()


def _serve(runner: ModelRunner, commands: zmq.Socket, replies: zmq.Socket, rank: int) -> None:
    """Carry out rank 0's commands until ``Stop``."""
    with torch.inference_mode():
        while True:
            frames = commands.recv_multipart(copy=False)
            command = pickle.loads(frames[0].buffer)
            if isinstance(command, RunStep):
                runner.follow_step(command, frames[1].buffer)
            elif isinstance(command, AllocateKv):
                runner.config.max_model_len = command.max_model_len
                runner.allocate_kv_cache(command.num_blocks)
            elif isinstance(command, AllocateHostCache):
                runner.allocate_host_cache(command.num_blocks)
            elif isinstance(command, ReserveLogits):
                runner.reserve_logits(command.max_rows, command.width)
            elif isinstance(command, CaptureGraphs):
                runner.capture_graphs(command.sizes)
            elif isinstance(command, ReleaseKv):
                runner.release_kv_cache()
            elif isinstance(command, MemoryInfo):
                replies.send(pickle.dumps(Reply(rank, torch.cuda.mem_get_info(runner.device))))
            elif isinstance(command, Stop):
                # (before the group goes: their captured collectives hold its communicator)
                runner.release_graphs()
                return
            else:
                raise RuntimeError(f"unknown command {type(command).__name__}")


if __name__ == "__main__":
    run_worker(pickle.loads(sys.stdin.buffer.read()))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (no interpreter teardown: CUDA and NCCL state is simply dropped with the process)
