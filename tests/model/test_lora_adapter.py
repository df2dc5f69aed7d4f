"""PEFT adapters as mili reads them: scaling, the checks that refuse what is not served (by name), and the
segmented LoRA matmul against a row-by-row reference."""

from __future__ import annotations

import math

import pytest
import torch

from lora_helpers import edited_adapter, write_peft_adapter
from mili_openai.kernels.lora import LoraRows, LoraSlotTable, add_lora, lora_groups
from mili_openai.model import load_model
from mili_openai.model.lora_adapter import AdapterError, load_lora_adapter, lora_scale
from mili_openai.model.lora_layers import LoraSlots

RANK = 8


@pytest.fixture(scope="module")
def slots(tiny_checkpoint):
    model, _ = load_model(tiny_checkpoint, torch.float32, torch.device("cpu"), use_decode_kernel=False)
    return LoraSlots(model, num_slots=2, max_rank=RANK)


@pytest.fixture(scope="module")
def adapter_dir(tiny_checkpoint, tmp_path_factory):
    return write_peft_adapter(tiny_checkpoint, tmp_path_factory.mktemp("adapter"), RANK, seed=3,
                              targets=["q_proj", "v_proj", "down_proj"], alpha=4.0)


def test_scale_is_folded_into_b(adapter_dir, slots):
    from safetensors.torch import load_file

    adapter = load_lora_adapter("a", adapter_dir, slots.shapes, RANK)
    stored = load_file(str(adapter_dir / "adapter_model.safetensors"))
    b = stored["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    assert torch.equal(adapter.weights[(1, "self_attn.v_proj")][1], b * (4.0 / RANK))
    assert set(module for _, module in adapter.weights) == {"self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"}
    assert adapter.rank == RANK
    assert lora_scale(16.0, 64, use_rslora=True) == pytest.approx(16.0 / math.sqrt(64))


@pytest.mark.parametrize("fields, named", [
    (dict(use_dora=True), "use_dora"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "embed_tokens"),
    (dict(use_qalora=True), "use_qalora"),
    (dict(bias="all"), "bias"),
    (dict(peft_type="IA3"), "IA3"),
    (dict(target_parameters=["gate_up_proj", "down_proj"]), "target_parameters.*routed experts"),
])
def test_unsupported_options_are_refused_by_name(adapter_dir, slots, tmp_path, fields, named):
    with pytest.raises(AdapterError, match=named):
        load_lora_adapter("bad", edited_adapter(adapter_dir, tmp_path / "edited", **fields), slots.shapes, RANK)


def test_alpha_pattern_overrides_a_modules_alpha(adapter_dir, slots, tmp_path):
    edited = edited_adapter(adapter_dir, tmp_path / "edited", alpha_pattern={"v_proj": 8.0},
                            rank_pattern={"v_proj": RANK})
    plain = load_lora_adapter("a", adapter_dir, slots.shapes, RANK)
    patterned = load_lora_adapter("a", edited, slots.shapes, RANK)
    v_proj, q_proj = (0, "self_attn.v_proj"), (0, "self_attn.q_proj")
    torch.testing.assert_close(patterned.weights[v_proj][1], plain.weights[v_proj][1] * 2)
    assert torch.equal(patterned.weights[q_proj][1], plain.weights[q_proj][1])


def test_rank_over_the_maximum_is_refused(adapter_dir, slots):
    with pytest.raises(AdapterError, match="rank 8 is over --max-lora-rank 4"):
        load_lora_adapter("big", adapter_dir, slots.shapes, 4)


def test_adapter_of_another_base_is_refused(tiny_checkpoint_mha_untied, tmp_path, slots):
    other = write_peft_adapter(tiny_checkpoint_mha_untied, tmp_path / "other", 4, seed=5, targets=["q_proj"])
    with pytest.raises(AdapterError, match="another base model|does not serve LoRA on"):
        load_lora_adapter("other", other, slots.shapes, RANK)


def _renamed(old: str, new: str):
    return lambda weights: {name.replace(old, new): tensor for name, tensor in weights.items()}


def test_lora_on_routed_experts_is_refused_by_name(adapter_dir, slots, tmp_path):
    on_an_expert = edited_adapter(adapter_dir, tmp_path / "expert",
                                  edit_weights=_renamed("layers.0.mlp.down_proj", "layers.0.mlp.experts.3.down_proj"))
    with pytest.raises(AdapterError, match="layers.0.mlp.experts.3.down_proj.*routed experts is not served"):
        load_lora_adapter("moe", on_an_expert, slots.shapes, RANK)


def test_the_vision_language_layout_reads_as_the_text_one(adapter_dir, slots, tmp_path):
    """PEFT on Qwen3.5's vision-language class names the decoder model.language_model.layers."""
    nested = edited_adapter(adapter_dir, tmp_path / "vl", edit_weights=_renamed("model.layers.",
                                                                                "model.language_model.layers."))
    plain, read = (load_lora_adapter("a", path, slots.shapes, RANK) for path in (adapter_dir, nested))
    assert plain.weights.keys() == read.weights.keys()
    assert all(torch.equal(plain.weights[key][1], read.weights[key][1]) for key in plain.weights)


def test_missing_files_are_refused(tmp_path, slots):
    with pytest.raises(AdapterError, match="adapter_config.json not found"):
        load_lora_adapter("none", tmp_path, slots.shapes, RANK)


def test_segmented_matmul_matches_row_by_row():
    torch.manual_seed(0)
    rows, slots_count, width, in_features, out_features = 9, 3, 6, 5, 7
    x = torch.randn(rows, in_features)
    lora_a = torch.randn(slots_count, width, in_features)
    lora_b = torch.randn(slots_count, out_features, width)
    table = LoraSlotTable(lora_a, lora_b.transpose(1, 2).contiguous(), (0, out_features))
    row_slots = [2, -1, 0, 2, 2, -1, 1, 0, 2]
    base = torch.randn(rows, out_features)
    groups = lora_groups(row_slots, x.device)
    got = add_lora(base.clone(), x, table, LoraRows(groups))
    want = torch.stack([base[r] + (x[r] @ lora_a[s].T @ lora_b[s].T if s >= 0 else 0) for r, s in enumerate(row_slots)])
    torch.testing.assert_close(got, want)
    assert LoraRows(groups).per_row(rows, x.device).tolist() == row_slots  # the kernels' form of the groups
    # one adapter on every row: no gather
    assert lora_groups([1, 1, 1], x.device) == [(1, None)]
    whole = add_lora(base[:3].clone(), x[:3], table, LoraRows(lora_groups([1, 1, 1], x.device)))
    torch.testing.assert_close(whole, base[:3] + x[:3] @ lora_a[1].T @ lora_b[1].T)
    assert LoraRows(lora_groups([1, 1, 1], x.device)).per_row(3, x.device).tolist() == [1, 1, 1]
