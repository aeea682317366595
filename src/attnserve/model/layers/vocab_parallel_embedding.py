"""`VocabParallelEmbedding` and `ParallelLMHead`: the vocabulary split across ranks.

Each rank holds ceil(vocab / tp) rows (the last rank's tail is zero padding). The embedding
looks up the tokens of its own range, zeroes the others and all-reduces; the LM head computes
its slice of the logits, all-gathered (every rank then holds all logits, as in vLLM V1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from attnserve.model.layers.weight_utils import (
    LoadedWeight,
    copy_checked,
    default_weight_loader,
    narrow_weight,
    set_weight_attrs,
    weight_shape,
)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_size = get_tensor_model_parallel_world_size()
        per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = get_tensor_model_parallel_rank() * per_rank
        self.vocab_end = min(self.vocab_start + per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim), requires_grad=False)
        set_weight_attrs(self.weight, self.weight_loader, (num_embeddings, embedding_dim))

    def weight_loader(
        self, param: nn.Parameter, loaded: LoadedWeight, shard_id: str | None = None
    ) -> None:
        if self.tp_size == 1:
            default_weight_loader(param, loaded, "embedding")
            return
        if weight_shape(loaded)[0] != self.num_embeddings:
            raise ValueError(
                f"embedding: checkpoint has {weight_shape(loaded)[0]} rows, "
                f"vocabulary is {self.num_embeddings}"
            )
        rows = self.vocab_end - self.vocab_start
        param.data[rows:].zero_()
        shard = narrow_weight(loaded, 0, self.vocab_start, rows)
        copy_checked(param.data[:rows], shard, "embedding")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        embedded = F.embedding(local_ids, self.weight).masked_fill(outside[:, None], 0)
        return tensor_model_parallel_all_reduce(embedded)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, embedding_dim] -> logits [N, num_embeddings] over the whole vocabulary."""
        logits = tensor_model_parallel_all_gather(F.linear(hidden, self.weight))
        return logits[..., : self.num_embeddings]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the same sharding, used only through `compute_logits`."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the LM head is not an embedding: call compute_logits")
