"""Front: this process's place among the server's front processes (``--api-server-count``).

One front (the default) starts its own engine core. With several (or with ``--restart-core``), the supervisor
(app/supervisor.py) starts the core and the fronts; each front attaches to the core as one of its clients and
serves its share of the connections on the shared listening socket. What depends on the number of fronts is
here: the share of the request queue each admits, and which one pins the stored presets at start-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.runtime.core_process import CoreEndpoint


@dataclass(frozen=True, slots=True)
class Front:
    endpoint: CoreEndpoint | None = None  # the shared core; None: start one of our own
    index: int = 0
    count: int = 1

    @property
    def shared(self) -> bool:
        return self.count > 1

    def queue_share(self, max_queue: int) -> int:
        """This front's part of ``--max-queue`` (each front counts only its own waiting requests)."""
        return math.ceil(max_queue / self.count)

    @property
    def pins_stored_presets(self) -> bool:
        """One front pins the stored presets at start-up; the core's pins serve every front."""
        return self.index == 0
