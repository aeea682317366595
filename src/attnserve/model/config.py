"""`ModelConfig`: what model to serve, resolved and validated up front.

`ModelConfig.resolve` accepts a local HF directory, a `.gguf` file, a dummy preset name or a
Hugging Face hub id (`org/name`, fetched to the hub cache: `model.hub`; `model` is then the
snapshot's folder) (the embedded default model is resolved to its files where the engine's
configs are made, in `EngineArgs`). Every problem (missing path, unknown preset or hub id,
unsupported architecture or rope type, bad dtype, too long `max_model_len`, a quantization the
checkpoint or device cannot run, a bad generation config) is a ValueError raised here, before
any weight is read.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from attnserve.model.generation_config import default_sampling_fields, read_generation_config
from attnserve.model.hub import is_hub_id, resolve_model_path
from attnserve.model.layers.rotary_embedding import SUPPORTED_ROPE_TYPES
from attnserve.model.presets import DUMMY_PRESETS, preset_hf_config
from attnserve.model.quantization.fp8_checkpoint import fp8_checkpoint_scheme
from attnserve.model.quantization.resolve import resolve_quantization
from attnserve.model.registry import TEXT_MODELS, check_architecture

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """ "auto": bfloat16 on CUDA (float16 without bf16 support), float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of {list(_DTYPES)}")
        return dtype
    if dtype == "auto":
        if torch.device(device).type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use 'auto' or one of {list(_DTYPES)}")
    return _DTYPES[dtype]


LAYER_KINDS = ("full_attention", "sliding_attention")  # HF's `layer_types` values


def rope_settings(
    hf_config: Any, layer_kind: str = "full_attention"
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope scaling dict or None) from a transformers 4.x or 5.x config, for the
    layers of `layer_kind` where the config gives each kind its own (Gemma 3)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params and layer_kind in params:
        params = params[layer_kind]
    if params:
        scaling = None if params.get("rope_type", "default") == "default" else dict(params)
        return float(params["rope_theta"]), scaling
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and "rope_type" not in scaling:
        scaling = {**scaling, "rope_type": scaling.get("type", "default")}
    return float(getattr(hf_config, "rope_theta", 10000.0)), scaling


