"""The adaptive off-switch's policy (`DraftSwitch`), driven by made-up acceptance histories (no model, no clock): when
a request pauses its drafting, how long, when it probes again and what a probe decides; and the device default of
`disable_by_batch_size`."""

from __future__ import annotations

import pytest

from engine_helpers import make_seq, speculative_scheduler

from mili_openai.config import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    EngineConfig,
    SpeculativeConfig,
    speculative_config_from,
)
from mili_openai.engine.kv_pages import KVPageManager
from mili_openai.engine.proposers import DraftSwitch
from mili_openai.engine.scheduler import Scheduler

K = 3  # drafts per verify step
MAX_TOKENS = 4000


def switch(**fields) -> DraftSwitch:
    return DraftSwitch(SpeculativeConfig(K, method="mtp", **fields))


def run(draft_switch: DraftSwitch, seq, kept_per_step, steps: int) -> list[bool]:
    """Decode `steps` steps of seq: a step it is allowed to draft verifies K drafts and keeps `kept_per_step(i)`
    of them (i counts its verify steps); every step appends the tokens it makes. -> per step, whether it drafted."""
    drafted, verified = [], 0
    for _ in range(steps):
        allowed = draft_switch.allows(seq)
        drafted.append(allowed)
        kept = 0
        if allowed:
            kept = kept_per_step(verified)
            verified += 1
            draft_switch.record(seq, K, kept)
        seq.output_token_ids.extend([0] * (1 + kept))
    return drafted


def test_a_useless_head_pauses_after_min_drafts_then_probes_with_a_doubling_backoff():
    draft_switch = switch(min_drafts_for_switch=4, switch_backoff_tokens=16)
    seq = make_seq("r", [1, 2, 3], MAX_TOKENS)
    drafted = run(draft_switch, seq, lambda _: 0, 16 + 1 + 32 + 1 + 64 + 1 + 10)
    # two verify steps (6 drafts >= 4, none kept), then paused 16 tokens, a probe, 32, a probe, 64, a probe...
    probes = [index for index, on in enumerate(drafted) if on]
    assert probes == [0, 1, 18, 51, 116]
    assert not any(drafted[2:18]) and not any(drafted[19:51]) and not any(drafted[52:116])


def test_the_pause_stops_growing_at_its_cap():
    draft_switch = switch(min_drafts_for_switch=4, switch_backoff_tokens=2)
    seq = make_seq("r", [1], MAX_TOKENS)
    drafted = run(draft_switch, seq, lambda _: 0, 400)
    probes = [index for index, on in enumerate(drafted) if on]
    gaps = [after - before - 1 for before, after in zip(probes[1:], probes[2:])]
    cap = DraftSwitch.MAX_PAUSE_FACTOR * 2
    assert gaps[:5] == [2, 4, 8, 16, 32] and set(gaps[4:]) == {cap}


def test_a_head_that_keeps_its_share_never_pauses():
    draft_switch = switch(min_drafts_for_switch=4, min_acceptance_rate=0.2, switch_backoff_tokens=16)
    seq = make_seq("r", [1], MAX_TOKENS)
    # one draft of three kept every step: a third, above the 20% asked
    assert all(run(draft_switch, seq, lambda _: 1, 300))


def test_a_head_that_turns_useless_pauses_within_a_window():
    """The window halves its counts as it fills, so however long a good start was, a bad stretch pauses the request
    within the same few steps."""
    bad_steps_drafted = []
    for good_steps in (50, 500):
        draft_switch = switch(min_drafts_for_switch=4, switch_backoff_tokens=16)
        seq = make_seq("r", [1], MAX_TOKENS)
        drafted = run(draft_switch, seq, lambda step: K if step < good_steps else 0, good_steps + 60)
        assert all(drafted[:good_steps]) and not drafted[-1]
        bad_steps_drafted.append(drafted[good_steps:].index(False))
    # at most WINDOW_FILLS * 4 = 16 drafts in the window, all kept: 20% of the window is reached in 9 bad steps
    assert bad_steps_drafted[0] == bad_steps_drafted[1] <= 12


