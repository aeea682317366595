"""The throughput bound of an offline workload, from the model's shape and two rates measured in
the same run: device copy bandwidth (bytes read + written, `bench kernels`' copy) and a large
square matmul in the model's dtype.

The bound assumes every request runs at once (one prefill of all prompts, then decode steps with
every unfinished request) and perfect overlap of memory traffic and arithmetic:

- prefill: all prompt tokens at the matmul rate: 2 × decoder matmul weights × prompt tokens +
  2 × lm_head weights per request (logits of the last token only) + causal attention
  (4 × heads × head size per attended query-key pair per layer);
- decode step k (k = 1 .. max output − 1; prefill drew each request's first token): the requests
  with more than k output tokens each attend to input + k keys; the step reads every weight once
  plus the K and V of every attended key in every layer, and does 2 × matmul weights per token
  plus the attention FLOPs; its time is max(bytes / copy rate, FLOPs / matmul rate) (max, not
  sum: a roofline, so the bound is optimistic and a real upper bound);
- bound tokens/s = output tokens / (prefill time + the sum of the decode step times).

Weight bytes are the decoder's matmul and norm weights and lm_head, in the model dtype; an untied
input embedding is not counted (a step gathers only its tokens' rows). Quantized matmul weights
count as stored: FP8, one byte (the LM head and the experts stay in the model dtype); packed
GGUF, the smallest packed type's 18 bytes per 32 weights (Q4_0, so the bound stays a bound), the
LM head too. Keys beyond a layer's sliding window are not counted, layer by layer (Gemma's
local layers read at most their window, its global ones every key).

A mixture-of-experts model multiplies each token by its `top_k` experts only (the FLOPs count
those and the router), and a step reads the experts its tokens were routed to: for B tokens
under uniform routing, E·(1 − (1 − k/E)^B) of the E experts of each sparse layer (dummy weights
route near-uniformly; a model whose routing is skewed reads fewer).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from attnserve.bench.kernel_common import copy_bandwidth_tbs, median_us
from attnserve.model.config import ModelConfig, layer_sliding_windows, sparse_layers
from attnserve.model.layers.moe import MoESpec
from attnserve.model.loader import get_model_cls
from attnserve.model.models.moe import MoeForCausalLM

_GGUF_BYTES = 18 / 32  # Q4_0: a float16 scale and 32 four-bit codes
_QUANTIZED_BYTES = {"fp8": 1.0, "gguf": _GGUF_BYTES}
# (copy buffer bytes, matmul size, calls per timing, timings): large on a GPU, small elsewhere
_CUDA_PROBE = (2 << 30, 8192, 10, 10)
_HOST_PROBE = (64 << 20, 1024, 1, 3)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int
    kv_dtype_bytes: int
    layer_windows: tuple[int | None, ...] = ()  # each layer's sliding window (None: global)
    sparse_layers: int = 0  # MoE layers (the others are dense)
    num_experts: int = 0
    top_k: int = 0
    expert_intermediate_size: int = 0
    matmul_weight_bytes: float | None = None  # per shared matmul weight (None: dtype_bytes)
    lm_head_weight_bytes: float | None = None  # per LM head weight (None: dtype_bytes)

    @classmethod
    def from_config(cls, config: ModelConfig, kv_cache_dtype: str = "auto") -> ModelShape:
        dtype_bytes = config.dtype.itemsize
        spec = moe_spec(config)
        experts: dict[str, int] = {}
        if spec is not None:
            experts = {
                "sparse_layers": sum(sparse_layers(config.hf_config)),
                "num_experts": spec.num_experts,
                "top_k": spec.top_k,
                "expert_intermediate_size": spec.intermediate_size,
            }
        return cls(
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_size=config.head_size,
            intermediate_size=int(config.hf_config.intermediate_size),
            vocab_size=config.vocab_size,
            dtype_bytes=dtype_bytes,
            kv_dtype_bytes=1 if kv_cache_dtype == "fp8" else dtype_bytes,
            layer_windows=_layer_windows(config),
            matmul_weight_bytes=_QUANTIZED_BYTES.get(config.quantization or ""),
            lm_head_weight_bytes=_GGUF_BYTES if config.quantization == "gguf" else None,
            **experts,
        )

    @property
    def expert_params(self) -> int:
        """One expert's gated MLP."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def _shared_params(self) -> int:
        """The matmul weights every token is multiplied by: q, k, v, o of every layer, the gated
        MLPs of the dense layers, the routers of the sparse ones."""
        qkv_o = self.hidden_size * self.head_size * (2 * self.num_heads + 2 * self.num_kv_heads)
        dense_layers = self.num_layers - self.sparse_layers
        mlps = dense_layers * 3 * self.hidden_size * self.intermediate_size
        routers = self.sparse_layers * self.hidden_size * self.num_experts
        return self.num_layers * qkv_o + mlps + routers

    @property
    def decoder_matmul_params(self) -> int:
        """The decoder weights one token is multiplied by: q, k, v, o and the gated MLP's three
        projections (or the router and `top_k` experts), over all layers."""
        return self._shared_params + self.sparse_layers * self.top_k * self.expert_params

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def experts_read(self, tokens: int) -> float:
        """Experts of one sparse layer that `tokens` tokens are routed to (uniform routing)."""
        if not self.num_experts:
            return 0.0
        return float(self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** tokens))

    def step_weight_bytes(self, tokens: int) -> float:
        """Bytes of the weights a forward pass of `tokens` tokens reads (see the docstring)."""
        experts = self.sparse_layers * self.experts_read(tokens) * self.expert_params
        return self._shared_weight_bytes + experts * self.dtype_bytes

    @property
    def _shared_weight_bytes(self) -> int:
        norms = (2 * self.num_layers + 1) * self.hidden_size
        matmul = self.matmul_weight_bytes or self.dtype_bytes
        lm_head = self.lm_head_weight_bytes or self.dtype_bytes
        return int(
            self._shared_params * matmul + self.lm_head_params * lm_head + norms * self.dtype_bytes
        )

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.kv_dtype_bytes

    @property
    def attention_flops_per_pair(self) -> int:
        """Q·K and P·V for one query-key pair, all heads and layers."""
        return 4 * self.num_layers * self.num_heads * self.head_size

    @property
    def windows(self) -> list[int | None]:
        """Each layer's sliding window (None: the layer attends to every key)."""
        return list(self.layer_windows) or [None] * self.num_layers

    def layer_keys(self, keys: npt.NDArray[np.float64]) -> float:
        """Query-key pairs of one decode token per sequence (`keys`: each one's keys), summed
        over the layers, each capped at its window: in units of one layer's pair."""
        return float(sum(np.minimum(keys, w).sum() if w else keys.sum() for w in self.windows))

    def prefill_pairs(self, length: int) -> int:
        """Query-key pairs of one causal prompt, summed over the layers (as `layer_keys`)."""
        return sum(causal_pairs(length, w) for w in self.windows)


