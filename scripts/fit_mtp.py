"""Fit a random checkpoint's MTP module (or, with --draft, a tiny draft model) to the target's own greedy outputs,
so that speculative decoding's acceptance, and the speed-up it buys, can be measured without trained weights
(issue 47). A random MTP head accepts almost nothing; fitted, it accepts what this script measures and prints.

1. Data (scripts/fit_mtp_data.py): random word-token prompts (as `mili bench` draws them) continued by the
   target's greedy output through mili's engine, and random-token sequences; one prefill of each gives the
   target's normed hidden state and greedy next token at every position (teacher forcing: the label is defined
   for any sequence). Positions inside the greedy continuations, what decoding drafts for, weigh most.
2. Fitting (float32, Adam), the target frozen, scored on held-out validation prompts (the top-1 agreement with the
   target over the whole vocabulary on their continuations) and stopped where that stops rising:
   - MTP: at position p the module reads h_p and the embedding of token p + 1 and must give the target's greedy
     token after p + 1 (the token its head drafts). Its decoder layer is transformers' own class (the numerical
     reference mili's MTP layer is tested against), with the checkpoint's `mtp.*` tensors as the start.
   - --draft: a tiny model of the target's family (transformers' class, embeddings and head started from a
     random projection of the target's) learns the target's greedy next token at every position.
   The loss is over the labels' tokens and random others, never the whole 248K vocabulary at once.
3. Output: a copy of the checkpoint with the fitted `mtp.*` tensors (or, with --draft, the draft's own
   checkpoint with the target's tokenizer files), then the acceptance measured through mili's engine on other
   held-out prompts with `--speculative-config` ("mtp", or "draft_model" against the target), per position.

A random target's greedy token is not predictable on prompts the fit did not see, so held-out acceptance stays
near zero. With `--bench-workload ARGS` (repeatable) the data is instead the prompts `mili bench serve ARGS`
sends, continued by the target as served (scripts/fit_mtp_data.py): the fit memorises the benchmark's own greedy
outputs, and is scored and measured on them; the acceptance is then real, but "on the fitted prompt set".

    python scripts/fit_mtp.py /work/bench/qwen35-0.8b-random /tmp/qwen35-0.8b-mtp-fitted
    python scripts/fit_mtp.py /work/bench/qwen35-0.8b-random /tmp/qwen35-draft --draft
    python scripts/fit_mtp.py /work/bench/qwen35-0.8b-random /tmp/fitted --bench-workload "--num-requests 2 \
        --concurrency 1 --input-len 512 --output-len 256 --warmup 1 --seed 3 --ignore-eos"
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fit_mtp_data import (  # noqa: E402 (sibling)
    EVAL_SEED_OFFSET,
    Sequences,
    bench_workload,
    build_and_save,
    generate_as_served,
    load_cached,
    prompts,
)
from fit_training import CandidateLoss, batches, fit, held_out_rows, rounding_check  # noqa: E402 (sibling)

from mili_openai import LLM, SamplingParams  # noqa: E402
from mili_openai.model.loader import checkpoint_files  # noqa: E402

MTP_PREFIX = "mtp."
TOKEN_MAP_FILE = "draft_token_map.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "chat_template.jinja",
                   "generation_config.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="the target checkpoint (random weights)")
    parser.add_argument("output", type=Path, help="where the fitted copy (or, with --draft, the draft) is written")
    parser.add_argument("--draft", action="store_true", help="fit a tiny draft model instead of the MTP module")
    parser.add_argument("--draft-hidden-size", type=int, default=256)
    parser.add_argument("--draft-layers", type=int, default=2, help="for a Qwen3.5 target: linear layers, then "
                                                                    "one full-attention layer last")
    data = parser.add_argument_group("data")
    data.add_argument("--num-prompts", type=int, default=96, help="prompts continued by the target's greedy output")
    data.add_argument("--num-random", type=int, default=16, help="sequences of random tokens only")
    data.add_argument("--validation-prompts", type=int, default=6, help="held out: the fit stops on them")
    data.add_argument("--prompt-len", type=int, default=96)
    data.add_argument("--output-len", type=int, default=160)
    data.add_argument("--other-weight", type=float, default=0.2,
                      help="the weight of positions outside a greedy continuation (those inside weigh 1)")
    data.add_argument("--bench-workload", action="append", default=[], metavar="ARGS",
                      help="fit on the prompts `mili bench serve ARGS` sends (its warm-up ones included; e.g. \"--num-requests "
                           "2 --concurrency 1 --input-len 512 --output-len 256 --warmup 1 --seed 3 --ignore-eos\"), "
                           "continued by the target's greedy output as served, instead of drawn prompts; repeatable. "
                           "The fit is scored, and acceptance measured, on those very prompts (the fitted prompt set)")
    data.add_argument("--data-cache", type=Path, default=None,
                      help="save the labelled data here, or load it where a run with the same data flags did")
    fitting = parser.add_argument_group("fitting")
    fitting.add_argument("--max-epochs", type=int, default=30)
    fitting.add_argument("--max-minutes", type=float, default=15.0, help="the fit's own time limit")
    fitting.add_argument("--batch-size", type=int, default=4, help="sequences per optimizer step")
    fitting.add_argument("--lr", type=float, default=1e-3)
    fitting.add_argument("--negatives", type=int, default=4096,
                         help="random tokens beside the labels' in each step's loss")
    fitting.add_argument("--margin", type=float, default=1.0,
                         help="a scored row counts as right where its label's logit leads every other token's by "
                              "more than this: a fit that barely wins tips under the served bfloat16 rounding")
    fitting.add_argument("--evals-per-epoch", type=int, default=2)
    fitting.add_argument("--patience", type=int, default=4, help="evaluations without a better validation score")
    fitting.add_argument("--token-map-size", type=int, default=32768,
                         help="write the fitted labels' most frequent tokens (at most this many) as the drafts' "
                              "token map, and measure with it (0: none)")
    measuring = parser.add_argument_group("measuring")
    measuring.add_argument("--num-speculative-tokens", type=int, default=3, help="drafts per step when measuring")
    measuring.add_argument("--eval-prompts", type=int, default=4, help="0: no measuring")
    measuring.add_argument("--eval-output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=None)
    return parser.parse_args(argv)


def transformers_classes(config) -> tuple[type, type, type]:
    """(decoder layer, RMSNorm, rotary embedding) classes of the checkpoint's family in transformers."""
    family = config.model_type.removesuffix("_text")
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    prefix = config.architectures[0].removesuffix("ForCausalLM")
    rotary = getattr(module, f"{prefix}TextRotaryEmbedding", None) or getattr(module, f"{prefix}RotaryEmbedding")
    return getattr(module, f"{prefix}DecoderLayer"), getattr(module, f"{prefix}RMSNorm"), rotary


