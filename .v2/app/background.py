"""Tasks the server starts and keeps referenced until they end (turns being stored after their stream, lock
refreshes), so none is garbage-collected mid-way, and which shutdown waits for."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class BackgroundTasks:
    """Tasks the server keeps referenced until they end (e.g. turns being stored after their stream), and waits
    for at shutdown."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task
