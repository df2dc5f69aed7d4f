"""The draft-model proposer (vLLM's "draft_model"): a smaller Qwen3 / Qwen3.5 checkpoint that shares the target's
tokenizer drafts autoregressively, run by the model runner right after each step's sampling (engine/speculation.py).

The draft keeps caches of its own, addressed as the target's: a K/V pool over the same page ids (in the draft's
layer shapes) and, for a hybrid draft, a state pool over the same state slots, the prefix cache's snapshot slots
included. The runner sizes them out of the one cache budget beside the target's. A sequence's slot starts as the
target's does: zeroed, or copied from the snapshot it resumes from. After each step:
1. Catch-up, over the step's kept rows (every prefill row, and each decode's rows up to its last accepted draft),
   reading the target's own input ids: the draft's K/V and states then cover every token the target's cover.
   The states the target saved into snapshots in the step (a chunk's end, a decode reaching a page boundary, a
   verify row's kept state) are saved from the same rows of the draft's (`_save_snapshots`), so a prefix hit
   resumes the draft where it resumes the target.
2. Chained drafts: N decode rows per sampled sequence, one after another: the token just sampled, then each draft
   but the last, each row's argmax the next draft. Their K/V lands in slots the scheduler allocated ahead
   (`Proposer.draft_lookahead`) and is overwritten by the next catch-up before anything reads it; a sequence
   without a page there stops. A hybrid draft's states are put back as the catch-up left them, after the last
   accepted token, where the next catch-up goes on.
Drafts are greedy (the draft's argmax): one token for sure, which the target's samples verify exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mili_openai.config import EngineConfig
from mili_openai.engine import draft_batches
from mili_openai.engine.draft_head import DraftHead
from mili_openai.engine.speculation import SpeculationPlan
from mili_openai.engine.tokenizer_loading import load_tokenizer
from mili_openai.model import KVCache, ModelConfig, load_model, resolve_model_path
from mili_openai.model.batch import ForwardBatch
from mili_openai.model.cache_spec import LayerCacheSpec, ModelCaches, has_recurrent_layers
from mili_openai.model.state_cache import StateCache

# files that hold a checkpoint's vocabulary; a draft with none of them reads the target's token ids as they are
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")
MISMATCHES_NAMED = 3  # differing tokens an error message quotes


@dataclass(frozen=True, slots=True)
class DraftModel:
    """The draft checkpoint, loaded beside the target."""

    model: nn.Module  # a Qwen3ForCausalLM or Qwen3_5ForCausalLM
    config: ModelConfig
    path: Path

    def cache_specs(self) -> list[LayerCacheSpec]:
        return self.model.cache_specs()

    def page_bytes(self, page_size: int) -> int:
        """Bytes one page of the draft's K/V takes (its share of every page of the budget)."""
        return KVCache.bytes_per_page(self.cache_specs(), page_size, self.model.dtype)

    def slot_bytes(self) -> int:
        """Bytes one state slot of the draft takes (0 for a draft without linear-attention layers)."""
        return StateCache.bytes_per_slot(self.cache_specs(), self.model.dtype)

    def caches(self, num_pages: int, page_size: int, num_state_slots: int, device: torch.device) -> ModelCaches:
        """The draft's pools over the target's `num_pages` pages and `num_state_slots` state slots."""
        specs, dtype = self.cache_specs(), self.model.dtype
        states = StateCache(specs, num_state_slots, dtype, device) if has_recurrent_layers(specs) else None
        return ModelCaches(KVCache(specs, num_pages, page_size, dtype, device), states)


def load_draft_model(config: EngineConfig, target_path: Path, target: ModelConfig, dtype: torch.dtype,
                     device: torch.device, defer_cpu_kernels: bool) -> DraftModel:
    """The checkpoint `config.speculative_config.model` names, loaded on `device` in the target's `dtype`; a draft
    that does not share the target's tokenizer, or keeps states a dense target has no slots for, is refused."""
    path = resolve_model_path(config.speculative_config.model, config.default_model_cache)
    draft = ModelConfig.from_pretrained(path)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model {path} has a vocabulary of {draft.vocab_size} tokens, the target "
                         f"{target.vocab_size}: a draft must share the target's tokenizer")
    if draft.hybrid is not None and target.hybrid is None:
        raise ValueError(f"the draft model {path} ({draft.architecture}) has linear-attention layers, whose states "
                         f"a {target.architecture} target keeps no slots for: draft it with a Qwen3 checkpoint")
    check_same_tokenizer(target_path, path)
    model, _ = load_model(path, dtype, device, attention_backend=config.attention_backend,
                          defer_cpu_kernels=defer_cpu_kernels, kernel_plan_cache=config.kernel_plan_cache)
    return DraftModel(model, draft, path)


def check_same_tokenizer(target_path: Path, draft_path: Path) -> None:
    """ValueError naming tokens whose ids differ, where the draft checkpoint ships a tokenizer of its own."""
    if not any((draft_path / name).exists() for name in TOKENIZER_FILES):
        return
    target = load_tokenizer(target_path).get_vocab()
    draft = load_tokenizer(draft_path).get_vocab()
    if target == draft:
        return
    differing = sorted(set(target.items()).symmetric_difference(draft.items()), key=lambda item: item[1])
    named = ", ".join(f"{token!r}" for token, _ in differing[:MISMATCHES_NAMED])
    raise ValueError(f"the draft model {draft_path} has another tokenizer than the target {target_path} "
                     f"({len(target)} and {len(draft)} tokens; {named} differ): a draft must share the target's "
                     "tokenizer")


