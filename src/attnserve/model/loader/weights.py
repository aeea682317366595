"""Weight sources other than GGUF: a directory of safetensors files, and seeded dummy init."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

DUMMY_STD = 0.02


def iter_safetensors(directory: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every *.safetensors file in `directory`, by checkpoint name."""
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
                yield name, handle.get_tensor(name)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Seeded random weights on the parameters' own device: norms 1, the rest N(0, 0.02)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        param.normal_(0.0, DUMMY_STD, generator=generators[param.device])
