"""The installed package's version (``pagedchat --version``, ``GET /version``, the OpenAPI document)."""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version


@cache
def version() -> str:
    try:
        return package_version("pagedchat")
    except PackageNotFoundError:
        return "0+unknown"
