"""GGUF loading of MoE models: tiny Qwen3-MoE (`qwen3moe`) and Mixtral (`llama` with experts)
files written from HF models as llama.cpp's converter writes them (names from gguf's own
TensorNameMap, experts stacked per layer, Mixtral's q/k rows permuted, tensors in Q8_0/F16/F32),
loaded by us, against HF's forward on the same quantize-dequantize weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from attnserve.model import ModelConfig
from tests.model.paged import PagedRunner, load_reference_model
from tests.model.test_gguf import llama_cpp_permute
from tests.model.tiny_moe import tiny_moe_model

Q = GGMLQuantizationType
# tensor kind -> storage type (the expert and attention rows have a multiple of 32 columns)
QUANT = {"gate_up_proj": Q.Q8_0, "down_proj": Q.F16, "q_proj": Q.Q8_0, "embed_tokens": Q.Q8_0}
CASES: dict[str, tuple[str, Any, dict[str, Any]]] = {
    "qwen3moe": ("qwen3-moe-norm-topk", gguf.MODEL_ARCH.QWEN3MOE, {}),
    "qwen3moe-no-norm": (
        "qwen3-moe-norm-topk",
        gguf.MODEL_ARCH.QWEN3MOE,
        {"norm_topk_prob": False},
    ),
    "mixtral": ("mixtral", gguf.MODEL_ARCH.LLAMA, {}),
}


def _qtype(hf_name: str, tensor: torch.Tensor) -> Any:
    if tensor.dim() == 1:
        return Q.F32
    return next((q for kind, q in QUANT.items() if f".{kind}" in hf_name), Q.F16)


def _round_trip(array: np.ndarray, qtype: Any) -> np.ndarray:
    if qtype == Q.F32:
        return array
    if qtype == Q.F16:
        return array.astype(np.float16).astype(np.float32)
    return dequantize(quantize(array, qtype), qtype)


def _gguf_tensors(hf_model: Any, arch: Any) -> dict[str, tuple[np.ndarray, Any]]:
    """GGUF name -> (array as the file stores it, storage type), from HF's in-memory weights:
    stacked experts split into gate / up, q/k permuted for `llama`."""
    config = hf_model.config
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors = {}
    for name, tensor in hf_model.state_dict().items():
        parts = {name: tensor}
        if name.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            base = name.removesuffix("gate_up_proj")
            parts = {f"{base}gate_proj.weight": gate, f"{base}up_proj.weight": up}
        elif name.endswith("experts.down_proj"):
            parts = {f"{name}.weight": tensor}
        for part_name, part in parts.items():
            data = part.numpy()
            if arch == gguf.MODEL_ARCH.LLAMA and (".q_proj." in name or ".k_proj." in name):
                heads = (
                    config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
                )
                data = llama_cpp_permute(data, heads)
            gguf_name = names.get_name(part_name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, part_name
            tensors[gguf_name] = (data, _qtype(name, tensor))
    return tensors


def write_shape(writer: GGUFWriter, config: Any) -> None:
    """The metadata of the model's shape, as llama.cpp's converter writes it."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim or config.hidden_size // config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


def _write(path: Path, hf_model: Any, arch: Any) -> None:
    config = hf_model.config
    writer = GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    write_shape(writer, config)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == gguf.MODEL_ARCH.QWEN3MOE:
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if not config.norm_topk_prob:
            writer.add_expert_weights_norm(False)
    for name, (data, qtype) in _gguf_tensors(hf_model, arch).items():
        stored = data.astype(np.float16) if qtype == Q.F16 else data
        if qtype not in (Q.F32, Q.F16):
            stored = quantize(data, qtype)
        writer.add_tensor(name, stored, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=list(CASES))
def moe_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(case, file, HF model on the file's rounded weights)."""
    source, arch, changes = CASES[request.param]
    hf_model = tiny_moe_model(source, **changes)
    path = tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf"
    _write(path, hf_model, arch)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            rounded = _round_trip(param.numpy(), _qtype(name, param))
            param.copy_(torch.from_numpy(np.ascontiguousarray(rounded)).reshape(param.shape))
    return request.param, path, hf_model


def test_moe_gguf_config(moe_gguf: Any) -> None:
    case, path, hf_model = moe_gguf
    config = ModelConfig.resolve(str(path), dtype="float32")
    hf = config.hf_config
    assert config.load_format == "gguf"
    assert config.architecture == hf_model.config.architectures[0]
    assert (hf.num_local_experts, hf.num_experts_per_tok) == (
        hf_model.config.num_local_experts,
        hf_model.config.num_experts_per_tok,
    )
    if case.startswith("qwen3moe"):
        assert hf.moe_intermediate_size == hf_model.config.moe_intermediate_size
        assert hf.norm_topk_prob == (case == "qwen3moe") and hf.mlp_only_layers == []
        assert config.head_size == hf_model.config.head_dim
    else:
        assert hf.intermediate_size == hf_model.config.intermediate_size


def test_moe_gguf_logits_match_hf(moe_gguf: Any) -> None:
    _, path, hf_model = moe_gguf
    # dequantized, as HF runs it (packed, the decode steps round activations: test_gguf.py)
    config = ModelConfig.resolve(str(path), dtype="float32", quantization="none")
    model = load_reference_model(config)
    vocab = hf_model.config.vocab_size
    seqs = [
        torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 6)
    ]
    ours = PagedRunner(model, config, max_len=9, seqs=2).run(
        [s[:-2].tolist() for s in seqs], [s[-2:].tolist() for s in seqs]
    )
    for seq, logits in zip(seqs, ours, strict=True):
        with torch.no_grad():
            expected = hf_model(seq[None]).logits[0]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
