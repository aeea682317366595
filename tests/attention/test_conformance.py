"""The backend conformance suite: every registered backend runnable here must pass it.

Each case runs two steps through the backend: step 1 prefills every sequence's context (so the
cache is written by the backend itself), step 2 mixes fresh prefills, chunked prefills and
decodes. Both steps are checked against a dense fp32 attention. A backend run through Triton's
interpreter (on a CPU) runs half of the case grid, chosen to keep every value of every axis.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from attnserve.attention import (
    AttentionBackend,
    as_decode_rows,
    build_metadata,
    set_forward_context,
)
from attnserve.worker.graphs import pad_for_graph
from tests.attention.harness import (
    Case,
    Runner,
    Sequence,
    check_close,
    make_sequences,
    num_cache_blocks,
    reference,
    runs_interpreted,
)

FEATURES: list[dict[str, object]] = [
    {},
    {"sliding_window": 7},
    {"alibi": True},
    {"soft_cap": 5.0},
    {"sliding_window": 19, "alibi": True, "soft_cap": 8.0},
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GRID = ([1, 2, 4, 8], [64, 80, 128], [1, 16, 32, 128])  # GQA group, head size, block size


def _cases() -> list[Case]:
    grid = itertools.product(*GRID)
    cases = []
    for index, (group, head_size, block_size) in enumerate(grid):
        cases.append(
            Case(
                num_kv_heads=2 if group < 8 else 1,
                group=group,
                head_size=head_size,
                block_size=block_size,
                dtype=DTYPES[index % len(DTYPES)],
                seed=index,
                **FEATURES[index % len(FEATURES)],  # type: ignore[arg-type]
            )
        )
    return cases


CASES = _cases()
# Under Triton's interpreter (a second a case) a backend runs half of CASES: those whose grid
# coordinates have an even sum. They still hold every group, head size, block size, dtype and
# feature, and 135 of the 143 pairs of them; compiled, every case runs.
INTERPRETED_SKIPS = frozenset(
    case
    for case, coordinates in zip(
        CASES, itertools.product(*(range(len(axis)) for axis in GRID)), strict=True
    )
    if sum(coordinates) % 2
)
# fp8 caches (per-KV-head scales calibrated on the case's K/V) at FP8_TOLERANCE: a compute dtype
# each, the features, block sizes 1..128, GQA groups 1..8.
FP8_CASES = [
    Case(2, 4, 128, 16, torch.bfloat16, kv_cache_dtype="fp8", seed=100),
    Case(2, 1, 64, 32, torch.float32, kv_cache_dtype="fp8", seed=101, sliding_window=7),
    Case(1, 8, 128, 1, torch.float16, kv_cache_dtype="fp8", seed=102, alibi=True),
    Case(2, 2, 80, 128, torch.bfloat16, kv_cache_dtype="fp8", seed=103, soft_cap=5.0),
    Case(2, 2, 64, 16, torch.float32, kv_cache_dtype="fp8", seed=104),
]


def _lengths(rng: random.Random, block_size: int, short: bool = False) -> list[tuple[int, int]]:
    """(context, query) per sequence: prefills, chunked prefills, then decodes. `short` (for
    interpreted backends): the longest sequences span two blocks instead of three."""
    longest = max(40, block_size + 12 if short else 2 * block_size + 5)
    prefills = [(0, rng.randint(2, longest)) for _ in range(rng.randint(0, 2))]
    chunked = [(rng.randint(1, longest), rng.randint(2, 20)) for _ in range(rng.randint(0, 2))]
    decodes = [(rng.randint(1, longest), 1) for _ in range(rng.randint(1, 4))]
    single = [(0, 1)] if rng.random() < 0.5 else []  # a one-token prompt is a prefill
    return single + prefills + chunked + decodes


def _skip_unsupported(backend: type[AttentionBackend], case: Case, device: str) -> None:
    reasons = backend.unsupported_reasons(case.spec(device))
    if reasons:
        pytest.skip("; ".join(reasons))
    if runs_interpreted(backend, device) and case in INTERPRETED_SKIPS:
        pytest.skip("interpreted: this case's half of the grid runs compiled only")


def _write_context(runner: Runner, seqs: list[Sequence]) -> None:
    """Step 1: prefill each sequence's context through the backend, checking its output."""
    cached = [s for s in seqs if s.context_len > 0]
    if not cached:
        return
    spans = [(0, s.context_len) for s in cached]
    got = runner.step(cached, spans)
    want = torch.cat(
        [reference(runner.case, s, a, b) for s, (a, b) in zip(cached, spans, strict=True)]
    )
    check_close(runner.case, got, want)


def _check_mixed_step(runner: Runner, seqs: list[Sequence]) -> None:
    """Step 2: every sequence's new tokens over its cached context."""
    spans = [(s.context_len, s.length) for s in seqs]
    got = runner.step(seqs, spans)
    want = torch.cat(
        [reference(runner.case, s, a, b) for s, (a, b) in zip(seqs, spans, strict=True)]
    )
    check_close(runner.case, got, want)


