"""A Triton FP8 GEMM with scales applied in float32: `out = (a * sa) (b * sb)^T`, E4M3 inputs.

`a` [M, K] holds quantized activations, `b` [N, K] a weight (row-major, as the linear layers
keep it). Scales come in one of two granularities:
- row-wise (`group` None): `sa` [M] per token, `sb` [N] per output row; the float32
  accumulator of the whole K loop is scaled once in the epilogue (what `torch._scaled_mm`'s
  row-wise mode computes);
- group-wise (`group` G): `sa` [M, K / G] per token and group of G columns, `sb` [N, K / G]
  per row and group (a block-wise checkpoint's [N / 128, K / 128] scales kept per row), either
  in any strides (`fp8_quant.quantize_groups` writes column-major ones); each K block's partial
  product is scaled as it is added (DeepSeek's w8a8 block scheme).

One program computes a BLOCK_M x BLOCK_N tile, programs ordered in groups of GROUP_M row
tiles so that neighbours share the weight tiles in L2. K must be a multiple of BLOCK_K (and
BLOCK_K divide the group), so the K loop needs no masks; rows past M and N are clamped on load
and masked on store. Split-K (`GemmConfig.split_k` S > 1) gives each tile S programs, each
over one of S equal slices of K (K a multiple of S x BLOCK_K): they write float32 partial sums
to a workspace [S, M, N], and a second launch adds the S slices in order and, for row-wise
scales, scales the sum, so the epilogue is the unsplit one's (and the result deterministic). At
decode sizes a weight of 4096 rows makes too few tiles to keep the 132 SMs reading it; split-K
multiplies the programs. (Partial sums added by float32 atomics into a zeroed buffer, then
scaled, were slower on every shape measured: docs/benchmarks-archive.md.) `fp8.fp8_matmul` runs
it with the tile `pick_config` picks for M, N and K (where it is the faster GEMM); other callers
may pass a tile or take the default: `group_config` for group-wise scales, else `default_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class GemmConfig:
    """A tile shape: BLOCK_M x BLOCK_N output tiles, K in blocks of BLOCK_K, and `split_k`
    programs a tile, each over its slice of K."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    split_k: int = 1


@triton.jit
def _scaled_mm_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    b_ptr,
    out_ptr,
    a_scale_ptr,
    b_scale_ptr,
    M,
    N,
    K,
    stride_a,
    stride_b,
    stride_out,
    stride_a_scale,
    stride_a_group,
    stride_b_scale,
    stride_b_group,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
) -> None:
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    load_rows = tl.max_contiguous(tl.multiple_of(rows % M, BLOCK_M), BLOCK_M).to(tl.int64)
    load_cols = tl.max_contiguous(tl.multiple_of(cols % N, BLOCK_N), BLOCK_N).to(tl.int64)
    k_blocks = K // (BLOCK_K * SPLIT_K)
    k_start = tl.program_id(1) * k_blocks * BLOCK_K
    ks = k_start + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + load_rows[:, None] * stride_a + ks[None, :]
    b_ptrs = b_ptr + load_cols[None, :] * stride_b + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_blocks):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        if GROUP_K == 0:
            acc = tl.dot(a, b, acc)
        else:
            group = (k_start + k * BLOCK_K) // GROUP_K
            sa = tl.load(a_scale_ptr + load_rows * stride_a_scale + group * stride_a_group)
            sb = tl.load(b_scale_ptr + load_cols * stride_b_scale + group * stride_b_group)
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    if SPLIT_K == 1:
        if GROUP_K == 0:
            sa = tl.load(a_scale_ptr + load_rows)
            sb = tl.load(b_scale_ptr + load_cols)
            acc = acc * sa[:, None] * sb[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs + tl.program_id(1).to(tl.int64) * M * N, acc, mask=mask)


