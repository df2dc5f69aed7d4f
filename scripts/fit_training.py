"""The fitting loop of scripts/fit_mtp.py, shared by the MTP module and the draft model: the loss over candidate
tokens, batches of like-length sequences, Adam stopped on the validation score, and that score (top-1 agreement
with the target over the whole vocabulary, on the rows decoding drafts for)."""

from __future__ import annotations

import copy
import random
import time

import torch
import torch.nn.functional as F

from fit_mtp_data import LOGIT_ROWS, Sequences


class CandidateLoss:
    """Cross-entropy over the tokens any fitted label holds plus `negatives` random others, drawn afresh each step:
    the whole vocabulary's logits for every row would cost more than the module fitted."""

    def __init__(self, train: Sequences, vocab: int, negatives: int, seed: int) -> None:
        self.labels = torch.unique(torch.cat(train.greedy))
        self.index = torch.full((vocab,), -1, dtype=torch.int64)
        self.index[self.labels] = torch.arange(len(self.labels))
        self.vocab, self.negatives = vocab, negatives
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, normed: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
                 ) -> torch.Tensor:
        """normed (N, H), head (vocab, H), labels (N,), weights (N,) -> the weighted mean loss."""
        others = torch.randint(self.vocab, (self.negatives,), generator=self.generator)
        others = others[self.index[others] < 0]
        candidates = torch.cat((self.labels, others))
        logits = normed @ head[candidates].T
        losses = F.cross_entropy(logits, self.index[labels], reduction="none")
        return (losses * weights).sum() / weights.sum()


@torch.no_grad()
def top1(normed: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, margin: float = 0.0) -> int:
    """How many rows' argmax over the whole vocabulary is their label, by at least `margin` over the runner-up."""
    right = 0
    for start in range(0, len(labels), LOGIT_ROWS):
        logits = (normed[start : start + LOGIT_ROWS] @ head.T).float()
        rows = labels[start : start + LOGIT_ROWS].unsqueeze(1)
        label_logit = logits.gather(1, rows).squeeze(1)
        runner_up = logits.scatter(1, rows, float("-inf")).amax(dim=-1)
        right += int((label_logit - runner_up > margin).sum())
    return right


def scored_on(args) -> str:
    """What the fit's top-1 agreement is measured on."""
    return "on the fitted prompt set" if args.bench_workload else "held-out"


def margin_note(args) -> str:
    return f" (the label leading by > {args.margin:g})" if args.margin else ""


def fit(args, module: torch.nn.Module, train_batches: list, validation_batches: list, step_loss, score
        ) -> dict[str, torch.Tensor]:
    """Adam over `train_batches` until the validation score (`score(batch)` -> (right, counted)) stops rising or
    is whole, the epochs or the minutes run out; -> the state of the best score."""
    started = time.perf_counter()
    optimizer = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=args.lr)
    every = max(1, len(train_batches) // args.evals_per_epoch)
    best, best_state, since_best, losses = -1.0, copy.deepcopy(module.state_dict()), 0, []
    for epoch in range(args.max_epochs):
        random.Random(epoch).shuffle(train_batches)
        for step, batch in enumerate(train_batches, 1):
            module.train()
            loss = step_loss(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if step % every and step != len(train_batches):
                continue
            module.eval()
            right, counted = map(sum, zip(*(score(batch) for batch in validation_batches)))
            agreement = right / counted
            minutes = (time.perf_counter() - started) / 60
            print(f"epoch {epoch + 1} step {step}/{len(train_batches)}: mean loss {sum(losses) / len(losses):.3f}, "
                  f"{scored_on(args)} top-1 agreement {agreement:.1%}{margin_note(args)} ({minutes:.1f} min)",
                  flush=True)
            losses = []
            if agreement > best:
                best, best_state, since_best = agreement, copy.deepcopy(module.state_dict()), 0
            else:
                since_best += 1
            if since_best >= args.patience or minutes >= args.max_minutes or best == 1.0:
                print(f"stopped: best {scored_on(args)} top-1 agreement {best:.1%}{margin_note(args)}", flush=True)
                return best_state
    print(f"all epochs run: best {scored_on(args)} top-1 agreement {best:.1%}{margin_note(args)}", flush=True)
    return best_state


def batches(data: Sequences, size: int) -> list[tuple[torch.Tensor, ...]]:
    """(tokens (B, T), hidden (B, T, H) float32, greedy (B, T), weights (B, T)) of `size` sequences at a time, of
    like lengths: the shorter ones padded at their end with weight 0 (the fitted modules are causal, so padding
    changes no earlier position; its label is a real one, which the loss's candidates hold)."""
    order = sorted(range(len(data)), key=lambda index: len(data.tokens[index]))
    pad_label = int(data.greedy[0][0])

    def padded(tensor: torch.Tensor, length: int, value: float) -> torch.Tensor:
        extra = length - len(tensor)
        return torch.cat((tensor, tensor.new_full((extra, *tensor.shape[1:]), value))) if extra else tensor

    out = []
    for start in range(0, len(order), size):
        chosen = order[start : start + size]
        length = max(len(data.tokens[index]) for index in chosen)
        out.append((torch.stack([padded(data.tokens[i], length, 0) for i in chosen]),
                    torch.stack([padded(data.hidden[i], length, 0.0) for i in chosen]).float(),
                    torch.stack([padded(data.greedy[i], length, pad_label) for i in chosen]),
                    torch.stack([padded(data.weights[i], length, 0.0) for i in chosen])))
    return out


def held_out_rows(normed: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, head: torch.Tensor,
                  margin: float = 0.0) -> tuple[int, int]:
    """(right, counted) over the rows inside greedy continuations (weight 1), what decoding drafts for; right:
    the label leads by more than `margin`."""
    rows = weights.reshape(-1) == 1.0
    return (top1(normed.reshape(-1, normed.shape[-1])[rows], head, labels.reshape(-1)[rows], margin),
            int(rows.sum()))


def rounding_check(module: torch.nn.Module, scored_batches: list, rows_of, head: torch.Tensor) -> None:
    """Print the fitted module's top-1 agreement (no margin) with its forward, inputs and head in float32, and in
    bfloat16 as it is served: the gap is what rounding tips on near ties. rows_of(batch, dtype) -> (normed,
    labels, weights) with `module` in that dtype."""
    agreement, originals = {}, {name: param.data for name, param in module.named_parameters()}
    for dtype in (torch.float32, torch.bfloat16):
        for param in module.parameters():  # the parameters only: RoPE's buffers stay float32, as served
            param.data = param.data.to(dtype)
        head_at = head.to(dtype)
        with torch.no_grad():
            right, counted = map(sum, zip(*(held_out_rows(*rows_of(batch, dtype), head_at)
                                            for batch in scored_batches)))
        agreement[dtype] = right / counted
    for name, param in module.named_parameters():
        param.data = originals[name]
    print(f"the fitted module's top-1 agreement (no margin): {agreement[torch.float32]:.1%} in float32, "
          f"{agreement[torch.bfloat16]:.1%} in bfloat16", flush=True)
