"""The parallel layers' sharding, one simulated rank at a time (no process group needed): each
rank's shard, loaded from the full weight, put back together equals the full layer's weight
and output; dummy weights are the same whatever the tensor-parallel degree."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnserve.distributed import parallel_state
from attnserve.model.config import ModelConfig
from attnserve.model.layers import linear, vocab_parallel_embedding
from attnserve.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from attnserve.model.layers.vocab_parallel_embedding import VocabParallelEmbedding
from attnserve.model.loader import build_model
from attnserve.model.quantization.weight_utils import load_weight
from attnserve.model.weights import init_dummy_weights


@contextmanager
def as_rank(world_size: int, rank: int) -> Iterator[None]:
    """Layers built inside see this tensor-parallel world size and rank."""
    saved = parallel_state._WORLD_SIZE, parallel_state._RANK
    parallel_state._WORLD_SIZE, parallel_state._RANK = world_size, rank
    try:
        yield
    finally:
        parallel_state._WORLD_SIZE, parallel_state._RANK = saved


@pytest.fixture
def no_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Collectives as identities: each simulated rank returns its own partial result."""
    for module in (linear, vocab_parallel_embedding):
        monkeypatch.setattr(module, "tensor_model_parallel_all_reduce", lambda t: t)
        monkeypatch.setattr(module, "tensor_model_parallel_all_gather", lambda t: t)


def test_column_parallel_shards_concatenate_to_the_full_output(no_collectives: None) -> None:
    weight, bias, x = torch.randn(12, 5), torch.randn(12), torch.randn(3, 5)
    outputs = []
    for rank in range(3):
        with as_rank(3, rank):
            layer = ColumnParallelLinear(5, 12, bias=True)
        load_weight(layer.weight, weight, "w")
        load_weight(layer.bias, bias, "b")  # type: ignore[arg-type]
        outputs.append(layer(x))
    torch.testing.assert_close(torch.cat(outputs, -1), F.linear(x, weight, bias))


def test_row_parallel_partials_sum_to_the_full_output(no_collectives: None) -> None:
    weight, x = torch.randn(4, 10), torch.randn(3, 10)
    partials = []
    for rank in range(2):
        with as_rank(2, rank):
            layer = RowParallelLinear(10, 4)
        load_weight(layer.weight, weight, "w")
        partials.append(layer(x[:, rank * 5 : (rank + 1) * 5]))
    torch.testing.assert_close(sum(partials), F.linear(x, weight))


def test_merged_gate_up_keeps_each_ranks_rows_of_each_part() -> None:
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    for rank in range(2):
        with as_rank(2, rank):
            layer = MergedColumnParallelLinear(3, [8, 8], ["gate", "up"])
        load_weight(layer.weight, gate, "w", "gate")
        load_weight(layer.weight, up, "w", "up")
        rows = slice(rank * 4, (rank + 1) * 4)
        torch.testing.assert_close(layer.weight, torch.cat([gate[rows], up[rows]]))
        # the whole merged weight (a converted checkpoint) loads to the same shard
        merged = layer.weight.clone()
        load_weight(layer.weight, torch.cat([gate, up]), "w")
        torch.testing.assert_close(layer.weight, merged)


@pytest.mark.parametrize(("tp", "kv_heads"), [(2, 2), (4, 2), (2, 1)])
def test_qkv_splits_query_heads_and_replicates_scarce_kv_heads(tp: int, kv_heads: int) -> None:
    head, heads = 2, 4
    q = torch.randn(heads * head, 6)
    k, v = torch.randn(kv_heads * head, 6), torch.randn(kv_heads * head, 6)
    for rank in range(tp):
        with as_rank(tp, rank):
            layer = QKVParallelLinear(6, head, heads, kv_heads)
        for name, part in (("q", q), ("k", k), ("v", v)):
            load_weight(layer.weight, part, "w", name)
        q_rows = heads // tp * head
        kv_head = rank * kv_heads // tp  # the KV head this rank's query heads attend with
        kv_rows = slice(kv_head * head, kv_head * head + layer.num_kv_heads * head)
        expected = torch.cat([q[rank * q_rows : (rank + 1) * q_rows], k[kv_rows], v[kv_rows]])
        torch.testing.assert_close(layer.weight, expected)


def test_vocab_parallel_embedding_and_logits_with_padding(no_collectives: None) -> None:
    vocab, dim = 7, 4  # 7 rows over 2 ranks: 4 + 3 and a padding row
    table, ids, hidden = torch.randn(vocab, dim), torch.tensor([0, 3, 4, 6]), torch.randn(2, dim)
    embedded, logits = [], []
    for rank in range(2):
        with as_rank(2, rank):
            layer = VocabParallelEmbedding(vocab, dim)
        load_weight(layer.weight, table, "w")
        embedded.append(layer(ids))
        logits.append(F.linear(hidden, layer.weight))
    torch.testing.assert_close(sum(embedded), table[ids])
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], hidden @ table.T)


def test_lazy_safetensors_slices_load_the_same_shards(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    weight = torch.randn(6, 4)
    save_file({"w": weight}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as handle:
        for rank in range(2):
            with as_rank(2, rank):
                column, row = ColumnParallelLinear(4, 6), RowParallelLinear(4, 6)
            load_weight(column.weight, handle.get_slice("w"), "w")
            load_weight(row.weight, handle.get_slice("w"), "w")
            torch.testing.assert_close(column.weight, weight[rank * 3 : (rank + 1) * 3])
            torch.testing.assert_close(row.weight, weight[:, rank * 2 : (rank + 1) * 2])


def test_a_wrong_full_shape_is_a_value_error() -> None:
    with as_rank(2, 0):
        layer = ColumnParallelLinear(4, 6)
    with pytest.raises(ValueError, match="does not match the full weight"):
        load_weight(layer.weight, torch.randn(8, 4), "w")


def test_dummy_weights_do_not_depend_on_the_tensor_parallel_degree() -> None:
    config = ModelConfig.resolve("llama-tiny", dtype="float32")

    def shard_params(tp: int, rank: int) -> dict[str, torch.Tensor]:
        with as_rank(tp, rank):
            model = build_model(config, "cpu")
            init_dummy_weights(model)
        return dict(model.named_parameters())

    full = shard_params(1, 0)
    ranks = [shard_params(2, rank) for rank in range(2)]
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    q_rows = config.num_heads * config.head_size
    kv_rows = config.num_kv_heads * config.head_size
    q, k, v = full[qkv].split([q_rows, kv_rows, kv_rows])
    for rank, params in enumerate(ranks):
        expected = torch.cat([part.chunk(2)[rank] for part in (q, k, v)])
        torch.testing.assert_close(params[qkv], expected)
    for name, dim in (
        ("model.layers.1.mlp.down_proj.weight", 1),
        ("model.embed_tokens.weight", 0),
        ("lm_head.weight", 0),
    ):
        torch.testing.assert_close(torch.cat([p[name] for p in ranks], dim), full[name])
