"""Benchmark workloads: `random` (independent prompts), `shared-prefix` (groups sharing a long prefix),
`sharegpt` (real conversations from a local ShareGPT-format JSON file, as vLLM's benchmark reads them) and
`multi-turn` (chats whose every turn resends the whole history; the replies are the server's, so the turns'
requests are built as the run goes, bench/conversations.py).

A request is kept endpoint-neutral (prefix + history + body); `sse_client.request_body` turns it into a
completions prompt (all concatenated) or chat messages (prefix = system message, history = user and assistant
turns, body = the new user message).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mili_openai.bench.config import MULTI_TURN, BenchConfig, length_range
from mili_openai.bench.prompt_tokens import PromptBuilder, TokenPrompt

# Warmup prompts come from a seed stream apart from the measured ones, so warming up never pre-caches
# a measured prompt in a server's prefix cache.
WARMUP_SEED_OFFSET = 1_000_003
# vLLM's ShareGPT filter: conversations this short say little, and longer ones exceed small models' contexts
SHAREGPT_MIN_TOKENS = 4  # prompt and reply each
SHAREGPT_MAX_PROMPT_TOKENS = 1024
SHAREGPT_MAX_TOTAL_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class BenchRequest:
    body: TokenPrompt  # the part unique to this request
    output_len: int  # max_tokens
    prefix: TokenPrompt | None = None  # shared by every request of `group`
    group: int | None = None
    # multi-turn: the earlier turns, (user message, the server's reply), and this request's turn (1 = the first)
    history: tuple[tuple[TokenPrompt, TokenPrompt], ...] = ()
    turn: int | None = None

    @property
    def prompt_len(self) -> int:
        """Prompt tokens before any chat template (the server's usage adds the template's own)."""
        history = sum(user.num_tokens + reply.num_tokens for user, reply in self.history)
        return self.body.num_tokens + (self.prefix.num_tokens if self.prefix is not None else 0) + history


@dataclass(frozen=True, slots=True)
class Conversation:
    """A multi-turn chat: its user messages in order, each turn answered in up to `output_len` tokens."""

    messages: tuple[TokenPrompt, ...]
    output_len: int


def build_random_requests(builder: PromptBuilder, num_requests: int, input_len: int, output_len: int,
                          as_ids: bool = False, range_ratio: float = 0.0) -> list[BenchRequest]:
    """`num_requests` independent prompts. With `range_ratio` r > 0 each request's prompt and output lengths
    are drawn uniformly from [len * (1 - r), len * (1 + r)] (at least 1), as vLLM's --random-range-ratio
    draws them; at 0 every request has the given lengths and no length is drawn."""
    make = builder.id_prompt if as_ids else builder.prompt

    def length(center: int) -> int:
        return builder.rng.randint(*length_range(center, range_ratio)) if range_ratio else center

    requests = []
    for _ in range(num_requests):
        prompt_len, max_tokens = length(input_len), length(output_len)
        requests.append(BenchRequest(body=make(prompt_len), output_len=max_tokens))
    return requests


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


def build_sharegpt_requests(builder: PromptBuilder, num_requests: int, path: str | Path,
                            output_len: int | None = None) -> list[BenchRequest]:
    """`num_requests` conversations drawn (seeded) from a ShareGPT-format file: each entry's first turn is
    the prompt, its second the reply whose token count is the request's max_tokens (unless `output_len`).
    Entries are skipped as vLLM skips them: fewer than two turns, a prompt or reply under 4 tokens, a
    prompt over 1024 or prompt + reply over 2048."""
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"dataset_path {str(path)!r} cannot be read as JSON: {exc}") from exc
    if not isinstance(entries, list):
        raise ValueError(f"dataset_path {str(path)!r} must hold a JSON list of conversations")
    order = list(range(len(entries)))
    builder.rng.shuffle(order)
    requests: list[BenchRequest] = []
    for index in order:
        turns = entries[index].get("conversations") if isinstance(entries[index], dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, reply = (str(turn.get("value", "")) if isinstance(turn, dict) else "" for turn in turns[:2])
        prompt_ids = builder.tokenizer.encode(prompt, add_special_tokens=False).ids
        reply_len = builder.count_tokens(reply)
        if (len(prompt_ids) < SHAREGPT_MIN_TOKENS or reply_len < SHAREGPT_MIN_TOKENS
                or len(prompt_ids) > SHAREGPT_MAX_PROMPT_TOKENS
                or len(prompt_ids) + reply_len > SHAREGPT_MAX_TOTAL_TOKENS):
            continue
        body = TokenPrompt(text=prompt, token_ids=tuple(prompt_ids))
        requests.append(BenchRequest(body=body, output_len=output_len or reply_len))
        if len(requests) == num_requests:
            return requests
    raise ValueError(f"dataset_path {str(path)!r} has {len(requests)} usable conversations, fewer than the "
                     f"{num_requests} requests asked for")


def build_conversations(builder: PromptBuilder, num_conversations: int, num_turns: int, turn_len: int,
                        output_len: int) -> list[Conversation]:
    """`num_conversations` chats of `num_turns` user messages of `turn_len` tokens each."""
    return [Conversation(messages=tuple(builder.prompt(turn_len) for _ in range(num_turns)), output_len=output_len)
            for _ in range(num_conversations)]


def build_requests(config: BenchConfig, builder: PromptBuilder, num_requests: int) -> list[BenchRequest]:
    if config.dataset == "sharegpt":
        return build_sharegpt_requests(builder, num_requests, config.dataset_path, config.sharegpt_output_len)
    if config.dataset == "random":
        return build_random_requests(builder, num_requests, config.input_len, config.output_len,
                                     as_ids=config.prompt_as_ids, range_ratio=config.random_range_ratio)
    return build_shared_prefix_requests(builder, num_requests, min(config.num_groups, num_requests),
                                        config.prefix_len, config.suffix_len, config.output_len,
                                        as_ids=config.prompt_as_ids)


def build_workload(config: BenchConfig, tokenizer
                   ) -> tuple[list[BenchRequest], list[BenchRequest] | list[Conversation]]:
    """(warmup requests, measured requests, or conversations for multi-turn) of the configured dataset."""
    if config.dataset == MULTI_TURN:
        conversations = build_conversations(PromptBuilder(tokenizer, config.seed), config.num_conversations,
                                            config.num_turns, config.turn_len, config.output_len)
        return build_warmup(config, tokenizer), conversations
    if config.dataset == "sharegpt":  # one draw, split: a file's conversations are finite, so no overlap
        drawn = build_requests(config, PromptBuilder(tokenizer, config.seed), config.num_requests + config.warmup)
        return drawn[config.num_requests :], drawn[: config.num_requests]
    measured = build_requests(config, PromptBuilder(tokenizer, config.seed), config.num_requests)
    return build_warmup(config, tokenizer), measured


def build_warmup(config: BenchConfig, tokenizer) -> list[BenchRequest]:
    """The warmup requests of a dataset drawn from a seed (multi-turn: single-turn chats of one user message)."""
    if not config.warmup:
        return []
    builder = PromptBuilder(tokenizer, config.seed + WARMUP_SEED_OFFSET)
    if config.dataset == MULTI_TURN:
        return build_random_requests(builder, config.warmup, config.turn_len, config.output_len)
    return build_requests(config, builder, config.warmup)
