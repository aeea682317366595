"""Time the TRITON backend's kernels on a CUDA GPU, for tuning (not the general bench command).

Decode: TB/s of KV bytes read (K and V once), beside a device-to-device copy (bytes read +
written). Prefill: TFLOP/s with the causal half counted, beside torch SDPA on contiguous
tensors. Each figure is the median of triton.testing.do_bench. Every timed configuration is
first checked against a torch reference. Usage (from the repository root):
PYTHONPATH=src python scripts/bench_triton_kernels.py [--sweep] [--only KERNEL] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
import triton

from attnserve.attention.ops.triton_cache import reshape_and_cache
from attnserve.attention.ops.triton_common import AttentionParams, KernelConfig
from attnserve.attention.ops.triton_decode import choose_num_splits, num_sms, paged_decode
from attnserve.attention.ops.triton_prefill import paged_prefill

DECODE_SHAPES = [(64, 2048, 32, 8), (256, 1024, 16, 8), (16, 8192, 32, 8)]  # B, ctx, Hq, Hkv
PREFILL_SHAPES = [(4, 4096, 32, 8), (16, 1024, 32, 8)]  # B, L, Hq, Hkv
HEAD, BLOCK, DTYPE = 128, 16, torch.bfloat16
DECODE_SWEEP = [KernelConfig(16, n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
PREFILL_SWEEP = [
    KernelConfig(128, 64, 8, 3),
    KernelConfig(128, 128, 8, 3),
    KernelConfig(128, 32, 4, 4),
    KernelConfig(64, 64, 4, 3),
    KernelConfig(256, 32, 8, 3),
]


def median_ms(fn: object) -> float:
    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def paged_kv(batch: int, length: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache holding `length` random tokens per sequence on shuffled blocks, and its table."""
    per_seq = -(-length // BLOCK)
    blocks = torch.randperm(batch * per_seq, device="cuda").view(batch, per_seq)
    cache = torch.randn(batch * per_seq, 2, kv_heads, BLOCK, HEAD, device="cuda", dtype=DTYPE)
    return cache, blocks.to(torch.int32)


def gather_kv(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """[B, 2, Hkv, L, D] dense copy of the paged cache (the reference's input)."""
    pages = cache[table.long()]  # [B, nb, 2, Hkv, bs, D]
    dense = pages.permute(0, 2, 3, 1, 4, 5).flatten(3, 4)
    return dense[:, :, :, :length]


def copy_tbps() -> float:
    src = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / median_ms(lambda: dst.copy_(src)) / 1e9


def bench_decode(
    shape: tuple[int, int, int, int], sweep: bool, extra_splits: list[int]
) -> list[dict[str, object]]:
    batch, length, heads, kv_heads = shape
    cache, table = paged_kv(batch, length, kv_heads)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, HEAD, device="cuda", dtype=DTYPE)
    params = AttentionParams(scale=HEAD**-0.5)
    kv = gather_kv(cache, table, length).float().repeat_interleave(heads // kv_heads, dim=2)
    want = F.scaled_dot_product_attention(q.float()[:, :, None], kv[:, 0], kv[:, 1])[:, :, 0]
    auto = choose_num_splits(batch, kv_heads, length, num_sms(q.device))
    runs: list[tuple[KernelConfig | None, int]] = [(None, auto)]
    if sweep:
        runs += [(cfg, auto) for cfg in DECODE_SWEEP]
        runs += [(None, s) for s in (1, 2, 4, 8, 16) if s != auto]
    runs += [(None, s) for s in extra_splits if s != auto]
    kv_bytes = 2 * batch * length * kv_heads * HEAD * cache.element_size()
    rows = []
    for cfg, splits in runs:
        out = torch.full_like(q, float("nan"))

        def run(
            cfg: KernelConfig | None = cfg, splits: int = splits, out: torch.Tensor = out
        ) -> None:
            paged_decode(q, cache, table, seq_lens, out, params, splits, cfg)

        run()
        err = float((out.float() - want).abs().max())
        ms = median_ms(run)
        rows.append(
            {"kernel": "decode", "shape": shape, "config": str(cfg or "default"), "splits": splits,
             "max_err": err, "us": ms * 1e3, "TB/s": kv_bytes / ms / 1e9}
        )  # fmt: skip
    return rows


def bench_prefill(shape: tuple[int, int, int, int], sweep: bool) -> list[dict[str, object]]:
    batch, length, heads, kv_heads = shape
    cache, table = paged_kv(batch, length, kv_heads)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    starts = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * length
    q = torch.randn(batch * length, heads, HEAD, device="cuda", dtype=DTYPE)
    params = AttentionParams(scale=HEAD**-0.5)
    flops = 4 * batch * length * length * heads * HEAD / 2
    kv = gather_kv(cache, table, length).repeat_interleave(heads // kv_heads, dim=2)
    q4 = q.view(batch, length, heads, HEAD).transpose(1, 2).contiguous()
    k4, v4 = kv[:, 0].contiguous(), kv[:, 1].contiguous()
    want = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)
    sdpa_ms = median_ms(lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True))
    rows: list[dict[str, object]] = [
        {"kernel": "sdpa", "shape": shape, "config": "contiguous", "max_err": 0.0,
         "us": sdpa_ms * 1e3, "TFLOP/s": flops / sdpa_ms / 1e9}
    ]  # fmt: skip
    for cfg in [None, *(PREFILL_SWEEP if sweep else [])]:
        out = torch.full_like(q, float("nan"))

        def run(cfg: KernelConfig | None = cfg, out: torch.Tensor = out) -> None:
            paged_prefill(q, None, None, cache, table, seq_lens, starts, length, out, params, cfg)

        run()
        got = out.view(batch, length, heads, HEAD).transpose(1, 2)
        err = float((got.float() - want.float()).abs().max())
        ms = median_ms(run)
        rows.append(
            {"kernel": "prefill", "shape": shape, "config": str(cfg or "default"),
             "max_err": err, "us": ms * 1e3, "TFLOP/s": flops / ms / 1e9}
        )  # fmt: skip
    return rows


def bench_cache_write() -> dict[str, object]:
    tokens, kv_heads = 16384, 8
    cache = torch.empty(tokens // BLOCK + 1, 2, kv_heads, BLOCK, HEAD, device="cuda", dtype=DTYPE)
    key = torch.randn(tokens, kv_heads, HEAD, device="cuda", dtype=DTYPE)
    slots = torch.randperm(tokens, device="cuda")
    ms = median_ms(lambda: reshape_and_cache(key, key, cache, slots))
    return {"kernel": "cache_write", "tokens": tokens, "us": ms * 1e3,
            "TB/s": 4 * key.numel() * key.element_size() / ms / 1e9}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true", help="also time other tile configs")
    parser.add_argument("--only", choices=["decode", "prefill"], help="time one kernel only")
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--splits", default="", help="decode split counts to time, e.g. 2,4,8")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list[dict[str, object]] = [{"kernel": "copy", "TB/s": copy_tbps()}]
    for shape in DECODE_SHAPES if args.only != "prefill" else []:
        rows += bench_decode(shape, args.sweep, [int(s) for s in args.splits.split(",") if s])
    for shape in PREFILL_SHAPES if args.only != "decode" else []:
        rows += bench_prefill(shape, args.sweep)
    rows.append(bench_cache_write())
    device = torch.cuda.get_device_name()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": device, "rows": rows}, handle, indent=1, default=str)
    print(device, "torch", torch.__version__, "triton", triton.__version__)
    for row in rows:
        print(" ".join(f"{k}={_fmt(v)}" for k, v in row.items()))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if math.isfinite(value) else str(value)
    return str(value).replace(" ", "")


if __name__ == "__main__":
    main()
