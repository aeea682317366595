"""The scheduler with LoRA: a step takes sequences of at most `max_loras` adapters (base rows
always), the others wait and every request still finishes; and a block cached under one adapter
is never found under another, nor under the base model."""

from __future__ import annotations

from attnserve.config import SchedulerConfig
from attnserve.engine.core.block_allocator import BlockAllocator
from attnserve.engine.core.block_table import BlockTable
from attnserve.engine.core.scheduler import Scheduler
from attnserve.engine.core.sequence import Sequence
from attnserve.lora.request import LoRARequest
from attnserve.sampling_params import SamplingParams
from attnserve.step_types import SampleOutput
from tests.engine.scheduler_steps import record_step


def _add(s: Scheduler, rid: str, lora: int) -> Sequence:
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    seq = Sequence(rid, [1, 2, 3, 4, 5], params, BlockTable(s.allocator, 4, lora_int_id=lora))
    seq.lora_request = LoRARequest(f"a{lora}", lora, "/unused") if lora else None
    s.add(seq)
    return seq


def test_a_step_takes_at_most_max_loras_adapters() -> None:
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=64)
    s = Scheduler(config, BlockAllocator(64), max_loras=2)
    for i, lora in enumerate([1, 2, 3, 0, 1, 3, 2, 0, 4]):
        _add(s, f"r{i}", lora)
    finished: set[str] = set()
    while s.waiting or s.running:
        out = s.schedule()
        adapters = {i.seq.lora_request.lora_int_id for i in out.scheduled if i.seq.lora_request}
        assert len(adapters) <= 2
        assert {i.seq.request_id for i in out.scheduled} >= {"r3", "r7"} - finished  # base rows
        results = [SampleOutput([7]) if item.samples else None for item in out.scheduled]
        record_step(s, out, results, [0])
        finished |= {i.seq.request_id for i in out.scheduled if i.seq.finish_reason}
    assert finished == {f"r{i}" for i in range(9)}


def test_cached_blocks_are_kept_apart_per_adapter() -> None:
    allocator = BlockAllocator(16, enable_prefix_caching=True)
    tokens = list(range(1, 10))
    first = BlockTable(allocator, 4, lora_int_id=1)
    first.ensure_capacity(len(tokens))
    first.commit_computed(tokens, 8)
    assert BlockTable(allocator, 4, lora_int_id=1).match_prefix(tokens) == 8
    assert BlockTable(allocator, 4, lora_int_id=2).match_prefix(tokens) == 0
    assert BlockTable(allocator, 4).match_prefix(tokens) == 0
