"""Default sampling settings from the model's `generation_config.json`, as vLLM and SGLang apply them.

Model makers ship their recommended settings there (Qwen3: temperature 0.6, top_p 0.95, top_k 20; its
card warns that other settings, greedy above all, make it repeat itself). A request that leaves one of
these fields out gets the file's value; a request's own value always wins, and `--generation-config none`
keeps OpenAI's defaults (temperature 1, no truncation). vLLM reads the same five fields; its
`max_new_tokens` -> `max_tokens` mapping is not done here, since OpenAI's `max_tokens` defaults differ per
route.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mili_openai.engine.sampling_params import MODEL_DEFAULT_FIELDS, SamplingDefaults, SamplingParams
from mili_openai.model.config import GENERATION_CONFIG_FILE

GENERATION_CONFIG_AUTO = "auto"  # the model directory's own file
GENERATION_CONFIG_NONE = "none"  # ignore the file: OpenAI's defaults
INTEGER_FIELDS = ("top_k",)  # the others are floats in SamplingParams


def read_sampling_defaults(source: str, model_path: Path) -> SamplingDefaults:
    """The defaults `source` names: "auto" (the model's file, none if it has no file), "none" ({}), or a
    directory holding a `generation_config.json`. Raises ValueError for a file whose values cannot run."""
    if source == GENERATION_CONFIG_NONE:
        return {}
    if source == GENERATION_CONFIG_AUTO:
        path = model_path / GENERATION_CONFIG_FILE
        if not path.is_file():
            return {}
    else:
        path = Path(source).expanduser() / GENERATION_CONFIG_FILE
        if not path.is_file():
            raise ValueError(f"generation config {source!r}: no {GENERATION_CONFIG_FILE} in that directory")
    try:
        generation = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} cannot be read as JSON: {exc}") from exc
    if not isinstance(generation, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return sampling_defaults_from(generation, str(path))


def sampling_defaults_from(generation: dict[str, Any], origin: str) -> SamplingDefaults:
    """The sampling fields `generation` sets (null counts as unset), checked as a request's would be."""
    defaults: SamplingDefaults = {}
    for name in MODEL_DEFAULT_FIELDS:
        kind = int if name in INTEGER_FIELDS else float
        value = generation.get(name)
        if value is None:
            continue
        # bool is an int to Python; JSON allows NaN; a float top_k (20.0) is accepted only when it is whole
        if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
                or (kind is int and value != int(value))):
            raise ValueError(f"{origin}: {name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        defaults[name] = kind(value)
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"{origin}: {exc}") from exc
    return defaults


def describe_sampling_defaults(defaults: SamplingDefaults) -> str:
    """One line for the startup log: what a request that sets none of these fields samples with."""
    if not defaults:
        return "sampling defaults: OpenAI's (temperature 1, no top_p/top_k/min_p, no repetition penalty)"
    settings = ", ".join(f"{name}={value}" for name, value in defaults.items())
    return (f"sampling defaults from the model's {GENERATION_CONFIG_FILE}: {settings} (a request's own values "
            "win; --generation-config none keeps OpenAI's defaults)")
