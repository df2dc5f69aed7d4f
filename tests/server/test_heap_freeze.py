"""`mili serve` leaves the objects alive after loading out of the garbage collector's reach (gc.freeze,
as vLLM does), so no full collection over the model and libraries stalls a stream; a server built in
another process (these tests, an app embedding it) freezes nothing unless asked."""

from __future__ import annotations

import gc

import httpx

from helpers_server import live_server
from mili_openai.cli import build_parser, config_from_args
from mili_openai.config import EngineConfig, ServerConfig
from mili_openai.server.app import create_app


def serve_and_count_frozen(checkpoint, freeze: bool) -> int:
    engine = EngineConfig(model=str(checkpoint), dtype="float32", num_pages=32, max_model_len=256)
    app = create_app(ServerConfig(engine=engine, served_model_name="tiny", freeze_gc_after_load=freeze))
    try:
        with live_server(app) as server:  # ready once the engine has loaded
            frozen = gc.get_freeze_count()
            body = {"model": "tiny", "prompt": "after the freeze", "max_tokens": 4}
            assert httpx.post(f"{server.api_base}/completions", json=body, timeout=60).status_code == 200
        return frozen
    finally:
        gc.unfreeze()  # hand this test process's objects back to the collector


def test_the_cli_freezes_and_an_embedded_server_does_not(tiny_checkpoint):
    assert config_from_args(build_parser().parse_args(["serve"])).freeze_gc_after_load
    assert not ServerConfig().freeze_gc_after_load
    assert gc.get_freeze_count() == 0
    assert serve_and_count_frozen(tiny_checkpoint, freeze=False) == 0
    # the model's modules and tensors, the tokenizer and every imported library: far more than a few
    assert serve_and_count_frozen(tiny_checkpoint, freeze=True) > 10_000
