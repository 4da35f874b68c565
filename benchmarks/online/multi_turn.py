"""Workload ``multi-turn`` (shared WORKLOADS.md): conversations through the session API and through the
stateless API, same run, same server; per turn the mean TTFT and the cached share of the prompt tokens.

``--conversations`` conversations of ``--turns`` turns (drawn per conversation) share one system prompt of
``--system-len`` filler words (one token each); each user turn has ``--user-len`` words and each assistant turn
exactly ``--assistant-len`` tokens (ignore_eos, max_tokens, greedy). The same planned conversations run twice:

- ``session``: ``POST /v1/sessions {"system"}``, then per turn ``POST /v1/sessions/{id}/messages`` with the
  user content; the server keeps the history as exact token ids (deleted at the end).
- ``stateless``: ``POST /v1/chat/completions`` with the whole history each turn, the assistant messages being
  the replies the server streamed.

Each API runs with its own ``cache_salt`` (fresh per run), so neither hits the other's blocks (nor an earlier
run's), while the conversations of one API share the system prompt's blocks, which one warm-up request per
API computes before the timed turns. Up to ``--concurrency`` conversations run at once (default all), each
turn sent when the previous reply ends. TTFT = request sent to the first streamed text; cached share =
sum(usage.prompt_tokens_details.cached_tokens) / sum(usage.prompt_tokens) over the conversations at that turn.

Without ``--base-url`` the script starts ``python -m app serve`` (``--server-args``); ``--with-redis`` first
starts a throw-away redis-server and passes ``--redis-url`` (otherwise the embedded in-memory store).

    python -m benchmarks.online.multi_turn --conversations 24 --turns 12-18 --with-redis          # the workload
    python -m benchmarks.online.multi_turn --conversations 4 --turns 6 --user-len 120-160 --assistant-len 80-120
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shlex
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from random import Random
from typing import Any

import httpx

from benchmarks.harness import record
from benchmarks.online.http_client import (
    StreamResult,
    add_server_options,
    draw,
    filler_text,
    int_range,
    local_redis,
    new_client,
    served_model,
    server_from_args,
    shown,
    stream_request,
)

logger = logging.getLogger("benchmarks.online.multi_turn")

APIS = ("session", "stateless")
WARM_UP_WORDS = 8


@dataclass(slots=True)
class Conversation:
    index: int
    user_texts: list[str]
    reply_tokens: list[int]


@dataclass(slots=True)
class Turn:
    """One answered (or failed) turn of one conversation through one API."""

    api: str
    conversation: int
    turn: int  # 1-based
    ttft_s: float | None
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    error: str | None = None

    @classmethod
    def of(cls, api: str, conversation: int, turn: int, result: StreamResult) -> Turn:
        return cls(
            api,
            conversation,
            turn,
            result.ttft,
            result.latency,
            result.prompt_tokens,
            result.cached_tokens,
            result.completion_tokens,
            result.error,
        )


# the planned conversations ---------------------------------------------------------------------------------


def plan(args: argparse.Namespace) -> tuple[str, list[Conversation]]:
    """The system prompt and every conversation's user texts and reply lengths, from one seeded generator."""
    rng = Random(args.seed)
    system = filler_text(rng, args.system_len)
    conversations = []
    for index in range(args.conversations):
        turns = draw(rng, args.turns)
        users = [filler_text(rng, draw(rng, args.user_len)) for _ in range(turns)]
        conversations.append(
            Conversation(index, users, [draw(rng, args.assistant_len) for _ in range(turns)])
        )
    return system, conversations


