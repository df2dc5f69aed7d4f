"""The MTP proposer's forward passes, run by the model runner right after a step's sampling
(engine/speculation.py): the next step's drafts from the checkpoint's own MTP module (model/mtp_predictor.py).

1. Catch-up, over the step's kept rows: every prefill row, and each decode's rows up to its last accepted draft.
   The row at position p pairs the target's hidden state h_p with the token at p + 1 (the next prompt token,
   the accepted draft, or the token just sampled), writing the MTP layer's K/V at p, so that later drafts
   attend to the whole sequence. The last row of each sampled sequence gives its first draft.
2. Chained drafts: each further step is one decode row per sequence at the next position, reading the step
   before's output and draft. Its K/V lands in a slot the scheduler allocated ahead (`Scheduler.draft_lookahead`)
   and is overwritten by the next catch-up before anything reads it; a sequence without a page there stops.
Drafts are greedy (the argmax of the MTP head): one token for sure, which the target's samples verify exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from mili_openai.engine.draft_batches import (
    chain_batch,
    has_page_at,
    drafted_sequences,
    kept_decode_rows,
    kept_rows_batch,
    proposes_for,
    take_drafts,
    taken_tokens,
)
from mili_openai.engine.draft_head import DraftHead
from mili_openai.engine.speculation import NO_TOKEN, SpeculationPlan
from mili_openai.model.batch import ForwardBatch
from mili_openai.model.cache_spec import ModelCaches


class MtpDrafter:
    def __init__(self, model, caches: ModelCaches, num_speculative_tokens: int, page_size: int,
                 head: DraftHead | None = None) -> None:
        """model: a Qwen3_5ForCausalLM whose `mtp_predictor` is attached (model/mtp_predictor.py); head: the
        drafts' logits (default: the model's whole LM head)."""
        self.model = model
        self.head = head if head is not None else DraftHead(model)
        self.predictor = model.mtp_predictor
        self.caches = caches
        self.num_speculative_tokens = num_speculative_tokens
        self.page_size = page_size

    def reset_states(self, slots: torch.Tensor) -> None:
        """Nothing to zero: the MTP module's one layer attends, keeping K/V in the target's pages."""

    def copy_states(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Nothing to copy (no states, as above)."""

    @torch.inference_mode()
    def propose(self, plan: SpeculationPlan, batch: ForwardBatch, hidden: torch.Tensor, tokens: list[int],
                accepted: list[int]) -> list[list[int]]:
        catch_up, rows, owners, sampled = self._catch_up_batch(plan, batch, tokens, accepted)
        drafts: list[list[int]] = [[] for _ in plan.pages]
        device = hidden.device
        last = catch_up.logits_indices.to(device)
        # run even where no sequence sampled: the chunks' K/V are what later drafts attend to
        state = self._run(catch_up.input_ids, hidden[rows.to(device)], catch_up, 0)[last]  # (S, hidden)
        if not owners:
            return drafts
        taken = taken_tokens(plan, tokens, accepted, batch.num_decode, sampled) if plan.grammars is not None else None
        token = torch.empty(len(owners), dtype=torch.int64, device=device)
        positions = catch_up.positions[last.to(catch_up.positions.device)].tolist()
        live = take_drafts(plan, owners, list(range(len(owners))), self.head(state), token, taken,
                           drafts)
        for step in range(1, self.num_speculative_tokens):
            positions = [position + 1 for position in positions]
            live = [i for i in live if has_page_at(positions[i], plan.pages[owners[i]], self.page_size)]
            if not live:
                break
            chain = chain_batch([positions[i] for i in live], [plan.pages[owners[i]] for i in live], self.page_size,
                                device)
            index = torch.tensor(live, dtype=torch.int64, device=device)
            out = self._run(token[index], state[index], chain, step)
            state[index] = out
            live = take_drafts(plan, owners, live, self.head(out), token, taken, drafts)
        return drafts

    def _run(self, ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, step: int) -> torch.Tensor:
        rotary = batch.rotary
        if rotary is None:
            rotary = self.model.model.rotary_emb(batch.positions, self.model.dtype)
        embeds = self.model.model.embed_tokens(ids.to(hidden.device))
        return self.predictor(embeds, hidden, rotary, batch, self.caches, step)

    @staticmethod
    def _catch_up_batch(plan: SpeculationPlan, batch: ForwardBatch, tokens: list[int], accepted: list[int]
                        ) -> tuple[ForwardBatch, torch.Tensor, list[int], list[int]]:
        """(the catch-up pass's batch, the target rows it reads, the batch index of the sequence of each of its
        logits rows and that sequence's index among the step's sampled ones: `drafted_sequences`). `tokens`: the
        step's samples in logits order (every decode row, then each sampled chunk's last row). Decodes the
        proposer no longer drafts for are left out; every prefill row is in."""
        owners, sampled = drafted_sequences(plan)
        decode_rows, counts = kept_decode_rows(plan, accepted)
        # the token after each decode row: its kept drafts, then its sample
        decode_ids = [tokens[row] for row in decode_rows]
        last_rows = np.cumsum(counts).astype(np.int64) - 1
        num_decode = len(decode_rows)
        prefill_ids = plan.next_ids.copy()
        chunk_rows, sampled_chunks = [], 0
        chunk_seqs = iter(plan.sampled_seqs[len(plan.group_rows):])
        for segment in batch.prefills:
            end = segment.start - batch.num_decode + segment.length  # past the chunk's last prefill row
            if prefill_ids[end - 1] == NO_TOKEN:  # the chunk sampled: its last row pairs with that token
                prefill_ids[end - 1] = tokens[batch.num_decode + sampled_chunks]
                sampled_chunks += 1
                if proposes_for(plan, next(chunk_seqs)):
                    chunk_rows.append(num_decode + end - 1)
        input_ids = torch.from_numpy(np.concatenate((np.asarray(decode_ids, dtype=np.int64), prefill_ids)))
        logits_indices = torch.from_numpy(np.concatenate((last_rows, np.asarray(chunk_rows, dtype=np.int64))))
        catch_up, rows = kept_rows_batch(batch, decode_rows, counts, input_ids, logits_indices)
        return catch_up, rows, owners, sampled
