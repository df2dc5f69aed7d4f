"""Speculative decoding's acceptance over a bench run, read from the server's `/metrics` before and after it: the
drafts verified and kept at each draft position (mili's `mili_spec_decode_*_per_pos_total{position}`; vLLM's
`vllm:spec_decode_num_accepted_tokens_per_pos` names differ, so another server reports none)."""

from __future__ import annotations

import re
from typing import Any

import aiohttp

from mili_openai.bench.server_metrics import fetch_metrics_text

DRAFTS_PER_POSITION = "mili_spec_decode_num_draft_tokens_per_pos_total"
ACCEPTED_PER_POSITION = "mili_spec_decode_num_accepted_tokens_per_pos_total"
SAMPLE_LINE = re.compile(r'^(\w+)\{position="(\d+)"\}\s+([0-9.eE+-]+)$')


def per_position_counts(text: str) -> dict[str, dict[int, float]]:
    """{metric name: {position: value}} of the per-position counters in a Prometheus text exposition."""
    counts: dict[str, dict[int, float]] = {DRAFTS_PER_POSITION: {}, ACCEPTED_PER_POSITION: {}}
    for line in text.splitlines():
        match = SAMPLE_LINE.match(line.strip())
        if match and match.group(1) in counts:
            counts[match.group(1)][int(match.group(2))] = float(match.group(3))
    return counts


def acceptance_by_position(before: dict[str, dict[int, float]] | None,
                           after: dict[str, dict[int, float]] | None) -> list[dict[str, Any]] | None:
    """Per draft position over the run: drafts verified, kept, and the rate; None without such counters."""
    if before is None or after is None or not after[DRAFTS_PER_POSITION]:
        return None
    rows = []
    for position in sorted(after[DRAFTS_PER_POSITION]):
        drafts = after[DRAFTS_PER_POSITION][position] - before[DRAFTS_PER_POSITION].get(position, 0.0)
        kept = after[ACCEPTED_PER_POSITION].get(position, 0.0) - before[ACCEPTED_PER_POSITION].get(position, 0.0)
        rows.append({"position": position, "drafts": int(drafts), "accepted": int(kept),
                     "rate": kept / drafts if drafts else None})
    return rows


async def scrape_per_position(client: aiohttp.ClientSession, base_url: str,
                              headers: dict[str, str]) -> dict[str, dict[int, float]] | None:
    """The server's per-position counters now; None where it has no /metrics (or it fails)."""
    text = await fetch_metrics_text(client, base_url, headers)
    return per_position_counts(text) if text is not None else None