class TrainableMtp(torch.nn.Module):
    """The MTP module as mili runs it (model/mtp_predictor.py), over whole sequences, from transformers' modules."""

    def __init__(self, config, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        layer_class, norm_class, rotary_class = transformers_classes(config)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm_class(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_class(hidden, eps=eps)
        self.norm = norm_class(hidden, eps=eps)
        source = config.layer_types.index("full_attention")  # built as the target's first attention layer
        self.layers = torch.nn.ModuleList(layer_class(config, source) for _ in range(config.mtp_num_hidden_layers))
        self.rotary = rotary_class(config)
        self.load_state_dict(tensors, strict=True)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds (B, T, H) of tokens p + 1, hidden (B, T, H) the target's at p -> (B, T, H) normed."""
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), dim=-1))
        position_ids = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
        rotary = self.rotary(x, position_ids)
        return self.norm(self.layers[0](x, position_embeddings=rotary, attention_mask=None))


def fit_mtp(args, config, train: Sequences, validation: Sequences, embedding: torch.Tensor, head: torch.Tensor
            ) -> dict[str, torch.Tensor]:
    """The fitted `mtp.*` tensors (float32, by checkpoint name); `embedding` and `head` the target's, frozen."""
    source = {}
    for file in checkpoint_files(args.checkpoint):
        source.update({name.removeprefix(MTP_PREFIX): t.float() for name, t in load_file(str(file)).items()
                       if name.startswith(MTP_PREFIX)})
    if not source:
        raise SystemExit(f"{args.checkpoint} carries no MTP weights (mtp.*): fit a draft model with --draft")
    config._attn_implementation = "sdpa"
    module = TrainableMtp(config, source)
    candidate_loss = CandidateLoss(train, len(embedding), args.negatives, args.seed)

    def normed_and_labels(batch, dtype=torch.float32):
        # position p reads h_p and token p + 1, and must give the target's greedy token after p + 1
        tokens, hidden, greedy, weights = batch
        normed = module(F.embedding(tokens[:, 1:], embedding).to(dtype), hidden[:, :-1].to(dtype))
        return normed, greedy[:, 1:], weights[:, 1:]

    def step_loss(batch):
        normed, labels, weights = normed_and_labels(batch)
        return candidate_loss(normed.reshape(-1, normed.shape[-1]), head, labels.reshape(-1), weights.reshape(-1))

    def score(batch):
        with torch.no_grad():
            return held_out_rows(*normed_and_labels(batch), head, args.margin)

    scored = batches(validation, args.batch_size)
    state = fit(args, module, batches(train, args.batch_size), scored, step_loss, score)
    module.load_state_dict(state)
    rounding_check(module, scored, normed_and_labels, head)
    return {MTP_PREFIX + name: tensor.detach() for name, tensor in state.items()}


