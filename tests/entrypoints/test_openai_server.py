"""The OpenAI-compatible server, driven by the official `openai` client against a real
`attnserve serve` process (default model, CPU, loopback, an API key; shared with
test_openai_structured.py): both endpoints, streaming and not, n / stop / seed / logprobs /
usage, the API key, and the metrics it reports."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx
import openai
import pytest

from attnserve.bench.serve import benchmark, format_report
from attnserve.cli import build_parser
from attnserve.entrypoints.openai.latency_breakdown import FIRST_TOKEN_STAGES, TOKEN_STAGES
from tests.conftest import HANG_GUARD_S
from tests.entrypoints.openai_server import API_KEY, ServerProcess

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
NO_EOS: dict[str, Any] = {"ignore_eos": True}
RAN_OUT = 'attnserve:request_success_total{finished_reason="length"}'  # reached max_tokens


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    (card,) = client.models.list().data
    assert card.id == MODEL
    assert card.model_extra == {"max_model_len": 512}
    assert client.models.retrieve(MODEL).id == MODEL  # GET /v1/models/{id}
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-9")
    assert missing.value.code == "model_not_found"


def test_completion_whole_and_streamed_agree(client: openai.OpenAI, tokenizer: Any) -> None:
    prompt = "The capital of France is"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    (choice,) = whole.choices
    assert "Paris" in choice.text
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert whole.usage.completion_tokens == len(tokenizer.encode(choice.text)) <= 8
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_whole_and_streamed_agree(client: openai.OpenAI, tokenizer: Any) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=24, temperature=0
    )
    answer = whole.choices[0].message.content or ""
    assert "Paris" in answer and whole.choices[0].message.role == "assistant"
    prompt = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt))
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_fixed_length_streams_report_exact_usage(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt=[[1000, 2000, 3000], [4000, 5000]],
        n=2,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_EOS,
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == 5 and usage.completion_tokens == 24
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks[:-1]}
    assert finished == {0: "length", 1: "length", 2: "length", 3: "length"}


def test_batched_prompts_and_n(client: openai.OpenAI) -> None:
    single = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=6, temperature=0)
    batch = client.completions.create(
        model=MODEL, prompt=["Red, green,", "One, two,"], n=2, max_tokens=6, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[2].text == batch.choices[3].text == single.choices[0].text


def test_seed_makes_sampling_repeatable(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        out = client.completions.create(
            model=MODEL, prompt="Once upon a time", n=2, max_tokens=6, seed=seed, temperature=1
        )
        return [c.text for c in out.choices]

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first
    assert first[0] != first[1]  # the two samples differ from one another


def test_stop_string_is_cut_whole_and_streamed(client: openai.OpenAI) -> None:
    free = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0
    ).choices[0]
    stop = free.text[4:7]
    cut = free.text[: free.text.index(stop)]
    args: dict[str, Any] = {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 12}
    stopped = client.completions.create(**args, temperature=0, stop=[stop]).choices[0]
    assert (stopped.text, stopped.finish_reason) == (cut, "stop")
    chunks = list(client.completions.create(**args, temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, logprobs=3
    ).choices[0]
    assert out.logprobs is not None and out.logprobs.top_logprobs is not None
    assert len(out.logprobs.tokens or []) == 5
    assert "".join(out.logprobs.tokens or []) == out.text
    for chosen, top in zip(
        out.logprobs.token_logprobs or [], out.logprobs.top_logprobs, strict=True
    ):
        assert len(top) == 3 and chosen == max(top.values())  # greedy takes the best
        assert all(value <= 0 for value in top.values())


def test_chat_top_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    ).choices[0]
    assert out.logprobs is not None and out.logprobs.content is not None
    entries = out.logprobs.content
    assert "".join(e.token for e in entries) == out.message.content
    for entry in entries:
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert entry.logprob == entry.top_logprobs[0].logprob
        assert bytes(entry.bytes or []) == entry.token.encode()


def test_api_key_is_required_on_v1_only(server: ServerProcess) -> None:
    wrong = openai.OpenAI(
        base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=HANG_GUARD_S
    )
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.models.list()
    assert caught.value.body["message"] == "a valid API key is required"  # type: ignore[index]
    body = {"model": MODEL, "prompt": "hi"}
    missing = httpx.post(server.url + "/v1/completions", json=body, timeout=HANG_GUARD_S)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    for open_route in ("/health", "/metrics"):
        assert httpx.get(server.url + open_route, timeout=HANG_GUARD_S).status_code == 200


def test_metrics_count_a_request(client: openai.OpenAI, server: ServerProcess) -> None:
    before = server.wait_idle()
    client.completions.create(
        model=MODEL, prompt=[5, 6, 7, 8], max_tokens=5, temperature=0, extra_body=NO_EOS
    )
    after = server.wait_idle()

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("attnserve:generation_tokens_total") == 5
    assert grew("attnserve:prompt_tokens_total") == 4
    assert grew("attnserve:time_to_first_token_seconds_count") == 1
    # one gap per output after the first: 4 when each token arrives alone, fewer where the
    # front end reads two steps' tokens as one output (the last two come back to back)
    assert 1 <= grew("attnserve:time_per_output_token_seconds_count") <= 4
    # the front end's share of the first token: measured, and inside the request's TTFT
    assert grew("attnserve:first_token_frontend_delay_seconds_count") == 1
    delay = grew("attnserve:first_token_frontend_delay_seconds_sum")
    assert 0 < delay <= grew("attnserve:time_to_first_token_seconds_sum")
    assert grew('attnserve:request_success_total{finished_reason="length"}') == 1
    assert after["attnserve:kv_cache_usage_perc"] == 0
    assert after["attnserve:prefix_cache_hit_rate"] >= 0


def test_64_concurrent_streams_all_complete_and_free_their_blocks(server: ServerProcess) -> None:
    client = openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=HANG_GUARD_S
    )
    common: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": NO_EOS,
    }

    async def one(i: int) -> tuple[int, int]:
        if i % 2:
            chat = [{"role": "user", "content": f"Count to {i}."}]
            stream: Any = await client.chat.completions.create(messages=chat, **common)
        else:
            stream = await client.completions.create(prompt=f"{i} bottles of", **common)
        chunks = [chunk async for chunk in stream]
        deltas = sum(1 for c in chunks if c.choices and c.choices[0].finish_reason is None)
        return deltas, chunks[-1].usage.completion_tokens

    async def run() -> list[tuple[int, int]]:
        async with client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(i) for i in range(64))), HANG_GUARD_S
            )

    started = time.monotonic()
    results = asyncio.run(run())
    assert [usage for _, usage in results] == [8] * 64
    assert all(deltas >= 1 for deltas, _ in results)  # one event per token, or merged ones
    idle = server.wait_idle()
    assert idle["attnserve:kv_cache_usage_perc"] == 0
    print(f"64 streams x 8 tokens: {time.monotonic() - started:.1f} s")


def test_streamed_text_equals_whole_text_with_many_streams(client: openai.OpenAI) -> None:
    """32 streams at once (a busy front end merges each stream's queued deltas into one event):
    every streamed text adds up to the non-streamed text, stop strings included."""
    prompts = [f"{i} apples and {i + 1}" for i in range(32)]
    stops = [["\n"] if i % 2 else None for i in range(32)]
    common: dict[str, Any] = {"model": MODEL, "max_tokens": 16, "temperature": 0}
    concurrent = openai.AsyncOpenAI(
        base_url=client.base_url, api_key=API_KEY, max_retries=0, timeout=HANG_GUARD_S
    )

    async def whole(prompt: str, stop: list[str] | None) -> tuple[str, str | None]:
        choice = (await concurrent.completions.create(prompt=prompt, stop=stop, **common)).choices[
            0
        ]
        return choice.text, choice.finish_reason

    async def streamed(prompt: str, stop: list[str] | None) -> tuple[str, str | None, int]:
        stream = await concurrent.completions.create(
            prompt=prompt, stop=stop, stream=True, **common
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].text for c in chunks)
        return text, chunks[-1].choices[0].finish_reason, len(chunks)

    async def run() -> tuple[list[tuple[str, str | None]], list[tuple[str, str | None, int]]]:
        async with concurrent:
            pairs = list(zip(prompts, stops, strict=True))
            wholes = await asyncio.wait_for(
                asyncio.gather(*(whole(*p) for p in pairs)), HANG_GUARD_S
            )
            streams = await asyncio.wait_for(
                asyncio.gather(*(streamed(*p) for p in pairs)), HANG_GUARD_S
            )
            return wholes, streams

    wholes, streams = asyncio.run(run())
    assert [(text, reason) for text, reason, _ in streams] == wholes
    print(f"events per stream: {[n for _, _, n in streams]}")


async def _until_running(server: ServerProcess, count: int) -> None:
    """Poll the metrics until `count` requests run; fail only on a hang."""
    deadline = time.monotonic() + HANG_GUARD_S
    while (await asyncio.to_thread(server.metrics))["attnserve:num_requests_running"] < count:
        assert time.monotonic() < deadline, f"{count} requests never ran at once: a hang"
        await asyncio.sleep(0.05)


async def _open_streams(server: ServerProcess, count: int) -> None:
    """`count` long streams: read each one's first event, then drop every connection."""
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 400, "stream": True}
    body.update(NO_EOS)
    drop = asyncio.Event()

    async def one(http: httpx.AsyncClient) -> None:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            await drop.wait()

    async with httpx.AsyncClient(
        base_url=server.url, headers=server.headers, timeout=HANG_GUARD_S
    ) as http:
        streams = asyncio.gather(*(one(http) for _ in range(count)))
        await _until_running(server, count)
        assert (await asyncio.to_thread(server.metrics))["attnserve:kv_cache_usage_perc"] > 0
        drop.set()
        await streams