def sampling(max_tokens: int, temperature: float) -> dict[str, Any]:
    return {
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# the session API -------------------------------------------------------------------------------------------


async def create_session(
    client: httpx.AsyncClient, base_url: str, system: str, salt: str, title: str
) -> str:
    response = await client.post(
        f"{base_url}/v1/sessions", json={"system": system, "cache_salt": salt, "title": title}
    )
    if response.status_code not in (200, 201):
        raise RuntimeError(f"POST /v1/sessions: HTTP {response.status_code}: {response.text[:300]}")
    return response.json()["id"]


async def delete_session(client: httpx.AsyncClient, base_url: str, session_id: str) -> None:
    with contextlib.suppress(httpx.HTTPError):
        response = await client.delete(f"{base_url}/v1/sessions/{session_id}")
        if response.status_code != 200:
            logger.warning("DELETE /v1/sessions/%s: HTTP %d", session_id, response.status_code)


async def session_conversation(
    client: httpx.AsyncClient,
    base_url: str,
    conv: Conversation,
    system: str,
    salt: str,
    temperature: float,
) -> list[Turn]:
    try:
        session_id = await create_session(
            client, base_url, system, salt, f"multi-turn {conv.index}"
        )
    except (RuntimeError, httpx.HTTPError) as exc:
        return [Turn("session", conv.index, 1, None, 0.0, 0, 0, 0, str(exc))]
    turns = []
    try:
        for number, (user, reply) in enumerate(zip(conv.user_texts, conv.reply_tokens), start=1):
            body = {"content": user, **sampling(reply, temperature)}
            result = await stream_request(
                client, f"{base_url}/v1/sessions/{session_id}/messages", body
            )
            turns.append(Turn.of("session", conv.index, number, result))
            if not result.ok:
                break
    finally:
        await delete_session(client, base_url, session_id)
    return turns


# the stateless API -----------------------------------------------------------------------------------------


async def stateless_conversation(
    client: httpx.AsyncClient,
    base_url: str,
    conv: Conversation,
    system: str,
    salt: str,
    temperature: float,
    model: str,
) -> list[Turn]:
    """The client keeps the history: every turn resends it, with the replies exactly as streamed."""
    messages = [{"role": "system", "content": system}]
    turns = []
    for number, (user, reply) in enumerate(zip(conv.user_texts, conv.reply_tokens), start=1):
        messages.append({"role": "user", "content": user})
        body = {
            "model": model,
            "messages": messages,
            "cache_salt": salt,
            **sampling(reply, temperature),
        }
        result = await stream_request(client, f"{base_url}/v1/chat/completions", body)
        turns.append(Turn.of("stateless", conv.index, number, result))
        if not result.ok:
            break
        messages.append({"role": "assistant", "content": result.text})
    return turns


# one API's run ---------------------------------------------------------------------------------------------


async def warm_up(
    client: httpx.AsyncClient, base_url: str, api: str, system: str, salt: str, model: str
) -> None:
    """One short conversation under the API's salt, untimed, so its system prompt blocks are in the cache."""
    warm = Conversation(-1, [filler_text(Random("warm-up"), WARM_UP_WORDS)], [1])
    turns = await run_conversation(client, base_url, api, warm, system, salt, 0.0, model)
    if turns[0].error:
        logger.warning("%s warm-up failed: %s", api, turns[0].error)


async def run_conversation(
    client: httpx.AsyncClient,
    base_url: str,
    api: str,
    conv: Conversation,
    system: str,
    salt: str,
    temperature: float,
    model: str,
) -> list[Turn]:
    if api == "session":
        return await session_conversation(client, base_url, conv, system, salt, temperature)
    return await stateless_conversation(client, base_url, conv, system, salt, temperature, model)


async def run_api(
    client: httpx.AsyncClient,
    base_url: str,
    api: str,
    system: str,
    conversations: list[Conversation],
    args: argparse.Namespace,
    model: str,
) -> list[Turn]:
    salt = f"bench-multi-turn-{api}-{uuid.uuid4().hex[:12]}"
    await warm_up(client, base_url, api, system, salt, model)
    gate = asyncio.Semaphore(args.concurrency or len(conversations))

    async def one(conv: Conversation) -> list[Turn]:
        async with gate:
            turns = await run_conversation(
                client, base_url, api, conv, system, salt, args.temperature, model
            )
        failed = next((t.error for t in turns if t.error), None)
        logger.info(
            "%s conversation %d: %d turns%s",
            api,
            conv.index,
            len(turns),
            f", failed: {failed}" if failed else "",
        )
        return turns

    results = await asyncio.gather(*(one(conv) for conv in conversations))
    return [turn for turns in results for turn in turns]


# report ----------------------------------------------------------------------------------------------------


def turn_stats(turns: list[Turn]) -> dict[str, Any]:
    """Mean TTFT (ms), cached share of prompt tokens and mean prompt tokens over the answered turns."""
    good = [t for t in turns if t.error is None]
    timed = [t.ttft_s for t in good if t.ttft_s is not None]
    prompt = sum(t.prompt_tokens for t in good)
    return {
        "answered": len(good),
        "failed": len(turns) - len(good),
        "ttft_mean_ms": 1e3 * sum(timed) / len(timed) if timed else None,
        "cached_fraction": sum(t.cached_tokens for t in good) / prompt if prompt else None,
        "prompt_tokens_mean": prompt / len(good) if good else None,
    }


def per_turn(turns: list[Turn], apis: tuple[str, ...]) -> list[dict[str, Any]]:
    numbers = sorted({t.turn for t in turns})
    return [
        {
            "turn": n,
            **{api: turn_stats([t for t in turns if t.turn == n and t.api == api]) for api in apis},
        }
        for n in numbers
    ]


def overall(turns: list[Turn], apis: tuple[str, ...]) -> dict[str, Any]:
    return {
        "all turns": {api: turn_stats([t for t in turns if t.api == api]) for api in apis},
        "turns 2+": {
            api: turn_stats([t for t in turns if t.api == api and t.turn > 1]) for api in apis
        },
    }


def table(rows: list[dict[str, Any]], totals: dict[str, Any], apis: tuple[str, ...]) -> str:
    head = (
        ["turn", "n"]
        + [f"{api} TTFT mean (ms)" for api in apis]
        + [f"{api} cached" for api in apis]
        + [f"{api} prompt tokens" for api in apis]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    labelled = [(str(r["turn"]), r) for r in rows] + [
        (f"**{name}**", r) for name, r in totals.items()
    ]
    for label, r in labelled:
        stats = [r[api] for api in apis]
        cells = [label, "/".join(str(s["answered"]) for s in stats)]
        cells += [_fmt(s["ttft_mean_ms"], "{:.0f}") for s in stats]
        cells += [_fmt(s["cached_fraction"], "{:.1%}") for s in stats]
        cells += [_fmt(s["prompt_tokens_mean"], "{:.0f}") for s in stats]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else spec.format(value)


def errors(turns: list[Turn]) -> list[str]:
    seen = sorted({f"{t.api}: {t.error}" for t in turns if t.error})
    return seen[:5]


# main ------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument(
        "--turns", type=int_range, default=(12, 18), help="turns per conversation: N or LOW-HIGH"
    )
    parser.add_argument(
        "--system-len", type=int, default=500, help="system prompt words (one token each)"
    )
    parser.add_argument(
        "--user-len", type=int_range, default=(120, 160), help="user turn words: N or LOW-HIGH"
    )
    parser.add_argument(
        "--assistant-len", type=int_range, default=(80, 120), help="reply tokens: N or LOW-HIGH"
    )
    parser.add_argument(
        "--concurrency", type=int, default=None, help="conversations at once (default: all)"
    )
    parser.add_argument(
        "--apis", default=",".join(APIS), help="which APIs, in this order (default: both)"
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--with-redis",
        action="store_true",
        help="start a throw-away redis-server and give the server --redis-url",
    )
    parser.add_argument(
        "--json", metavar="PATH", help="also write the numbers (and every turn) here"
    )
    add_server_options(parser)
    args = parser.parse_args(argv)
    args.apis = tuple(api.strip() for api in args.apis.split(","))
    if not args.apis or any(api not in APIS for api in args.apis):
        parser.error(f"--apis: a comma-separated subset of {','.join(APIS)}")
    if (
        args.conversations < 1
        or args.system_len < 1
        or (args.concurrency is not None and args.concurrency < 1)
    ):
        parser.error("--conversations, --system-len and --concurrency must be >= 1")
    if args.with_redis and args.base_url:
        parser.error("--with-redis starts the server's Redis: it cannot apply to --base-url")
    return args


@contextlib.contextmanager
def server_with_store(args: argparse.Namespace) -> Iterator[str]:
    """The server under test, with a fresh Redis behind it when ``--with-redis``."""
    if not args.with_redis:
        with server_from_args(args) as base_url:
            yield base_url
        return
    with local_redis() as redis_url, server_from_args(args, ["--redis-url", redis_url]) as base_url:
        yield base_url


async def benchmark(base_url: str, args: argparse.Namespace) -> tuple[str, list[Turn]]:
    system, conversations = plan(args)
    turns: list[Turn] = []
    async with new_client(args.request_timeout) as client:
        model = await served_model(client, base_url)
        for api in args.apis:
            logger.info(
                "%s API: %d conversations, %d turns in all",
                api,
                len(conversations),
                sum(len(c.user_texts) for c in conversations),
            )
            turns += await run_api(client, base_url, api, system, conversations, args, model)
    return model, turns


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    load_before = record.load_average()
    with server_with_store(args) as base_url:
        model, turns = asyncio.run(benchmark(base_url, args))
    server_args = None if args.base_url else shlex.split(args.server_args)
    env = record.environment(
        __spec__.name, load_before=load_before, argv=argv, server_args=server_args
    )
    rows, totals = per_turn(turns, args.apis), overall(turns, args.apis)
    store = (
        "Redis"
        if args.with_redis
        else ("the server's store" if args.base_url else "in-memory store")
    )
    print(
        f"\n## multi-turn workload: {model}, {args.conversations} conversations, {shown(args.turns)} turns, "
        f"system {args.system_len}, user {shown(args.user_len)}, assistant {shown(args.assistant_len)} tokens; "
        f"sessions in {store}\n"
    )
    print(table(rows, totals, args.apis))
    print(
        "\nn = answered turns per API; cached = cached_tokens / prompt_tokens summed over the turn's requests"
    )
    for error in errors(turns):
        print(f"warning: {error}")
    print(record.environment_line(env))
    record.write_json(
        args.json,
        {
            "environment": env,
            "arguments": vars(args),
            "per_turn": rows,
            "overall": totals,
            "turns": [asdict(t) for t in turns],
        },
    )


if __name__ == "__main__":
    main()
