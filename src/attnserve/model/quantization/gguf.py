"""`quantization="gguf"`: a GGUF file's Q4_0, Q4_1 and Q8_0 tensors stay packed (CPU only).

Each linear layer (and the vocabulary table, with the tied LM head) collects the rows its loader
stores: `GGUFWeight`s for packed tensors, float tensors for the rest (F32, F16, K-quants ...,
which the loader dequantizes as before). After loading, runs of rows of one kind become one
segment: a packed segment multiplies by the blocks themselves, a dense one by `F.linear` in the
model's dtype; a layer of several segments (e.g. q in Q4_0, k in Q4_1, v in Q8_0, or a v in
F16) concatenates their outputs. Packed segments run the native kernels (`gguf_cpu`): up to
`NATIVE_MAX_ROWS` activation rows (per kernel set) straight from the blocks, more by
dequantizing a chunk of weight rows at a time into float32 for the BLAS; without the native
kernels, through torch's int4 kernel (`gguf_torch`). Vocabulary lookups dequantize only the
looked-up rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.model.quantization.base import (
    EmbeddingMethod,
    LinearMethod,
    QuantizationConfig,
    layer_weight,
)
from attnserve.model.quantization.gguf_blocks import GGUFWeight
from attnserve.model.quantization.gguf_cpu import NativeWeight, native_library
from attnserve.model.quantization.gguf_torch import TorchPackedWeight
from attnserve.model.quantization.weight_utils import LoadedWeight, full_weight, set_row_store

# activation rows up to which each native kernel set multiplies from the blocks; above,
# dequantized chunks through the BLAS are faster (crossovers on the embedded model's prefill:
# AVX2 16-32 rows, AVX-512 VNNI 512-768; docs/benchmarks-archive.md)
NATIVE_MAX_ROWS = {"avx2": 16, "avx512": 512}
CHUNK_FLOATS = 1 << 20  # weight floats dequantized at a time for the BLAS path


class PackedSegment:
    """Rows kept as GGUF blocks: through the native kernels, else torch's int4 kernel."""

    def __init__(self, weight: GGUFWeight) -> None:
        self.qtype = weight.qtype
        self.kernel: NativeWeight | TorchPackedWeight = (
            NativeWeight(weight)
            if native_library() is not None
            else TorchPackedWeight.from_gguf(weight)
        )

    @property
    def rows(self) -> int:
        return self.kernel.rows

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] times the rows transposed, in float32 [M, rows]."""
        kernel = self.kernel
        if isinstance(kernel, TorchPackedWeight) or x.shape[0] <= NATIVE_MAX_ROWS[kernel.isa]:
            return kernel.mm(x)
        return self._through_blas(kernel, x.to(torch.float32))

    @staticmethod
    def _through_blas(native: NativeWeight, x: torch.Tensor) -> torch.Tensor:
        """Chunks of weight rows dequantized into one reused buffer, each multiplied by the
        BLAS into its columns of the output (contiguous [M, rows], as the next op wants it;
        the BLAS writes a column slice in place)."""
        rows, cols = native.rows, native.cols
        step = max(1, CHUNK_FLOATS // cols)
        out = torch.empty(x.shape[0], rows, dtype=torch.float32)
        chunk = torch.empty(min(step, rows), cols, dtype=torch.float32)
        for start in range(0, rows, step):
            dense = native.dequantize_into(start, chunk[: min(step, rows - start)])
            torch.mm(x, dense.t(), out=out[:, start : start + len(dense)])
        return out

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows `ids` (a vocabulary lookup)."""
        return self.kernel.dequantize_rows(ids)

    def dense(self) -> torch.Tensor:
        return self.kernel.dequantize()


@dataclass(frozen=True)
class DenseSegment:
    """Rows of a tensor the file does not hold packed, in the model's dtype."""

    weight: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.weight.shape[0])

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)

    def dense(self) -> torch.Tensor:
        return self.weight.float()


Segment = PackedSegment | DenseSegment
Part = GGUFWeight | torch.Tensor  # rows as a loader stores them


