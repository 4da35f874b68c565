"""The engine core's grammar matchers held in the zygote's matcher server (engine/output/remote_matchers.py): the
same masks and verdicts as matchers of the process's own, every row's mask in one round trip, copies, and a server
that ended (its requests fail with a message naming response_format, the zygote forks a new one, the next grammar
works) or never existed (the compiler keeps its own matchers)."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.grammar_zygote import spawn
from engine.output.grammar_compiler import GrammarCompiler
from engine.output.remote_matchers import RemoteMatcher, RemoteMatchers
from engine.output.structured_output import accept, token_masks, unpack_mask
from engine.sampling_params import StructuredOutput
from engine.worker.model_sources import ensure_default_model
from engine.worker.tokenizer_files import grammar_source

VOCAB = 49152
SCHEMA = StructuredOutput(
    "json_schema",
    schema=json.dumps(
        {
            "type": "object",
            "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 6}},
            "required": ["n", "s"],
        }
    ),
)


class Row:
    """The part of a Sequence token_masks reads."""

    def __init__(self, grammar) -> None:
        self.grammar = grammar


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(ensure_default_model(Path(EngineConfig().cache_dir)))


@pytest.fixture()
def server(model_dir, tmp_path):
    path = str(tmp_path / "matchers.sock")
    zygote = spawn(model_dir, matchers_path=path)
    try:
        zygote.send_setup(VOCAB, (2,))
        assert zygote.conn.poll(120), "the zygote answers its setup"
        assert zygote.conn.recv()[:2] == ("ready", "ok")
        yield zygote, path
    finally:
        zygote.stop()


@pytest.fixture(scope="module")
def local(model_dir) -> GrammarCompiler:
    return GrammarCompiler(grammar_source(model_dir), VOCAB, (2,))


def test_remote_matchers_give_the_local_masks_and_verdicts_step_by_step(server, local):
    _, path = server
    remote = RemoteMatchers(path, VOCAB)
    spec = local.compiled(SCHEMA)
    pairs = [(remote.matcher(spec.grammar), local.matcher(spec)) for _ in range(3)]
    rng = random.Random(7)
    steps = 0
    while pairs and steps < 40:
        # both sides' masks for every row at once: one round trip for the remote rows
        remote_mask, remote_failed = token_masks([Row(r) for r, _ in pairs], VOCAB)
        local_mask, local_failed = token_masks([Row(m) for _, m in pairs], VOCAB)
        assert remote_failed == local_failed == {}
        assert torch.equal(remote_mask, local_mask)
        allowed = unpack_mask(local_mask, VOCAB)
        kept = []
        for row, (r, m) in enumerate(pairs):
            token = rng.choice(allowed[row].nonzero().flatten().tolist())
            assert r.consume_token(token) == m.consume_token(token)
            assert r.is_accepting() == m.is_accepting()
            if not m.is_stopped():
                kept.append((r, m))
        pairs, steps = kept, steps + 1
    assert not pairs, "every output reached its end"
    assert steps > 5


def test_an_advance_sent_without_waiting_brings_the_next_mask_and_a_refusal_ends_at_it(
    server, local
):
    _, path = server
    remote = RemoteMatchers(path, VOCAB)
    spec = local.compiled(SCHEMA)
    matcher, mine = remote.matcher(spec.grammar), local.matcher(spec)
    brace = local.ll_tokenizer().tokenize_str("{")
    for token in brace:
        accept(Row(matcher), token)
        assert mine.consume_token(token)
    assert matcher.ready is None, "the answer is read with the next call"
    masks, failed = token_masks([Row(matcher), Row(mine)], VOCAB)
    assert failed == {} and torch.equal(masks[0], masks[1])
    assert matcher.ready is not None, "the advance's answer was the next mask"
    # a token the mask does not allow: refused by the server, the request ends at its next mask
    refused = int((~unpack_mask(masks, VOCAB)[0]).nonzero()[0])
    accept(Row(matcher), refused)
    _, failed = token_masks([Row(matcher)], VOCAB)
    assert failed[0].startswith(f"response_format: token {refused} does not fit the grammar")
    assert matcher.is_error()


def test_a_copy_rolls_back_and_validates_on_its_own(server, local):
    _, path = server
    remote = RemoteMatchers(path, VOCAB)
    spec = local.compiled(SCHEMA)
    first = remote.matcher(spec.grammar)
    prefix = local.ll_tokenizer().tokenize_str('{"n": 12')
    for token in prefix:
        assert first.consume_token(token)
    copy = first.deep_copy()
    assert isinstance(copy, RemoteMatcher) and copy.key != first.key
    assert copy.rollback(len(prefix))
    # the copy is back at the start, the first matcher is not: their masks differ
    masks, _ = token_masks([Row(first), Row(copy)], VOCAB)
    assert not torch.equal(masks[0], masks[1])
    assert copy.validate_tokens(prefix) == len(prefix)
    assert first.validate_tokens(prefix) < len(prefix)


def test_a_server_that_ended_fails_its_matchers_and_the_next_grammar_gets_a_new_one(server, local):
    zygote, path = server
    remote = RemoteMatchers(path, VOCAB)
    spec = local.compiled(SCHEMA)
    old = remote.matcher(spec.grammar)
    pid = _server_pid(zygote.process.pid)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ValueError, match="response_format: the grammar process ended"):
        old.consume_token(90)
    _, failed = token_masks([Row(old)], VOCAB)
    assert failed[0].startswith("response_format:")
    deadline = time.monotonic() + 10
    while _server_pid(zygote.process.pid) in (None, pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    new = remote.matcher(spec.grammar)
    masks, failed = token_masks([Row(new)], VOCAB)
    assert failed == {} and unpack_mask(masks, VOCAB)[0].sum() < VOCAB
    assert _server_pid(zygote.process.pid) not in (None, pid)


def test_a_compiler_told_of_no_server_keeps_its_own_matchers(model_dir, tmp_path):
    compiler = GrammarCompiler(grammar_source(model_dir), VOCAB, (2,))
    compiler.use_remote(str(tmp_path / "nobody.sock"))
    matcher = compiler.matcher(compiler.compiled(SCHEMA))
    assert not isinstance(matcher, RemoteMatcher)
    masks, failed = token_masks([Row(matcher)], VOCAB)
    assert failed == {} and 0 < unpack_mask(masks, VOCAB)[0].sum() < VOCAB


def test_a_compiler_with_a_server_builds_no_tokenizer(server, model_dir):
    _, path = server
    compiler = GrammarCompiler(grammar_source(model_dir), VOCAB, (2,))
    compiler.use_remote(path)
    compiled = GrammarCompiler(grammar_source(model_dir), VOCAB, (2,)).compiled(SCHEMA)
    matcher = compiler.matcher(compiled)
    assert isinstance(matcher, RemoteMatcher)
    assert compiler._tokenizer is None


def _server_pid(zygote_pid: int) -> int | None:
    """The zygote's child named pagedchat-gmask (its matcher server)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == zygote_pid and name == "pagedchat-gmask" and fields[0] != "Z":
            return int(entry.name)
    return None
