"""The contract between the API side and the engine: what the engine tells the API side once it has loaded
(`EngineInfo`), and the only kind of request it takes (`EngineRequest`, made by `check_request`).

The API side (the routes, the offline `LLM`) checks each request once, with `check_request`, before
`EngineClient.submit`; the engine takes an `EngineRequest` as checked and does not check it again, also when it
arrives from another process (engine/process_client.py). Importing this module pulls in neither torch nor the
model.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mili_openai.engine.image_inputs import TEXT_ONLY_MODEL, ImageFeatures, RequestImages, place_images
from mili_openai.engine.pooling_spec import PoolingSpec
from mili_openai.engine.sampling_params import SamplingDefaults, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from mili_openai.model.vision_config import VisionSpec

PROMPT_FIELD = "prompt"  # what a request's prompt is called in errors, unless the caller names its own field
MAX_TOKENS_FIELD = "max_tokens"  # the field a context overflow names, where the caller names its prompt's


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """The loaded engine, as the API side sees it: built once by the engine (`EngineCore.info`), and sent once
    to a server in another process."""

    tokenizer: PreTrainedTokenizerBase  # the engine's own: the server tokenizes exactly as the engine decodes
    model_path: Path | None
    # prompt + output tokens of one sequence: the model's context, never more than the whole KV pool holds
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    quantization: str | None  # what the weights are (int8, int4, awq, ...), None for unquantized
    sampling_defaults: SamplingDefaults  # what a request's omitted sampling fields become
    vision: VisionSpec | None = None  # a model that takes images: its placeholder tokens and preprocessing
    pooling: PoolingSpec | None = None  # a pooling model's output (embeddings, rerank scores); None: it generates
    # the LoRA adapters served at start (`--lora-modules`), in their order: (name, path); those served now, after
    # loads and unloads at run time, are `EngineClient.lora_adapters()`
    lora_adapters: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A request that passed `check_request`: it can run to its end in this engine."""

    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens resolved against the context length
    images: RequestImages | None = None  # the prompt's images and their placement (engine/image_inputs.py)
    pooled: bool = False  # a pooling request: the prompt's vector (PoolingSpec) instead of tokens
    lora_name: str | None = None  # the LoRA adapter it runs with (one served: the engine checks); None: the base


class RequestError(ValueError):
    """A request that can never run: a 400 whose `param` names the field at fault (server/errors.py)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled with its param, from an engine process to the server
        return type(self), (str(self), self.param)


class UnknownLoraAdapter(RequestError):
    """A LoRA adapter name the engine does not serve (never loaded, or unloaded): a 404 (server/errors.py)."""


class LoraAdapterExists(ValueError):
    """A load under a name already served (or being loaded): a 400, as vLLM answers."""


def check_request(prompt_token_ids: list[Any], params: SamplingParams, info: EngineInfo,
                  prompt_field: str | None = None, images: list[ImageFeatures] | None = None,
                  lora_name: str | None = None) -> EngineRequest:
    """The request as the engine takes it; RequestError for one that can never run. `prompt_field`: what the
    client called its prompt ("messages" for a chat); given, the errors name the field at fault (`param`), as
    OpenAI's chat errors do. `images`: the prompt's preprocessed images; `lora_name`: the LoRA adapter to run with
    (None: the base model), which the engine checks as it takes the request, since adapters come and go at run
    time (`UnknownLoraAdapter`)."""
    if info.pooling is not None:
        raise RequestError(f"this server runs a pooling model ({info.pooling.task}): it does not generate text; "
                           "use /v1/embeddings, /v1/rerank or /score")
    prompt = _checked_prompt(prompt_token_ids, info, prompt_field)
    vocab_size, max_model_len = info.vocab_size, info.max_model_len
    what = prompt_field or PROMPT_FIELD
    if any(not 0 <= t < vocab_size for t in itertools.chain(params.logit_bias, params.stop_token_ids)):
        raise RequestError(f"logit_bias and stop_token_ids keys must be token ids in [0, {vocab_size})")
    if len(prompt) >= max_model_len:
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens, but {len(prompt)} tokens "
                           f"are in the {what}, leaving no room for output.", prompt_field)
    room = max_model_len - len(prompt)
    if params.max_tokens is not None and params.max_tokens > room:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(prompt) + params.max_tokens} tokens ({len(prompt)} in the {what}, {params.max_tokens} in the "
            f"completion). Please reduce the length of the {what} or the completion.",
            MAX_TOKENS_FIELD if prompt_field else None)
    placed = _place_images(prompt, images, info, prompt_field) if images else None
    max_tokens = params.max_tokens if params.max_tokens is not None else room
    return EngineRequest(prompt, params, max_tokens, placed, lora_name=lora_name)


def _place_images(prompt: list[int], images: list[ImageFeatures], info: EngineInfo,
                  prompt_field: str | None) -> RequestImages:
    if info.vision is None:
        raise RequestError(TEXT_ONLY_MODEL, prompt_field)
    try:
        return place_images(prompt, info.vision.image_token_id, images)
    except ValueError as exc:
        raise RequestError(str(exc), prompt_field) from None


def check_pooling_request(prompt_token_ids: list[Any], info: EngineInfo, prompt_field: str = "input",
                          truncate_to: int | None = None) -> EngineRequest:
    """A pooling request (its prompt's vector, no output) as the engine takes it; RequestError for one that can
    never run. `truncate_to`: keep the prompt's last so many tokens (vLLM's `truncate_prompt_tokens`), else a
    prompt over the context is refused."""
    if info.pooling is None:
        raise RequestError("this server runs a generative model: embeddings and scores need a pooling model "
                           "(mili serve CKPT --runner pooling)")
    prompt = _checked_prompt(prompt_token_ids, info, prompt_field)
    if truncate_to is not None:
        prompt = prompt[-truncate_to:]
    if len(prompt) > info.max_model_len:
        raise RequestError(f"This model's maximum context length is {info.max_model_len} tokens, but {len(prompt)} "
                           f"tokens are in the {prompt_field}. Shorten it, or set truncate_prompt_tokens.",
                           prompt_field)
    # nothing is sampled: the parameters only fill the sequence's fields
    return EngineRequest(prompt, SamplingParams(max_tokens=1), max_tokens=1, pooled=True)


def _checked_prompt(prompt_token_ids: list[Any], info: EngineInfo, prompt_field: str | None) -> list[int]:
    prompt = [int(t) for t in prompt_token_ids]
    if not prompt:
        raise RequestError("the prompt is empty: at least one token is needed", prompt_field)
    if min(prompt) < 0 or max(prompt) >= info.vocab_size:
        raise RequestError(f"prompt token ids must be in [0, {info.vocab_size})", prompt_field)
    return prompt