def test_a_burst_of_disconnects_frees_every_block(server: ServerProcess) -> None:
    before = server.wait_idle().get(RAN_OUT, 0.0)
    asyncio.run(_open_streams(server, 32))
    idle = server.wait_idle()
    assert idle["attnserve:num_requests_running"] == 0
    assert idle["attnserve:kv_cache_usage_perc"] == 0
    assert idle.get(RAN_OUT, 0.0) == before  # aborted: none ran on to its 400 tokens


def test_a_dropped_non_streaming_request_is_aborted(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 400, **NO_EOS}
    before = server.wait_idle().get(RAN_OUT, 0.0)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers) as http:
            post = http.post("/v1/completions", json=body, timeout=HANG_GUARD_S)
            request = asyncio.create_task(post)
            await _until_running(server, 1)
            request.cancel()  # closes the connection mid-generation
            with contextlib.suppress(asyncio.CancelledError):
                await request

    asyncio.run(run())
    idle = server.wait_idle()
    assert idle["attnserve:num_requests_running"] == 0
    assert idle["attnserve:kv_cache_usage_perc"] == 0
    assert idle.get(RAN_OUT, 0.0) == before  # aborted, not run on to its 400 tokens


@pytest.mark.parametrize("pacing", [[], ["--request-rate", "20", "--max-concurrency", "2"]])
def test_bench_serve_reports_what_the_server_counted(
    server: ServerProcess, pacing: list[str]
) -> None:
    command = ["bench", "serve", "--base-url", server.url, "--api-key", API_KEY]
    command += ["--num-prompts", "6"]
    args = build_parser().parse_args([*command, "--input-len", "16", "--output-len", "5", *pacing])
    before = server.wait_idle()
    summary = asyncio.run(benchmark(args))
    after = server.wait_idle()
    assert (summary["completed"], summary["failed"]) == (6, 0)
    assert summary["total_input_tokens"] == 96 and summary["total_output_tokens"] == 30
    counted = (
        after["attnserve:generation_tokens_total"] - before["attnserve:generation_tokens_total"]
    )
    assert counted == 30
    assert 0 < summary["median_ttft_ms"] <= summary["p99_ttft_ms"] <= summary["p99_e2el_ms"]
    assert summary["mean_tpot_ms"] > 0 and summary["mean_itl_ms"] > 0
    assert summary["output_throughput"] == pytest.approx(30 / summary["duration_s"])
    assert "Output token throughput" in format_report(summary)
    # the server's own share of the first tokens, from its /metrics around the run
    assert 0 < summary["mean_frontend_delay_ms"] <= summary["mean_ttft_ms"]
    assert "front-end delay" in format_report(summary)
    # the server's latency breakdown: every stage of a first token was seen, and those before
    # its chunk is sent add up to less than the time to first token the client saw around them
    # (the last, `write`, ends when the server's coroutine resumes after the send: the client
    # may have read the chunk by then)
    stages = summary["breakdown_ms"]
    first = stages["first token"]
    assert set(first) == set(FIRST_TOKEN_STAGES)
    assert all(value is not None and value >= 0 for value in first.values())
    assert 0 < sum(first.values()) - first["write"] < summary["mean_ttft_ms"]
    later = stages["later tokens"]
    assert set(later) == set(TOKEN_STAGES) and all(v is not None for v in later.values())
    assert later["core"] > 0
    assert stages["engine steps"]["interval"] > 0
    assert "Server stages, first token" in format_report(summary)
