"""`quantization="fp8"` on a CUDA GPU with FP8 matmuls (compute capability 8.9+: Ada, Hopper).

- The FP8 linear (cuBLASLt `_scaled_mm`, row-wise scales) against the product of its own rounded
  operands in float32 (relative error under `ROUNDED_TOL`: the bf16 output and the order of the
  sums only) and against bf16 `F.linear` on the unrounded ones (under `BF16_TOL`: E4M3 keeps 3
  mantissa bits of both operands; about 3.5% is expected for random operands).
- The engine on Qwen3-0.6B's shape, dummy weights, bf16 against FP8 on the same weights: greedy
  decode through CUDA graphs equals eager decode, and the final hidden states and logits of
  the FP8 model stay near the bf16 model's (relative error, top-1 agreement; printed). Random
  weights give flat, chaotic logits: on the CPU (float32 activations, torch's CPU `_scaled_mm`)
  the same comparison measured a hidden-state error of 0.156 and a top-1 agreement of 0.625
  over 112 positions; the bounds leave room for that, while a wrong scale gives errors near 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnserve import LLM, SamplingParams
from attnserve.model import ModelConfig
from attnserve.model.loader import load_model
from attnserve.model.quantization.fp8 import fp8_linear, quantize_rows
from tests.model.paged import PagedRunner

pytestmark = pytest.mark.cuda

ROUNDED_TOL = 1e-2
BF16_TOL = 6e-2
HIDDEN_TOL = 0.3  # relative error of the final hidden states, FP8 against bf16
TOP1_MIN = 0.5  # share of positions where the two models' top-1 tokens agree
MODEL = "qwen3-0.6b"


def _fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(not _fp8_capable(), reason="needs compute capability 8.9+")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@needs_fp8
@pytest.mark.parametrize(("m", "k", "n"), [(1, 4096, 4096), (7, 4096, 14336), (256, 4096, 6144),
                                           (1000, 14336, 4096)])  # fmt: skip
def test_fp8_linear_against_its_rounded_operands_and_bf16(m: int, k: int, n: int) -> None:
    generator = torch.Generator("cuda").manual_seed(m + k + n)
    x = torch.randn(m, k, device="cuda", generator=generator).bfloat16()
    weight = (0.02 * torch.randn(n, k, device="cuda", generator=generator)).bfloat16()
    bias = torch.randn(n, device="cuda", generator=generator).bfloat16()
    weight_q, weight_scale = quantize_rows(weight)
    got = fp8_linear(x, weight_q, weight_scale, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    x_q, x_scale = quantize_rows(x)
    rounded = (x_q.float() * x_scale[:, None]) @ (weight_q.float() * weight_scale[:, None]).t()
    assert _relative(got, rounded + bias.float()) < ROUNDED_TOL
    assert _relative(got, F.linear(x, weight, bias)) < BF16_TOL


@needs_fp8
@pytest.mark.parametrize(("m", "k"), [(1, 4096), (300, 14336), (5, 1000)])
def test_one_launch_quantization_equals_the_torch_ops(m: int, k: int) -> None:
    from attnserve.model.quantization import fp8_quant

    generator = torch.Generator("cuda").manual_seed(m + k)
    x = (3 * torch.randn(m, k, device="cuda", generator=generator)).bfloat16()
    x[0, :7] = 0.0
    got, got_scale = fp8_quant.quantize_rows(x)
    expected, scale = quantize_rows(x.cpu())  # the torch ops, on the CPU
    assert torch.equal(got_scale.cpu(), scale)
    assert torch.equal(got.cpu().view(torch.uint8), expected.view(torch.uint8))


def _same_bits(got: tuple[torch.Tensor, torch.Tensor], expected: torch.Tensor) -> bool:
    """`got` (E4M3 values, scales) is `expected` quantized per row by the torch ops."""
    values, scale = quantize_rows(expected.cpu())
    return torch.equal(got[1].cpu(), scale) and torch.equal(
        got[0].cpu().view(torch.uint8), values.view(torch.uint8)
    )


def _near_bits(got: tuple[torch.Tensor, torch.Tensor], expected: torch.Tensor) -> None:
    """`got` is `expected` quantized per row up to the norm's last bit: rows equal bit for bit
    but for a few, each within a bf16 step of the norm (its float32 sum may be added in
    another order) and so within one E4M3 step after quantization."""
    values, scale = quantize_rows(expected.cpu())
    got_values, got_scale = got[0].cpu(), got[1].cpu()
    same_rows = (got_values.view(torch.uint8) == values.view(torch.uint8)).all(-1)
    same_rows &= got_scale == scale
    assert float(same_rows.float().mean()) >= 0.99
    torch.testing.assert_close(got_scale, scale, rtol=2**-7, atol=0)
    dequantized, reference = (
        got_values.float() * got_scale[:, None],
        values.float() * scale[:, None],
    )
    assert bool(((dequantized - reference).abs() <= 2**-3 * reference.abs() + 1e-6).all())


@needs_fp8
@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("m", [1, 300, 4096])
def test_the_quantizing_norm_and_activation_equal_the_separate_ops(
    m: int, unit_offset: bool
) -> None:
    """The kernels an FP8 layer's input comes from (RMSNorm, Llama's or Gemma's, with and
    without the residual add, and SiLU-and-mul or GeGLU, quantizing in the same launch) write
    what the separate ops and the torch quantization write: the activations bit for bit, the
    norms up to their last bit."""
    from attnserve.model.layers import fused_ops

    generator = torch.Generator("cuda").manual_seed(m)
    x, residual = (3 * torch.randn(2, m, 4096, device="cuda", generator=generator)).bfloat16()
    weight = (1 + 0.1 * torch.randn(4096, device="cuda", generator=generator)).bfloat16()
    got, summed = fused_ops.rms_norm_fp8(x, None, weight, 1e-6, unit_offset)
    assert summed is None
    _near_bits(got, fused_ops.rms_norm(x, weight, 1e-6, unit_offset))
    got, summed = fused_ops.rms_norm_fp8(x, residual, weight, 1e-6, unit_offset)
    normed, expected_sum = fused_ops.fused_add_rms_norm(x, residual, weight, 1e-6, unit_offset)
    assert summed is not None and torch.equal(summed, expected_sum)
    _near_bits(got, normed)
    gate_up = (3 * torch.randn(m, 2 * 14336, device="cuda", generator=generator)).bfloat16()
    if unit_offset:
        quantized, plain = fused_ops.gelu_tanh_and_mul_fp8, fused_ops.gelu_tanh_and_mul
    else:
        quantized, plain = fused_ops.silu_and_mul_fp8, fused_ops.silu_and_mul
    assert _same_bits(quantized(gate_up), plain(gate_up))


@needs_fp8
@pytest.mark.parametrize(("m", "k", "n"), [(1, 4096, 6144), (5, 14336, 4096), (16, 4096, 28672),
                                           (32, 14336, 4096), (64, 4096, 4096), (100, 4096, 6144),
                                           (128, 14336, 4096), (160, 4096, 28672),
                                           (200, 4096, 28672), (256, 14336, 4096),
                                           (300, 14336, 4096), (2048, 4096, 28672)])  # fmt: skip
def test_the_triton_fp8_gemm_against_its_rounded_operands(m: int, k: int, n: int) -> None:
    """Every tile shape the GEMM would run this product with (the one picked for the shape,
    if any: split over K at 1-256 rows of the 4096-row weights; and the default), against
    float32 on the same E4M3 operands."""
    from attnserve.model.quantization import fp8_gemm

    generator = torch.Generator("cuda").manual_seed(m + n)
    x_q, x_scale = quantize_rows(torch.randn(m, k, device="cuda", generator=generator))
    w_q, w_scale = quantize_rows(torch.randn(n, k, device="cuda", generator=generator))
    rounded = (x_q.float() * x_scale[:, None]) @ (w_q.float() * w_scale[:, None]).t()
    configs = {fp8_gemm.pick_config(m, n, k), fp8_gemm.default_config(m, 128)} - {None}
    for config in configs:
        got = fp8_gemm.scaled_mm(x_q, x_scale, w_q, w_scale, torch.bfloat16, config=config)
        assert _relative(got, rounded) < ROUNDED_TOL, config


@needs_fp8
@pytest.mark.parametrize(("m", "split"), [(1, 2), (37, 4), (64, 8)])
def test_the_split_k_fp8_gemm_equals_the_unsplit_one(m: int, split: int) -> None:
    """Split-K (each program a slice of K, the slices' sums added and scaled in a second
    launch) against the same tile over the whole K: equal up to the order of float32 sums."""
    from attnserve.model.quantization import fp8_gemm

    generator = torch.Generator("cuda").manual_seed(m + split)
    x_q, x_scale = quantize_rows(torch.randn(m, 14336, device="cuda", generator=generator))
    w_q, w_scale = quantize_rows(torch.randn(4096, 14336, device="cuda", generator=generator))
    config = fp8_gemm.GemmConfig(16, 64, 256, 4, 3, split_k=split)
    got, unsplit = (
        fp8_gemm.scaled_mm(x_q, x_scale, w_q, w_scale, torch.float32, config=c)
        for c in (config, fp8_gemm.GemmConfig(16, 64, 256, 4, 3))
    )
    assert _relative(got, unsplit) < 1e-5


@needs_fp8
@pytest.mark.parametrize("m", [1, 5, 17, 200, 1000])
def test_the_block_scaled_gemm_equals_the_torch_definition(m: int) -> None:
    """A block-wise FP8 layer's product on CUDA against the same product in float32 torch ops
    on the CPU: by the Triton GEMM (scaling each K block as it adds it) at every size, and by
    cuBLAS's block-scaled GEMM, which Hopper runs, for more than 16 rows (rows padded to 4)."""
    from attnserve.model.quantization.fp8_block import (
        cublas_block_scaled,
        fp8_block_linear,
        uniform_blocks,
    )

    generator = torch.Generator("cuda").manual_seed(m)
    x = torch.randn(m, 4096, device="cuda", generator=generator).bfloat16()
    weight = 0.02 * torch.randn(6144, 4096, device="cuda", generator=generator)
    blocks = weight.reshape(48, 128, 32, 128).abs().amax(dim=(1, 3)) / 448.0
    per_row = blocks.repeat_interleave(128, 0)
    w_q = (weight.reshape(6144, 32, 128) / per_row[:, :, None]).to(torch.float8_e4m3fn)
    w_q = w_q.reshape(6144, 4096)
    expected = fp8_block_linear(x.cpu().float(), w_q.cpu(), per_row.cpu(), 128, None)
    hopper = torch.cuda.get_device_capability() == (9, 0) and hasattr(F, "scaled_mm")
    assert cublas_block_scaled(x.device, torch.bfloat16) == hopper
    assert torch.equal(uniform_blocks(per_row, (128, 128)), blocks)
    for cublas in (None, blocks) if hopper else (None,):
        got = fp8_block_linear(x, w_q, per_row, 128, None, cublas)
        assert got.dtype == torch.bfloat16 and got.shape == (m, 6144)
        assert _relative(got.cpu(), expected) < ROUNDED_TOL