def test_a_probe_that_keeps_its_share_resumes_drafting_and_resets_the_backoff():
    draft_switch = switch(min_drafts_for_switch=4, switch_backoff_tokens=8)
    seq = make_seq("r", [1], MAX_TOKENS)
    # useless for its first 3 verify steps (a pause of 8 after 2 of them, one failed probe then a pause of 16),
    # then keeps every draft from its 4th verify step (the second probe) on
    drafted = run(draft_switch, seq, lambda step: 0 if step < 3 else K, 60)
    probes = [index for index, on in enumerate(drafted) if on]
    assert probes[:4] == [0, 1, 10, 27]
    assert all(drafted[27:])  # the probe kept its drafts: drafting goes on
    assert seq.draft_window.resume_at is None and seq.draft_window.pause == 0
    # a later bad stretch pauses it for the first length again, not the doubled one
    drafted = run(draft_switch, seq, lambda _: 0, 12)
    window = seq.draft_window
    assert not drafted[-1]
    assert window.resume_at is not None and window.resume_at - len(seq.output_token_ids) <= 8


def test_a_backoff_of_zero_keeps_a_switched_off_request_off():
    draft_switch = switch(min_drafts_for_switch=4, switch_backoff_tokens=0)
    seq = make_seq("r", [1], 500)
    drafted = run(draft_switch, seq, lambda _: 0, 400)
    assert drafted[:2] == [True, True] and not any(drafted[2:])


def test_a_rate_of_zero_never_switches():
    seq = make_seq("r", [1], MAX_TOKENS)
    assert all(run(switch(min_acceptance_rate=0), seq, lambda _: 0, 100))


def test_the_scheduler_runs_the_model_proposer_again_for_a_probe():
    """A paused request's steps run no MTP proposer; once its pause is over, the proposer drafts for it again
    (its next step verifies those drafts: the probe)."""
    speculative = SpeculativeConfig(K, method="mtp", min_drafts_for_switch=K, switch_backoff_tokens=2,
                                    disable_by_batch_size=None)
    scheduler = speculative_scheduler(speculative)
    seq = make_seq("a", [5, 6, 5], max_tokens=40)
    scheduler.add(seq)
    assert scheduler.schedule().proposes_for == [True]
    seq.append_token(6)
    seq.proposed_drafts = [1, 2, 3]
    verify = scheduler.schedule()
    assert verify.draft_tokens == [[1, 2, 3]]
    seq.settle_drafts(K, 0)
    scheduler.draft_switch.record(seq, K, 0)
    proposes = []
    for token in (7, 8, 9):
        seq.append_token(token)
        seq.proposed_drafts = []
        batch = scheduler.schedule()
        assert batch.draft_tokens == [[]]
        proposes.append(batch.run_proposer)
    assert proposes == [False, False, True]  # paused 2 tokens from its output of 2, then the probe's drafts made


@pytest.mark.parametrize(("device", "given", "expected"), [
    ("cpu", {}, DEFAULT_DISABLE_BY_BATCH_SIZE["cpu"]),
    ("cuda", {}, None),
    ("cpu", {"disable_by_batch_size": None}, None),
    ("cpu", {"disable_by_batch_size": 8}, 8),
    ("cuda", {"disable_by_batch_size": "auto"}, None),
])
def test_disable_by_batch_size_takes_the_device_default_unless_set(device, given, expected):
    speculative = speculative_config_from({"num_speculative_tokens": 2, **given})
    config = EngineConfig(speculative_config=speculative).for_device(device)
    assert config.speculative_config.disable_by_batch_size == expected


@pytest.mark.parametrize("fields", [{"disable_by_batch_size": 0}, {"disable_by_batch_size": "always"},
                                    {"switch_backoff_tokens": -1}, {"switch_backoff_tokens": True},
                                    {"min_drafts_for_switch": 0}])
def test_bad_switch_settings_are_refused_by_name(fields):
    with pytest.raises(ValueError, match=next(iter(fields))):
        speculative_config_from({"num_speculative_tokens": 2, **fields})


def test_a_scheduler_refuses_a_config_without_the_device_default():
    config = EngineConfig(page_size=4, num_pages=8, max_num_seqs=8, max_num_batched_tokens=64,
                          speculative_config=SpeculativeConfig(2))
    with pytest.raises(ValueError, match="for_device"):
        Scheduler(config, KVPageManager(num_pages=8, page_size=4, enable_prefix_caching=False))
