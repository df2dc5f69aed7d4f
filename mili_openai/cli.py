"""The `mili` command: `mili serve [MODEL] ...` runs the OpenAI-compatible server under uvicorn.

Flags map one-to-one onto `ServerConfig` / `EngineConfig`; a value they reject becomes a clean
argparse error. SIGINT/SIGTERM: /health turns 503 and new generation requests get 503 at once,
in-flight requests get `--shutdown-grace-period` seconds to finish, then they are aborted (streams
end with finish_reason "abort", an error event and [DONE], never cut silently), then uvicorn closes
the listener, the engine stops and the process exits 0 (server/drain.py). A second signal exits at once.
Each finished request writes one JSON line on the `mili_openai.requests` logger (server/request_log.py).
A model that fails to load exits 1 with the reason on stderr, so a supervisor restarts it and shows why.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mili_openai.bench.cli import add_bench_parser
from mili_openai.config import (
    ATTENTION_BACKENDS,
    DEVICES,
    DTYPES,
    LM_HEAD_QUANTIZATIONS,
    POOLING_TASKS,
    POOLING_TYPES,
    QUANTIZATION_GROUP_SIZES,
    QUANTIZATION_METHODS,
    RUNNERS,
    TOOL_CALL_PARSERS,
    EngineConfig,
    MediaConfig,
    LoraConfig,
    ServerConfig,
    SpeculativeConfig,
    speculative_config_from,
)
from mili_openai.server.request_log import REQUEST_LOGGER_NAME

if TYPE_CHECKING:
    import uvicorn

    from mili_openai.server.drain import DrainingServer

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# uvicorn's own last-resort deadline, after our grace period has aborted what was left
UVICORN_SHUTDOWN_MARGIN_S = 5.0
# vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter, honoured beside --enable-runtime-lora-updating
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
ENV_TRUE = ("1", "true")  # the values vLLM reads as on


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    defaults, engine = ServerConfig(), EngineConfig()
    serve = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                                  formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("model", nargs="?", default=None,
                       help="local checkpoint directory or hub id (default: a small embedded random-weight Qwen3)")
    net = serve.add_argument_group("server")
    net.add_argument("--host", default=defaults.host)
    net.add_argument("--port", type=int, default=defaults.port)
    net.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (except /health, "
                                                     "/metrics, /version)")
    net.add_argument("--served-model-name", default=None, help="the model id clients use (default: the path's "
                                                               "last component)")
    net.add_argument("--max-queue", type=int, default=defaults.max_queue,
                     help="waiting requests beyond this are refused with 429")
    net.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s,
                     help="seconds before a request is aborted")
    net.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    net.add_argument("--cors-allow-origin", action="append", default=[], dest="cors_allow_origins",
                     help="allowed CORS origin (repeatable; none = CORS off)")
    net.add_argument("--shutdown-grace-period", type=float, default=defaults.shutdown_grace_s,
                     help="seconds in-flight requests get to finish on SIGTERM")
    net.add_argument("--timeout-keep-alive", type=int, default=defaults.timeout_keep_alive_s, metavar="SECONDS",
                     help="close a keep-alive connection idle this long; keep it above clients' pool expiry (httpx: "
                          "5 s) and below the idle timeout of any load balancer in front (docs/deployment.md)")
    net.add_argument("--responses-store-size", type=int, default=defaults.responses_store_size,
                     help="POST /v1/responses answers kept in memory for previous_response_id and GET "
                          "/v1/responses/{id} (the latest N, per replica; 0 keeps none)")
    net.add_argument("--log-level", choices=LOG_LEVELS, default=defaults.log_level)
    net.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                     help="the format tool calls are parsed in: hermes (Qwen3's JSON) or qwen3_coder (the XML of "
                          "Qwen3.5, Qwen3.6 and Qwen3-Coder); default: the one the model's chat template teaches")
    media = MediaConfig()
    net.add_argument("--allowed-media-domains", nargs="*", default=[], metavar="DOMAIN",
                     help="hosts whose http(s) image URLs may be fetched (none by default: data URLs only)")
    net.add_argument("--max-images-per-request", type=int, default=media.max_images_per_request)
    net.add_argument("--max-image-pixels", type=int, default=media.max_image_pixels,
                     help="largest decoded width x height of an image")
    net.add_argument("--media-fetch-timeout", type=float, default=media.fetch_timeout_s, metavar="SECONDS",
                     help="time allowed to fetch one image URL")
    net.add_argument("--debug-endpoints", action="store_true",
                     help="serve GET /debug/engine (KV page accounting) for soak tests; not for production")
    eng = serve.add_argument_group("engine")
    eng.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    eng.add_argument("--dtype", choices=DTYPES, default=engine.dtype)
    eng.add_argument("--device", choices=DEVICES, default=engine.device)
    eng.add_argument("--page-size", type=int, default=engine.page_size, help="tokens per KV page")
    eng.add_argument("--num-pages", type=int, default=None, help="KV pages (overrides --kv-cache-memory-gb)")
    eng.add_argument("--kv-cache-memory-gb", type=float, default=None,
                     help="KV pool size (default: 2 on CPU; on CUDA what --gpu-memory-utilization leaves)")
    eng.add_argument("--gpu-memory-utilization", type=float, default=engine.gpu_memory_utilization,
                     help="CUDA: the share of GPU memory for the weights, the peak activation (profiled at start) "
                          "and the KV pool, which takes the rest (unless --kv-cache-memory-gb or --num-pages)")
    eng.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help="token budget of one forward (default: 512 on CPU, 8192 on CUDA)")
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                     default=engine.enable_prefix_caching, help="reuse cached prompt prefixes (the radix cache)")
    eng.add_argument("--hybrid-snapshot-fraction", type=float, default=engine.hybrid_snapshot_fraction,
                     help="hybrid models (Qwen3.5, Qwen3-Next): the share of the cache budget kept for the prefix "
                          "cache's state snapshots (default: two per --max-num-seqs, at least 0.2 of the budget "
                          "and at most half of what the running sequences' states leave)")
    eng.add_argument("--num-hybrid-snapshots", type=int, default=None,
                     help="hybrid models: this many state snapshots (overrides --hybrid-snapshot-fraction)")
    eng.add_argument("--state-snapshot-interval", type=int, default=None,
                     help="hybrid models: a prefill also saves its state every this many pages")
    eng.add_argument("--max-num-seqs", type=int, default=None,
                     help="cap on running sequences (default: 64 on CPU, 256 on CUDA)")
    eng.add_argument("--max-encoder-patches-per-step", type=int, default=engine.max_encoder_patches_per_step,
                     help="vision models: image patches one step may encode, so images do not stall decodes "
                          "(one image always fits)")
    eng.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    eng.add_argument("--generation-config", default=engine.generation_config,
                     help="defaults for the sampling fields a request leaves out (temperature, top_p, top_k, "
                          "min_p, repetition_penalty): 'auto' = the model's generation_config.json, 'none' = "
                          "OpenAI's, or a directory holding a generation_config.json")
    eng.add_argument("--speculative-config", default=None, metavar="JSON",
                     help='speculative decoding, as vLLM\'s flag: \'{"method": "mtp", "num_speculative_tokens": 2}\' '
                          '(Qwen3.5 / Qwen3.6 / Qwen3-Next) or \'{"method": "ngram", "num_speculative_tokens": 4, '
                          '"prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 4}\' (the last '
                          'three optional; disable_by_batch_size defaults to 4 on a CPU; also min_acceptance_rate, '
                          'min_drafts_for_switch, switch_backoff_tokens: docs/speculative.md)')
    eng.add_argument("--quantization", "-q", choices=QUANTIZATION_METHODS, default=None,
                     help="quantize a bf16 checkpoint's weights as it loads: int8 (a scale per row), int4 (groups, "
                          "zero points), fp8 (CUDA: e4m3 weights, and activations in prefill); the LM head goes int8 under int8 "
                          "and int4. Pre-quantized checkpoints (fp8, awq, gptq in config.json) need no flag")
    eng.add_argument("--quantization-group-size", type=int, choices=QUANTIZATION_GROUP_SIZES,
                     default=engine.quantization_group_size, help="int4: values along a row per scale")
    eng.add_argument("--quantize-lm-head", choices=LM_HEAD_QUANTIZATIONS, default=None,
                     help="with --quantization int8|int4: the LM head's (and a tied embedding's) weights, int8 (a "
                          "scale per row, the default) or int4 (groups of --quantization-group-size, zero points: "
                          "fewer bytes per token, logits a little further from the bf16 model's)")
    eng.add_argument("--enforce-eager", action="store_true",
                     help="CUDA: run decode steps op by op rather than replay them from CUDA graphs")
    eng.add_argument("--kernel-plan-cache", action=argparse.BooleanOptionalAction, default=engine.kernel_plan_cache,
                     help="CPU: reuse the kernel plan (which kernel runs which shape) an earlier start timed on this "
                          "machine, kept beside the kernels' build; --no-kernel-plan-cache times it at every start")
    eng.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=engine.attention_backend,
                     help="auto: Triton kernels reading the KV pages in place on CUDA, the compiled kernels on CPU; "
                          "torch: torch's SDPA over gathered K/V on CUDA")
    eng.add_argument("--tensor-parallel-size", "-tp", type=int, default=engine.tensor_parallel_size,
                     help="shard the model over this many worker processes (one GPU each on CUDA; gloo between "
                          "processes on CPU)")
    eng.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                     help="run the engine (scheduling, step inputs, postprocessing) in a process of its own, apart "
                          "from the HTTP side's event loop and GIL (default: yes on CUDA, no on CPU)")
    eng.add_argument("--async-launch", action=argparse.BooleanOptionalAction, default=None,
                     help="launch each step on the engine loop, a step ahead, with a worker thread only waiting "
                          "for results, so the GPU never waits for the host's postprocessing (default: yes on "
                          "CUDA, no on CPU)")
    eng.add_argument("--switch-interval", type=float, default=None, metavar="SECONDS",
                     help="CPython's GIL switch interval in the engine's process (default: Python's, 0.005)")
    eng.add_argument("--torch-profiler-dir", default=None, metavar="DIR",
                     help="enable POST /start_profile and POST /stop_profile: a torch profile of the engine's steps "
                          "(CPU ops, and GPU kernels on CUDA) written into DIR as a Chrome trace and a text summary "
                          "(as vLLM's torch profiler directory; off: the routes answer 404). Slows serving while it runs")
    pool = serve.add_argument_group("pooling (embeddings, reranking)")
    pool.add_argument("--runner", choices=RUNNERS, default=engine.runner,
                      help="generate text, or pool: embeddings (/v1/embeddings) and scores (/v1/rerank, /score); auto "
                           "pools where the checkpoint has a sentence-transformers Pooling module (Qwen3-Embedding)")
    pool.add_argument("--pooling-task", choices=POOLING_TASKS, default=engine.pooling_task,
                      help="a pooling model's task: embed, or rerank for a Qwen3-Reranker (P('yes') over 'no' at the "
                           "last token of its prompt); auto = embed, or classify for a Qwen3ForSequenceClassification "
                           "checkpoint (its score head: /classify, and with one label /score and /v1/rerank)")
    pool.add_argument("--pooling-type", choices=POOLING_TYPES, default=None,
                      help="which hidden states make an embedding (default: the checkpoint's modules.json, else last)")
    pool.add_argument("--rerank-template", default=None, metavar="FILE",
                      help="a file holding the reranker's prompt for one pair, with {query}, {document} and optionally "
                           "{instruction} (default: Qwen3-Reranker's model card format)")
    lora, lora_defaults = serve.add_argument_group("LoRA adapters (vLLM's flags)"), LoraConfig()
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters beside the base model")
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                      help="PEFT adapter directories, each as name=path or a JSON object {\"name\": ..., \"path\": ...};"
                           " a request runs one by naming it as its `model`")
    lora.add_argument("--max-loras", type=int, default=lora_defaults.max_loras, help="adapters in one step")
    lora.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept loaded in host memory "
                                                                        "(default: --max-loras)")
    lora.add_argument("--max-lora-rank", type=int, default=lora_defaults.max_lora_rank,
                      help="the largest adapter rank served (sizes the adapter slots)")
    lora.add_argument("--enable-runtime-lora-updating", action="store_true",
                      help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also on with --enable-lora "
                           f"and {RUNTIME_LORA_ENV}=true, as vLLM)")
    eng.add_argument("--default-model-cache", default=None,
                     help="where the embedded default model is built (default: ~/.cache/mili-openai)")
    serve.set_defaults(func=run_serve, parser=serve)
    return serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mili", description="mili-openai: an OpenAI-compatible server for Qwen3")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(subparsers)
    add_bench_parser(subparsers)
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The one config, built from `serve` flags; raises ValueError for values the config rejects."""
    if args.num_threads is not None and args.num_threads < 1:
        raise ValueError("num_threads must be >= 1")
    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        page_size=args.page_size,
        num_pages=args.num_pages,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_encoder_patches_per_step=args.max_encoder_patches_per_step,
        enable_prefix_caching=args.enable_prefix_caching,
        hybrid_snapshot_fraction=args.hybrid_snapshot_fraction,
        num_hybrid_snapshots=args.num_hybrid_snapshots,
        hybrid_snapshot_interval=args.state_snapshot_interval,
        max_model_len=args.max_model_len,
        num_threads=args.num_threads,
        default_model_cache=args.default_model_cache,
        generation_config=args.generation_config,
        speculative_config=parse_speculative_config(args.speculative_config),
        enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend,
        kernel_plan_cache=args.kernel_plan_cache,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        quantize_lm_head=args.quantize_lm_head,
        engine_process=args.engine_process,
        async_launch=args.async_launch,
        switch_interval_s=args.switch_interval,
        torch_profiler_dir=args.torch_profiler_dir,
        runner=args.runner,
        pooling_task=args.pooling_task,
        pooling_type=args.pooling_type,
        lora=lora_config_from_args(args),
        cpu_kernels_in_background=True,  # a first start answers while the kernels compile
    )
    return ServerConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_queue=args.max_queue,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        cors_allow_origins=tuple(args.cors_allow_origins),
        shutdown_grace_s=args.shutdown_grace_period,
        timeout_keep_alive_s=args.timeout_keep_alive,
        responses_store_size=args.responses_store_size,
        log_level=args.log_level,
        debug_endpoints=args.debug_endpoints,
        tool_call_parser=args.tool_call_parser,
        media=MediaConfig(allowed_domains=tuple(args.allowed_media_domains),
                          max_images_per_request=args.max_images_per_request,
                          max_image_pixels=args.max_image_pixels, fetch_timeout_s=args.media_fetch_timeout),
        rerank_template=Path(args.rerank_template).read_text() if args.rerank_template is not None else None,
        freeze_gc_after_load=True,  # this process only serves
        runtime_lora_updating=args.enable_runtime_lora_updating or (
            args.enable_lora and os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ENV_TRUE),
    )


