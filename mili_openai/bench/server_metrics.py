"""A server's Prometheus `/metrics`, read around a bench run: the fetch every scrape shares, and mili's prefix-cache
state snapshots of a hybrid model (`mili_state_snapshots`, `mili_state_snapshots_cached`,
`mili_state_snapshot_bytes`). Another server exposes none of these, and reports none."""

from __future__ import annotations

import re
from http import HTTPStatus

import aiohttp

METRICS_PATH = "/metrics"
SNAPSHOTS = "mili_state_snapshots"  # snapshots the budget holds
SNAPSHOTS_CACHED = "mili_state_snapshots_cached"  # of those, attached to the radix tree
SNAPSHOT_BYTES = "mili_state_snapshot_bytes"  # the budget's memory
GAUGE_LINE = re.compile(r"^(\w+)\s+([0-9.eE+-]+)$")  # a sample without labels


async def fetch_metrics_text(client: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> str | None:
    """The server's /metrics text now; None where it has none (or the request fails)."""
    try:
        async with client.get(base_url.rstrip("/") + METRICS_PATH, headers=headers) as response:
            if response.status != HTTPStatus.OK:
                return None
            return await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return None


def snapshot_memory(text: str) -> dict[str, int] | None:
    """{snapshots, cached, budget_bytes, used_bytes} from a Prometheus text exposition: used = the budget's
    share that the snapshots attached to the tree take (every snapshot is one state slot). None where the
    server keeps no snapshots (not mili, or not a hybrid model, or its prefix cache off)."""
    gauges = {}
    for line in text.splitlines():
        match = GAUGE_LINE.match(line.strip())
        if match and match.group(1) in (SNAPSHOTS, SNAPSHOTS_CACHED, SNAPSHOT_BYTES):
            gauges[match.group(1)] = int(float(match.group(2)))
    if not gauges.get(SNAPSHOTS):
        return None
    count, cached, budget = gauges[SNAPSHOTS], gauges.get(SNAPSHOTS_CACHED, 0), gauges.get(SNAPSHOT_BYTES, 0)
    return {"snapshots": count, "cached": cached, "budget_bytes": budget, "used_bytes": budget * cached // count}


async def scrape_snapshot_memory(client: aiohttp.ClientSession, base_url: str,
                                 headers: dict[str, str]) -> dict[str, int] | None:
    text = await fetch_metrics_text(client, base_url, headers)
    return snapshot_memory(text) if text is not None else None