def layer_sliding_windows(hf_config: Any) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention)."""
    window = getattr(hf_config, "sliding_window", None)
    num_layers = int(hf_config.num_hidden_layers)
    if window is None or getattr(hf_config, "use_sliding_window", True) is False:
        return [None] * num_layers
    layer_types = getattr(hf_config, "layer_types", None) or ["sliding_attention"] * num_layers
    return [int(window) if kind == "sliding_attention" else None for kind in layer_types]


def num_experts(hf_config: Any) -> int:
    """Routed experts of each MoE layer (Mixtral's `num_local_experts`, Qwen-MoE's
    `num_experts`); 0 for a dense model."""
    for key in ("num_local_experts", "num_experts"):
        value = getattr(hf_config, key, None)
        if value:
            return int(value)
    return 0


def sparse_layers(hf_config: Any) -> list[bool]:
    """Which decoder layers are MoE, by HF's rule: not in `mlp_only_layers`, and every
    `decoder_sparse_step`-th layer (every layer by default) when the model has experts."""
    step = int(getattr(hf_config, "decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    sparse = num_experts(hf_config) > 0
    layers = range(int(hf_config.num_hidden_layers))
    return [sparse and i not in dense and (i + 1) % step == 0 for i in layers]


@dataclass(frozen=True)
class ModelConfig:
    model: str
    hf_config: Any
    tokenizer: str | None
    dtype: torch.dtype
    max_model_len: int
    load_format: str
    weights_path: str | None
    quantization: str | None = None  # "gguf", "fp8" or None (see model.quantization.resolve)
    trust_remote_code: bool = False  # passed to transformers' AutoConfig and AutoTokenizer
    generation_config: str = "auto"  # "auto", "vllm" or a folder (model.generation_config)

    @property
    def architecture(self) -> str:
        return str(self.hf_config.architectures[0])

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        return int(self.hf_config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return int(getattr(self.hf_config, "num_key_value_heads", None) or self.num_heads)

    @property
    def hidden_size(self) -> int:
        return int(self.hf_config.hidden_size)

    @property
    def head_size(self) -> int:
        head_dim = getattr(self.hf_config, "head_dim", None)
        return int(head_dim) if head_dim else self.hidden_size // self.num_heads

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    def get_num_kv_heads(self, tensor_parallel_size: int = 1) -> int:
        """KV heads per rank: at least one (a KV head is replicated when fewer than ranks)."""
        return max(1, self.num_kv_heads // tensor_parallel_size)

    def verify_with_parallel_config(self, tensor_parallel_size: int) -> None:
        """ValueError unless the heads and the MLP split evenly over the ranks."""
        tp = tensor_parallel_size
        kv = self.num_kv_heads
        problems = []
        if self.num_heads % tp:
            problems.append(f"its {self.num_heads} attention heads")
        if kv % tp and tp % kv:
            problems.append(f"its {kv} KV heads (nor is {tp} a multiple of them)")
        for key in ("intermediate_size", "moe_intermediate_size"):
            size = getattr(self.hf_config, key, None)
            if size is not None and int(size) % tp:
                problems.append(f"its {key} {size}")
        if problems:
            raise ValueError(
                f"tensor_parallel_size {tp} does not divide {' and '.join(problems)} of model "
                f"{self.model}"
            )

    @cached_property
    def sliding_window(self) -> int | None:
        windows = [w for w in layer_sliding_windows(self.hf_config) if w is not None]
        return max(windows) if windows else None

    @cached_property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids: the model config's, plus generation_config.json's if present."""
        ids = _as_id_list(getattr(self.hf_config, "eos_token_id", None))
        generation = read_generation_config(self.model)
        ids += [i for i in _as_id_list(generation.get("eos_token_id")) if i not in ids]
        return ids

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The SamplingParams fields `generation_config` gives requests that do not set them
        (vLLM's name; see model.generation_config)."""
        model_dir = self.model if Path(self.model).is_dir() else None
        return default_sampling_fields(self.generation_config, model_dir)

    @classmethod
    def resolve(
        cls,
        model: str,
        tokenizer: str | None = None,
        dtype: str | torch.dtype = "auto",
        load_format: str = "auto",
        max_model_len: int | None = None,
        device: str = "cpu",
        quantization: str | None = None,
        hub: HubOptions | None = None,
        generation_config: str = "auto",
    ) -> ModelConfig:
        """Validate the request and build the config (see the module docstring); `hub`: how
        hub ids (model and tokenizer) are fetched and trusted."""
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {load_format!r}; use one of {LOAD_FORMATS}")
        hub = hub or HubOptions()
        torch_dtype = resolve_dtype(dtype, device)
        model = hub.fetch(model, "model")
        described = _describe(model, load_format, hub.trust_remote_code)
        hf_config, default_tokenizer, load_format, weights_path = described
        _validate_hf_config(hf_config)
        checkpoint = _checkpoint_quantization(hf_config, load_format, weights_path)
        config = cls(
            model=model,
            hf_config=hf_config,
            tokenizer=_resolve_tokenizer(tokenizer, default_tokenizer, hub),
            dtype=torch_dtype,
            max_model_len=_resolve_max_model_len(hf_config, max_model_len),
            load_format=load_format,
            weights_path=weights_path,
            quantization=resolve_quantization(quantization, checkpoint, device, torch_dtype),
            trust_remote_code=hub.trust_remote_code,
            generation_config=generation_config,
        )
        config.get_diff_sampling_param()  # a bad generation config fails here
        return config


@dataclass(frozen=True)
class HubOptions:
    """How hub ids are fetched (vLLM's `--revision`, `--tokenizer-revision`, `--download-dir`)
    and whether transformers may run the model's own code (`--trust-remote-code`)."""

    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    trust_remote_code: bool = False

    def fetch(self, name: str, what: str) -> str:
        """`name`, or its hub snapshot's folder when it is a hub id (`what`: model/tokenizer)."""
        revision = self.tokenizer_revision if what == "tokenizer" else self.revision
        return resolve_model_path(name, revision, self.download_dir, self.trust_remote_code, what)


def _checkpoint_quantization(
    hf_config: Any, load_format: str, weights_path: str | None
) -> str | None:
    """The weights' own kind: "gguf" (a GGUF file, or GGUF blocks in safetensors), "fp8" (an
    FP8 `quantization_config`; dummy weights of such a model are quantized on load) or None."""
    if load_format == "gguf":
        return "gguf"
    if load_format == "safetensors" and weights_path is not None:
        from attnserve.model.weights import has_gguf_blocks

        if has_gguf_blocks(weights_path):
            return "gguf"
    return "fp8" if fp8_checkpoint_scheme(hf_config, weights_path) is not None else None


def _describe(
    model: str, load_format: str, trust_remote_code: bool
) -> tuple[Any, str | None, str, str | None]:
    """(hf_config, default tokenizer, concrete load format, weights path) for `model`."""
    if model in DUMMY_PRESETS:
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"{model!r} is a dummy preset: load_format must be 'dummy'")
        return preset_hf_config(model), None, "dummy", None
    path = Path(model)
    if path.is_dir():
        return _describe_hf_dir(path, load_format, trust_remote_code)
    if path.is_file() and path.suffix == ".gguf":
        if load_format not in ("auto", "gguf", "dummy"):
            raise ValueError(f"{model} is a GGUF file: load_format must be 'gguf' or 'dummy'")
        from attnserve.model.gguf import gguf_has_tokenizer, gguf_hf_config

        concrete = "dummy" if load_format == "dummy" else "gguf"
        tokenizer = str(path) if gguf_has_tokenizer(path) else None
        return gguf_hf_config(path), tokenizer, concrete, str(path)
    raise ValueError(
        f"model {model!r} is neither an existing HF directory, a .gguf file, a hub id "
        f"(org/name), nor a dummy preset (known presets: {sorted(DUMMY_PRESETS)})"
    )


