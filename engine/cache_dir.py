"""Where pagedchat keeps what it writes once and reads at every start (GGUF files' descriptions, the native CPU
kernels' builds, the KV cache's disk tier, the session database): ``PAGEDCHAT_CACHE_DIR``, else
~/.cache/pagedchat. No torch here: the front reads it before it imports torch."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> str:
    return os.environ.get("PAGEDCHAT_CACHE_DIR", str(Path.home() / ".cache" / "pagedchat"))
