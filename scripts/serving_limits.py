"""This machine's limits for `compare_serving.py`'s single-stream workload: the decode-step and prefill
floors, measured by the probes `bench_engine.py` defines, and their lines in docs/performance.md.

The shared VMs this runs on change speed in phases of a second or more (the read bandwidth has measured
28-36 GB/s in one minute and 55-62 in the next), so a floor measured minutes away from the run it judges
can belong to another phase. The single-stream workload is therefore bracketed: its limits are measured
right before and right after it, with its server up and idle, and each floor uses the faster of the two
(the stricter floor). The whole run's limits, measured once at the end, are quoted beside them.

Phases shorter than the workload still blur that bracket, so each server also runs paired rounds: one
short single-stream request between two quick probes, a few seconds in all, and each request's TPOT and
TTFT are held against the floors measured around it. Their median says how close a step comes to what
the machine could do at that moment.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from bench_engine import ReadProbes, measure_matmul_flops  # a sibling script

BF16_BYTES = 2
MS_PER_S = 1000.0
BRACKET_KEYS = ("before", "after")
QUICK_REPEATS = 3  # passes per probe in a paired round: the probes must stay short beside the request


def measure_machine_limits(checkpoint: Path, prompt_len: int, read_probes: ReadProbes | None = None,
                           repeats: int = 8, device: torch.device = torch.device("cpu")) -> dict:
    """The floors a server cannot beat here: a decode step reads every weight once (bandwidth-bound), a
    prefill token costs 2 flops per non-embedding parameter plus causal attention's two products over its
    mean context, at `prompt_len` (matmul-bound)."""
    weight_bytes = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    probes = (read_probes or ReadProbes(device)).measure(repeats)
    bandwidth, flops = max(probes.values()), measure_matmul_flops(repeats, device)
    config = json.loads((checkpoint / "config.json").read_text())
    # A prompt token goes through every matmul but the LM head (applied to the last position only); the
    # embedding is a row lookup. Tied or not, the file holds the vocab × hidden table at least once.
    params = weight_bytes / BF16_BYTES - config["vocab_size"] * config["hidden_size"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    # q·k and p·v, 2 flops a multiply-add each, per head and layer, over the mean context of a causal prompt
    attention = 2 * 2 * config["num_hidden_layers"] * config["num_attention_heads"] * head_dim * (prompt_len // 2)
    return {"weight_bytes": weight_bytes, "read_bandwidth_bytes_per_s": bandwidth,
            "read_bandwidth_probes": probes, "matmul_flops_per_s": flops,
            "decode_step_floor_ms": weight_bytes / bandwidth * MS_PER_S,
            "prefill_floor_ms_per_token": (2 * params + attention) / flops * MS_PER_S}


def strictest(bracket: dict[str, dict]) -> dict:
    """Of the limits measured before and after a run, the faster probe of each kind (the lower floors)."""
    measured = [bracket[key] for key in BRACKET_KEYS if key in bracket]
    fastest = max(measured, key=lambda limits: limits["read_bandwidth_bytes_per_s"])
    return {**fastest, "prefill_floor_ms_per_token": min(m["prefill_floor_ms_per_token"] for m in measured),
            "matmul_flops_per_s": max(m["matmul_flops_per_s"] for m in measured)}


def paired_rounds(checkpoint: Path, prompt_len: int, run_request: Callable[[int], dict], rounds: int,
                  device: torch.device = torch.device("cpu")) -> list[dict]:
    """`rounds` times: quick limits, one request (`run_request(round)` -> its summary JSON), quick limits.
    Each round's request must have a prompt of its own (no prefix-cache hits)."""
    probes = ReadProbes(device)
    results = []
    for index in range(rounds):
        before = measure_machine_limits(checkpoint, prompt_len, probes, QUICK_REPEATS, device)
        summary = run_request(index)
        after = measure_machine_limits(checkpoint, prompt_len, probes, QUICK_REPEATS, device)
        results.append({"before": before, "after": after, "summary": summary})
    return results