def _setup(
    backend: type[AttentionBackend], case: Case, device: str
) -> tuple[Runner, list[Sequence]]:
    _skip_unsupported(backend, case, device)
    rng = random.Random(case.seed)
    lengths = _lengths(rng, case.block_size, short=runs_interpreted(backend, device))
    seqs = make_sequences(case, lengths, rng)
    runner = Runner(backend, case, num_cache_blocks(seqs), device)
    runner.calibrate(seqs)
    return runner, seqs


@pytest.mark.parametrize("case", CASES + FP8_CASES, ids=str)
def test_mixed_batch_matches_dense_reference(
    backend_on_device: tuple[type[AttentionBackend], str], case: Case
) -> None:
    backend, device = backend_on_device
    runner, seqs = _setup(backend, case, device)
    _write_context(runner, seqs)
    _check_mixed_step(runner, seqs)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.sliding_window and c.block_size <= 16] + FP8_CASES[1:2], ids=str
)
def test_window_reads_no_page_behind_it(
    backend_on_device: tuple[type[AttentionBackend], str], case: Case
) -> None:
    """A sliding window's KV-cache group frees a sequence's pages once its next token's window
    has passed them; their places keep stale ids, which may name any block, one the sequence
    holds now included. With the context written, each sequence's pages behind the window of
    its first new token are renamed to its last page: the step's outputs do not change."""
    backend, device = backend_on_device
    runner, seqs = _setup(backend, case, device)
    _write_context(runner, seqs)
    window = case.sliding_window or 0
    renamed = 0
    for seq in seqs:
        behind = max(0, seq.context_len - window + 1) // case.block_size
        seq.blocks[:behind] = [seq.blocks[-1]] * behind
        renamed += behind
    if not renamed:
        pytest.skip("no sequence of this case has a page behind its window")
    _check_mixed_step(runner, seqs)


@pytest.mark.parametrize("case", CASES[::7] + FP8_CASES[:1], ids=str)
def test_swap_out_and_in_keeps_outputs(
    backend_on_device: tuple[type[AttentionBackend], str], case: Case
) -> None:
    backend, device = backend_on_device
    runner, seqs = _setup(backend, case, device)
    _write_context(runner, seqs)
    num_blocks = runner.kv_cache.shape[backend.get_kv_cache_block_dim()]
    used = sorted({b for s in seqs for b in s.blocks})
    host = runner.new_cache(len(used), "cpu")
    backend.swap_blocks(runner.kv_cache, host, torch.tensor([[b, i] for i, b in enumerate(used)]))
    runner.kv_cache = runner.new_cache(num_blocks, device)  # the device copy is lost
    moved = {b: num_blocks - 1 - i for i, b in enumerate(used)}  # back into other blocks
    backend.swap_blocks(
        host, runner.kv_cache, torch.tensor([[i, moved[b]] for i, b in enumerate(used)])
    )
    for s in seqs:
        s.blocks = [moved[b] for b in s.blocks]
    _check_mixed_step(runner, seqs)


@pytest.mark.parametrize("case", CASES[3::7] + FP8_CASES[1:2], ids=str)
def test_copy_blocks_keeps_outputs(
    backend_on_device: tuple[type[AttentionBackend], str], case: Case
) -> None:
    backend, device = backend_on_device
    runner, seqs = _setup(backend, case, device)
    _write_context(runner, seqs)
    num_blocks = runner.kv_cache.shape[backend.get_kv_cache_block_dim()]
    used = sorted({b for s in seqs for b in s.blocks})
    spare = [b for b in range(num_blocks) if b not in used]
    copies = dict(zip(used, spare, strict=False))
    backend.copy_blocks([runner.kv_cache], torch.tensor(list(copies.items())))
    garbage = runner.new_cache(num_blocks, device)  # then overwrite the originals with garbage
    backend.swap_blocks(garbage, runner.kv_cache, torch.tensor([[b, b] for b in copies]))
    for s in seqs:
        s.blocks = [copies[b] for b in s.blocks]
    _check_mixed_step(runner, seqs)


def test_padding_slots_are_never_written(
    backend_on_device: tuple[type[AttentionBackend], str],
) -> None:
    """A layout whose slots are all -1 (padding) leaves the cache as it was."""
    backend, device = backend_on_device
    dtypes = backend.capabilities.dtypes  # fp32 where the backend has it, else bf16
    dtype = torch.float32 if torch.float32 in dtypes else torch.bfloat16
    case = Case(num_kv_heads=2, group=2, head_size=64, block_size=16, dtype=dtype)
    runner, seqs = _setup(backend, case, device)
    spans = [(0, s.length) for s in seqs]
    layout = runner.layout(seqs, spans)
    padding = dataclasses.replace(layout, slot_mapping=torch.full_like(layout.slot_mapping, -1))
    before = runner.kv_cache.clone()
    runner.forward(seqs, spans, runner.builder.build(padding))
    assert torch.equal(before.view(torch.uint8), runner.kv_cache.view(torch.uint8))


