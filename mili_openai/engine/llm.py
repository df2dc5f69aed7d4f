"""The offline batch API, shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from mili_openai.config import EngineConfig
from mili_openai.engine.contract import check_request
from mili_openai.engine.core import EngineCore
from mili_openai.engine.outputs import RequestOutput
from mili_openai.engine.sampling_params import SamplingParams

PromptInput = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.config = EngineConfig(model=model, **engine_args)
        self.core = EngineCore.from_config(self.config)
        self.tokenizer = self.core.tokenizer

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
                text = prompt if isinstance(prompt, str) else None
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                # ValueError for one that can never run (an adapter not registered included)
                checked = check_request(ids, params, self.core.info, lora_name=lora_name)
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

    @staticmethod
    def _normalise_prompts(prompts) -> list[PromptInput]:
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) for p in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts
