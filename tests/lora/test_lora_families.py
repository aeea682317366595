"""LoRA on the other members of the Llama family and over two ranks: Qwen3 (a head size of its
own, q/k norms) and Gemma 2 (GeGLU, soft-caps, a sliding window) against HF transformers on the
adapter merged into the weights; a Llama sharded over two ranks (A split on row-parallel, B on
column-parallel layers) giving one rank's tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from attnserve import LLM, LoRARequest, SamplingParams
from tests.conftest import TINY_LLAMA, hf_greedy
from tests.lora.adapters import write_merged_model, write_peft_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 90, 61, 7], [44, 8, 150, 3]]
TINY = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 160,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
}  # fmt: skip
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 24,
                                "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
}  # fmt: skip


def _save_hf_model(path: Path, config_cls: str, config: dict[str, Any]) -> Path:
    hf_config = getattr(transformers, config_cls)(**config)
    hf_config.architectures = [config_cls.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():  # random norms too, so every weight matters
        for name, param in model.named_parameters():
            param.copy_(
                (1.0 if name.endswith("norm.weight") else 0.0) + 0.1 * torch.randn_like(param)
            )
    model.save_pretrained(path)
    return path


def _generate(model: Path, adapter: Path, **engine: Any) -> list[list[int]]:
    llm = LLM(str(model), device="cpu", dtype="float32", enable_lora=True, **engine)
    request = LoRARequest("adapter", 1, str(adapter))
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=request)
        return [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_equals_merged_weights(family: str, tmp_path: Path) -> None:
    config_cls, overrides = FAMILIES[family]
    config = {**TINY, **overrides}
    model = _save_hf_model(tmp_path / "model", config_cls, config)
    adapter = write_peft_adapter(tmp_path / "adapter", config, rank=8, seed=3)
    merged = write_merged_model(model, adapter, tmp_path / "merged")
    expected = [hf_greedy(merged, prompt, GREEDY.max_tokens or 0) for prompt in PROMPTS]
    assert _generate(model, adapter) == expected
    assert expected != [hf_greedy(model, prompt, GREEDY.max_tokens or 0) for prompt in PROMPTS]


def test_two_ranks_equal_one(tiny_llama_dir: Path, tmp_path: Path) -> None:
    adapter = write_peft_adapter(tmp_path / "adapter", TINY_LLAMA, rank=8, seed=4)
    one = _generate(tiny_llama_dir, adapter)
    assert _generate(tiny_llama_dir, adapter, tensor_parallel_size=2) == one
    merged = write_merged_model(tiny_llama_dir, adapter, tmp_path / "merged")
    assert one == [hf_greedy(merged, prompt, GREEDY.max_tokens or 0) for prompt in PROMPTS]
