"""The batched LoRA products of one projection, every row with its own adapter (Punica's
shrink/expand in plain torch): out[t] += (x[t] A[s_t]^T) B[s_t]^T for each token t whose slot
s_t >= 0 (-1: the base model only).

The adapters sit in stacked buffers: `lora_a` [slots, S·R, in] (the S slices of a merged
projection, each R = max_lora_rank rows, zero-padded), `lora_b` [slots, out, R] with the
adapter's scaling folded in, and `col_slice` [out] naming the slice each output column belongs
to. This is the CPU path and the kernels' reference: it groups the rows by slot (a host sync).
On CUDA `triton_ops` computes the same in two launches, with no sync, so graphs capture it.
"""

from __future__ import annotations

import torch


def add_lora_torch(
    x: torch.Tensor,
    out: torch.Tensor,
    indices: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slices: list[tuple[int, int]],
) -> torch.Tensor:
    """`out` [T, out] with each row's adapter product added in place (`slices`: each slice's
    (first output column, width))."""
    rank = lora_b.shape[-1]
    for slot in indices.unique().tolist():
        if slot < 0:
            continue
        rows = (indices == slot).nonzero().squeeze(1)
        shrunk = x.index_select(0, rows).to(lora_a.dtype) @ lora_a[slot].t()
        delta = torch.empty(len(rows), out.shape[1], dtype=shrunk.dtype, device=out.device)
        for j, (start, width) in enumerate(slices):
            part = shrunk[:, j * rank : (j + 1) * rank]
            delta[:, start : start + width] = part @ lora_b[slot, start : start + width].t()
        out.index_add_(0, rows, delta.to(out.dtype))
    return out
