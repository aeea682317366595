"""`VocabParallelEmbedding` and `ParallelLMHead`: the vocabulary split across ranks.

Each rank holds ceil(vocab / tp) rows (the last rank's tail is zero padding). The embedding
looks up the tokens of its own range, zeroes the others and all-reduces; the LM head computes
its slice of the logits, all-gathered (every rank then holds all logits, as in vLLM V1). The
table's `quant_method` (from the active quantization, as for linear layers) does the lookups and
the logits' matmul.
"""

from __future__ import annotations

import torch
from torch import nn

from attnserve.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from attnserve.model.quantization import embedding_method_for
from attnserve.model.quantization.weight_utils import (
    LoadedWeight,
    default_weight_loader,
    narrow_weight,
    row_store,
    set_weight_attrs,
    store_rows,
    weight_shape,
)


class VocabParallelEmbedding(nn.Module):
    weight: nn.Parameter  # registered by the quant method

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_size = get_tensor_model_parallel_world_size()
        per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = get_tensor_model_parallel_rank() * per_rank
        self.vocab_end = min(self.vocab_start + per_rank, num_embeddings)
        self.quant_method = embedding_method_for(self)
        self.quant_method.create_weights(self, per_rank, embedding_dim)
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
        if row_store(param) is None:
            param.data[rows:].zero_()  # a quantized table keeps unstored rows zero itself
        store_rows(param, 0, narrow_weight(loaded, 0, self.vocab_start, rows), "embedding")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.embedding(self, input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        embedded = self.quant_method.embedding(self, local_ids).masked_fill(outside[:, None], 0)
        return tensor_model_parallel_all_reduce(embedded)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, embedding_dim] -> logits [N, num_embeddings] over the whole vocabulary."""
        logits = tensor_model_parallel_all_gather(self.quant_method.logits(self, hidden))
        return logits[..., : self.num_embeddings]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the same sharding, used only through `compute_logits`."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the LM head is not an embedding: call compute_logits")
