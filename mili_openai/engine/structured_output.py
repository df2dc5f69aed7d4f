"""Structured outputs: a grammar per sequence that masks every token which would leave its format.

llguidance (the Rust engine behind vLLM's "guidance" backend) compiles a JSON schema, a regular
expression or a Lark grammar against the tokenizer's vocabulary, and a matcher per sequence gives the
allowed next tokens as a bitmask. The mask is filled when the sampler launches a step and the sampled
token consumed when it finishes (`Sampler.launch`, `Sampler.finish`): a step planned ahead whose matcher
the step before advances launches only once that step has finished (`PreparedStep.needs_host_tokens`),
so it sees its matcher advanced.

With speculative decoding (vLLM's scheme), a sequence's drafts are cut at the first one its format disallows
(`ConstrainedOutput.valid_prefix`); the row after the c-th draft is masked as if the first c drafts were
consumed, which are then rolled back (`ConstrainedOutput.ahead`); and the matcher takes only the tokens the step
keeps: the accepted drafts and the token after them (`consume_tokens`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mili_openai.engine.sampling_params import StructuredOutputsParams


# llguidance views of tokenizers kept per process (a server has one; tests start engines on a few)
VOCABULARIES_KEPT = 4
# keywords whose value is one subschema, a list of them, or a mapping of names to them
SUBSCHEMA_KEYWORDS = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
                      "unevaluatedItems")
SUBSCHEMA_LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "prefixItems")
SUBSCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_json_schema(schema: Any) -> Any:
    """A copy of `schema` in which every object that lists its `properties` allows no other key unless it
    says so (`additionalProperties` or `unevaluatedProperties` of its own), as OpenAI's strict structured
    outputs and vLLM's default backend take a schema. JSON Schema's own default lets a model add any key
    (pydantic's schemas leave it unsaid), and a model that does may never close the object. An object that
    lists no properties (`{"type": "object"}`) stays free-form. `allOf` members are left open: each would
    otherwise forbid the keys the others list."""
    return _strict(schema, close=True)


def _strict(schema: Any, close: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SUBSCHEMA_KEYWORDS:
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key], close=True)
    for key in SUBSCHEMA_LIST_KEYWORDS:
        if isinstance(out.get(key), list):
            out[key] = [_strict(member, close=key != "allOf") for member in out[key]]
    for key in SUBSCHEMA_MAP_KEYWORDS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _strict(sub, close=True) for name, sub in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(out["additionalProperties"], close=True)
    lists_properties = isinstance(out.get("properties"), dict)
    if close and lists_properties and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a format. JSON is compact (no free whitespace): a model's whitespace
    between tokens of JSON would be the one place it could loop. A schema is strict (`strict_json_schema`)."""
    import llguidance

    compact = {"whitespace_flexible": False}
    if spec.json is not None:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(strict_json_schema(schema)),
                                                             defaults=compact)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=compact)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.grammar is not None:  # Lark, or GBNF as vLLM's xgrammar backend takes it (converted)
        from llguidance.gbnf_to_lark import any_to_lark

        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))
    alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice)
    return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")


THINK_START, THINK_END = "<think>", "</think>"  # Qwen3's reasoning tags, one token each


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of the one token `text` encodes to (a tag such as `<think>`), or None if it takes several."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


