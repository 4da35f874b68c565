"""benchmarks.online.serve's pure parts: the flags of --compare-offline, the engine options read from --server-args,
the lean SSE client's parsing, and the serve-vs-engine numbers on timings made up by hand. No network, no model."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.offline.engine_step import engine_config_from_server_args, engine_max_tokens
from benchmarks.online.http_client import StreamResult, apply_chunk
from benchmarks.online.serve import parse_args, summarize
from benchmarks.online.serve_compare import (
    client_warnings,
    comparison,
    comparison_table,
    steady_window,
    tokens_between,
)
from benchmarks.online.sse_client import (
    ClientLoad,
    body_pieces,
    concurrency_share,
    read_events,
)
from engine.config import EngineConfig

# --server-args -> EngineConfig ---------------------------------------------------------------------------


def test_server_args_become_the_engine_config_the_server_builds():
    config = engine_config_from_server_args(
        [
            "--load-format",
            "dummy",
            "--model-config",
            "llama-3.2-1b",
            "--kv-cache-memory-gib",
            "2.5",
            "--num-threads",
            "2",
            "--no-enable-prefix-caching",
            "--enforce-eager",
            "--max-queue",
            "10",
        ]
    )
    assert (config.load_format, config.model_config, config.kv_cache_memory_gib) == (
        "dummy",
        "llama-3.2-1b",
        2.5,
    )
    assert (
        config.num_threads == 2
        and config.enable_prefix_caching is False
        and config.enforce_eager is True
    )


def test_no_server_args_is_the_default_engine():
    assert engine_config_from_server_args([]) == EngineConfig()


def test_an_unknown_server_flag_is_refused():
    with pytest.raises(SystemExit):
        engine_config_from_server_args(["--no-such-flag", "1"])


def test_engine_requests_outlast_the_prefill_and_the_timed_steps():
    # 8 prompts of 512 over a 2048-token budget: ceil(4096 / 2048) + 1 = 3 prefill steps at most
    config = EngineConfig(max_num_batched_tokens=2048, max_model_len=8192)
    assert (
        engine_max_tokens(config, [[0] * 512] * 8, 128, min_steps=40, warmup_steps=5)
        == 128 + 3 + 5 + 40
    )
    config = EngineConfig(max_num_batched_tokens=2048, max_model_len=600)
    assert (
        engine_max_tokens(config, [[0] * 512] * 8, 128, min_steps=40, warmup_steps=5) == 600 - 512
    )


# flags --------------------------------------------------------------------------------------------------


def test_compare_offline_sends_c_requests_from_client_processes():
    args = parse_args(["--compare-offline", "--concurrency", "8", "--endpoint", "completions"])
    assert args.num_prompts == 8 and args.client_processes >= 1 and args.engine_steps == 40
    # the in-process client by default
    assert parse_args(["--concurrency", "8"]).client_processes == 1


@pytest.mark.parametrize(
    "extra",
    [
        ["--endpoint", "chat", "--concurrency", "8"],  # the engine gets token ids: completions only
        ["--endpoint", "completions"],  # no C
        ["--endpoint", "completions", "--concurrency", "8", "--num-prompts", "16"],
        ["--endpoint", "completions", "--concurrency", "8", "--base-url", "http://127.0.0.1:8000"],
        ["--endpoint", "completions", "--concurrency", "8", "--input-len", "100-200"],
    ],
)
def test_compare_offline_refuses_what_would_not_compare(extra: list[str]):
    with pytest.raises(SystemExit):
        parse_args(["--compare-offline", *extra])


def test_concurrency_is_dealt_to_the_client_processes():
    assert [concurrency_share(10, i, 4) for i in range(4)] == [3, 3, 2, 2]
    assert concurrency_share(None, 0, 4) is None


# the lean client's parsing ------------------------------------------------------------------------------


async def _pieces(*pieces: bytes):
    for piece in pieces:
        yield piece


def test_events_split_across_reads_and_pings_are_parsed():
    chunk = b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}],"usage":null}\n\n'
    last = b'data: {"choices":[{"index":0,"text":"b","finish_reason":"length"}],"usage":null}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3}}\n\n'
    two_tokens = (
        b'data: {"choices":[{"index":0,"text":"","token_ids":[7,8],"finish_reason":null}]}\n\n'
    )
    result = StreamResult(sent_at=0.0)
    asyncio.run(
        read_events(
            _pieces(
                chunk[:20],
                chunk[20:] + b": ping - 2026\n\n",
                two_tokens + last + usage,
                b"data: [DONE]\n\n",
            ),
            result,
        )
    )
    assert result.text == "ab" and result.finish_reason == "length" and result.done_at > 0
    assert result.token_counts == [1, 2, 1] and len(result.token_times) == 3
    assert (result.prompt_tokens, result.completion_tokens) == (4, 3)


def test_chunked_transfer_encoding_is_undone():
    async def read() -> list[bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(b"5\r\nhello\r\n3;ext=1\r\nabc\r\n0\r\n\r\n")
        reader.feed_eof()
        return [piece async for piece in body_pieces(reader, {"transfer-encoding": "chunked"})]

    assert asyncio.run(read()) == [b"hello", b"abc"]


def test_an_event_counts_its_token_ids_else_one_token():
    result = StreamResult(sent_at=0.0)
    apply_chunk({"choices": [{"text": "", "token_ids": [1, 2, 3]}]}, 1.0, result)
    apply_chunk({"choices": [{"text": ""}]}, 2.0, result)
    assert result.token_counts == [3, 1] and result.token_times == [1.0, 2.0]


# serve-vs-engine numbers ----------------------------------------------------------------------------------


def _stream(token_times: list[float], done_at: float) -> StreamResult:
    return StreamResult(
        sent_at=0.0,
        done_at=done_at,
        token_times=token_times,
        token_counts=[1] * len(token_times),
        finish_reason="length",
        prompt_tokens=8,
        completion_tokens=len(token_times),
    )


# request 1: 5 tokens 0.1 s apart from 1.0; request 2: 4 tokens 0.2 s apart from 1.2; both sent at 0
FAST, SLOW = _stream([1.0, 1.1, 1.2, 1.3, 1.4], 1.4), _stream([1.2, 1.4, 1.6, 1.8], 1.8)
ENGINE = {"batch": 2, "step_ms_mean": 50.0, "step_ms_median": 49.0, "tok_s": 2 / 0.050}


def test_the_steady_window_runs_from_the_last_first_token_to_the_first_last_token():
    assert steady_window([FAST, SLOW]) == (1.2, 1.4)
    # in (1.2, 1.4]: 1.3 and 1.4 of the fast one, 1.4 of the slow one (its 1.2 came from the prefill)
    assert tokens_between([FAST, SLOW], 1.2, 1.4) == 3
    # never all streaming
    assert steady_window([_stream([1.0, 1.1], 1.1), _stream([1.5, 1.6], 1.6)]) is None


def test_comparison_against_the_engine_step():
    summary = summarize([FAST, SLOW], 1.8, [{"max_tokens": 5}, {"max_tokens": 4}])
    c = comparison(ENGINE, summary, [FAST, SLOW])
    # TPOT: (1.4 - 1.0) / 4 = 0.1 s and (1.8 - 1.2) / 3 = 0.2 s, median 150 ms over a 50 ms step
    assert c["served_tpot_p50_ms"] == pytest.approx(150.0) and c["tpot_over_step"] == pytest.approx(
        3.0
    )
    # ITL: four gaps of 0.1 and three of 0.2: the median of seven is 0.1 s
    assert c["served_itl_p50_ms"] == pytest.approx(100.0) and c["itl_over_step"] == pytest.approx(
        2.0
    )
    # steady: 3 tokens in 0.2 s = 15 tok/s of the engine's 2 / 0.05 = 40; overall 9 tokens in 1.8 s = 5 tok/s
    assert c["delivered_steady_tok_s"] == pytest.approx(15.0) and c[
        "steady_share_of_engine"
    ] == pytest.approx(0.375)
    assert c["delivered_overall_tok_s"] == pytest.approx(5.0) and c[
        "overall_share_of_engine"
    ] == pytest.approx(0.125)
    # TTFT 1.0 and 1.2 s: p50 1.1 s, p99 1.0 + 0.99 * 0.2 s
    assert c["ttft_p50_ms"] == pytest.approx(1100.0) and c["ttft_p99_ms"] == pytest.approx(1198.0)
    table = comparison_table(c)
    assert "| 3.00x |" in table and "| 38% |" in table and "| 12% |" in table


def test_coalesced_events_count_every_token_they_carry():
    coalesced = _stream([1.0, 1.3], 1.3)
    coalesced.token_counts = [1, 3]  # the second event carried three tokens
    assert tokens_between([coalesced], 1.0, 1.3) == 3


def test_a_busy_client_process_is_flagged():
    loads = [
        ClientLoad(requests=4, events=1000, wall_s=10.0, cpu_s=2.0),
        ClientLoad(requests=4, events=1000, wall_s=10.0, cpu_s=9.0),
    ]
    assert loads[0].events_per_cpu_s == 500.0
    warnings = client_warnings(loads)
    assert len(warnings) == 1 and warnings[0].startswith("client process 1 was busy 90%")
