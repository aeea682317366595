"""FP8 GEMMs and the quantizing kernels on the GPU machine: what `fp8_gemm.pick_config` was
chosen from (docs/benchmarks.md, issue 30).

    PYTHONPATH=src python3 tools/fp8_gemm_sweep.py [--rows 1,16,32,64,128,256] [--json FILE]

For each of Llama-3-8B's four projections (qkv, o, gate_up, down) and each row count: bf16
`F.linear`, torch's `_scaled_mm` row-wise (with and without fast accumulation) and tensor-wise,
this project's Triton FP8 GEMM at every tile shape `candidates` lists for the size (checked
against the row-wise product first), then the three fastest again with other pipeline depths
and warp counts, and the tile `pick_config` takes; then RMSNorm (+ residual) and SiLU-and-mul
followed by the quantization against the quantizing kernels. Times are µs of CUDA graph
replays (`triton.testing.do_bench_cudagraph`), each replay cycling through copies of the
weight that together outgrow the L2 cache, as a model's layers do. Triton compiles the tiles
in a pool of processes first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench_cudagraph

from attnserve.model.layers import fused_ops
from attnserve.model.quantization import fp8_gemm
from attnserve.model.quantization.fp8 import quantize_rows
from attnserve.model.quantization.fp8_gemm import GemmConfig as Config

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LARGE = [Config(64, 128, 128, 4, 4), Config(128, 128, 128, 8, 4), Config(128, 256, 128, 8, 3),
         Config(128, 128, 128, 4, 4), Config(64, 256, 128, 4, 4),
         Config(128, 64, 128, 4, 4)]  # fmt: skip
SMS = 132
SHARED_BYTES = 220 * 1024  # the tiles' pipeline buffers a program may hold (the H200 has 227 KiB)
ROTATE_BYTES = 128 << 20  # weight copies a timing cycles through: over the 60 MB L2


def _stages(config: Config) -> Config:
    """`config` with as many pipeline stages as fit SHARED_BYTES (at most its own)."""
    stages = config.num_stages
    while (config.block_m + config.block_n) * config.block_k * stages > SHARED_BYTES:
        stages -= 1
    return replace(config, num_stages=stages)


def candidates(m: int, n: int, k: int) -> list[Config]:
    """The tile shapes timed at [m, k] x [k, n]: BLOCK_M the rows (up to 128) and half of that,
    BLOCK_N 16 to 256, K blocks of 256 for narrow tiles and 128 for wide ones; split-K 2 to 8
    where the tiles alone make fewer than two waves of programs (up to eight waves, slices of
    512+ columns); tiles that fill under half a wave unsplit are left out."""
    if m > 256:
        return LARGE
    top = min(max(16, triton.next_power_of_2(m)), 128)
    configs = []
    for block_m in sorted({max(16, top // 2), top}):
        for block_n in (16, 32, 64, 128) + ((256,) if m >= 64 else ()):
            block_ks = (256,) if block_n <= 32 else (128, 256) if block_n == 64 else (128,)
            for block_k, split in itertools.product(block_ks, (1, 2, 4, 8)):
                tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
                if split == 1 and tiles < SMS // 2:
                    continue
                if split > 1 and (tiles >= 2 * SMS or tiles * split > 8 * SMS
                                  or k % (block_k * split) or k // split < 512):  # fmt: skip
                    continue
                warps = 8 if block_m * block_n >= 128 * 128 else 4
                stages = 3 if block_k == 256 else 4
                configs.append(_stages(Config(block_m, block_n, block_k, warps, stages,
                                              split_k=split)))  # fmt: skip
    return configs


def variants(configs: Iterable[Config]) -> list[Config]:
    """Each config with 3, 4 and 5 pipeline stages (where they fit) and the other warp count."""
    out = []
    for config in configs:
        for stages in (3, 4, 5):
            out.append(_stages(replace(config, num_stages=stages)))
        out.append(replace(config, num_warps=12 - config.num_warps))
    return list(dict.fromkeys(out))


def _compile(configs: list[Config]) -> list[Config]:
    """Runs each config once at a small size for M = 1 and M = 16 (the two specializations the
    sweep meets), so that Triton's cache holds its kernels; returns those that fail."""
    failed = []
    b_q, b_scale = quantize_rows(torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16))
    for config, m in itertools.product(configs, (1, 16)):
        a_q, a_scale = quantize_rows(torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16))
        try:
            fp8_gemm.scaled_mm(a_q, a_scale, b_q, b_scale, torch.bfloat16, config=config)
        except Exception as error:  # out of shared memory, or a shape the compiler refuses
            print(f"{_name(config)}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            failed.append(config)
    torch.cuda.synchronize()
    return list(dict.fromkeys(failed))


class Compiler:
    """A pool of processes that fill Triton's cache with the configs' kernels."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.pool = ProcessPoolExecutor(min(16, os.cpu_count() or 1), mp_context=context)
        self.done: set[Config] = set()
        self.failed: set[Config] = set()

    def __call__(self, configs: list[Config]) -> list[Config]:
        """The configs that compiled (each compiled once, in parallel)."""
        todo = [c for c in dict.fromkeys(configs) if c not in self.done]
        for failed in self.pool.map(_compile, [[c] for c in todo]):
            self.failed.update(failed)
        self.done.update(todo)
        return [c for c in configs if c not in self.failed]


def _micros(fn: Callable[[], Any]) -> float:
    fn()
    torch.cuda.synchronize()
    return round(do_bench_cudagraph(fn, rep=5) * 1000, 2)


def _name(config: Config) -> str:
    c = config
    split = f"k{c.split_k}" if c.split_k > 1 else ""
    return f"{c.block_m}x{c.block_n}x{c.block_k}w{c.num_warps}s{c.num_stages}{split}"


def gemm_row(name: str, m: int, compile_all: Compiler) -> dict[str, Any]:
    n, k = SHAPES[name]
    copies = -(-ROTATE_BYTES // (n * k))
    weights = [quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
               for _ in range(copies)]  # fmt: skip
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x_q, x_scale = quantize_rows(x)
    dense = [(w_q.float() * w_scale[:, None]).bfloat16() for w_q, w_scale in weights]
    one = torch.ones((), device="cuda")

    def rotating(call: Callable[[int], Any]) -> Callable[[], Any]:
        turn = itertools.count()
        return lambda: call(next(turn) % copies)

    def scaled(fast: bool, rowwise: bool = True) -> Callable[[int], torch.Tensor]:
        def call(i: int) -> torch.Tensor:
            w_q, w_scale = weights[i]
            sa, sb = (x_scale[:, None], w_scale[None, :]) if rowwise else (one, one)
            return torch._scaled_mm(x_q, w_q.t(), scale_a=sa, scale_b=sb,
                                    out_dtype=torch.bfloat16, use_fast_accum=fast)  # fmt: skip

        return call

    row = {"shape": name, "m": m, "bf16": _micros(rotating(lambda i: F.linear(x, dense[i]))),
           "row": _micros(rotating(scaled(False))), "row_fast": _micros(rotating(scaled(True))),
           "tensor_fast": _micros(rotating(scaled(True, rowwise=False)))}  # fmt: skip

    def ours(config: Config) -> Callable[[int], torch.Tensor]:
        return lambda i: fp8_gemm.scaled_mm(x_q, x_scale, *weights[i], torch.bfloat16,
                                            config=config)  # fmt: skip

    reference = scaled(False)(0).float()
    times: dict[Config, float] = {}

    def measure(configs: list[Config]) -> None:
        for config in compile_all([c for c in configs if c not in times]):
            got = ours(config)(0).float()
            if float((got - reference).norm() / reference.norm()) > 1e-2:
                raise AssertionError(f"{_name(config)} computes a wrong product at {name} x {m}")
            times[config] = _micros(rotating(ours(config)))

    measure(candidates(m, n, k))
    measure(variants(sorted(times, key=times.__getitem__)[:3]))
    picked = fp8_gemm.pick_config(m, n, k)
    ranked = sorted(times, key=times.__getitem__)
    row["triton"] = {_name(c): times[c] for c in ranked}
    row["best_unsplit"] = next((_name(c) for c in ranked if c.split_k == 1), None)
    row["picked"] = None if picked is None else _name(picked)
    row["picked_us"] = None if picked is None else _micros(rotating(ours(picked)))
    return row


def fused_row(m: int) -> dict[str, Any]:
    x, residual = torch.randn(2, m, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    gate_up = torch.randn(m, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    norm = lambda: quantize_rows(fused_ops.fused_add_rms_norm(x, residual, weight, 1e-6)[0])  # noqa: E731
    return {
        "m": m,
        "norm_then_quantize": _micros(norm),
        "quantizing_norm": _micros(lambda: fused_ops.rms_norm_fp8(x, residual, weight, 1e-6)),
        "silu_then_quantize": _micros(lambda: quantize_rows(fused_ops.silu_and_mul(gate_up))),
        "quantizing_silu": _micros(lambda: fused_ops.silu_and_mul_fp8(gate_up)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,32,64,128,256")
    parser.add_argument("--json", default=None, help="also write every row here, as it comes")
    args = parser.parse_args()
    compile_all = Compiler()
    rows: list[dict[str, Any]] = []
    for name in SHAPES:
        for m in (int(r) for r in args.rows.split(",")):
            row = gemm_row(name, m, compile_all)
            rows.append(row)
            best = list(row["triton"].items())[:3]
            print(name, m, {k: v for k, v in row.items() if k not in ("shape", "m", "triton")},
                  "best", best, flush=True)  # fmt: skip
            _write(args.json, rows)
    for m in (256, 4096):
        rows.append(fused_row(m))
        print(rows[-1], flush=True)
    _write(args.json, rows)


def _write(path: str | None, rows: list[dict[str, Any]]) -> None:
    """The rows so far as JSON to `path` (after each row: a run cut short keeps what it did)."""
    if path:
        with open(path, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
