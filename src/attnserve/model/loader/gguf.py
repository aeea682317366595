"""Reading llama.cpp GGUF files: metadata -> HF LlamaConfig, tensors -> HF weights, dequantized
or (with `keep_packed`) Q4_0/Q4_1/Q8_0 matrices kept as their blocks (`GGUFWeight`).

Tensor names map to HF names (token_embd -> model.embed_tokens, blk.N.attn_q -> ...q_proj, ...).
llama.cpp's converter interleaves the rows of q_proj/k_proj within each head (for its rotary
kernel); `unpermute_rows` undoes that so the weights match HF's "rotate half" layout.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from attnserve.model.layers.rotary_embedding import rope_inv_freq
from attnserve.model.quantization.gguf_blocks import PACKED_TYPES, GGUFWeight, from_blocks

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"


@functools.lru_cache(maxsize=1)
def _reader(path: str) -> Any:
    """One parsed GGUF file (parsing the metadata of a large vocabulary takes seconds)."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, IndexError, OSError, KeyError) as error:
        raise ValueError(
            f"cannot read GGUF file {path} (truncated or corrupt?): {error}"
        ) from error


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """A scalar or string metadata value, or `default` when the key is absent."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value.tolist()[0]


def _tensor(reader: Any, name: str) -> Any | None:
    return next((t for t in reader.tensors if t.name == name), None)


def hf_name(gguf_name: str) -> str:
    """The HF checkpoint name of a GGUF tensor; ValueError for one with no counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no HF Llama counterpart")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave of a q/k projection (weight or bias)."""
    rows = weight.shape[0]
    per_head = rows // num_heads
    split = weight.reshape(num_heads, per_head // 2, 2, *weight.shape[1:])
    return split.transpose(1, 2).reshape(weight.shape)


def gguf_has_tokenizer(path: str | Path) -> bool:
    """Whether the file carries a tokenizer vocabulary."""
    return "tokenizer.ggml.tokens" in _reader(str(path)).fields


def gguf_hf_config(path: str | Path) -> Any:
    """An HF LlamaConfig from a GGUF file's metadata."""
    from transformers import AutoConfig

    reader = _reader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}; supported: ['llama']")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    head_dim = int(_field(reader, "llama.attention.key_length", hidden // heads))
    embedding = _tensor(reader, "token_embd.weight")
    vocab = _field(reader, "llama.vocab_size", None if embedding is None else embedding.shape[1])
    theta = float(_field(reader, "llama.rope.freq_base", 10000.0))
    return AutoConfig.for_model(
        "llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=hidden,
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        vocab_size=int(vocab),
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(reader, head_dim, theta),
        tie_word_embeddings=_tensor(reader, "output.weight") is None,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )


def _rope_scaling(reader: Any, head_dim: int, theta: float) -> dict[str, Any] | None:
    """Llama-3 scaling recovered from a `rope_freqs` tensor; other kinds passed on to be
    rejected by the config check."""
    freqs = _tensor(reader, _ROPE_FREQS)
    if freqs is None:
        kind = _field(reader, "llama.rope.scaling.type", "none")
        if kind == "none":
            return None
        return {"rope_type": kind, "factor": _field(reader, "llama.rope.scaling.factor")}
    factors = torch.from_numpy(np.asarray(freqs.data, dtype=np.float32).reshape(-1))
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": int(
            _field(reader, "llama.rope.scaling.original_context_length", 8192)
        ),
    }
    plain = rope_inv_freq(head_dim, theta)
    expected = plain / rope_inv_freq(head_dim, theta, scaling)
    if not torch.allclose(expected, factors, rtol=1e-3):
        raise ValueError("GGUF rope_freqs do not match Llama-3 rope scaling (unsupported)")
    return scaling


def _read(tensor: Any, shape: tuple[int, ...], keep_packed: bool) -> torch.Tensor | GGUFWeight:
    """One tensor's weight: its blocks when kept packed (a matrix of a packed type), else
    dequantized to float32."""
    from gguf.quants import dequantize

    qtype = tensor.tensor_type.name
    if keep_packed and qtype in PACKED_TYPES and len(shape) == 2:
        return from_blocks(qtype, tensor.data, (shape[0], shape[1]))
    array = dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.array(array, dtype=np.float32)).reshape(shape)


def iter_gguf_weights(
    path: str | Path, hf_config: Any, keep_packed: bool = False
) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    """Every weight of the file as (HF name, weight), un-permuted: float32 tensors, or with
    `keep_packed` the blocks of Q4_0/Q4_1/Q8_0 matrices."""
    reader = _reader(str(path))
    heads = {"q_proj": hf_config.num_attention_heads, "k_proj": hf_config.num_key_value_heads}
    for tensor in tqdm(reader.tensors, desc=f"Loading {Path(path).name}", unit="tensor"):
        if tensor.name == _ROPE_FREQS:
            continue
        name = hf_name(tensor.name)
        shape = tuple(reversed([int(d) for d in tensor.shape]))
        try:
            weight = _read(tensor, shape, keep_packed)
        except (ValueError, RuntimeError) as error:
            raise ValueError(
                f"GGUF file {path}: tensor {tensor.name} is truncated or corrupt ({error})"
            ) from error
        projection = name.split(".")[-2]
        if projection in heads:
            weight = _unpermuted(weight, int(heads[projection]))
        yield name, weight


def _unpermuted(weight: torch.Tensor | GGUFWeight, num_heads: int) -> torch.Tensor | GGUFWeight:
    if isinstance(weight, GGUFWeight):
        return weight.rows(lambda rows: unpermute_rows(rows, num_heads))
    return unpermute_rows(weight, num_heads)
