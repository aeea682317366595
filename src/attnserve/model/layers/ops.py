"""The model's per-device ops, each defined once with the choice of kernels that run it: the
fused Triton kernels (`fused_ops`, `fused_moe_routing`, `fused_moe`) on CUDA where Triton is
installed; the native CPU ops (`cpu_ops`) for float32 CPU tensors where their library loads;
else plain torch, which is also the others' reference (the same math with the same roundings).
ATTNSERVE_FUSED_OPS=0 keeps plain torch everywhere. The layers (`RMSNorm`, `SiluAndMul`,
`RotaryEmbedding`, the MoE block) call these and make no choice of their own; tests patch
`use_triton` here to send CPU tensors through Triton's interpreter.

The choice is plain Python, not `torch.library` custom ops: a CPU graph (`worker.graphs.cpu`)
records each native call and keeps the tensors allocated while it captures, and a custom op
would reach it as one opaque torch op with those allocations hidden inside; a CPU decode step's
ops also take microseconds, which a trip through the dispatcher would add to. The Triton
modules are imported on first use only, so CPU-only installs never import Triton.
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F

from attnserve.model.layers import cpu_ops
from attnserve.model.quantization.fp8 import quantize_rows
from attnserve.model.quantization.fp8_format import Fp8Activation

_FUSED = os.environ.get("ATTNSERVE_FUSED_OPS", "1") != "0"
_TRITON = _FUSED and importlib.util.find_spec("triton") is not None

NormWeight = tuple[torch.Tensor, float, bool]  # an RMSNorm's weight, eps and unit_offset


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on `x` runs its fused Triton kernel: on CUDA when Triton is installed."""
    return x.is_cuda and _TRITON


