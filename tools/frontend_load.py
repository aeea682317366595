"""The server's front end under load, without a model: `attnserve serve` whose engine core is a
stand-in that draws one token per running request every `--step-ms`, as a decode-bound GPU
would, so what the benchmark sees past that step time is the front end's (HTTP, tokenizing,
detokenizing, JSON, SSE) on this machine's CPU.

    PYTHONPATH=src python tools/frontend_load.py --step-ms 28 --num-prompts 400
    PYTHONPATH=src python tools/frontend_load.py --step-ms 6 --request-rate 16

The stand-in core runs in its own process behind the real `ProcClient` pipes and `run_core`
loop (only `EngineCore` is replaced): a new request gets its first token one step after it
arrives; every running request then gets one token (random ids in 1000..10000) a step until its
`max_tokens`. The model directory is SmolLM2's tokenizer with a Llama config (`--model`, default:
`/tmp/smol-tiny`, written from the embedded model's converted tokenizer when missing). The client
is `attnserve bench serve` in this process (its lean HTTP client) against the server in a
subprocess; the report is bench serve's, with the core's step time beside it: a front end that
keeps up gives a mean ITL equal to the step time and a mean TPOT equal to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from attnserve.engine.core.messages import (
    CoreReady,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
)

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "head_dim": 16, "vocab_size": 49152, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "tie_word_embeddings": False,
}  # fmt: skip


class StandInCore:
    """`EngineCore`'s interface over no model: one token per running request per step."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.running: dict[str, list[int]] = {}  # request id -> [tokens drawn, max_tokens]
        self.arrived: list[str] = []
        self.ended: list[str] = []
        self.next_step = time.monotonic()
        self.rng = random.Random(0)
        self.num_steps = 0

    def ready_message(self) -> CoreReady:
        return CoreReady(1 << 20, os.getpid())

    def add_request(self, request: EngineCoreRequest) -> None:
        self.running[request.request_id] = [0, request.sampling_params.max_tokens or 16]
        self.arrived.append(request.request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.running.pop(request_id, None)

    def finish_sequences(self, sequences: list[tuple[str, int]]) -> None:
        for request_id, _ in sequences:
            if self.running.pop(request_id, None) is not None:
                self.ended.append(request_id)

    def has_work(self) -> bool:
        return bool(self.running or self.ended)

    def step(self) -> EngineCoreOutputs:
        self.next_step = max(self.next_step + self.step_s, time.monotonic())
        time.sleep(max(0.0, self.next_step - time.monotonic()))
        self.num_steps += 1
        out = EngineCoreOutputs()
        for request_id, state in list(self.running.items()):
            state[0] += 1
            done = state[0] >= state[1]
            token = [self.rng.randrange(1000, 10000)]
            out.outputs.append(
                EngineCoreOutput(request_id, 0, token, None, None, "length" if done else None)
            )
            if done:
                del self.running[request_id]
                out.finished_requests.append(request_id)
        out.finished_requests += self.ended
        self.ended = []
        out.timestamp = time.monotonic()
        return out

    def stats(self) -> dict[str, float]:
        return {"num_running": len(self.running), "num_waiting": 0, "num_swapped": 0,
                "kv_cache_usage": 0.0, "prefix_cache_hit_rate": 0.0, "num_preemptions": 0,
                "num_requests_added": 0, "num_steps": self.num_steps}  # fmt: skip

    def reset_stats(self) -> None:
        """Nothing to reset."""

    def shutdown(self) -> None:
        """Nothing to free."""


def stand_in_core_process(config, commands, messages, num_threads, log_level) -> None:  # type: ignore[no-untyped-def]
    """`run_engine_core_process` with the stand-in core (the step time from the environment)."""
    from attnserve.engine.core.loop import pipe_emit, pipe_take, run_core, start_heartbeat

    core = StandInCore(float(os.environ["FRONTEND_LOAD_STEP_S"]))
    emit = pipe_emit(messages)
    emit(core.ready_message())
    start_heartbeat(emit)
    run_core(core, pipe_take(commands), emit)  # type: ignore[arg-type]
    os._exit(0)


def serve(model: str, port: int) -> None:
    from attnserve.bench.launch import serve_parser
    from attnserve.engine.core import loop
    from attnserve.entrypoints.openai.api_server import run_server

    loop.run_engine_core_process = stand_in_core_process  # type: ignore[assignment]
    args = serve_parser().parse_args(
        [model, "--load-format", "dummy", "--port", str(port), "--uvicorn-log-level", "warning"]
    )
    args.log_level = "warning"
    sys.exit(run_server(args))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (its threads, not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def model_dir(path: Path) -> Path:
    if not (path / "tokenizer.json").exists():
        from attnserve.model.model_cache import cache_root

        found = next(cache_root().rglob("tokenizer.json"), None)
        if found is None:
            raise SystemExit("no converted embedded model: run `attnserve generate` once")
        path.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(found.parent / name, path / name)
    (path / "config.json").write_text(json.dumps(CONFIG))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-ms", type=float, default=28.0)
    parser.add_argument("--model", default="/tmp/smol-tiny")
    parser.add_argument("--port", type=int, default=8311)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    known, rest = parser.parse_known_args()
    if known.serve:
        serve(known.model, known.port)
    from attnserve.bench.serve import add_arguments, benchmark, format_report

    bench = argparse.ArgumentParser()
    add_arguments(bench)
    bench_args = bench.parse_args([*rest, "--base-url", f"http://127.0.0.1:{known.port}"])
    env = {**os.environ, "FRONTEND_LOAD_STEP_S": str(known.step_ms / 1000)}
    model = str(model_dir(Path(known.model)))
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--model", model, "--port", str(known.port)], env=env
    )
    try:
        import httpx

        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{known.port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        warm = argparse.Namespace(**{**vars(bench_args), "num_prompts": 4, "output_len": 4})
        asyncio.run(benchmark(warm))
        cpu = cpu_seconds(server.pid)
        summary = asyncio.run(benchmark(bench_args))
        cpu = cpu_seconds(server.pid) - cpu
        print(format_report(summary))
        print(f"stand-in core step: {known.step_ms:.1f} ms")
        tokens = summary["total_output_tokens"]
        print(f"server process CPU: {cpu:.2f} s, {cpu / tokens * 1e6:.1f} us per output token")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
