"""Which quantization a model runs in: the `quantization` option against its checkpoint and
device, decided (and refused with a ValueError naming the problem) before any weight is read.

Values (vLLM's option and names): None picks the checkpoint's own: "gguf" for GGUF weights on
the CPU (dequantized elsewhere: the packed kernels are CPU-only), "fp8" for an FP8 checkpoint,
otherwise none. "gguf" keeps a GGUF checkpoint's Q4_0/Q4_1/Q8_0 matrices packed. "fp8" runs an
FP8 checkpoint as stored, or quantizes a float checkpoint's linear layers on load. "none"
dequantizes a GGUF checkpoint into the model's dtype (the weights attnserve ran before).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from attnserve.model.quantization.base import QuantizationConfig

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("gguf", "fp8", "none")


def check_quantization(value: str | None) -> None:
    if value is not None and value not in QUANTIZATION_METHODS:
        raise ValueError(
            f"unknown quantization {value!r}; use one of {list(QUANTIZATION_METHODS)} "
            "(or None: the checkpoint's own)"
        )


def keeps_gguf_packed(requested: str | None, device: str) -> bool:
    """Whether a GGUF checkpoint stays packed: asked for, or by default on the CPU."""
    check_quantization(requested)
    return requested == "gguf" or (requested is None and torch.device(device).type == "cpu")


def resolve_quantization(
    requested: str | None, checkpoint: str | None, device: str, dtype: torch.dtype
) -> str | None:
    """The quantization to run ("gguf", "fp8" or None) for `checkpoint` (the weights' own
    kind: "gguf", "fp8" or None) on `device`; ValueError for a combination that cannot run."""
    check_quantization(requested)
    device_type = torch.device(device).type
    if checkpoint == "gguf":
        return _for_gguf(requested, device_type)
    if requested == "gguf":
        raise ValueError("quantization 'gguf' needs GGUF weights (a .gguf file)")
    if checkpoint == "fp8" and requested == "none":
        raise ValueError(
            "the checkpoint is FP8: quantization 'none' (dequantizing it) is not "
            "supported; use 'fp8' or leave quantization unset"
        )
    if requested == "fp8" or checkpoint == "fp8":
        _check_fp8_device(device, dtype)
        return "fp8"
    return None


def _for_gguf(requested: str | None, device_type: str) -> str | None:
    if requested == "fp8":
        raise ValueError(
            "quantization 'fp8' takes float or FP8 weights, not a GGUF file's; use 'gguf' or 'none'"
        )
    if keeps_gguf_packed(requested, device_type):
        if device_type != "cpu":
            raise ValueError(
                f"quantization 'gguf' runs on the CPU only (packed kernels), not on "
                f"{device_type}; use quantization 'none' to dequantize the weights"
            )
        return "gguf"
    if requested is None:
        logger.info("GGUF weights dequantized on %s (packed kernels: CPU only)", device_type)
    return None


def _check_fp8_device(device: str, dtype: torch.dtype) -> None:
    """ValueError unless `torch._scaled_mm` runs FP8 E4M3 here (CUDA: compute capability 8.9+,
    as on Ada and Hopper; the CPU: where this torch's kernel exists)."""
    target = torch.device(device)
    if target.type == "cuda":
        major, minor = torch.cuda.get_device_capability(target)
        if (major, minor) < (8, 9):
            raise ValueError(
                f"quantization 'fp8' needs FP8 matmuls (compute capability 8.9+, Ada or Hopper); "
                f"{torch.cuda.get_device_name(target)} has {major}.{minor}"
            )
        return
    if not _scaled_mm_runs(target.type, dtype):
        raise ValueError(
            f"quantization 'fp8': torch {torch.__version__} has no FP8 matmul "
            f"(torch._scaled_mm) for {dtype} on {target.type}"
        )


@functools.cache
def _scaled_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether a tiny row-wise scaled FP8 matmul runs on this (non-CUDA) device."""
    fp8 = torch.ones(16, 16, device=device_type).to(torch.float8_e4m3fn)
    scale_a = torch.ones(16, 1, device=device_type)
    scale_b = torch.ones(1, 16, device=device_type)
    try:
        torch._scaled_mm(fp8, fp8.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=dtype)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def quantization_config(
    name: str | None, hf_config: Any, weights_path: str | None
) -> QuantizationConfig | None:
    """The layers' `QuantizationConfig` of a resolved quantization (None: unquantized);
    `weights_path` None: the weights are not read from files (dummy)."""
    if name is None:
        return None
    if name == "gguf":
        from attnserve.model.quantization.gguf import GGUFConfig

        return GGUFConfig()
    from attnserve.model.quantization.fp8_checkpoint import fp8_checkpoint_scheme
    from attnserve.model.quantization.fp8_config import Fp8Config

    scheme = None if weights_path is None else fp8_checkpoint_scheme(hf_config, weights_path)
    return Fp8Config(scheme)