def lora_config_from_args(args: argparse.Namespace) -> LoraConfig | None:
    """--enable-lora's config; ValueError for adapters named without it, or malformed."""
    if not args.enable_lora:
        if args.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    return LoraConfig(modules=tuple(parse_lora_module(text) for text in args.lora_modules),
                      max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras, max_lora_rank=args.max_lora_rank)


def parse_lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules item, `name=path` or vLLM's JSON form, -> (name, path)."""
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules {text!r} is not valid JSON: {exc}") from None
        if not isinstance(fields, dict) or not isinstance(fields.get("name"), str) or not isinstance(fields.get("path"), str):
            raise ValueError(f"--lora-modules {text!r}: a JSON item needs string 'name' and 'path'")
        return fields["name"], fields["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path")
    return name, path


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    if text is None:
        return None
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
    return speculative_config_from(fields)


def make_server(config: ServerConfig) -> DrainingServer:
    """A uvicorn server for `config` that drains the app on SIGTERM/SIGINT, then exits 0 (or exits 1 at once
    when the model fails to load)."""
    # imported here, not above: the server pulls in torch and the model, which `mili bench` never needs
    from mili_openai.server.app import create_app
    from mili_openai.server.drain import DrainingServer

    app = create_app(config)
    return DrainingServer(uvicorn_config(config, app), app.state.server, config.shutdown_grace_s)