def test_metadata_is_frozen(backend_on_device: tuple[type[AttentionBackend], str]) -> None:
    """One metadata object serves any number of forwards: the contract freezes it."""
    backend, device = backend_on_device
    dtype = backend.capabilities.dtypes[0]
    runner, seqs = _setup(backend, Case(2, 2, 64, 16, dtype=dtype), device)
    meta = runner.builder.build(runner.layout(seqs, [(0, s.length) for s in seqs]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.num_prefills = 0  # type: ignore[misc]


def _storage(meta: object) -> dict[str, int]:
    """Where each tensor of a metadata object lives (a captured graph reads these addresses)."""
    fields = ((f.name, getattr(meta, f.name)) for f in dataclasses.fields(meta))  # type: ignore[arg-type]
    return {name: value.data_ptr() for name, value in fields if isinstance(value, torch.Tensor)}


# bf16 (CASES[1::9]), float32 (CASES[0::18]: CPU_NATIVE's only dtype) and an fp8 cache
@pytest.mark.parametrize("case", CASES[1::9] + CASES[0::18] + FP8_CASES[4:], ids=str)
def test_graph_metadata_decodes_match_reference(
    backend_on_device: tuple[type[AttentionBackend], str], case: Case
) -> None:
    """A padded decode step built by `build_for_graph` attends like the dense reference,
    and a rebuild for the same bucket reuses the same buffers (what graph replay relies on)."""
    backend, device = backend_on_device
    if not backend.capabilities.graphs:
        pytest.skip(f"{backend.get_name()} does not declare graph support")
    runner, seqs = _setup(backend, case, device)
    seqs = [s for s in seqs if s.length >= 2]
    runner.step(seqs, [(0, s.length - 1) for s in seqs])
    bucket = len(seqs) + 3
    runner.builder.init_graph_buffers(bucket, max(len(s.blocks) for s in seqs) + 1)
    spans = [(s.length - 1, s.length) for s in seqs]
    first = runner.builder.build_for_graph(
        pad_for_graph(runner.layout(seqs[:1], spans[:1]), bucket)
    )
    meta = runner.builder.build_for_graph(pad_for_graph(runner.layout(seqs, spans), bucket))
    assert _storage(first) == _storage(meta)

    def padded(name: str) -> torch.Tensor:
        rows = torch.cat([getattr(s, name)[-1:] for s in seqs]).flatten(1)
        rows = torch.cat([rows, torch.zeros(bucket - len(seqs), rows.shape[1])])
        return rows.to(case.dtype).to(device)

    with set_forward_context({runner.spec: meta}):
        out = runner.layer(padded("q"), padded("k"), padded("v"))
    got = out.float().cpu().view(bucket, case.num_heads, case.head_size)[: len(seqs)]
    want = torch.cat([reference(case, s, s.length - 1, s.length) for s in seqs])
    check_close(case, got, want)


@pytest.mark.parametrize("case", CASES[2::9] + FP8_CASES[2:3], ids=str)
def test_multi_token_decode_queries_as_decode_rows(
    backend_on_device: tuple[type[AttentionBackend], str], case: Case
) -> None:
    """Speculative decoding's verify step: a few new tokens per cached sequence, run as decode
    rows (`as_decode_rows`: each token a one-token query over its own context, which holds the
    step's earlier new tokens of its sequence). The backend must write every new token's K/V
    before any row reads them; then each row attends like the dense reference."""
    backend, device = backend_on_device
    runner, seqs = _setup(backend, case, device)
    seqs = [s for s in seqs if s.length >= 5]
    if not seqs:
        pytest.skip("no sequence long enough for a context and a multi-token query")
    # 4..1 tokens each: the multi-token queries first, as a step orders them (as prefills)
    queries = [min(4 - i % 4, s.length - 1) for i, s in enumerate(seqs)]
    order = sorted(range(len(seqs)), key=lambda i: -queries[i])
    seqs, queries = [seqs[i] for i in order], [queries[i] for i in order]
    runner.step(seqs, [(0, s.length - q) for s, q in zip(seqs, queries, strict=True)])
    spans = [(s.length - q, s.length) for s, q in zip(seqs, queries, strict=True)]
    layout = as_decode_rows(runner.layout(seqs, spans))
    assert layout.num_prefills == 0 and layout.num_seqs == sum(queries)
    metadata = build_metadata(runner.builders, layout)
    got = runner.forward(seqs, spans, metadata[runner.spec])
    want = torch.cat([reference(case, s, a, b) for s, (a, b) in zip(seqs, spans, strict=True)])
    check_close(case, got, want)
