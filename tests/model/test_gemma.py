"""Gemma 2 and Gemma 3 (text) against HF transformers on the same tiny random weights, in float32
on the CPU: logits at every position through the paged KV cache, and greedy tokens through `LLM`
for prompts longer than the sliding window, with and without prefix caching, with chunked
prefill, with KV-cache groups (the window layers' blocks behind the window freed: a pool small
enough to preempt by swap and by recompute, every free block poisoned before each step) and
without, with n-gram speculation, and at tensor parallel 2; the KV memory a sequence holds with
and without freed blocks; dummy weights exported to HF; the dummy presets at their real configs
(config and a meta build only, no weights); a multimodal Gemma 3 checkpoint served as its text
model."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from attnserve import LLM, SamplingParams
from attnserve.attention import Attention
from attnserve.bench.kv_memory import blocks_held
from attnserve.model import ModelConfig
from attnserve.model.config import layer_sliding_windows, rope_settings
from attnserve.model.loader import build_model
from attnserve.model.models.hf_export import to_hf_model
from tests.conftest import hf_greedy
from tests.distributed.test_tensor_parallel import token_ids
from tests.model.paged import PagedRunner, load_reference_model

WINDOW = 8
_TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "sliding_window": WINDOW,
    "query_pre_attn_scalar": 24,
}
# model -> (config class, its settings): small soft-caps, so that they bite on random weights
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "Gemma2ForCausalLM": (
        "Gemma2Config",
        {
            **_TINY,
            "num_hidden_layers": 4,
            "attn_logit_softcapping": 4.0,
            "final_logit_softcapping": 5.0,
        },
    ),
    "Gemma3ForCausalLM": (
        "Gemma3TextConfig",
        {
            **_TINY,
            "num_hidden_layers": 6,  # five sliding layers, one global
            "rope_theta": 1000.0,
            "rope_local_base_freq": 100.0,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        },
    ),
}
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
SMALL_CACHE = {"block_size": 4, "max_num_batched_tokens": 8, "kv_cache_memory_bytes": 36 << 10}
ENGINE_SETUPS: dict[str, dict[str, Any]] = {
    "prefix-cache": {"block_size": 4},
    "no-prefix-cache": {"block_size": 4, "enable_prefix_caching": False},
    "chunked-prefill": {"block_size": 4, "max_num_batched_tokens": 6},
    "no-hybrid-kv-cache": {"block_size": 4, "disable_hybrid_kv_cache_manager": True},
    # a pool too small for the three at once: freed window blocks are reused, some preempted
    "preempted-by-swap": {**SMALL_CACHE, "preemption_mode": "swap"},
    "preempted-by-recompute": SMALL_CACHE,
    "ngram-speculation": {"block_size": 4, "speculative_config": NGRAM},
}


def save_random_hf(path: Path, config: Any, model_cls: Any = None) -> Any:
    """An HF causal LM of `config` with random weights, saved as safetensors in `path`: std 0.2,
    the (tied, sqrt(hidden)-scaled) embeddings' 0.05 so that they do not drown the layers (the
    greedy tokens would repeat the last one)."""
    torch.manual_seed(0)
    if model_cls is None:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        model = model_cls(config).float()
    model.eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, 0.05 if "embed_tokens" in name else 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """model -> (its save_pretrained directory, HF's model)."""
    saved = {}
    for arch, (config_cls, settings) in MODELS.items():
        config = getattr(transformers, config_cls)(**settings)
        config.architectures = [arch]
        path = tmp_path_factory.mktemp(arch)
        saved[arch] = (path, save_random_hf(path, config))
    return saved


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts shorter than, a little longer than and several times the window."""
    rng = random.Random(0)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 13, 29)]


@pytest.fixture(scope="module")
def expected(
    checkpoints: dict[str, tuple[Path, Any]], prompts: list[list[int]]
) -> dict[str, list[list[int]]]:
    return {
        arch: [hf_greedy(path, prompt, NEW_TOKENS) for prompt in prompts]
        for arch, (path, _) in checkpoints.items()
    }


def _assert_logits_match(model: Any, config: ModelConfig, hf_model: Any) -> None:
    """Ours through the paged cache (each sequence but its last 3 tokens in one prefill step,
    then those 3 as decode steps) against HF's forward, at every position."""
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=gen) for n in (6, 14, 23)]
    runner = PagedRunner(model, config, max_len=23, seqs=len(seqs))
    ours = runner.run([s[:-3].tolist() for s in seqs], [s[-3:].tolist() for s in seqs])
    for got, seq in zip(ours, seqs, strict=True):
        with torch.no_grad():
            want = hf_model(seq[None]).logits[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", MODELS)
def test_logits_match_hf(checkpoints: dict[str, tuple[Path, Any]], arch: str) -> None:
    path, hf_model = checkpoints[arch]
    config = ModelConfig.resolve(str(path), dtype="float32")
    assert config.architecture == arch
    _assert_logits_match(load_reference_model(config), config, hf_model)


@pytest.mark.parametrize("arch", MODELS)
def test_dummy_weights_export_to_hf(checkpoints: dict[str, tuple[Path, Any]], arch: str) -> None:
    """Our dummy weights under HF's names (`to_hf_model`, the benchmarks' HF baseline) give
    HF our logits: the norms' weights mean the same (1 + weight) to both."""
    config = ModelConfig.resolve(str(checkpoints[arch][0]), dtype="float32", load_format="dummy")
    model = load_reference_model(config)
    _assert_logits_match(model, config, to_hf_model(model, config))


@pytest.mark.parametrize("setup", ENGINE_SETUPS)
@pytest.mark.parametrize("arch", MODELS)
def test_greedy_matches_hf(
    checkpoints: dict[str, tuple[Path, Any]],
    prompts: list[list[int]],
    expected: dict[str, list[list[int]]],
    arch: str,
    setup: str,
) -> None:
    path = checkpoints[arch][0]
    llm = LLM(str(path), device="cpu", dtype="float32", **ENGINE_SETUPS[setup])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected[arch]
    if setup == "prefix-cache":  # again, from the cached prefixes
        again = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in again] == expected[arch]
        assert llm.llm_engine.stats()["prefix_cache_hit_rate"] > 0.3
    if setup.startswith("preempted"):
        assert llm.llm_engine.stats()["num_preemptions"] > 0
    if setup == "ngram-speculation":  # verify steps over every KV-cache group's table
        assert llm.llm_engine.stats()["spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("arch", MODELS)
def test_window_layers_free_the_blocks_behind_their_window(
    checkpoints: dict[str, tuple[Path, Any]], arch: str
) -> None:
    """One sequence of 200 tokens and a few more: with the window layers' blocks behind the
    window freed, it holds less KV memory than with every block kept, by about the share of
    window layers."""
    held = {}
    for freed in (True, False):
        llm = LLM(
            str(checkpoints[arch][0]),
            device="cpu",
            dtype="float32",
            block_size=4,
            enable_prefix_caching=False,
            disable_hybrid_kv_cache_manager=not freed,
        )
        engine = llm.llm_engine
        _, blocks = blocks_held(engine, 200, 4)
        held[freed] = blocks * engine.executor.driver_runner.bytes_per_block()
    windows = layer_sliding_windows(checkpoints[arch][1].config)
    share = windows.count(None) / len(windows)  # global layers: Gemma 2 half, Gemma 3 a sixth
    assert held[False] * share < held[True] < held[False] * (share + 0.15)


@pytest.mark.parametrize("arch", MODELS)
def test_tokens_are_not_trivial(expected: dict[str, list[list[int]]], arch: str) -> None:
    """Random weights that give one token over and over would check little."""
    assert len({token for tokens in expected[arch] for token in tokens}) > NEW_TOKENS


def _attention_layers(config: ModelConfig) -> list[Attention]:
    model = build_model(config, "meta")
    assert model.lm_head is model.model.embed_tokens
    hidden = config.hidden_size
    assert model.model.embed_scale == float(torch.tensor(hidden**0.5).to(config.dtype))
    return [m for m in model.modules() if isinstance(m, Attention)]


def test_gemma2_preset_is_the_real_config() -> None:
    config = ModelConfig.resolve("gemma-2-9b", load_format="dummy")
    assert config.architecture == "Gemma2ForCausalLM"
    assert (config.num_layers, config.hidden_size, config.head_size) == (42, 3584, 256)
    assert (config.num_heads, config.num_kv_heads, config.vocab_size) == (16, 8, 256000)
    assert layer_sliding_windows(config.hf_config) == [4096, None] * 21
    assert config.max_model_len == 8192
    layers = _attention_layers(config)
    assert [layer.spec.sliding_window for layer in layers] == [4096, None] * 21
    assert {layer.spec.logits_soft_cap for layer in layers} == {50.0}
    assert {layer.scale for layer in layers} == {256**-0.5}


def test_gemma3_preset_is_the_real_config() -> None:
    config = ModelConfig.resolve("gemma-3-12b", load_format="dummy", max_model_len=4096)
    assert config.architecture == "Gemma3ForCausalLM"
    assert (config.num_layers, config.hidden_size, config.head_size) == (48, 3840, 256)
    assert (config.num_heads, config.num_kv_heads, config.vocab_size) == (16, 8, 262208)
    windows = [1024] * 5 + [None]
    assert layer_sliding_windows(config.hf_config) == windows * 8
    assert rope_settings(config.hf_config, "sliding_attention") == (10000.0, None)
    theta, scaling = rope_settings(config.hf_config)
    assert (theta, scaling and scaling["rope_type"], scaling and scaling["factor"]) == (
        1e6,
        "linear",
        8.0,
    )
    layers = _attention_layers(config)
    assert [layer.spec.sliding_window for layer in layers] == windows * 8
    assert {layer.spec.logits_soft_cap for layer in layers} == {None}
    assert {layer.scale for layer in layers} == {256**-0.5}


def test_multimodal_gemma3_serves_its_text_model(tmp_path: Path) -> None:
    """A Gemma3ForConditionalGeneration checkpoint (HF's names: `language_model.model.*`,
    `vision_tower.*`, `multi_modal_projector.*`) loads as its text model: HF's logits on text."""
    text = transformers.Gemma3TextConfig(**MODELS["Gemma3ForCausalLM"][1])
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=255,
        eos_token_id=[1, 106],
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    hf_model = save_random_hf(tmp_path, config, transformers.Gemma3ForConditionalGeneration)
    ours = ModelConfig.resolve(str(tmp_path), dtype="float32")
    assert ours.architecture == "Gemma3ForCausalLM" and ours.eos_token_ids == [1, 106]
    _assert_logits_match(load_reference_model(ours), ours, hf_model)


@pytest.mark.parametrize("arch", MODELS)
def test_tp2_greedy_matches_hf(
    checkpoints: dict[str, tuple[Path, Any]],
    prompts: list[list[int]],
    expected: dict[str, list[list[int]]],
    arch: str,
) -> None:
    """Two ranks (gloo, one process each): heads, MLP and vocabulary sharded, norms replicated,
    the final soft-cap after the logits' gather."""
    got = token_ids(prompts, GREEDY, model=str(checkpoints[arch][0]), tensor_parallel_size=2)
    assert [list(tokens) for tokens, _, _ in got] == expected[arch]


@pytest.mark.parametrize("arch", MODELS)
def test_no_layer_reads_a_freed_block(
    checkpoints: dict[str, tuple[Path, Any]],
    prompts: list[list[int]],
    expected: dict[str, list[list[int]]],
    arch: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before every step, every block no sequence holds is filled with large values (through
    the backend's own block copy): the tokens stay HF's, so no layer reads a block its
    window left behind (nor any other free block)."""
    llm = LLM(
        str(checkpoints[arch][0]),
        device="cpu",
        dtype="float32",
        enable_prefix_caching=False,
        **SMALL_CACHE,
    )
    core = llm.llm_engine.engine_core
    runner = core.executor.driver_runner
    cache = runner.cache_engine
    block_size, head_size = SMALL_CACHE["block_size"], _TINY["head_dim"]
    shape = cache.backend.get_kv_cache_shape(1, block_size, runner.num_kv_heads, head_size)
    poison = torch.full(shape, 1e4, dtype=cache.kv_caches[0].dtype)
    launch = core.executor.execute_model_async
    poisoned_steps = []

    def poison_then_launch(plan: Any) -> Any:
        free = [b for b in range(runner.num_blocks) if core.allocator.ref_count(b) == 0]
        pairs = torch.tensor([[0, block] for block in free], dtype=torch.int64)
        for tensor in cache.kv_caches:
            cache.backend.swap_blocks(poison, tensor, pairs.reshape(-1, 2))
        poisoned_steps.append(len(free))
        return launch(plan)

    monkeypatch.setattr(core.executor, "execute_model_async", poison_then_launch)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected[arch]
    assert sum(poisoned_steps) > 0
