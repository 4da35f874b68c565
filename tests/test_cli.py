"""The command line: every engine and server option is a flag of `pagedchat serve`, every option the README
shows exists, and `pagedchat chat` streams a piped conversation."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from app.cli import _DERIVED, build_parser, engine_config_from_args, server_settings_from_args
from app.settings import ServerSettings
from engine.config import EngineConfig

README = Path(__file__).resolve().parent.parent / "README.md"


def _help(command: str) -> str:
    return build_parser()._subparsers._group_actions[0].choices[command].format_help()


def test_every_engine_and_server_option_is_a_serve_flag():
    help_text = _help("serve")
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in _DERIVED]
    names += [f.name for f in dataclasses.fields(ServerSettings) if f.name != "engine"]
    for name in names:
        assert "--" + name.replace("_", "-") in help_text


def test_every_option_the_readme_shows_exists():
    table_rows = [line for line in README.read_text().splitlines() if line.startswith("| `--")]
    shown = {flag for row in table_rows for flag in re.findall(r"`(--[a-z][a-z0-9-]*)", row)}
    assert {"--host", "--port", "--redis-url", "--api-key", "--max-queue", "--model"} <= shown
    flags = set(re.findall(r"--[a-z][a-z0-9-]*", _help("serve") + _help("chat")))
    assert shown <= flags, shown - flags


def test_serve_flags_reach_the_server_settings():
    args = build_parser().parse_args(["serve", "--port", "9001", "--api-key", "k", "--max-queue", "3",
                                      "--redis-url", "redis://x:1/0", "--max-num-seqs", "7"])
    settings = server_settings_from_args(args)
    assert (settings.port, settings.api_key, settings.max_queue, settings.redis_url, settings.engine.max_num_seqs) \
        == (9001, "k", 3, "redis://x:1/0", 7)


def test_every_engine_option_is_a_chat_flag():
    help_text = _help("chat")
    for field in dataclasses.fields(EngineConfig):
        if field.name not in _DERIVED:
            assert "--" + field.name.replace("_", "-") in help_text


def test_flags_reach_the_engine_config():
    args = build_parser().parse_args(["chat", "--block-size", "32", "--no-enable-prefix-caching",
                                      "--kv-cache-memory-gib", "0.5", "--prefix-hash", "xxh128"])
    config = engine_config_from_args(args)
    assert (config.block_size, config.enable_prefix_caching, config.kv_cache_memory_gib, config.prefix_hash) == \
        (32, False, 0.5, "xxh128")


def test_bad_flag_value_exits_with_a_clear_message():
    result = subprocess.run([sys.executable, "-m", "app", "chat", "--block-size", "12"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and "block_size" in result.stderr


def test_piped_chat_streams_a_reply_with_stats():
    result = subprocess.run(
        [sys.executable, "-m", "app", "chat", "--temperature", "0", "--max-tokens", "8",
         "--kv-cache-memory-gib", "0.1", "--num-threads", "1", "--log-level", "WARNING"],
        input="What is 2 + 2?\nAnd 3 + 3?\n", capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    stats = [line for line in result.stderr.splitlines() if line.startswith("[") and "tokens, TTFT" in line]
    assert len(stats) == 2, result.stderr
    assert result.stdout.strip(), "the replies are printed on stdout"
    second_turn_cached = int(stats[1].split("of which ")[1].split(" cached")[0])
    assert second_turn_cached > 0, "the second turn re-sends the first: its blocks must be hit"
