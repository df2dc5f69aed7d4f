"""The kernel backend (model/kernel_backend.py): every module that runs kernels requires it at construction, a
loaded model's modules all share its one object (the MTP predictor's, the LoRA wrappers', the vision towers' with
Qwen3-VL's DeepStack mergers, a sequence classifier's score head and its pooler too), so one assignment to a field
changes the op for the whole model."""

from __future__ import annotations

import pytest
import torch
from model_helpers import PagedSequences, counting_matmul, random_tokens

from mili_openai.engine.pooler import Pooler
from mili_openai.engine.pooling_spec import CLASSIFY, LAST, PoolingRow, PoolingSpec
from mili_openai.kernels.fp8 import per_row_weights
from mili_openai.kernels.lora import LoraGroup, add_lora
from mili_openai.model import KVCache, ModelCaches, ModelConfig, load_model
from mili_openai.model.gated_attention import GatedAttention
from mili_openai.model.gated_deltanet import GatedDeltaNet
from mili_openai.model.kernel_backend import KernelBackend
from mili_openai.model.layers import Linear, RMSNorm, SwiGLUMLP
from mili_openai.model.lora_layers import LoraLinear, LoraSlots
from mili_openai.model.moe import SparseMoeBlock
from mili_openai.model.mtp_predictor import attach_mtp_predictor
from mili_openai.model.quantization.dynamic import quantize_fp8, quantize_int8
from mili_openai.model.quantization.modules import Fp8Linear, QuantizedLinear
from mili_openai.model.qwen3_5_vision import BiasedLinear, VisionPatchEmbed

CPU = torch.device("cpu")
HIDDEN = 64


def _hybrid_config() -> ModelConfig:
    from hybrid_helpers import TINY_HYBRID_CONFIG

    return ModelConfig.from_dicts({"model_type": "qwen3_5_text", **TINY_HYBRID_CONFIG})


