"""The offline batch API, shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)`,
`.chat(messages, sampling_params)` (images as image parts: engine/offline_chat.py), and for a
pooling model `LLM(model=..., runner="pooling").embed(prompts)`, `.score(text_1, text_2)` and `.classify(prompts)`.

A prompt with images is vLLM's dict: `{"prompt": text, "multi_modal_data": {"image": image or [images]}}` (or
`"prompt_token_ids"`), its text holding one `<|image_pad|>` per image as the chat template writes it; images are
PIL images or (H, W, 3) uint8 arrays."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from mili_openai.config import EngineConfig
from mili_openai.engine.contract import check_pooling_request, check_request
from mili_openai.engine.core import EngineCore
from mili_openai.engine.image_inputs import TEXT_ONLY_MODEL, ImageFeatures
from mili_openai.engine.image_processor import ImagePreprocessor, as_rgb_image, expand_image_placeholders
from mili_openai.engine.offline_chat import chat_prompt
from mili_openai.engine.outputs import (
    ClassificationOutput,
    EmbeddingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
)
from mili_openai.engine.pooling_spec import (
    CLASSIFY,
    EMBED,
    QWEN3_RERANK_TEMPLATE,
    cosine,
    finish_vector,
    render_pair,
)
from mili_openai.engine.sampling_params import SamplingParams

PromptInput = str | list[int] | dict
MULTI_MODAL_DATA = "multi_modal_data"


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.config = EngineConfig(model=model, **engine_args)
        self.core = EngineCore.from_config(self.config)
        self.tokenizer = self.core.tokenizer
        vision = self.core.info.vision
        self._preprocess_image = ImagePreprocessor(vision) if vision is not None else None

    def expert_load(self) -> dict[int, list[int]]:
        """For a Qwen3-MoE model, {sparse layer index: how many (token, expert) pairs each expert has received
        since load}, to debug routing balance; empty for a dense model. Counted in the forward (prefill and
        decode tokens, recomputed ones included). Under CUDA graphs the decode steps' counts also include the
        padding rows of each step's graph bucket (--enforce-eager counts exactly)."""
        return self.core.runner.expert_load()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no SamplingParams: the model's generation_config.json
        defaults (see engine/sampling_defaults.py), as vLLM's method of this name returns."""
        return self.core.default_sampling_params()

    def generate(
        self,
        prompts: PromptInput | SequenceABC[PromptInput],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        lora_request: str | SequenceABC[str | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order, with `params.n` outputs each (the engine fans a prompt
        out into its samples: engine/parallel_sampling.py). `lora_request`: the name of a LoRA adapter the
        config registered (`LLM(model, lora={"modules": [(name, path)], ...})`) to run every prompt with, or one
        name (None: the base model) per prompt."""
        prompt_list = self._normalise_prompts(prompts)
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError("give one SamplingParams, or exactly one per prompt")

        if lora_request is None or isinstance(lora_request, str):
            lora_list = [lora_request] * len(prompt_list)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompt_list):
                raise ValueError("give one lora_request, or exactly one per prompt")

        results: dict[str, RequestOutput] = {}  # by engine request id, in prompt order
        try:
            for prompt_index, (prompt, params, lora_name) in enumerate(zip(prompt_list, params_list, lora_list)):
                text, ids, images = self._prompt_inputs(prompt)
                # ValueError for one that can never run (an adapter not registered included)
                checked = check_request(ids, params, self.core.info, images=images, lora_name=lora_name)
                request = self.core.add(checked, f"llm-{id(self)}-{prompt_index}")
                results[request.request_id] = RequestOutput.empty(str(prompt_index), ids, params.n, prompt=text)
            self._run_to_completion(results)
        finally:
            for request_id in results:
                self.core.abort(request_id)  # a no-op for finished requests; frees the rest after an error
        return list(results.values())

    def chat(
        self,
        messages: list[dict] | SequenceABC[list[dict]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        lora_request: str | SequenceABC[str | None] | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """vLLM's: one conversation (OpenAI-format message dicts) or a list of them, each rendered with the model's
        chat template, its image parts placed where they sit (engine/offline_chat.py), then generated as `generate`
        does. One RequestOutput per conversation."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [chat_prompt(self.tokenizer, conversation, chat_template_kwargs or {}, add_generation_prompt)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, lora_request)

    def embed(self, prompts: PromptInput | SequenceABC[PromptInput], truncate_prompt_tokens: int | None = None,
              dimensions: int | None = None, normalize: bool | None = None) -> list[PoolingRequestOutput]:
        """Each prompt's embedding (an embedding model: `runner="pooling"`), its first `dimensions` values if
        given, L2-normalised as the model's own pooling says unless `normalize` says otherwise."""
        spec = self.core.info.pooling
        if spec is None or spec.task != EMBED:
            raise ValueError("embed needs an embedding model (LLM(model, runner='pooling'))")
        prompt_ids = self._prompt_ids(prompts)
        vectors = self._pool(prompt_ids, truncate_prompt_tokens)
        normalize = spec.normalize if normalize is None else normalize
        return [PoolingRequestOutput(str(index), ids, EmbeddingOutput(finish_vector(v, dimensions, normalize).tolist()))
                for index, (ids, v) in enumerate(zip(prompt_ids, vectors))]

    def score(self, text_1: str | list[str], text_2: str | list[str],
              instruction: str | None = None) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.score`: text_1 against each text_2 (or pairwise, equal lengths). A reranker (or a classifier
        of one label) scores each pair in its prompt (Qwen3-Reranker's format); an embedding model by the cosine of
        their embeddings."""
        spec = self.core.info.pooling
        if spec is None or (spec.task == CLASSIFY and not spec.scores_pairs):
            raise ValueError("score needs a reranker, a classifier of one label or an embedding model "
                             "(LLM(model, runner='pooling'))")
        first = [text_1] if isinstance(text_1, str) else list(text_1)
        second = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(first) not in (1, len(second)):
            raise ValueError("give one text_1, or as many as text_2")
        pairs = list(zip(first * len(second), second)) if len(first) == 1 else list(zip(first, second))
        if spec.scores_pairs:
            prompt_ids = [self.tokenizer.encode(render_pair(QWEN3_RERANK_TEMPLATE, query, document, instruction),
                                                add_special_tokens=False) for query, document in pairs]
            scores = [vector[0] for vector in self._pool(prompt_ids, None)]
        else:
            texts = list(dict.fromkeys(text for pair in pairs for text in pair))
            prompt_ids = [self.tokenizer.encode(text) for text in texts]
            vectors = dict(zip(texts, self._pool(prompt_ids, None)))
            scores = [cosine(vectors[a], vectors[b]) for a, b in pairs]
        return [PoolingRequestOutput(str(index), [], ScoringOutput(score)) for index, score in enumerate(scores)]

    def classify(self, prompts: PromptInput | SequenceABC[PromptInput],
                 truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.classify`: each prompt's label probabilities (`outputs.probs`, by label id) from a
        Qwen3ForSequenceClassification checkpoint's score head at its last token."""
        spec = self.core.info.pooling
        if spec is None or spec.task != CLASSIFY:
            raise ValueError("classify needs a sequence-classification checkpoint (Qwen3ForSequenceClassification)")
        prompt_ids = self._prompt_ids(prompts)
        vectors = self._pool(prompt_ids, truncate_prompt_tokens)
        return [PoolingRequestOutput(str(index), ids, ClassificationOutput(list(probs)))
                for index, (ids, probs) in enumerate(zip(prompt_ids, vectors))]

    def _prompt_ids(self, prompts: PromptInput | SequenceABC[PromptInput]) -> list[list[int]]:
        return [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in self._normalise_prompts(prompts)]

    def _pool(self, prompt_ids: list[list[int]], truncate_to: int | None) -> list[list[float]]:
        """Every prompt's vector from the engine (engine/pooling_spec.py), in order."""
        results: dict[str, list[float]] = {}
        request_ids = []
        try:
            for index, ids in enumerate(prompt_ids):
                request_id = f"llm-{id(self)}-pool-{index}"
                self.core.add(check_pooling_request(ids, self.core.info, truncate_to=truncate_to), request_id)
                request_ids.append(request_id)
            self._run_steps(lambda delta: results.__setitem__(delta.request_id, delta.pooled))
        finally:
            for request_id in request_ids:
                self.core.abort(request_id)
        return [results[request_id] for request_id in request_ids]

    def _run_to_completion(self, results: dict[str, RequestOutput]) -> None:
        self._run_steps(lambda delta: results[delta.request_id].add(delta))

    def _run_steps(self, on_delta) -> None:
        while self.core.has_work():
            scheduled = self.core.schedule()
            if scheduled is None:
                continue
            batch, step = scheduled
            output = self.core.runner.execute(step)
            for delta in self.core.postprocess(batch, output):
                on_delta(delta)

    def _prompt_inputs(self, prompt: PromptInput) -> tuple[str | None, list[int], list[ImageFeatures] | None]:
        """(text or None, token ids with image placeholders expanded, images or None)."""
        if not isinstance(prompt, dict):
            return (prompt, self.tokenizer.encode(prompt), None) if isinstance(prompt, str) else (None, list(prompt), None)
        text = prompt.get("prompt")
        ids = self.tokenizer.encode(text) if text is not None else list(prompt["prompt_token_ids"])
        data = (prompt.get(MULTI_MODAL_DATA) or {}).get("image")
        if data is None:
            return text, ids, None
        if self._preprocess_image is None:
            raise ValueError(TEXT_ONLY_MODEL)
        images = [self._preprocess_image(as_rgb_image(image))
                  for image in (data if isinstance(data, (list, tuple)) else [data])]
        return text, expand_image_placeholders(ids, images, self.core.info.vision.image_token_id), images

    @staticmethod
    def _normalise_prompts(prompts) -> list[PromptInput]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) for p in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts
