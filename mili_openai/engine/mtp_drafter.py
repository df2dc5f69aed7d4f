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

from mili_openai.config import MTP_SPECULATIVE_METHOD, SpeculativeConfig
from mili_openai.engine.speculation import NO_TOKEN, SpeculationPlan, StepSpeculation
from mili_openai.model.batch import ForwardBatch, PageTables, PrefillSegment
from mili_openai.model.cache_spec import ModelCaches
from mili_openai.model.mtp_predictor import attach_mtp_predictor


def prepare_model_for_speculation(config: SpeculativeConfig | None, model) -> None:
    """Before the runner sizes its caches: attach the MTP module (and its K/V layers) where it drafts; refuse
    a method that cannot run on this model."""
    if config is None:
        return
    if config.method == "draft_model":
        raise NotImplementedError('speculative method "draft_model" is not implemented yet: use "ngram" or "mtp"')
    if config.method == MTP_SPECULATIVE_METHOD:
        if not hasattr(model, "mtp_predictor"):
            raise ValueError(f'speculative method "mtp" needs a model with an MTP module (Qwen3.5 / Qwen3.6 / '
                             f"Qwen3-Next), not {model.config.architecture}")
        attach_mtp_predictor(model)


def runner_speculation(config: SpeculativeConfig | None, model, caches: ModelCaches,
                       page_size: int) -> StepSpeculation | None:
    """The runner's part of speculative decoding; None where it has none (no linear layer to roll back, no
    model proposer)."""
    if config is None or (caches.state is None and config.method != MTP_SPECULATIVE_METHOD):
        return None
    drafter = None
    if config.method == MTP_SPECULATIVE_METHOD:
        drafter = MtpDrafter(model, caches, config.num_speculative_tokens, page_size)
    return StepSpeculation(caches.state, drafter)


