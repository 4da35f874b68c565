"""LLM: the offline API on the in-process engine: ``LLM().generate(["Hello"], SamplingParams(max_tokens=32))``."""

from __future__ import annotations

import itertools
from typing import Any

from engine.chat_template import chat_prompt_ids
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.output.outputs import best_choices
from engine.output.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    """The offline API (see the module docstring)."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Prompts as strings (tokenized here) or token-id lists; the final outputs in the prompts' order, and
        for a prompt with ``n`` > 1 its ``n`` samples one after another in ``index`` order (with ``best_of``:
        the ``n`` of highest cumulative logprob, best first)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError("sampling_params: one per prompt, or a single one for all")
        ids = [self._encode(p) if isinstance(p, str) else list(p) for p in prompts]
        request_ids = [f"offline-{next(_OFFLINE_IDS)}" for _ in ids]
        for request_id, prompt_ids, p in zip(request_ids, ids, params):
            self.engine.add_request(
                request_id, prompt_ids, p or SamplingParams(), cache_salt=cache_salt
            )
        finals: dict[str, list[RequestOutput]] = {r: [] for r in request_ids}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step(finals_only=True):
                finals[output.request_id].append(output)
        results = []
        for request_id, p in zip(request_ids, params):
            p = p or SamplingParams()
            samples = sorted(finals[request_id], key=lambda out: out.index)
            results += best_choices(samples, p.n) if p.best_of is not None else samples
        return results

    def beam_search(
        self,
        prompts: str | list[int] | list[str | list[int]],
        beam_width: int = 4,
        max_tokens: int = 16,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        n: int = 1,
        ignore_eos: bool = False,
    ) -> list[RequestOutput]:
        """Beam search (transformers' ``generate(num_beams=beam_width, do_sample=False)`` rules); per prompt
        the ``n`` best hypotheses, best first."""
        params = SamplingParams(
            use_beam_search=True,
            beam_width=beam_width,
            max_tokens=max_tokens,
            n=n,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            ignore_eos=ignore_eos,
        )
        return self.generate(prompts, params)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; rendered with the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.chat_prompt_ids(c) for c in conversations], sampling_params)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (they also end with this process)."""
        self.engine.shutdown()

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_prompt_ids(self._require_tokenizer(), messages)

    def _encode(self, text: str) -> list[int]:
        return self._require_tokenizer().encode(text)

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("prompts: this model has no tokenizer (dummy weights); pass token ids")
        return self.tokenizer


_OFFLINE_IDS = itertools.count()
