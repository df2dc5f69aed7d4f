"""Structured outputs (llguidance grammars): a JSON schema, any JSON object, a regex or a choice, through the offline
engine and speculative decoding, and a reasoning model's thinking before the format (tests/server/
test_structured_outputs_server.py: through a real server). The tiny random model writes no JSON on its own (checked),
so a valid output is the grammar's doing."""

from __future__ import annotations

import json
import re

import openai
import pytest

from helpers_server import served_engine
from mili_openai import LLM, SamplingParams, StructuredOutputsParams
from mili_openai.engine.structured_output import GrammarCompiler, VocabularyKey, strict_json_schema
from structured_helpers import CHOICES, GRAMMAR, GRAMMAR_REGEX, REGEX, SCHEMA, conforms


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), dtype="float32", num_pages=256, page_size=8)


def test_format_params_are_checked():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="non-empty"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="JSON schema"):
        StructuredOutputsParams(json=3)
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_format_holds_greedy_and_sampled(llm, temperature):
    def texts(spec: StructuredOutputsParams) -> list[tuple[str, str]]:
        params = SamplingParams(temperature=temperature, max_tokens=40, n=4, seed=3, structured_outputs=spec)
        return [(c.text, c.finish_reason) for c in llm.generate(["Tell me something."], params)[0].outputs]

    free = llm.generate(["Tell me something."], SamplingParams(temperature=temperature, max_tokens=40, seed=3))
    assert not conforms(free[0].outputs[0].text) and not re.fullmatch(REGEX, free[0].outputs[0].text)
    assert all(conforms(text) and finish == "stop" for text, finish in texts(StructuredOutputsParams(json=SCHEMA)))
    assert all(re.fullmatch(REGEX, text) and finish == "stop"
               for text, finish in texts(StructuredOutputsParams(regex=REGEX)))
    assert all(text in CHOICES and finish == "stop" for text, finish in texts(StructuredOutputsParams(choice=CHOICES)))
    assert all(re.fullmatch(GRAMMAR_REGEX, text) and finish == "stop"
               for text, finish in texts(StructuredOutputsParams(grammar=GRAMMAR)))
    for text, finish in texts(StructuredOutputsParams(json_object=True)):
        assert text.startswith("{")  # a random model's object may run to max_tokens; a finished one parses
        assert finish == "length" or isinstance(json.loads(text), dict)
    llm.core.check_integrity()


def test_schemas_are_strict_unless_they_say_otherwise():
    item = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
                                               "free": {"type": "object"},
                                               "open": {**item, "additionalProperties": True},
                                               "either": {"anyOf": [item, {"type": "null"}]},
                                               "both": {"allOf": [item, {"properties": {"y": {}}}]}},
              "$defs": {"Item": item}}
    strict = strict_json_schema(schema)
    closed = {**item, "additionalProperties": False}
    assert strict["additionalProperties"] is False and strict["$defs"]["Item"] == closed
    properties = strict["properties"]
    assert properties["free"] == {"type": "object"}  # lists no properties: a free-form object
    assert properties["open"]["additionalProperties"] is True and properties["either"]["anyOf"][0] == closed
    assert "additionalProperties" not in properties["both"]["allOf"][0]  # each member would refuse the other's
    assert schema["$defs"]["Item"] == item  # the caller's schema is not touched


def test_a_schema_that_leaves_extra_keys_unsaid_gets_none(llm):
    """pydantic's schemas do not say additionalProperties: false; sampled, the random model would add keys
    (it did, until it ran out of tokens) if the grammar let it."""
    schema = {key: value for key, value in SCHEMA.items() if key != "additionalProperties"}
    optional = {"type": "object", "properties": {"flag": {"type": "boolean"}}}
    params = [SamplingParams(temperature=1.0, max_tokens=40, n=8, seed=seed, structured_outputs=StructuredOutputsParams(
        json=spec)) for seed, spec in enumerate((schema, optional))]
    first, second = llm.generate(["Tell me something.", "Tell me more."], params)
    assert all(conforms(c.text) and c.finish_reason == "stop" for c in first.outputs)
    assert all(set(json.loads(c.text)) <= {"flag"} and c.finish_reason == "stop" for c in second.outputs)


def test_ignore_eos_ends_at_the_eos_that_completes_a_format(llm):
    """ignore_eos keeps an unconstrained stream going past EOS, but a finished format allows EOS alone:
    the EOS that completes it ends the sequence, as without ignore_eos (SGLang ends a request whose
    grammar has terminated), rather than EOS after EOS up to max_tokens."""
    for spec in (StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(json=SCHEMA),
                 StructuredOutputsParams(regex=REGEX)):
        plain, ignoring = (llm.generate(["Tell me something."], SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=ignore, structured_outputs=spec))[0].outputs[0]
            for ignore in (False, True))
        assert ignoring.finish_reason == plain.finish_reason == "stop"
        assert ignoring.token_ids == plain.token_ids and ignoring.text == plain.text
        assert ignoring.token_ids[-1] in llm.core.info.eos_token_ids and len(ignoring.token_ids) < 40
    eos = llm.core.info.eos_token_ids[0]  # unconstrained, an EOS made certain still does not end the stream
    forced = llm.generate(["Tell me something."], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                 logit_bias={eos: 100.0}))[0].outputs[0]
    assert forced.finish_reason == "length" and forced.token_ids == [eos] * 12


