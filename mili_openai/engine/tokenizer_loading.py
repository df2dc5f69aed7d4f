"""A checkpoint's tokenizer with the chat template its server should render.

transformers' tokenizer takes its template from chat_template.jinja, else tokenizer_config.json. A vision-language
checkpoint may also ship the processor's template in the older chat_template.json, the one that places images
(vLLM prefers the processor's template too): where that file is there and no chat_template.jinja, it wins.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

TEMPLATE_FILE = "chat_template.jinja"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"  # {"chat_template": "..."}
TEMPLATE_KEY = "chat_template"
TOKENIZERS_KEPT = 2  # a target's and its draft's (~80 MB each for Qwen's vocabulary)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # files no tokenizer is read from


def load_tokenizer(model_path: str | Path) -> Any:
    """The tokenizer of the checkpoint at `model_path`, its chat template the processor's where one is shipped.

    Read once per process for the same files (~0.5 s of CPU for Qwen's vocabulary, at every engine's start):
    engines on one checkpoint, and a draft's tokenizer check, share it, and only read it. A file of the
    checkpoint changed or added since (its size or modification time) means a new read."""
    directory = Path(model_path).resolve()
    return _read_tokenizer(directory, _files_stamp(directory))


def _files_stamp(directory: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, size, modification time) of each of the checkpoint's files but its weights."""
    with os.scandir(directory) as entries:
        stats = [(entry.name, entry.stat()) for entry in entries
                 if entry.is_file() and not entry.name.endswith(WEIGHT_SUFFIXES)]
    return tuple(sorted((name, stat.st_size, stat.st_mtime_ns) for name, stat in stats))


@functools.lru_cache(maxsize=TOKENIZERS_KEPT)
def _read_tokenizer(directory: Path, stamp: tuple[tuple[str, int, int], ...]) -> Any:
    """`stamp`: the files as they were read (only part of the cache's key)."""
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    processor_template = directory / PROCESSOR_TEMPLATE_FILE
    if processor_template.is_file() and not (directory / TEMPLATE_FILE).is_file():
        template = json.loads(processor_template.read_text()).get(TEMPLATE_KEY)
        if isinstance(template, str) and template:
            tokenizer.chat_template = template
    return tokenizer
