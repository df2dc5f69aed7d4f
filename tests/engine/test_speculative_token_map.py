"""Drafts over a token map (`{"token_map": FILE}`, SGLang's `--speculative-token-map`): a model's drafts are the
argmax over the map's tokens only, from their rows of the LM head, and the output is plain decoding's whatever
the map holds. Checked through the Qwen3.5 target as its own draft (its drafts are its greedy tokens, so kept
where the map holds them) and through its MTP module."""

from __future__ import annotations

import json

import pytest
import torch

from hybrid_helpers import HYBRID_VOCAB, MTP_THREE, WrappedDrafter, hybrid_tokens

from mili_openai import LLM, SamplingParams
from mili_openai.config import speculative_config_from
from mili_openai.engine.draft_head import DraftHead, load_token_map

MAX_NEW = 20
ENGINE = dict(dtype="float32", num_pages=256, page_size=4, max_num_batched_tokens=32)
OTHER_TOKENS = 100  # tokens beside the output's in a map that holds it


class RecordingDrafter(WrappedDrafter):
    """Wraps the runner's drafter and keeps every draft it proposes."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.drafted: set[int] = set()

    def propose(self, *args) -> list[list[int]]:
        drafts = self.inner.propose(*args)
        self.drafted.update(token for sequence_drafts in drafts for token in sequence_drafts)
        return drafts


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(hybrid_checkpoint):
    """(checkpoint, prompts, greedy tokens without drafts)."""
    checkpoint = str(hybrid_checkpoint("qwen3_5"))
    prompts = [hybrid_tokens(length, seed=length) for length in (23, 31, 9)]
    outputs = LLM(checkpoint, **ENGINE).generate(prompts, greedy())
    return checkpoint, prompts, [output.outputs[0].token_ids for output in outputs]


def write_map(path, ids) -> str:
    path.write_text(json.dumps(sorted(ids)))
    return str(path)


def run(checkpoint: str, prompts, speculative: dict) -> tuple[LLM, RecordingDrafter, list[list[int]]]:
    llm = LLM(checkpoint, speculative_config=speculative, **ENGINE)
    speculation = llm.core.runner.forward.speculation
    recorder = speculation.drafter = RecordingDrafter(speculation.drafter)
    outputs = llm.generate(prompts, greedy())
    return llm, recorder, [output.outputs[0].token_ids for output in outputs]


def self_draft(checkpoint: str, token_map: str) -> dict:
    return {"model": checkpoint, "num_speculative_tokens": 3, "min_acceptance_rate": 0, "token_map": token_map,
            "disable_by_batch_size": None}


def test_a_map_that_holds_the_output_keeps_the_drafts(plain, tmp_path):
    checkpoint, prompts, expected = plain
    held = {token for output in expected for token in output}
    others = [token for token in range(HYBRID_VOCAB) if token not in held][:OTHER_TOKENS]
    token_map = write_map(tmp_path / "map.json", held | set(others))
    llm, recorder, outputs = run(checkpoint, prompts, self_draft(checkpoint, token_map))
    assert outputs == expected
    stats = llm.core.stats()
    assert stats.spec_decode_num_accepted_tokens_total >= 0.9 * stats.spec_decode_num_draft_tokens_total > 0
    assert recorder.drafted <= held | set(others)


def test_a_map_without_the_output_keeps_no_draft(plain, tmp_path):
    checkpoint, prompts, expected = plain
    held = {token for output in expected for token in output}
    outside = set(range(HYBRID_VOCAB)) - held
    llm, recorder, outputs = run(checkpoint, prompts, self_draft(checkpoint, write_map(tmp_path / "map.json", outside)))
    assert outputs == expected
    stats = llm.core.stats()
    assert stats.spec_decode_num_draft_tokens_total > 0 and stats.spec_decode_num_accepted_tokens_total == 0
    assert recorder.drafted and recorder.drafted <= outside


def test_mtp_drafts_come_from_the_map(plain, tmp_path):
    checkpoint, prompts, expected = plain
    mapped = set(range(0, HYBRID_VOCAB, 7))
    token_map = write_map(tmp_path / "map.json", mapped)
    llm, recorder, outputs = run(checkpoint, prompts, MTP_THREE | {"token_map": token_map})
    assert outputs == expected
    assert llm.core.stats().spec_decode_num_draft_tokens_total > 0
    assert recorder.drafted and recorder.drafted <= mapped


def test_the_mapped_logits_are_the_heads_rows(plain):
    model = LLM(plain[0], **ENGINE).core.runner.forward.model
    ids = torch.tensor([3, 17, 500, HYBRID_VOCAB - 1])
    hidden = torch.randn(2, model.config.hidden_size)
    logits = DraftHead(model, ids)(hidden)
    torch.testing.assert_close(logits[:, ids], model.compute_logits(hidden)[:, ids])
    others = torch.ones(HYBRID_VOCAB, dtype=torch.bool)
    others[ids] = False
    assert torch.isneginf(logits[:, others]).all()


@pytest.mark.parametrize(("content", "message"), [
    ("not json", "not a readable JSON list"), ("[]", "non-empty JSON list"), ('["a"]', "non-empty JSON list"),
    ("[1, 2, 2]", "repeats"), (f"[0, {HYBRID_VOCAB}]", r"ids must be in \[0, 1024\)")])
def test_bad_token_maps_are_refused(tmp_path, content, message):
    path = tmp_path / "map.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_token_map(str(path), HYBRID_VOCAB)


def test_a_token_map_is_for_model_drafts_only():
    with pytest.raises(ValueError, match="token_map is for a model's drafts"):
        speculative_config_from({"method": "ngram", "num_speculative_tokens": 2, "token_map": "/a/map.json"})
