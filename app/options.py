"""An option of ``pagedchat serve`` and ``pagedchat chat``: its help sentence, choices, unit and environment
variable, for the command line (app/cli.py) and its ``--help``; the options themselves are listed in
engine_options.py and server_options.py.

This module imports nothing heavy (no torch), so ``pagedchat --help`` answers at once. The values themselves are
checked where they are used, by EngineConfig and ServerSettings (whose defaults ``--help`` shows, as the
``default`` text here: tests/server/test_cli.py holds the two together, and checks that every field has an option).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|kib|kb|mib|mb|gib|gb)?\s*$", re.IGNORECASE)
_UNITS = {
    None: 1,
    "b": 1,
    "kib": 2**10,
    "kb": 10**3,
    "mib": 2**20,
    "mb": 10**6,
    "gib": 2**30,
    "gb": 10**9,
}


def parse_bytes(text: str) -> int:
    """A size in bytes: a number with an optional unit (``4MiB``, ``512KiB``, ``1GB``, ``4096``)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(
            f"{text!r} is not a size (a number with an optional unit: B, KiB, MiB, GiB, KB, MB, GB)"
        )
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower() or None])


def parse_names(text: str) -> list[str]:
    """Comma-separated names (``a,b``), each stripped; empty ones are kept for ServerSettings to refuse."""
    return [name.strip() for name in text.split(",")]


@dataclass(frozen=True, slots=True)
class Option:
    name: str  # the field of EngineConfig or ServerSettings; the flag is --name-with-dashes
    help: str  # one sentence: what it does (units in the sentence where they are not in the name)
    default: str  # as --help shows it
    kind: str = "str"  # str | int | float | bool | bytes | names (comma-separated)
    choices: tuple[str, ...] | None = None
    env: str | None = None  # the environment variable that sets it when the flag is not given

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def help_text(self) -> str:
        parts = [self.help.rstrip(".") + "."]
        if self.choices:
            parts.append(f"One of: {', '.join(self.choices)}.")
        parts.append(f"Default: {self.default}.")
        if self.env:
            parts.append(f"Env: {self.env}.")
        return " ".join(parts)
