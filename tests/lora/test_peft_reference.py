"""LoRA against `peft` itself: adapters made and saved by peft (random A and B; alpha / r and
rsLoRA's alpha / sqrt(r) scaling; all seven projections and a subset) on a tiny random Llama and
Qwen3 give, through the offline `LLM`, HF transformers' greedy tokens on peft's own merge
(`merge_and_unload`), in one batch that mixes base rows and both adapters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from attnserve import LLM, SamplingParams
from tests.conftest import hf_greedy
from tests.lora.adapters import ALL_MODULES
from tests.lora.test_lora_families import FAMILIES, TINY, _save_hf_model
from tests.lora.test_lora_llm import _requests

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 90, 61, 7], [44, 8, 150, 3, 12, 9, 71, 20, 6, 111, 30]]
ADAPTERS: dict[str, dict[str, Any]] = {
    "plain": {"r": 8, "lora_alpha": 16, "target_modules": list(ALL_MODULES)},
    "rslora": {"r": 4, "lora_alpha": 8, "use_rslora": True,
               "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]},
}  # fmt: skip


@pytest.fixture(params=["llama", "qwen3"])
def base_model(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    if request.param == "llama":
        return tiny_llama_dir
    config_cls, overrides = FAMILIES[request.param]
    return _save_hf_model(tmp_path_factory.mktemp(request.param), config_cls, TINY | overrides)


def _peft_adapter(base: Path, options: dict[str, Any], seed: int, folder: Path) -> Path:
    """An adapter of `options` on `base` with peft's random A and B (seeded), saved by peft into
    `folder/adapter`; HF's `base` with peft's merge of it saved into `folder/merged`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, **options)
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(folder / "adapter")
    peft_model.merge_and_unload().save_pretrained(folder / "merged")
    return folder


def test_mixed_batch_equals_peft_merge(base_model: Path, tmp_path: Path) -> None:
    adapters: dict[str, Path] = {}
    expected = {None: [hf_greedy(base_model, prompt, NEW_TOKENS) for prompt in PROMPTS]}
    for seed, (name, options) in enumerate(ADAPTERS.items(), start=1):
        folder = _peft_adapter(base_model, options, seed, tmp_path / name)
        adapters[name] = folder / "adapter"
        expected[name] = [hf_greedy(folder / "merged", prompt, NEW_TOKENS) for prompt in PROMPTS]
    requests = _requests(adapters)
    rows = [(name, prompt) for prompt in range(len(PROMPTS)) for name in requests]
    llm = LLM(str(base_model), device="cpu", dtype="float32", enable_lora=True, max_loras=2)
    try:
        outputs = llm.generate(
            [PROMPTS[prompt] for _, prompt in rows], GREEDY, use_tqdm=False,
            lora_request=[requests[name] for name, _ in rows],
        )  # fmt: skip
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [expected[n][p] for n, p in rows]
    assert len({str(tokens) for tokens in expected.values()}) == len(expected)
