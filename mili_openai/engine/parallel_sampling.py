"""A request of `n` samples: a parent with one child sequence per sample (vLLM's parallel sampling).

This is the one place that derives each sample's sequence id and parameters, and that counts which samples
have finished (`SampleProgress`: the engine's `ParentRequest`, and across a process boundary the server's
`RequestStream`). The engine core adds the children together (all or nothing), tags every delta with the
parent's id and the sample's index, marks the request's last delta (`SequenceDelta.request_finished`), and
aborts them together. So the server, the offline `LLM` and any client of the engine see one request
and one stream of per-sample deltas, and can never disagree on the seeds.

Seeds: sample i of a seeded request samples with `seed + i`, so the samples differ yet each one
reproduces. A seed near the top of int64 counts down instead (`seed - i`), so every child's seed stays
a valid int64 and distinct from its siblings'.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mili_openai.engine.sampling_params import INT64_MAX, SamplingParams


def child_request_id(request_id: str, index: int) -> str:
    """The engine sequence of sample `index` (unique across requests: ids split at their last "-")."""
    return f"{request_id}-{index}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of sample `index`: one sequence, its own seed when seeded."""
    seed = params.seed
    if seed is not None:
        seed = seed + index if seed + index <= INT64_MAX else seed - index
    return dataclasses.replace(params, n=1, seed=seed)


class SampleProgress:
    """Which of one request's samples have not delivered their final delta yet."""

    __slots__ = ("_unfinished",)

    def __init__(self, num_samples: int) -> None:
        self._unfinished = set(range(num_samples))

    def finish(self, index: int) -> bool:
        """Sample `index` delivered its final delta; returns whether every sample now has."""
        self._unfinished.discard(index)
        return not self._unfinished

    @property
    def finished(self) -> bool:
        return not self._unfinished

    @property
    def unfinished(self) -> list[int]:
        return sorted(self._unfinished)


@dataclass(slots=True, eq=False)
class ParentRequest:
    """One request's children, and which have not delivered their final delta yet."""

    request_id: str
    child_ids: list[str]
    progress: SampleProgress = field(init=False)

    def __post_init__(self) -> None:
        self.progress = SampleProgress(len(self.child_ids))

    @classmethod
    def of(cls, request_id: str, params: SamplingParams) -> ParentRequest:
        return cls(request_id, [child_request_id(request_id, index) for index in range(params.n)])

    @property
    def num_samples(self) -> int:
        return len(self.child_ids)
