"""`attnserve bench moe`: its shapes (the presets' experts), the ceiling's arithmetic, one tiny
run through the Triton interpreter on the CPU (checked against the torch path; the timings
themselves are not asserted), the table; and `bench throughput` on a tiny MoE checkpoint, the
path `--model qwen3-30b-a3b --load-format dummy` takes on the GPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is decorated

from attnserve.bench.moe import (
    DECODE,
    DECODE_MAX_PAIRS,
    OURS,
    SKIPPED,
    VLLM,
    Ceilings,
    Inputs,
    MoeRow,
    Setup,
    bench_shape,
    best_tiles,
    ceiling,
    expert_spec,
    format_table,
)
from attnserve.cli import main
from attnserve.model.layers.fused_moe import MoEKernelConfig
from attnserve.model.layers.moe import MoESpec
from tests.model.tiny_moe import save_tiny_moe

TINY_SPEC = MoESpec(4, 2, 32, 32, renormalize=True, weights_in_model_dtype=False)
CPU = Setup(device="cpu", dtype=torch.float32, calls=1, repeats=1, graphs=False)


def test_shapes_are_the_presets_experts() -> None:
    qwen = expert_spec("qwen3-30b-a3b")
    assert (qwen.num_experts, qwen.top_k, qwen.hidden_size, qwen.intermediate_size) == (
        128,
        8,
        2048,
        768,
    )
    assert qwen.renormalize
    mixtral = expert_spec("mixtral-8x7b", tensor_parallel_size=2)
    assert (mixtral.num_experts, mixtral.top_k, mixtral.intermediate_size) == (8, 2, 7168)
    with pytest.raises(ValueError, match="no experts"):
        expert_spec("qwen3-0.6b")
    with pytest.raises(ValueError, match="5 ranks do not split"):
        expert_spec("qwen3-30b-a3b", tensor_parallel_size=5)
    with pytest.raises(ValueError, match="must be >= 1"):
        expert_spec("qwen3-30b-a3b", tensor_parallel_size=0)


def test_ceiling_by_hand() -> None:
    ids = torch.tensor([[0, 1], [1, 3], [0, 3]])
    empty = torch.empty(0)
    inputs = Inputs(empty, torch.empty(4, 64, 32, dtype=torch.bfloat16), empty, empty, ids)
    # 3 experts of 3·32·32 weights, bf16: 18432 bytes; 6 pairs · 2 · 3072 = 36864 FLOPs
    experts, us = ceiling(TINY_SPEC, inputs, Ceilings(1e9, 1e9))
    assert experts == 3 and us == pytest.approx(36.864)
    experts, us = ceiling(TINY_SPEC, inputs, Ceilings(1e9, 1e12))
    assert us == pytest.approx(18.432)


def test_a_tiny_run_checks_every_implementation() -> None:
    tiles = [("16x16x16 w4 s1", MoEKernelConfig(16, 16, 16, num_stages=1))]
    many = DECODE_MAX_PAIRS // TINY_SPEC.top_k + 1  # past the decode path's batches
    rows = bench_shape("tiny", TINY_SPEC, [1, many], Ceilings(1e9, 1e9), CPU, tiles)
    assert [(r.batch, r.impl) for r in rows] == [
        (1, OURS), (1, DECODE), (1, VLLM), (1, tiles[0][0]),
        (many, OURS), (many, VLLM), (many, tiles[0][0]),
    ]  # fmt: skip
    for row in rows:
        if row.impl != VLLM:  # vLLM is not installed here (a row with its error if so)
            assert row.error is None and row.median_us is not None
            assert row.max_err is not None and row.max_err < 1e-5
        assert 1 <= row.experts_read <= 4 and row.ceiling_us > 0
    skipped = bench_shape("tiny", TINY_SPEC, [1], Ceilings(1e9, 1e9), CPU, tiles, deadline=0.0)
    assert skipped[-1].error == SKIPPED and skipped[-1].median_us is None
    assert skipped[0].error is None


def test_table_and_best_tile() -> None:
    rows = [
        MoeRow("qwen", 8, OURS, 60, 50.0, median_us=100.0, max_err=0.01),
        MoeRow("qwen", 8, VLLM, 60, 50.0, median_us=120.0, max_err=0.01),
        MoeRow("qwen", 8, DECODE, 60, 50.0, median_us=70.0, max_err=0.01),
        MoeRow("qwen", 8, "a", 60, 50.0, median_us=90.0, max_err=0.0),
        MoeRow("qwen", 8, "b", 60, 50.0, median_us=80.0, max_err=0.0),
        MoeRow("qwen", 8, "c", 60, 50.0, error="failed: RuntimeError: x"),
    ]
    lines = format_table(rows).splitlines()
    assert "50%" in lines[1] and "1.20x" in lines[1]
    assert "1.71x" in lines[3]
    assert lines[6].endswith("error: failed: RuntimeError: x")
    assert best_tiles(rows) == {"qwen 8": "b (80.0 µs)"}


def test_bench_moe_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", "moe"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_throughput_runs_on_a_moe_model(tmp_path: Path) -> None:
    save_tiny_moe(tmp_path / "model", "qwen3-moe-dense-first")
    out = tmp_path / "throughput.json"
    model = ["--model", str(tmp_path / "model"), "--load-format", "dummy", "--device", "cpu"]
    workload = ["--num-prompts", "3", "--min-len", "8", "--max-len", "16"]
    options = ["--profile-steps", "2", "--kv-cache-memory-bytes", str(8 << 20)]
    assert main(["bench", "throughput", *model, *workload, *options, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert 0 < report["fraction_of_bound"] < 1
    assert report["breakdown"]["steps"] == 2
