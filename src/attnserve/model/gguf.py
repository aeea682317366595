"""Reading llama.cpp GGUF files: metadata -> an HF config, tensors -> HF weights, dequantized
or (with `keep_packed`) Q4_0/Q4_1/Q8_0 matrices kept as their blocks (`GGUFWeight`).

Architectures: `llama` (Llama, and Mixtral when it has experts), `qwen3moe`, `gemma2` and
`gemma3` (text; norms stored as 1 + weight, as llama.cpp's converter writes them). Tensor names map
to HF names (token_embd -> model.embed_tokens, blk.N.attn_q -> ...q_proj, ...); a stacked expert
tensor (blk.N.ffn_gate_exps [E, I, H], ...) becomes one HF weight per expert (views, no copy), so
the models load GGUF files through their checkpoint names. llama.cpp's qwen3moe has no dense
layers and renormalises the top-k weights (unless the file's `expert_weights_norm` says
otherwise). For `llama` files
llama.cpp's converter interleaves the rows of q_proj/k_proj within each head (for its rotary
kernel); `unpermute_rows` undoes that so the weights match HF's "rotate half" layout.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
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
_ROUTER = "ffn_gate_inp"


@dataclass(frozen=True)
class _MoeNames:
    block: str  # the HF model's MoE block: `model.layers.N.<block>.gate`, `...experts.E...`
    experts: dict[str, str]  # stacked GGUF tensor -> HF projection of each expert


_MOE_NAMES = {
    "llama": _MoeNames(
        "block_sparse_moe", {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
    ),
    "qwen3moe": _MoeNames(
        "mlp",
        {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"},
    ),
}
# Gemma's norms around attention and the feed-forward block (`ffn_norm` is the one before it)
_GEMMA_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA_LARGE_LAYERS = {"gemma2": 46, "gemma3": 62}  # the 27B models (llama.cpp's query scale)
ARCHITECTURES = (*_MOE_NAMES, *_GEMMA_LARGE_LAYERS)


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
    """A metadata value (a number, a string, or a list for an array), or `default` when the
    key is absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _tensor(reader: Any, name: str) -> Any | None:
    return next((t for t in reader.tensors if t.name == name), None)


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The HF checkpoint name of a (non-expert) GGUF tensor; ValueError for one with no
    counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK.fullmatch(gguf_name)
    moe = _MOE_NAMES.get(arch)
    extra = _GEMMA_LAYER_NAMES if moe is None else {_ROUTER: f"{moe.block}.gate"}
    names = {**_LAYER_NAMES, **extra}
    if match is None or match.group(2) not in names:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no HF counterpart in {arch!r} models")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


def hf_weights(
    gguf_name: str, weight: torch.Tensor | GGUFWeight, arch: str
) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    """(HF name, weight) pairs of one GGUF tensor: one per expert for a stacked expert tensor
    (always dequantized: only matrices stay packed)."""
    match = _BLOCK.fullmatch(gguf_name)
    moe = _MOE_NAMES.get(arch)
    if (
        moe is None
        or match is None
        or match.group(2) not in moe.experts
        or isinstance(weight, GGUFWeight)
    ):
        yield hf_name(gguf_name, arch), weight
        return
    prefix = f"model.layers.{match.group(1)}.{moe.block}.experts"
    projection = moe.experts[match.group(2)]
    for expert, expert_weight in enumerate(weight):
        yield f"{prefix}.{expert}.{projection}.{match.group(3)}", expert_weight


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave of a q/k projection (weight or bias)."""
    rows = weight.shape[0]
    per_head = rows // num_heads
    split = weight.reshape(num_heads, per_head // 2, 2, *weight.shape[1:])
    return split.transpose(1, 2).reshape(weight.shape)


def gguf_has_tokenizer(path: str | Path) -> bool:
    """Whether the file carries a tokenizer vocabulary."""
    return "tokenizer.ggml.tokens" in _reader(str(path)).fields


def gguf_architecture(path: str | Path) -> str:
    """The file's `general.architecture`; ValueError for one we cannot load."""
    arch = _field(_reader(str(path)), "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {path}; supported: {list(ARCHITECTURES)}"
        )
    return str(arch)