class MtpDrafter:
    def __init__(self, model, caches: ModelCaches, num_speculative_tokens: int, page_size: int) -> None:
        """model: a Qwen3_5ForCausalLM whose `mtp_predictor` is attached (model/mtp_predictor.py)."""
        self.model = model
        self.predictor = model.mtp_predictor
        self.caches = caches
        self.num_speculative_tokens = num_speculative_tokens
        self.page_size = page_size

    @torch.inference_mode()
    def propose(self, plan: SpeculationPlan, batch: ForwardBatch, hidden: torch.Tensor, tokens: list[int],
                accepted: list[int]) -> list[list[int]]:
        catch_up, rows, owners = self._catch_up_batch(plan, batch, tokens, accepted)
        drafts: list[list[int]] = [[] for _ in plan.pages]
        if not owners:
            return drafts
        device = hidden.device
        last = catch_up.logits_indices.to(device)
        state = self._run(catch_up.input_ids, hidden[rows.to(device)], catch_up, 0)[last]  # (S, hidden)
        token = self.model.compute_logits(state).argmax(dim=-1)  # (S,)
        positions = catch_up.positions[last.to(catch_up.positions.device)].tolist()
        for owner, draft in zip(owners, token.tolist()):
            drafts[owner].append(draft)
        live = list(range(len(owners)))
        for step in range(1, self.num_speculative_tokens):
            positions = [position + 1 for position in positions]
            live = [i for i in live if positions[i] // self.page_size < len(plan.pages[owners[i]])]
            if not live:
                break
            chain = self._chain_batch([positions[i] for i in live], [plan.pages[owners[i]] for i in live], device)
            index = torch.tensor(live, dtype=torch.int64, device=device)
            out = self._run(token[index], state[index], chain, step)
            state[index] = out
            token[index] = self.model.compute_logits(out).argmax(dim=-1)
            for i, draft in zip(live, token[index].tolist()):
                drafts[owners[i]].append(draft)
        return drafts

    def _run(self, ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, step: int) -> torch.Tensor:
        rotary = batch.rotary
        if rotary is None:
            rotary = self.model.model.rotary_emb(batch.positions, self.model.dtype)
        embeds = self.model.model.embed_tokens(ids.to(hidden.device))
        return self.predictor(embeds, hidden, rotary, batch, self.caches, step)

    @staticmethod
    def _catch_up_batch(plan: SpeculationPlan, batch: ForwardBatch, tokens: list[int], accepted: list[int]
                        ) -> tuple[ForwardBatch, torch.Tensor, list[int]]:
        """(the catch-up pass's batch, the target rows it reads, the batch index of each of its sampled rows).
        `tokens`: the step's samples in logits order (every decode row, then each sampled chunk's last row)."""
        decode_rows: list[int] = []
        decode_ids: list[int] = []
        last_rows: list[int] = []
        for first, kept in zip(plan.group_rows, accepted):
            decode_rows.extend(range(first, first + kept + 1))
            decode_ids.extend(tokens[first : first + kept + 1])  # the token after each row: drafts, then the sample
            last_rows.append(len(decode_rows) - 1)
        num_decode = len(decode_rows)
        prefill_ids = plan.next_ids.copy()
        shift = batch.num_decode - num_decode  # rejected drafts' rows are left out before the chunks
        segments, sampled_chunks = [], 0
        for segment in batch.prefills:
            end = segment.start - batch.num_decode + segment.length  # past the chunk's last prefill row
            if prefill_ids[end - 1] == NO_TOKEN:  # the chunk sampled: its last row pairs with that token
                prefill_ids[end - 1] = tokens[batch.num_decode + sampled_chunks]
                last_rows.append(num_decode + end - 1)
                sampled_chunks += 1
            segments.append(PrefillSegment(segment.start - shift, segment.length, segment.context_len))
        rows = torch.tensor(decode_rows + list(range(batch.num_decode, batch.num_tokens)), dtype=torch.int64)
        device = batch.positions.device
        rows_on_device, decode_index = rows.to(device), rows[:num_decode].to(device)
        rotary = None if batch.rotary is None else (batch.rotary[0][rows_on_device], batch.rotary[1][rows_on_device])
        pages = batch.pages
        catch_up = ForwardBatch(
            input_ids=torch.from_numpy(np.concatenate((np.asarray(decode_ids, dtype=np.int64), prefill_ids))),
            positions=batch.positions[rows_on_device],
            slot_mapping=batch.slot_mapping[rows_on_device],
            num_decode=num_decode,
            decode_ctx_lens=batch.decode_ctx_lens[decode_index] if num_decode else None,
            prefills=segments,
            logits_indices=torch.tensor(last_rows, dtype=torch.int64),
            pages=PageTables(pages.page_size, pages.decode[decode_index] if num_decode else None, pages.prefill,
                             pages.prefill_cu_seqlens, pages.prefill_ctx_lens, pages.max_prefill_len),
            rotary=rotary,
        )
        owners = list(range(len(plan.group_rows))) + plan.sampled_seqs[len(plan.group_rows):]
        return catch_up, rows, owners

    def _chain_batch(self, positions: list[int], pages: list[np.ndarray], device: torch.device) -> ForwardBatch:
        """One decode row per sequence at `positions`, attending to its pages up to there."""
        width = max(position // self.page_size + 1 for position in positions)
        table = np.zeros((len(positions), width), dtype=np.int64)
        for row, page_list in enumerate(pages):
            count = min(width, len(page_list))
            table[row, :count] = page_list[:count]
        position = np.asarray(positions, dtype=np.int64)
        slots = table[np.arange(len(positions)), position // self.page_size] * self.page_size + position % self.page_size

        def on_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device)

        return ForwardBatch(
            input_ids=on_device(np.zeros(len(positions), dtype=np.int64)),  # the drafts are passed as embeddings' ids
            positions=on_device(position), slot_mapping=on_device(slots), num_decode=len(positions),
            decode_ctx_lens=on_device(position + 1), prefills=[],
            logits_indices=on_device(np.arange(len(positions), dtype=np.int64)),
            pages=PageTables(self.page_size, on_device(table), None, None, None, 0),
        )