def paired_fractions(rounds: list[dict], prompt_len: int) -> dict[str, list[float]]:
    """Per round, the decode and prefill floors (the stricter of the two probes) ÷ the request's TPOT, TTFT."""
    fractions: dict[str, list[float]] = {"decode": [], "prefill": []}
    for entry in rounds:
        limits, summary = strictest(entry), entry["summary"]
        if summary["tpot"]["mean_ms"] is None or summary["ttft"]["mean_ms"] is None:
            continue  # a failed request: no figure
        fractions["decode"].append(limits["decode_step_floor_ms"] / summary["tpot"]["mean_ms"])
        fractions["prefill"].append(limits["prefill_floor_ms_per_token"] * prompt_len / summary["ttft"]["mean_ms"])
    return fractions


def spread_text(values: list[float]) -> str:
    """'median 81% (quartiles 78-84%, 10 rounds)'"""
    if len(values) < 2:
        return f"{values[0]:.0%} (one round)" if values else "no round completed"
    low, _, high = statistics.quantiles(values, n=4)
    return f"median {statistics.median(values):.0%} (quartiles {low:.0%}-{high:.0%}, {len(values)} rounds)"


def render_paired(description: str, paired: dict[str, list[dict]], prompt_len: int) -> list[str]:
    """paired: {server: rounds from `paired_rounds`}."""
    lines = ["", f"Paired rounds: {description}, each between two quick probes (the stricter floor of the "
                 f"two, as above; 100% = at the limit):", ""]
    for server, rounds in paired.items():
        fractions = paired_fractions(rounds, prompt_len)
        lines.append(f"- {server}: decode {spread_text(fractions['decode'])} of the bandwidth limit; prefill "
                     f"{spread_text(fractions['prefill'])} of the matmul limit")
    return lines


def probe_text(limits: dict) -> str:
    """' (the fastest of: float32 sum 23.1, ...)' from the probes, when the limits recorded them."""
    probes = limits.get("read_bandwidth_probes")
    if not probes:
        return ""
    return " (the fastest of: " + ", ".join(f"{name} {rate / 1e9:.1f}" for name, rate in probes.items()) + ")"


def limits_text(limits: dict, prompt_len: int) -> str:
    prefill = limits["prefill_floor_ms_per_token"] * prompt_len
    return (f"read bandwidth {limits['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s{probe_text(limits)}, best "
            f"bf16-weight matmul {limits['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s; floors: a decode step "
            f"{limits['decode_step_floor_ms']:.1f} ms (every weight read once), a {prompt_len}-token prefill "
            f"{prefill:.0f} ms")


def against_floors(server: str, summary: dict, limits: dict, prompt_len: int) -> str:
    tpot, ttft = summary["tpot"]["mean_ms"], summary["ttft"]["mean_ms"]
    step, prefill = limits["decode_step_floor_ms"], limits["prefill_floor_ms_per_token"] * prompt_len
    return (f"{server}: TPOT {tpot:.1f} ms against a {step:.1f} ms floor = {step / tpot:.0%} of the limit; "
            f"TTFT {ttft:.0f} ms against a {prefill:.0f} ms floor = {prefill / ttft:.0%}")


def render_limits(workload: str, prompt_len: int, run_limits: dict | None, results: dict[str, dict],
                  brackets: dict[str, dict]) -> list[str]:
    """The limits section: per server, its single-stream run against the limits bracketing it, then the
    whole run's limits. results / brackets: {server: result JSON / {"before": limits, "after": limits}}."""
    lines = ["", "### Against this machine's limits"]
    bracketed = [server for server, data in results.items()
                 if server in brackets and data["summary"]["tpot"]["mean_ms"] is not None]
    if bracketed:
        lines += ["", f"{workload} against the limits measured right before and right after it (server up and "
                      f"idle; each floor from the faster of the two probes, so the stricter floor; 100% = at the "
                      f"limit):", ""]
    for server in bracketed:
        limits = strictest(brackets[server])
        lines.append(f"- {against_floors(server, results[server]['summary'], limits, prompt_len)}. Limits: "
                     f"{limits_text(limits, prompt_len)}.")
    if run_limits is not None:
        lines += ["", f"The whole run's limits, measured once at its end with both servers stopped: "
                      f"{limits_text(run_limits, prompt_len)}. Against them:", ""]
        lines += [f"- {against_floors(server, data['summary'], run_limits, prompt_len)}"
                  for server, data in results.items() if data["summary"]["tpot"]["mean_ms"] is not None]
    return lines
