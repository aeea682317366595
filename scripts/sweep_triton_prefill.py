"""Sweep the TRITON paged prefill kernel's tiles and `PrefillVariant`s against torch SDPA (GPU).

Prompts only (no cached context), as `attnserve bench kernels` runs them.

For each prefill shape of scripts/bench_triton_kernels.py (B x L = 4x4096 and 16x1024, 32 query /
8 KV heads, head 128, bf16, block 16, causal) it builds that script's random paged cache
(shuffled pages), times SDPA on contiguous tensors (K/V repeated per query head), then runs
the every-key-from-the-cache variant (on a 256x64 tile) and the tile grid under each
source of the new tokens' keys (plain loads, TMA). Every run is first checked against an fp32
reference (max abs error <= --atol); one that fails to compile, runs out of resources or is
wrong is reported with the reason and not timed.
Times are triton.testing.do_bench medians; TFLOP/s count the causal half (2*B*H*L^2*D).
Runs past --budget-s (split evenly over the shapes, unused time carried on) are skipped, so a
run ends in about budget + one compile. Prints a table per shape sorted by time and the best
run per shape; --json writes everything (after each shape, so a killed run keeps its part).

    PYTHONPATH=src:. python3 scripts/sweep_triton_prefill.py --json $OUT/prefill_sweep.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
import triton

from attnserve.attention.ops.triton_common import AttentionParams, KernelConfig
from attnserve.attention.ops.triton_prefill import (
    FreshKeys,
    PrefillVariant,
    default_prefill_config,
    paged_prefill,
)
from scripts.bench_triton_kernels import DTYPE, HEAD, PREFILL_SHAPES, gather_kv, paged_kv

Shape = tuple[int, int, int, int]  # batch, prompt length, query heads, KV heads
PARAMS = AttentionParams(scale=HEAD**-0.5)
DEVICE = "cuda"
CACHE_ONLY = PrefillVariant(fresh_keys="cache")  # every key gathered from the cache
SESSION3_TILE = KernelConfig(256, 64, 8, 3)
# (source of the new keys, tile: rows (tokens x 4 query heads) x keys, warps, stages)
GRID: list[tuple[FreshKeys, KernelConfig]] = [
    *(
        ("tma", KernelConfig(64, n, w, s))
        for n, w, s in ((64, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 3), (32, 4, 4), (128, 4, 2))
    ),
    ("tma", KernelConfig(64, 64, 8, 3)),
    ("tma", KernelConfig(128, 64, 8, 3)),
    ("tma", KernelConfig(128, 128, 8, 3)),
    ("pointers", KernelConfig(64, 64, 4, 3)),
    ("pointers", KernelConfig(256, 64, 8, 3)),
]


@dataclass
class Problem:
    """One shape's inputs: paged (the kernel's) and contiguous (SDPA's), and the fp32 answer."""

    shape: Shape
    q: torch.Tensor  # [B * L, Hq, D]
    k: torch.Tensor  # [B * L, Hkv, D]: the new tokens' K/V (also in the cache)
    v: torch.Tensor
    cache: torch.Tensor
    table: torch.Tensor
    seq_lens: torch.Tensor
    starts: torch.Tensor
    q4: torch.Tensor  # [B, Hq, L, D], and K/V below repeated to Hq heads
    k4: torch.Tensor
    v4: torch.Tensor
    want: torch.Tensor  # fp32 [B, Hq, L, D]
    flops: float


@dataclass
class Run:
    config: KernelConfig
    variant: PrefillVariant
    status: str  # "ok", or why it was not timed
    max_err: float | None = None
    us: float | None = None
    tflops: float | None = None
    vs_sdpa: float | None = None


def build_problem(shape: Shape) -> Problem:
    batch, length, heads, kv_heads = shape
    cache, table = paged_kv(batch, length, kv_heads)
    q = torch.randn(batch * length, heads, HEAD, device=DEVICE, dtype=DTYPE)
    dense = gather_kv(cache, table, length)  # [B, 2, Hkv, L, D]
    fresh = dense.permute(1, 0, 3, 2, 4).reshape(2, batch * length, kv_heads, HEAD)
    kv = dense.repeat_interleave(heads // kv_heads, dim=2)
    q4 = q.view(batch, length, heads, HEAD).transpose(1, 2).contiguous()
    k4, v4 = kv[:, 0].contiguous(), kv[:, 1].contiguous()
    want = F.scaled_dot_product_attention(q4.float(), k4.float(), v4.float(), is_causal=True)
    return Problem(
        shape=shape,
        q=q,
        k=fresh[0].contiguous(),
        v=fresh[1].contiguous(),
        cache=cache,
        table=table,
        seq_lens=torch.full((batch,), length, dtype=torch.int32, device=DEVICE),
        starts=torch.arange(batch + 1, device=DEVICE, dtype=torch.int32) * length,
        q4=q4,
        k4=k4,
        v4=v4,
        want=want,
        flops=2.0 * batch * heads * length * length * HEAD,
    )


def median_us(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3


def max_err(problem: Problem, out: torch.Tensor) -> float:
    batch, length, heads, _ = problem.shape
    got = out.view(batch, length, heads, HEAD).transpose(1, 2).float()
    return float((got - problem.want).abs().max())


def run_one(
    problem: Problem, cfg: KernelConfig, variant: PrefillVariant, sdpa_us: float, atol: float
) -> Run:
    """Check one (tile, variant) against the reference, then time it."""
    out = torch.full_like(problem.q, float("nan"))
    length = problem.shape[1]

    def call() -> None:
        paged_prefill(
            problem.q, problem.k, problem.v, problem.cache, problem.table, problem.seq_lens,
            problem.starts, length, out, PARAMS, cfg, variant, max_context_len=0,
        )  # fmt: skip

    try:
        call()
        torch.cuda.synchronize()
    except Exception as error:  # compile errors, out of resources, ptxas crashes
        reason = (str(error).strip().splitlines() or [""])[0][:160]
        return Run(cfg, variant, f"failed: {type(error).__name__}: {reason}")
    err = max_err(problem, out)
    if not err <= atol:
        return Run(cfg, variant, f"wrong: max err {err:.3g} > {atol}", max_err=err)
    us = median_us(call)
    tflops = problem.flops / us / 1e6
    return Run(cfg, variant, "ok", err, us, tflops, sdpa_us / us)


def best_run(runs: list[Run]) -> Run | None:
    timed = [r for r in runs if r.us is not None]
    return min(timed, key=lambda r: r.us or math.inf) if timed else None


def sweep_shape(shape: Shape, deadline: float, atol: float) -> dict[str, object]:
    """Steps 1-3 of the module docstring for one shape; returns its JSON record."""
    problem = build_problem(shape)
    sdpa_us = median_us(
        lambda: F.scaled_dot_product_attention(problem.q4, problem.k4, problem.v4, is_causal=True)
    )
    sdpa = F.scaled_dot_product_attention(problem.q4, problem.k4, problem.v4, is_causal=True)
    sdpa_err = float((sdpa.float() - problem.want).abs().max())
    print(f"\n{_shape_name(shape)}: SDPA {sdpa_us:.1f} us, {problem.flops / sdpa_us / 1e6:.1f} "
          f"TFLOP/s, max err {sdpa_err:.3g} (vs fp32)", flush=True)  # fmt: skip
    runs: list[Run] = []

    def measure(cfg: KernelConfig, variant: PrefillVariant) -> None:
        if time.monotonic() > deadline:
            run = Run(cfg, variant, "skipped: time budget spent")
        else:
            run = run_one(problem, cfg, variant, sdpa_us, atol)
        runs.append(run)
        print("  " + _row(run), flush=True)

    default_tile = default_prefill_config(torch.device(DEVICE), HEAD, DTYPE, "tma", shape[1])
    measure(SESSION3_TILE, CACHE_ONLY)
    for fresh, cfg in GRID:
        measure(cfg, PrefillVariant(fresh_keys=fresh))
    _print_table(shape, runs, default_tile)
    return {
        "shape": dict(zip(("batch", "length", "heads", "kv_heads"), shape, strict=True)),
        "sdpa": {"us": sdpa_us, "tflops": problem.flops / sdpa_us / 1e6, "max_err": sdpa_err},
        "default_config": asdict(default_tile),
        "best": asdict(best) if (best := best_run(runs)) else None,
        "runs": [asdict(r) for r in runs],
    }


def _shape_name(shape: Shape) -> str:
    batch, length, heads, kv_heads = shape
    return f"B={batch} L={length} Hq={heads} Hkv={kv_heads}"


def _config_name(cfg: KernelConfig) -> str:
    return f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"


def _row(run: Run) -> str:
    flags = f"{run.variant.fresh_keys:<8}"
    if run.us is None:
        return f"{_config_name(run.config):<16} {flags}   {run.status}"
    return (f"{_config_name(run.config):<16} {flags}   {run.us:9.1f} {run.tflops:8.1f} "
            f"{run.vs_sdpa:7.1%} {run.max_err:8.3g}")  # fmt: skip


def _print_table(shape: Shape, runs: list[Run], default_tile: KernelConfig) -> None:
    print(f"\n{_shape_name(shape)}, sorted (keys: where the new keys come from)")
    print(f"  {'config':<16} keys     {'us':>9} {'TFLOP/s':>8} {'vs SDPA':>7} {'max err':>8}")
    for run in sorted(runs, key=lambda r: r.us if r.us is not None else math.inf):
        print("  " + _row(run))
    best = best_run(runs)
    before = next((r for r in runs if r.variant == CACHE_ONLY and r.us), None)
    if best:
        print(f"best {_shape_name(shape)}: {best.config} {best.variant} -> {best.tflops:.1f} "
              f"TFLOP/s = {best.vs_sdpa:.1%} of SDPA", flush=True)  # fmt: skip
    if before:
        print(f"before (default tile, keys from the cache): {before.tflops:.1f} TFLOP/s = "
              f"{before.vs_sdpa:.1%} of SDPA", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--atol", type=float, default=0.05, help="max abs error vs fp32")
    parser.add_argument("--budget-s", type=float, default=190.0, help="stop starting runs after")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    start = time.monotonic()
    report: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shapes": [],
    }
    print(report["device"], "torch", torch.__version__, "triton", triton.__version__, flush=True)
    records: list[dict[str, object]] = []
    report["shapes"] = records
    for i, shape in enumerate(PREFILL_SHAPES):
        deadline = start + args.budget_s * (i + 1) / len(PREFILL_SHAPES)
        records.append(sweep_shape(shape, deadline, args.atol))
        torch.cuda.empty_cache()
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=1)
    print(f"\ntotal {time.monotonic() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
