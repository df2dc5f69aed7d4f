"""Per-request sampling and stopping parameters, shaped like vLLM's `SamplingParams`."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # OpenAI's cap on logprobs / top_logprobs
# the knobs a request may leave unset for the model's generation_config.json to fill (vLLM's list)
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
SamplingDefaults = dict[str, float | int]  # values of MODEL_DEFAULT_FIELDS (engine/sampling_defaults.py)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
REASONING_MODES = ("off", "optional", "open")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Constrain the output to a format (vLLM's `StructuredOutputsParams`); exactly one field set:
    `json` a JSON schema (a dict, or its JSON text), `json_object` any JSON object, `regex` a regular
    expression the whole output matches, `choice` one of the given strings, `grammar` a Lark grammar
    (llguidance's dialect: rule `start`, regexes between slashes) or a GBNF one (rule `root`, `::=`)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # a list is taken too
    grammar: str | None = None
    # where the format starts in a reasoning model's output: "off" at its first token; "optional" after
    # a `<think>...</think>` block if the output opens one first; "open" after the `</think>` that
    # closes the block the prompt opened (the chat route sets this from the rendered prompt)
    reasoning: str = "off"

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name, value in (("json", self.json), ("json_object", self.json_object or None),
                                          ("regex", self.regex), ("choice", self.choice), ("grammar", self.grammar))
                 if value is not None]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of json, json_object, regex, choice and grammar; "
                             f"got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("choice must be a non-empty list of strings")
        if self.reasoning not in REASONING_MODES:
            raise ValueError(f"reasoning must be one of {REASONING_MODES}, got {self.reasoning!r}")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError("json must be a JSON schema: an object, or its JSON text")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0  # EOS and stop tokens are ignored until this many tokens exist
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = no logprobs; k >= 0 = chosen token plus top-k alternatives
    # None = prompt not scored; k >= 0 = each prompt token's logprob (the first has none) plus top-k. The
    # whole prompt then runs through the model: a cached prefix has no logits to read.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # None = free text

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise ValueError("seed must fit in a signed 64-bit integer")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def reads_output_history(self) -> bool:
        """Whether sampling a token looks at the tokens generated before it (penalties, min_tokens)."""
        return self.has_penalties or self.min_tokens > 0
