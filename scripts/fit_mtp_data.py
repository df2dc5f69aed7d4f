"""The training data of scripts/fit_mtp.py: token sequences, and at every position the target's final (normed)
hidden state and its greedy next token, from one prefill of each sequence (teacher forcing); inside a greedy
continuation the label is the token decoding gave (a prefill rounds otherwise and may tip a near tie).

The label at a position is defined for any token sequence, so the sequences mix what serving sees with variety:
- random word-token prompts continued by the target's own greedy output (the continuation is what decode
  drafts for: its positions carry weight 1, the prompt's `--other-weight`);
- sequences of random word tokens only (weight `--other-weight` everywhere);
- validation prompts, continued the same way, held out of the fit: the top-1 agreement on their continuations
  is what the fit reports and stops on.

With `--bench-workload` the sequences are instead the very prompts `mili bench serve` sends with those arguments
(its warm-up requests too), each continued by the target's greedy output as a server decodes it: text prompts
tokenized as the server tokenizes them, the serving dtype, a workload's requests run `--concurrency` at a time. A
random target's greedy token is not predictable on prompts it was not fitted on, so this fit memorises the
benchmark's outputs; it is scored on them, and the acceptance measured on them is "on the fitted prompt set".
"""

from __future__ import annotations

import argparse
import math
import pickle
import random
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mili_openai import LLM, SamplingParams
from mili_openai.bench.cli import add_serve_arguments, config_from_args
from mili_openai.bench.datasets import build_workload
from mili_openai.bench.prompt_tokens import load_tokenizer, sampling_pool
from mili_openai.bench.sse_client import BENCH_TEMPERATURE, completion_prompt
from mili_openai.model import KVCache, ModelCaches, PrefillSegment, StateCache
from mili_openai.model.batch import ForwardBatch, PageTables
from mili_openai.model.cache_spec import has_recurrent_layers

LOGIT_ROWS = 64  # rows whose logits over the whole vocabulary exist at once
PAGE_SIZE = 16
RANDOM_SEED_OFFSET = 500_009  # the random-token sequences: another seed stream than the prompts
VALIDATION_SEED_OFFSET = 700_001  # validation prompts: held out of the fit
EVAL_SEED_OFFSET = 1_000_003  # the prompts acceptance is measured on through the engine: held out of both
LABELS = "decoded"  # in the cache's key: data labelled by a prefill's argmax alone (before served_labels) is stale


@dataclass
class Sequences:
    """Token sequences with, at every position, the target's normed hidden state, its greedy next token and the
    weight of that position in the fit (1 inside a greedy continuation)."""

    tokens: list[torch.Tensor]  # (T,) int64 each
    hidden: list[torch.Tensor]  # (T, hidden) bfloat16 each
    greedy: list[torch.Tensor]  # (T,) int64 each
    weights: list[torch.Tensor]  # (T,) float32 each

    def __len__(self) -> int:
        return len(self.tokens)

    def positions(self) -> int:
        return sum(len(tokens) for tokens in self.tokens)


