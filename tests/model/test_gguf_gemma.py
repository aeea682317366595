"""Gemma 2 and Gemma 3 (text) from GGUF: a tiny file written from an HF model as llama.cpp's
converter writes it (its metadata keys, names from gguf's own TensorNameMap, norms stored as
1 + weight, no q/k permutation, float32 tensors), loaded by us, against HF's forward on the same
weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
import transformers
from gguf import GGUFWriter, RopeScalingType

from attnserve.model import ModelConfig
from attnserve.model.config import layer_sliding_windows, rope_settings
from tests.model.paged import PagedRunner, load_reference_model
from tests.model.test_gemma import MODELS, save_random_hf
from tests.model.test_gguf_moe import write_shape


def _write_gguf(path: Path, arch: str, hf_model: Any) -> None:
    config = hf_model.config
    writer = GGUFWriter(str(path), arch)
    write_shape(writer, config)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    else:
        theta, scaling = rope_settings(config)
        writer.add_rope_freq_base(theta)
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight":  # tied
            continue
        data = tensor + 1.0 if name.endswith("norm.weight") else tensor
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), data.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma_gguf(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(the file, HF's model): llama.cpp's files carry no query scale, so HF's is head_dim's, and
    Gemma 3's rotary bases are llama.cpp's (local 10k)."""
    arch = f"Gemma{request.param[-1]}ForCausalLM"
    config_cls, settings = MODELS[arch]
    settings = {**settings, "query_pre_attn_scalar": settings["head_dim"]}
    if request.param == "gemma3":
        settings["rope_local_base_freq"] = 10000.0
    config = getattr(transformers, config_cls)(**settings)
    config.architectures = [arch]
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = save_random_hf(directory, config)
    _write_gguf(directory / "tiny.gguf", request.param, hf_model)
    return directory / "tiny.gguf", hf_model


def test_gguf_config_is_hfs(gemma_gguf: tuple[Path, Any]) -> None:
    path, hf_model = gemma_gguf
    config = ModelConfig.resolve(str(path), dtype="float32")
    hf = hf_model.config
    assert config.architecture == hf.architectures[0] and config.load_format == "gguf"
    assert layer_sliding_windows(config.hf_config) == layer_sliding_windows(hf)
    for kind in ("full_attention", "sliding_attention"):
        assert rope_settings(config.hf_config, kind) == rope_settings(hf, kind)
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        assert getattr(config.hf_config, key) == getattr(hf, key)
    assert config.hf_config.tie_word_embeddings


def test_gguf_logits_match_hf(gemma_gguf: tuple[Path, Any]) -> None:
    path, hf_model = gemma_gguf
    config = ModelConfig.resolve(str(path), dtype="float32", quantization="none")
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 256, (n,), generator=gen) for n in (7, 19)]
    ours = PagedRunner(load_reference_model(config), config, max_len=19, seqs=2).run(
        [s[:-2].tolist() for s in seqs], [s[-2:].tolist() for s in seqs]
    )
    for seq, logits in zip(seqs, ours, strict=True):
        with torch.no_grad():
            expected = hf_model(seq[None]).logits[0]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
