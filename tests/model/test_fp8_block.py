"""Block-wise FP8 checkpoints (HF's `weight_block_size`, compressed-tensors' "block" strategy),
built here with the published quantization math (one scale per block = its max |w| / 448):
loaded as stored, each weight equal to its blocks dequantized; the product equal to its
block-scaled definition; scores near the float model's, on one rank and on two; malformed
configs and unsplittable layers refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from attnserve import LLM
from attnserve.model import ModelConfig
from attnserve.model.layers.linear import QKVParallelLinear, RowParallelLinear
from attnserve.model.loader import load_model
from attnserve.model.quantization import active_quantization, process_weights_after_loading
from attnserve.model.quantization.fp8 import FP8, FP8_MAX, quantize_rows
from attnserve.model.quantization.fp8_block import fp8_block_linear, uniform_blocks
from attnserve.model.quantization.fp8_checkpoint import Fp8Scheme, fp8_checkpoint_scheme
from attnserve.model.quantization.fp8_config import Fp8Config
from attnserve.model.quantization.weight_utils import load_weight
from tests.distributed.test_parallel_layers import as_rank
from tests.model.test_fp8 import (
    CHANNEL,
    GAP_MAX,
    GAP_MEAN,
    _prompt_scores,
    write_quantized_checkpoint,
)

BLOCK = (48, 32)  # rows need not divide a weight (64 rows: 48 + 16); columns must
HF_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
GROUP = CHANNEL["config_groups"]["group_0"]  # type: ignore[index]
CT_BLOCK = {
    **CHANNEL,
    "config_groups": {
        "group_0": {
            **GROUP,
            "weights": {**GROUP["weights"], "strategy": "block", "block_structure": list(BLOCK)},
            "input_activations": {
                **GROUP["input_activations"], "strategy": "group", "group_size": BLOCK[1],
            },
        }
    },
}  # fmt: skip


def quantize_blocks(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 weight, [row blocks, column blocks] scales) with weight ~ q * its block's scale."""
    rows, columns = block
    row_blocks, column_blocks = -(-weight.shape[0] // rows), weight.shape[1] // columns
    scales = torch.empty(row_blocks, column_blocks)
    quantized = torch.empty_like(weight, dtype=FP8)
    for i in range(row_blocks):
        for j in range(column_blocks):
            part = weight[i * rows : (i + 1) * rows, j * columns : (j + 1) * columns]
            scales[i, j] = (part.abs().amax() / FP8_MAX).clamp(min=1e-12)
            quantized[i * rows : (i + 1) * rows, j * columns : (j + 1) * columns] = (
                part / scales[i, j]
            ).to(FP8)
    return quantized, scales


def dequantized(
    quantized: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    per_element = scales.repeat_interleave(block[0], 0)[: quantized.shape[0]]
    return quantized.double() * per_element.double().repeat_interleave(block[1], 1)


@pytest.fixture(scope="module", params=["hf", "compressed-tensors"])
def block_checkpoint(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path_factory: Any
) -> Path:
    target = tmp_path_factory.mktemp("fp8_block") / request.param
    hf = request.param == "hf"
    suffix = "_scale_inv" if hf else "_scale"

    def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(("", suffix), quantize_blocks(weight, BLOCK), strict=True))

    write_quantized_checkpoint(tiny_llama_dir, target, HF_BLOCK if hf else CT_BLOCK, quantize)
    return target


def test_the_product_is_its_block_scaled_definition() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=generator)
    weight, scales = quantize_blocks(torch.randn(80, 64, generator=generator), BLOCK)
    per_row = scales.repeat_interleave(BLOCK[0], 0)[:80]
    got = fp8_block_linear(x, weight, per_row, BLOCK[1], None)
    groups, group_scales = quantize_rows(x.reshape(-1, BLOCK[1]))
    x_reference = (groups.double() * group_scales.double()[:, None]).reshape(5, 64)
    reference = x_reference @ dequantized(weight, scales, BLOCK).t()
    torch.testing.assert_close(got.double(), reference, atol=1e-4, rtol=1e-5)


def test_cublas_takes_the_scales_of_whole_128_x_128_blocks_only() -> None:
    """The per-row scales go to cuBLAS as [N / 128, K / 128] blocks only where every 128 rows
    share theirs; a merged projection with a 64-row part (blocks across two parts), other block
    sizes, a row count off the blocks, or K / 128 not a multiple of 4 keep the Triton GEMM."""
    blocks = torch.rand(3, 8, generator=torch.Generator().manual_seed(0)) + 0.5
    per_row = blocks.repeat_interleave(128, 0)
    got = uniform_blocks(per_row, (128, 128))
    assert got is not None and torch.equal(got, blocks)
    parts = (per_row[:128], blocks[1:2].expand(64, 8), blocks[2:3].expand(192, 8))
    assert uniform_blocks(torch.cat(parts), (128, 128)) is None
    assert uniform_blocks(per_row, (128, 64)) is None
    assert uniform_blocks(per_row[:320], (128, 128)) is None
    assert uniform_blocks(per_row[:, :6], (128, 128)) is None


