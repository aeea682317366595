"""Detokenizing speed: 16 streams of 512 tokens, one token per step, through
`IncrementalDetokenizer` on the embedded model's tokenizer, by its `DecodeStream` path (the
tokenizers library) and by its window path (the fallback for tokenizers without a `tokenizers`
backend: two windowed `decode` calls a step). Each stream's text is checked against one whole
`tokenizer.decode` first; the median of 5 runs is printed.

    .venv/bin/python tools/detokenize_speed.py
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

from attnserve.engine.detokenizer import IncrementalDetokenizer
from attnserve.model.default_model import embedded_gguf_path
from attnserve.model.tokenizer import load_gguf_tokenizer

STREAMS, TOKENS, RUNS = 16, 512, 5
TEXT = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


class _WindowOnly:
    """The tokenizer as one without a `tokenizers` backend is seen: decode only."""

    def __init__(self, tokenizer: Any) -> None:
        self.decode = tokenizer.decode


def _run(tokenizer: Any, prompt: list[int], streams: list[list[int]]) -> tuple[float, list[str]]:
    detokenizers = [IncrementalDetokenizer(tokenizer, prompt) for _ in streams]
    start = time.perf_counter()
    for i in range(TOKENS):
        for detokenizer, ids in zip(detokenizers, streams, strict=True):
            detokenizer.step([ids[i]], final=i == TOKENS - 1)
    return time.perf_counter() - start, [d.text for d in detokenizers]


def main() -> None:
    tokenizer = load_gguf_tokenizer(embedded_gguf_path())
    ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    rng = random.Random(0)
    starts = [rng.randrange(len(ids) - TOKENS) for _ in range(STREAMS)]
    streams = [ids[s : s + TOKENS] for s in starts]
    prompt = tokenizer.encode("Say it:", add_special_tokens=False)
    expected = [tokenizer.decode(s) for s in streams]
    for name, used in (("DecodeStream", tokenizer), ("window", _WindowOnly(tokenizer))):
        times = []
        for _ in range(RUNS):
            elapsed, texts = _run(used, prompt, streams)
            if texts != expected:
                raise SystemExit(f"{name}: the streamed text differs from a whole decode")
            times.append(elapsed)
        median = statistics.median(times)
        per_token = median / (STREAMS * TOKENS) * 1e6
        print(f"{name}: {median * 1e3:.1f} ms for {STREAMS}x{TOKENS} tokens ({per_token:.1f} us)")


if __name__ == "__main__":
    main()