class DraftModelDrafter:
    def __init__(self, draft: DraftModel, caches: ModelCaches, num_speculative_tokens: int, page_size: int,
                 head: DraftHead | None = None) -> None:
        """head: the drafts' logits (default: the draft's whole LM head)."""
        self.model = draft.model
        self.head = head if head is not None else DraftHead(draft.model)
        self.caches = caches
        self.num_speculative_tokens = num_speculative_tokens
        self.page_size = page_size

    def reset_states(self, slots: torch.Tensor) -> None:
        if self.caches.state is not None:
            self.caches.state.reset(slots)

    def copy_states(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if self.caches.state is not None:
            self.caches.state.copy(src, dst)

    @torch.inference_mode()
    def propose(self, plan: SpeculationPlan, batch: ForwardBatch, hidden: torch.Tensor, tokens: list[int],
                accepted: list[int]) -> list[list[int]]:
        decode_rows, counts = draft_batches.kept_decode_rows(plan, accepted)
        no_logits = torch.empty(0, dtype=torch.int64)
        # the draft's own RoPE; no images (a draft reads their placeholder tokens as text)
        catch_up, _ = draft_batches.kept_rows_batch(batch, decode_rows, counts, None, no_logits, with_rotary=False)
        states = self.caches.state
        keeps_rows = states is not None and bool(plan.snapshot_saves) and catch_up.decode_groups is not None
        if keeps_rows:  # a verify row's state is saved from the row reaching the page boundary
            states.keep_verified_states(catch_up.num_decode)
        self.model(catch_up, self.caches)
        if states is not None:
            self._save_snapshots(plan, accepted, decode_rows if keeps_rows else None)
            states.keep_verified_states(None)
        drafts: list[list[int]] = [[] for _ in plan.pages]
        num_groups = len(plan.group_rows)
        owners, sampled = draft_batches.drafted_sequences(plan)
        if owners:
            taken = draft_batches.taken_tokens(plan, tokens, accepted, batch.num_decode, sampled)
            positions = [plan.sample_positions[owner] + (accepted[owner] if owner < num_groups else 0)
                         for owner in owners]
            self._chain(plan, owners, taken, positions, drafts, batch.input_ids.device)
        return drafts

    def _save_snapshots(self, plan: SpeculationPlan, accepted: list[int], kept_rows: list[int] | None) -> None:
        """The step's state saves (engine/state_snapshots.py) from the draft's states after its catch-up: a slot's
        as it stands (a chunk's end, a decode's last kept row), a verify row's from the state the catch-up's row
        kept (`kept_rows`: the batch row of each catch-up decode row, None where the catch-up kept none). A save
        of a sequence the catch-up skipped (its drafting paused) copies the draft's state as it stands, behind:
        worse drafts after a hit, never other output."""
        states = self.caches.state
        copies = list(plan.state_saves)
        kept_from: list[tuple[int, int]] = []
        catch_up_row = {row: index for index, row in enumerate(kept_rows or [])}
        for decode, row, snapshot_id in plan.snapshot_saves:
            if row > accepted[decode]:
                continue  # the target does not keep it either
            index = catch_up_row.get(plan.group_rows[decode] + row)
            if index is not None:
                kept_from.append((index, snapshot_id))
            else:
                copies.append((plan.group_slots[decode], snapshot_id))
        if copies:
            src, dst = zip(*copies)
            states.copy(torch.tensor(src), torch.tensor(dst))
        if kept_from:
            rows, dst = zip(*kept_from)
            states.restore_kept(torch.tensor(rows), torch.tensor(dst))

    def _chain(self, plan: SpeculationPlan, owners: list[int], taken: list[list[int]], positions: list[int],
               drafts: list[list[int]], device: torch.device) -> None:
        """N chained decode rows per sequence from its sample (the last token it `taken`) at its position, each
        draft appended to `drafts`; a structured output masks them as its target rows."""
        token = torch.tensor([kept[-1] for kept in taken], dtype=torch.int64, device=device)
        states, saved_slots, saved = self.caches.state, None, None
        live, pages = list(range(len(owners))), plan.pages
        for _ in range(self.num_speculative_tokens):
            live = [i for i in live if draft_batches.has_page_at(positions[i], pages[owners[i]], self.page_size)]
            if not live:
                break
            slots = [plan.state_slots[owners[i]] for i in live] if states is not None else None
            if states is not None and saved is None:  # the chain's rows are guesses: their states go back after
                saved_slots = torch.tensor(slots, dtype=torch.int64)
                saved = states.save(saved_slots)
            index = torch.tensor(live, dtype=torch.int64, device=device)
            chain = draft_batches.chain_batch([positions[i] for i in live], [pages[owners[i]] for i in live],
                                              self.page_size, device, input_ids=token[index], state_slots=slots)
            logits = self.head(self.model(chain, self.caches))  # (live, vocab)
            formats = taken if plan.grammars is not None else None
            live = draft_batches.take_drafts(plan, owners, live, logits, token, formats, drafts)
            positions = [position + 1 for position in positions]
        if saved is not None:
            states.restore(saved_slots, saved)
