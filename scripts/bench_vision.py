"""Images through the HTTP API: mili beside llama.cpp's server (`--mmproj`) on the same random checkpoint.

Builds (once) a random Qwen3.5-0.8B-shaped vision-language checkpoint (`Qwen3_5ForConditionalGeneration`, bf16, its
text model as QWEN3_5_0_8B_CONFIG, its tower as QWEN3_5_0_8B_VISION_CONFIG, Qwen3.5's tokenizer and chat
template), converts it for llama.cpp with its own converter (the language model, then the vision tower with
`--mmproj`), starts both servers, waits for /health, and runs the two workloads through /v1/chat/completions,
the servers taking turns (never both at work at once: the machine has 2 cores; turn by turn, because this
machine's speed drifts from minute to minute, and a ratio of runs minutes apart measures the drift too):

- TTFT: one request at a time, each one 448 x 448 image (a different one each time, so no cache helps) and a
  short question, `max_tokens` 1 (the latency of the prefill and the first token); each image goes to one server,
  then the other. p50 and p90 over the requests, and the paired ratios' median and range.
- Throughput: 8 requests at once, each with a different 448 x 448 image, 64 output tokens each (`ignore_eos`,
  which both servers take); output tokens per second over the wall time of the batch, from the servers' usage.
  `--rounds` batches each, in turns; the median round, and each round's ratio.

Both run greedy. A table goes to stdout, the raw figures to OUT_DIR/vision-results.json. Ratios are mili ÷ peer
for throughput and peer ÷ mili for TTFT (above 1: mili ahead).

    .venv/bin/python scripts/bench_vision.py --llama-cpp DIR          # DIR: llama.cpp's source tree, built
    .venv/bin/python scripts/bench_vision.py --servers mili           # mili alone
    .venv/bin/python scripts/bench_vision.py --llama-cpp DIR --tiny   # a tiny checkpoint: checks the command only

llama.cpp's server is DIR/build/bin/llama-server (built as scripts/compare_serving.py's docstring says); its
converter DIR/convert_hf_to_gguf.py runs with DIR/gguf-py on the path.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import importlib.util
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("mili_openai") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

from mili_openai.bench.server_process import (  # noqa: E402
    LOCALHOST,
    ServerProcess,
    ServerSpec,
    build_cpu_kernels_first,
    free_port,
)
from mili_openai.model.default_model import TINY_QWEN35_CONFIG  # noqa: E402
from mili_openai.model.hybrid_checkpoint import (  # noqa: E402
    QWEN3_5_0_8B_CONFIG,
    QWEN3_5_0_8B_VISION_CONFIG,
    QWEN35_TOKENIZER,
    build_random_hybrid_checkpoint,
)

SERVERS = ("mili", "llama.cpp")  # the first is "ours"
LLAMA_ARGS = ("-t", "2", "-np", "8", "-c", "16384")  # as compare_serving.py runs it: 2 threads, 8 slots
IMAGE_SIDE = 448  # pixels: 28 x 28 patches of 16, 196 image tokens
QUESTION = "What is in this image? Answer in one sentence."
TTFT_REQUESTS = 8
CONCURRENT_REQUESTS = 8
THROUGHPUT_OUTPUT_TOKENS = 64
THROUGHPUT_ROUNDS = 2
WARMUP_REQUESTS = 1  # first requests build caches and kernels: not timed
STARTUP_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 900.0
BLOCK_PIXELS = 16  # the drawn images' blocks: one patch each, so every patch differs
SEED = 0
TINY_VISION_FIELDS: dict = {}  # hybrid_checkpoint's TINY_VISION_CONFIG as it is


def drawn_png(seed: int, side: int = IMAGE_SIDE) -> bytes:
    """A side x side RGB PNG of random coloured blocks over a gradient, different for each seed."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(side // BLOCK_PIXELS, side // BLOCK_PIXELS, 3), dtype=np.int64)
    pixels = np.kron(blocks, np.ones((BLOCK_PIXELS, BLOCK_PIXELS, 1), dtype=np.int64))
    pixels = (pixels + np.arange(side)[None, :, None] // 4) % 256
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8), "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def image_messages(png: bytes) -> list[dict]:
    """One user turn: the image as a data URL, then the question."""
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": content}]


