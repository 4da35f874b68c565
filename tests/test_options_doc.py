"""docs/OPTIONS.md is what scripts/options_doc.py renders from the option definitions, so an option added, removed
or reworded in app/ without regenerating the page fails here (the message gives the command)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_generator():
    spec = importlib.util.spec_from_file_location(
        "options_doc", ROOT / "scripts" / "options_doc.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_options_page_is_the_generators_output():
    generator = load_generator()
    page = (ROOT / "docs" / "OPTIONS.md").read_text(encoding="utf-8")
    assert page == generator.render(), (
        f"docs/OPTIONS.md is stale: run `{generator.COMMAND}` and commit the result"
    )


def test_every_serve_and_chat_flag_is_on_the_page():
    """Counted independently of the generator: every long flag `pagedchat serve --help` and `pagedchat chat
    --help` print appears on the page (the page may add --no-* forms)."""
    from app.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    page = (ROOT / "docs" / "OPTIONS.md").read_text(encoding="utf-8")
    flags = {
        s
        for command in ("serve", "chat")
        for action in commands[command]._actions
        for s in action.option_strings
        if s.startswith("--") and s != "--help"
    }
    missing = sorted(f for f in flags if f"`{f}`" not in page)
    assert not missing, missing
