"""Shared by the model tests: sequences on shuffled pages, the `ForwardBatch`es the runner would build, and
broken copies of checkpoints."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from mili_openai.model import ForwardBatch, PrefillSegment
from mili_openai.model.batch import PageTables

VOCAB_SAMPLE = 150000  # ids drawn below the special tokens


class PagedSequences:
    """Hands pages to sequences from a shuffled free list and builds `ForwardBatch`es like the engine's
    runner does, so the model is tested on non-contiguous page tables."""

    def __init__(self, num_pages: int, page_size: int, seed: int = 0) -> None:
        self.page_size = page_size
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.tokens: dict[str, list[int]] = {}
        self.pages: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def add(self, key: str, tokens: list[int]) -> None:
        self.tokens[key], self.pages[key], self.computed[key] = list(tokens), [], 0

    def _slots(self, key: str, end: int) -> torch.Tensor:
        """Slots of positions [0, end) of `key`, allocating pages as needed."""
        while len(self.pages[key]) * self.page_size < end:
            self.pages[key].append(self.free.pop())
        positions = torch.arange(end)
        pages = torch.tensor(self.pages[key], dtype=torch.int64)
        return pages[positions // self.page_size] * self.page_size + positions % self.page_size

    def _table(self, keys: list[str]) -> torch.Tensor:
        """The page table of `keys`' sequences, a row each, padded with page 0."""
        width = max(len(self.pages[key]) for key in keys)
        return torch.tensor([self.pages[key] + [0] * (width - len(self.pages[key])) for key in keys],
                            dtype=torch.int64)

    def batch(self, decode: list[str] = (), prefill: list[tuple[str, int]] = ()) -> tuple[ForwardBatch, list]:
        """One forward: a token of each `decode` key, then `n` tokens of each `(key, n)` prefill chunk.
        -> (batch, [(key, position)] per row, all rows wanted as logits)."""
        ids, positions, slot_mapping, rows = [], [], [], []
        decode_table = decode_ctx_lens = None
        if decode:
            contexts = [self._slots(key, self.computed[key] + 1) for key in decode]
            decode_table = self._table(list(decode))
            decode_ctx_lens = torch.tensor([len(c) for c in contexts])
            for key, context in zip(decode, contexts):
                position = self.computed[key]
                ids.append(self.tokens[key][position])
                positions.append(position)
                slot_mapping.append(int(context[-1]))
                rows.append((key, position))
                self.computed[key] += 1
        segments, lengths = [], []
        for key, count in prefill:
            start = self.computed[key]
            context = self._slots(key, start + count)
            segments.append(PrefillSegment(start=len(ids), length=count, context_len=start + count))
            lengths.append(count)
            ids.extend(self.tokens[key][start: start + count])
            positions.extend(range(start, start + count))
            slot_mapping.extend(context[start:].tolist())
            rows.extend((key, p) for p in range(start, start + count))
            self.computed[key] += count
        pages = PageTables(
            self.page_size, decode=decode_table, prefill=self._table([key for key, _ in prefill]) if prefill else None,
            prefill_cu_seqlens=torch.tensor([0, *lengths]).cumsum(0) if prefill else None,
            prefill_ctx_lens=torch.tensor([s.context_len for s in segments]) if prefill else None,
            max_prefill_len=max(lengths, default=0))
        batch = ForwardBatch(
            input_ids=torch.tensor(ids), positions=torch.tensor(positions), slot_mapping=torch.tensor(slot_mapping),
            num_decode=len(decode), prefills=segments, logits_indices=torch.arange(len(ids)),
            decode_ctx_lens=decode_ctx_lens, pages=pages,
        )
        return batch, rows


def counting_matmul(calls: list[torch.Size]):
    """A stand-in for the backend's `matmul`: F.linear, recording each weight's shape in `calls` (which matmuls a
    forward routes through the backend)."""

    def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        calls.append(weight.shape)
        return F.linear(x, weight)

    return matmul


class CountingStack:
    """A decode stack that records each call's row count and runs `stack`: proves a forward went through the
    compiled decode stack, not the modules."""

    def __init__(self, stack) -> None:
        self.stack = stack
        self.max_rows = stack.max_rows
        self.calls: list[int] = []

    def forward(self, *args):
        self.calls.append(args[0].shape[0])
        return self.stack.forward(*args)


def random_tokens(length: int, seed: int, vocab: int = VOCAB_SAMPLE) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def copy_without_weight(source: Path, target: Path, name: str) -> Path:
    """A copy of the single-file checkpoint `source` at `target`, lacking the tensor `name`."""
    shutil.copytree(source, target)
    weights = target / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors[name]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return target