def chat_body(model: str, png: bytes, max_tokens: int) -> dict:
    return {"model": model, "messages": image_messages(png), "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}


def ensure_checkpoint(path: Path, tiny: bool) -> Path:
    if (path / "config.json").is_file():
        return path
    fields = TINY_QWEN35_CONFIG if tiny else QWEN3_5_0_8B_CONFIG
    vision = TINY_VISION_FIELDS if tiny else QWEN3_5_0_8B_VISION_CONFIG
    return build_random_hybrid_checkpoint(path, "qwen3_5_vl", fields, seed=SEED, dtype=torch.bfloat16,
                                          tokenizer=QWEN35_TOKENIZER, vision_fields=vision)


def ensure_gguf(checkpoint: Path, llama_cpp: Path, out_dir: Path) -> tuple[Path, Path]:
    """(language model, vision projector) GGUF files, converted by llama.cpp's own converter (bf16), once."""
    text, mmproj = out_dir / f"{checkpoint.name}-bf16.gguf", out_dir / f"mmproj-{checkpoint.name}-bf16.gguf"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(llama_cpp / "gguf-py"),
                                                                         os.environ.get("PYTHONPATH")]))}
    for target, extra in ((text, []), (mmproj, ["--mmproj"])):
        if not target.is_file():
            subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(checkpoint), *extra,
                            "--outtype", "bf16", "--outfile", str(target)], check=True, env=env)
    return text, mmproj


def server_spec(name: str, checkpoint: Path, port: int, gguf: tuple[Path, Path] | None, llama_cpp: Path | None,
                extra_args: list[str]) -> ServerSpec:
    base_url = f"http://{LOCALHOST}:{port}"
    if name == "llama.cpp":
        text, mmproj = gguf
        argv = [str(llama_cpp / "build" / "bin" / "llama-server"), "-m", str(text), "--mmproj", str(mmproj),
                "--host", LOCALHOST, "--port", str(port), *LLAMA_ARGS]
        return ServerSpec(name=name, argv=tuple(argv + extra_args), base_url=base_url)
    argv = [sys.executable, "-m", "mili_openai", "serve", str(checkpoint), "--host", LOCALHOST, "--port", str(port),
            "--dtype", "bfloat16", "--device", "cpu", "--log-level", "warning"]
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return ServerSpec(name=name, argv=tuple(argv + extra_args), base_url=base_url,
                      env={"HF_HUB_OFFLINE": "1", "PYTHONPATH": python_path})


async def post_chat(session: aiohttp.ClientSession, base_url: str, body: dict) -> tuple[float, int]:
    """(seconds until the whole response, completion tokens) of one non-streamed chat request."""
    started = time.perf_counter()
    async with session.post(f"{base_url}/v1/chat/completions", json=body) as response:
        payload = await response.json(content_type=None)
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {json.dumps(payload)[:300]}")
    return time.perf_counter() - started, int(payload["usage"]["completion_tokens"])


async def served_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as response:
        return (await response.json(content_type=None))["data"][0]["id"]


