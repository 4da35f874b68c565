"""Command line: ``pagedchat serve`` (the HTTP server) and ``pagedchat chat`` (a streaming terminal chat on
the engine); also ``python -m app ...``.

Every EngineConfig and ServerSettings option is a flag (``--max-num-seqs``, ``--enable-prefix-caching/--no-...``),
described in app/engine_options.py and app/server_options.py (help, choices, units, environment variable);
tests/server/test_cli.py checks that every field of the dataclasses has its flag. Building the parser imports no
torch, so ``--help`` and ``--version`` are instant; the dataclasses are imported when a command runs.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from app.engine_options import ENGINE_OPTIONS
from app.options import Option, parse_bytes, parse_names
from app.server_options import LOG_LEVELS, SERVER_OPTIONS
from app.version import version

_DERIVED = {"hf_config", "model_path", "model_id", "torch_dtype", "torch_device", "eos_token_ids"}
_TYPES = {"int": int, "float": float, "str": str, "bytes": parse_bytes, "names": parse_names}


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    _add_options(parser.add_argument_group("engine"), ENGINE_OPTIONS)


def _add_options(group: argparse._ArgumentGroup, options: tuple[Option, ...]) -> None:
    """Every flag defaults to None: a flag not given leaves the dataclass's default (or environment) in place."""
    for option in options:
        if option.kind == "bool":
            group.add_argument(
                option.flag,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=option.help_text(),
            )
        else:
            group.add_argument(
                option.flag,
                type=_value_type(option),
                default=_env_size(option),
                choices=option.choices,
                metavar="SIZE"
                if option.kind == "bytes"
                else None
                if option.choices
                else option.name.upper(),
                help=option.help_text(),
            )


def _env_size(option: Option) -> str | None:
    """A size's environment variable is read here: its field holds bytes, and argparse parses a text default
    as it parses the flag (a bad value exits 2 naming the flag)."""
    if option.kind != "bytes" or option.env is None:
        return None
    return os.environ.get(option.env) or None


def _value_type(option: Option) -> Any:
    convert = _TYPES[option.kind]

    def value(text: str) -> Any:
        try:
            return convert(text.lower() if option.choices else text)
        except ValueError as exc:  # argparse prints it as "argument --flag: ..." and exits 2
            raise argparse.ArgumentTypeError(
                f"{text!r}: {exc}"
                if option.kind == "bytes"
                else f"invalid {option.kind} value: {text!r}"
            ) from None

    value.__name__ = option.kind
    return value


def engine_config_from_args(args: argparse.Namespace) -> Any:
    from engine.config import EngineConfig

    return EngineConfig(**_given(args, EngineConfig, _DERIVED))


def server_settings_from_args(args: argparse.Namespace) -> Any:
    """ServerSettings from the flags (ValueError naming the field for a bad value). ``pagedchat serve MODEL``
    is ``--model MODEL``."""
    from app.settings import ServerSettings

    positional = getattr(args, "model_positional", None)
    if positional is not None:
        if args.model is not None and args.model != positional:
            raise ValueError(
                f"model: given twice ({positional!r} and --model {args.model!r}); give one"
            )
        args.model = positional
    return ServerSettings(
        engine=engine_config_from_args(args), **_given(args, ServerSettings, {"engine"})
    )


def _given(args: argparse.Namespace, cls: type, skip: set[str]) -> dict[str, Any]:
    import dataclasses

    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if f.name not in skip and getattr(args, f.name, None) is not None
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedchat", description="Self-hosted LLM chat on a paged KV cache."
    )
    parser.add_argument("--version", action="version", version=f"pagedchat {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="the HTTP server: OpenAI-compatible API, sessions, chat UI",
        description="The HTTP server: OpenAI-compatible API, sessions, chat UI. Sizes take "
        "units (4MiB, 512KiB); a flag not given keeps its default, or its "
        "environment variable where one is named.",
    )
    serve.add_argument(
        "model_positional",
        nargs="?",
        metavar="MODEL",
        default=None,
        help="The model, as --model (a local Hugging Face directory, a .gguf file or a hub id). "
        "Default: the embedded SmolLM2-135M-Instruct.",
    )
    _add_options(serve.add_argument_group("server"), SERVER_OPTIONS)
    add_engine_options(serve)
    chat = sub.add_parser(
        "chat",
        help="stream a chat with the model in this terminal",
        description="A streaming chat with the model in this terminal (the engine, no server).",
    )
    chat.add_argument("--system", default=None, help="The system prompt. Default: none.")
    chat.add_argument(
        "--max-tokens", type=int, default=256, help="Most tokens per reply. Default: 256."
    )
    chat.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        help="Sampling temperature (0: greedy). Default: 0.7.",
    )
    chat.add_argument(
        "--log-level",
        default="info",
        type=str.lower,
        choices=LOG_LEVELS,
        help="How much is logged. Default: info.",
    )
    add_engine_options(chat)
    return parser


