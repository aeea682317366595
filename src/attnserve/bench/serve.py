"""`attnserve bench serve`: load a running OpenAI-compatible server the way vLLM's serving
benchmark does, and report its throughput and latencies.

Prompts are random token ids (so their length is exact whatever the tokenizer), of a fixed
length or spread uniformly by `--range-ratio`; each asks for exactly `--output-len` tokens
(greedy, `ignore_eos`), streamed. Requests arrive as a Poisson process at `--request-rate`
per second (`inf`: all at once), at most `--max-concurrency` in flight. Per request: time to
first token (TTFT), time per output token after the first (TPOT), the gaps between streamed
tokens (ITL) and end-to-end latency (E2EL); reported as mean / median / p99 in ms. From an
attnserve server's `/metrics`, read before and after the run: the mean front-end delay of the
first tokens (from the engine core handing over the step that drew a request's first token to
the server handing it to the response; the rest of the TTFT is the core's), and the server's
latency breakdown: the mean time a first token, and a later one, spent in each stage from the
request's handler to the socket, and per engine step its interval and the front end's backlog
(attnserve.entrypoints.openai.latency_breakdown names the stages).

`--launch "SERVE ARGS"` starts `attnserve serve SERVE ARGS` itself (a free loopback port; warmed
by a few short requests first) and stops it after the run; `--compare-generate` then runs the same
requests through `LLM.generate` with the same engine arguments, in this process with the server
gone, and prints both output rates and their ratio (serve / generate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attnserve.bench.sse_client import post_json

API_KEY_ENV = "ATTNSERVE_API_KEY"
TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


@dataclass
class RequestResult:
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server")
    parser.add_argument("--endpoint", default="/v1/completions", help="the route to call")
    parser.add_argument("--model", default=None, help="default: the server's only model")
    parser.add_argument("--api-key", default=None, help=f"default: ${API_KEY_ENV}")
    parser.add_argument("--num-prompts", type=int, default=200, help="requests to send")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens")
    parser.add_argument(
        "--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- r); 0: fixed"
    )
    parser.add_argument("--request-rate", type=float, default=math.inf, help="per s; inf: burst")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument(
        "--token-ids", type=int, nargs=2, default=(1000, 10000), metavar=("LOW", "HIGH"),
        help="prompt token ids are drawn from [LOW, HIGH)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")
    parser.add_argument("--result-json", default=None, help="also write the summary here")
    parser.add_argument(
        "--launch", default=None, metavar="SERVE_ARGS",
        help="start `attnserve serve SERVE_ARGS` (quoted; no --port) and benchmark it",
    )  # fmt: skip
    parser.add_argument(
        "--compare-generate", action="store_true",
        help="with --launch: also time LLM.generate of the same requests; print the ratio",
    )  # fmt: skip
    parser.set_defaults(handler=run)


def sample_requests(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request."""
    if not 0 <= args.range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.input_len < 1 or args.output_len < 1 or args.num_prompts < 1:
        raise ValueError("--input-len, --output-len and --num-prompts must be >= 1")
    rng = random.Random(args.seed)
    low, high = args.token_ids

    def length(mean: int) -> int:
        spread = int(mean * args.range_ratio)
        return max(1, rng.randint(mean - spread, mean + spread))

    return [
        ([rng.randrange(low, high) for _ in range(length(args.input_len))], length(args.output_len))
        for _ in range(args.num_prompts)
    ]


