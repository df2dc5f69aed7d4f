"""scripts/fit_mtp.py at a tiny size: it fits a random Qwen3.5 checkpoint's MTP module (or a tiny draft model) to
the target's greedy outputs, writes the fitted weights into a copy of the checkpoint (the rest untouched), and
prints the acceptance measured through the engine."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

FIT_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fit_mtp.py"
TINY_RUN = ["--num-prompts", "4", "--num-random", "2", "--validation-prompts", "2", "--prompt-len", "12",
            "--output-len", "12", "--max-epochs", "3", "--patience", "100", "--negatives", "64", "--eval-prompts", "2",
            "--eval-output-len", "8", "--num-speculative-tokens", "2"]


def load_script():
    spec = importlib.util.spec_from_file_location("fit_mtp", FIT_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def run_script(argv: list[str], capsys) -> tuple[dict, list[float]]:
    """(the acceptance it printed, the mean training loss between held-out evaluations)."""
    load_script().main(argv)
    printed = capsys.readouterr().out
    result = json.loads([line for line in printed.splitlines() if line.startswith("{")][-1])
    agreements = re.findall(r"held-out top-1 agreement ([0-9.]+)%", printed)
    assert len(agreements) == 3 * 2 + 1  # each of 3 epochs evaluated twice, then the best
    return result, [float(loss) for loss in re.findall(r"mean loss ([0-9.]+)", printed)]


def test_the_mtp_module_is_fitted_into_a_copy(hybrid_checkpoint, tmp_path, capsys):
    source = hybrid_checkpoint("qwen3_5")
    output = tmp_path / "fitted"
    result, losses = run_script([str(source), str(output), *TINY_RUN], capsys)
    assert result["speculative_config"]["method"] == "mtp" and result["draft_tokens"] > 0
    assert len(result["acceptance_per_position"]) == 2
    assert losses[-1] < losses[0]
    before, after = load_file(str(source / "model.safetensors")), load_file(str(output / "model.safetensors"))
    assert before.keys() == after.keys()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all(name.startswith("mtp.") for name in changed)
    assert "mtp.fc.weight" in changed


def test_a_tiny_draft_is_fitted_beside_the_target(hybrid_checkpoint, tmp_path, capsys):
    source = hybrid_checkpoint("qwen3_5")
    output = tmp_path / "draft"
    argv = [str(source), str(output), *TINY_RUN, "--draft", "--draft-hidden-size", "32", "--lr", "1e-2",
            "--data-cache", str(tmp_path / "data.pt")]
    result, losses = run_script(argv, capsys)
    token_map = output / "draft_token_map.json"
    assert result["speculative_config"] == {"method": "draft_model", "model": str(output),
                                            "num_speculative_tokens": 2, "token_map": str(token_map)}
    assert json.loads(token_map.read_text())  # the labels' tokens, measured with
    assert result["draft_tokens"] > 0 and losses[-1] < losses[0]
    config = json.loads((output / "config.json").read_text())
    assert config["hidden_size"] == 32 and config["layer_types"] == ["linear_attention", "full_attention"]
    assert (output / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    # the labelled data was saved for the next fit of the same target, and is read back as it was built
    script = load_script()
    train, validation = script.load_cached(script.parse_args(argv))
    assert (len(train), len(validation)) == (4 + 2, 2)
    assert train.hidden[0].shape == (24, json.loads((source / "config.json").read_text())["hidden_size"])
    assert script.load_cached(script.parse_args([*argv, "--seed", "1"])) is None  # other data flags: built anew


def test_bench_workloads_are_fitted_and_their_acceptance_measured(hybrid_checkpoint, tmp_path, capsys):
    """--bench-workload: the data is the prompts `mili bench serve` draws with those arguments (warm-up ones too),
    continued as served; the fit memorises them, so the engine accepts drafts on that fitted prompt set, where a
    random head accepts next to none."""
    source = hybrid_checkpoint("qwen3_5_qwen35_tokenizer")  # the bench's text prompts need the whole vocabulary
    workloads = [f"--num-requests 2 --concurrency 1 --input-len 12 --output-len 16 --warmup 1 --seed 3 --ignore-eos "
                 f"--tokenizer {source}",
                 f"--num-requests 4 --concurrency 2 --input-len 8 --output-len 8 --warmup 0 --seed 1 --ignore-eos "
                 f"--tokenizer {source}"]
    argv = [str(source), str(tmp_path / "fitted"), "--max-epochs", "40", "--patience", "100", "--negatives", "64",
            "--lr", "1e-2", "--num-speculative-tokens", "2", "--data-cache", str(tmp_path / "data.pt")]
    for workload in workloads:
        argv += ["--bench-workload", workload]
    load_script().main(argv)
    printed = capsys.readouterr().out
    assert "held-out" not in printed
    best = float(re.findall(r"best on the fitted prompt set top-1 agreement ([0-9.]+)%", printed)[-1])
    result = json.loads([line for line in printed.splitlines() if line.startswith("{")][-1])
    assert result["measured_on"] == "the fitted prompt set"
    assert best >= 80 and result["acceptance_rate"] >= 0.5, (best, result)
    # the data: each request of both workloads, its prompt as the server tokenizes the bench's text, then its output
    script = load_script()
    train, validation = script.load_cached(script.parse_args(argv))
    assert len(train) == len(validation) == 3 + 4
    assert sorted(int((weights == 1.0).sum()) for weights in train.weights) == [8] * 4 + [16] * 3
    # a continuation position's label is the token decoded after it (a prefill's argmax may round otherwise)
    for tokens, greedy, weights in zip(train.tokens, train.greedy, train.weights):
        prompt_len = int((weights != 1.0).sum())
        assert torch.equal(greedy[prompt_len - 1 : -1], tokens[prompt_len:])
