"""Sampling a launched step: the sampler over the rows whose chunk reached its end, the sampled ids kept on the
device for the next step's pending inputs (``last_sampled``, read there by the step's first kernel,
kernels/prepare_inputs.py), and their copy to the host started on a stream of its own, not waited for:
``LaunchedStep.wait`` blocks when the engine reads them.

A row whose own parameters or grammar make sampling fail ends its request with an error; the batch is sampled
again with a greedy stand-in in its place, so one request's failure never fails the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.sequence import Sequence
from engine.sample.sampler import Sampler, SamplerOutput
from engine.sample.token_logprobs import TokenLogprobs
from engine.output.structured_output import token_masks
from engine.sampling_params import SamplingParams
from engine.distributed import parallel_state


@dataclass(slots=True, eq=False)
class LaunchedStep:
    """A step whose sampled ids are on their way to the host."""

    seqs: list[Sequence]  # the sampled sequences, in row order
    sampled: SamplerOutput | None  # None when no entry of the step reached its end
    # [rows] the sampled ids' host copy (pinned on CUDA), valid after ``event``
    host_ids: torch.Tensor
    event: torch.cuda.Event | None
    prepare_seconds: float  # host time packing inputs (the rest of execute() is launch time)
    # where each sequence holds its pending token
    pending_indices: list[int] = field(default_factory=list)
    # row -> why its request failed (token is void)
    failures: dict[int, str] = field(default_factory=dict)
    # row -> log_softmax [vocab] (beams)
    beam_logprobs: dict[int, torch.Tensor] = field(default_factory=dict)
    # speculative decoding: sequence -> its drafts; its 1 + k rows follow the plain rows (ScheduledBatch)
    drafts: dict[Sequence, int] = field(default_factory=dict)

    def feed_rows(self) -> dict[int, int]:
        """seq_id -> row of its sampled id, for the next step's inputs."""
        return {seq.seq_id: row for row, seq in enumerate(self.seqs)}

    def wait(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Block until the sampled ids are on the host; the ids and (where asked) their logprobs."""
        if self.sampled is None:
            return [], []
        if self.event is not None:
            self.event.synchronize()
        return self.host_ids.tolist(), self.sampled.logprobs()


class StepSampler:
    def __init__(self, config: EngineConfig, broadcast: bool) -> None:
        """``broadcast``: send each step's sampled ids to the other tensor-parallel ranks."""
        self.device, self.eos_token_ids, self.broadcast = (
            config.torch_device,
            config.eos_token_ids,
            broadcast,
        )
        self.sampler = Sampler()
        num_rows = max(config.max_num_seqs, config.max_num_batched_tokens)
        self.last_sampled = torch.zeros(num_rows, dtype=torch.int32, device=self.device)
        self._host_ids = [
            torch.empty(num_rows, dtype=torch.int64, pin_memory=self.device.type == "cuda")
            for _ in range(2)
        ]
        self._turn = 0
        # the ids' copy to the host runs on a stream of its own: on the compute stream, the copy engine's turn
        # between two kernels left the device idle ~5 us a step before the next step's first kernel
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # marks the sampler's work on the compute stream for the copy stream to wait on; re-recorded each step (a
        # wait takes the record made before it)
        self._sampled = torch.cuda.Event() if self.device.type == "cuda" else None

    def launch(
        self, logits: torch.Tensor | None, seqs: list[Sequence], prepare_seconds: float
    ) -> LaunchedStep:
        """Sample ``seqs``' rows of ``logits`` (None: no row reached its end) and start the ids' copy to the
        host; the sampled ids stay on the device as the next step's pending inputs (``last_sampled``)."""
        if logits is None:
            return LaunchedStep([], None, self._host_ids[0][:0], None, prepare_seconds)
        beam_rows = [i for i, seq in enumerate(seqs) if seq.params.use_beam_search]
        beam_logprobs = {}
        # float32 like transformers' beam search; the sampled token of these rows is not used
        if beam_rows:
            log_probs = torch.log_softmax(logits[beam_rows].float(), dim=-1)
            beam_logprobs = dict(zip(beam_rows, log_probs))
        sampled, failures = self._sample_rows(logits, seqs)
        rows = len(seqs)
        # the next step's pending inputs, read on the device
        self.last_sampled[:rows].copy_(sampled.token_ids)
        if rows and self.broadcast:
            parallel_state.broadcast_from_driver(self.last_sampled[:rows])
        if self.device.type != "cuda":
            return LaunchedStep(
                seqs,
                sampled,
                sampled.token_ids,
                None,
                prepare_seconds,
                failures=failures,
                beam_logprobs=beam_logprobs,
            )
        # two buffers: the host may still read the previous one
        host = self._host_ids[self._turn % 2][:rows]
        self._turn += 1
        self._sampled.record()
        stream = self._copy_stream
        stream.wait_event(self._sampled)
        with torch.cuda.stream(stream):
            host.copy_(sampled.token_ids, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        # (the ids' memory is not reused before the copy has read them)
        sampled.token_ids.record_stream(stream)
        return LaunchedStep(
            seqs,
            sampled,
            host,
            event,
            prepare_seconds,
            failures=failures,
            beam_logprobs=beam_logprobs,
        )

    def _sample_rows(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[SamplerOutput, dict[int, str]]:
        """Sample every row; a row whose own parameters or grammar make sampling fail is reported (its request
        ends with an error) and the batch is sampled again with a plain greedy stand-in for it."""
        mask, failures = token_masks(seqs, logits.shape[-1])
        if mask is not None and self.device.type == "cuda":
            # from pageable memory it would sync
            mask = mask.pin_memory().to(self.device, non_blocking=True)
        eos = self.eos_token_ids
        try:
            return self.sampler(logits, seqs, eos, mask), failures
        except Exception:  # noqa: BLE001 - find the row at fault; none found means a fault of the whole step
            for i, seq in enumerate(seqs):
                try:
                    self.sampler(
                        logits[i : i + 1], [seq], eos, None if mask is None else mask[i : i + 1]
                    )
                except Exception as exc:  # noqa: BLE001
                    failures[i] = f"sampling failed: {type(exc).__name__}: {exc}"
            if not failures:
                raise
        stand_ins = [_greedy_stand_in(seq) if i in failures else seq for i, seq in enumerate(seqs)]
        return self.sampler(logits, stand_ins, eos, mask), failures


def _greedy_stand_in(seq: Sequence) -> Sequence:
    """Takes a failed row's place in a batch: sampled greedily, its token is thrown away."""
    return Sequence(
        seq_id=seq.seq_id,
        request_id=f"{seq.request_id} (stand-in)",
        token_ids=list(seq.token_ids[-1:]),
        params=SamplingParams(temperature=0.0),
    )
