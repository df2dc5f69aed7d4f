"""The offline batch API, shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)`.

A prompt with images is vLLM's dict: `{"prompt": text, "multi_modal_data": {"image": image or [images]}}` (or
`"prompt_token_ids"`), its text holding one `<|image_pad|>` per image as the chat template writes it; images are
PIL images or (H, W, 3) uint8 arrays."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from mili_openai.config import EngineConfig
from mili_openai.engine.contract import check_request
from mili_openai.engine.core import EngineCore
from mili_openai.engine.image_inputs import TEXT_ONLY_MODEL, ImageFeatures
from mili_openai.engine.image_processor import ImagePreprocessor, as_rgb_image, expand_image_placeholders
from mili_openai.engine.outputs import RequestOutput
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
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order, with `params.n` outputs each (the engine fans a prompt
        out into its samples: engine/parallel_sampling.py)."""
        prompt_list = self._normalise_prompts(prompts)
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError("give one SamplingParams, or exactly one per prompt")

        results: dict[str, RequestOutput] = {}  # by engine request id, in prompt order
        try:
            for prompt_index, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                text, ids, images = self._prompt_inputs(prompt)
                checked = check_request(ids, params, self.core.info, images=images)  # ValueError: can never run
                request = self.core.add(checked, f"llm-{id(self)}-{prompt_index}")
                results[request.request_id] = RequestOutput.empty(str(prompt_index), ids, params.n, prompt=text)
            self._run_to_completion(results)
        finally:
            for request_id in results:
                self.core.abort(request_id)  # a no-op for finished requests; frees the rest after an error
        return list(results.values())

    def _run_to_completion(self, results: dict[str, RequestOutput]) -> None:
        while self.core.has_work():
            scheduled = self.core.schedule()
            if scheduled is None:
                continue
            batch, step = scheduled
            output = self.core.runner.execute(step)
            for delta in self.core.postprocess(batch, output):
                results[delta.request_id].add(delta)

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
