"""/v1/sessions ... (placeholder until the sessions issue lands)."""
from __future__ import annotations

from typing import Any

OPERATIONS: list = []
routes: list = []


async def open_sessions(server: Any) -> None:
    return None


async def chat_in_session(*args: Any) -> Any:
    raise NotImplementedError
