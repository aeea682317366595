"""The throughput bound's arithmetic against a hand computation, and its rate probes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnserve.bench.bound import (
    ModelShape,
    Rates,
    causal_pairs,
    measure_rates,
    prefill_flops,
    workload_bound,
)
from attnserve.model.config import ModelConfig
from tests.model.tiny_moe import save_tiny_moe

SHAPE = ModelShape(
    num_layers=2,
    hidden_size=8,
    num_heads=2,
    num_kv_heads=1,
    head_size=4,
    intermediate_size=16,
    vocab_size=32,
    dtype_bytes=2,
    kv_dtype_bytes=2,
)


def test_shape_figures_by_hand() -> None:
    # per layer: q,o 8·4·2 each, k,v 8·4·1 each = 192; MLP 3·8·16 = 384
    assert SHAPE.decoder_matmul_params == 2 * (192 + 384) == 1152
    assert SHAPE.lm_head_params == 256
    # norms: 2 per layer + the final one, 8 each
    assert SHAPE.step_weight_bytes(1) == (1152 + 40 + 256) * 2 == 2896
    assert SHAPE.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2 == 32
    assert SHAPE.attention_flops_per_pair == 4 * 2 * 2 * 4 == 64


MOE = ModelShape(
    **{
        **SHAPE.__dict__,
        "sparse_layers": 1,
        "num_experts": 4,
        "top_k": 2,
        "expert_intermediate_size": 6,
    }
)


def test_moe_shape_figures_by_hand() -> None:
    # q,k,v,o 192 per layer; one dense MLP 384; the sparse layer: router 8·4, experts 3·8·6 each
    assert MOE.expert_params == 144
    assert MOE.decoder_matmul_params == 2 * 192 + 384 + 32 + 2 * 144 == 1088
    shared = 2 * 192 + 384 + 32 + 40 + 256
    # uniform routing of 2 of 4 experts: 2 experts for one token, 4·(1 - 1/4) = 3 for two
    assert MOE.experts_read(1) == pytest.approx(2) and MOE.experts_read(2) == pytest.approx(3)
    assert MOE.step_weight_bytes(1) == pytest.approx((shared + 2 * 144) * 2)
    assert MOE.step_weight_bytes(1000) == pytest.approx((shared + 4 * 144) * 2)  # every expert
    assert SHAPE.step_weight_bytes(7) == SHAPE.step_weight_bytes(1)


def test_moe_shape_matches_the_parameters_of_a_checkpoint(tmp_path: Path) -> None:
    hf_model = save_tiny_moe(tmp_path, "mixtral")
    config = ModelConfig.resolve(str(tmp_path), load_format="dummy")
    shape = ModelShape.from_config(config)
    embedding = config.vocab_size * config.hidden_size
    params = sum(p.numel() for p in hf_model.parameters())
    every_expert = shape.step_weight_bytes(10**6)
    assert every_expert == pytest.approx((params - embedding) * config.dtype.itemsize)
    assert (shape.sparse_layers, shape.num_experts, shape.top_k) == (config.num_layers, 4, 2)


def test_causal_pairs() -> None:
    assert causal_pairs(5, None) == 1 + 2 + 3 + 4 + 5
    assert causal_pairs(5, 3) == 1 + 2 + 3 + 3 + 3
    assert causal_pairs(3, 8) == 6


def test_workload_bound_by_hand() -> None:
    inputs, outputs = [3, 5], [2, 3]
    # prefill: 2·1152·8 tokens + 2·256 per request + 64·(6 + 15) pairs
    assert prefill_flops(SHAPE, inputs) == 18432 + 1024 + 1344 == 20800
    rates = Rates(copy_bytes_per_s=1000.0, matmul_flops_per_s=1900.0)
    bound = workload_bound(SHAPE, inputs, outputs, rates)
    # step 1: both run, keys 3+1 and 5+1 -> bytes 2896 + 32·10, FLOPs 2·1408·2 + 64·10
    step1 = max(3216 / 1000, 6272 / 1900)  # compute-bound
    # step 2: only the second runs, 5+2 keys -> bytes 2896 + 32·7, FLOPs 2·1408 + 64·7
    step2 = max(3120 / 1000, 3264 / 1900)  # memory-bound
    assert bound.decode_steps == 2 and bound.memory_bound_steps == 1
    assert bound.prefill_s == pytest.approx(20800 / 1900)
    assert bound.decode_s == pytest.approx(step1 + step2)
    assert bound.output_tokens == 5
    assert bound.tokens_per_s == pytest.approx(5 / (20800 / 1900 + step1 + step2))


def test_sliding_window_caps_the_keys() -> None:
    windowed = ModelShape(**{**SHAPE.__dict__, "layer_windows": (4, 4)})
    rates = Rates(copy_bytes_per_s=1.0, matmul_flops_per_s=1e30)  # memory only
    bound = workload_bound(windowed, [5], [2], rates)
    assert bound.decode_s == pytest.approx(2896 + 32 * 4)


def test_each_layer_reads_the_keys_of_its_own_window() -> None:
    """A local layer (window 4) and a global one: the decode step's one sequence of 6 keys
    reads 4 + 6 of them (16 bytes a key a layer); its 5-token prompt has 14 + 15 causal pairs
    (32 FLOPs a pair a layer)."""
    mixed = ModelShape(**{**SHAPE.__dict__, "layer_windows": (4, None)})
    memory_only = Rates(copy_bytes_per_s=1.0, matmul_flops_per_s=1e30)
    assert workload_bound(mixed, [5], [2], memory_only).decode_s == pytest.approx(2896 + 16 * 10)
    matmuls = 2 * 1152 * 5 + 2 * 256
    assert prefill_flops(mixed, [5]) == matmuls + 32 * (14 + 15)
    assert prefill_flops(SHAPE, [5]) == matmuls + 64 * 15


def test_gemma_shapes_carry_their_layer_windows() -> None:
    gemma2 = ModelShape.from_config(ModelConfig.resolve("gemma-2-9b", load_format="dummy"))
    assert gemma2.windows[:4] == [4096, None, 4096, None]
    gemma3 = ModelShape.from_config(ModelConfig.resolve("gemma-3-12b", load_format="dummy"))
    assert gemma3.windows[:6] == [1024] * 5 + [None]
    assert (
        ModelShape.from_config(ModelConfig.resolve("llama-tiny", load_format="dummy")).windows
        == [None] * 2
    )


def test_bad_lengths_are_value_errors() -> None:
    rates = Rates(1.0, 1.0)
    with pytest.raises(ValueError, match="one input and one output"):
        workload_bound(SHAPE, [3], [2, 2], rates)
    with pytest.raises(ValueError, match=">= 1"):
        workload_bound(SHAPE, [3], [0], rates)


def test_shape_matches_the_parameters_of_the_preset() -> None:
    from transformers import LlamaForCausalLM

    config = ModelConfig.resolve("llama-tiny", load_format="dummy")
    shape = ModelShape.from_config(config, "fp8")
    model = LlamaForCausalLM(config.hf_config)
    embedding = config.vocab_size * config.hidden_size  # untied: gathered, not read whole
    params = sum(p.numel() for p in model.parameters())
    assert shape.step_weight_bytes(1) == (params - embedding) * config.dtype.itemsize
    assert shape.kv_dtype_bytes == 1


def test_rates_are_measured_on_the_host() -> None:
    rates = measure_rates(torch.device("cpu"), torch.float32)
    assert rates.copy_bytes_per_s > 0 and rates.matmul_flops_per_s > 0