async def send_request(
    base_url: str,
    endpoint: str,
    headers: dict[str, str],
    model: str,
    prompt: list[int],
    output_len: int,
) -> RequestResult:
    """One streamed completion, timed at each event that carries tokens (through the lean
    `sse_client`, so the client takes as little of the machine as it can)."""
    result = RequestResult(prompt_len=len(prompt))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = last = time.perf_counter()
    events = 0
    async with post_json(base_url, endpoint, body, headers) as response:
        if response.status != 200:
            result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
            return result
        async for data in response.event_data():
            if data == b"[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = str(chunk["error"].get("message"))
                return result
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                now = time.perf_counter()
                if events == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last, events = now, events + 1
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or events
    return result


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    requests = sample_requests(args)
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = args.model
    if model is None:
        async with httpx.AsyncClient(base_url=args.base_url, headers=headers) as http:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
    before = await scrape(args.base_url, headers)
    gate = asyncio.Semaphore(args.max_concurrency or len(requests))
    rng = random.Random(args.seed + 1)

    async def limited(prompt: list[int], output_len: int) -> RequestResult:
        async with gate:
            return await send_request(
                args.base_url, args.endpoint, headers, model, prompt, output_len
            )

    started = time.perf_counter()
    tasks = []
    for prompt, output_len in requests:
        tasks.append(asyncio.create_task(limited(prompt, output_len)))
        if math.isfinite(args.request_rate):
            await asyncio.sleep(rng.expovariate(args.request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - started
    summary = summarize(results, duration)
    after = await scrape(args.base_url, headers)
    if before is not None and after is not None:
        summary.update(server_side(before, after))
    summary.update(model=model, config={k: v for k, v in vars(args).items() if k != "handler"})
    return summary


FRONTEND_DELAY = "attnserve:first_token_frontend_delay_seconds"
# The server's latency breakdown (attnserve's entrypoints/openai/latency_breakdown.py): summaries
# by stage, as (family, label in the report)
BREAKDOWN = {
    "attnserve:first_token_stage_seconds": "first token",
    "attnserve:token_stage_seconds": "later tokens",
    "attnserve:step_stage_seconds": "engine steps",
}


async def scrape(base_url: str, headers: dict[str, str]) -> dict[str, float] | None:
    """The server's `/metrics` samples this benchmark reads, by name and stage label; None
    where it has none (another server, or no prometheus-client here)."""
    import httpx

    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return None
    async with httpx.AsyncClient(base_url=base_url, headers=headers) as http:
        response = await http.get("/metrics")
    if response.status_code != 200:
        return None
    samples = {}
    for family in text_string_to_metric_families(response.text):
        if family.name == FRONTEND_DELAY or family.name in BREAKDOWN:
            for sample in family.samples:
                samples[f"{sample.name}|{sample.labels.get('stage', '')}"] = sample.value
    return samples


def server_side(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The run's mean front-end delay of a first token and, per breakdown family, the mean ms
    of each stage (from the summaries' growth between two scrapes)."""

    def mean_ms(name: str, stage: str = "") -> float | None:
        count = after.get(f"{name}_count|{stage}", 0.0) - before.get(f"{name}_count|{stage}", 0.0)
        total = after.get(f"{name}_sum|{stage}", 0.0) - before.get(f"{name}_sum|{stage}", 0.0)
        return total / count * 1000 if count > 0 else None

    result: dict[str, Any] = {}
    delay = mean_ms(FRONTEND_DELAY)
    if delay is not None:
        result["mean_frontend_delay_ms"] = delay
    for family, label in BREAKDOWN.items():
        stages = dict.fromkeys(k.split("|")[1] for k in after if k.startswith(family + "_sum"))
        means = {stage: mean_ms(family, stage) for stage in stages}
        if any(value is not None for value in means.values()):
            result.setdefault("breakdown_ms", {})[label] = means
    return result


def _stats(name: str, values: list[float]) -> dict[str, float]:
    ms = np.array(values or [math.nan]) * 1000
    return {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.error is None]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_len for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error is not None})[:5],
        "duration_s": duration,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(done) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
    }
    summary.update(_stats("ttft", [r.ttft for r in done]))
    summary.update(_stats("tpot", tpots))
    summary.update(_stats("itl", [gap for r in done for gap in r.itl]))
    summary.update(_stats("e2el", [r.latency for r in done]))
    return summary


def format_report(summary: dict[str, Any]) -> str:
    lines = [
        "============ Serving Benchmark Result ============",
        f"{'Successful requests:':<40}{summary['completed']:>10}",
        f"{'Failed requests:':<40}{summary['failed']:>10}",
        f"{'Benchmark duration (s):':<40}{summary['duration_s']:>10.2f}",
        f"{'Total input tokens:':<40}{summary['total_input_tokens']:>10}",
        f"{'Total generated tokens:':<40}{summary['total_output_tokens']:>10}",
        f"{'Request throughput (req/s):':<40}{summary['request_throughput']:>10.2f}",
        f"{'Output token throughput (tok/s):':<40}{summary['output_throughput']:>10.2f}",
        f"{'Total token throughput (tok/s):':<40}{summary['total_token_throughput']:>10.2f}",
    ]
    for name, title in TITLES.items():
        lines.append(f"{'-' * 15}{title:^20}{'-' * 15}")
        for stat in ("mean", "median", "p99"):
            value = summary[f"{stat}_{name}_ms"]
            lines.append(f"{f'{stat.title()} {name.upper()} (ms):':<40}{value:>10.2f}")
    if "mean_frontend_delay_ms" in summary:
        delay = summary["mean_frontend_delay_ms"]
        lines.append(f"{'Mean front-end delay, first token (ms):':<40}{delay:>10.2f}")
    for label, stages in summary.get("breakdown_ms", {}).items():
        lines.append(f"{'-' * 12}{f'Server stages, {label} (mean ms)':^26}{'-' * 12}")
        lines.extend(
            f"{stage + ':':<40}{value:>10.3f}"
            for stage, value in stages.items()
            if value is not None
        )
    lines.extend(f"error: {e}" for e in summary["errors"])
    return "\n".join([*lines, "=" * 50])


def _with(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def _launched_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server of `--launch`, warm it with a few short requests, benchmark it, stop it;
    then, with `--compare-generate`, the `LLM.generate` baseline of the same requests."""
    from attnserve.bench.launch import LaunchedServer, generate_baseline, parse_serve_args

    serve_args = parse_serve_args(args.launch)
    server = LaunchedServer(serve_args)
    try:
        asyncio.run(benchmark(_with(args, base_url=server.url, num_prompts=4, output_len=4)))
        summary = asyncio.run(benchmark(_with(args, base_url=server.url)))
    finally:
        server.stop()
    if args.compare_generate:
        requests = sample_requests(args)
        seconds = generate_baseline(serve_args, requests)
        rate = sum(n for _, n in requests) / seconds
        summary["generate"] = {"duration_s": seconds, "output_throughput": rate}
        summary["serve_over_generate"] = summary["output_throughput"] / rate
    return summary


def format_comparison(summary: dict[str, Any]) -> str:
    generate = summary["generate"]
    return "\n".join(
        [
            f"{'LLM.generate, same requests (s):':<40}{generate['duration_s']:>10.2f}",
            f"{'LLM.generate output tok/s:':<40}{generate['output_throughput']:>10.2f}",
            f"{'Serve / generate output throughput:':<40}{summary['serve_over_generate']:>10.2f}",
        ]
    )


def run(args: argparse.Namespace) -> int:
    if args.compare_generate and not args.launch:
        raise ValueError("--compare-generate needs --launch (the server's engine arguments)")
    summary = asyncio.run(benchmark(args)) if args.launch is None else _launched_benchmark(args)
    print(format_report(summary))
    if "generate" in summary:
        print(format_comparison(summary))
    if args.result_json:
        with open(args.result_json, "w") as f:
            date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            json.dump({**summary, "date": date}, f, indent=1)
    return 0 if summary["failed"] == 0 else 1
