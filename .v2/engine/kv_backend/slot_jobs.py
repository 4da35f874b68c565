"""Driver work off the engine thread (the vAttention backend's mapping ahead and unmapping, vattention.py).

One worker thread runs the jobs in submission order. Each slot's latest job is kept, so a step that needs a
slot's pages now waits for that slot's job alone (the worker's order makes the slot's earlier jobs done too).
Jobs not known done are kept with their function and arguments: at collection, a job the worker never started
is run on the spot, so no mapping is left half done when the driver's memory is given back.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class SlotJobs:
    def __init__(self, thread_name: str) -> None:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._latest: dict[int, Future] = {}  # slot -> its latest job
        # every job not known done, in order
        self._jobs: list[tuple[Future, Callable[..., Any], tuple]] = []

    @property
    def slots(self) -> set[int]:
        """Slots with a job that may still run."""
        return set(self._latest)

    def submit(self, slot: int, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the worker thread, as ``slot``'s latest job."""
        if len(self._jobs) >= 64:
            self._jobs = [job for job in self._jobs if not job[0].done()]
        future = self._worker.submit(fn, *args)
        self._jobs.append((future, fn, args))
        self._latest[slot] = future

    def wait_for(self, slot: int) -> None:
        """Wait for ``slot``'s jobs (none: return at once)."""
        if (pending := self._latest.pop(slot, None)) is not None:
            pending.result()

    def wait_all(self) -> None:
        """Wait for every job submitted so far."""
        for future, _, _ in self._jobs:
            future.result()
        self._jobs.clear()
        self._latest.clear()

    def close(self) -> None:
        """Stop the worker without waiting for it: a job it never started runs here; one it runs or ran is
        waited for (a running job keeps its owner alive, so at the owner's collection it is done)."""
        self._worker.shutdown(wait=False)
        for future, fn, args in self._jobs:
            if future.cancel():
                fn(*args)
            else:
                future.result()
        self._jobs.clear()
        self._latest.clear()
