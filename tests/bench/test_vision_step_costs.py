"""scripts/vision_step_costs.py on the tiny vision checkpoint: its per-step record adds up (every image encoded once,
in a prefill step; each decode-only step reads every projection and the LM head once, 2 FLOPs a weight a row)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vision_step_costs.py"
REQUESTS, TOKENS = 2, 4
FLOAT32_BYTES = 4


def language_matmul_values(checkpoint: Path) -> int:
    """The values a decode step multiplies each row by: every language-model projection (its 2-D weights but the
    tower's and the MTP module's) and the LM head, counted as the embedding (its shape, tied or not)."""
    values = 0
    for file in checkpoint.glob("*.safetensors"):
        with safe_open(file, "pt") as tensors:
            for name in tensors.keys():
                shape = tensors.get_slice(name).get_shape()
                if len(shape) == 2 and not ("visual" in name or name.startswith("mtp") or "lm_head" in name):
                    values += shape[0] * shape[1]
    return values


def test_step_costs_add_up(vision_checkpoint, tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("vision_step_costs", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclass looks its module up there
    spec.loader.exec_module(script)
    out = tmp_path / "costs.json"
    assert script.main([str(vision_checkpoint), "--threads", "1", "--dtype", "float32", "--concurrency",
                        str(REQUESTS), "--output-tokens", str(TOKENS), "--out", str(out)]) == 0
    costs = json.loads(out.read_text())
    assert costs["output_tokens"] == REQUESTS * TOKENS
    steps = costs["steps"]
    assert sum(step["images"] for step in steps) == REQUESTS
    assert all(step["prefill_tokens"] for step in steps if step["images"])
    assert all((step["tower_cpu_s"] > 0) == (step["images"] > 0) for step in steps)
    decode_only = [step for step in steps if not step["prefill_tokens"]]
    assert decode_only and costs["decode_only"]["steps"] == len(decode_only)
    weights = decode_only[0]["weight_gb"]
    assert all(step["weight_gb"] == weights for step in decode_only)
    assert weights * 1e9 == pytest.approx(language_matmul_values(vision_checkpoint) * FLOAT32_BYTES)
    for step in decode_only:  # 2 FLOPs per weight value per row; float32 weights, 4 bytes a value
        expected = 2 * step["decode_rows"] * weights / FLOAT32_BYTES
        assert abs(step["matmul_gflop"] - expected) <= 1e-9 * max(expected, 1.0)