class ConstrainedOutput:
    """A sequence's matcher, and whether the format has started: a reasoning model's thinking block
    (`StructuredOutputsParams.reasoning`) goes unmasked, and the format begins after its `</think>`."""

    ACTIVE, WAITING, THINKING = "active", "waiting", "thinking"

    def __init__(self, matcher: Any, reasoning: str, think_start: int | None, think_end: int | None) -> None:
        self.matcher = matcher
        self.think_start, self.think_end = think_start, think_end
        has_tags = think_start is not None and think_end is not None
        modes = {"optional": self.WAITING, "open": self.THINKING}
        self.state = modes.get(reasoning, self.ACTIVE) if has_tags else self.ACTIVE
        self.consumed = 0  # tokens consumed, thinking included: the sequence's output tokens so far
        self.matched = 0  # of those, the tokens the matcher took (not the thinking block's): what a rollback undoes
        # How many output tokens there were when the format came to take nothing but EOS (it is complete,
        # or in error); None before. A count rather than a flag: the engine loop reads it for a token
        # while the forward thread, a step ahead, may already have consumed the next one.
        self.finished_at: int | None = None

    @property
    def masks(self) -> bool:
        """Whether the next token is masked at all (not while the model thinks)."""
        return self.state != self.THINKING

    def masks_after(self, drafts: Sequence[int]) -> bool:
        """Whether the token after `drafts` (each allowed in turn) is masked at all."""
        with self.ahead(drafts):
            return self.masks

    def fill_mask(self, bitmask: np.ndarray, index: int, drafts: Sequence[int] = ()) -> None:
        """Row `index` of an int32 bitmask (bit j of word w: token 32 w + j): the tokens this output may
        take next, after `drafts` (each allowed in turn; where it `masks_after` them)."""
        import llguidance.numpy

        with self.ahead(drafts):
            llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask, index)
            if self.state == self.WAITING:  # the format's first tokens, or `<think>` to reason first
                word, bit = divmod(self.think_start, 32)
                bitmask.view(np.uint32)[index, word] |= np.uint32(1 << bit)

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the format allows, each after the ones before it (the state is unchanged)."""
        saved = self._save()
        count = 0
        try:
            while count < len(drafts) and self._allows(drafts[count]):
                self.consume(drafts[count])
                count += 1
        finally:
            self._restore(saved)
        return count

    @contextmanager
    def ahead(self, drafts: Sequence[int]) -> Iterator[None]:
        """Within: as if `drafts` were consumed, up to the first the format disallows (a verify row after it is
        never reached: the target's sample there cannot be that draft); put back after."""
        if not drafts:
            yield
            return
        saved = self._save()
        try:
            for token_id in drafts:
                if not self._allows(token_id):
                    break
                self.consume(token_id)
            yield
        finally:
            self._restore(saved)

    def _allows(self, token_id: int) -> bool:
        if self.state == self.THINKING or (self.state == self.WAITING and token_id == self.think_start):
            return True
        return self.matcher.validate_tokens([token_id]) == 1

    def _save(self) -> tuple[str, int, int | None, int]:
        return self.state, self.consumed, self.finished_at, self.matched

    def _restore(self, saved: tuple[str, int, int | None, int]) -> None:
        if self.matched > saved[3]:
            self.matcher.rollback(self.matched - saved[3])
        self.state, self.consumed, self.finished_at, self.matched = saved

    def finished_by(self, num_output_tokens: int) -> bool:
        """Whether the format took nothing but EOS after the first `num_output_tokens` output tokens."""
        return self.finished_at is not None and self.finished_at <= num_output_tokens

    def consume(self, token_id: int) -> None:
        self.consumed += 1
        if self.state == self.THINKING:
            if token_id == self.think_end:
                self.state = self.ACTIVE
            return
        if self.state == self.WAITING:
            if token_id == self.think_start:
                self.state = self.THINKING
                return
            self.state = self.ACTIVE
        self.matcher.consume_token(token_id)
        self.matched += 1
        if self.finished_at is None and self.matcher.is_stopped():
            self.finished_at = self.consumed


@dataclass(frozen=True, slots=True)
class VocabularyKey:
    """What llguidance's view of a tokenizer depends on: its serialised form (as a digest), the vocabulary size
    and the EOS token. The tokenizer and its serialised form ride along, outside the comparison, to build the view
    from."""

    digest: bytes
    vocab_size: int
    eos_token_id: int | None
    tokenizer: Any = field(compare=False, hash=False, repr=False)
    serialised: str = field(compare=False, hash=False, repr=False)

    @classmethod
    def of(cls, tokenizer: Any, vocab_size: int) -> VocabularyKey:
        serialised = tokenizer.backend_tokenizer.to_str()  # ~0.2 s for Qwen's 151k tokens
        return cls(hashlib.sha256(serialised.encode()).digest(), vocab_size, tokenizer.eos_token_id, tokenizer,
                   serialised)


@functools.lru_cache(maxsize=VOCABULARIES_KEPT)
def llguidance_vocabulary(key: VocabularyKey) -> Any:
    """llguidance's view of `key.tokenizer` (~2.5 s for Qwen's vocabulary; read-only once built, so engines
    with the same tokenizer in one process share it: a test session starts dozens of engines)."""
    import llguidance.hf

    backend = key.tokenizer.backend_tokenizer
    if backend.padding is None and backend.truncation is None:
        # from_tokenizer's own steps on the key's serialised form, without the copy of the tokenizer (~0.4 s) it
        # makes to switch these two off and the second serialisation
        return llguidance.LLTokenizer(key.serialised, n_vocab=key.vocab_size, eos_token=key.eos_token_id)
    return llguidance.hf.from_tokenizer(key.tokenizer, n_vocab=key.vocab_size)


class GrammarCompiler:
    """Constrained outputs for sequences' formats, over one model's tokenizer.

    Compiling is the slow part: llguidance's view of the tokenizer once, then each JSON schema. So the
    server builds the view while loading (`load_vocabulary`) and compiles a request's format on a worker
    thread (`compile`); the engine loop then only copies the compiled matcher (`matcher`). The cache
    keeps the latest formats, as the same schema tends to
    come back (an app's one response type, n > 1 samples). Its lock is held for dictionary work and
    copies only, never for a compile, so the loop never waits behind another request's compile."""

    CACHED_FORMATS = 64

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._vocabulary = None  # llguidance's view of the tokenizer, built once
        self._vocabulary_lock = threading.Lock()
        self._think_tags = [single_token_id(tokenizer, tag) for tag in (THINK_START, THINK_END)]
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # grammar text -> matcher at its start
        self._cache_lock = threading.Lock()

    def load_vocabulary(self) -> Any:
        """llguidance's view of the tokenizer, built on first call. It holds the GIL for most of its build,
        so the server calls this while loading: built on a request, it would stall every stream once."""
        with self._vocabulary_lock:
            if self._vocabulary is None:
                self._vocabulary = llguidance_vocabulary(VocabularyKey.of(self._tokenizer, self._vocab_size))
            return self._vocabulary

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The format's matcher at the start of the output, from the cache or compiled now (and cached);
        ValueError naming what is wrong with the format. Only copies of it are handed out."""
        import llguidance

        try:
            grammar = grammar_text(spec)
        except (ValueError, TypeError) as exc:  # the schema is not JSON, the regex does not parse
            raise ValueError(f"structured output format: {exc}") from None
        with self._cache_lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled
        compiled = llguidance.LLMatcher(self.load_vocabulary(), grammar)
        if compiled.is_error():
            raise ValueError(f"structured output format: {compiled.get_error()}")
        with self._cache_lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > self.CACHED_FORMATS:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutputsParams) -> ConstrainedOutput:
        """A fresh matcher at the start of the output; ValueError naming what is wrong with the format."""
        compiled = self.compile(spec)
        with self._cache_lock:  # copied while no other thread copies the same cached matcher
            return ConstrainedOutput(compiled.deep_copy(), spec.reasoning, *self._think_tags)


def mask_rows(logits: torch.Tensor, rows: list[int], outputs: list[ConstrainedOutput],
              drafts: list[Sequence[int]] | None = None) -> None:
    """Set every token the rows' formats disallow to -inf, in place. logits (B, V) float32 on any device;
    the outputs all mask (after each row's `drafts`, where given: the drafts before a verify row).
    llguidance's numpy helpers, not its torch ones: those apply the mask with torch.compile, which on CPU
    costs a C++ compile on the first constrained step (stalling every stream) and a compiler wherever the
    server runs."""
    import llguidance.numpy

    bitmask = llguidance.numpy.allocate_token_bitmask(len(rows), logits.shape[1])  # (R, ceil(V / 32)) int32
    for index, output in enumerate(outputs):
        output.fill_mask(bitmask, index, drafts[index] if drafts is not None else ())
    # little-endian words: bit j of word w is bit j % 8 of byte 4 w + j // 8, i.e. unpacked bit 32 w + j
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :logits.shape[1]]
    blocked = torch.from_numpy(allowed).to(logits.device) == 0
    for index, row in enumerate(rows):
        logits[row].masked_fill_(blocked[index], float("-inf"))


def consume_tokens(outputs: list[ConstrainedOutput], token_ids: list[int],
                   drafts: list[Sequence[int]] | None = None) -> None:
    """Advance each format by its row's sampled token. A token against the grammar (possible only when
    other processors left no allowed token, e.g. min_tokens blocking the EOS a finished format needs)
    puts the matcher in error, after which it allows EOS alone: the sequence ends, other rows unharmed.
    drafts: per row, the drafts before it where it verifies some (a decode's rows come in order): its token
    counts only where the row before sampled the last of them, so a matcher takes exactly the tokens kept."""
    reached = True
    for index, (output, token_id) in enumerate(zip(outputs, token_ids)):
        before = drafts[index] if drafts is not None else ()
        reached = not before or (reached and token_ids[index - 1] == before[-1])
        if reached:
            output.consume(token_id)
