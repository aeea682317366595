"""Weight sources other than GGUF files: a directory of safetensors files, and seeded dummy init.

A safetensors file may hold GGUF tensors as their blocks (uint8 [N, K/32, block bytes]), named in
its metadata under `GGUF_TYPES_KEY` ({name: GGUF type}): the converted default model is such a
file (`save_with_gguf_blocks`). They load as `GGUFWeight`s when kept packed, else dequantized.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from attnserve.model.quantization.gguf_blocks import GGUFWeight
from attnserve.model.quantization.weight_utils import (
    LoadedWeight,
    full_shape,
    load_weight,
    row_store,
)

GGUF_TYPES_KEY = "attnserve.gguf_types"


def _files(directory: str | Path) -> list[Path]:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {directory}")
    return files


def _open(file: Path) -> object:
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as error:  # safetensors raises its own SafetensorError
        raise ValueError(f"cannot read {file} (truncated or corrupt?): {error}") from error


def _gguf_types(handle: object) -> dict[str, str]:
    metadata = handle.metadata() or {}  # type: ignore[attr-defined]
    types: dict[str, str] = json.loads(metadata.get(GGUF_TYPES_KEY, "{}"))
    return types


def has_gguf_blocks(directory: str | Path) -> bool:
    """Whether a safetensors file of `directory` holds GGUF blocks."""
    for file in _files(directory):
        with _open(file) as handle:  # type: ignore[attr-defined]
            if _gguf_types(handle):
                return True
    return False


def save_with_gguf_blocks(
    weights: Iterable[tuple[str, torch.Tensor | GGUFWeight]], path: Path
) -> None:
    """Write `weights` as one safetensors file, GGUF weights as their blocks."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    for name, weight in weights:
        if isinstance(weight, GGUFWeight):
            tensors[name], types[name] = weight.blocks.contiguous(), weight.qtype
        else:
            tensors[name] = weight.contiguous()
    save_file(tensors, str(path), metadata={GGUF_TYPES_KEY: json.dumps(types)})


DUMMY_STD = 0.02


def iter_safetensors(
    directory: str | Path, lazy: bool = False, keep_packed: bool = False
) -> Iterator[tuple[str, LoadedWeight]]:
    """Every tensor of every *.safetensors file in `directory`, by checkpoint name; with `lazy`,
    as slices read only where a (tensor-parallel) weight loader narrows them. GGUF blocks come
    as `GGUFWeight`s with `keep_packed`, else dequantized to float32."""
    for file in _files(directory):
        with _open(file) as handle:  # type: ignore[attr-defined]
            types = _gguf_types(handle)
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in types:
                    packed = GGUFWeight(types[name], handle.get_tensor(name))
                    yield name, packed if keep_packed else packed.dequantize()
                else:
                    yield name, handle.get_slice(name) if lazy else handle.get_tensor(name)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Seeded random weights on the parameters' own device: norms 1, the rest N(0, 0.02).

    Each parameter's FULL weight comes from a generator seeded by the seed and the parameter's
    name, and its weight loader keeps this rank's shard, so the model is the same whatever the
    tensor-parallel degree. A quantized parameter's weight is drawn in the model's dtype (the
    same values as unquantized) and quantized by its loader.
    """
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        generator = torch.Generator(param.device).manual_seed(seed + zlib.crc32(name.encode()))
        shape = full_shape(param)
        if shape == tuple(param.shape) and row_store(param) is None:
            param.normal_(0.0, DUMMY_STD, generator=generator)
            continue
        dtype = getattr(param, "source_dtype", param.dtype)  # a quantized one: the model's
        full = torch.empty(shape, dtype=dtype, device=param.device)
        load_weight(param, full.normal_(0.0, DUMMY_STD, generator=generator), name)