def test_a_bad_format_is_refused_before_it_runs(llm):
    for spec in (StructuredOutputsParams(regex="[ab"), StructuredOutputsParams(json={"type": "objectx"})):
        with pytest.raises(ValueError, match="structured output format"):
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert not llm.core.has_work()


def test_compiled_formats_are_cached_and_only_copies_run(llm):
    """A format is compiled once and each sequence gets its own copy: one sequence's tokens never move
    another's matcher. A bad format is not cached, and the cache drops its oldest format when full."""
    grammars = llm.core.grammars
    spec = StructuredOutputsParams(choice=["yes", "no"])
    compiled = grammars.compile(spec)
    assert grammars.compile(StructuredOutputsParams(choice=["yes", "no"])) is compiled
    first, second = grammars.matcher(spec), grammars.matcher(spec)
    for token in llm.tokenizer.encode("yes", add_special_tokens=False):
        first.consume(token)
    assert first.matcher.is_accepting() and not second.matcher.is_accepting() and not compiled.is_accepting()
    for _ in range(2):
        with pytest.raises(ValueError, match="structured output format"):
            grammars.compile(StructuredOutputsParams(regex="[ab"))
    grammars.CACHED_FORMATS = 2  # on this instance only
    try:
        grammars.compile(StructuredOutputsParams(regex="a+"))
        grammars.compile(StructuredOutputsParams(regex="b+"))
        assert grammars.compile(spec) is not compiled  # the oldest, evicted: compiled anew
    finally:
        del grammars.CACHED_FORMATS


def test_engines_on_one_tokenizer_share_its_llguidance_view(llm, qwen_tokenizer):
    """llguidance's view of a tokenizer (seconds to build) is built once per process for engines on the same
    tokenizer, another instance of it included; another vocabulary size is another view."""
    vocab_size = llm.core.info.vocab_size
    view = llm.core.grammars.load_vocabulary()
    assert GrammarCompiler(qwen_tokenizer, vocab_size).load_vocabulary() is view
    key = VocabularyKey.of(qwen_tokenizer, vocab_size)
    assert key == VocabularyKey.of(llm.tokenizer, vocab_size) and key != VocabularyKey.of(qwen_tokenizer, vocab_size + 1)


def test_masks_are_llguidances_own(llm):
    """mask_rows (numpy bit unpacking) blocks exactly the tokens llguidance's reference kernel blocks, on
    the masked rows only; a row waiting for thinking also allows `<think>`."""
    import llguidance.numpy
    import numpy as np
    import torch

    from mili_openai.engine.structured_output import mask_rows

    grammars, vocab = llm.core.grammars, llm.core.info.vocab_size
    outputs = [grammars.matcher(StructuredOutputsParams(regex=REGEX)),
               grammars.matcher(StructuredOutputsParams(json=SCHEMA, reasoning="optional"))]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    expected = logits.numpy().copy()
    reference = llguidance.numpy.allocate_token_bitmask(2, vocab)
    for index, output in enumerate(outputs):
        output.fill_mask(reference, index)
    masked = expected[[0, 2]]  # fancy indexing copies: masked, then written back
    llguidance.numpy.apply_token_bitmask_inplace(masked, reference)
    expected[[0, 2]] = masked
    mask_rows(logits, [0, 2], outputs)
    assert np.array_equal(logits.numpy(), expected)
    think = llm.tokenizer.convert_tokens_to_ids("<think>")
    assert torch.isfinite(logits[2, think]) and torch.isinf(logits[0, think]) and torch.isfinite(logits[1]).all()


class KnownOutputProposer:
    """Drafts each sequence's known constrained output, with its first draft wrong every third call and its second
    wrong every third call: drafts kept whole, in part, and cut where the grammar disallows a wrong one."""

    drafts_in_runner = False
    draft_lookahead = 0

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], k: int) -> None:
        self.outputs, self.k, self.calls = outputs, k, 0

    def propose(self, seq, max_drafts: int) -> list[int]:
        done = len(seq.output_token_ids)
        drafts = list(self.outputs[tuple(seq.prompt_token_ids)][done : done + min(self.k, max_drafts)])
        self.calls += 1
        wrong = {1: 0, 2: 1}.get(self.calls % 3)
        if wrong is not None and wrong < len(drafts):
            drafts[wrong] += 1
        return drafts


