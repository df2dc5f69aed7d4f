"""mili-openai: a small OpenAI-compatible inference server for Qwen3."""

from mili_openai.engine.outputs import CompletionOutput, RequestOutput
from mili_openai.engine.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model; load it on first use so `import mili_openai` stays light.
    if name == "LLM":
        from mili_openai.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'mili_openai' has no attribute {name!r}")