def uvicorn_config(config: ServerConfig, app: Any) -> uvicorn.Config:
    """uvicorn's settings for serving `app` under `config`."""
    import uvicorn

    return uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level,
        access_log=False,  # the request log (one JSON line per request) replaces it
        timeout_keep_alive=config.timeout_keep_alive_s,
        timeout_graceful_shutdown=math.ceil(config.shutdown_grace_s + UVICORN_SHUTDOWN_MARGIN_S),
    )


def configure_logging(level: str) -> None:
    """Human-readable lines for everything, except the request log: bare JSON lines, one per request."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    request_logger = logging.getLogger(REQUEST_LOGGER_NAME)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    request_logger.addHandler(handler)
    request_logger.propagate = False


def run_serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    configure_logging(config.log_level)
    server = make_server(config)
    name = server.config.app.state.server.served_model_name
    source = config.engine.model or "the embedded default model: random weights, Qwen3's tokenizer"
    print(f"mili-openai: serving model '{name}' ({source}) on http://{config.host}:{config.port}", flush=True)
    server.run()
    if server.model_failed:  # one line a supervisor's log shows, after the traceback the loader logged
        print(f"mili-openai: exiting, the model failed to load: {server.state.load_error}", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            config_from_args(args)  # validate before anything heavy starts
        except ValueError as exc:
            args.parser.error(str(exc))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
