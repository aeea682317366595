"""LoRA through the offline `LLM` end to end: greedy tokens with an adapter equal HF transformers'
on the same weights with the adapter merged in (W + scaling · B A), in batches that mix base
rows and several adapters, under chunked prefill and preemption, with fewer device slots than
adapters (requests wait for a slot), through the torch path and the Triton kernels; prefix
caching never hands one adapter's blocks to another."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from attnserve import LLM, LoRARequest, SamplingParams
from attnserve.lora import layers
from tests.conftest import TINY_LLAMA, hf_greedy
from tests.lora.adapters import write_merged_model, write_peft_adapter

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all": write_peft_adapter(root / "all", TINY_LLAMA, rank=8, alpha=16.0, seed=1),
        "attn": write_peft_adapter(
            root / "attn", TINY_LLAMA, rank=4, alpha=8.0, seed=2,
            modules=("q_proj", "v_proj", "o_proj"), use_rslora=True,
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, 380) for _ in range(n)] for n in (7, 19, 33)]


@pytest.fixture(scope="module")
def expected(
    tiny_llama_dir: Path,
    adapters: dict[str, Path],
    prompts: list[list[int]],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str | None, list[list[int]]]:
    """HF's greedy tokens of each prompt: the base model and each adapter merged into it."""
    models: dict[str | None, Path] = {None: tiny_llama_dir}
    for name, folder in adapters.items():
        target = tmp_path_factory.mktemp(f"merged-{name}") / "model"
        models[name] = write_merged_model(tiny_llama_dir, folder, target)
    return {name: [hf_greedy(d, p, NEW_TOKENS) for p in prompts] for name, d in models.items()}


def _requests(adapters: dict[str, Path]) -> dict[str | None, LoRARequest | None]:
    ids = {name: i + 1 for i, name in enumerate(sorted(adapters))}
    return {None: None} | {n: LoRARequest(n, ids[n], str(p)) for n, p in adapters.items()}


SETUPS = {
    "two-slots": {"max_loras": 2},
    "one-slot-chunked": {"max_loras": 1, "max_num_batched_tokens": 16},
    "preemption": {"max_loras": 2, "kv_cache_memory_bytes": 14 * 4096, "block_size": 4},
}


@pytest.mark.parametrize("setup", SETUPS, ids=str)
def test_mixed_batch_equals_each_adapter_merged(
    tiny_llama_dir: Path,
    adapters: dict[str, Path],
    prompts: list[list[int]],
    expected: dict[str | None, list[list[int]]],
    setup: str,
) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu", enable_lora=True, **SETUPS[setup])
    requests = _requests(adapters)
    names = [name for name in requests for _ in prompts]  # base, then each adapter
    outputs = llm.generate(
        prompts * len(requests), GREEDY, use_tqdm=False,
        lora_request=[requests[name] for name in names],
    )  # fmt: skip
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == [tokens for name in requests for tokens in expected[name]]
    assert expected["all"] != expected[None] and expected["attn"] != expected[None]
    llm.shutdown()


def test_prefix_cache_is_kept_apart_per_adapter(
    tiny_llama_dir: Path,
    adapters: dict[str, Path],
    prompts: list[list[int]],
    expected: dict[str | None, list[list[int]]],
) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu", enable_lora=True, max_loras=2, block_size=4)
    requests = _requests(adapters)
    for name in (None, "all", "attn", "all"):  # each prompt cached under the previous run's
        out = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests[name])
        assert [o.outputs[0].token_ids for o in out] == expected[name]
    stats = llm.llm_engine.stats()
    # only the second "all" run found cached blocks: a quarter of the lookups hit at most
    assert 0 < stats["prefix_cache_hit_rate"] <= 0.25
    llm.shutdown()


def test_requests_are_refused_up_front(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    request = LoRARequest("all", 1, str(adapters["all"]))
    base = LLM(str(tiny_llama_dir), device="cpu")
    with pytest.raises(ValueError, match="'all' requested, but LoRA is off"):
        base.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=request)
    base.shutdown()
    llm = LLM(str(tiny_llama_dir), device="cpu", enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match=r"'all': rank 8 is above max_lora_rank \(4\)"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=request)
    clash = LoRARequest("other", 2, str(adapters["attn"]))
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=clash)
    with pytest.raises(ValueError, match="lora_int_id 2 already names adapter 'other'"):
        llm.generate([[5]], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 2, "/y"))
    llm.shutdown()


def test_triton_kernels_give_the_same_tokens(
    tiny_llama_dir: Path,
    adapters: dict[str, Path],
    prompts: list[list[int]],
    expected: dict[str | None, list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The whole model with its LoRA products in the Triton kernels (Triton's interpreter on
    the CPU), base rows and both adapters in one batch."""
    pytest.importorskip("triton")
    monkeypatch.setattr(layers, "use_triton", lambda tensor: True)
    llm = LLM(str(tiny_llama_dir), device="cpu", enable_lora=True, max_loras=2)
    requests = _requests(adapters)
    names = list(requests)
    outputs = llm.generate(
        prompts[:1] * len(names), GREEDY, use_tqdm=False,
        lora_request=[requests[name] for name in names],
    )  # fmt: skip
    assert [o.outputs[0].token_ids for o in outputs] == [expected[n][0] for n in names]
    llm.shutdown()
