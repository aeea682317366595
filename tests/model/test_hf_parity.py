"""Our Llama-family model, loaded from an HF save_pretrained directory, against HF transformers'
own forward on the same weights (fp32): a flat prefill of several prompts, then decode steps
through the paged KV cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from attnserve.model import ModelConfig
from tests.model.paged import PagedRunner, load_reference_model

TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 160,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
# small soft-caps, so that they bite on random weights; a window shorter than the prompts
GEMMA2 = {
    "head_dim": 16,
    "sliding_window": 4,
    "query_pre_attn_scalar": 24,
    "attn_logit_softcapping": 2.0,
    "final_logit_softcapping": 3.0,
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-rope-bias": (
        "LlamaConfig",
        {"rope_scaling": LLAMA3_ROPE, "attention_bias": True, "mlp_bias": True},
    ),
    "mistral-sliding": ("MistralConfig", {"sliding_window": 4, "head_dim": 16}),
    "qwen2-tied": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3-qknorm": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}),
    "gemma2-softcap-sliding": ("Gemma2Config", GEMMA2),
}
PROMPT_LENS = (7, 11, 5)
DECODE_STEPS = 4


def _save_hf_model(tmp_path: Path, config_cls: str, overrides: dict[str, Any]) -> Any:
    config = getattr(transformers, config_cls)(**{**TINY, **overrides})
    config.architectures = [config_cls.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norms and biases too, so every weight matters
        for name, param in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            param.copy_(base + 0.1 * torch.randn_like(param))
    model.save_pretrained(tmp_path)
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(case: str, tmp_path: Path) -> None:
    hf_model = _save_hf_model(tmp_path, *CASES[case])
    config = ModelConfig.resolve(str(tmp_path), dtype="float32")
    assert config.architecture == hf_model.config.architectures[0]
    model = load_reference_model(config)
    gen = torch.Generator().manual_seed(1)
    full = [
        torch.randint(0, TINY["vocab_size"], (n + DECODE_STEPS,), generator=gen)
        for n in PROMPT_LENS
    ]
    prompts = [seq[:n].tolist() for seq, n in zip(full, PROMPT_LENS, strict=True)]
    continuations = [seq[n:].tolist() for seq, n in zip(full, PROMPT_LENS, strict=True)]
    ours = PagedRunner(model, config, max_len=max(PROMPT_LENS) + DECODE_STEPS, seqs=3).run(
        prompts, continuations
    )
    for seq, logits in zip(full, ours, strict=True):
        with torch.no_grad():
            expected = hf_model(seq[None]).logits[0]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["mistral-sliding", "gemma2-softcap-sliding"])
def test_sliding_window_case_is_exercised(case: str) -> None:
    """A sliding-window case only checks the window if prompts are longer than it."""
    window = CASES[case][1]["sliding_window"]
    assert min(PROMPT_LENS) > window