def test_formats_draft_and_keep_plain_decodings_tokens(tiny_checkpoint, llm):
    """With drafts, a constrained sequence's grammar masks each verify row after the drafts before it and takes
    only the tokens kept: its output is plain decoding's, valid, beside unconstrained sequences that draft."""
    formats = {"Pick a color.": StructuredOutputsParams(json=SCHEMA), "Code?": StructuredOutputsParams(regex=REGEX),
               "Choose.": StructuredOutputsParams(choice=CHOICES), "Pairs.": StructuredOutputsParams(grammar=GRAMMAR)}
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec) for spec in formats.values()]
    looping = [1000, 2000, 3000] * 6
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = llm.generate([*formats, looping], [*params, free])
    drafting = LLM(str(tiny_checkpoint), dtype="float32", num_pages=256, page_size=8,
                   speculative_config={"num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1,
                                       "min_acceptance_rate": 0, "disable_by_batch_size": None})
    known = {tuple(output.prompt_token_ids): list(output.outputs[0].token_ids) for output in plain}
    drafting.core.scheduler.proposer = KnownOutputProposer(known, k=3)
    outputs = drafting.generate([*formats, looping], [*params, free])
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    texts = [o.outputs[0].text for o in outputs]
    assert conforms(texts[0]) and re.fullmatch(REGEX, texts[1]) and texts[2] in CHOICES
    assert re.fullmatch(GRAMMAR_REGEX, texts[3])
    stats = drafting.core.stats()
    kept, verified = stats.spec_decode_num_accepted_tokens_per_pos, stats.spec_decode_num_draft_tokens_per_pos
    assert all(0 < kept[position] < verified[position] for position in (0, 1))
    drafting.core.check_integrity()


def test_a_formats_matcher_looks_ahead_and_rolls_back(llm):
    """`valid_prefix` and `ahead` leave the matcher where it was, and see what consuming the drafts would."""
    tokenizer = llm.tokenizer
    output = llm.core.grammars.matcher(StructuredOutputsParams(regex=REGEX))
    good = tokenizer.encode("ab", add_special_tokens=False)
    bad = tokenizer.encode("z", add_special_tokens=False)
    assert output.valid_prefix(good + bad) == len(good)
    assert output.valid_prefix(bad + good) == 0
    with output.ahead(good):
        assert output.consumed == len(good)
        assert output.valid_prefix(tokenizer.encode("c-", add_special_tokens=False)) > 0
    assert output.consumed == output.matched == 0
    assert output.valid_prefix(good) == len(good)  # the matcher is back at the start


def test_a_reasoning_models_thinking_goes_before_the_format(llm, tiny_checkpoint):
    """With `reasoning`, the `<think>...</think>` block goes unmasked and the format starts after it; the
    chat route sets the mode from the rendered prompt. Logit biases stand in for a model that thinks."""
    tokenizer = llm.tokenizer
    think, end = (tokenizer.convert_tokens_to_ids(tag) for tag in ("<think>", "</think>"))
    thinks = {think: 40.0, end: 45.0}  # `</think>` is likelier, but the format allows only `<think>` first

    def text(reasoning: str, bias: dict[int, float]) -> str:
        spec = StructuredOutputsParams(json=SCHEMA, reasoning=reasoning)
        params = SamplingParams(temperature=0, max_tokens=60, logit_bias=bias, structured_outputs=spec,
                                skip_special_tokens=False)
        return llm.generate(["Pick."], params)[0].outputs[0].text

    assert text("optional", thinks).startswith("<think></think>") and conforms(text("optional", thinks)[15:])
    assert text("open", {end: 45.0}).startswith("</think>") and conforms(text("open", {end: 45.0})[8:])
    assert conforms(text("optional", {}))  # no thinking: the format from the first token
    assert conforms(text("off", thinks))  # the tags are no part of the format
    with pytest.raises(ValueError, match="reasoning"):
        StructuredOutputsParams(regex="a", reasoning="maybe")

    with served_engine(tiny_checkpoint, num_pages=64, page_size=8) as (live, _):
        client = openai.OpenAI(base_url=live.api_base, api_key="unused", max_retries=0)
        json_schema = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}
        bias = {str(token): value for token, value in thinks.items()}
        for kwargs, first in (({}, "<think>"), ({"chat_template_kwargs": {"enable_thinking": False}}, "{")):
            reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Pick."}],
                                                   response_format=json_schema, max_tokens=60, temperature=0,
                                                   logit_bias=bias, logprobs=True, extra_body=kwargs)
            assert conforms(reply.choices[0].message.content), reply.choices[0].message
            assert reply.choices[0].logprobs.content[0].token.startswith(first)  # thinks only where it may
