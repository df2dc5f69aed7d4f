"""Benchmark workloads: `random` (independent prompts) and `shared-prefix` (groups sharing a long prefix).

A request is kept endpoint-neutral (prefix + body); `payloads.py` turns it into a completions prompt
(prefix and body concatenated) or chat messages (prefix = system message, body = user message).
"""

from __future__ import annotations

from dataclasses import dataclass

from mili_openai.bench.config import BenchConfig
from mili_openai.bench.prompt_tokens import PromptBuilder, TokenPrompt

# Warmup prompts come from a seed stream apart from the measured ones, so warming up never pre-caches
# a measured prompt in a server's prefix cache.
WARMUP_SEED_OFFSET = 1_000_003


@dataclass(frozen=True, slots=True)
class BenchRequest:
    body: TokenPrompt  # the part unique to this request
    output_len: int  # max_tokens
    prefix: TokenPrompt | None = None  # shared by every request of `group`
    group: int | None = None

    @property
    def prompt_len(self) -> int:
        """Prompt tokens before any chat template (the server's usage adds the template's own)."""
        return self.body.num_tokens + (self.prefix.num_tokens if self.prefix is not None else 0)


def build_random_requests(builder: PromptBuilder, num_requests: int, input_len: int, output_len: int,
                          as_ids: bool = False) -> list[BenchRequest]:
    make = builder.id_prompt if as_ids else builder.prompt
    return [BenchRequest(body=make(input_len), output_len=output_len) for _ in range(num_requests)]


def build_shared_prefix_requests(builder: PromptBuilder, num_requests: int, num_groups: int, prefix_len: int,
                                 suffix_len: int, output_len: int, as_ids: bool = False) -> list[BenchRequest]:
    """`num_requests` requests spread round-robin over `num_groups` prefixes.

    Round-robin (not group after group) so that requests of one group arrive interleaved with the others,
    as in a real multi-tenant load; a server must then keep several prefixes cached at once.
    """
    if num_groups > num_requests:
        raise ValueError(f"num_groups ({num_groups}) must be <= num_requests ({num_requests})")
    make = builder.id_prompt if as_ids else builder.prompt
    prefixes = [make(prefix_len) for _ in range(num_groups)]
    return [
        BenchRequest(body=make(suffix_len), output_len=output_len, prefix=prefixes[i % num_groups],
                     group=i % num_groups)
        for i in range(num_requests)
    ]


def build_requests(config: BenchConfig, builder: PromptBuilder, num_requests: int) -> list[BenchRequest]:
    if config.dataset == "random":
        return build_random_requests(builder, num_requests, config.input_len, config.output_len,
                                     as_ids=config.prompt_as_ids)
    return build_shared_prefix_requests(builder, num_requests, min(config.num_groups, num_requests),
                                        config.prefix_len, config.suffix_len, config.output_len,
                                        as_ids=config.prompt_as_ids)


def build_workload(config: BenchConfig, tokenizer) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(warmup requests, measured requests) of the configured dataset."""
    measured = build_requests(config, PromptBuilder(tokenizer, config.seed), config.num_requests)
    warmup = []
    if config.warmup:
        warmup = build_requests(config, PromptBuilder(tokenizer, config.seed + WARMUP_SEED_OFFSET), config.warmup)
    return warmup, measured
