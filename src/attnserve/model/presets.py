"""Named shapes for `load_format="dummy"`: exact HF configs of real models, random weights.

A preset is the HF `config.json` content of the model it names (written out here, so no download
is needed); a dummy model has no tokenizer, so prompts are token ids.
"""

from __future__ import annotations

from typing import Any

# What Llama-3-8B and Llama-3-70B share (8K context, 128K vocabulary, untied head).
_LLAMA3_8K: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

DUMMY_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "llama-3.2-1b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_ROPE,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "llama-3-8b": {
        **_LLAMA3_8K,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "use_sliding_window": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "llama-3-70b": {
        **_LLAMA3_8K,
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
    },
    "gemma-2-9b": {
        "model_type": "gemma2",
        "architectures": ["Gemma2ForCausalLM"],
        "hidden_size": 3584,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "intermediate_size": 14336,
        "vocab_size": 256000,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "attention_bias": False,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
    # A few-MB model for fast engine tests.
    "llama-tiny": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def preset_hf_config(name: str) -> Any:
    """The transformers config of a dummy preset; ValueError for an unknown name."""
    from transformers import AutoConfig

    if name not in DUMMY_PRESETS:
        raise ValueError(f"unknown dummy preset {name!r}; known presets: {sorted(DUMMY_PRESETS)}")
    settings = dict(DUMMY_PRESETS[name])
    return AutoConfig.for_model(settings.pop("model_type"), **settings)
