"""The sampling fields shared by /v1/completions and /generate, and their mapping to SamplingParams.

Pydantic checks types and OpenAI's ranges (each failure a 400 naming the field); `SamplingParams`
re-checks what it owns. Strict mode: `"5"` is not an integer here, as in OpenAI's API.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mili_openai.engine.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MODEL_DEFAULT_FIELDS,
    SamplingParams,
    StructuredOutputsParams,
)
from mili_openai.protocol.errors import APIError

MAX_TEMPERATURE = 2.0
MAX_N = 128  # choices per request: each is a full sequence in the engine
MAX_STOP_STRINGS = 16
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a bias value
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# vLLM's `prompt_logprobs` field: score the prompt's tokens, k alternatives each (protocol/logprobs.py)
PromptLogprobsField = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None


def check_prompt_logprobs(prompt_logprobs: int | None, stream: bool) -> None:
    if prompt_logprobs is not None and stream:
        raise ValueError("prompt_logprobs are not available when stream is true")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: "text", "json_object", or "json_schema" with its `json_schema`."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request field (one of its keys)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None


class SamplingFields(BaseModel):
    """Fields every generation request takes (OpenAI's plus vLLM's extras)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None  # None: the model served
    stream: bool = False
    max_tokens: Annotated[int, Field(ge=1)] | None = DEFAULT_MAX_TOKENS
    temperature: Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]] | None = None
    user: str | None = None
    # vLLM extras
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    skip_special_tokens: bool = True
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None:
            for key in value:
                if not key.lstrip("-").isdigit():
                    raise ValueError(f"logit_bias keys must be token ids as strings, got {key!r}")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one output format the request asks for, from whichever field; a 400 naming the fields when
        it asks for more than one."""
        formats: dict[str, StructuredOutputsParams] = {}
        response_format = self.response_format
        if response_format is not None and response_format.type != "text":
            wants_schema = response_format.type == "json_schema"
            schema = response_format.json_schema.schema_ if wants_schema and response_format.json_schema else None
            if wants_schema and schema is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
            formats["response_format"] = (StructuredOutputsParams(json=schema) if schema is not None
                                          else StructuredOutputsParams(json_object=True))
        if self.structured_outputs is not None:
            field = self.structured_outputs
            try:
                formats["structured_outputs"] = StructuredOutputsParams(
                    json=field.json_, json_object=bool(field.json_object), regex=field.regex, choice=field.choice,
                    grammar=field.grammar)
            except ValueError as exc:
                raise APIError(400, str(exc), param="structured_outputs") from None
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            value = getattr(self, name)
            if value is not None:
                formats[name] = StructuredOutputsParams(**{name.removeprefix("guided_"): value})
        if len(formats) > 1:
            raise APIError(400, f"ask for one output format, not {len(formats)}: {sorted(formats)}",
                           param=sorted(formats)[1])
        return next(iter(formats.values()), None)

    def to_sampling_params(self, vocab_size: int, defaults: Mapping[str, float | int], logprobs: int | None = None,
                           **overrides: Any) -> SamplingParams:
        """The engine's parameters; token ids in `logit_bias` / `stop_token_ids` checked against the vocab.
        `defaults` (the model's, engine/sampling_defaults.py) fill the optional knobs the request leaves out."""
        bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        for token_id in bias:
            if not 0 <= token_id < vocab_size:
                raise APIError(400, f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})",
                               param="logit_bias")
        for token_id in self.stop_token_ids or []:
            if token_id >= vocab_size:
                raise APIError(400, f"stop_token_ids: token id {token_id} is outside the vocabulary "
                                    f"[0, {vocab_size})", param="stop_token_ids")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", param="logprobs")
        fields: dict[str, Any] = dict(
            n=self.n,
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=bias,
            seed=self.seed,
            stop=self.stop_list(),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_outputs_params(),
        )
        # unset optional knobs take the model's defaults, else keep SamplingParams' own
        for name in MODEL_DEFAULT_FIELDS:
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                fields[name] = value
        fields.update(overrides)
        return SamplingParams(**fields)
