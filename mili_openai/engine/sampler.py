"""The batch sampler: one call per engine step turns (B, V) logits into one token per sequence.

Order of operations (vLLM's): logit_bias and the min_tokens mask, then penalties, then a structured
output's grammar mask (the sampled token then advances its matcher), then greedy rows take
the argmax; random rows go on through temperature, top-k / top-p and min-p, and draw with the
exponential race (argmax of probs / Exp(1) noise), which needs no multinomial and no host sync.
Log-probabilities are taken from the raw model logits, before any of this.

Given a `SamplingKernel` (the compiled CPU kernels), CPU rows take temperature, the same truncation and
an inverse-CDF draw in one call instead, far cheaper than the torch path's (V,) noise and top-p sort
over Qwen3's vocabulary (mili_openai/kernels/csrc/sample_rows.cpp).

Reproducibility: a seeded row draws exactly one noise vector per step from its own generator ((V,)
uniforms in torch, one uniform in the kernel), and every processor works row by row, so its tokens do
not depend on which rows share the batch.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from mili_openai.engine import logits_processing as lp
from mili_openai.engine import structured_output
from mili_openai.engine.outputs import TokenLogprob
from mili_openai.engine.sampling_params import SamplingParams

# Temperatures below this are greedy (vLLM's epsilon): logits / 1e-30 overflow to inf and softmax to nan.
MIN_TEMPERATURE = 1e-5
# Smallest Exp(1) draw used as a divisor: -log(U) is exactly 0 when U rounds to 1, and probs / 0 would
# win the race with inf (or nan for a masked token).
MIN_EXPONENTIAL_NOISE = 1e-10


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one sequence of the batch."""

    params: SamplingParams
    generator: torch.Generator | None  # the request's own generator when params.seed is set
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    grammar: Any = None  # the sequence's structured-output matcher (engine/structured_output.py), if any
    # a row verifying drafts: the drafts before it, which its grammar mask sees consumed (a decode's rows in order)
    grammar_drafts: Sequence[int] = ()


class SamplerOutput(NamedTuple):
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # per row; None unless params.logprobs is not None
    # scored prompt tokens (params.prompt_logprobs), set by the model runner: batch index of the
    # sequence -> (prompt index of the first entry, the entries)
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprob]]] | None = None
    # pooling chunks' reductions (engine/pooler.py), set by the model runner: batch index -> float32 vector
    pooled: dict[int, np.ndarray] | None = None
    # a model proposer's drafts for each sequence's next step, in batch order (engine/speculation.py); None: none
    proposed_drafts: list[list[int]] | None = None


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top_ks: Sequence[int],
                   with_ranks: bool = False) -> list[TokenLogprob]:
    """Row i's log-probability of token_ids[i] under log_softmax(logits[i]), with its top_ks[i] likeliest
    tokens (one topk at the widest k; each row keeps its own first k) and, with_ranks, its rank."""
    targets = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device)
    tensors = logprob_tensors(logits, targets, max(top_ks), with_ranks)
    return logprob_entries(token_ids, top_ks, *(t.tolist() if t is not None else None for t in tensors))


