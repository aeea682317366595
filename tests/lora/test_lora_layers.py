"""The batched LoRA products: the Triton shrink/expand kernels (Triton's interpreter on the CPU)
and the grouped torch path against a per-row float64 reference, merged slices included; and a
projection's `LoRALinear` split over two ranks as its base weight is, against the whole layer."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # already so via conftest; import-order proof

from attnserve.lora.layers import (  # noqa: E402
    LoRAIndices,
    LoRALinear,
    column_slices,
)
from attnserve.lora.peft import LoRAWeights  # noqa: E402
from attnserve.lora.punica import add_lora_torch  # noqa: E402
from attnserve.model.layers.linear import QKVParallelLinear, RowParallelLinear  # noqa: E402
from tests.distributed.test_parallel_layers import as_rank  # noqa: E402

SLOTS, RANK = 3, 8
SLICES = [(0, 24), (24, 8), (32, 8)]  # q, k, v widths of a merged projection


def _stacks(dtype: torch.dtype, seed: int, inputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lora_a = torch.randn(SLOTS, len(SLICES) * RANK, inputs, generator=gen) / inputs**0.5
    lora_a = lora_a.to(dtype)
    lora_b = torch.randn(SLOTS, 40, RANK, generator=gen).to(dtype)
    return lora_a.to(DEVICE), lora_b.to(DEVICE)


def _reference(
    x: torch.Tensor, base: torch.Tensor, slots: list[int], a: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    out = base.double().clone()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        for j, (start, width) in enumerate(SLICES):
            shrunk = x[t].double() @ a[slot, j * RANK : (j + 1) * RANK].double().t()
            out[t, start : start + width] += shrunk @ b[slot, start : start + width].double().t()
    return out


# a block mixing every slot and base rows; blocks of one slot, of base rows only, and a mixed
# tail (kernel blocks are 16 tokens)
SLOT_CASES = {
    "mixed": [0, 0, -1, 2, 1, 1, -1, 2, 0],
    "blocks": [1] * 16 + [-1] * 16 + [2] * 5 + [0] * 7 + [-1] * 3,
}


# 1,100 inputs: the shrink splits K over 4 programs, the last with a partial tile
@pytest.mark.parametrize("inputs", [32, 1100])
@pytest.mark.parametrize("case", SLOT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kernel", ["torch", "triton", "triton-sorted"])
def test_batched_products_equal_each_rows_own_adapter(
    kernel: str, dtype: torch.dtype, case: str, inputs: int
) -> None:
    if kernel.startswith("triton"):
        pytest.importorskip("triton")
    lora_a, lora_b = _stacks(dtype, seed=1, inputs=inputs)
    slots = SLOT_CASES[case]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(len(slots), inputs, generator=gen).to(dtype).to(DEVICE)
    base = torch.randn(len(slots), 40, generator=gen).to(dtype).to(DEVICE)
    indices = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    expected = _reference(x, base, slots, lora_a, lora_b)
    if kernel == "torch":
        got = add_lora_torch(x, base.clone(), indices, lora_a, lora_b, SLICES)
    else:
        from attnserve.lora.triton_ops import add_lora_triton

        order = torch.arange(len(slots), dtype=torch.int32, device=DEVICE)
        if kernel == "triton-sorted":
            order = torch.argsort(indices, stable=True).to(torch.int32)
        columns = column_slices(SLICES, base.shape[1], base.device)
        got = add_lora_triton(x, base.clone(), (indices, order), lora_a, lora_b, columns)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, atol=tol * 10, rtol=tol)
    base_rows = [t for t, slot in enumerate(slots) if slot < 0]
    assert torch.equal(got[base_rows], base[base_rows])  # no adapter: the base output only


def test_indices_keep_each_tokens_slot_and_a_sorted_order() -> None:
    indices = LoRAIndices(12, torch.device("cpu"))
    indices.set(torch.tensor([2, -1, 0, 2, 0], dtype=torch.int32).numpy())
    slots, order = indices.for_tokens(7)  # two padded rows: no adapter, in place
    assert slots.tolist() == [2, -1, 0, 2, 0, -1, -1]
    assert order.tolist() == [1, 2, 4, 0, 3, 5, 6]
    indices.set(torch.tensor([1], dtype=torch.int32).numpy())
    slots, order = indices.for_tokens(5)
    assert slots.tolist() == [1, -1, -1, -1, -1] and order.tolist() == [0, 1, 2, 3, 4]


def _weights(modules: dict[str, tuple[int, int]], rank: int) -> dict[str, LoRAWeights]:
    gen = torch.Generator().manual_seed(3)
    return {
        name: LoRAWeights(
            torch.randn(rank, fan_in, generator=gen), torch.randn(fan_out, rank, generator=gen)
        )
        for name, (fan_in, fan_out) in modules.items()
    }


def _addend(layer: torch.nn.Module, lora: LoRALinear, x: torch.Tensor) -> torch.Tensor:
    layer.weight.data.zero_()
    lora.indices.set(torch.zeros(len(x), dtype=torch.int32).numpy())
    return layer.multiply(x, None)


def test_column_parallel_ranks_keep_their_rows_of_b() -> None:
    shapes = {"q_proj": (16, 16), "k_proj": (16, 8), "v_proj": (16, 8)}
    weights, x = _weights(shapes, rank=4), torch.randn(3, 16)
    full = torch.cat([(x @ w.lora_a.t()) @ w.lora_b.t() * 0.5 for w in weights.values()], -1)
    q, kv = full.split([16, 16], -1)
    outputs = []
    for rank in range(2):
        with as_rank(2, rank):
            layer = QKVParallelLinear(16, 4, 4, 2)
        indices = LoRAIndices(8, torch.device("cpu"))
        layer.lora = lora = LoRALinear(
            layer, ("q_proj", "k_proj", "v_proj"), indices, (2, 8), torch.float32
        )
        lora.set_slot(0, weights, 0.5)
        outputs.append(_addend(layer, lora, x))
    k, v = kv.split(8, -1)
    for rank, got in enumerate(outputs):
        rows = slice(rank * 4, rank * 4 + 4)
        expected = torch.cat([q[:, rank * 8 : rank * 8 + 8], k[:, rows], v[:, rows]], -1)
        torch.testing.assert_close(got, expected)


def test_row_parallel_partial_products_sum_to_the_full_one() -> None:
    weights, x = _weights({"o_proj": (16, 12)}, rank=8), torch.randn(3, 16)
    expected = (x @ weights["o_proj"].lora_a.t()) @ weights["o_proj"].lora_b.t() * 2.0
    total = torch.zeros(3, 12)
    for rank in range(2):
        with as_rank(2, rank):
            layer = RowParallelLinear(16, 12)
        lora = LoRALinear(
            layer, ("o_proj",), LoRAIndices(8, torch.device("cpu")), (1, 8), torch.float32
        )
        layer.lora = lora
        lora.set_slot(0, weights, 2.0)
        total += _addend(layer, lora, x[:, rank * 8 : rank * 8 + 8])
    torch.testing.assert_close(total, expected)
