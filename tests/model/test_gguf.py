"""GGUF loading: a tiny llama.cpp-style file (q/k rows permuted as convert_hf_to_gguf does,
tensors in Q8_0/Q4_0/Q4_1/F16/F32) written from an HF model, loaded by us, against HF's forward
on the same quantize-dequantize weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from attnserve.model import ModelConfig
from attnserve.model.gguf import unpermute_rows
from tests.model.paged import PagedRunner, load_reference_model

Q = GGMLQuantizationType
HF_TO_GGUF = {
    "model.embed_tokens.weight": ("token_embd.weight", Q.Q8_0),
    "model.norm.weight": ("output_norm.weight", Q.F32),
    "lm_head.weight": ("output.weight", Q.F16),
    "input_layernorm.weight": ("attn_norm.weight", Q.F32),
    "self_attn.q_proj.weight": ("attn_q.weight", Q.Q4_0),
    "self_attn.k_proj.weight": ("attn_k.weight", Q.Q4_1),
    "self_attn.v_proj.weight": ("attn_v.weight", Q.Q8_0),
    "self_attn.o_proj.weight": ("attn_output.weight", Q.F16),
    "post_attention_layernorm.weight": ("ffn_norm.weight", Q.F32),
    "mlp.gate_proj.weight": ("ffn_gate.weight", Q.Q4_1),
    "mlp.up_proj.weight": ("ffn_up.weight", Q.Q4_0),
    "mlp.down_proj.weight": ("ffn_down.weight", Q.Q8_0),
}
HEADS, KV_HEADS = 4, 2


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _gguf_name_and_type(hf_name: str) -> tuple[str, Any]:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    name, qtype = HF_TO_GGUF[rest]
    return f"blk.{layer}.{name}", qtype


def _write_gguf(path: Path, hf_model: Any) -> None:
    config = hf_model.config
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(config.vocab_size)
    writer.add_eos_token_id(2)
    for hf_name, tensor in hf_model.state_dict().items():
        name, qtype = _gguf_name_and_type(hf_name)
        data = tensor.numpy()
        if ".q_proj." in hf_name or ".k_proj." in hf_name:
            data = llama_cpp_permute(data, HEADS if ".q_proj." in hf_name else KV_HEADS)
        data = data.astype(np.float16) if qtype == Q.F16 else data
        stored = data if qtype in (Q.F32, Q.F16) else quantize(data, qtype)
        writer.add_tensor(name, stored, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    settings: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": 128,
        "max_position_embeddings": 64,
        "rope_theta": 50000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    config = transformers.LlamaConfig(**settings)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            param.copy_(
                (1.0 if name.endswith("norm.weight") else 0.0) + 0.1 * torch.randn_like(param)
            )
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(path, hf_model)
    with torch.no_grad():  # the reference sees the same rounding as the file
        for name, param in hf_model.named_parameters():
            qtype = _gguf_name_and_type(name)[1]
            if qtype not in (Q.F32, Q.F16):
                param.copy_(torch.from_numpy(dequantize(quantize(param.numpy(), qtype), qtype)))
            elif qtype == Q.F16:
                param.copy_(param.half().float())
    return path, hf_model


def test_tiny_gguf_config(tiny_gguf: tuple[Path, Any]) -> None:
    path = tiny_gguf[0]
    config = ModelConfig.resolve(str(path), dtype="float32")
    assert config.load_format == "gguf" and config.tokenizer is None
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (2, HEADS, KV_HEADS)
    assert (config.hidden_size, config.head_size, config.vocab_size) == (64, 16, 128)
    assert config.max_model_len == 64 and config.eos_token_ids == [2]
    assert not config.hf_config.tie_word_embeddings


def test_tiny_gguf_logits_match_hf(tiny_gguf: tuple[Path, Any]) -> None:
    path, hf_model = tiny_gguf
    config = ModelConfig.resolve(str(path), dtype="float32", quantization="none")
    model = load_reference_model(config)
    seqs = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 6)]
    ours = PagedRunner(model, config, max_len=9, seqs=2).run(
        [s[:-2].tolist() for s in seqs], [s[-2:].tolist() for s in seqs]
    )
    for seq, logits in zip(seqs, ours, strict=True):
        with torch.no_grad():
            expected = hf_model(seq[None]).logits[0]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("gguf_name", "heads"), [("blk.0.attn_q.weight", 6), ("blk.0.attn_k.weight", 2)]
)
def test_unpermute_matches_transformers(gguf_name: str, heads: int) -> None:
    """transformers' own GGUF reader un-permutes q/k: ours must agree with it."""
    weight = np.random.default_rng(0).standard_normal((heads * 8, 5)).astype(np.float32)
    permuted = llama_cpp_permute(weight, heads)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 6, "num_key_value_heads": 2})
    expected = processor.process(permuted, gguf_name).weights
    np.testing.assert_array_equal(expected, weight)
    np.testing.assert_array_equal(
        unpermute_rows(torch.from_numpy(permuted), heads).numpy(), expected
    )


def test_tiny_gguf_packed_logits_close_to_hf(tiny_gguf: tuple[Path, Any]) -> None:
    """Kept packed (the CPU default), every GGUF type of the file runs through its own kernel;
    the decode rows' activations are rounded to int16 per block, so the logits stay within
    3e-4 of HF's on the dequantized weights (of logits up to 3)."""
    path, hf_model = tiny_gguf
    config = ModelConfig.resolve(str(path), dtype="float32")
    assert config.quantization == "gguf"
    model = load_reference_model(config)
    layer = model.model.layers[0]
    kinds = [getattr(s, "qtype", "dense") for s in layer.self_attn.qkv_proj.quant_method.segments]
    assert kinds == ["Q4_0", "Q4_1", "Q8_0"]
    o_proj = layer.self_attn.o_proj.quant_method.segments
    assert [type(s).__name__ for s in o_proj] == ["DenseSegment"]
    seqs = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 6)]
    ours = PagedRunner(model, config, max_len=9, seqs=2).run(
        [s[:-2].tolist() for s in seqs], [s[-2:].tolist() for s in seqs]
    )
    for seq, logits in zip(seqs, ours, strict=True):
        with torch.no_grad():
            expected = hf_model(seq[None]).logits[0]
        torch.testing.assert_close(logits, expected, atol=1e-3, rtol=0)
