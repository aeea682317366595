"""`KVCacheScales`: the per-layer, per-KV-head scales of an fp8 (e4m3) KV cache.

The cache stores value / scale, so a key or value of magnitude up to `FP8_MAX` x scale is
representable; the scale of each KV head is computed from real activations: the largest
magnitude its keys (values) reach while the scales calibrate, times `HEADROOM`, maps to
e4m3's largest finite value. The model runner calibrates once, before the cache holds anything
it keeps and before any CUDA graph is captured (`ModelRunner.calibrate_kv_scales`): a prefill of
random tokens inside `calibrating(...)`, where each `Attention` layer observes the keys and
values it is about to write. A checkpoint that carries its scales (`k_scale` / `v_scale`, per
tensor or per KV head, as vLLM and llm-compressor write them) gives them instead (`load`), and
then nothing calibrates.

The scales are one device tensor [2, num_kv_heads] (float32; row 0 keys, row 1 values) that the
kernels read by address: a captured graph reads the values it holds at replay, and because they
never change after calibration every block of the cache, swapped out and back in or copied,
decodes with the scale it was written with.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
HEADROOM = 2.0  # calibrated magnitudes map to FP8_MAX / HEADROOM: later tokens may reach twice


class KVCacheScales:
    """The scales of one layer's fp8 cache, 1.0 until observed (`observe`)."""

    def __init__(self, num_kv_heads: int, device: torch.device | str) -> None:
        if num_kv_heads < 1:
            raise ValueError(f"num_kv_heads must be >= 1, got {num_kv_heads}")
        self.scales = torch.ones(2, num_kv_heads, dtype=torch.float32, device=device)
        self._amax = torch.zeros_like(self.scales)
        self.calibrating = False
        self._from_checkpoint = [False, False]  # keys, values

    @property
    def from_checkpoint(self) -> bool:
        """Whether both the key and the value scales were loaded (`load`): no calibration."""
        return all(self._from_checkpoint)

    @property
    def partly_from_checkpoint(self) -> bool:
        return any(self._from_checkpoint)

    def load(self, index: int, scale: torch.Tensor, first_head: int) -> None:
        """A checkpoint's key (`index` 0) or value (1) scale: one for the whole tensor, or one
        per KV head of the model, of which this layer keeps `first_head` onwards (its rank's
        heads). ValueError for another shape or a scale that is not positive and finite."""
        heads = self.scales.shape[1]
        values = scale.detach().float().reshape(-1)
        if values.numel() == 1:
            values = values.expand(heads)
        elif first_head + heads <= values.numel():
            values = values[first_head : first_head + heads]
        else:
            raise ValueError(
                f"a KV-cache scale of shape {list(scale.shape)}: one per tensor or one per KV "
                f"head expected (this layer keeps heads {first_head}..{first_head + heads - 1})"
            )
        if not bool(torch.isfinite(values).all() and (values > 0).all()):
            raise ValueError(f"KV-cache scales must be positive and finite, got {values.tolist()}")
        self.scales[index].copy_(values)
        self._from_checkpoint[index] = True

    @property
    def k_scale(self) -> torch.Tensor:
        """[num_kv_heads] float32: stored key = key / k_scale."""
        return self.scales[0]

    @property
    def v_scale(self) -> torch.Tensor:
        """[num_kv_heads] float32: stored value = value / v_scale."""
        return self.scales[1]

    def observe(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Widen the scales to cover `key` / `value` ([T, num_kv_heads * D] or [T, num_kv_heads,
        D]): each head's scale becomes HEADROOM x its largest magnitude seen / FP8_MAX (1.0
        while a head has seen only zeros). Device ops only, written in place."""
        if key.numel() == 0:
            return
        heads = self.scales.shape[1]
        amax = torch.stack(
            [x.reshape(x.shape[0], heads, -1).abs().amax(dim=(0, 2)) for x in (key, value)]
        )
        torch.maximum(self._amax, amax.float(), out=self._amax)
        scales = torch.where(self._amax > 0, self._amax * (HEADROOM / FP8_MAX), 1.0)
        self.scales.copy_(scales)

    def values(self) -> tuple[list[float], list[float]]:
        """(k_scale, v_scale) per KV head, on the host."""
        keys, values = self.scales.tolist()
        return keys, values


@contextmanager
def calibrating(scales: Iterable[KVCacheScales]) -> Iterator[None]:
    """Every forward inside observes the keys and values its layer writes."""
    members = list(scales)
    for member in members:
        member.calibrating = True
    try:
        yield
    finally:
        for member in members:
            member.calibrating = False
