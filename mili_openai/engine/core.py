"""The engine's synchronous core: requests in (one sequence per sample), one step at a time, deltas out.

`schedule` and `postprocess` run on the thread that owns the engine state (the event loop, or the
caller of the offline `LLM`); `runner.execute` between them is the only heavy work.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path

import numpy as np

from mili_openai.config import EngineConfig
from mili_openai.engine.contract import EngineInfo, EngineRequest
from mili_openai.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher, TokenDecoder
from mili_openai.engine.kv_pages import KVPageManager
from mili_openai.engine.lora_manager import BASE_MODEL_ID
from mili_openai.engine.lora_registry import LoraRegistry
from mili_openai.engine.outputs import (
    EngineObserver,
    EngineStats,
    RequestMetrics,
    SequenceDelta,
    SpeculationCounts,
)
from mili_openai.engine.parallel_sampling import ParentRequest, child_params
from mili_openai.engine.pooling_setup import resolve_pooling
from mili_openai.engine.pooling_spec import PoolingRow, PoolingSpec, accumulate_pooled
from mili_openai.engine.runner import ModelRunner, Runner
from mili_openai.engine.step_preparer import PreparedStep
from mili_openai.engine.sampler import Sampler, SamplerOutput
from mili_openai.engine.sampling_defaults import read_sampling_defaults
from mili_openai.engine.sampling_params import SamplingDefaults, SamplingParams
from mili_openai.engine.scheduled_batch import ScheduledBatch
from mili_openai.engine.scheduler import Scheduler
from mili_openai.engine.sequence import Sequence
from mili_openai.engine.state_slots import StateSlotManager, config_for_state_slots
from mili_openai.engine.structured_output import GrammarCompiler
from mili_openai.engine.tokenizer_loading import load_tokenizer
from mili_openai.model import resolve_model_path
from mili_openai.model.vision_config import checkpoint_vision_spec


class EngineCore:
    def __init__(
        self, config: EngineConfig, runner: Runner, tokenizer, observer: EngineObserver | None = None,
        model_path: Path | None = None, sampling_defaults: SamplingDefaults | None = None,
        pooling: PoolingSpec | None = None,
    ) -> None:
        """sampling_defaults: what a request's omitted sampling fields become (from_config reads them from the
        checkpoint). pooling: serve a pooling model (embeddings, rerank scores) instead of generating."""
        config = config.for_device(runner.device.type)  # the device is known only now
        if runner.num_state_slots:  # linear-attention layers: a state slot per running sequence
            config = config_for_state_slots(config, runner.num_state_snapshots)
        self.config = config
        self.observer = observer
        self.runner = runner
        self.tokenizer = tokenizer
        model_config = runner.model_config
        # the whole KV pool bounds a sequence too, so a request the context admits always fits the pool
        max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                            runner.num_pages * config.page_size)
        if model_config.rope.rope_type == "dynamic":
            # dynamic NTK past the trained context depends on each request's history: refuse it up front
            max_model_len = min(max_model_len, model_config.max_position_embeddings)
        self.info = EngineInfo(tokenizer=tokenizer, model_path=model_path, max_model_len=max_model_len,
                               vocab_size=model_config.vocab_size, eos_token_ids=tuple(model_config.eos_token_ids),
                               quantization=runner.quantization, sampling_defaults=sampling_defaults or {},
                               vision=checkpoint_vision_spec(model_config, model_path), pooling=pooling,
                               lora_adapters=config.lora.modules if config.lora is not None else ())
        # the adapters requests may name, and their ids (the runner holds their weights)
        self.lora = LoraRegistry(config.lora, runner.lora if config.lora is not None else None)
        if pooling is not None:
            runner.set_pooling(pooling)
        page_config = config if pooling is None or pooling.uses_prefix_cache else dataclasses.replace(
            config, enable_prefix_caching=False)  # mean and CLS pooling read every position: no cache
        snapshots = runner.num_state_snapshots if runner.num_state_slots and page_config.enable_prefix_caching else 0
        self.pages = KVPageManager.for_engine(page_config, runner.num_pages, runner.num_state_slots, snapshots)
        self.state_slots = StateSlotManager(runner.num_state_slots) if runner.num_state_slots else None
        self.scheduler = Scheduler(config, self.pages, self.state_slots)
        self.sequences: dict[str, Sequence] = {}  # by sequence id: each sample of each request
        self.requests: dict[str, ParentRequest] = {}  # by request id, until its last sample finishes
        self._request_ids = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.spec_decode = SpeculationCounts()
        self.grammars = GrammarCompiler(tokenizer, model_config.vocab_size)
        # by skip_special_tokens; used on the thread that owns the engine state
        self.decoders = {skip: TokenDecoder(tokenizer, skip) for skip in (True, False)}

    @classmethod
    def from_config(cls, config: EngineConfig, observer: EngineObserver | None = None) -> EngineCore:
        """Resolve the model (embedded default, local dir or hub id), load it and its tokenizer."""
        model_path = resolve_model_path(config.model, config.default_model_cache)
        sampling_defaults = read_sampling_defaults(config.generation_config, model_path)  # before the slow load
        tokenizer = load_tokenizer(model_path)
        runner = ModelRunner.load(config, model_path)
        pooling = resolve_pooling(config, model_path, runner.model_config, tokenizer)
        return cls(config, runner, tokenizer, observer, model_path, sampling_defaults, pooling)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's defaults applied: what a request that sets nothing samples with."""
        return SamplingParams(**self.info.sampling_defaults)

    # ---- requests in ----
    def add(self, request: EngineRequest, request_id: str | None = None) -> ParentRequest:
        """Queue a checked request (engine/contract.py): one sequence per sample of `params.n`, all or none (a
        parent with children, engine/parallel_sampling.py). ValueError for a request id in use, UnknownLoraAdapter
        for an adapter not served (unloaded since the request was checked)."""
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        lora_id = self.lora.id_of(request.lora_name) if request.lora_name is not None else BASE_MODEL_ID
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt, params, max_tokens = request.prompt_token_ids, request.params, request.max_tokens
        parent = ParentRequest.of(request_id, params)
        if any(child_id in self.sequences for child_id in parent.child_ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        now = time.monotonic()
        children = [self._sequence(child_id, request_id, index, prompt, child_params(params, index), max_tokens, now)
                    for index, child_id in enumerate(parent.child_ids)]
        self.requests[request_id] = parent
        for seq in children:
            seq.pooled, seq.images, seq.lora_id = request.pooled, request.images, lora_id
            self.sequences[seq.sequence_id] = seq
            self.scheduler.add(seq)
        return parent

    def _sequence(self, sequence_id: str, request_id: str, index: int, prompt: list[int], params: SamplingParams,
                  max_tokens: int, arrival_time: float) -> Sequence:
        return Sequence(
            sequence_id=sequence_id,
            prompt_token_ids=prompt,
            params=params,
            max_tokens=max_tokens,
            arrival_time=arrival_time,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt, params.skip_special_tokens,
                                               self.decoders[params.skip_special_tokens]),
            stop_matcher=StopStringMatcher(params.stop) if params.stop else None,
            generator=Sampler.make_generator(params.seed, self.runner.device) if params.seed is not None else None,
            grammar=self.grammars.matcher(params.structured_outputs) if params.structured_outputs else None,
            parent_id=request_id,
            index=index,
        )

    def abort(self, request_id: str) -> list[SequenceDelta]:
        """Abort every sample of the request still running; their final deltas (none if it is unknown)."""
        parent = self.requests.get(request_id)
        if parent is None:
            return []
        deltas = []
        for child_id in parent.child_ids:
            seq = self.sequences.get(child_id)
            if seq is not None and not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                deltas.append(self._final_delta(seq, text="", token_ids=[], logprobs=None))
        return deltas

    # ---- one step ----
    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def schedule(self) -> tuple[ScheduledBatch, PreparedStep] | None:
        """The next step, with no other in flight."""
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        return batch, self.runner.prepare(batch)

    def schedule_ahead(self, running: ScheduledBatch) -> tuple[ScheduledBatch, PreparedStep] | None:
        """The step after `running` (scheduled, not yet postprocessed), planned while it runs so the runner
        can start it the moment `running` ends; None where it must wait for `running`'s outputs
        (`Scheduler.can_plan_ahead`). Rows whose sampling reads their output so far (penalties,
        min_tokens) get it with the pending token added on the forward thread (`StepPreparer.prepare`).
        """
        if not self.scheduler.can_plan_ahead(running):
            return None
        batch = self.scheduler.schedule(lookahead=True)
        if batch is None:
            return None
        sampled = [seq for seq, samples in zip(running.seqs, running.samples) if samples]
        return batch, self.runner.prepare(batch, {seq: index for index, seq in enumerate(sampled)})

    def postprocess(self, batch: ScheduledBatch, output: SamplerOutput) -> list[SequenceDelta]:
        deltas: list[SequenceDelta] = []
        now = time.monotonic()
        sampled = iter(zip(output.token_ids, output.logprobs))
        scored = output.prompt_logprobs or {}
        for index, (seq, samples) in enumerate(zip(batch.seqs, batch.samples)):
            drafts = batch.drafts(index)
            # a step that ran no model proposer leaves none: older drafts are for positions behind
            seq.proposed_drafts = output.proposed_drafts[index] if output.proposed_drafts is not None else []
            if not samples:
                tokens = []
            else:
                tokens = [next(sampled) for _ in range(1 + len(drafts))] if drafts else [next(sampled)]
            if seq.is_finished:  # aborted while the forward ran, or finished by the step before
                continue
            if index in scored and seq.prompt_logprobs is not None:
                first, entries = scored[index]
                seq.prompt_logprobs[first : first + len(entries)] = entries
            if index >= batch.num_decode:
                self.pages.cache_computed_pages(seq)
            if seq.pooled:
                delta = self._pool(seq, batch, index, output.pooled or {})
                if delta is not None:
                    deltas.append(delta)
                continue
            if not tokens:
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            if drafts:
                tokens = self._verify_drafts(seq, drafts, tokens)
            deltas.append(self._append_tokens(seq, tokens))
        return deltas

    def _pool(self, seq: Sequence, batch: ScheduledBatch, index: int,
              pooled: dict[int, np.ndarray]) -> SequenceDelta | None:
        """Fold a pooling request's chunk into its vector (engine/pooling_spec.py); once its last chunk ran, it
        finishes with the vector in its final delta."""
        start, length = batch.positions[index], batch.num_new_tokens[index]
        row = PoolingRow(index, 0, length, start, final=start + length == seq.num_prompt_tokens)
        seq.pooling_partial, vector = accumulate_pooled(seq.pooling_partial, pooled.get(index), row,
                                                        self.info.pooling.pooling_type, seq.num_prompt_tokens)
        if not row.final:
            return None
        seq.first_token_time = time.monotonic()  # the result's time, as a first token's for the metrics
        seq.pooling_partial = None
        self.scheduler.finish(seq, "stop")
        return self._final_delta(seq, text="", token_ids=[], logprobs=None, pooled=vector.tolist())

    def _verify_drafts(self, seq: Sequence, drafts: list[int], sampled: list[tuple]) -> list[tuple]:
        """The tokens a decode with drafts produced: the drafts its rows sampled too, then the first
        sample that differs (or the one after the last draft). For a draft that is one token for sure (an
        n-gram's), this is speculative decoding's rejection sampling: the draft is kept with the target's
        probability of it, else the sample is a draw from the target without it; so the tokens have plain
        decoding's distribution, and greedy rows its very tokens."""
        accepted = 0
        while accepted < len(drafts) and sampled[accepted][0] == drafts[accepted]:
            accepted += 1
        self.pages.settle_drafts(seq, len(drafts), accepted)
        self.scheduler.draft_switch.record(seq, len(drafts), accepted)
        self.spec_decode.record(len(drafts), accepted)
        return sampled[: accepted + 1]

    def _append_tokens(self, seq: Sequence, tokens: list[tuple]) -> SequenceDelta:
        """Append a step's tokens (one, or more after drafts) up to the one that finishes seq; one delta."""
        texts, token_ids, logprobs = [], [], []
        for token_id, logprob in tokens:
            token_ids.append(token_id)
            if logprob is not None:
                logprobs.append(logprob)
            texts.append(self._append_token(seq, token_id))
            if seq.is_finished:
                break
        text = texts[0] if len(texts) == 1 else "".join(texts)
        if seq.is_finished:
            return self._final_delta(seq, text, token_ids, logprobs or None)
        return self._delta(seq, text, token_ids, logprobs or None)

    def _append_token(self, seq: Sequence, token_id: int) -> str:
        """Append one token; its text safe to show. Finishes seq (the scheduler frees it) if it ends here."""
        seq.append_token(token_id)
        self.generation_tokens_total += 1
        params, info = seq.params, self.info
        past_min = len(seq.output_token_ids) >= params.min_tokens
        text, finish, stop_reason = "", None, None
        if past_min and token_id in info.eos_token_ids and (not params.ignore_eos or self._format_done(seq)):
            finish = "stop"
        elif past_min and token_id in params.stop_token_ids:
            finish, stop_reason = "stop", token_id
        else:
            text = seq.detokenizer.append([token_id])
            if seq.stop_matcher is not None:
                text, matched = seq.stop_matcher.push(text)
                if matched is not None:
                    finish, stop_reason = "stop", matched
        if finish is None and (len(seq.output_token_ids) >= seq.max_tokens or len(seq.token_ids) >= info.max_model_len):
            finish = "length"
        if finish is None:
            return text
        if not isinstance(stop_reason, str):  # not ended by a stop string: release held-back text
            tail, matched = self._finish_text(seq)
            text += tail
            if matched is not None:
                finish, stop_reason = "stop", matched
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq, finish)
        return text

    @staticmethod
    def _format_done(seq: Sequence) -> bool:
        """Whether seq's structured output takes nothing but EOS now (complete, or in error), its latest
        token counted: an EOS then ends seq even under ignore_eos (as SGLang ends a request whose grammar
        has terminated), where it would otherwise emit EOS after EOS up to max_tokens."""
        return seq.grammar is not None and seq.grammar.finished_by(len(seq.output_token_ids))

    @staticmethod
    def _finish_text(seq: Sequence) -> tuple[str, str | None]:
        """Text held back by the detokeniser (an unfinished character) and the stop matcher."""
        tail = seq.detokenizer.flush()
        if seq.stop_matcher is None:
            return tail, None
        text, matched = seq.stop_matcher.push(tail)
        return (text, matched) if matched is not None else (text + seq.stop_matcher.flush(), None)

    def _delta(self, seq: Sequence, text: str, token_ids: list[int], logprobs,
               request_finished: bool = False, pooled: list[float] | None = None) -> SequenceDelta:
        return SequenceDelta(
            request_id=seq.parent_id,
            index=seq.index,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=len(seq.output_token_ids),
            error=seq.error,
            # once, with the first output token: by then every prompt chunk has been scored
            prompt_logprobs=seq.prompt_logprobs if token_ids and len(seq.output_token_ids) == len(token_ids) else None,
            request_finished=request_finished,
            pooled=pooled,
        )

    def _final_delta(self, seq: Sequence, text: str, token_ids: list[int], logprobs,
                     pooled: list[float] | None = None) -> SequenceDelta:
        """The last delta of a finished seq; forgets seq, and its request once every sample has finished."""
        del self.sequences[seq.sequence_id]
        self.lora.sequence_ended(seq.lora_id, self.sequences.values())  # an unloaded adapter's last one lets it go
        request_finished = self.requests[seq.parent_id].progress.finish(seq.index)
        if request_finished:
            del self.requests[seq.parent_id]
        if seq.first_scheduled_time is not None:
            self.prompt_tokens_total += seq.num_prompt_tokens
        if self.observer is not None:
            self.observer.on_request_finished(self.request_metrics(seq))
        return self._delta(seq, text, token_ids, logprobs, request_finished, pooled)

    def request_metrics(self, seq: Sequence) -> RequestMetrics:
        return RequestMetrics(
            request_id=seq.parent_id,
            index=seq.index,
            arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time,
            first_token_time=seq.first_token_time,
            finished_time=time.monotonic(),
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=len(seq.output_token_ids),
            finish_reason=seq.finish_reason or "abort",
            num_preemptions=seq.num_preemptions,
        )

    # ---- introspection ----
    def stats(self) -> EngineStats:
        pool = self.pages.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_pages=pool.num_pages,
            num_free_pages=pool.num_free,
            num_cached_pages=self.pages.tree.cached_pages,
            kv_cache_usage=self.pages.usage(),
            num_state_slots=self.state_slots.num_slots if self.state_slots is not None else 0,
            num_free_state_slots=self.state_slots.num_free if self.state_slots is not None else 0,
            **(snapshots.stats(self.runner.state_slot_bytes) if (snapshots := self.pages.snapshots) else {}),
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prefix_cache_queries_total=self.scheduler.prefix_cache_queries_total,
            prefix_cache_hits_total=self.scheduler.prefix_cache_hits_total,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            spec_decode_num_drafts_total=self.spec_decode.num_drafts,
            spec_decode_num_draft_tokens_total=self.spec_decode.num_draft_tokens,
            spec_decode_num_accepted_tokens_total=self.spec_decode.num_accepted_tokens,
            running_lora_adapters=self.lora.adapter_names(self.scheduler.running),
            waiting_lora_adapters=self.lora.adapter_names(self.scheduler.waiting),
            max_lora=self.config.lora.max_loras if self.config.lora is not None else 0,
            spec_decode_num_draft_tokens_per_pos=tuple(self.spec_decode.draft_tokens_per_position),
            spec_decode_num_accepted_tokens_per_pos=tuple(self.spec_decode.accepted_tokens_per_position),
        )

    def check_integrity(self) -> None:
        """Pages conserved: free + tree + owned == pool, nothing shared that should not be; likewise state slots."""
        self.pages.check_integrity(self.sequences.values())
        if self.state_slots is not None:
            self.state_slots.check_integrity(self.sequences.values())
