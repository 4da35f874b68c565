"""What every benchmark records beside its numbers, in one place: where and when it ran (the environment: UTC
date, the command that reproduces it, the device, the versions of the libraries it ran on, the machine's load
average before and after), the one-line form of that for a printed report, the JSON file, and the device a
GPU-only script needs before it starts.

WORKLOADS.md asks every number for its workload, command, device and date: a script builds its environment with
``environment(__spec__.name, ...)`` once its run is over (the load average after the run is read then), prints
``environment_line(env)`` under its table and writes ``write_json(args.json, {"environment": env, ...})``.

Nothing here imports torch unless the caller hands it a torch device, so the HTTP benchmarks (whose device is the
server's) stay light.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import shlex
import sys
from typing import Any

logger = logging.getLogger(__name__)

# versions worth recording, when the run imported them
LIBRARIES = ("torch", "triton", "transformers", "llama_cpp")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def load_average() -> float:
    """The 1-minute load average: on a 2-vCPU machine anything else running moves the numbers."""
    return os.getloadavg()[0]


def command_line(module: str, argv: list[str] | None = None) -> str:
    """The command that reproduces the run: ``python -m MODULE`` and its arguments (``sys.argv``'s by default),
    quoted for a shell.
    ``module`` is the script's ``__spec__.name``, which is its dotted name also when it runs as ``__main__``."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def device_name(device: Any) -> str:
    """A torch device (or "cuda", "cpu") as torch names it; the CPU as the platform names the processor."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def versions() -> dict[str, str]:
    """The versions of the libraries of LIBRARIES this process imported."""
    found = {}
    for name in LIBRARIES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "__version__"):
            found[name] = str(module.__version__)
    return found


def environment(
    module: str,
    device: Any = None,
    load_before: float | None = None,
    argv: list[str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Where and when a run happened, for its JSON and its report line; ``extra`` adds what only this script
    knows (threads, weights format, the server's arguments ...). ``device`` is where the measured work ran
    (None: not in this process, e.g. a server over HTTP; then the processor is the client's). Call it after the
    run: the load average after the run is read here."""
    return {
        "date": utc_now(),
        "command": command_line(module, argv),
        **({"device": device_name(device)} if device is not None else {}),
        **versions(),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        **extra,
    }


def environment_line(env: dict[str, Any]) -> str:
    """The environment as one printed line, under a report's tables."""
    libraries = ", ".join(f"{name} {env[name]}" for name in LIBRARIES if env.get(name))
    before = env.get("load_average_before")
    load = f"{before:.2f} before / " if before is not None else ""
    where = env.get("device") or f"the client on {env['processor']}"
    return (
        f"{env['date']}, {where} ({env['cpu_count']} CPUs), {libraries or 'python'}, "
        f"load average {load}{env['load_average_after']:.2f} after; command: {env['command']}"
    )


def write_json(path: str | None, data: Any) -> None:
    """The run's numbers as JSON at ``path`` (nothing when no path was asked for)."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
    logger.info("numbers written to %s", path)


def require_cuda(module: str, devices: int = 1) -> None:
    """A clear exit for a GPU-only script started where there is no GPU (or too few), before any work."""
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < devices:
        raise SystemExit(
            f"{module} needs {devices} CUDA device{'s' if devices > 1 else ''}; this machine has {found}"
        )
