"""SamplingParams: how one request is sampled and when it stops (vLLM semantics)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16  # OpenAI allows 4; room for chat templates' own stop strings
MAX_STOP_STRING_CHARS = 256
# a request's rank among its tenant's requests: an integer in [-MAX_PRIORITY, MAX_PRIORITY]
MAX_PRIORITY = 1000
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # entries; OpenAI's limit
MAX_TEMPERATURE = 100.0  # the engine's bound (the HTTP API's is OpenAI's: 2)
MAX_SAMPLES = 128  # n and best_of: OpenAI's limit on n
MAX_SPECULATIVE_CONTEXT = 32768  # token ids of speculative_context
_INT32 = 2**31
_GREEDY_EPS = 1e-5
STRUCTURED_KINDS = ("json_object", "json_schema", "lark")


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    """Constrain the output to a grammar: any JSON object, JSON valid against ``schema`` (JSON text), or the
    llguidance Lark grammar ``schema`` holds (``lark``: the front builds one for tool calls)."""

    kind: str
    schema: str | None = None
    # the compiled grammar (llguidance's), set by the server's front after compiling and checking the schema off
    # its event loop, so the engine core does not compile it again on its step loop
    grammar: str | None = None

    def __post_init__(self) -> None:
        _check(
            self.kind in STRUCTURED_KINDS,
            "response_format",
            f"type must be one of {STRUCTURED_KINDS}",
        )
        _check(
            (self.schema is not None) == (self.kind != "json_object"),
            "response_format",
            "json_schema and lark need a schema; json_object takes none",
        )


@dataclass(slots=True)
class SamplingParams:
    # samples of one prompt (parallel sampling: the prompt is computed once, its blocks shared)
    n: int = 1
    # sample this many (>= n) and keep the n of highest cumulative logprob
    best_of: int | None = None
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None  # same seed, same output (a 64-bit integer)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None = until max_model_len
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens exist
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k = sampled token's logprob plus top-k alternatives
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    structured_output: StructuredOutput | None = None
    # beam search (an extension, as in vLLM): the n best of beam_width beams, deterministic (sampling fields
    # are ignored); transformers' rules, so generate(num_beams=beam_width, do_sample=False) gives the same tokens
    use_beam_search: bool = False
    beam_width: int = 4
    length_penalty: float = 1.0  # a hypothesis scores sum(logprobs) / length ** length_penalty
    early_stopping: bool | str = False  # False (transformers' heuristic), True, or "never"
    # speculative decoding, where the engine runs it: False keeps this request to one token a step (its output
    # is the same either way; an off switch for a client that wants even steps)
    speculative: bool = True
    # token ids the n-gram drafts may also come from besides the request's own (a regenerated or edited turn's
    # earlier reply: likely again in part); at most MAX_SPECULATIVE_CONTEXT
    speculative_context: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check(
            _is_int(self.n) and 1 <= self.n <= MAX_SAMPLES, "n", f"must be in [1, {MAX_SAMPLES}]"
        )
        _check(isinstance(self.speculative, bool), "speculative", "must be true or false")
        self.speculative_context = list(self.speculative_context)
        _check(
            len(self.speculative_context) <= MAX_SPECULATIVE_CONTEXT
            and all(_is_int(t) and t >= 0 for t in self.speculative_context),
            "speculative_context",
            f"must be at most {MAX_SPECULATIVE_CONTEXT} token ids (integers >= 0)",
        )
        _check(
            self.best_of is None
            or (_is_int(self.best_of) and self.n <= self.best_of <= MAX_SAMPLES),
            "best_of",
            f"must be in [n, {MAX_SAMPLES}]",
        )
        # (above ~100 the logits are flat anyway; far above, 1 / temperature underflows float32 to noise)
        _check(
            _is_num(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
            "temperature",
            f"must be in [0, {MAX_TEMPERATURE}]",
        )
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(
            _is_int(self.top_k) and -1 <= self.top_k < _INT32,
            "top_k",
            "must be -1, 0 (off) or a positive integer (at most the vocabulary size)",
        )
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(
            self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64),
            "seed",
            "must be a 64-bit integer",
        )
        _check(
            _is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            "must be in [-2, 2]",
        )
        _check(
            _is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            "must be in [-2, 2]",
        )
        _check(
            _is_num(self.repetition_penalty) and 0.01 <= self.repetition_penalty <= 100,
            "repetition_penalty",
            "must be in [0.01, 100]",
        )
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and 1 <= self.max_tokens < _INT32),
            "max_tokens",
            "must be >= 1",
        )
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens < _INT32, "min_tokens", "must be >= 0"
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must not exceed max_tokens",
        )
        _check(
            all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop)
            and len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_STRING_CHARS} characters",
        )
        _check(
            all(_is_int(t) and 0 <= t < _INT32 for t in self.stop_token_ids)
            and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} non-negative token ids",
        )
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
            _check(
                len(self.logit_bias) <= MAX_LOGIT_BIAS
                and all(_is_int(t) and 0 <= t < _INT32 for t in self.logit_bias)
                and all(_is_num(b) and -100 <= b <= 100 for b in self.logit_bias.values()),
                "logit_bias",
                f"at most {MAX_LOGIT_BIAS} token ids mapped to biases in [-100, 100]",
            )
        _check(
            self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
            "response_format",
            "must be a StructuredOutput",
        )
        _check(
            self.logprobs is None
            or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"must be in [0, {MAX_LOGPROBS}]",
        )
        _check(isinstance(self.use_beam_search, bool), "use_beam_search", "must be a boolean")
        _check(
            _is_int(self.beam_width) and 1 <= self.beam_width <= MAX_SAMPLES,
            "beam_width",
            f"must be in [1, {MAX_SAMPLES}]",
        )
        _check(
            _is_num(self.length_penalty) and -10 <= self.length_penalty <= 10,
            "length_penalty",
            "must be in [-10, 10]",
        )
        _check(
            isinstance(self.early_stopping, bool) or self.early_stopping == "never",
            "early_stopping",
            'must be true, false or "never"',
        )
        if self.use_beam_search:
            _check(
                self.n <= self.beam_width, "n", "must not exceed beam_width with use_beam_search"
            )
            for name, unsupported in (
                ("best_of", self.best_of is not None),
                ("logprobs", self.logprobs is not None),
                ("stop", bool(self.stop)),
                ("stop_token_ids", bool(self.stop_token_ids)),
                ("min_tokens", self.min_tokens > 0),
                ("logit_bias", bool(self.logit_bias)),
                ("response_format", self.structured_output is not None),
                ("presence_penalty", self.uses_penalties),
            ):
                _check(not unsupported, name, "is not supported with use_beam_search")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def num_samples(self) -> int:
        """Outputs the request ends with: ``n`` (sampled from ``best_of`` when given)."""
        return self.n if self.use_beam_search else self.best_of or self.n

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs at once: its beams or its samples."""
        return self.beam_width if self.use_beam_search else self.best_of or self.n

    def sample_seed(self, index: int) -> int | None:
        """The seed of sample ``index`` of a seeded request: sample 0 keeps it (n = 1 is unchanged), the others
        get their own, each a pure function of (seed, index), so every sample is reproducible on its own."""
        if self.seed is None or index == 0:
            return self.seed
        return (self.seed + index * 0x9E3779B97F4A7C15) % 2**64

    @property
    def needs_known_history(self) -> bool:
        """Sampling reads the values of earlier output tokens (not only their count)."""
        return self.uses_penalties or self.structured_output is not None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    # NaN fails
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")
