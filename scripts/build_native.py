"""Build the native CPU kernels (kernels/cpu_native.py) of every level this CPU runs, into the cache directory the
engine loads them from, ahead of the first start (`make install` runs it in the background while the rest
installs: the builds take ~20 s a level on 2 cores). Each level is built once per machine; a level already built is
only loaded. A failure is reported and the engine builds that level on first use, as it does without this.

    python scripts/build_native.py
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from engine.config import EngineConfig
from kernels import cpu_native


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = Path(EngineConfig().cache_dir) / "native"
    failed = 0
    for level in ["generic", *cpu_native.supported_levels()]:
        start = time.perf_counter()
        try:
            kernels = cpu_native.load(root, level)
        except Exception as exc:  # noqa: BLE001 - reported; the engine builds it on first use
            kernels = None
            print(f"{level}: {type(exc).__name__}: {exc}", file=sys.stderr)
        failed += kernels is None
        print(
            f"{level}: {'ready' if kernels else 'unavailable'} in {time.perf_counter() - start:.1f} s"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
