"""Writes docs/OPTIONS.md from the option definitions themselves: the server's options (app/server_options.py), the
engine's (app/engine_options.py) and the flags of ``pagedchat chat`` (app/cli.py's parser), one markdown table
each. tests/test_options_doc.py fails when the file and this output differ, so the page cannot drift from ``--help``.

    .venv/bin/python scripts/options_doc.py           # rewrite docs/OPTIONS.md
    .venv/bin/python scripts/options_doc.py --check   # exit 1 if docs/OPTIONS.md is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from app.cli import build_parser
from app.engine_options import ENGINE_OPTIONS
from app.options import Option
from app.server_options import SERVER_OPTIONS

OUT = REPO_ROOT / "docs" / "OPTIONS.md"
COMMAND = ".venv/bin/python scripts/options_doc.py"
VALUES = {
    "int": "integer",
    "float": "number",
    "str": "text",
    "bytes": "size (4MiB, 512KiB, 1GB)",
    "names": "names, comma-separated",
}

INTRO = f"""# Options

Every option of `pagedchat serve` (also `python -m app serve`) and `pagedchat chat`. This page is generated
from their definitions in app/server_options.py, app/engine_options.py and app/cli.py by
`{COMMAND}`; tests/test_options_doc.py checks it against them, so edit the definitions, then run that
command. `pagedchat serve --help` prints the same. A flag that is not given keeps its default, or its environment variable
where one is named. Pass them through make as `make serve ARGS="--port 9000 --model Qwen/Qwen3-0.6B"`.

`pagedchat serve MODEL` is `pagedchat serve --model MODEL`. `pagedchat serve` exits with status 0 after a stop,
2 for a start-up mistake (one line says what to fix; everything that needs no model is checked before weights
load), 3 when the engine or a front process died (a supervisor should restart it), and 1 for any other start-up
failure.
"""


def cell(text: str) -> str:
    """Text for a table cell: a literal | would end the cell."""
    return text.replace("|", "\\|")


def flag(option: Option) -> str:
    if option.kind == "bool":
        return f"`{option.flag}` / `--no-{option.flag[2:]}`"
    return f"`{option.flag}`"


def value(option: Option) -> str:
    if option.kind == "bool":
        return "on / off"
    if option.choices:
        return " \\| ".join(f"`{choice}`" for choice in option.choices)
    return VALUES[option.kind]


def options_table(options: tuple[Option, ...]) -> list[str]:
    rows = ["| flag | value | default | env | meaning |", "| --- | --- | --- | --- | --- |"]
    for option in options:
        env = f"`{option.env}`" if option.env else ""
        meaning = option.help.rstrip(".") + "."
        rows.append(
            f"| {flag(option)} | {value(option)} | {cell(option.default)} | {env} | {cell(meaning)} |"
        )
    return rows


def chat_table() -> list[str]:
    """The flags ``pagedchat chat`` adds to the engine's: its own arguments, read from the parser."""
    parser = build_parser()
    chat = parser._subparsers._group_actions[0].choices["chat"]
    engine_flags = {option.flag for option in ENGINE_OPTIONS}
    rows = ["| flag | meaning |", "| --- | --- |"]
    for action in chat._actions:
        flags = [s for s in action.option_strings if s.startswith("--")]
        if not flags or flags[0] in engine_flags or flags[0] == "--help":
            continue
        rows.append(f"| `{flags[0]}` | {cell(action.help or '')} |")
    return rows


def render() -> str:
    parts = [
        INTRO,
        "## Server options (`pagedchat serve`)\n",
        *options_table(SERVER_OPTIONS),
        "",
        "## Engine options (`pagedchat serve` and `pagedchat chat`)\n",
        *options_table(ENGINE_OPTIONS),
        "",
        "## `pagedchat chat`\n",
        "A streaming chat in the terminal on the engine (no server). It takes the engine options above and:\n",
        *chat_table(),
    ]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="only compare; exit 1 when the page is stale"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        stale = not OUT.exists() or OUT.read_text(encoding="utf-8") != text
        if stale:
            print(f"{OUT.relative_to(REPO_ROOT)} is stale: run {COMMAND}", file=sys.stderr)
        return int(stale)
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