def use_native(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether an op on `x` (and `others`, its other tensor inputs) runs its native CPU op:
    float32 CPU tensors, where the ops' library loads."""
    return (
        _FUSED
        and x.device.type == "cpu"
        and all(t.dtype == torch.float32 for t in (x, *others))
        and cpu_ops.cpu_ops_library() is not None
    )


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    """`rms_norm` in torch: normalised in float32 (like HF's Llama norm), rounded to x's dtype,
    then scaled by the weight; with `unit_offset` as HF's Gemma norm: scaled by 1 + weight in
    float32, rounded to x's dtype once at the end."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x32 * (1.0 + weight.float())).to(dtype)
    return weight * x32.to(dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension (with `unit_offset`, Gemma's
    (1 + weight) * ...), a new tensor; `x` may be [T, H, D] heads (Qwen3's q/k norm)."""
    if use_triton(x):
        from attnserve.model.layers import fused_ops

        return fused_ops.rms_norm(x, weight, eps, unit_offset)
    if use_native(x) and not unit_offset:
        return cpu_ops.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps, unit_offset)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual` added to `x`, then normalised (`rms_norm`): (normed, the sum), new tensors."""
    if use_triton(x):
        from attnserve.model.layers import fused_ops

        return fused_ops.fused_add_rms_norm(x, residual, weight, eps, unit_offset)
    if use_native(x, residual) and not unit_offset:
        return cpu_ops.fused_add_rms_norm(x, residual, weight, eps)
    summed = x + residual
    return rms_norm_reference(summed, weight, eps, unit_offset), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] [..., 2*I] -> silu(gate) * up [..., I]."""
    if use_triton(x):
        from attnserve.model.layers import fused_ops

        return fused_ops.silu_and_mul(x)
    if use_native(x):
        return cpu_ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] [..., 2*I] -> gelu_tanh(gate) * up [..., I] (GeGLU, as HF's
    `gelu_pytorch_tanh` computes it)."""
    if use_triton(x):
        from attnserve.model.layers import fused_ops

        return fused_ops.gelu_tanh_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rms_norm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool = False,
) -> tuple[Fp8Activation, torch.Tensor | None]:
    """`rms_norm` of x (or, with `residual`, `fused_add_rms_norm`) quantized per row for an FP8
    linear layer: (the quantized rows, the sum when `residual` was added). One launch on CUDA
    for [T, N] rows in the weight's dtype; else the norm, then `quantize_rows`."""
    in_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    if use_triton(x) and x.dim() == 2 and weight.dtype == in_dtype:
        from attnserve.model.layers import fused_ops

        return fused_ops.rms_norm_fp8(x, residual, weight, eps, unit_offset)
    if residual is None:
        return Fp8Activation(*quantize_rows(rms_norm(x, weight, eps, unit_offset))), None
    normed, summed = fused_add_rms_norm(x, residual, weight, eps, unit_offset)
    return Fp8Activation(*quantize_rows(normed)), summed


def silu_and_mul_fp8(x: torch.Tensor) -> Fp8Activation:
    """`silu_and_mul` of [T, 2*I] rows quantized per row for an FP8 linear layer: one launch on
    CUDA, else the op then `quantize_rows` (the same bits either way)."""
    if use_triton(x):
        from attnserve.model.layers import fused_ops

        return fused_ops.silu_and_mul_fp8(x)
    return Fp8Activation(*quantize_rows(silu_and_mul(x)))


def gelu_tanh_and_mul_fp8(x: torch.Tensor) -> Fp8Activation:
    """`gelu_tanh_and_mul` quantized per row for an FP8 linear layer (as `silu_and_mul_fp8`)."""
    if use_triton(x):
        from attnserve.model.layers import fused_ops

        return fused_ops.gelu_tanh_and_mul_fp8(x)
    return Fp8Activation(*quantize_rows(gelu_tanh_and_mul(x)))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] float32; cos/sin [T, 1, D/2]."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, H*D] and key [T, Hkv*D] rotated ("rotate half") by their tokens' positions
    [T], in float32 from `cos_sin_cache` [positions, D] (cos then sin): new tensors."""
    if use_triton(query):
        from attnserve.model.layers import fused_rotary

        return fused_rotary.rotary_embedding(positions, query, key, cos_sin_cache, head_size)
    if use_native(query, key):
        return cpu_ops.rotary_embedding(positions, query, key, cos_sin_cache, head_size)
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    rotated = []
    for x in (query, key):
        heads = x.view(x.shape[0], -1, head_size).float()
        rotated.append(_rotate(heads, cos, sin).to(x.dtype).flatten(1))
    return rotated[0], rotated[1]


def qkv_rotary_embedding(
    positions: torch.Tensor,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cos_sin_cache: torch.Tensor,
    head_size: int,
    head_norms: tuple[NormWeight, NormWeight] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An attention layer's q, k, v [T, H*D] (splits of its qkv projection) ready for attention:
    q and k normalised per head by `head_norms` (Qwen3's or Gemma 3's q/k norm) when given,
    then rotated (`rotary_embedding`); v contiguous. One fused launch on CUDA (the norms'
    weights in q's dtype; the kernel takes q's eps and unit_offset for both), one native call on
    the CPU after the head norms, the separate ops elsewhere."""
    query, key, value = qkv
    if use_triton(query) and (head_norms is None or head_norms[0][0].dtype == query.dtype):
        from attnserve.model.layers import fused_rotary

        weights = None if head_norms is None else (head_norms[0][0], head_norms[1][0])
        _, eps, unit_offset = (None, 0.0, False) if head_norms is None else head_norms[0]
        return fused_rotary.qkv_rotary_embedding(
            positions, qkv, cos_sin_cache, head_size, weights, eps, unit_offset
        )
    if head_norms is not None:
        query, key = (
            rms_norm(x.reshape(x.shape[0], -1, head_size), weight, eps, offset).flatten(1)
            for (weight, eps, offset), x in zip(head_norms, (query, key), strict=True)
        )
    if use_native(query, key, value):
        return cpu_ops.rotary_embedding_qkv(
            positions, (query, key, value), cos_sin_cache, head_size
        )
    return (*rotary_embedding(positions, query, key, cos_sin_cache, head_size), value.contiguous())


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, top_k], expert ids int64 [T, top_k]) of the `top_k` most probable
    experts of each token, the weights renormalised to sum to 1 when asked (HF's routing)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts` with the weights in `weights_dtype` (one launch on CUDA)."""
    if use_triton(router_logits):
        from attnserve.model.layers.fused_moe_routing import fused_topk

        return fused_topk(router_logits, top_k, renormalize, weights_dtype)
    weights, ids = select_experts(router_logits, top_k, renormalize)
    return weights.to(weights_dtype), ids


def moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """`moe_experts` in plain torch, as HF computes it: expert by expert (in increasing id),
    each token's down output scaled by its weight and added into the result."""
    out = torch.zeros_like(hidden)
    flat = topk_ids.flatten()
    order = torch.sort(flat, stable=True).indices
    tokens = order // topk_ids.shape[1]
    weights = topk_weights.flatten()[order]
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows, scale = tokens[start : start + count], weights[start : start + count, None]
        gate, up = F.linear(hidden[rows], w13[expert]).chunk(2, dim=-1)
        down = F.linear(F.silu(gate) * up, w2[expert]) * scale
        out.index_add_(0, rows, down.to(out.dtype))
        start += count
    return out


def moe_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """hidden [T, H] through its tokens' routed experts (gate/up `w13` [E, 2*I, H], down `w2`
    [E, H, I]), each output weighted by `topk_weights` and summed over the top-k: [T, H]. The
    fused-MoE kernel on CUDA (`fused_moe.fused_experts`), `moe_reference` elsewhere."""
    if use_triton(hidden):
        from attnserve.model.layers.fused_moe import fused_experts

        return fused_experts(hidden, w13, w2, topk_weights, topk_ids)
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the torch MoE path (ATTNSERVE_FUSED_OPS=0) syncs with the host and cannot be "
            "captured in a CUDA graph: use enforce_eager=True with it"
        )
    return moe_reference(hidden, w13, w2, topk_weights, topk_ids)
