"""The LoRA benchmark's tools on the tiny checkpoint: scripts/make_lora_adapters.py writes adapters in PEFT's format
(mili serves one as PEFT's merge does), and `mili bench serve --models` spreads requests over them on a real server
(docs/performance.md gives the full-size command)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from engine_helpers import assert_matches, greedy, random_prompts
from helpers_server import REAL_ENGINE_CONFIG, live_server
from lora_helpers import peft_greedy
from mili_openai import LLM
from mili_openai.bench.cli import EXIT_OK, main as bench_main
from mili_openai.config import EngineConfig, LoraConfig, ServerConfig
from mili_openai.engine.async_engine import AsyncEngine
from mili_openai.server.app import create_app

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_lora_adapters.py"
COUNT, RANK = 4, 16
MAX_NEW = 6


def load_script():
    spec = importlib.util.spec_from_file_location("make_lora_adapters", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory) -> list[tuple[str, Path]]:
    out = tmp_path_factory.mktemp("bench-loras")
    argv = [str(tiny_checkpoint), str(out), "--count", str(COUNT), "--rank", str(RANK), "--dtype", "float32"]
    assert load_script().main(argv) == 0
    return [(f"lora-{index}", out / f"lora-{index}") for index in range(COUNT)]


def test_the_script_writes_adapters_served_as_peft_merges_them(tiny_checkpoint, adapters):
    name, path = adapters[1]
    prompts = random_prompts(2, [7, 20], seed=5)
    expected = peft_greedy(tiny_checkpoint, path, prompts, MAX_NEW)
    llm = LLM(str(tiny_checkpoint), dtype="float32", num_pages=64, cpu_kernels_in_background=True,
              lora=dict(modules=[(name, str(path))], max_lora_rank=RANK))
    assert_matches(llm.generate(prompts, greedy(MAX_NEW), lora_request=name), expected)
    assert [output.outputs[0].token_ids for output in llm.generate(prompts, greedy(MAX_NEW))] != [
        tokens for tokens, _ in expected]  # the adapter moves the tokens


def test_bench_serve_spreads_requests_over_the_adapters(tiny_checkpoint, adapters, tmp_path):
    lora = LoraConfig(modules=tuple((name, str(path)) for name, path in adapters), max_loras=COUNT,
                      max_lora_rank=RANK)
    engine_config = EngineConfig(model=str(tiny_checkpoint), cpu_kernels_in_background=True, lora=lora,
                                 **REAL_ENGINE_CONFIG)
    app = create_app(ServerConfig(engine=engine_config, served_model_name="tiny"), engine=AsyncEngine(engine_config))
    names = ",".join(name for name, _ in adapters)
    with live_server(app) as server:
        code = bench_main(["serve", "--base-url", server.base_url, "--num-requests", "8", "--concurrency", str(COUNT),
                           "--input-len", "16", "--output-len", "4", "--ignore-eos", "--models", names,
                           "--no-progress", "--json", str(tmp_path / "run.json")])
    assert code == EXIT_OK
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["model"] == names and run["config"]["models"] == names.split(",")
    assert run["summary"]["completed"] == 8 and run["summary"]["total_output_tokens"] == 8 * 4