async def run_workloads(base_urls: dict[str, str], ttft_requests: int, concurrency: int, output_tokens: int,
                        rounds: int) -> dict[str, dict]:
    """Both workloads on every server in `base_urls`, the servers taking turns request by request (TTFT) and batch
    by batch (throughput), each image new to each server. -> per server, its figures."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        models = {name: await served_model(session, url) for name, url in base_urls.items()}
        seed = 1000  # each request its own image: no encoder or prefix cache hit anywhere
        for _ in range(WARMUP_REQUESTS):
            seed += 1
            for name, url in base_urls.items():
                await post_chat(session, url, chat_body(models[name], drawn_png(seed), 1))
        ttfts: dict[str, list[float]] = {name: [] for name in base_urls}
        for _ in range(ttft_requests):
            seed += 1
            png = drawn_png(seed)
            for name, url in base_urls.items():
                ttfts[name].append((await post_chat(session, url, chat_body(models[name], png, 1)))[0])
        walls: dict[str, list[float]] = {name: [] for name in base_urls}
        tokens: dict[str, list[int]] = {name: [] for name in base_urls}
        for _ in range(rounds):
            pngs = [drawn_png(seed + 1 + i) for i in range(concurrency)]
            seed += concurrency
            for name, url in base_urls.items():
                started = time.perf_counter()
                results = await asyncio.gather(*(post_chat(session, url, chat_body(models[name], png, output_tokens))
                                                 for png in pngs))
                walls[name].append(time.perf_counter() - started)
                tokens[name].append(sum(count for _, count in results))
    figures = {}
    for name in base_urls:
        rates = [count / wall for count, wall in zip(tokens[name], walls[name])]
        figures[name] = {"ttft_p50_s": statistics.median(ttfts[name]),
                         "ttft_p90_s": float(np.percentile(ttfts[name], 90)), "ttft_all_s": ttfts[name],
                         "concurrent_walls_s": walls[name], "concurrent_output_tokens": tokens[name],
                         "output_tok_per_s_rounds": rates, "output_tok_per_s": statistics.median(rates),
                         "requests_per_s": concurrency / statistics.median(walls[name])}
    return figures


def render(results: dict[str, dict]) -> str:
    lines = ["| server | TTFT p50 (1 image 448², ms) | TTFT p90 (ms) | 8 concurrent: output tok/s | requests/s |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['ttft_p50_s'] * 1e3:.0f} | {r['ttft_p90_s'] * 1e3:.0f} | "
                     f"{r['output_tok_per_s']:.1f} | {r['requests_per_s']:.2f} |")
    if len(results) == 2:
        ours, peer = results.values()
        paired = sorted(theirs / mine for mine, theirs in zip(ours["ttft_all_s"], peer["ttft_all_s"]))
        rounds = [mine / theirs for mine, theirs in zip(ours["output_tok_per_s_rounds"], peer["output_tok_per_s_rounds"])]
        lines.append(f"\nTTFT p50: peer ÷ mili = {peer['ttft_p50_s'] / ours['ttft_p50_s']:.2f}x (request by request: "
                     f"median {statistics.median(paired):.2f}x, {paired[0]:.2f}-{paired[-1]:.2f}x); throughput: "
                     f"mili ÷ peer = {ours['output_tok_per_s'] / peer['output_tok_per_s']:.2f}x (rounds: "
                     f"{', '.join(f'{ratio:.2f}x' for ratio in rounds)})")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp's source tree, with build/bin/llama-server")
    parser.add_argument("--checkpoint", type=Path, help="the checkpoint (built there if absent)")
    parser.add_argument("--tiny", action="store_true", help="a tiny checkpoint: validates the command, not speed")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench-results" / "vision")
    parser.add_argument("--ttft-requests", type=int, default=TTFT_REQUESTS)
    parser.add_argument("--concurrency", type=int, default=CONCURRENT_REQUESTS)
    parser.add_argument("--output-tokens", type=int, default=THROUGHPUT_OUTPUT_TOKENS)
    parser.add_argument("--rounds", type=int, default=THROUGHPUT_ROUNDS, help="concurrent batches per server")
    parser.add_argument("--mili-args", nargs=argparse.REMAINDER, default=[], help="more `mili serve` flags (last)")
    args = parser.parse_args(argv)
    if "llama.cpp" in args.servers and args.llama_cpp is None:
        parser.error("--llama-cpp DIR is needed to run llama.cpp's server (or pass --servers mili)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    default_name = "qwen3.5-tiny-vl-random" if args.tiny else "qwen3.5-0.8b-vl-random"
    checkpoint = ensure_checkpoint(args.checkpoint or args.out_dir / f"{default_name}-seed{SEED}", args.tiny)
    gguf = ensure_gguf(checkpoint, args.llama_cpp, args.out_dir) if "llama.cpp" in args.servers else None
    if "mili" in args.servers:
        build_cpu_kernels_first()
    with contextlib.ExitStack() as servers:
        base_urls = {}
        for name in args.servers:
            spec = server_spec(name, checkpoint, free_port(), gguf, args.llama_cpp,
                               args.mili_args if name == "mili" else [])
            servers.enter_context(ServerProcess(spec, args.out_dir / f"{name}.log")).wait_healthy(STARTUP_TIMEOUT_S)
            base_urls[name] = spec.base_url
        results = asyncio.run(run_workloads(base_urls, args.ttft_requests, args.concurrency, args.output_tokens,
                                            args.rounds))
    for name, figures in results.items():
        print(f"{name}: {json.dumps({k: v for k, v in figures.items() if k != 'ttft_all_s'})}", flush=True)
    (args.out_dir / "vision-results.json").write_text(json.dumps({"checkpoint": str(checkpoint), **results},
                                                                  indent=2))
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