def gguf_hf_config(path: str | Path) -> Any:
    """The HF config (Llama, Mixtral, Qwen3-MoE, Gemma 2 or Gemma 3) of a GGUF file's metadata."""
    from transformers import AutoConfig

    reader, arch = _reader(str(path)), gguf_architecture(path)

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // heads))
    embedding = _tensor(reader, "token_embd.weight")
    vocab = key("vocab_size", None if embedding is None else embedding.shape[1])
    theta = float(key("rope.freq_base", 10000.0))
    common = {
        "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "vocab_size": int(vocab),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(reader, arch, head_dim, theta),
        "tie_word_embeddings": _tensor(reader, "output.weight") is None,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    if arch in _GEMMA_LARGE_LAYERS:
        return _gemma_hf_config(
            reader, arch, {**common, "intermediate_size": int(key("feed_forward_length"))}
        )
    experts = int(key("expert_count", 0))
    top_k = key("expert_used_count")
    if arch == "qwen3moe":
        expert_size = int(key("expert_feed_forward_length"))
        return AutoConfig.for_model(
            "qwen3_moe",
            architectures=["Qwen3MoeForCausalLM"],
            intermediate_size=int(key("feed_forward_length", expert_size)),
            moe_intermediate_size=expert_size,
            num_experts=experts,
            num_experts_per_tok=int(top_k),
            norm_topk_prob=bool(key("expert_weights_norm", True)),
            **common,
        )
    intermediate = int(key("feed_forward_length"))
    if experts:
        return AutoConfig.for_model(
            "mixtral",
            architectures=["MixtralForCausalLM"],
            intermediate_size=intermediate,
            num_local_experts=experts,
            num_experts_per_tok=int(top_k),
            **common,
        )
    return AutoConfig.for_model(
        "llama", architectures=["LlamaForCausalLM"], intermediate_size=intermediate, **common
    )


def _gemma_hf_config(reader: Any, arch: str, common: dict[str, Any]) -> Any:
    """Gemma 2/3 from llama.cpp's metadata, with what the file leaves out as llama.cpp assumes
    it: queries scaled by (hidden / heads)**-0.5 in the 27B models, else head_dim**-0.5; Gemma 3's
    sliding layers on a rotary base of 10k, five per global layer."""
    from transformers import AutoConfig

    def key(name: str) -> Any:
        return _field(reader, f"{arch}.{name}")

    large = common["num_hidden_layers"] == _GEMMA_LARGE_LAYERS[arch]
    heads = common["hidden_size"] // common["num_attention_heads"]
    settings = {
        **common,
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "query_pre_attn_scalar": heads if large else common["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": key("attention.sliding_window"),
    }
    if arch == "gemma2":
        caps = {
            "attn_logit_softcapping": key("attn_logit_softcapping"),
            "final_logit_softcapping": key("final_logit_softcapping"),
        }
        return AutoConfig.for_model(
            "gemma2", architectures=["Gemma2ForCausalLM"], **caps, **settings
        )
    return AutoConfig.for_model(
        "gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        rope_local_base_freq=10000.0,
        sliding_window_pattern=6,
        **settings,
    )


def _rope_scaling(reader: Any, arch: str, head_dim: int, theta: float) -> dict[str, Any] | None:
    """Llama-3 scaling recovered from a `rope_freqs` tensor; other kinds passed on to be
    rejected by the config check."""
    freqs = _tensor(reader, _ROPE_FREQS)
    if freqs is None:
        kind = _field(reader, f"{arch}.rope.scaling.type", "none")
        if kind == "none":
            return None
        return {"rope_type": kind, "factor": _field(reader, f"{arch}.rope.scaling.factor")}
    factors = torch.from_numpy(np.asarray(freqs.data, dtype=np.float32).reshape(-1))
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": int(
            _field(reader, f"{arch}.rope.scaling.original_context_length", 8192)
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
    `keep_packed` the blocks of Q4_0/Q4_1/Q8_0 matrices (stacked expert tensors are always
    dequantized)."""
    reader, arch = _reader(str(path)), gguf_architecture(path)
    heads = {"q_proj": hf_config.num_attention_heads, "k_proj": hf_config.num_key_value_heads}
    permuted = heads if arch == "llama" else {}  # the others' rotary matches HF's: no permute
    for tensor in tqdm(reader.tensors, desc=f"Loading {Path(path).name}", unit="tensor"):
        if tensor.name == _ROPE_FREQS:
            continue
        shape = tuple(reversed([int(d) for d in tensor.shape]))
        try:
            weight = _read(tensor, shape, keep_packed)
        except (ValueError, RuntimeError) as error:
            raise ValueError(
                f"GGUF file {path}: tensor {tensor.name} is truncated or corrupt ({error})"
            ) from error
        for name, hf_weight in hf_weights(tensor.name, weight, arch):
            projection = name.split(".")[-2]
            if projection in permuted:
                hf_weight = _unpermuted(hf_weight, int(permuted[projection]))
            if arch in _GEMMA_LARGE_LAYERS and name.endswith("norm.weight"):
                hf_weight = _gemma_norm(hf_weight)
            yield name, hf_weight


def _gemma_norm(weight: torch.Tensor | GGUFWeight) -> torch.Tensor:
    """llama.cpp stores a Gemma norm's scale (1 + weight); the HF weight is the offset."""
    if isinstance(weight, GGUFWeight):
        raise ValueError("a Gemma norm weight in GGUF must be a plain (unpacked) vector")
    return weight - 1.0


def _unpermuted(weight: torch.Tensor | GGUFWeight, num_heads: int) -> torch.Tensor | GGUFWeight:
    if isinstance(weight, GGUFWeight):
        return weight.rows(lambda rows: unpermute_rows(rows, num_heads))
    return unpermute_rows(weight, num_heads)
