"""Graph padding: a decode step padded to a capture bucket, and its metadata built into the
builders' persistent buffers (the layout every `build_for_graph` is handed)."""

from __future__ import annotations

import numpy as np
import torch

from attnserve.attention import Builders, StepLayout, StepMetadata


def pad_for_graph(layout: StepLayout, num_padded_seqs: int) -> StepLayout:
    """A decode-only layout padded to `num_padded_seqs` sequences (a capture bucket): the real
    decodes first, then padding sequences of one token at position 0 in block 0 (context 0,
    slot -1: they write nothing, and their outputs are ignored). They count as decodes."""
    num_seqs = layout.num_seqs
    if layout.num_prefills or not 0 < num_seqs <= num_padded_seqs:
        raise ValueError(
            f"a step of {layout.num_prefills} prefills and {layout.num_decode_tokens} decodes "
            f"cannot be padded to a decode-only step of {num_padded_seqs} sequences"
        )

    def padded(values: torch.Tensor, fill: int) -> torch.Tensor:
        out = np.full((num_padded_seqs, *values.shape[1:]), fill, dtype=np.int64)
        out[:num_seqs] = values.numpy()
        return torch.from_numpy(out)

    rows = torch.from_numpy(np.arange(num_padded_seqs + 1))
    return StepLayout(
        num_prefills=0,
        num_prefill_tokens=0,
        num_decode_tokens=num_padded_seqs,
        context_lens=padded(layout.context_lens, 0),
        query_lens=padded(layout.query_lens, 1),
        seq_lens=padded(layout.seq_lens, 1),
        query_start_loc=rows,
        block_table=padded(layout.block_table, 0),
        token_seq=rows[:-1],
        token_pos=padded(layout.token_pos, 0),
        slot_mapping=padded(layout.slot_mapping, -1),
        group_tables=tuple((padded(t, 0), padded(s, -1)) for t, s in layout.group_tables),
    )


def build_graph_metadata(builders: Builders, padded: StepLayout) -> StepMetadata:
    """Every spec's metadata for a decode step padded to a capture bucket (`pad_for_graph`),
    written into the builders' persistent buffers."""
    return {
        spec: builder.build_for_graph(padded.for_group(spec.kv_cache_group))
        for spec, builder in builders.items()
    }