class _Staged:
    """The rows a layer's loader stored, by first row, until `segments` joins them."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, what: str) -> None:
        self.rows, self.cols, self.dtype, self.what = rows, cols, dtype, what
        self.parts: dict[int, Part] = {}

    def store(self, offset: int, loaded: LoadedWeight) -> None:
        part = loaded if isinstance(loaded, GGUFWeight) else full_weight(loaded)
        if part.shape[1] != self.cols:
            raise ValueError(f"{self.what}: {part.shape[1]} columns, the layer has {self.cols}")
        self.parts[offset] = part

    def segments(self, pad_to: int | None = None) -> list[Segment]:
        """The stored rows as segments (ValueError unless they tile the rows exactly); with
        `pad_to`, rows up to it that were never stored are zero (a rank's vocabulary tail)."""
        runs: list[list[Part]] = []
        covered = 0
        for offset in sorted(self.parts):
            if offset != covered:
                raise ValueError(f"{self.what}: rows {covered}..{offset - 1} were never loaded")
            part = self.parts[offset]
            _add_to_runs(runs, part)
            covered += part.shape[0]
        if pad_to is not None and covered < pad_to:
            _add_to_runs(runs, self._zeros(runs[-1][-1] if runs else None, pad_to - covered))
            covered = pad_to
        if covered != self.rows:
            raise ValueError(f"{self.what}: {covered} rows loaded, the layer has {self.rows}")
        self.parts.clear()
        return [self._segment(run) for run in runs]

    def _zeros(self, last: Part | None, rows: int) -> Part:
        """`rows` zero rows of the last part's kind (all-zero blocks have d = m = 0)."""
        if isinstance(last, GGUFWeight):
            blocks = last.blocks
            return GGUFWeight(last.qtype, blocks.new_zeros(rows, *blocks.shape[1:]))
        return torch.zeros(rows, self.cols, dtype=self.dtype)

    def _segment(self, run: list[Part]) -> Segment:
        packed = [part for part in run if isinstance(part, GGUFWeight)]
        if packed:  # a run is of one kind
            return PackedSegment(GGUFWeight(packed[0].qtype, torch.cat([p.blocks for p in packed])))
        dense = [part.to(self.dtype) for part in run if isinstance(part, torch.Tensor)]
        return DenseSegment(torch.cat(dense))


def _kind(part: Part) -> str:
    return part.qtype if isinstance(part, GGUFWeight) else "dense"


def _add_to_runs(runs: list[list[Part]], part: Part) -> None:
    """Append `part` to the last run when of the same kind, else start a run."""
    if runs and _kind(runs[-1][-1]) == _kind(part):
        runs[-1].append(part)
    else:
        runs.append([part])


def segments_mm(segments: list[Segment], x: torch.Tensor) -> torch.Tensor:
    """x [M, K] times the segments' rows transposed, in x's dtype [M, rows]."""
    if len(segments) == 1:
        out = segments[0].mm(x)
        return out if out.dtype == x.dtype else out.to(x.dtype)
    return torch.cat([s.mm(x).to(x.dtype) for s in segments], dim=-1)


def segments_dense(segments: list[Segment]) -> torch.Tensor:
    return torch.cat([s.dense() for s in segments])


class _GGUFMethod:
    """What both GGUF methods keep (one method object per layer): the rows its loader stored,
    then the segments. The layer's `weight` is its shape only (on "meta")."""

    def __init__(self) -> None:
        self.staged: _Staged | None = None
        self.segments: list[Segment] = []
        self.dtype = torch.get_default_dtype()  # the model's, where the layer is built

    def _placeholder(self, layer: nn.Module, rows: int, cols: int) -> None:
        weight = nn.Parameter(torch.empty(rows, cols, device="meta"), requires_grad=False)
        layer.weight = weight
        self.staged = _Staged(rows, cols, self.dtype, type(layer).__name__)
        set_row_store(weight, self.staged.store, self.dtype)

    def _finish(self, pad_to: int | None = None) -> None:
        if self.staged is None:
            raise RuntimeError("a GGUF layer finished before its weights were created")
        self.segments = self.staged.segments(pad_to)

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        return segments_dense(self.segments)


class GGUFLinearMethod(_GGUFMethod, LinearMethod):
    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        self._placeholder(layer, out_features, in_features)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self._finish()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = segments_mm(self.segments, x)
        return out if bias is None else out + bias


class GGUFEmbeddingMethod(_GGUFMethod, EmbeddingMethod):
    """The table as one packed GGUFWeight (lookups dequantize the rows they take) or dense;
    a rank's rows past the vocabulary are zero rows of the table's own kind."""

    def create_weights(self, layer: nn.Module, rows: int, dim: int) -> None:
        self._placeholder(layer, rows, dim)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self._finish(pad_to=layer_weight(layer).shape[0])

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        (table,) = self.segments  # one tensor, padded with rows of its own kind
        if isinstance(table, DenseSegment):
            return F.embedding(ids, table.weight)
        return table.lookup(ids.reshape(-1)).to(self.dtype).view(*ids.shape, -1)

    def logits(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return segments_mm(self.segments, hidden)


class GGUFConfig(QuantizationConfig):
    name = "gguf"

    def linear_method(self, layer: nn.Module) -> LinearMethod:
        return GGUFLinearMethod()

    def embedding_method(self, layer: nn.Module) -> EmbeddingMethod:
        return GGUFEmbeddingMethod()
