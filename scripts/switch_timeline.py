"""What a request costs step by step under speculative decoding's off-switch, against the same request without
speculation (issue 47): an engine without drafts and one with `--speculative-config` decode the same greedy requests
in turn, in one process (A/B, so the machine's drift hits both alike), stepped as the server's loop steps them (the
next step planned before this one runs wherever it may). Per request it prints the steps by kind, with their median
forward time: verify steps (drafts checked), proposer-only steps (a model proposer drafting for the next step),
plain steps; the steps not planned ahead; and the decode's total. With a random MTP head: how many steps the switch
takes, whether a switched-off step costs a plain one, what each probe costs. `--paired` interleaves the two
engines' steps one by one instead and prints the median ratio of their plain steps' times, paired: on a busy
machine the one reading of a switched-off step's cost that drift does not bend.

    python scripts/switch_timeline.py /work/bench/qwen35-0.8b-random --speculative-config \
        '{"method": "mtp", "num_speculative_tokens": 3}' --tokens 256 --rounds 2 [--paired]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import deque

from mili_openai import LLM, SamplingParams
from mili_openai.engine.contract import check_request

PROMPT_LEN = 512
WARMUP_TOKENS = 6
KV_CACHE_GB = 0.5  # two engines in one process: small pools


class RequestStepper:
    """An engine's requests, run to the end as the server's loop runs them (the next step planned before this one
    runs wherever it may), a step at a time; one record per step."""

    def __init__(self, llm: LLM, prompts: list[list[int]], tokens: int) -> None:
        self.core, self.launched, self.steps = llm.core, deque(), []
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        for index, prompt in enumerate(prompts):
            self.core.add(check_request(prompt, params, self.core.info), f"timeline-{time.monotonic()}-{index}")

    def busy(self) -> bool:
        return self.core.has_work() or bool(self.launched)

    def step(self) -> None:
        core, launched = self.core, self.launched
        while not launched:
            scheduled = core.schedule()
            if scheduled is not None:
                launched.append(scheduled)
        batch, step = launched[0]
        if len(launched) == 1:  # the server plans the next step here, while this one runs
            ahead = core.schedule_ahead(batch)
            if ahead is not None:
                launched.append(ahead)
        started = time.perf_counter()
        output = core.runner.execute(step)
        forward_ms = 1000 * (time.perf_counter() - started)
        launched.popleft()
        core.postprocess(batch, output)
        self.steps.append({"decode_only": batch.num_decode == len(batch.seqs),
                           "drafts": sum(map(len, batch.draft_tokens)), "proposer": batch.run_proposer,
                           "ahead": bool(launched), "ms": forward_ms})


def decode_steps(llm: LLM, prompts: list[list[int]], tokens: int) -> list[dict]:
    """Run the requests to the end, serially; one record per step."""
    stepper = RequestStepper(llm, prompts, tokens)
    while stepper.busy():
        stepper.step()
    return stepper.steps


def is_plain(step: dict) -> bool:
    return step["decode_only"] and not step["drafts"] and not step["proposer"]


def paired_plain_steps(engines: dict[str, LLM], prompts: list[list[int]], tokens: int) -> dict:
    """Both engines' requests with their steps interleaved one by one, so that each pair of steps meets the same
    machine: the speculative engine's plain steps over the plain engine's, paired (a busy machine's drift cancels)."""
    steppers = [RequestStepper(llm, prompts, tokens) for llm in engines.values()]
    while any(stepper.busy() for stepper in steppers):
        for stepper in steppers:
            if stepper.busy():
                stepper.step()
    plain, speculative = (stepper.steps for stepper in steppers)
    ratios = [b["ms"] / a["ms"] for a, b in zip(plain, speculative) if is_plain(a) and is_plain(b)]
    return {"paired_plain_steps": len(ratios), "median_ratio": round(statistics.median(ratios), 3),
            "ratio_quartiles": [round(q, 3) for q in statistics.quantiles(ratios, n=4)]}


def summary(steps: list[dict]) -> dict:
    decodes = [step for step in steps if step["decode_only"]]
    kinds = {"verify": [s for s in decodes if s["drafts"]],
             "proposer_only": [s for s in decodes if not s["drafts"] and s["proposer"]],
             "plain": [s for s in decodes if is_plain(s)]}
    row = {"decode_ms": round(sum(step["ms"] for step in decodes)),
           "not_planned_ahead": sum(not step["ahead"] for step in decodes)}
    for kind, chosen in kinds.items():
        row[f"{kind}_steps"] = len(chosen)
        row[f"{kind}_median_ms"] = round(statistics.median(s["ms"] for s in chosen), 1) if chosen else None
    row["verify_at_step"] = [index for index, step in enumerate(decodes) if step["drafts"]]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--speculative-config", required=True, help="JSON, as `mili serve` takes it")
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per request (W3: 256)")
    parser.add_argument("--rounds", type=int, default=2, help="requests per engine, alternating")
    parser.add_argument("--batch-size", type=int, default=1, help="requests decoding together")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--paired", action="store_true",
                        help="interleave the two engines' steps one by one and print the paired ratio of plain steps")
    args = parser.parse_args()
    engines = {name: LLM(args.checkpoint, speculative_config=speculative, num_threads=args.num_threads,
                         kv_cache_memory_gb=KV_CACHE_GB, max_num_seqs=max(2, args.batch_size))
               for name, speculative in (("plain", None), ("speculative", json.loads(args.speculative_config)))}
    rng = random.Random(0)

    vocab = engines["plain"].core.info.vocab_size  # a tiny test checkpoint's too
    low, high = min(1000, vocab // 2), min(100_000, vocab)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(low, high) for _ in range(PROMPT_LEN)] for _ in range(args.batch_size)]

    for llm in engines.values():
        decode_steps(llm, prompts(), WARMUP_TOKENS)
    for round_index in range(args.rounds):
        batch = prompts()
        if args.paired:
            print(json.dumps({"round": round_index, **paired_plain_steps(engines, batch, args.tokens)}), flush=True)
            continue
        for name, llm in engines.items():
            print(json.dumps({"round": round_index, "engine": name, **summary(decode_steps(llm, batch, args.tokens))}),
                  flush=True)


if __name__ == "__main__":
    main()