def _engine(quantization: str | None, enforce_eager: bool) -> LLM:
    return LLM(
        MODEL,
        load_format="dummy",
        dtype="bfloat16",
        quantization=quantization,
        enforce_eager=enforce_eager,
        max_model_len=512,
        max_num_seqs=8,
        kv_cache_memory_bytes=1 << 30,
    )


@needs_fp8
def test_fp8_decode_through_cuda_graphs_equals_eager() -> None:
    prompts = [[(7 * i + 3 * j) % 1000 + 5 for j in range(n)] for i, n in enumerate((5, 40, 130))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = []
    for eager in (True, False):
        llm = _engine("fp8", enforce_eager=eager)
        tokens.append(
            [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        )
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    assert tokens[0] == tokens[1]


@needs_fp8
def test_fp8_model_tracks_the_bf16_model_on_the_same_weights() -> None:
    """Teacher-forced on random prompts (one prefill, then decode steps of the prompts' own
    next tokens): both models' final hidden states and logits at every position."""
    prompts = [torch.randint(5, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (9, 33, 70)]  # fmt: skip
    logits, hidden = {}, {}
    for quantization in (None, "fp8"):
        config = ModelConfig.resolve(
            MODEL, dtype="bfloat16", load_format="dummy", device="cuda", max_model_len=256,
            quantization=quantization,
        )  # fmt: skip
        model = load_reference_model_on_cuda(config)
        states: list[torch.Tensor] = []
        model.register_forward_hook(lambda _m, _a, out, keep=states.append: keep(out.float()))
        runner = PagedRunner(model, config, max_len=80, seqs=len(prompts), device="cuda")
        logits[quantization] = torch.cat(runner.run([p[:-4] for p in prompts],
                                                    [p[-4:] for p in prompts]))  # fmt: skip
        hidden[quantization] = torch.cat(states)
        del model, runner
        torch.cuda.empty_cache()
    hidden_error = _relative(hidden["fp8"], hidden[None])
    agreement = float((logits["fp8"].argmax(-1) == logits[None].argmax(-1)).float().mean())
    print(
        f"FP8 vs bf16: final hidden states relative error {hidden_error:.4f}, "
        f"logits relative error {_relative(logits['fp8'], logits[None]):.4f}, "
        f"top-1 agreement {agreement:.3f} over {len(logits[None])} positions"
    )
    assert hidden_error < HIDDEN_TOL and agreement >= TOP1_MIN


def load_reference_model_on_cuda(config: ModelConfig) -> torch.nn.Module:
    """`tests.model.paged.load_reference_model` on the GPU: TORCH_SDPA, bound as the model
    runner binds a backend."""
    from attnserve.attention import attention_specs, bind_attention_backend, get_model_attn_backend

    model = load_model(config, torch.device("cuda"), block_size=4)
    bind_attention_backend(model, get_model_attn_backend(attention_specs(model), "TORCH_SDPA"))
    return model


@needs_fp8
def test_fp8_weights_with_the_fp8_kv_cache() -> None:
    """Both quantizations at once, decode steps from CUDA graphs: the run completes and its
    first greedy tokens are the FP8-weights run's with a bf16 cache (printed: how many)."""
    prompts = [[(11 * i + j) % 900 + 5 for j in range(n)] for i, n in enumerate((6, 50))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = []
    for cache in ("auto", "fp8"):
        llm = LLM(MODEL, load_format="dummy", dtype="bfloat16", quantization="fp8",
                  kv_cache_dtype=cache, max_model_len=512, max_num_seqs=8,
                  kv_cache_memory_bytes=1 << 30)  # fmt: skip
        tokens.append(
            [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        )
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    assert all(len(t) == 16 for t in tokens[1])
    same = [sum(a == b for a, b in zip(x, y, strict=True)) for x, y in zip(*tokens, strict=True)]
    print(f"fp8 KV cache: tokens equal to the bf16-cache run per prompt: {same} of 16")
    assert all(x[0] == y[0] for x, y in zip(*tokens, strict=True))


@needs_fp8
@pytest.mark.cuda(gpus=2)
def test_fp8_over_two_gpus_scores_like_one() -> None:
    """Scales shard with the rows (tests/model/test_fp8.py checks that exactly); over two ranks
    each rank rounds its half of a row-parallel layer's activations, so the prompt's
    log-probabilities move a little (a misplaced scale moves them by whole nats)."""
    prompt = [(13 * j) % 900 + 5 for j in range(40)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    scores = []
    for tp in (1, 2):
        llm = LLM(
            MODEL,
            load_format="dummy",
            dtype="bfloat16",
            quantization="fp8",
            tensor_parallel_size=tp,
            max_model_len=512,
            kv_cache_memory_bytes=1 << 30,
        )
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
        rows = zip(output.prompt_logprobs[1:], prompt[1:], strict=True)
        scores.append(torch.tensor([row[token].logprob for row, token in rows]))
    gap = (scores[0] - scores[1]).abs()
    print(f"fp8 TP=2 vs TP=1 prompt log-probs: mean |gap| {gap.mean():.4f}, max {gap.max():.4f}")
    assert gap.max() < 1.0
