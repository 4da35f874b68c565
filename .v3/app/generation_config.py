"""The model's own sampling defaults (``generation_config.json``: temperature, top_p, top_k, min_p,
repetition_penalty), applied to every request that does not set them, as vLLM does with
``--generation-config auto``; ``none`` keeps the OpenAI defaults (temperature 1, no truncation)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GENERATION_CONFIGS = ("auto", "none")
# each default the file may give, and the values a request could give for it
_CHECKS = {
    "temperature": lambda v: 0 <= v <= 100,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: float(v).is_integer() and v >= -1,
    "min_p": lambda v: 0 <= v <= 1,
    "repetition_penalty": lambda v: 0 < v <= 10,
}


def model_sampling_defaults(model_path: str | None) -> dict[str, Any]:
    """The sampling defaults in the model directory's generation_config.json (none when there is no such file);
    a value out of its range is skipped with a warning, never applied."""
    if model_path is None:
        return {}
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("%s is unreadable (%s): no sampling defaults from the model", path, exc)
        return {}
    defaults: dict[str, Any] = {}
    for name, valid in _CHECKS.items():
        value = config.get(name)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or not valid(value)
        ):
            logger.warning("%s: %s=%r is out of range; not applied", path, name, value)
            continue
        defaults[name] = int(value) if name == "top_k" else float(value)
    if defaults:
        logger.info(
            "the model's sampling defaults apply to requests that do not set them: %s "
            "(--generation-config none: OpenAI's)",
            defaults,
        )
    return defaults
