"""TRITON prefill: each source of the new tokens' keys (the paged cache, the step's K/V by plain
loads or by TMA descriptors) against dense causal attention, with and without cached context.

Runs on CUDA when present, else through the Triton interpreter on the CPU (conftest switches it
on); the reference is fp32 attention over the full K/V of each sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnserve.attention import get_backend_cls

BACKEND = get_backend_cls("TRITON")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if BACKEND.unavailable_reason() or DEVICE not in BACKEND.capabilities.devices:
    pytest.skip("TRITON does not run here", allow_module_level=True)

from attnserve.attention.ops.triton_common import AttentionParams, KernelConfig  # noqa: E402
from attnserve.attention.ops.triton_prefill import (  # noqa: E402
    FreshKeys,
    PrefillVariant,
    paged_prefill,
)

HEAD, HEADS, KV_HEADS, BLOCK = 64, 8, 2, 16
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16


class Step:
    """Sequences with `context` cached tokens and `new` tokens this step, on shuffled pages:
    the new tokens' q/k/v (back to back) and the cache holding every token's K/V."""

    def __init__(self, context: list[int], new: list[int]) -> None:
        gen = torch.Generator().manual_seed(sum(context) + 7 * sum(new))
        per_seq = -(-max(c + n for c, n in zip(context, new, strict=True)) // BLOCK)
        self.table = torch.randperm(len(new) * per_seq + 2, generator=gen)[: len(new) * per_seq]
        self.table = self.table.view(len(new), per_seq).to(torch.int32)
        self.cache = torch.zeros(len(new) * per_seq + 2, 2, KV_HEADS, BLOCK, HEAD, dtype=DTYPE)
        lengths = [c + n for c, n in zip(context, new, strict=True)]
        self.keys = [torch.randn(length, KV_HEADS, HEAD, generator=gen) for length in lengths]
        self.values = [torch.randn_like(k) for k in self.keys]
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            pos = torch.arange(k.shape[0])
            pages, offsets = self.table[i, pos // BLOCK].long(), pos % BLOCK
            self.cache[pages, 0, :, offsets] = k.to(DTYPE)  # [block, K/V, head, offset, dim]
            self.cache[pages, 1, :, offsets] = v.to(DTYPE)
        self.context, self.new = context, new
        self.q = torch.randn(sum(new), HEADS, HEAD, generator=gen)
        self.k_new = torch.cat([k[c:] for k, c in zip(self.keys, context, strict=True)])
        self.v_new = torch.cat([v[c:] for v, c in zip(self.values, context, strict=True)])
        self.starts = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
        self.seq_lens = torch.tensor(lengths, dtype=torch.int32)

    def reference(self) -> torch.Tensor:
        outs = []
        for i, (c, n) in enumerate(zip(self.context, self.new, strict=True)):
            q = self.q[self.starts[i] : self.starts[i + 1]].transpose(0, 1)
            k = self.keys[i].to(DTYPE).float().repeat_interleave(HEADS // KV_HEADS, 1)
            v = self.values[i].to(DTYPE).float().repeat_interleave(HEADS // KV_HEADS, 1)
            mask = torch.arange(c + n)[None, :] <= (c + torch.arange(n))[:, None]
            out = F.scaled_dot_product_attention(
                q.to(DTYPE).float(), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
            )
            outs.append(out.transpose(0, 1))
        return torch.cat(outs)

    def run(self, fresh: FreshKeys, config: KernelConfig | None = None) -> torch.Tensor:
        def dev(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(DEVICE, DTYPE if tensor.is_floating_point() else tensor.dtype)

        out = torch.full_like(dev(self.q), float("nan"))
        paged_prefill(
            dev(self.q), dev(self.k_new), dev(self.v_new), dev(self.cache), dev(self.table),
            dev(self.seq_lens), dev(self.starts), max(self.new), out,
            AttentionParams(scale=HEAD**-0.5), config, PrefillVariant(fresh_keys=fresh),
            max_context_len=max(self.context),
        )  # fmt: skip
        return out.float().cpu()


TOLERANCE = 2e-2 if DEVICE == "cuda" else 1e-4


@pytest.mark.parametrize("fresh", ["cache", "pointers", "tma"])
@pytest.mark.parametrize(("context", "new"), [([0, 0], [37, 70]), ([37, 5, 0], [21, 40, 3])])
def test_every_key_source_matches_dense_attention(
    fresh: FreshKeys, context: list[int], new: list[int]
) -> None:
    if fresh == "tma" and DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9")
    step = Step(context, new)
    got = step.run(fresh, KernelConfig(block_m=32, block_n=16, num_warps=4, num_stages=1))
    assert not got.isnan().any(), "rows left unwritten"
    torch.testing.assert_close(got, step.reference(), atol=TOLERANCE, rtol=TOLERANCE)


def test_keys_from_the_step_need_a_plain_call() -> None:
    step = Step([5], [9])
    q, k, v = (t.to(DEVICE, DTYPE) for t in (step.q, step.k_new, step.v_new))
    with pytest.raises(ValueError, match="fresh_keys='tma' needs"):
        paged_prefill(
            q, k, v, step.cache.to(DEVICE), step.table.to(DEVICE), step.seq_lens.to(DEVICE),
            step.starts.to(DEVICE), 9, torch.empty_like(q),
            AttentionParams(scale=0.1, soft_cap=30.0), variant=PrefillVariant(fresh_keys="tma"),
        )  # fmt: skip
