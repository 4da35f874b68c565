"""Workload "Restart" (WORKLOADS.md) on the CPU default: a session's next turn after a server restart, against the
same turn without the restart and against a cold re-prefill (issue 52).

One server (the default model, sessions in a SQLite file and KV blocks on a disk tier, both in a temporary
directory, so both survive a restart) builds sessions S1, S2, S3 (``--repeats`` of each; medians reported) of
the same ``--turns`` user messages (``--tokens`` in all; greedy replies of ``--reply-tokens``, so all store the
same token ids: checked in the SQLite file). Then the same next message goes to each, with a greedy reply of
``--reply-tokens``:

- (a) warm: S1 on that server (its blocks on the device);
- (b) restart: the server stopped (SIGTERM) and started again with the same options; S2 (its blocks on disk);
- (c) cold: started again with ``--kv-disk-size 0``; S3 (everything computed again).

Each restarted server answers one short unrelated chat before the timed turn, so one-time start-up costs fall
outside it. Each session has its own cache salt, so a turn hits only its own session's blocks. Reported: each
turn's TTFT, cached tokens (and the server's disk and Redis hits, from /metrics) and reply; TTFT b/a (goal
<= 1.5) and c/a; whether the replies are the same (greedy); the tier counters of /metrics after each turn.

``--redis``: then a throw-away redis-server and two servers on it (sessions and ``--kv-redis-url``), each with
its own empty disk tier: a session built on the first, its next turn sent to the second: the cached share of
that turn's prompt (goal >= 90%).

    python -m benchmarks.cpu.kv_restart [--tokens 2000] [--redis] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import secrets
import shlex
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from random import Random
from typing import Any

import httpx

from benchmarks.harness import record
from benchmarks.online.http_client import (
    StreamResult,
    filler_text,
    local_redis,
    local_server,
    new_client,
    served_model,
    stream_request,
)
from benchmarks.online.multi_turn import create_session, sampling

logger = logging.getLogger("benchmarks.cpu.kv_restart")

RESTART_GOAL = 1.5  # restarted TTFT / warm TTFT
REDIS_GOAL = 0.9  # cached share of the next turn's prompt on the second server
TEMPLATE_TOKENS = 12  # what the chat template adds around one user message and its reply (about)
CASES = ("a warm", "b restarted", "c cold")
REDIS_CASE = "redis 2nd server"
SETTLE_S = 1.0  # writes_settled's interval
WRITTEN = "kv_tier_written_bytes_total"
TIERS = ("disk", "redis")  # their hits in /metrics: prefix_cache_<tier>_hits_total (tokens)
SYSTEM = "You are a helpful assistant. Answer briefly."


@dataclass(slots=True)
class Plan:
    """The conversation every session gets: the user messages of its history, then the timed next one."""

    history: list[str]
    next_message: str
    reply_tokens: int
    salt: str


@dataclass(slots=True)
class NextTurn:
    case: str
    ttft_s: float | None
    prompt_tokens: int
    cached_tokens: int
    reply: str
    start_s: float  # the server's start, to /health
    metrics: dict[str, float]  # the tier counters of /metrics after the turn
    error: str | None = None

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2000, help="the session's history, about")
    parser.add_argument("--turns", type=int, default=4, help="user messages in the history")
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--next-words", type=int, default=128, help="the timed message's length")
    parser.add_argument(
        "--repeats", type=int, default=1, help="sessions per case (their median TTFT is reported)"
    )
    parser.add_argument("--redis", action="store_true", help="also the two-server Redis case")
    parser.add_argument("--server-args", default="", help="more `python -m app serve` flags")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        "--json",
        default=f"docs/results/kv-restart-cpu-{record.utc_now()[:10]}.json",
        help="the JSON file ('' for none)",
    )
    return parser.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    """Filler words are one token each (http_client.WORDS), so each message's words are its tokens."""
    rng = Random(args.seed)
    words = max(8, args.tokens // args.turns - args.reply_tokens - TEMPLATE_TOKENS)
    history = [filler_text(rng, words) for _ in range(args.turns)]
    salt = f"kv-restart-{secrets.token_hex(6)}"
    return Plan(history, filler_text(rng, args.next_words), args.reply_tokens, salt)


# the session API ------------------------------------------------------------------------------------------


async def send_turn(
    client: httpx.AsyncClient, url: str, session: str, text: str, reply: int
) -> StreamResult:
    body = {"content": text, **sampling(reply, 0.0)}
    return await stream_request(client, f"{url}/v1/sessions/{session}/messages", body)


async def build_session(client: httpx.AsyncClient, url: str, plan: Plan, title: str) -> str:
    """A new session through the plan's history, every turn answered (RuntimeError otherwise). Each session has
    a salt of its own: its turns hit only its own blocks, never those of a session of the same text (the timed
    turn of S1 would otherwise put the very prompt of S2's timed turn on disk)."""
    session = await create_session(client, url, SYSTEM, f"{plan.salt}-{title}", title)
    for number, text in enumerate(plan.history, start=1):
        result = await send_turn(client, url, session, text, plan.reply_tokens)
        if not result.ok:
            raise RuntimeError(f"{title} turn {number}: {result.error}")
    logger.info("%s built: %d turns, last prompt %d tokens", title, number, result.prompt_tokens)
    return session


async def next_turns(
    url: str, sessions: list[str], plan: Plan, case: str, start_s: float
) -> list[NextTurn]:
    """The timed turn of each session, after one short unrelated chat on this server (untimed)."""
    async with new_client(1800.0) as client:
        await warm_up(client, url)
        return [await timed_turn(client, url, s, plan, case, start_s) for s in sessions]


async def timed_turn(
    client: httpx.AsyncClient, url: str, session: str, plan: Plan, case: str, start_s: float
) -> NextTurn:
    """The next message to ``session``, once the server's writes to the tiers have settled; ``metrics``: what
    the turn changed in the server's /metrics."""
    before = await writes_settled(client, url)
    result = await send_turn(client, url, session, plan.next_message, plan.reply_tokens)
    after = await tier_metrics(client, url)
    metrics = {name: value - before.get(name, 0.0) for name, value in after.items()}
    turn = NextTurn(
        case,
        result.ttft,
        result.prompt_tokens,
        result.cached_tokens,
        result.text,
        start_s,
        metrics,
        result.error,
    )
    logger.info(
        "%s: TTFT %s s, %d of %d prompt tokens cached",
        case,
        f"{turn.ttft_s:.3f}" if turn.ttft_s is not None else "n/a",
        turn.cached_tokens,
        turn.prompt_tokens,
    )
    return turn


async def warm_up(client: httpx.AsyncClient, url: str) -> None:
    body = {
        "model": await served_model(client, url),
        "messages": [{"role": "user", "content": "Say hello."}],
        "cache_salt": f"warm-up-{secrets.token_hex(4)}",
        **sampling(2, 0.0),
    }
    result = await stream_request(client, f"{url}/v1/chat/completions", body)
    if not result.ok:
        logger.warning("warm-up chat failed: %s", result.error)


async def tier_metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The prefix cache's and the KV tiers' counters of /metrics (whatever of them the server exports)."""
    response = await client.get(f"{url}/metrics")
    found = {}
    for line in response.text.splitlines():
        name, _, value = line.partition(" ")
        if line.startswith("pagedchat:") and any(
            word in name for word in ("prefix_cache", "disk", "redis", "kv_tier")
        ):
            with contextlib.suppress(ValueError):
                found[name.split("{")[0].removeprefix("pagedchat:")] = float(value)
    return found


async def writes_settled(
    client: httpx.AsyncClient, url: str, timeout_s: float = 120.0
) -> dict[str, float]:
    """Wait until the bytes written to the tiers stop growing (two reads SETTLE_S apart agree): the blocks of the
    turns just ended go down on an I/O thread of the server's, which a user's next message, seconds later, would
    not meet. Returns the last read of /metrics."""
    deadline, last = time.perf_counter() + timeout_s, None
    while True:
        metrics = await tier_metrics(client, url)
        if last is not None and metrics.get(WRITTEN) == last.get(WRITTEN):
            return metrics
        if time.perf_counter() > deadline:
            logger.warning("the tier writes did not settle within %.0f s", timeout_s)
            return metrics
        last = metrics
        await asyncio.sleep(SETTLE_S)


def stored_token_ids(db_path: Path, session: str) -> list[int]:
    """The session's exact token ids as the SQLite store keeps them (read-only)."""
    with contextlib.closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)) as db:
        row = db.execute("SELECT token_ids FROM sessions WHERE id = ?", (session,)).fetchone()
    return json.loads(row[0]) if row else []