BUILDERS = {
    "Linear": lambda backend: Linear(HIDDEN, HIDDEN, backend),
    "RMSNorm": lambda backend: RMSNorm(HIDDEN, 1e-6, backend),
    "SwiGLUMLP": lambda backend: SwiGLUMLP(HIDDEN, 2 * HIDDEN, backend),
    "SparseMoeBlock": lambda backend: SparseMoeBlock(HIDDEN, 4, 2, HIDDEN, True, backend),
    "QuantizedLinear": lambda backend: QuantizedLinear(quantize_int8(torch.randn(8, HIDDEN)), backend),
    "Fp8Linear": lambda backend: Fp8Linear(per_row_weights(*quantize_fp8(torch.randn(8, HIDDEN))), backend),
    "GatedDeltaNet": lambda backend: GatedDeltaNet(_hybrid_config(), backend),
    "GatedAttention": lambda backend: GatedAttention(_hybrid_config(), backend),
    "BiasedLinear": lambda backend: BiasedLinear(HIDDEN, HIDDEN, backend),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_module_built_without_the_backend_fails_at_construction(name):
    backend = KernelBackend()
    assert BUILDERS[name](backend).backend is backend
    with pytest.raises(TypeError, match="KernelBackend"):
        BUILDERS[name](None)


def _backend_holders(module: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in module.modules() if hasattr(m, "backend")]


@pytest.mark.parametrize("name", ["qwen3_5_vl", "qwen3_5_moe"])
def test_every_module_of_a_hybrid_model_and_its_mtp_predictor_shares_the_backend(hybrid_checkpoint, name):
    model, _ = load_model(hybrid_checkpoint(name), torch.float32, CPU, use_decode_kernel=False)
    predictor = attach_mtp_predictor(model)
    kinds = {type(m) for m in _backend_holders(model)}
    assert {GatedDeltaNet, GatedAttention, Linear}.issubset(kinds)
    assert all(m.backend is model.backend for m in _backend_holders(model))  # the predictor and tower are in it
    assert any(isinstance(m, Linear) for m in _backend_holders(predictor))
    if name == "qwen3_5_vl":
        assert {BiasedLinear, VisionPatchEmbed}.issubset({type(m) for m in _backend_holders(model.visual)})


def test_one_assignment_routes_every_projection_and_the_head(tiny_checkpoint):
    """The backend's matmul, swapped once, runs each dense projection of a forward and the LM head."""
    model, _ = load_model(tiny_checkpoint, torch.float32, CPU, use_decode_kernel=False)
    calls = []
    pages = PagedSequences(num_pages=8, page_size=16)
    pages.add("a", random_tokens(5, seed=1))
    batch, _ = pages.batch(prefill=[("a", 5)])
    caches = ModelCaches(KVCache(model.cache_specs(), 8, 16, torch.float32, CPU))
    model.backend.matmul = counting_matmul(calls)
    with torch.inference_mode():
        model.compute_logits(model(batch, caches)[batch.logits_indices])
    projections = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(calls) == len(projections) + 1  # + the tied LM head, on the embedding matrix
    assert calls[-1] == model.model.embed_tokens.weight.shape


def test_the_lora_wrappers_run_the_backends_lora_op(tiny_checkpoint):
    model, _ = load_model(tiny_checkpoint, torch.float32, CPU, use_decode_kernel=False)
    slots = LoraSlots(model, num_slots=1, max_rank=4)
    wrappers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    assert wrappers and all(m.backend is model.backend for m in wrappers)
    calls = []

    def counting(out, x, table, rows):
        calls.append(len(rows.groups))
        return add_lora(out, x, table, rows)

    model.backend.lora = counting
    projection = wrappers[0]
    with torch.inference_mode(), slots.rows([LoraGroup(0, None)]):
        projection(torch.randn(3, projection.lora_a.shape[-1]))
    assert calls == [1]


def test_qwen3_vl_tower_and_its_deepstack_mergers_share_the_backend(qwen3_vl_checkpoint):
    model, config = load_model(qwen3_vl_checkpoint, torch.float32, CPU, use_decode_kernel=False)
    assert all(m.backend is model.backend for m in _backend_holders(model))
    mergers = _backend_holders(model.visual.deepstack_merger_list)
    assert len(mergers) == 2 * len(config.vision_tower.deepstack_visual_indexes) > 0  # fc1 and fc2 each
    assert all(isinstance(m, BiasedLinear) for m in mergers)


def test_hybrid_lora_wrappers_share_the_backend(hybrid_checkpoint):
    model, _ = load_model(hybrid_checkpoint("qwen3_5"), torch.float32, CPU, use_decode_kernel=False)
    LoraSlots(model, num_slots=1, max_rank=4)
    wrappers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    assert any(isinstance(m.base, Linear) and "linear_attn.in_proj_qkv" in [t.name for t in m.targets]
               for m in wrappers)  # Gated DeltaNet's input projection is wrapped too
    assert all(m.backend is model.backend for m in wrappers)


def test_a_classifiers_score_head_and_pooler_run_the_backends_matmul(classifier_checkpoint):
    """The score head is the backend's like every projection; the pooler reads the backend's matmul at each call,
    so kernels installed after it was built (the CPU kernels compiled in the background) reach it too."""
    model, config = load_model(classifier_checkpoint("labels"), torch.float32, CPU, use_decode_kernel=False)
    assert model.score.backend is model.backend
    labels = config.classifier.labels
    spec = PoolingSpec(CLASSIFY, LAST, normalize=False, hidden_size=config.hidden_size, labels=labels,
                       activation=config.classifier.activation)
    pooler = Pooler.for_model(spec, model)
    calls = []
    model.backend.matmul = counting_matmul(calls)
    pooled = pooler(torch.randn(3, config.hidden_size), [PoolingRow(0, 0, 3, 0, final=True)])
    assert calls == [model.score.weight.shape] and pooled[0].shape == (len(labels),)