def prompts(checkpoint: Path, vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` random word tokens (ids the model's vocabulary holds)."""
    pool = [token for token in sampling_pool(load_tokenizer(checkpoint)) if token < vocab_size]
    pool = pool or list(range(vocab_size))
    rng = random.Random(seed)
    return [[rng.choice(pool) for _ in range(length)] for _ in range(count)]


def greedy_outputs(llm: LLM, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompt_ids, params)
    return [prompt + list(output.outputs[0].token_ids) for prompt, output in zip(prompt_ids, outputs)]


@torch.inference_mode()
def final_states(model, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the target's final normed hidden state at each position (T, hidden), its greedy next token at each
    position (T,)): one prefill of the whole sequence on fresh caches (pages in order, state slot 0)."""
    length, specs, dtype, device = len(tokens), model.cache_specs(), model.dtype, torch.device("cpu")
    num_pages = math.ceil(length / PAGE_SIZE)
    states = StateCache(specs, 1, dtype, device) if has_recurrent_layers(specs) else None
    caches = ModelCaches(KVCache(specs, num_pages, PAGE_SIZE, dtype, device), states)
    positions = torch.arange(length)
    batch = ForwardBatch(
        input_ids=torch.tensor(tokens), positions=positions, slot_mapping=positions, num_decode=0,
        decode_ctx_lens=None, prefills=[PrefillSegment(0, length, length)], logits_indices=positions,
        pages=PageTables(PAGE_SIZE, None, torch.arange(num_pages).unsqueeze(0), torch.tensor([0, length]),
                         torch.tensor([length]), length),
        state_slots=torch.zeros(1, dtype=torch.int64) if states is not None else None)
    hidden = model(batch, caches)
    greedy = torch.cat([model.compute_logits(hidden[start : start + LOGIT_ROWS]).argmax(dim=-1)
                        for start in range(0, length, LOGIT_ROWS)])
    return hidden.to(torch.bfloat16), greedy


def labelled(model, sequences: list[list[int]], weights: list[torch.Tensor],
             prompt_lens: list[int | None]) -> Sequences:
    """The sequences with the target's hidden states and greedy labels from one prefill each; inside a greedy
    continuation (a sequence with a prompt length) a position's label is the token the server decoded after it
    (served_labels)."""
    hidden, greedy = zip(*(final_states(model, sequence) for sequence in sequences)) if sequences else ((), ())
    tokens = [torch.tensor(s) for s in sequences]
    return Sequences(tokens, list(hidden), served_labels(tokens, list(greedy), prompt_lens), weights)


def served_labels(tokens: list[torch.Tensor], greedy: list[torch.Tensor], prompt_lens: list[int | None]
                  ) -> list[torch.Tensor]:
    """Each continuation position's label set to the token decoded after it. A prefill's argmax may differ there
    from the decode's in bfloat16 (other kernels, other rounding: a near tie tips), and verification keeps a
    draft only where it is what the server decodes."""
    out, differing, counted = [], 0, 0
    for sequence, labels, prompt_len in zip(tokens, greedy, prompt_lens):
        if prompt_len is not None and len(sequence) > prompt_len:
            served = sequence[prompt_len:]
            decoded = slice(prompt_len - 1, len(sequence) - 1)
            differing += int((labels[decoded] != served).sum())
            counted += len(served)
            labels = labels.clone()
            labels[decoded] = served
        out.append(labels)
    if counted:
        print(f"the prefill's argmax differs from the decoded token at {differing} of {counted} continuation "
              "positions: labelled with the decoded one", flush=True)
    return out


def tail_weights(prompt_len: int, total: int, other_weight: float) -> torch.Tensor:
    """Weight 1 at the positions whose token the target generated, `other_weight` before."""
    weights = torch.full((total,), other_weight)
    weights[prompt_len:] = 1.0
    return weights


def build_data(args, llm: LLM, vocab: int) -> tuple[Sequences, Sequences]:
    """(the fitted sequences, the validation ones), labelled by the target behind `llm`."""
    started = time.perf_counter()
    total = args.prompt_len + args.output_len
    train_prompts = prompts(args.checkpoint, vocab, args.num_prompts, args.prompt_len, args.seed)
    validation_prompts = prompts(args.checkpoint, vocab, args.validation_prompts, args.prompt_len,
                                 args.seed + VALIDATION_SEED_OFFSET)
    continued = greedy_outputs(llm, train_prompts + validation_prompts, args.output_len)
    print(f"{len(continued)} greedy continuations of {args.output_len} tokens in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    random_only = prompts(args.checkpoint, vocab, args.num_random, total, args.seed + RANDOM_SEED_OFFSET)
    tail = tail_weights(args.prompt_len, total, args.other_weight)
    model = llm.core.runner.forward.model
    train = labelled(model, continued[: args.num_prompts] + random_only,
                     [tail] * args.num_prompts + [torch.full((total,), args.other_weight)] * len(random_only),
                     [args.prompt_len] * args.num_prompts + [None] * len(random_only))
    validation = labelled(model, continued[args.num_prompts :], [tail] * len(validation_prompts),
                          [args.prompt_len] * len(validation_prompts))
    print(f"{train.positions()} fitted positions ({len(train)} sequences: {args.num_prompts} greedy-continued, "
          f"{len(random_only)} random), {validation.positions()} validation ones; labelled in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    return train, validation


@dataclass
class BenchWorkload:
    """The requests one `mili bench serve` run sends (warm-up first), as its server receives them."""

    prompts: list[str | list[int]]  # the completions prompt of each
    params: list[SamplingParams]
    concurrency: int  # requests in flight at once


def bench_workload(arguments: str) -> BenchWorkload:
    """The requests of `mili bench serve ARGUMENTS` (e.g. "--num-requests 2 --input-len 512 --output-len 256
    --seed 3 --ignore-eos"): the same seed, lengths and tokenizer draw the same prompts."""
    parser = argparse.ArgumentParser(prog="mili bench serve", add_help=False)
    add_serve_arguments(parser)
    config = config_from_args(parser.parse_args(shlex.split(arguments)))
    if config.endpoint != "completions" or config.dataset not in ("random", "shared-prefix"):
        raise SystemExit(f"--bench-workload {arguments!r}: only the completions endpoint's random or shared-prefix "
                         "prompts are drawn here")
    warmup, measured = build_workload(config, load_tokenizer(config.tokenizer))
    requests = list(warmup) + list(measured)
    params = [SamplingParams(temperature=BENCH_TEMPERATURE, max_tokens=request.output_len,
                             ignore_eos=config.ignore_eos) for request in requests]
    return BenchWorkload([completion_prompt(config, request) for request in requests], params,
                         config.concurrency or len(requests))


def generate_as_served(llm: LLM, workload: BenchWorkload) -> list:
    """The workload's requests through `llm`, `concurrency` at a time (a batch's rows are computed together, which
    in bfloat16 may tip a near tie) -> their RequestOutputs."""
    step = workload.concurrency
    return [output for start in range(0, len(workload.prompts), step)
            for output in llm.generate(workload.prompts[start : start + step], workload.params[start : start + step])]


def build_bench_data(args, llm: LLM) -> tuple[Sequences, Sequences]:
    """The benchmark's own prompts continued by the target (`--bench-workload`), labelled; the fit is scored on
    the same sequences (there is nothing to hold out: they are what the benchmark decodes)."""
    started = time.perf_counter()
    sequences, weights, prompt_lens = [], [], []
    for arguments in args.bench_workload:
        for output in generate_as_served(llm, bench_workload(arguments)):
            prompt = list(output.prompt_token_ids)
            sequences.append(prompt + list(output.outputs[0].token_ids))
            weights.append(tail_weights(len(prompt), len(sequences[-1]), args.other_weight))
            prompt_lens.append(len(prompt))
    print(f"{len(sequences)} benchmark prompts continued in {time.perf_counter() - started:.0f} s", flush=True)
    data = labelled(llm.core.runner.forward.model, sequences, weights, prompt_lens)
    print(f"{data.positions()} fitted positions, {sum(int((w == 1.0).sum()) for w in weights)} of them in greedy "
          f"continuations; labelled in {time.perf_counter() - started:.0f} s", flush=True)
    return data, data


def data_key(args) -> dict:
    """The flags the data depends on: a cache saved under other ones is not reused."""
    key = {name: getattr(args, name) for name in ("checkpoint", "num_prompts", "num_random", "validation_prompts",
                                                  "prompt_len", "output_len", "other_weight", "seed",
                                                  "bench_workload")}
    return key | {"checkpoint": str(key["checkpoint"]), "labels": LABELS}


def load_cached(args) -> tuple[Sequences, Sequences] | None:
    """The data `args.data_cache` holds where a run with the same data flags saved it (the MTP fit and the draft
    fit of one target share it), else None."""
    cache = args.data_cache
    if cache is None or not cache.exists():
        return None
    try:
        saved = torch.load(cache, weights_only=False)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:  # a file cut short: build anew
        print(f"{cache} is unreadable ({exc}): the data is built anew", flush=True)
        return None
    if not isinstance(saved, dict) or saved.get("key") != data_key(args):
        return None
    print(f"data from {cache}", flush=True)
    return Sequences(**saved["train"]), Sequences(**saved["validation"])


def build_and_save(args, llm: LLM, vocab: int) -> tuple[Sequences, Sequences]:
    train, validation = build_bench_data(args, llm) if args.bench_workload else build_data(args, llm, vocab)
    if args.data_cache is not None:  # written whole, then renamed: a run stopped midway leaves no half file
        partial = args.data_cache.with_name(args.data_cache.name + ".partial")
        torch.save({"key": data_key(args), "train": vars(train), "validation": vars(validation)}, partial)
        partial.replace(args.data_cache)
    return train, validation
