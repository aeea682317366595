"""Where a step's device time goes, kernel by kernel, against the bytes it must read: a
diagnostic for the GPU machine (issue 49's "where the time goes").

    PYTHONPATH=src python3 tools/decode_profile.py PRESET [PRESET ...] [--batch-sizes 1 8 256]
        [--input-len 128] [--steps 20] [--prompt-tokens 2048] [--top 12] [--json FILE]
        [ENGINE_ARG=VALUE ...]

For each preset (dummy weights, the engine's defaults: CUDA graphs on, async scheduling), the
copy rate measured first, then for each batch size B: B prompts of --input-len random tokens are
prefilled, 3 decode steps let one-off work pass, --steps steps are timed by wall clock (the step
period the engine reaches) and --steps more run under torch.profiler. Printed per B: the step
period, the device's busy time per step (the kernels' summed time, graph replays included), the
step's byte bound (the weights a step of B tokens reads plus the KV cache of B sequences, at the
copy rate) and the period's fraction of it, each kernel family's time per step, and the top
kernels. Then one prompt step of --prompt-tokens tokens (prompts of 512), profiled the same way.
Families are read from kernel names (matmul, attention, norm, activation, rotary, KV write,
sampling, elementwise torch, other).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from attnserve import LLM, SamplingParams
from attnserve.bench.bound import ModelShape, measure_rates
from attnserve.bench.common import sync
from attnserve.engine.llm_engine import LLMEngine

os.environ.setdefault("KINETO_LOG_LEVEL", "6")

FAMILIES = (  # (family, kernel-name pattern), the first match wins
    ("attention", r"attend|paged|_decode_kernel|merge_splits|prefill|flash|fmha|BatchDecode"),
    ("KV write", r"reshape_and_cache|cache_kernel"),
    ("norm", r"rms_norm|layer_norm|norm_kernel"),
    ("activation", r"silu|gelu|geglu"),
    ("rotary", r"rotary|rotate"),
    ("matmul", r"gemm|nvjet|cutlass|sm90|xmma|cublas|matmul|_mm_kernel|splitK|split_k"),
    ("sampling", r"topk|top_k|sort|argmax|softmax|exponential|multinomial|sample"),
    ("elementwise torch", r"elementwise|vectorized|reduce_kernel|index|copy|fill|cat"),
)


def family(name: str) -> str:
    for label, pattern in FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def kernel_times(prof: Any) -> dict[str, float]:
    """Each kernel name's summed device time in µs, from the profile's Chrome trace."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            events = json.load(file)["traceEvents"]
    totals: dict[str, float] = defaultdict(float)
    for event in events:
        if event.get("ph") == "X" and event.get("cat") == "kernel":
            totals[event["name"]] += float(event["dur"])
    return totals


def _steps(engine: LLMEngine, count: int) -> float:
    """Wall ms per step of `count` engine steps."""
    sync()
    started = time.perf_counter()
    for _ in range(count):
        engine.step()
    sync()
    return (time.perf_counter() - started) * 1000 / count


def _profiled(engine: LLMEngine, count: int) -> dict[str, float]:
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        _steps(engine, count)
    return {name: us / count for name, us in kernel_times(prof).items()}


def _add(engine: LLMEngine, tag: str, lengths: list[int], max_tokens: int, vocab: int) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = []
    for index, length in enumerate(lengths):
        ids.append(f"{tag}-{index}")
        engine.add_request(ids[-1], [random.randrange(100, vocab) for _ in range(length)], params)
    return ids


def _report(title: str, kernels_us: dict[str, float], top: int) -> dict[str, Any]:
    by_family: dict[str, float] = defaultdict(float)
    for name, us in kernels_us.items():
        by_family[family(name)] += us
    busy_ms = sum(kernels_us.values()) / 1000
    print(f"  {title}: device busy {busy_ms:.3f} ms/step")
    for label, us in sorted(by_family.items(), key=lambda item: -item[1]):
        print(f"    {label:<18} {us / 1000:8.3f} ms {us / 1000 / max(busy_ms, 1e-9):6.1%}")
    ranked = sorted(kernels_us.items(), key=lambda item: -item[1])[:top]
    for name, us in ranked:
        print(f"      {us / 1000:8.3f} ms  {family(name):<18} {name[:110]}")
    return {"busy_ms": busy_ms, "families_ms": {k: v / 1000 for k, v in by_family.items()},
            "top": [(name, us / 1000) for name, us in ranked]}  # fmt: skip


def profile_preset(preset: str, args: argparse.Namespace, engine_args: dict[str, Any]) -> dict:
    llm = LLM(preset, load_format="dummy", **engine_args)
    engine = llm.llm_engine
    config = engine.config.model_config
    rates = measure_rates(engine.config.device, config.dtype)
    shape = ModelShape.from_config(config)
    vocab = config.vocab_size
    result: dict[str, Any] = {"preset": preset, "copy_tb_s": rates.copy_bytes_per_s / 1e12}
    print(f"== {preset}: copy rate {rates.copy_bytes_per_s / 1e12:.2f} TB/s, weights "
          f"{shape.weight_bytes / 1e9:.2f} GB, {engine.config.device}")  # fmt: skip
    for batch in args.batch_sizes:
        ids = _add(engine, f"b{batch}", [args.input_len] * batch, 3 * args.steps + 16, vocab)
        while any(s.num_output_tokens == 0 for s in engine.engine_core.scheduler.running) or (
            engine.engine_core.scheduler.waiting
        ):
            engine.step()
        _steps(engine, 3)
        period_ms = _steps(engine, args.steps)
        kernels = _profiled(engine, args.steps)
        for request_id in ids:
            engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()
        context = args.input_len + 2 * args.steps
        step_bytes = shape.step_weight_bytes(batch) + batch * context * shape.kv_bytes_per_token
        bound_ms = step_bytes / rates.copy_bytes_per_s * 1000
        print(f"  decode batch {batch}: period {period_ms:.3f} ms/step, byte bound "
              f"{bound_ms:.3f} ms ({bound_ms / period_ms:.0%} of it)")  # fmt: skip
        entry = _report(f"decode batch {batch}", kernels, args.top)
        result[f"decode_{batch}"] = {"period_ms": period_ms, "bound_ms": bound_ms, **entry}
    prompts = [512] * max(1, args.prompt_tokens // 512)
    ids = _add(engine, "prompt", prompts, 1, vocab)
    kernels = _profiled(engine, 1)
    for request_id in ids:
        engine.abort_request(request_id)
    result["prompt_step"] = _report(f"prompt step of {sum(prompts)} tokens", kernels, args.top)
    llm.shutdown()
    return result


def _engine_args(pairs: list[str]) -> dict[str, Any]:
    engine_args: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            engine_args[key] = json.loads(value)
        except json.JSONDecodeError:
            engine_args[key] = value
    return engine_args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("presets", nargs="+", help="presets, then ENGINE_ARG=VALUE pairs")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 256])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    presets = [p for p in args.presets if "=" not in p]
    engine_args = _engine_args([p for p in args.presets if "=" in p])
    results = [profile_preset(preset, args, engine_args) for preset in presets]
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