# the restart case -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def timed_server(options: list[str], timeout_s: float) -> Iterator[tuple[str, float]]:
    """A server and the seconds its start took (to /health)."""
    start = time.perf_counter()
    with local_server(options, timeout_s) as url:
        yield url, time.perf_counter() - start


def run_restart(args: argparse.Namespace, plan: Plan, tmp: Path) -> dict[str, Any]:
    db = tmp / "sessions.sqlite3"
    options = [
        *shlex.split(args.server_args),
        *("--session-store", "sqlite", "--session-db-path", str(db)),
        *("--kv-disk-path", str(tmp / "kv"), "--kv-disk-size", "2GiB"),
    ]
    with timed_server(options, args.startup_timeout) as (url, start_s):
        sessions = asyncio.run(build_all(url, plan, args.repeats))  # [S1s, S2s, S3s]
        stored = [stored_token_ids(db, s) for same in sessions for s in same]
        turns = asyncio.run(next_turns(url, sessions[0], plan, CASES[0], start_s))
    with timed_server(options, args.startup_timeout) as (url, start_s):
        turns += asyncio.run(next_turns(url, sessions[1], plan, CASES[1], start_s))
    cold_options = [*options, "--kv-disk-size", "0"]  # (the last of a repeated flag wins)
    with timed_server(cold_options, args.startup_timeout) as (url, start_s):
        turns += asyncio.run(next_turns(url, sessions[2], plan, CASES[2], start_s))
    return {
        "history_tokens": len(stored[0]),
        "stored_ids_identical": all(ids == stored[0] for ids in stored),
        "turns": turns,
    }


