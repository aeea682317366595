"""`attnserve bench kernels`: its options, and the kernel sweeps on the CPU through Triton's
interpreter at tiny shapes (every run checked against fp32 attention over the dense K/V; the
timings themselves are not asserted)."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is decorated

from attnserve.attention.ops.triton_common import KernelConfig
from attnserve.bench.kernel_sweep import (
    Setup,
    SweepRow,
    check_and_time,
    format_sweep,
    sweep_decode,
    sweep_prefill,
)
from attnserve.cli import main

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = Setup(head_size=32, dtype=torch.float32, device=DEVICE, atol=1e-3, calls=1, repeats=1)
TILE = KernelConfig(32, 16, 4, 1)


def test_decode_sweep_checks_every_tile_and_split_count() -> None:
    torch.manual_seed(0)
    rows = sweep_decode((2, 40, 4, 2), [1, 2], [TILE], 1.0, TINY, deadline=math.inf)
    assert [row.status for row in rows] == ["ok"] * len(rows)
    assert all(row.max_err is not None and row.max_err < 1e-3 for row in rows)
    assert all(row.median_us is not None and row.rate is not None for row in rows)
    assert sum(row.default for row in rows) == 1 and rows[0].default
    splits = {row.config.rsplit(", ", 1)[1] for row in rows}
    assert splits == {"1 splits", "2 splits"}
    assert any(row.config.startswith("32x16 w4 s1") for row in rows)


def test_prefill_sweep_checks_every_key_source_against_sdpa() -> None:
    torch.manual_seed(0)
    grid = [("cache", TILE), ("pointers", TILE)]
    rows = sweep_prefill((2, 24, 4, 2), grid, TINY, deadline=math.inf)
    assert [row.config for row in rows] == [
        "sdpa-contiguous",
        "default tile, keys: default",
        "32x16 w4 s1, keys: cache",
        "32x16 w4 s1, keys: pointers",
    ]
    assert [row.status for row in rows] == ["ok"] * 4
    assert all(row.max_err is not None and row.max_err < 1e-3 for row in rows)
    assert rows[0].vs_baseline == 1.0
    assert [row.default for row in rows] == [False, True, False, False]


def test_fp8_sweeps_check_against_the_stored_values_and_count_fp8_bytes() -> None:
    torch.manual_seed(0)
    setup = dataclasses.replace(TINY, kv_cache_dtype="fp8")
    shape = (2, 40, 4, 2)
    decode = sweep_decode(shape, [1], [TILE], 1.0, setup, deadline=math.inf)
    prefill = sweep_prefill(shape, [("cache", TILE), ("pointers", TILE)], setup, math.inf)
    assert [row.status for row in decode + prefill] == ["ok"] * len(decode + prefill)
    assert all(row.max_err is not None and row.max_err < 1e-3 for row in decode + prefill)
    kv_bytes = 2 * 2 * 40 * 2 * 32  # K and V, batch, tokens, KV heads, head size: one byte each
    for row in decode:
        assert row.rate is not None and row.median_us is not None
        assert row.rate * row.median_us * 1e6 == pytest.approx(kv_bytes)


def test_runs_past_the_deadline_are_skipped_not_timed() -> None:
    rows = sweep_decode((2, 40, 4, 2), [2], [TILE], 1.0, TINY, deadline=-math.inf)
    assert {row.status for row in rows} == {"skipped: time budget spent"}
    assert all(row.median_us is None for row in rows)


def test_a_wrong_or_failing_run_is_reported_and_not_timed() -> None:
    want = torch.ones(4)
    out = torch.zeros(4)
    status, err, us = check_and_time(lambda: None, out, want, TINY, graph=False)
    assert status.startswith("wrong: max err 1") and err == 1.0 and us is None

    def broken() -> None:
        raise RuntimeError("out of resources: shared memory\nmore detail")

    status, err, us = check_and_time(broken, out, want, TINY, graph=False)
    assert status == "failed: RuntimeError: out of resources: shared memory"
    assert err is None and us is None


def test_the_sweep_table_marks_the_default_and_names_the_best() -> None:
    rows = [
        SweepRow("decode", "2x40 4/2", "default tile, 1 splits", "ok", 0.0, 20.0, 1.0, 0.5, True),
        SweepRow("decode", "2x40 4/2", "32x16 w4 s1, 1 splits", "ok", 0.0, 10.0, 2.0, 1.0),
        SweepRow("decode", "2x40 4/2", "64x16 w4 s1, 1 splits", "failed: RuntimeError: x"),
    ]
    table = format_sweep(rows).splitlines()
    assert table[2].startswith("    32x16") and table[3].startswith("  * default tile")
    assert table[4].endswith("failed: RuntimeError: x")
    assert table[5] == "  best: 32x16 w4 s1, 1 splits (2.00 TB/s)"


@pytest.mark.parametrize(
    "options",
    [["--sweep", "decode,bogus"], ["--sweep", ""], ["--splits", "2,0"], ["--splits", "x"]],
)
def test_bad_sweep_options_are_usage_errors(options: list[str]) -> None:
    with pytest.raises(SystemExit) as error:
        main(["bench", "kernels", *options])
    assert error.value.code == 2
