"""One heavy client beside light ones, against a running `attnserve serve` (issue 48's targets):
a completion of `--long-prompts` prompts of `--long-tokens` token ids each is sent, and once the
server says it runs (`attnserve:num_requests_running` > 0), `--probes` short streamed requests
follow one after another, each timed to its first token, while `/health` and `/metrics` are
timed too. Prints each figure, and the server's `request_queue_steps` histogram.

    attnserve serve --port 8011 &          # the embedded model on the CPU
    PYTHONPATH=src python tools/fairness_probe.py --url http://127.0.0.1:8011
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx


async def _first_token_s(client: httpx.AsyncClient, model: str) -> float:
    body = {"model": model, "prompt": "Tell me a story", "max_tokens": 4, "stream": True}
    started = time.monotonic()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                return time.monotonic() - started
    raise RuntimeError("the stream ended without a token")


async def _timed_get(client: httpx.AsyncClient, path: str) -> float:
    started = time.monotonic()
    (await client.get(path)).raise_for_status()
    return time.monotonic() - started


async def _running(client: httpx.AsyncClient) -> bool:
    text = (await client.get("/metrics")).text
    line = next(x for x in text.splitlines() if x.startswith("attnserve:num_requests_running "))
    return float(line.split()[-1]) > 0


def _report(ttfts: list[float], health: list[float], metrics: list[float]) -> None:
    for name, values in (("short first token", ttfts), ("/health", health), ("/metrics", metrics)):
        print(f"{name}: median {statistics.median(values):.3f} s, worst {max(values):.3f} s "
              f"({len(values)} while the heavy request ran)", flush=True)  # fmt: skip


async def probe(args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(base_url=args.url, timeout=3600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        prompts = [[100 + (i * 7 + j) % 5000 for j in range(args.long_tokens)]
                   for i in range(args.long_prompts)]  # fmt: skip
        body = {"model": model, "prompt": prompts, "max_tokens": 1}
        started = time.monotonic()
        heavy = asyncio.create_task(client.post("/v1/completions", json=body))
        while not await _running(client):
            await asyncio.sleep(0.05)
        ttfts, health, metrics = [], [], []
        while not heavy.done() and len(ttfts) < args.probes:
            ttfts.append(await _first_token_s(client, model))
            health.append(await _timed_get(client, "/health"))
            metrics.append(await _timed_get(client, "/metrics"))
        _report(ttfts, health, metrics)
        response = await heavy
        print(f"heavy request: {args.long_prompts} x {args.long_tokens} token ids, "
              f"{response.status_code} after {time.monotonic() - started:.1f} s")  # fmt: skip
        queue = [x for x in (await client.get("/metrics")).text.splitlines()
                 if x.startswith("attnserve:request_queue_steps_bucket")]  # fmt: skip
    print("\n".join(queue))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--long-prompts", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=6000)
    parser.add_argument("--probes", type=int, default=5)
    asyncio.run(probe(parser.parse_args()))


if __name__ == "__main__":
    main()