def _describe_hf_dir(
    path: Path, load_format: str, trust_remote_code: bool
) -> tuple[Any, str | None, str, str | None]:
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json")
    if load_format == "gguf":
        raise ValueError(f"{path} is a directory: load_format 'gguf' needs a .gguf file")
    loaded = AutoConfig.from_pretrained(
        str(path), local_files_only=True, trust_remote_code=trust_remote_code
    )
    hf_config = _text_model_config(loaded)
    _validate_hf_config(hf_config)
    has_tokenizer = any((path / name).is_file() for name in _TOKENIZER_FILES)
    tokenizer = str(path) if has_tokenizer else None
    if load_format == "dummy":
        return hf_config, tokenizer, "dummy", None
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"model directory {path} has no *.safetensors weights")
    return hf_config, tokenizer, "safetensors", str(path)


def _text_model_config(hf_config: Any) -> Any:
    """A multimodal checkpoint's text model config (`TEXT_MODELS`: token ids in, the vision
    tower not loaded; its special ids kept), other configs as they are."""
    architectures = getattr(hf_config, "architectures", None) or [None]
    text_architecture = TEXT_MODELS.get(architectures[0])
    if text_architecture is None:
        return hf_config
    text = copy.deepcopy(hf_config.get_text_config())
    text.architectures = [text_architecture]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(text, key, None) is None:
            setattr(text, key, getattr(hf_config, key, None))
    return text


def _validate_hf_config(hf_config: Any) -> None:
    architectures = getattr(hf_config, "architectures", None)
    if not architectures:
        raise ValueError("the model config names no architecture (config.json 'architectures')")
    check_architecture(architectures[0])
    _validate_experts(hf_config)
    for kind in LAYER_KINDS:
        _, scaling = rope_settings(hf_config, kind)
        rope_type = (scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )


def _validate_experts(hf_config: Any) -> None:
    sparse_layers(hf_config)
    experts = num_experts(hf_config)
    top_k = int(getattr(hf_config, "num_experts_per_tok", 0) or 0)
    if experts and not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in 1..{experts} (the experts)")


def _resolve_tokenizer(tokenizer: str | None, default: str | None, hub: HubOptions) -> str | None:
    if tokenizer is None:
        return default
    if is_hub_id(tokenizer):
        return hub.fetch(tokenizer, "tokenizer")
    if not os.path.exists(tokenizer):
        raise ValueError(f"tokenizer path {tokenizer!r} does not exist")
    return tokenizer


def _resolve_max_model_len(hf_config: Any, max_model_len: int | None) -> int:
    model_max = int(hf_config.max_position_embeddings)
    if max_model_len is None:
        return model_max
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    if max_model_len > model_max:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"({model_max})"
        )
    return max_model_len


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]
