"""Command line: ``pagedchat serve`` (the HTTP server) and ``pagedchat chat`` (a streaming terminal chat on
the engine); also ``python -m app ...``.

Every EngineConfig and ServerSettings option is a flag (``--max-num-seqs``, ``--enable-prefix-caching/--no-...``),
generated from the dataclasses so nothing the engine or server offers is out of reach.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import time
from typing import Any

from app.settings import ServerSettings
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams

_DERIVED = {"hf_config", "model_path", "model_id", "torch_dtype", "torch_device", "eos_token_ids"}


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    _add_dataclass_options(parser.add_argument_group("engine"), EngineConfig, _DERIVED)


def _add_dataclass_options(group: argparse._ArgumentGroup, cls: type, skip: set[str]) -> None:
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        default = field.default if field.default is not dataclasses.MISSING else None
        if "bool" in str(field.type):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            group.add_argument(flag, type=_value_type(str(field.type)), default=default,
                               metavar=field.name.upper(), help=f"default: {_shown(default, field)}")


def _value_type(annotation: str) -> type:
    return int if "int" in annotation else float if "float" in annotation else str


def _shown(default: Any, field: dataclasses.Field) -> str:
    return "from the environment / cache dir" if field.default_factory is not dataclasses.MISSING else repr(default)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**_given(args, EngineConfig, _DERIVED))


def server_settings_from_args(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(engine=engine_config_from_args(args), **_given(args, ServerSettings, {"engine"}))


def _given(args: argparse.Namespace, cls: type, skip: set[str]) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if f.name not in skip and getattr(args, f.name) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedchat", description="Self-hosted LLM chat on a paged KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="the HTTP server: OpenAI-compatible API, sessions, chat UI")
    _add_dataclass_options(serve.add_argument_group("server"), ServerSettings, {"engine"})
    add_engine_options(serve)
    chat = sub.add_parser("chat", help="stream a chat with the model in this terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--log-level", default="INFO")
    add_engine_options(chat)
    return parser


async def chat_loop(config: EngineConfig, system: str | None, params: SamplingParams) -> None:
    from engine.async_engine import AsyncEngine

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
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            reply = await _stream_reply(engine, tokenizer.encode(text, add_special_tokens=False), params)
            messages.append({"role": "assistant", "content": reply})
    finally:
        await engine.stop()


async def _stream_reply(engine: Any, prompt_ids: list[int], params: SamplingParams) -> str:
    start, first, out = time.perf_counter(), None, None
    async for out in engine.generate(prompt_ids, params):
        first = first or time.perf_counter()
        print(out.text_delta, end="", flush=True)
    elapsed = time.perf_counter() - start
    rate = len(out.token_ids) / (elapsed - (first - start)) if elapsed > first - start else 0.0
    print(f"\n[{len(out.token_ids)} tokens, TTFT {1000 * (first - start):.0f} ms, {rate:.1f} tok/s, "
          f"prompt {out.num_prompt_tokens} tokens of which {out.num_cached_tokens} cached, "
          f"finish: {out.finish_reason}]", file=sys.stderr)
    return out.text


def serve(args: argparse.Namespace) -> int:
    from app.serve import serve as run

    try:
        settings = server_settings_from_args(args)
    except ValueError as exc:
        print(f"pagedchat: {exc}", file=sys.stderr)
        return 2
    return run(settings)


def _read_line() -> str | None:
    if sys.stdin.isatty():
        print("> ", end="", flush=True, file=sys.stderr)
    line = sys.stdin.readline()
    return None if not line or line.strip() == "/quit" else line.rstrip("\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return serve(args)
    try:
        config = engine_config_from_args(args)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    except ValueError as exc:
        print(f"pagedchat: {exc}", file=sys.stderr)
        return 2
    asyncio.run(chat_loop(config, args.system, params))
    return 0
