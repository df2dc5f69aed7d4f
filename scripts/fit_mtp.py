"""Fit a random checkpoint's MTP module (or, with --draft, a tiny draft model) to the target's own greedy outputs,
so that speculative decoding's acceptance, and the speed-up it buys, can be measured without trained weights
(issue 47). A random MTP head accepts almost nothing; fitted, it accepts what this script measures and prints.

1. Prompts: random word tokens of the checkpoint's tokenizer, as `mili bench` draws them, from a fixed seed.
2. The target's greedy continuations, through mili's engine; then one forward of mili's model over each whole
   sequence for its final hidden states and its greedy next token at every position.
3. Fitting (float32, Adam), the target frozen:
   - MTP: at position p the module reads h_p and the embedding of token p + 1 and must give the target's greedy
     token after p + 1 (the token its head drafts). Its decoder layer is transformers' own class (the numerical
     reference mili's MTP layer is tested against), with the checkpoint's `mtp.*` tensors as the start.
   - --draft: a tiny model of the target's family (transformers' class, embeddings started from a random
     projection of the target's) learns the target's greedy next token at every position.
4. Output: a copy of the checkpoint with the fitted `mtp.*` tensors (or, with --draft, the draft's own
   checkpoint with the target's tokenizer files), then the acceptance measured through mili's engine on held-out
   prompts with `--speculative-config` ("mtp", or "draft_model" against the target).

    python scripts/fit_mtp.py /work/bench/qwen35-0.8b-random /tmp/qwen35-0.8b-mtp-fitted
    python scripts/fit_mtp.py /work/bench/qwen35-0.8b-random /tmp/qwen35-draft --draft
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import random
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from mili_openai import LLM, SamplingParams
from mili_openai.bench.prompt_tokens import load_tokenizer, sampling_pool
from mili_openai.model import KVCache, ModelCaches, PrefillSegment, StateCache
from mili_openai.model.batch import ForwardBatch, PageTables
from mili_openai.model.cache_spec import has_recurrent_layers
from mili_openai.model.loader import checkpoint_files

MTP_PREFIX = "mtp."
EVAL_SEED_OFFSET = 1_000_003  # held-out prompts: another seed stream than the fitted ones
LOGIT_ROWS = 64  # rows whose logits over the whole vocabulary exist at once
PAGE_SIZE = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "chat_template.jinja",
                   "generation_config.json")
LOSS_REPORTS_PER_EPOCH = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="the target checkpoint (random weights)")
    parser.add_argument("output", type=Path, help="where the fitted copy (or, with --draft, the draft) is written")
    parser.add_argument("--draft", action="store_true", help="fit a tiny draft model instead of the MTP module")
    parser.add_argument("--draft-hidden-size", type=int, default=256)
    parser.add_argument("--draft-layers", type=int, default=2, help="for a Qwen3.5 target: linear layers, then "
                                                                    "one full-attention layer last")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--num-speculative-tokens", type=int, default=3, help="drafts per step when measuring")
    parser.add_argument("--eval-prompts", type=int, default=4)
    parser.add_argument("--eval-output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=None)
    return parser.parse_args(argv)


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
    """(the target's final normed hidden state at each position (T, hidden) float32, its greedy next token at each
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
    return hidden.float(), greedy


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


def fit(module: torch.nn.Module, batches, loss_of, epochs: int, lr: float) -> None:
    """Adam over `batches` (a list), `epochs` times; prints the loss and the top-1 agreement as it goes."""
    optimizer = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=lr)
    every = max(1, len(batches) // LOSS_REPORTS_PER_EPOCH)
    for epoch in range(epochs):
        random.Random(epoch).shuffle(batches)
        losses, agreements = [], []
        for step, batch in enumerate(batches):
            loss, agreement = loss_of(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            agreements.append(agreement)
            if step % every == 0:
                print(f"  epoch {epoch + 1} step {step + 1}/{len(batches)}: loss {losses[-1]:.3f}", flush=True)
        print(f"epoch {epoch + 1}/{epochs}: mean loss {sum(losses) / len(losses):.3f}, top-1 agreement "
              f"{sum(agreements) / len(agreements):.1%}", flush=True)


def head_loss(normed: torch.Tensor, head: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
    logits = normed.reshape(-1, normed.shape[-1]) @ head.T  # (B T, vocab)
    labels = labels.reshape(-1)
    return F.cross_entropy(logits, labels), (logits.argmax(dim=-1) == labels).float().mean().item()


def fit_mtp(args, config, sequences, hidden, greedy, embedding: torch.Tensor, head: torch.Tensor
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
    tokens = torch.tensor(sequences)  # (N, T)
    # position p reads h_p and token p + 1, and must give the target's greedy token after p + 1
    examples = [(tokens[i : i + args.batch_size, 1:], hidden[i : i + args.batch_size, :-1],
                 greedy[i : i + args.batch_size, 1:]) for i in range(0, len(sequences), args.batch_size)]

    def loss_of(batch):
        next_tokens, states, labels = batch
        return head_loss(module(F.embedding(next_tokens, embedding), states), head, labels)

    fit(module, examples, loss_of, args.epochs, args.lr)
    return {MTP_PREFIX + name: tensor.detach() for name, tensor in module.state_dict().items()}


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
    """A tiny model of the target's family, its vocabulary and RoPE."""
    config = target_config.__class__.from_dict(target_config.to_dict())
    hidden, head_dim = args.draft_hidden_size, target_config.head_dim  # the head dims the RoPE sections fit
    config.update(dict(hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=max(1, hidden // head_dim),
                       num_key_value_heads=1, num_hidden_layers=args.draft_layers, tie_word_embeddings=True))
    if hasattr(config, "layer_types"):  # Qwen3.5: linear layers, the last one attends
        config.layer_types = ["linear_attention"] * (args.draft_layers - 1) + ["full_attention"]
        config.update(dict(linear_num_key_heads=max(1, hidden // config.linear_key_head_dim),
                           linear_num_value_heads=max(1, hidden // config.linear_value_head_dim),
                           mtp_num_hidden_layers=0))
    return config


def fit_draft(args, target_config, sequences, greedy, embedding: torch.Tensor, dtype: torch.dtype) -> None:
    """Train the tiny draft and save it at args.output, in `dtype`, with the target's tokenizer files."""
    from transformers import AutoModelForCausalLM

    config = draft_config(target_config, args)
    torch.manual_seed(args.seed)
    draft = AutoModelForCausalLM.from_config(config).float()
    projection, _ = torch.linalg.qr(torch.randn(embedding.shape[1], config.hidden_size))  # orthonormal columns
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(embedding @ projection)
    tokens, labels = torch.tensor(sequences), greedy
    examples = [(tokens[i : i + args.batch_size], labels[i : i + args.batch_size])
                for i in range(0, len(sequences), args.batch_size)]

    def loss_of(batch):
        ids, targets = batch
        logits = draft(input_ids=ids).logits  # (B, T, vocab)
        flat, expected = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        return F.cross_entropy(flat, expected), (flat.argmax(dim=-1) == expected).float().mean().item()

    draft.train()
    fit(draft, examples, loss_of, args.epochs, args.lr)
    draft.to(dtype).save_pretrained(args.output)
    for name in TOKENIZER_FILES:
        if (args.checkpoint / name).exists():
            shutil.copy(args.checkpoint / name, args.output / name)


def measure(args, target: Path, speculative: dict, eval_prompts: list[list[int]]) -> None:
    """Acceptance of the fitted proposer through mili's engine, greedy, on the held-out prompts."""
    llm = LLM(str(target), speculative_config=speculative | {"min_acceptance_rate": 0}, num_threads=args.num_threads)
    params = SamplingParams(temperature=0.0, max_tokens=args.eval_output_len, ignore_eos=True)
    llm.generate(eval_prompts, params)
    stats = llm.core.stats()
    drafted, kept = stats.spec_decode_num_draft_tokens_total, stats.spec_decode_num_accepted_tokens_total
    per_position = [f"{k / d:.1%}" if d else "-" for k, d in zip(stats.spec_decode_num_accepted_tokens_per_pos,
                                                                 stats.spec_decode_num_draft_tokens_per_pos)]
    print(json.dumps({"speculative_config": speculative, "draft_tokens": drafted, "accepted_tokens": kept,
                      "acceptance_rate": round(kept / drafted, 4) if drafted else None,
                      "acceptance_per_position": per_position,
                      "mean_tokens_per_verify_step": round(1 + kept / stats.spec_decode_num_drafts_total, 3)
                      if stats.spec_decode_num_drafts_total else None}), flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.checkpoint)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    started = time.perf_counter()
    llm = LLM(str(args.checkpoint), num_threads=args.num_threads)
    vocab = llm.core.info.vocab_size
    train_prompts = prompts(args.checkpoint, vocab, args.num_prompts, args.prompt_len, args.seed)
    sequences = greedy_outputs(llm, train_prompts, args.output_len)
    model = llm.core.runner.model
    hidden, greedy = zip(*(final_states(model, sequence) for sequence in sequences))
    embedding = model.model.embed_tokens.weight.detach().float()
    head = model.lm_head.weight.detach().float() if model.lm_head is not None else embedding  # tied: the same
    dtype = model.dtype
    del llm, model
    print(f"{len(sequences)} sequences of {len(sequences[0])} tokens: the target's greedy outputs and states in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    eval_prompts = prompts(args.checkpoint, vocab, args.eval_prompts, args.prompt_len, args.seed + EVAL_SEED_OFFSET)
    if args.draft:
        fit_draft(args, config, sequences, torch.stack(greedy), embedding, dtype)
        target, speculative = args.checkpoint, {"method": "draft_model", "model": str(args.output)}
    else:
        fitted = fit_mtp(args, config, sequences, torch.stack(hidden), torch.stack(greedy), embedding, head)
        write_fitted_copy(args.checkpoint, args.output, fitted)
        target, speculative = args.output, {"method": "mtp"}
    print(f"fitted in {time.perf_counter() - started:.0f} s so far; measuring acceptance", flush=True)
    measure(args, target, speculative | {"num_speculative_tokens": args.num_speculative_tokens}, eval_prompts)
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