async def build_all(url: str, plan: Plan, repeats: int) -> list[list[str]]:
    """``repeats`` sessions for each case, built in turn."""
    async with new_client(1800.0) as client:
        built = [
            [await build_session(client, url, plan, f"S{i}-{r}") for i in (1, 2, 3)]
            for r in range(repeats)
        ]
    return [list(same) for same in zip(*built)]


# the Redis case -------------------------------------------------------------------------------------------


def run_redis(args: argparse.Namespace, plan: Plan, tmp: Path) -> list[NextTurn]:
    """A session built on one server, its next turn on a second server of the same Redis."""
    with local_redis() as redis_url, contextlib.ExitStack() as stack:
        servers = []
        for i in (1, 2):
            options = [
                *shlex.split(args.server_args),
                *("--redis-url", redis_url, "--kv-redis-url", redis_url),
                *("--kv-disk-path", str(tmp / f"kv-redis-{i}")),
            ]
            servers.append(stack.enter_context(timed_server(options, args.startup_timeout)))
        (first, _), (second, start_s) = servers
        session = asyncio.run(build_on(first, plan))
        return asyncio.run(next_turns(second, [session], plan, REDIS_CASE, start_s))


async def build_on(url: str, plan: Plan) -> str:
    async with new_client(1800.0) as client:
        return await build_session(client, url, plan, "R1")


# report ---------------------------------------------------------------------------------------------------


def medians(turns: list[NextTurn], case: str) -> tuple[float | None, float]:
    """The case's median TTFT (None if a turn was not timed) and median cached share."""
    mine = [t for t in turns if t.case == case]
    timed = [t.ttft_s for t in mine if t.ttft_s is not None]
    ttft = statistics.median(timed) if len(timed) == len(mine) else None
    return ttft, statistics.median(t.cached_share for t in mine)


def summarize(restart: dict[str, Any], redis: list[NextTurn]) -> dict[str, Any]:
    (warm, warm_share), (restarted, restarted_share), (cold, _) = (
        medians(restart["turns"], case) for case in CASES
    )
    over_warm = {
        name: ttft / warm if ttft is not None and warm else None
        for name, ttft in (("restarted", restarted), ("cold", cold))
    }
    summary = {
        "history_tokens": restart["history_tokens"],
        "stored_ids_identical": restart["stored_ids_identical"],
        "ttft_warm_s": warm,
        "ttft_restarted_s": restarted,
        "ttft_cold_s": cold,
        "restarted_over_warm": over_warm["restarted"],
        "cold_over_warm": over_warm["cold"],
        "warm_cached_share": warm_share,
        "restarted_cached_share": restarted_share,
        "replies_identical": len({t.reply for t in restart["turns"]}) == 1,
        "restart_goal_met": (over_warm["restarted"] or float("inf")) <= RESTART_GOAL,
    }
    if redis:
        share = medians(redis, REDIS_CASE)[1]
        summary["redis_cached_share"] = share
        summary["redis_goal_met"] = share >= REDIS_GOAL
    return summary


def print_report(turns: list[NextTurn], summary: dict[str, Any]) -> None:
    print(
        f"{'case':<18} {'TTFT s':>8} {'prompt':>7} {'cached':>7} {'share':>6} {'disk':>6} "
        f"{'redis':>6} {'start s':>8}"
    )
    for t in turns:
        ttft = f"{t.ttft_s:.3f}" if t.ttft_s is not None else "n/a"
        disk, redis = (t.metrics.get(f"prefix_cache_{tier}_hits_total", 0) for tier in TIERS)
        print(
            f"{t.case:<18} {ttft:>8} {t.prompt_tokens:>7} {t.cached_tokens:>7} "
            f"{t.cached_share:>6.1%} {disk:>6.0f} {redis:>6.0f} {t.start_s:>8.1f}"
            + (f"  error: {t.error}" if t.error else "")
        )
    for name, value in summary.items():
        print(f"{name:<26} {value:.3f}" if isinstance(value, float) else f"{name:<26} {value}")
    print(f"goals: restarted/warm <= {RESTART_GOAL}, redis cached share >= {REDIS_GOAL:.0%}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    plan, load_before = make_plan(args), record.load_average()
    with tempfile.TemporaryDirectory(prefix="kv-restart-") as tmp:
        restart = run_restart(args, plan, Path(tmp))
        redis = run_redis(args, plan, Path(tmp)) if args.redis else []
    turns = restart["turns"] + redis
    summary = summarize(restart, redis)
    print_report(turns, summary)
    env = record.environment(__spec__.name, None, load_before, server_args=args.server_args)
    print(record.environment_line(env))
    runs = [{**asdict(t), "cached_share": t.cached_share} for t in turns]
    record.write_json(args.out, {"environment": env, "summary": summary, "turns": runs})


if __name__ == "__main__":
    main()
