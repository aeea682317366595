"""Weight sources other than GGUF: a directory of safetensors files, and seeded dummy init."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from attnserve.model.layers.weight_utils import LoadedWeight, full_shape, load_weight

DUMMY_STD = 0.02


def iter_safetensors(
    directory: str | Path, lazy: bool = False
) -> Iterator[tuple[str, LoadedWeight]]:
    """Every tensor of every *.safetensors file in `directory`, by checkpoint name; with `lazy`,
    as slices read only where a (tensor-parallel) weight loader narrows them."""
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {directory}")
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as error:  # safetensors raises its own SafetensorError
            raise ValueError(f"cannot read {file} (truncated or corrupt?): {error}") from error
        with handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, handle.get_slice(name) if lazy else handle.get_tensor(name)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Seeded random weights on the parameters' own device: norms 1, the rest N(0, 0.02).

    Each parameter's FULL weight comes from a generator seeded by the seed and the parameter's
    name, and its weight loader keeps this rank's shard, so the model is the same whatever the
    tensor-parallel degree.
    """
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        generator = torch.Generator(param.device).manual_seed(seed + zlib.crc32(name.encode()))
        shape = full_shape(param)
        if shape == tuple(param.shape):
            param.normal_(0.0, DUMMY_STD, generator=generator)
            continue
        full = torch.empty(shape, dtype=param.dtype, device=param.device)
        load_weight(param, full.normal_(0.0, DUMMY_STD, generator=generator), name)