async def chat_loop(config: Any, system: str | None, params: Any) -> None:
    from engine.async_engine import AsyncEngine
    from engine.chat_template import chat_prompt_ids

    engine = AsyncEngine(config)
    await engine.start()
    tokenizer = engine.tokenizer
    messages = [{"role": "system", "content": system}] if system else []
    print("pagedchat: type a message (Ctrl-D or /quit to leave)", file=sys.stderr)
    try:
        while (line := await asyncio.to_thread(_read_line)) is not None:
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            reply = await _stream_reply(engine, chat_prompt_ids(tokenizer, messages), params)
            messages.append({"role": "assistant", "content": reply})
    finally:
        await engine.stop()


async def _stream_reply(engine: Any, prompt_ids: list[int], params: Any) -> str:
    start, first, out = time.perf_counter(), None, None
    async for out in engine.generate(prompt_ids, params):
        first = first or time.perf_counter()
        print(out.text_delta, end="", flush=True)
    elapsed = time.perf_counter() - start
    rate = len(out.token_ids) / (elapsed - (first - start)) if elapsed > first - start else 0.0
    print(
        f"\n[{len(out.token_ids)} tokens, TTFT {1000 * (first - start):.0f} ms, {rate:.1f} tok/s, "
        f"prompt {out.num_prompt_tokens} tokens of which {out.num_cached_tokens} cached, "
        f"finish: {out.finish_reason}]",
        file=sys.stderr,
    )
    return out.text


def serve(args: argparse.Namespace) -> int:
    if (args.api_server_count or 1) <= 1 and not args.restart_core:
        # the one front's core starts now and configures itself from these arguments: the model loads while this
        # process imports torch and starts (its connection takes the core if configured as it would launch it)
        from engine.runtime.core_prestart import prestart_core

        prestart_core(functools.partial(core_configuration, args))
    _load_tokenizer_early(args)
    from app.serve import serve as run

    try:
        settings = server_settings_from_args(args)
    except ValueError as exc:
        print(f"pagedchat: {exc}", file=sys.stderr)
        return 2
    return run(settings)


def _load_tokenizer_early(args: argparse.Namespace) -> None:
    """The front's tokenizer starts loading now, on a thread, where its directory is known without work (a GGUF
    file described before, a local directory): this process's imports meanwhile take turns with it for the GIL."""
    from engine.cache_dir import default_cache_dir
    from engine.worker.model_sources import known_model_dir
    from engine.worker.tokenizer_files import load_tokenizer_early

    cache_dir = Path(args.cache_dir or default_cache_dir())
    # (``pagedchat serve MODEL``: the positional is --model's, as server_settings_from_args reads it)
    model = args.model if args.model is not None else getattr(args, "model_positional", None)
    if (known := known_model_dir(model, cache_dir, args.load_format)) is not None:
        load_tokenizer_early(known)


def core_configuration(args: argparse.Namespace) -> tuple[Any, int, str]:
    """The engine core ``pagedchat serve`` (one front) launches, from its command line: its EngineConfig, log level
    and log format, as the front's own start computes them (run in the prestarted core's process)."""
    from engine.log_format import configure_logging

    configure_logging(args.log_level or "info", getattr(args, "log_format", None) or "text")
    settings = server_settings_from_args(args)
    return settings.engine, logging.getLogger().getEffectiveLevel(), settings.log_format


def _read_line() -> str | None:
    if sys.stdin.isatty():
        print("> ", end="", flush=True, file=sys.stderr)
    line = sys.stdin.readline()
    return None if not line or line.strip() == "/quit" else line.rstrip("\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # (the engine package imports torch: after --help)
    from engine.log_format import configure_logging

    configure_logging(args.log_level or "info", getattr(args, "log_format", None) or "text")
    if args.command == "serve":
        return serve(args)
    from engine.sampling_params import SamplingParams

    try:
        config = engine_config_from_args(args)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    except ValueError as exc:
        print(f"pagedchat: {exc}", file=sys.stderr)
        return 2
    asyncio.run(chat_loop(config, args.system, params))
    return 0
