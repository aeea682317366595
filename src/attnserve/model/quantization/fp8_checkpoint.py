"""Which FP8 checkpoints load as they are: the `quantization_config` of an HF model directory.

Loaded: FP8 E4M3 linear weights with float32 scales per tensor or per output channel (w = q *
scale), activations quantized dynamically per token, or with scales per block of the weight
(`fp8_block`: rows x columns, 128 x 128 in the published Qwen3 and DeepSeek checkpoints),
activations quantized dynamically per token and group of a block's columns; in either of two
spellings:
- `quant_method: "fp8"` (vLLM's / HF's): scales in `weight_scale` (per tensor, as vLLM writes
  them) or `weight_scale_inv` (HF's name; per tensor when `weight_block_size` is null, per
  block when it is [rows, columns]);
- `quant_method: "compressed-tensors"`, `format: "float-quantized"` (llm-compressor's FP8
  schemes): one config group of 8-bit float weights, strategy "tensor", "channel" or "block"
  (`block_structure`), symmetric, with dynamic 8-bit float input activations per token (per
  group of the block's columns with "block"); scales in `weight_scale`.
Everything else is refused by name (static activation scales, weight-only schemes, other
methods, `ignore` lists beyond the LM head, which is never quantized here).
A checkpoint's fp8 KV-cache scales (`self_attn.k_scale` / `v_scale`, or a compressed-tensors
`kv_cache_scheme` of static 8-bit float scales per tensor or per KV head, stored as
`self_attn.k_proj.output_scale` / `v_proj.output_scale`) are used with kv_cache_dtype 'fp8'
instead of calibrating them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED = "FP8 checkpoints with per-tensor, per-channel or block-wise scales"


@dataclass(frozen=True)
class Fp8Scheme:
    """An FP8 checkpoint's layout: the name of its weight scales, and for block-wise scales the
    (rows, columns) of a block (activations then scale per token and group of `columns`)."""

    scale_name: str = "weight_scale"
    block_size: tuple[int, int] | None = None


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    converted: dict[str, Any] = config.to_dict()
    return converted


def fp8_checkpoint_scheme(hf_config: Any, weights_path: str | None = None) -> Fp8Scheme | None:
    """The scheme of an FP8 `quantization_config` (None without one); ValueError for a
    quantization this loader cannot take (see the module docstring). `weights_path` (a
    safetensors directory) tells the scales' name for `quant_method: "fp8"`."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    config = _as_dict(raw)
    method = str(config.get("quant_method", ""))
    if method == "fp8":
        return _fp8_scheme(config, weights_path)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(config)
    raise ValueError(f"the checkpoint is quantized with {method!r}; attnserve loads {SUPPORTED}")


def _fp8_scheme(config: dict[str, Any], weights_path: str | None) -> Fp8Scheme:
    if config.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"FP8 activation_scheme {config['activation_scheme']!r}: only 'dynamic' (per-token "
            "activation scales) is supported"
        )
    _check_ignored(config.get("modules_to_not_convert"))
    block = config.get("weight_block_size")
    if block:
        return Fp8Scheme("weight_scale_inv", _block_size(block, "weight_block_size"))
    inverse = weights_path is not None and _has_tensor_suffix(weights_path, ".weight_scale_inv")
    return Fp8Scheme("weight_scale_inv" if inverse else "weight_scale")


def _block_size(value: Any, field: str) -> tuple[int, int]:
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and v > 0 for v in value)
    ):
        raise ValueError(f"FP8 {field} {value!r}: [rows, columns] of positive ints expected")
    return value[0], value[1]


def _compressed_tensors_scheme(config: dict[str, Any]) -> Fp8Scheme:
    fmt = config.get("format")
    if fmt != "float-quantized":
        raise ValueError(f"compressed-tensors format {fmt!r}: only 'float-quantized' is supported")
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors with {len(groups)} config groups: one is supported")
    group = groups[0]
    if "Linear" not in (group.get("targets") or []):
        raise ValueError(f"compressed-tensors targets {group.get('targets')}: 'Linear' expected")
    block = _check_weights(group.get("weights") or {})
    _check_activations(group.get("input_activations"), block)
    _check_ignored(config.get("ignore"))
    _check_kv_cache_scheme(config.get("kv_cache_scheme"))
    return Fp8Scheme(block_size=block)


def _check_weights(weights: dict[str, Any]) -> tuple[int, int] | None:
    """The block size of 'block' weights (None for 'tensor' and 'channel')."""
    wanted = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False}
    wrong = {k: weights.get(k) for k, v in wanted.items() if weights.get(k) != v}
    if wrong or weights.get("strategy") not in ("tensor", "channel", "block"):
        raise ValueError(
            f"compressed-tensors weights {weights}: only symmetric 8-bit float weights with "
            "strategy 'tensor', 'channel' or 'block' are supported"
        )
    if weights["strategy"] != "block":
        return None
    return _block_size(weights.get("block_structure"), "weights.block_structure")


def _check_activations(activations: dict[str, Any] | None, block: tuple[int, int] | None) -> None:
    """Dynamic 8-bit float activations: per token, or with block-wise weights per token and
    group of the block's columns."""
    if activations is None:
        raise ValueError("weight-only FP8 (no input_activations) is not supported")
    strategy = (
        {"strategy": "token"} if block is None else {"strategy": "group", "group_size": block[1]}
    )
    wanted = {"type": "float", "num_bits": 8, "dynamic": True, **strategy}
    if any(activations.get(k) != v for k, v in wanted.items()):
        raise ValueError(
            f"compressed-tensors input_activations {activations}: only dynamic 8-bit float "
            f"activations with {strategy} are supported"
        )


def _check_kv_cache_scheme(scheme: dict[str, Any] | None) -> None:
    """The fp8 KV-cache scales a checkpoint carries (`self_attn.k_proj.output_scale`): static
    8-bit float, per tensor or per KV head (used with kv_cache_dtype 'fp8')."""
    if scheme is None:
        return
    if (
        scheme.get("type") != "float"
        or scheme.get("num_bits") != 8
        or scheme.get("dynamic")
        or scheme.get("strategy") not in ("tensor", "attn_head")
    ):
        raise ValueError(
            f"compressed-tensors kv_cache_scheme {scheme}: only static 8-bit float scales per "
            "tensor or per KV head ('attn_head') are supported"
        )


def _check_ignored(ignored: list[str] | None) -> None:
    extra = [name for name in ignored or [] if name != "lm_head"]
    if extra:
        raise ValueError(f"FP8 checkpoint keeps {extra} unquantized: not supported (only lm_head)")


def _has_tensor_suffix(directory: str, suffix: str) -> bool:
    from safetensors import safe_open

    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            if any(name.endswith(suffix) for name in handle.keys()):  # noqa: SIM118
                return True
    return False