def test_a_block_checkpoint_loads_as_stored(block_checkpoint: Path) -> None:
    config = ModelConfig.resolve(str(block_checkpoint))
    assert config.quantization == "fp8"
    model = load_model(config, torch.device("cpu"))
    stored = load_file(str(block_checkpoint / "model.safetensors"))
    scale_name = "weight_scale_inv" if "hf" in block_checkpoint.name else "weight_scale"
    layer = model.model.layers[1]
    offset = 0
    for part, module in (
        ("q_proj", "qkv"),
        ("k_proj", "qkv"),
        ("v_proj", "qkv"),
        ("down_proj", "down"),
    ):
        prefix = f"model.layers.1.{'mlp' if part == 'down_proj' else 'self_attn'}.{part}."
        weight, scales = stored[prefix + "weight"], stored[prefix + scale_name]
        linear = layer.self_attn.qkv_proj if module == "qkv" else layer.mlp.down_proj
        rows = slice(offset, offset + len(weight)) if module == "qkv" else slice(None)
        offset += len(weight) if module == "qkv" else 0
        assert torch.equal(linear.weight[rows].view(torch.uint8), weight.view(torch.uint8))
        dense = linear.quant_method.dense_weight(linear)[rows]
        torch.testing.assert_close(dense.double(), dequantized(weight, scales, BLOCK))


def test_scores_stay_near_the_float_models_on_one_and_two_ranks(
    block_checkpoint: Path, tiny_llama_dir: Path
) -> None:
    prompt = list(range(3, 60))
    float_llm = LLM(str(tiny_llama_dir), device="cpu")
    expected = _prompt_scores(float_llm, prompt)
    float_llm.shutdown()
    for tp in (1, 2):  # two ranks split o_proj's and down_proj's columns on column blocks
        llm = LLM(str(block_checkpoint), device="cpu", tensor_parallel_size=tp)
        gaps = (_prompt_scores(llm, prompt) - expected).abs()
        llm.shutdown()
        assert gaps.mean() < GAP_MEAN and gaps.max() < GAP_MAX, (tp, gaps)


def test_a_row_parallel_layer_must_split_on_column_blocks() -> None:
    config = Fp8Config(Fp8Scheme("weight_scale_inv", (32, 48)))
    with (
        as_rank(2, 0),
        active_quantization(config),
        pytest.raises(ValueError, match="column blocks of 48"),
    ):
        RowParallelLinear(128, 64)  # 64 columns a rank


def test_merged_rows_keep_their_blocks_scales_on_each_rank() -> None:
    parts = {
        p: quantize_blocks(torch.randn(n, 64), BLOCK) for p, n in (("q", 64), ("k", 32), ("v", 32))
    }
    config = Fp8Config(Fp8Scheme("weight_scale_inv", BLOCK))
    for rank in range(2):
        with as_rank(2, rank), active_quantization(config):
            qkv = QKVParallelLinear(64, 16, 4, 2)
        for part, (weight, scales) in parts.items():
            load_weight(qkv.weight, weight, "w", part)
            load_weight(qkv.weight_scale_inv, scales, "s", part)
        process_weights_after_loading(qkv)
        rows = {"q": slice(rank * 32, rank * 32 + 32), "k": slice(rank * 16, rank * 16 + 16)}
        rows["v"] = rows["k"]
        expected = torch.cat([dequantized(*parts[p], BLOCK)[rows[p]] for p in ("q", "k", "v")])
        torch.testing.assert_close(qkv.quant_method.dense_weight(qkv).double(), expected)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({**HF_BLOCK, "weight_block_size": [128]}, r"weight_block_size \[128\]"),
        (
            {
                **CT_BLOCK,
                "config_groups": {
                    "group_0": {
                        **CT_BLOCK["config_groups"]["group_0"],
                        "input_activations": GROUP["input_activations"],
                    }
                },
            },  # type: ignore[index]
            "input_activations",
        ),
    ],
    ids=["block-size", "activations"],
)
def test_malformed_block_configs_are_refused_by_name(config: dict[str, Any], message: str) -> None:
    hf_config = type("Config", (), {"quantization_config": config})
    with pytest.raises(ValueError, match=message):
        fp8_checkpoint_scheme(hf_config)
