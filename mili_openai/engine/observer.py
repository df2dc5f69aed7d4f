"""Hooks through which the server observes the engine (Prometheus, logs) without the engine knowing."""

from __future__ import annotations

from typing import Protocol

from mili_openai.engine.outputs import RequestMetrics


class EngineObserver(Protocol):
    def on_request_finished(self, metrics: RequestMetrics) -> None:
        """Called on the engine's thread once per sequence, whether it finished, stopped or was aborted."""
        ...