def write_fitted_copy(checkpoint: Path, output: Path, fitted: dict[str, torch.Tensor]) -> None:
    """A copy of the checkpoint whose `mtp.*` tensors are the fitted ones, in the checkpoint's dtype."""
    shutil.copytree(checkpoint, output, dirs_exist_ok=True)
    for file in checkpoint_files(output):
        tensors = load_file(str(file))
        mtp = [name for name in tensors if name.startswith(MTP_PREFIX)]
        if mtp:
            tensors.update({name: fitted[name].to(tensors[name].dtype) for name in mtp})
            save_file(tensors, str(file), metadata={"format": "pt"})


def draft_config(target_config, args):
    """A tiny model of the target's family, its vocabulary and RoPE, its own LM head."""
    config = target_config.__class__.from_dict(target_config.to_dict())
    hidden, head_dim = args.draft_hidden_size, target_config.head_dim  # the head dims the RoPE sections fit
    config.update(dict(hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=max(1, hidden // head_dim),
                       num_key_value_heads=1, num_hidden_layers=args.draft_layers, tie_word_embeddings=False))
    if hasattr(config, "layer_types"):  # Qwen3.5: linear layers, the last one attends
        config.layer_types = ["linear_attention"] * (args.draft_layers - 1) + ["full_attention"]
        config.update(dict(linear_num_key_heads=max(1, hidden // config.linear_key_head_dim),
                           linear_num_value_heads=max(1, hidden // config.linear_value_head_dim),
                           mtp_num_hidden_layers=0))
    return config


def fit_draft(args, target_config, train: Sequences, validation: Sequences, embedding: torch.Tensor,
              dtype: torch.dtype) -> None:
    """Train the tiny draft and save it at args.output, in `dtype`, with the target's tokenizer files."""
    from transformers import AutoModelForCausalLM

    config = draft_config(target_config, args)
    torch.manual_seed(args.seed)
    draft = AutoModelForCausalLM.from_config(config).float()
    projection, _ = torch.linalg.qr(torch.randn(embedding.shape[1], config.hidden_size))  # orthonormal columns
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(embedding @ projection)
        draft.lm_head.weight.copy_(embedding @ projection)  # the target's head is its embedding (tied)
    candidate_loss = CandidateLoss(train, len(embedding), args.negatives, args.seed)

    def normed_and_labels(batch, dtype=torch.float32):
        tokens, _, greedy, weights = batch
        return draft.model(input_ids=tokens).last_hidden_state, greedy, weights

    def step_loss(batch):
        normed, labels, weights = normed_and_labels(batch)
        return candidate_loss(normed.reshape(-1, normed.shape[-1]), draft.lm_head.weight, labels.reshape(-1),
                              weights.reshape(-1))

    def score(batch):
        with torch.no_grad():
            return held_out_rows(*normed_and_labels(batch), draft.lm_head.weight, args.margin)

    scored = batches(validation, args.batch_size)
    state = fit(args, draft, batches(train, args.batch_size), scored, step_loss, score)
    draft.load_state_dict(state)
    rounding_check(draft.model, scored, normed_and_labels, draft.lm_head.weight.detach().clone())
    draft.to(dtype).save_pretrained(args.output)
    for name in TOKENIZER_FILES:
        if (args.checkpoint / name).exists():
            shutil.copy(args.checkpoint / name, args.output / name)


def write_token_map(args, train: Sequences, validation: Sequences, output: Path, size: int) -> Path:
    """The `size` tokens the fitted labels hold most often, as a token map (engine/draft_head.py) in `output`."""
    counts = torch.bincount(torch.cat(train.greedy))
    ids = counts.argsort(descending=True)[: min(size, int((counts > 0).sum()))]
    held_out = torch.cat([greedy[weights == 1.0] for greedy, weights in zip(validation.greedy, validation.weights)])
    covered = torch.isin(held_out, ids).float().mean().item()
    path = output / TOKEN_MAP_FILE
    path.write_text(json.dumps(sorted(ids.tolist())))
    scored = "fitted prompt set's" if args.bench_workload else "held-out"
    print(f"token map: {len(ids)} tokens ({path}); they hold {covered:.1%} of the {scored} continuations' labels",
          flush=True)
    return path


def measure(args, target: Path, speculative: dict, eval_prompts: list[list[int]],
            fitted: list[list[int]]) -> None:
    """Acceptance of the fitted proposer through mili's engine, greedy: on the held-out prompts, or with
    --bench-workload on the benchmark's own requests (the fitted prompt set, whose sequences as fitted are
    `fitted`: the served ones with drafts are compared with them)."""
    no_switch = {"min_acceptance_rate": 0, "disable_by_batch_size": None}  # measure every draft, at any batch size
    llm = LLM(str(target), speculative_config=speculative | no_switch, num_threads=args.num_threads)
    if args.bench_workload:
        served = [list(output.prompt_token_ids) + list(output.outputs[0].token_ids)
                  for arguments in args.bench_workload for output in generate_as_served(llm, bench_workload(arguments))]
        report_divergence(served, fitted)
    else:
        llm.generate(eval_prompts, SamplingParams(temperature=0.0, max_tokens=args.eval_output_len, ignore_eos=True))
    stats = llm.core.stats()
    drafted, kept = stats.spec_decode_num_draft_tokens_total, stats.spec_decode_num_accepted_tokens_total
    per_position = [f"{k / d:.1%}" if d else "-" for k, d in zip(stats.spec_decode_num_accepted_tokens_per_pos,
                                                                 stats.spec_decode_num_draft_tokens_per_pos)]
    print(json.dumps({"speculative_config": speculative, "measured_on": "the fitted prompt set" if args.bench_workload
                      else "held-out prompts", "draft_tokens": drafted, "accepted_tokens": kept,
                      "acceptance_rate": round(kept / drafted, 4) if drafted else None,
                      "acceptance_per_position": per_position,
                      "mean_tokens_per_verify_step": round(1 + kept / stats.spec_decode_num_drafts_total, 3)
                      if stats.spec_decode_num_drafts_total else None}), flush=True)


def report_divergence(served: list[list[int]], fitted: list[list[int]]) -> None:
    """How many requests decoded, with drafts, the very sequence the fit learnt (a random target's continuation
    tips at any rounding change, and drafts fitted to another continuation are rarely kept)."""
    same = sum(s == f for s, f in zip(served, fitted))
    parted = [next(i for i, (a, b) in enumerate(zip(s, f)) if a != b) for s, f in zip(served, fitted)
              if s != f and len(s) == len(f)]
    print(f"{same} of {len(fitted)} requests decoded the fitted sequence exactly with drafts; the others part from it "
          f"at token {parted} of the sequence", flush=True)


def target_head(checkpoint: Path) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """(the target's input embedding, its LM head (the embedding where tied), both float32, its dtype), read from
    its files alone."""
    found: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(checkpoint):
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():
                if not name.startswith(MTP_PREFIX) and name.endswith(("embed_tokens.weight", "lm_head.weight")):
                    found[name.rsplit(".", 2)[-2]] = tensors.get_tensor(name)
    embedding = found["embed_tokens"].float()
    head = found["lm_head"].float() if "lm_head" in found else embedding
    return embedding, head, found["embed_tokens"].dtype


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.checkpoint)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    started = time.perf_counter()
    data = load_cached(args)
    if data is None:
        llm = LLM(str(args.checkpoint), num_threads=args.num_threads)
        data = build_and_save(args, llm, llm.core.info.vocab_size)
        del llm
    train, validation = data
    embedding, head, dtype = target_head(args.checkpoint)
    vocab = len(embedding)
    eval_prompts = [] if args.bench_workload else prompts(args.checkpoint, vocab, args.eval_prompts, args.prompt_len,
                                                          args.seed + EVAL_SEED_OFFSET)
    if args.draft:
        fit_draft(args, config, train, validation, embedding, dtype)
        target, speculative = args.checkpoint, {"method": "draft_model", "model": str(args.output)}
    else:
        fitted = fit_mtp(args, config, train, validation, embedding, head)
        write_fitted_copy(args.checkpoint, args.output, fitted)
        target, speculative = args.output, {"method": "mtp"}
    if args.token_map_size > 0:
        speculative["token_map"] = str(write_token_map(args, train, validation, args.output, args.token_map_size))
    fitted_sequences = [tokens.tolist() for tokens in train.tokens]
    del train, validation, embedding, head
    print(f"fitted in {time.perf_counter() - started:.0f} s", flush=True)
    if args.eval_prompts == 0:
        return
    measure(args, target, speculative | {"num_speculative_tokens": args.num_speculative_tokens}, eval_prompts,
            fitted_sequences)
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
