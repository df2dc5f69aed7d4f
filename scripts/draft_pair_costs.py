"""What a draft-model pair's decode costs at batch 1 against the target alone, on the prompts a draft was fitted to
(scripts/fit_mtp.py --draft --bench-workload: its acceptance there is real), timed in one process with the servers'
engines interleaved round by round, medians over the rounds: a busy machine slows every engine of a round alike
(issue 47's draft pair: >= 1.5x decode speed at W3).

Per engine and round: ms per output token after the first (the decode of `--tokens` tokens, less a one-token
request's time; the prompt resumes from the prefix cache each time), and for each draft pair the drafter's own ms
per step (its catch-up and its chained drafts), the target's per step (the verify forward and the sampling), the
tokens each step gives, acceptance per draft position, and whether the request decoded the fitted continuation.

    python scripts/draft_pair_costs.py /work/bench/qwen35-0.8b-random /work/bench/draft6/qwen35-0.8b-draft-benchfit \\
        --data-cache /work/bench/draft6/fit-data.pt --drafts 2 3 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mili_openai import LLM, SamplingParams

W3_PROMPT_LEN = 400  # the data's sequences with a prompt at least this long are W3's (512 in), W1's are 256
TOKEN_MAP_FILE = "draft_token_map.json"


class TimedDrafter:
    """Wraps the runner's drafter: the seconds each of its runs (catch-up and chained drafts) took."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.seconds: list[float] = []

    def __getattr__(self, name: str):  # the state calls, unchanged
        return getattr(self.inner, name)

    def propose(self, *args) -> list[list[int]]:
        started = time.perf_counter()
        drafts = self.inner.propose(*args)
        self.seconds.append(time.perf_counter() - started)
        return drafts


def fitted_prompt(data_cache: Path) -> tuple[list[int], list[int]]:
    """(the first W3 prompt of the fit's data, its continuation as fitted)."""
    saved = torch.load(data_cache, weights_only=False)["train"]
    for tokens, weights in zip(saved["tokens"], saved["weights"]):
        prompt_len = int((weights < 1.0).sum())  # weight 1 marks the continuation's positions
        if prompt_len >= W3_PROMPT_LEN:
            return tokens[:prompt_len].tolist(), tokens[prompt_len:].tolist()
    raise SystemExit(f"{data_cache}: no sequence with a prompt of {W3_PROMPT_LEN} tokens or more (W3's)")


def measure(llm: LLM, prompt: list[int], fitted: list[int], tokens: int) -> dict:
    """One round of one engine: ms per decoded token, and the speculation's figures over the round."""
    drafter = getattr(llm.core.runner.forward.speculation, "drafter", None)
    before = llm.core.stats()
    started = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    first = time.perf_counter() - started
    if drafter is not None:
        drafter.seconds.clear()
    started = time.perf_counter()
    output = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))[0]
    whole = time.perf_counter() - started
    after = llm.core.stats()
    decoded = list(output.outputs[0].token_ids)
    row = {"ms_per_token": 1000 * (whole - first) / (tokens - 1), "decoded_the_fit": decoded == fitted[:tokens]}
    if drafter is not None:
        steps = after.spec_decode_num_drafts_total - before.spec_decode_num_drafts_total
        kept = after.spec_decode_num_accepted_tokens_total - before.spec_decode_num_accepted_tokens_total
        per_position = [(k1 - k0, d1 - d0) for k0, k1, d0, d1 in zip(
            before.spec_decode_num_accepted_tokens_per_pos, after.spec_decode_num_accepted_tokens_per_pos,
            before.spec_decode_num_draft_tokens_per_pos, after.spec_decode_num_draft_tokens_per_pos)]
        decode_steps = tokens - 1 - kept
        row |= {"tokens_per_step": (tokens - 1) / decode_steps, "verify_steps": steps,
                "drafter_ms_per_run": 1000 * statistics.median(drafter.seconds) if drafter.seconds else None,
                "acceptance_per_position": [kept_at / drafted if drafted else None for kept_at, drafted in per_position]}
        row["target_ms_per_step"] = (row["ms_per_token"] * row["tokens_per_step"]
                                     - (row["drafter_ms_per_run"] or 0.0))
    return row


def median_row(rows: list[dict]) -> dict:
    out = {}
    for key, value in rows[0].items():
        if isinstance(value, bool):
            out[key] = all(row[key] for row in rows)
        elif isinstance(value, list):
            out[key] = [round(statistics.median(row[key][i] for row in rows), 3) if value[i] is not None else None
                        for i in range(len(value))]
        elif value is not None:
            out[key] = round(statistics.median(row[key] for row in rows), 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target")
    parser.add_argument("draft", help="the draft checkpoint (its draft_token_map.json is used where present)")
    parser.add_argument("--data-cache", type=Path, required=True, help="the fit's data (fit_mtp.py --data-cache)")
    parser.add_argument("--drafts", type=int, nargs="+", default=[2, 3], help="num_speculative_tokens to time")
    parser.add_argument("--no-token-map", action="store_true", help="draft over the whole vocabulary")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64, help="decoded tokens per measurement")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=0.5, help="each engine's")
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    prompt, fitted = fitted_prompt(args.data_cache)
    # batch 1: one running sequence's state slot (the default's 256 would fill a small cache budget)
    engine = dict(dtype="bfloat16", kv_cache_memory_gb=args.kv_cache_memory_gb, max_num_seqs=1,
                  num_threads=args.num_threads)
    token_map = Path(args.draft) / TOKEN_MAP_FILE
    engines = {"plain": LLM(args.target, **engine)}
    for k in args.drafts:
        speculative = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": k,
                       "min_acceptance_rate": 0, "disable_by_batch_size": None}
        if token_map.exists() and not args.no_token_map:
            speculative["token_map"] = str(token_map)
        llm = LLM(args.target, speculative_config=speculative, **engine)
        speculation = llm.core.runner.forward.speculation
        speculation.drafter = TimedDrafter(speculation.drafter)
        engines[f"draft {k}"] = llm
    for llm in engines.values():  # warm-up: the prompt's prefix into each cache, the kernels' first calls
        measure(llm, prompt, fitted, 8)
    rounds: dict[str, list[dict]] = {name: [] for name in engines}
    for round_index in range(args.rounds):
        for name, llm in engines.items():
            rounds[name].append(measure(llm, prompt, fitted, args.tokens))
        print(json.dumps({"round": round_index} | {name: round(rows[-1]["ms_per_token"], 1)
                                                     for name, rows in rounds.items()}), flush=True)
    plain = statistics.median(row["ms_per_token"] for row in rounds["plain"])
    for name, rows in rounds.items():
        speedups = [plain_row["ms_per_token"] / row["ms_per_token"] for plain_row, row in zip(rounds["plain"], rows)]
        print(json.dumps({"engine": name, **median_row(rows), "speedup_vs_plain_same_round": round(
            statistics.median(speedups), 3), "target_step_vs_plain": round(
            median_row(rows).get("target_ms_per_step", plain) / plain, 3)}), flush=True)


if __name__ == "__main__":
    main()
