"""What a request costs step by step under speculative decoding's off-switch, against the same request without
speculation (issue 47): an engine without drafts and one with `--speculative-config` decode the same greedy requests
in turn, in one process (A/B, so the machine's drift hits both alike), stepped as the server's loop steps them (the
next step planned before this one runs wherever it may). Per request it prints the steps by kind, with their median
forward time: verify steps (drafts checked), proposer-only steps (a model proposer drafting for the next step),
plain steps; the steps not planned ahead; and the decode's total. With a random MTP head: how many steps the switch
takes, whether a switched-off step costs a plain one, what each probe costs.

    python scripts/switch_timeline.py /work/bench/qwen35-0.8b-random --speculative-config \
        '{"method": "mtp", "num_speculative_tokens": 3}' --tokens 256 --rounds 2
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


def decode_steps(llm: LLM, prompts: list[list[int]], tokens: int) -> list[dict]:
    """Run the requests to the end as the server's loop does, serially; one record per step."""
    core = llm.core
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        core.add(check_request(prompt, params, core.info), f"timeline-{time.monotonic()}-{index}")
    launched, steps = deque(), []
    while core.has_work() or launched:
        if not launched:
            scheduled = core.schedule()
            if scheduled is None:
                continue
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
        steps.append({"decode_only": batch.num_decode == len(batch.seqs), "drafts": sum(map(len, batch.draft_tokens)),
                      "proposer": batch.run_proposer, "ahead": bool(launched), "ms": forward_ms})
    return steps


def summary(steps: list[dict]) -> dict:
    decodes = [step for step in steps if step["decode_only"]]
    kinds = {"verify": [s for s in decodes if s["drafts"]],
             "proposer_only": [s for s in decodes if not s["drafts"] and s["proposer"]],
             "plain": [s for s in decodes if not s["drafts"] and not s["proposer"]]}
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
    args = parser.parse_args()
    engines = {name: LLM(args.checkpoint, speculative_config=speculative, num_threads=args.num_threads,
                         kv_cache_memory_gb=KV_CACHE_GB, max_num_seqs=max(2, args.batch_size))
               for name, speculative in (("plain", None), ("speculative", json.loads(args.speculative_config)))}
    rng = random.Random(0)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(1000, 100_000) for _ in range(PROMPT_LEN)] for _ in range(args.batch_size)]

    for llm in engines.values():
        decode_steps(llm, prompts(), WARMUP_TOKENS)
    for round_index in range(args.rounds):
        batch = prompts()
        for name, llm in engines.items():
            print(json.dumps({"round": round_index, "engine": name, **summary(decode_steps(llm, batch, args.tokens))}),
                  flush=True)


if __name__ == "__main__":
    main()
