"""What one decode step costs with k drafts, through mili's engine, at batch 1 (or `--batch-size` requests decoding
together), and so what acceptance a speed-up needs (issue 47). Needs a quiet machine.

- plain: a step without drafts (one row per request);
- verify k: a step whose k drafts are all kept, drafted for free (a proposer that knows the plain output): the
  cost of verifying k + 1 rows per request;
- mtp k (and mtp k over a token map): the checkpoint's MTP module drafting k tokens each step, the off-switch
  off; a step costs the verify and the k drafts, so a draft's own cost is the difference;
- mtp k, switched off: the MTP module with the off-switch turning each request off after its first verify step
  unless it kept every draft (min_acceptance_rate 1): with a head whose drafts are rejected, what a request whose
  drafting is off costs per step (it should be a plain step's cost).
Then, for k drafts kept with probability a each (the chain stops at the first rejection), a step yields
1 + a + ... + a^k tokens: the acceptance at which the step's cost buys the asked speed-up.

    python scripts/speculation_costs.py /work/bench/mtp3/qwen35-0.8b-mtp-fitted --token-map MAP --speedup 1.6
    python scripts/speculation_costs.py /work/bench/qwen35-0.8b-random --max-drafts 1 --batch-size 8 --tokens 24
"""

from __future__ import annotations

import argparse
import json
import random
import time

from mili_openai import LLM, SamplingParams

PROMPT_LEN = 512
WARMUP_TOKENS = 8


class KnownOutputProposer:
    """Drafts the plain output's next tokens: every draft is kept, and drafting costs nothing."""

    drafts_in_runner = False

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], k: int) -> None:
        self.outputs = outputs  # by prompt
        self.k = k

    def propose(self, seq, max_drafts: int) -> list[int]:
        done = len(seq.output_token_ids)
        output = self.outputs.get(tuple(seq.prompt_token_ids), [])
        return list(output[done : done + min(self.k, max_drafts)])


def decode_ms_per_step(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """(ms per decode step, tokens per step and request) of greedy requests decoding together, their prefill's
    time taken off."""
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True))
    started = time.perf_counter()
    llm.generate([prompt[:-1] + [prompt[-1] + 1] for prompt in prompts], SamplingParams(temperature=0.0, max_tokens=1))
    prefill = time.perf_counter() - started
    before = llm.core.stats()
    started = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    decode = time.perf_counter() - started - prefill
    after = llm.core.stats()
    # a request's tokens after its first come from decode steps: those without drafts give one each
    steps = after.spec_decode_num_drafts_total - before.spec_decode_num_drafts_total
    kept = after.spec_decode_num_accepted_tokens_total - before.spec_decode_num_accepted_tokens_total
    decode_steps = (len(prompts) * (tokens - 1) - kept) / len(prompts)
    return 1000 * decode / decode_steps, (tokens - 1) / decode_steps


def tokens_per_step(acceptance: float, k: int) -> float:
    return sum(acceptance**i for i in range(k + 1))


def needed_acceptance(step_cost: float, k: int, speedup: float) -> float | None:
    """The per-draft acceptance at which k drafts for `step_cost` plain steps give `speedup` (None: never)."""
    if tokens_per_step(1.0, k) < speedup * step_cost:
        return None
    low, high = 0.0, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if tokens_per_step(middle, k) < speedup * step_cost else (low, middle)
    return high


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint with an MTP module")
    parser.add_argument("--token-map", default=None, help="also time the MTP drafting over this token map")
    parser.add_argument("--max-drafts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96, help="decoded tokens per measurement")
    parser.add_argument("--speedup", type=float, default=1.6)
    parser.add_argument("--batch-size", type=int, default=1, help="requests decoding together")
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    plain_llm = LLM(args.checkpoint, num_threads=args.num_threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100_000) for _ in range(PROMPT_LEN)] for _ in range(args.batch_size)]
    outputs = plain_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.tokens + 1, ignore_eos=True))
    known = {tuple(prompt): list(output.outputs[0].token_ids) for prompt, output in zip(prompts, outputs)}
    plain, _ = decode_ms_per_step(plain_llm, prompts, args.tokens)
    del plain_llm
    rows = [{"kind": "plain", "k": 0, "batch_size": args.batch_size, "ms_per_step": round(plain, 1),
             "step_vs_plain": 1.0}]
    print(json.dumps(rows[0]), flush=True)
    for k in range(1, args.max_drafts + 1):
        # drafts at any batch size (not the device's default), never switched off unless asked
        mtp = {"method": "mtp", "num_speculative_tokens": k, "min_acceptance_rate": 0, "disable_by_batch_size": None}
        kinds = [("verify", mtp | {"method": "ngram"}), ("mtp", mtp),
                 ("mtp, switched off", mtp | {"min_acceptance_rate": 1.0, "min_drafts_for_switch": k,
                                              "switch_backoff_tokens": 0})]
        if args.token_map:
            kinds.append(("mtp over the token map", mtp | {"token_map": args.token_map}))
        for kind, speculative in kinds:  # one engine at a time: each holds the model
            llm = LLM(args.checkpoint, num_threads=args.num_threads, speculative_config=speculative)
            if kind == "verify":
                llm.core.scheduler.proposer = KnownOutputProposer(known, k)
            ms, per_step = decode_ms_per_step(llm, prompts, args.tokens)
            del llm
            cost = ms / plain
            need = needed_acceptance(cost, k, args.speedup)
            rows.append({"kind": kind, "k": k, "ms_per_step": round(ms, 1), "step_vs_plain": round(cost, 3),
                         "tokens_per_step_measured": round(per_step, 2),
                         f"acceptance_for_{args.speedup}x": round(need, 3) if need is not None else "unreachable"})
            print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
