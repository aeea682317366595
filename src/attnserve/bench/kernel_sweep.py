"""`attnserve bench kernels --sweep decode,prefill`: tile and split-count sweeps of attnserve's
own Triton attention kernels (the kernel library in attention/ops), for tuning their defaults.

Unlike the backend comparison (bench/kernels.py), a sweep calls the kernels directly, since
tiles, split counts and key sources are the kernels' own launch choices. Every run is first
checked against fp32 attention on the same paged cache (pages shuffled over the pool): one that
fails to compile, runs out of resources or is off by more than `atol` is reported with the
reason and not timed. Timing is kernels.py's (`median_us`); decode runs are replays of a CUDA
graph of the call, as the engine runs decode, prefill runs are eager.

- decode: at the split count the kernel plans for the shape, every tile of DECODE_TILES; at the
  default tile, every split count asked for. TB/s of KV read (in the cache's bytes: an fp8
  cache's are half of bf16's), and the fraction of the copy bandwidth.
- prefill (prompts only, no cached context): SDPA on contiguous tensors, the kernel's own
  choice, then each (source of the new tokens' keys, tile) of PREFILL_GRID. TFLOP/s counting
  the causal half, and the fraction of SDPA.

The time budget is split evenly over the shapes (time a shape leaves unused carries on); runs
that would start past a shape's share are skipped, so a sweep ends about one compile after it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from attnserve.attention.ops.triton_common import AttentionParams, KernelConfig
from attnserve.attention.ops.triton_decode import choose_num_splits, num_sms, paged_decode
from attnserve.attention.ops.triton_prefill import FreshKeys, PrefillVariant, paged_prefill
from attnserve.bench.kernel_common import (
    BLOCK_SIZE,
    DECODE_SHAPES,
    DEVICE,
    DTYPE,
    HEAD_SIZE,
    PREFILL_SHAPES,
    SDPA_BASELINE,
    as_graph,
    median_us,
)

Shape = tuple[int, int, int, int]  # batch, tokens per sequence, query heads, KV heads
DECODE_TILES = [
    KernelConfig(16, n, w, s) for n in (32, 64, 128) for w in (2, 4, 8) for s in (2, 3, 4, 5)
]
PREFILL_GRID: list[tuple[FreshKeys, KernelConfig]] = [
    ("cache", KernelConfig(256, 64, 8, 3)),
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


@dataclass(frozen=True)
class Setup:
    """What every run of a sweep shares."""

    head_size: int = HEAD_SIZE
    block_size: int = BLOCK_SIZE
    dtype: torch.dtype = DTYPE
    device: str = DEVICE
    kv_cache_dtype: str = "auto"  # "fp8": the cache holds e4m3 bytes (unit scales)
    atol: float = 0.05  # largest abs error against fp32 attention for a run to be timed
    calls: int = 10  # `median_us`'s calls per timed batch, and batches
    repeats: int = 10

    @property
    def params(self) -> AttentionParams:
        return AttentionParams(scale=self.head_size**-0.5)


@dataclass
class SweepRow:
    kind: str  # "decode" or "prefill"
    shape: str
    config: str  # tile (rows x keys, warps, stages) and split count or key source
    status: str  # "ok", or why the run was not timed
    max_err: float | None = None
    median_us: float | None = None
    rate: float | None = None  # TB/s (decode) or TFLOP/s (prefill)
    vs_baseline: float | None = None  # fraction of the copy bandwidth / of SDPA
    default: bool = False  # the kernel's own choice for this shape


def paged_cache(
    batch: int, length: int, kv_heads: int, setup: Setup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K/V of `length` tokens per sequence in the kernels' layout [blocks, 2 (K, V),
    KV heads, block size, head size] (rounded to e4m3 for an fp8 cache), on shuffled pages, and
    the block table [B, pages]."""
    pages = -(-length // setup.block_size)
    table = torch.randperm(batch * pages, device=setup.device).view(batch, pages)
    shape = (batch * pages, 2, kv_heads, setup.block_size, setup.head_size)
    cache = torch.randn(shape, device=setup.device, dtype=setup.dtype)
    if setup.kv_cache_dtype == "fp8":
        cache = cache.to(torch.float8_e4m3fn)
    return cache, table.to(torch.int32)


def dense_kv(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """[B, 2, KV heads, length, head size]: each sequence's K/V gathered from its pages."""
    pages = cache[table.long()]  # [B, pages, 2, Hkv, block, D]
    return pages.permute(0, 2, 3, 1, 4, 5).flatten(3, 4)[:, :, :, :length]


def shape_name(shape: Shape) -> str:
    batch, length, heads, kv_heads = shape
    return f"{batch}x{length} {heads}/{kv_heads}"


def tile_name(config: KernelConfig | None) -> str:
    if config is None:
        return "default tile"
    return f"{config.block_m}x{config.block_n} w{config.num_warps} s{config.num_stages}"


def check_and_time(
    call: Callable[[], object], out: torch.Tensor, want: torch.Tensor, setup: Setup, graph: bool
) -> tuple[str, float | None, float | None]:
    """(status, max abs error, µs) of one run: checked against `want` first, then timed."""
    try:
        call()
        err = float((out.float() - want).abs().max())
        if not err <= setup.atol:
            return f"wrong: max err {err:.3g} > {setup.atol}", err, None
        timed = as_graph(call) if graph else call
        return "ok", err, median_us(timed, setup.calls, setup.repeats, setup.device)
    except Exception as error:  # compile errors, out of resources, ptxas crashes
        reason = (str(error).strip().splitlines() or [""])[0][:160]
        return f"failed: {type(error).__name__}: {reason}", None, None


@dataclass(frozen=True)
class Run:
    """One kernel configuration to check and time: `kernel(out=...)` writes into `out`."""

    kernel: Callable[..., object]
    like: torch.Tensor  # the output's shape and dtype
    want: torch.Tensor  # the fp32 reference
    graph: bool = True  # timed as CUDA-graph replays on CUDA


def measure(
    row: SweepRow, run: Run, setup: Setup, deadline: float, work: float, baseline: float
) -> SweepRow:
    """Fill `row`: skipped past the deadline, else checked and timed; its rate is `work` (bytes
    or FLOPs) per second in units of 1e12, and its share of `baseline` at that rate."""
    if time.monotonic() > deadline:
        row.status = "skipped: time budget spent"
        return row
    out = torch.full_like(run.like, float("nan"))
    graph = run.graph and torch.device(setup.device).type == "cuda"
    call = partial(run.kernel, out=out)
    row.status, row.max_err, row.median_us = check_and_time(call, out, run.want, setup, graph)
    if row.median_us is not None:
        row.rate = work / row.median_us / 1e6
        row.vs_baseline = row.rate / baseline
    return row


def sweep_decode(
    shape: Shape,
    splits: list[int],
    tiles: list[KernelConfig],
    copy_tbs: float,
    setup: Setup,
    deadline: float,
) -> list[SweepRow]:
    """One new token per sequence over `length` cached ones (module docstring)."""
    batch, length, heads, kv_heads = shape
    cache, table = paged_cache(batch, length, kv_heads, setup)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device=setup.device)
    q = torch.randn(batch, heads, setup.head_size, device=setup.device, dtype=setup.dtype)
    kv = dense_kv(cache, table, length).float().repeat_interleave(heads // kv_heads, dim=2)
    want = F.scaled_dot_product_attention(q.float()[:, :, None], kv[:, 0], kv[:, 1])[:, :, 0]
    sms = num_sms(torch.device(setup.device))
    planned = choose_num_splits(batch, kv_heads, length, sms, setup.kv_cache_dtype == "fp8")
    runs: list[tuple[KernelConfig | None, int]] = [(None, planned)]
    runs += [(tile, planned) for tile in tiles]
    runs += [(None, n) for n in splits if n != planned]
    kv_bytes = 2 * batch * length * kv_heads * setup.head_size * cache.element_size()
    rows = []
    for tile, num_splits in runs:
        row = SweepRow("decode", shape_name(shape), f"{tile_name(tile)}, {num_splits} splits", "")
        row.default = tile is None and num_splits == planned
        call = partial(paged_decode, q, cache, table, seq_lens)
        run = Run(partial(call, params=setup.params, num_splits=num_splits, config=tile), q, want)
        rows.append(measure(row, run, setup, deadline, kv_bytes, copy_tbs))
    return rows


def sweep_prefill(
    shape: Shape, grid: list[tuple[FreshKeys, KernelConfig]], setup: Setup, deadline: float
) -> list[SweepRow]:
    """Causal prefill of whole prompts of `length` tokens (module docstring)."""
    batch, length, heads, kv_heads = shape
    tokens, dim = batch * length, setup.head_size
    cache, table = paged_cache(batch, length, kv_heads, setup)
    dense = dense_kv(cache, table, length).to(setup.dtype)
    key, value = dense.permute(1, 0, 3, 2, 4).reshape(2, tokens, kv_heads, dim).unbind(0)
    key, value = key.contiguous(), value.contiguous()  # the new tokens' K/V, also in the cache
    q = torch.randn(tokens, heads, dim, device=setup.device, dtype=setup.dtype)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device=setup.device)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=setup.device) * length
    q4 = q.view(batch, length, heads, dim).transpose(1, 2).contiguous()
    kv = dense.repeat_interleave(heads // kv_heads, dim=2)
    k4, v4 = kv[:, 0].contiguous(), kv[:, 1].contiguous()

    def as_rows(attention: torch.Tensor) -> torch.Tensor:  # [B, H, L, D] -> [B * L, H, D]
        return attention.transpose(1, 2).reshape(tokens, heads, dim)

    fp32 = (q4.float(), k4.float(), v4.float())
    want = as_rows(F.scaled_dot_product_attention(*fp32, is_causal=True))
    flops = 2.0 * batch * heads * length * length * dim
    sdpa = partial(F.scaled_dot_product_attention, q4, k4, v4, is_causal=True)
    sdpa_err = float((as_rows(sdpa()).float() - want).abs().max())
    sdpa_us = median_us(sdpa, setup.calls, setup.repeats, setup.device)
    sdpa_tflops = flops / sdpa_us / 1e6
    name = shape_name(shape)
    rows = [SweepRow("prefill", name, SDPA_BASELINE, "ok", sdpa_err, sdpa_us, sdpa_tflops, 1.0)]
    runs: list[tuple[FreshKeys | None, KernelConfig | None]] = [(None, None), *grid]
    for fresh, tile in runs:
        label = f"{tile_name(tile)}, keys: {fresh or 'default'}"
        row = SweepRow("prefill", name, label, "", default=tile is None and fresh is None)
        call = partial(paged_prefill, q, key, value, cache, table, seq_lens, starts, length)
        variant = PrefillVariant(fresh_keys=fresh)
        kernel = partial(call, params=setup.params, config=tile, variant=variant, max_context_len=0)
        rows.append(
            measure(row, Run(kernel, q, want, graph=False), setup, deadline, flops, sdpa_tflops)
        )
    return rows


def run_sweeps(
    sweeps: list[str], splits: list[int], budget_s: float, copy_tbs: float, setup: Setup
) -> list[SweepRow]:
    """The asked-for sweeps over bench/kernels.py's shapes, within `budget_s` seconds."""
    jobs: list[Callable[[float], list[SweepRow]]] = []
    if "decode" in sweeps:
        for shape in DECODE_SHAPES:
            jobs.append(partial(sweep_decode, shape, splits, DECODE_TILES, copy_tbs, setup))
    if "prefill" in sweeps:
        jobs += [partial(sweep_prefill, shape, PREFILL_GRID, setup) for shape in PREFILL_SHAPES]
    started, rows = time.monotonic(), []
    for index, job in enumerate(jobs):
        rows += job(started + budget_s * (index + 1) / len(jobs))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def format_sweep(rows: list[SweepRow]) -> str:
    """Per shape, the runs fastest first (* the kernel's own choice), then the best one."""
    lines = []
    for kind, shape in dict.fromkeys((row.kind, row.shape) for row in rows):
        unit = "TB/s" if kind == "decode" else "TFLOP/s"
        base = "of copy" if kind == "decode" else "of SDPA"
        lines.append(f"\n{kind} {shape}: {'config':<38} {'µs':>9} {unit:>8} {base:>8} max err")
        group = [row for row in rows if (row.kind, row.shape) == (kind, shape)]
        for row in sorted(group, key=lambda r: r.median_us or math.inf):
            mark = "*" if row.default else " "
            if row.median_us is None or row.rate is None:
                lines.append(f"  {mark} {row.config:<38} {row.status}")
                continue
            ratio = "-" if row.vs_baseline is None else f"{row.vs_baseline:.1%}"
            err = "-" if row.max_err is None else f"{row.max_err:.3g}"
            lines.append(
                f"  {mark} {row.config:<38} {row.median_us:>9.1f} {row.rate:>8.2f} {ratio:>8} {err}"
            )
        timed = [row for row in group if row.median_us is not None and row.config != SDPA_BASELINE]
        if timed:
            best = min(timed, key=lambda r: r.median_us or math.inf)
            lines.append(f"  best: {best.config} ({best.rate:.2f} {unit})")
    return "\n".join(lines)