def logprob_tensors(logits: torch.Tensor, targets: torch.Tensor, max_top_k: int, with_ranks: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """-> (chosen (R,), ranks (R,) or None, top values (R, k) or None, top ids (R, k) or None) on the logits'
    device, nothing read on the host: `logprob_entries` turns them into entries once copied."""
    logprobs = logits.log_softmax(dim=-1)  # (R, V)
    chosen_column = logprobs.gather(1, targets.unsqueeze(1))  # (R, 1)
    ranks = (logprobs > chosen_column).sum(dim=-1) + 1 if with_ranks else None
    values = ids = None
    if max_top_k > 0:
        values, ids = logprobs.topk(max_top_k, dim=-1)  # (R, max k) each
    return chosen_column.squeeze(1), ranks, values, ids


def logprob_entries(token_ids: Sequence[int], top_ks: Sequence[int], chosen: list[float], ranks: list[int] | None,
                    top_values: list[list[float]] | None, top_ids: list[list[int]] | None) -> list[TokenLogprob]:
    """The entries of `logprob_tensors`' outputs as lists."""
    ranks = ranks if ranks is not None else [None] * len(chosen)
    return [
        TokenLogprob(token_id=token_id, logprob=logprob,
                     top=list(zip(top_ids[row][:k], top_values[row][:k])) if k else [], rank=rank)
        for row, (token_id, logprob, k, rank) in enumerate(zip(token_ids, chosen, top_ks, ranks))
    ]


@dataclass(slots=True)
class PendingSample:
    """A batch sampled on the device whose tokens are still on their way to the host (`Sampler.launch`)."""

    token_ids: torch.Tensor  # (B,) int64 on the sampler's device
    host: list[torch.Tensor | None]  # token ids, then logprob_tensors' four: host copies (in flight on CUDA)
    copied: Any  # a torch.cuda.Event recorded after the copies; None on CPU, where they are the tensors
    constrained: list[int]  # rows with a structured output: their matchers take the token at finish
    grammars: list[Any]
    grammar_drafts: list[Sequence[int]]  # per constrained row, the drafts before it (SamplingRow.grammar_drafts)
    logprob_rows: list[int]  # rows that asked for logprobs, and how many top tokens each
    logprob_top_ks: list[int]


class SamplingKernel(Protocol):
    """Temperature, top-k/top-p/min-p and one draw per row in one compiled call (see
    mili_openai.kernels.CpuKernels.sample_rows)."""

    def sample_rows(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, min_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor: ...


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < MIN_TEMPERATURE


def _top_k_is_on(params: SamplingParams, vocab_size: int) -> bool:
    return 0 < params.top_k < vocab_size


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device, seed: int,
                 kernel: SamplingKernel | None = None) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.device = torch.device(device)
        self.generator = self.make_generator(seed, self.device)  # the stream of rows without a seed
        self.kernel = kernel  # for CPU samplers only (ModelRunner passes one on CPU)

    @staticmethod
    def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
        generator = torch.Generator(device=torch.device(device))
        generator.manual_seed(seed)
        return generator

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """logits: (B, V) float32, one row per entry of `rows`. Returns one token (and logprobs) per row."""
        return self.finish(self.launch(logits, rows))

    def launch(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> PendingSample:
        """Sample the batch on the logits' device, with the copies of its results to the host queued but
        not waited for (on CUDA the host need not wait for the GPU here, except for a structured output's
        mask, which the host computes). `finish` brings them back."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be (len(rows)={len(rows)}, V), got {tuple(logits.shape)}")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, fewer than vocab_size={self.vocab_size}")
        if not rows:
            empty = torch.empty(0, dtype=torch.long, device=logits.device)
            return PendingSample(empty, [empty.cpu(), None, None, None, None], None, [], [], [], [], [])
        self._validate_logit_bias(rows, logits.shape[1])
        raw_logits = logits
        constrained = [i for i, row in enumerate(rows) if row.grammar is not None]  # structured outputs
        logits = self._process(logits, rows, constrained)  # (B, V), a new tensor whenever anything changed

        greedy_rows = [i for i, row in enumerate(rows) if _is_greedy(row.params)]
        if len(greedy_rows) == len(rows):
            token_ids = lp.argmax_rows(logits)  # (B,)
        else:
            token_ids = self._sample_random(logits, rows, greedy_rows)  # (B,)
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        top_ks = [rows[i].params.logprobs for i in wanted]
        tensors = (None,) * 4
        if wanted:  # from the raw model logits
            index = self._row_tensor(wanted, torch.long)
            tensors = logprob_tensors(raw_logits[index], token_ids[index], max(top_ks))
        host, copied = self._copy_to_host([token_ids, *tensors])
        return PendingSample(token_ids, host, copied, constrained, [rows[i].grammar for i in constrained],
                             [rows[i].grammar_drafts for i in constrained], wanted, top_ks)

    @staticmethod
    def finish(pending: PendingSample) -> SamplerOutput:
        """Wait for a launched batch's results (the GIL released) and read them: the step's one host sync."""
        if pending.copied is not None:
            pending.copied.synchronize()
        token_list, *lists = (t.tolist() if t is not None else None for t in pending.host)
        if pending.constrained:
            structured_output.consume_tokens(pending.grammars, [token_list[i] for i in pending.constrained],
                                             pending.grammar_drafts)
        logprobs: list[TokenLogprob | None] = [None] * len(token_list)
        if pending.logprob_rows:
            entries = logprob_entries([token_list[i] for i in pending.logprob_rows], pending.logprob_top_ks, *lists)
            for row_index, entry in zip(pending.logprob_rows, entries):
                logprobs[row_index] = entry
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)

    # ---- processing shared by greedy and random rows ----
    def _validate_logit_bias(self, rows: Sequence[SamplingRow], width: int) -> None:
        # The routes and EngineCore.add reject such ids first; this is the last line before index_put_.
        for row in rows:
            for token_id in row.params.logit_bias:
                if not 0 <= token_id < width:
                    raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary [0, {width})")

    def _process(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 constrained: Sequence[int] = ()) -> torch.Tensor:
        """`constrained`: the rows with a structured output (`SamplingRow.grammar`)."""
        width = logits.shape[1]
        bias_rows, bias_tokens, bias_values = [], [], []
        masked_rows, masked_tokens = [], []
        penalty_rows = []
        for index, row in enumerate(rows):
            params = row.params
            for token_id, bias in params.logit_bias.items():
                bias_rows.append(index)
                bias_tokens.append(token_id)
                bias_values.append(bias)
            if len(row.output_token_ids) < params.min_tokens:
                # ignore_eos only changes stopping; below min_tokens EOS is never sampled either way.
                blocked = {*self.eos_token_ids, *(t for t in params.stop_token_ids if 0 <= t < width)}
                masked_rows.extend([index] * len(blocked))
                masked_tokens.extend(blocked)
            if params.has_penalties:
                penalty_rows.append(index)

        padded = width > self.vocab_size
        # not while thinking (after the drafts before a verify row)
        masked_formats = [index for index in constrained
                          if rows[index].grammar.masks_after(rows[index].grammar_drafts)]
        if not (bias_rows or masked_rows or penalty_rows or padded or masked_formats):
            return logits
        logits = logits.clone()  # the caller's tensor stays the raw logits (logprobs read them)
        if padded:  # columns past the real vocabulary (a padded lm_head) are never sampled
            logits[:, self.vocab_size :] = lp.NEG_INF
        if bias_rows:
            lp.apply_additive_bias(logits, bias_rows, bias_tokens, bias_values)
        if masked_rows:
            lp.mask_tokens(logits, masked_rows, masked_tokens)
        if penalty_rows:
            self._apply_penalties(logits, [rows[i] for i in penalty_rows], penalty_rows)
        if masked_formats:  # last: a format's mask is absolute, whatever the biases did
            structured_output.mask_rows(logits, masked_formats, [rows[i].grammar for i in masked_formats],
                                        [rows[i].grammar_drafts for i in masked_formats])
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], indices: list[int]) -> None:
        """Penalties touch only the tokens a row has seen: a few hundred entries, not (R, V) tensors
        over the whole vocabulary."""
        rep_rows, rep_tokens, rep_penalties = [], [], []
        out_rows, out_tokens, out_counts, out_presence, out_frequency = [], [], [], [], []
        for index, row in zip(indices, rows):
            params = row.params
            if params.repetition_penalty != 1:
                seen = {*row.prompt_token_ids, *row.output_token_ids}
                rep_rows.extend([index] * len(seen))
                rep_tokens.extend(seen)
                rep_penalties.extend([params.repetition_penalty] * len(seen))
            if params.presence_penalty != 0 or params.frequency_penalty != 0:
                counts = collections.Counter(row.output_token_ids)
                out_rows.extend([index] * len(counts))
                out_tokens.extend(counts.keys())
                out_counts.extend(counts.values())
                out_presence.extend([params.presence_penalty] * len(counts))
                out_frequency.extend([params.frequency_penalty] * len(counts))
        if rep_rows:  # first, as transformers and vLLM order them
            lp.apply_repetition_penalty(logits, rep_rows, rep_tokens, rep_penalties)
        if out_rows:
            lp.apply_presence_frequency_penalties(logits, out_rows, out_tokens, out_counts, out_presence,
                                                  out_frequency)

    def _row_tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return lp.to_device(values, dtype, self.device)

    @staticmethod
    def _copy_to_host(tensors: list[torch.Tensor | None]) -> tuple[list[torch.Tensor | None], Any]:
        """-> (host copies of the tensors, the event after their copies, or None). From a GPU they travel
        back into pinned memory asynchronously, and `finish` waits on the event (the GIL released) rather
        than the host in a synchronous copy."""
        if tensors[0].device.type != "cuda":
            return tensors, None
        host = []
        for tensor in tensors:
            if tensor is None:
                host.append(None)
                continue
            copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.append(copy.copy_(tensor, non_blocking=True))
        copied = torch.cuda.Event()
        copied.record()
        return host, copied

    # ---- random rows ----
    def _sample_random(self, logits: torch.Tensor, rows: Sequence[SamplingRow], greedy_rows: list[int]) -> torch.Tensor:
        random_rows = [i for i, row in enumerate(rows) if not _is_greedy(row.params)]
        all_random = not greedy_rows
        subset_index = None if all_random else self._row_tensor(random_rows, torch.long)
        x = logits if all_random else logits[subset_index]  # (R, V)
        subset = [rows[i] for i in random_rows]
        if self.kernel is not None:
            sampled = self._sample_with_kernel(x, subset)
        else:
            sampled = self._sample_with_torch(x, subset)  # (R,)
        if all_random:
            return sampled
        token_ids = lp.argmax_rows(logits)  # (B,) greedy answer for every row, overwritten for random ones
        token_ids[subset_index] = sampled
        return token_ids

    def _sample_with_kernel(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        params = [row.params for row in rows]
        width = x.shape[1]
        return self.kernel.sample_rows(
            x,
            self._row_tensor([p.temperature for p in params], torch.float32),
            self._row_tensor([p.top_k if _top_k_is_on(p, width) else width for p in params], torch.long),
            self._row_tensor([p.top_p for p in params], torch.float32),
            self._row_tensor([p.min_p for p in params], torch.float32),
            self._uniform(rows, 1, torch.float64).squeeze(1),
        )

    def _sample_with_torch(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        random_params = [row.params for row in rows]
        width = x.shape[1]
        x = x / self._row_tensor([p.temperature for p in random_params], x.dtype).unsqueeze(1)
        use_top_k = any(_top_k_is_on(p, width) for p in random_params)
        use_top_p = any(p.top_p < 1 for p in random_params)
        if use_top_k or use_top_p:
            top_ks = [p.top_k if _top_k_is_on(p, width) else width for p in random_params]
            top_k = self._row_tensor(top_ks, torch.long) if use_top_k else None
            top_p = self._row_tensor([p.top_p for p in random_params], x.dtype) if use_top_p else None
            max_top_k = max((k for k in top_ks if k < width), default=1)
            lp.apply_top_k_top_p(x, top_k, top_p, max_top_k)
        if any(p.min_p > 0 for p in random_params):
            lp.apply_min_p(x, self._row_tensor([p.min_p for p in random_params], x.dtype))

        probs = x.softmax(dim=-1)  # (R, V)
        noise = self._exponential_noise(rows, width, probs.dtype)  # (R, V)
        return lp.argmax_rows(probs.div_(noise))  # (R,)

    def _exponential_noise(self, rows: list[SamplingRow], width: int, dtype: torch.dtype) -> torch.Tensor:
        """(R, V) Exp(1) noise, drawn as -log(U) with U uniform: on CPU `exponential_` is several times
        slower than `uniform_` followed by a log, and the two have the same distribution."""
        uniform = self._uniform(rows, width, dtype)
        return uniform.log_().neg_().clamp_min_(MIN_EXPONENTIAL_NOISE)  # U = 0 gives inf: that token loses

    def _uniform(self, rows: list[SamplingRow], width: int, dtype: torch.dtype) -> torch.Tensor:
        """(R, width) uniforms in [0, 1): each seeded row's from its own generator, the rest shared."""
        uniform = torch.empty(len(rows), width, dtype=dtype, device=self.device)
        unseeded = [i for i, row in enumerate(rows) if row.generator is None]
        if len(unseeded) == len(rows):
            return uniform.uniform_(generator=self.generator)
        for i, row in enumerate(rows):  # a loop only over seeded rows: their streams are separate
            if row.generator is not None:
                uniform[i].uniform_(generator=row.generator)
        if unseeded:
            index = self._row_tensor(unseeded, torch.long)
            shared = torch.empty(len(unseeded), width, dtype=dtype, device=self.device)
            uniform[index] = shared.uniform_(generator=self.generator)
        return uniform
