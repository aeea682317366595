"""LoRA on a CUDA GPU: the Triton shrink/expand kernels against a float64 evaluation of the same
weights at Llama-3-8B's projection shapes (8 adapters of rank 16, q/k/v as slices), eagerly and
replayed from a CUDA graph with new slots written in; and the engine's greedy tokens with
adapters, from CUDA graphs (decode and piecewise), against HF transformers on the merged weights
(float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnserve import LLM, LoRARequest, SamplingParams
from attnserve.lora.layers import column_slices
from attnserve.lora.punica import add_lora_torch
from attnserve.lora.triton_ops import add_lora_triton
from tests.conftest import TINY_LLAMA, hf_greedy
from tests.lora.adapters import write_merged_model, write_peft_adapter

pytestmark = pytest.mark.cuda

SLOTS, RANK, HIDDEN = 8, 16, 4096
QKV = [(0, 4096), (4096, 1024), (5120, 1024)]


def _columns() -> torch.Tensor:
    return column_slices(QKV, 6144, torch.device("cuda"))


def _case(tokens: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    base = torch.randn(tokens, 6144, generator=gen)
    lora_a = torch.randn(SLOTS, len(QKV) * RANK, HIDDEN, generator=gen) / HIDDEN**0.5
    lora_b = torch.randn(SLOTS, 6144, RANK, generator=gen) * 0.1
    slots = torch.randint(-1, SLOTS, (tokens,), generator=gen, dtype=torch.int32)
    floats = tuple(t.to("cuda", dtype) for t in (x, base, lora_a, lora_b))
    return (*floats, slots.cuda())


def _reference(
    x: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    out = base.double().clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            for j, (start, width) in enumerate(QKV):
                u = x[t].double() @ a[slot, j * RANK : (j + 1) * RANK].double().t()
                out[t, start : start + width] += u @ b[slot, start : start + width].double().t()
    return out


def _order(slots: torch.Tensor) -> torch.Tensor:
    return torch.argsort(slots, stable=True).to(torch.int32)


@pytest.mark.parametrize("tokens", [1, 37, 256, 2048])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_against_float64(tokens: int, dtype: torch.dtype) -> None:
    x, base, a, b, slots = _case(tokens, dtype)
    want = _reference(x, base, a, b, slots)
    got = add_lora_triton(x, base.clone(), (slots, _order(slots)), a, b, _columns()).double()
    torch_path = add_lora_torch(x, base.clone(), slots, a, b, QKV).double()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:  # one bf16 rounding of the output at most, like the torch path's
        assert (got - want).abs().max() <= 2 * (torch_path - want).abs().max() + 1e-2


def test_kernels_replay_from_a_cuda_graph_with_new_slots() -> None:
    x, base, a, b, slots = _case(64, torch.bfloat16)
    order, columns = _order(slots), _columns()
    fresh = base.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    add_lora_triton(x, base.clone(), (slots, order), a, b, columns)  # compiled before the capture
    with torch.cuda.graph(graph):
        out = add_lora_triton(x, fresh, (slots, order), a, b, columns)
    new_slots = torch.flip(slots, (0,))
    slots.copy_(new_slots)
    order.copy_(_order(new_slots))
    fresh.copy_(base)
    graph.replay()
    torch.cuda.synchronize()
    eager = add_lora_triton(x, base.clone(), (slots, order), a, b, columns)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)


def test_engine_tokens_from_graphs_equal_hf_merged(tiny_llama_dir: Path, tmp_path: Path) -> None:
    adapters = [write_peft_adapter(tmp_path / f"a{i}", TINY_LLAMA, rank=8, seed=i) for i in (1, 2)]
    prompts = [[5, 17, 33, 2, 90, 61, 7], [44, 8, 150, 3], [9, 9, 31]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    requests = [None] + [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    llm = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", enable_lora=True, max_loras=2)
    try:
        outputs = llm.generate(
            [p for p in prompts for _ in requests], params, use_tqdm=False,
            lora_request=[r for _ in prompts for r in requests],
        )  # fmt: skip
    finally:
        llm.shutdown()
    models = [tiny_llama_dir] + [
        write_merged_model(tiny_llama_dir, p, tmp_path / f"merged{i}")
        for i, p in enumerate(adapters)
    ]
    expected = [hf_greedy(m, p, 12) for p in prompts for m in models]
    assert [o.outputs[0].token_ids for o in outputs] == expected
