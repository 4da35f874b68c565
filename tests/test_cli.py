"""`pagedchat chat` (what `make serve` runs today): every engine option is a flag, and a piped
conversation streams a reply."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

from app.cli import _DERIVED, build_parser, engine_config_from_args
from engine.config import EngineConfig


def test_every_engine_option_is_a_flag():
    help_text = build_parser()._subparsers._group_actions[0].choices["chat"].format_help()
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
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "block_size" in result.stderr


def test_piped_chat_streams_a_reply_with_stats():
    result = subprocess.run(
        [sys.executable, "-m", "app", "chat", "--temperature", "0", "--max-tokens", "8",
         "--kv-cache-memory-gib", "0.1", "--num-threads", "1", "--log-level", "WARNING"],
        input="What is 2 + 2?\nAnd 3 + 3?\n", capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    stats = [line for line in result.stderr.splitlines() if line.startswith("[") and "tokens, TTFT" in line]
    assert len(stats) == 2, result.stderr
    assert result.stdout.strip(), "the replies are printed on stdout"
    second_turn_cached = int(stats[1].split("of which ")[1].split(" cached")[0])
    assert second_turn_cached > 0, "the second turn re-sends the first: its blocks must be hit"