@triton.jit
def _split_k_sum_kernel(  # type: ignore[no-untyped-def]
    partial_ptr,
    out_ptr,
    a_scale_ptr,
    b_scale_ptr,
    M,
    N,
    stride_out,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    ROW_SCALES: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.load(partial_ptr + row * N + cols, mask=mask)
    for split in tl.static_range(1, SPLIT_K):
        acc += tl.load(partial_ptr + (split * M + row) * N + cols, mask=mask)
    if ROW_SCALES:  # group-wise partial sums are scaled in the K loop already
        sa = tl.load(a_scale_ptr + row)
        sb = tl.load(b_scale_ptr + cols, mask=mask)
        acc = acc * sa * sb
    tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def default_config(m: int, block_k: int) -> GemmConfig:
    """A tile shape for M rows (block-wise products: K blocks of `block_k`)."""
    if m <= 16:
        return GemmConfig(16, 64, block_k, 4, 4)
    if m <= 64:
        return GemmConfig(64, 64, block_k, 4, 4)
    return GemmConfig(128, 128, block_k, 8, 4)


SMS = 132  # the H200's multiprocessors, for which pick_config's tiles were measured
# Tiles of 64+ rows (wgmma) for 17-256 rows, narrow weights (N < 16,384): each with as many
# pipeline stages as shared memory holds for the programs an SM runs at once (its second value).
WAVE_TILES = (
    (GemmConfig(64, 64, 256, 4, 5), 1),
    (GemmConfig(64, 64, 128, 4, 5), 2),
    (GemmConfig(64, 128, 128, 4, 4), 2),
    (GemmConfig(128, 256, 128, 8, 4), 1),
)


def _one_wave(config: GemmConfig, per_sm: int, m: int, n: int, k: int) -> GemmConfig | None:
    """`config` with K split into as many slices (a power of two up to 8, of 1,024+ columns)
    as one wave of programs (`per_sm` on each of the SMS) holds; None where its tiles alone
    overfill that wave or K is not a multiple of its K blocks."""
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    if tiles > per_sm * SMS or k % config.block_k:
        return None
    split = 1
    while (split < 8 and 2 * split * tiles <= per_sm * SMS and k // (2 * split) >= 1024
           and k % (2 * split * config.block_k) == 0):  # fmt: skip
        split *= 2
    return replace(config, split_k=split)


def group_config(m: int, n: int, k: int, group: int) -> GemmConfig:
    """The tile for a group-wise product (`group` columns a scale): `pick_config`'s, its K blocks
    no wider than a group (the H200 probe of block-wise 128 x 128 layers,
    docs/benchmarks-archive.md: up to 16 rows within 1-1.1x of the fastest tile timed), else
    `default_config`'s."""
    block_k = min(128, group & -group)  # a power of two dividing the group
    picked = pick_config(m, n, k)
    if picked is None:
        return default_config(m, block_k)
    return replace(picked, block_k=min(picked.block_k, block_k))


def pick_config(m: int, n: int, k: int) -> GemmConfig | None:
    """The tile shape for an [m, k] x [k, n] row-scaled product, up to 256 rows, where this
    kernel is the faster GEMM, from the H200 sweep of Llama-3-8B's four projections at 1-256
    rows (docs/benchmarks.md: 1.0-2.1x `torch._scaled_mm`'s row-wise GEMM, which takes ~14 us
    even for a 4096 x 4096 weight that takes 4 us to read; tied for gate_up at 128 rows), else
    None (beyond 256 rows they tie, or the row-wise one wins). Wide weights take 64 x 128
    tiles at 17-64 and 129-192 rows (at 144 and 192 rows 50-51 us for gate_up, against 56-59
    for the 128 x 256 tile that 65-128 and 193-256 rows take). Up to 16 rows: 16 x 64 tiles
    split over K up to one wave of 4 programs an SM; up to 256: the first of
    `WAVE_TILES` that fills one wave of programs with K slices of at most 4,096 columns. Wide
    weights (N >= 16,384: already enough tiles) are never split."""
    if m > 256:
        return None
    if n >= 16384:
        if m <= 16:
            wide = GemmConfig(16, 128, 128, 8, 4)
        elif m <= 64 or 128 < m <= 192:
            wide = GemmConfig(64, 128, 128, 4, 3)
        elif m <= 128:
            wide = GemmConfig(128, 256, 128, 8, 4)
        else:
            wide = GemmConfig(128, 256, 128, 8, 3)
        return wide if k % wide.block_k == 0 else None
    if m <= 16:
        return _one_wave(GemmConfig(16, 64, 128, 8, 4), 4, m, n, k)
    for tile, per_sm in WAVE_TILES:
        config = _one_wave(tile, per_sm, m, n, k)
        if config is not None and k // config.split_k <= 4096:
            return config
    return None


def scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    group: int | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """(a * a_scale) @ (b * b_scale)^T in `out_dtype` (see the module docstring for the scales'
    shapes); a [M, K] and b [N, K] E4M3 with unit column stride."""
    m, k = a.shape
    n = b.shape[0]
    config = config or (default_config(m, 128) if group is None else group_config(m, n, k, group))
    split = config.split_k
    if k % (config.block_k * split) or (group is not None and group % config.block_k):
        raise ValueError(
            f"fp8 GEMM: K={k} (group {group}) is not a multiple of {config.block_k * split}"
        )
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    a_scale2 = a_scale.reshape(m, -1)
    b_scale2 = b_scale.reshape(n, -1)
    partial = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), split)
    _scaled_mm_kernel[grid](
        a, b, partial, a_scale2, b_scale2, m, n, k,
        a.stride(0), b.stride(0), partial.stride(-2), *a_scale2.stride(), *b_scale2.stride(),
        GROUP_K=group or 0, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, SPLIT_K=split,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _split_k_sum_kernel[(m, triton.cdiv(n, block))](
            partial, out, a_scale2, b_scale2, m, n, out.stride(0),
            SPLIT_K=split, BLOCK=block, ROW_SCALES=group is None, num_warps=4,
        )  # fmt: skip
    return out
