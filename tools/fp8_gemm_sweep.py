"""FP8 GEMMs and the quantizing kernels on the GPU machine: what `fp8_gemm.pick_config` was
chosen from (docs/benchmarks.md, issue 30).

    PYTHONPATH=src python3 tools/fp8_gemm_sweep.py [--rows 1,16,64,256,2048,16384] [--json FILE]

For each of Llama-3-8B's four projections (qkv, o, gate_up, down) and each row count: bf16
`F.linear`, torch's `_scaled_mm` row-wise (with and without fast accumulation) and tensor-wise,
this project's Triton FP8 GEMM at every tile shape of its sweep lists (checked against the
row-wise product first) and the tile `pick_config` takes; then RMSNorm (+ residual) and
SiLU-and-mul followed by the quantization against the quantizing kernels. Times are µs of CUDA
graph replays (`triton.testing.do_bench_cudagraph`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from attnserve.model.layers import fused_ops
from attnserve.model.quantization import fp8_gemm
from attnserve.model.quantization.fp8 import quantize_rows

Config = fp8_gemm.GemmConfig
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMALL = [Config(m, n, k, 4, 3 if k == 256 else 4) for m in (16, 32, 64) for n in (64, 128)
         for k in (128, 256)] + [Config(16, 32, 256, 4, 4)]  # fmt: skip
LARGE = [Config(64, 128, 128, 4, 4), Config(128, 128, 128, 8, 4), Config(128, 256, 128, 8, 3),
         Config(128, 128, 128, 4, 4), Config(64, 256, 128, 4, 4),
         Config(128, 64, 128, 4, 4)]  # fmt: skip


def _micros(fn: Callable[[], Any]) -> float:
    fn()
    torch.cuda.synchronize()
    return round(do_bench_cudagraph(fn, rep=8) * 1000, 2)


def _name(config: Config) -> str:
    c = config
    return f"{c.block_m}x{c.block_n}x{c.block_k}w{c.num_warps}s{c.num_stages}"


def gemm_row(name: str, m: int) -> dict[str, Any]:
    n, k = SHAPES[name]
    w_q, w_scale = quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x_q, x_scale = quantize_rows(x)
    weight = (w_q.float() * w_scale[:, None]).bfloat16()
    one = torch.ones((), device="cuda")

    def scaled(fast: bool, rowwise: bool = True) -> Callable[[], Any]:
        sa, sb = (x_scale[:, None], w_scale[None, :]) if rowwise else (one, one)
        return lambda: torch._scaled_mm(x_q, w_q.t(), scale_a=sa, scale_b=sb,
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)  # fmt: skip

    row = {"shape": name, "m": m, "bf16": _micros(lambda: F.linear(x, weight)),
           "row": _micros(scaled(False)), "row_fast": _micros(scaled(True)),
           "tensor_fast": _micros(scaled(True, rowwise=False))}  # fmt: skip

    def ours(config: Config) -> Callable[[], torch.Tensor]:
        return lambda: fp8_gemm.scaled_mm(x_q, x_scale, w_q, w_scale, torch.bfloat16, config=config)

    reference = scaled(False)().float()
    triton_times = {}
    for config in (SMALL if m <= 128 else []) + (LARGE if m >= 64 else []):
        got = ours(config)().float()
        if float((got - reference).norm() / reference.norm()) > 1e-2:
            raise AssertionError(f"{_name(config)} computes a wrong product at {name} x {m}")
        triton_times[_name(config)] = _micros(ours(config))
    picked = fp8_gemm.pick_config(m, n, k)
    row["triton"] = triton_times
    row["picked"] = None if picked is None else _name(picked)
    row["picked_us"] = None if picked is None else _micros(ours(picked))
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
    parser.add_argument("--rows", default="1,16,64,256,2048,16384")
    parser.add_argument("--json", default=None, help="also write every row here")
    args = parser.parse_args()
    rows = []
    for name in SHAPES:
        for m in (int(r) for r in args.rows.split(",")):
            row = gemm_row(name, m)
            rows.append(row)
            best = min(row["triton"].items(), key=lambda kv: kv[1], default=None)
            print(name, m, {k: v for k, v in row.items() if k not in ("shape", "m", "triton")},
                  "best triton", best, flush=True)  # fmt: skip
    for m in (256, 4096):
        rows.append(fused_row(m))
        print(rows[-1], flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