@dataclass(frozen=True)
class Rates:
    copy_bytes_per_s: float
    matmul_flops_per_s: float

    def figures(self) -> dict[str, float]:
        """The rates as a benchmark reports them."""
        return {
            "copy_tb_per_s": self.copy_bytes_per_s / 1e12,
            "matmul_tflop_per_s": self.matmul_flops_per_s / 1e12,
        }


@dataclass(frozen=True)
class Bound:
    output_tokens: int
    prefill_s: float
    decode_s: float
    decode_steps: int
    memory_bound_steps: int

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def _layer_windows(config: ModelConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window; () where no layer has one."""
    windows = tuple(layer_sliding_windows(config.hf_config))
    return windows if any(windows) else ()


def moe_spec(config: ModelConfig) -> MoESpec | None:
    """The experts of the model's sparse layers (None for a dense model)."""
    model_cls = get_model_cls(config.architecture)
    if not issubclass(model_cls, MoeForCausalLM):
        return None
    return model_cls.moe_spec(config.hf_config)


def _check_lengths(input_lens: list[int], output_lens: list[int]) -> None:
    if not input_lens or len(input_lens) != len(output_lens):
        raise ValueError("the bound needs one input and one output length per request")
    if min(input_lens) < 1 or min(output_lens) < 1:
        raise ValueError("input and output lengths must be >= 1")


def causal_pairs(length: int, window: int | None) -> int:
    """Query-key pairs of one causal prompt: query i attends to min(i, window) keys (1-based)."""
    if window is None or length <= window:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def prefill_flops(shape: ModelShape, input_lens: list[int]) -> int:
    """Every prompt at once: its matmuls, one lm_head row per request, causal attention."""
    pairs = sum(shape.prefill_pairs(n) for n in input_lens)
    matmuls = 2 * (shape.decoder_matmul_params * sum(input_lens))
    logits = 2 * shape.lm_head_params * len(input_lens)
    return matmuls + logits + shape.attention_flops_per_pair // shape.num_layers * pairs


def workload_bound(
    shape: ModelShape, input_lens: list[int], output_lens: list[int], rates: Rates
) -> Bound:
    """The bound of the module docstring for requests with these lengths."""
    _check_lengths(input_lens, output_lens)
    inputs = np.asarray(input_lens, dtype=np.float64)
    outputs = np.asarray(output_lens)
    params = shape.decoder_matmul_params + shape.lm_head_params
    kv_bytes_per_layer_key = shape.kv_bytes_per_token / shape.num_layers
    flops_per_layer_pair = shape.attention_flops_per_pair / shape.num_layers
    decode_s, memory_bound = 0.0, 0
    steps = int(outputs.max()) - 1
    for k in range(1, steps + 1):
        keys = inputs[outputs > k] + k
        layer_keys = shape.layer_keys(keys)
        step_bytes = shape.step_weight_bytes(len(keys)) + kv_bytes_per_layer_key * layer_keys
        flops = 2 * params * len(keys) + flops_per_layer_pair * layer_keys
        memory_s, compute_s = step_bytes / rates.copy_bytes_per_s, flops / rates.matmul_flops_per_s
        decode_s += max(memory_s, compute_s)
        memory_bound += int(memory_s >= compute_s)
    prefill_s = prefill_flops(shape, input_lens) / rates.matmul_flops_per_s
    return Bound(int(outputs.sum()), prefill_s, float(decode_s), steps, memory_bound)


def matmul_flops_per_s(
    size: int, dtype: torch.dtype, device: str, calls: int = 10, repeats: int = 10
) -> float:
    """Rate of a `size`³ matmul in `dtype` on `device`."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    out = torch.empty_like(a)
    us = median_us(lambda: torch.mm(a, b, out=out), calls, repeats, device)
    return 2 * size**3 / us * 1e6


def measure_rates(device: torch.device, dtype: torch.dtype) -> Rates:
    """Copy bandwidth and matmul rate on `device` (before the engine takes its memory)."""
    copy_bytes, size, calls, repeats = _CUDA_PROBE if device.type == "cuda" else _HOST_PROBE
    name = str(device)
    copy = copy_bandwidth_tbs(copy_bytes, name, calls, repeats) * 1e12
    rates = Rates(copy, matmul_flops_per_s(size, dtype, name, calls, repeats))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rates
