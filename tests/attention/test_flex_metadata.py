"""FLEX_ATTENTION's metadata (built on the CPU; the operator itself runs on CUDA only): a window
layer's block mask and page map reach only the pages from the first one its window reads. A
window's KV-cache group may have freed the pages behind it, so their ids can repeat a page the
sequence holds now; reading them again would count those keys twice."""

from __future__ import annotations

import torch

from attnserve.attention import AttentionSpec, build_step_layout, get_backend_cls

BLOCK = 16
WINDOW = 24


def test_a_window_layer_reads_no_page_behind_its_window() -> None:
    spec = AttentionSpec(4, 2, 64, torch.float32, block_size=BLOCK, sliding_window=WINDOW)
    builder = get_backend_cls("FLEX_ATTENTION").get_builder_cls()(spec, "cpu")
    # 64 tokens cached, 1 new: the token at 64 reads 41..64, pages 2-4; pages 0 and 1 hold
    # stale ids, the same as pages 4 and 2 now hold
    layout = build_step_layout([[9, 7, 7, 8, 9]], [64], [1], BLOCK)
    decode = builder.build(layout).decode
    assert decode is not None
    num_blocks, indices = decode.block_mask.kv_num_blocks, decode.block_mask.kv_indices
    assert num_blocks.flatten().tolist() == [3]
    assert indices[0, 0, 0, :3].tolist() == [7, 8, 9]
    query_pos, key_pos = decode.positions(
        torch.tensor(0), torch.tensor(0), torch.arange(10 * BLOCK)
    )
    assert int(query_pos) == 64
    assert key_pos[7 * BLOCK : 10 * BLOCK].tolist() == list(range(2 * BLOCK, 5 * BLOCK))
