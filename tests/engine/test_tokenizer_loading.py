"""The chat template a checkpoint's tokenizer renders with (engine/tokenizer_loading.py): tokenizer_config.json's,
the processor's chat_template.json over it (a vision-language checkpoint's, which places images), and
chat_template.jinja over both, as transformers' processor reads them; and the tokenizer read once per process until
a file of it changes."""

from __future__ import annotations

import json
import shutil

from mili_openai.engine.tokenizer_loading import PROCESSOR_TEMPLATE_FILE, TEMPLATE_FILE, load_tokenizer

PROCESSOR_TEMPLATE = "{% for message in messages %}[{{ message.role }}]{% endfor %}"
JINJA_TEMPLATE = "{% for message in messages %}<{{ message.role }}>{% endfor %}"
MESSAGES = [{"role": "user", "content": "hi"}]


def rendered(directory) -> str:
    return load_tokenizer(directory).apply_chat_template(MESSAGES, tokenize=False)


def test_the_processor_template_wins_unless_a_jinja_file_is_shipped(tiny_checkpoint, tmp_path):
    assert rendered(tiny_checkpoint).startswith("<|im_start|>user\nhi")  # tokenizer_config.json's (Qwen3's)
    checkpoint = tmp_path / "with-processor-template"
    shutil.copytree(tiny_checkpoint, checkpoint)
    (checkpoint / PROCESSOR_TEMPLATE_FILE).write_text(json.dumps({"chat_template": PROCESSOR_TEMPLATE}))
    assert rendered(checkpoint) == "[user]"
    (checkpoint / TEMPLATE_FILE).write_text(JINJA_TEMPLATE)
    assert rendered(checkpoint) == "<user>"


def test_a_tokenizer_is_read_once_until_a_file_of_it_changes(tiny_checkpoint, tmp_path):
    checkpoint = tmp_path / "changing"
    shutil.copytree(tiny_checkpoint, checkpoint)
    first = load_tokenizer(checkpoint)
    assert load_tokenizer(checkpoint) is first  # engines on one checkpoint share it
    config_file = checkpoint / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = PROCESSOR_TEMPLATE
    config_file.write_text(json.dumps(config))  # another size: read again, with the new template
    changed = load_tokenizer(checkpoint)
    assert changed is not first and rendered(checkpoint) == "[user]"
