"""A checkpoint's tokenizer with the chat template its server should render.

transformers' tokenizer takes its template from chat_template.jinja, else tokenizer_config.json. A vision-language
checkpoint may also ship the processor's template in the older chat_template.json, the one that places images
(vLLM prefers the processor's template too): where that file is there and no chat_template.jinja, it wins.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

TEMPLATE_FILE = "chat_template.jinja"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"  # {"chat_template": "..."}
TEMPLATE_KEY = "chat_template"


def load_tokenizer(model_path: str | Path) -> Any:
    """The tokenizer of the checkpoint at `model_path`, its chat template the processor's where one is shipped."""
    directory = Path(model_path)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    processor_template = directory / PROCESSOR_TEMPLATE_FILE
    if processor_template.is_file() and not (directory / TEMPLATE_FILE).is_file():
        template = json.loads(processor_template.read_text()).get(TEMPLATE_KEY)
        if isinstance(template, str) and template:
            tokenizer.chat_template = template
    return tokenizer
