"""The named offline workload kinds: what the side-by-side runs, the step timeline and `bench
throughput --workload` time, each drawn the same way everywhere (random token ids, seeded).

- standard: 256 requests, 100..1024 tokens in and out, uniform (nano-vllm's workload)
- chat: 512 requests with long-tailed (log-normal) prompt and output lengths, as chat traffic
  has: most prompts a few hundred tokens, a few of several thousand; most answers short, a few
  of a thousand or more. Steps that carry prompt tokens then run beside hundreds of decodes.
- long: 64 requests of 4096..6144 prompt tokens, 16..64 out (prompt-bound)
- prefix: 256 requests sharing a 2048-token prefix, then 64..256 of their own, 64..256 out
- short: 1024 requests of 16..128 tokens in and out
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from attnserve.bench.common import Workload


@dataclass(frozen=True)
class UniformKind:
    """Lengths uniform in [low, high] (prompts after a shared prefix of `prefix` tokens)."""

    num_requests: int
    prompt: tuple[int, int]
    output: tuple[int, int]
    prefix: int = 0


@dataclass(frozen=True)
class LongTailedKind:
    """Log-normal lengths: median, sigma (of the log), clipped to [low, high]."""

    num_requests: int
    prompt: tuple[float, float, int, int]
    output: tuple[float, float, int, int]


KINDS: dict[str, UniformKind | LongTailedKind] = {
    "standard": UniformKind(256, (100, 1024), (100, 1024)),
    "chat": LongTailedKind(512, (300.0, 1.1, 8, 6144), (150.0, 1.0, 8, 2048)),
    "long": UniformKind(64, (4096, 6144), (16, 64)),
    "prefix": UniformKind(256, (64, 256), (64, 256), prefix=2048),
    "short": UniformKind(1024, (16, 128), (16, 128)),
}


def draw_workload(kind: str, vocab_size: int) -> Workload:
    """The workload of `kind` (one of KINDS) for a vocabulary of `vocab_size` tokens (seed 0;
    the uniform kinds as `bench throughput` draws them from its length flags)."""
    if kind not in KINDS:
        raise ValueError(f"workload kind must be one of {', '.join(KINDS)}, got {kind!r}")
    spec = KINDS[kind]
    if isinstance(spec, LongTailedKind):
        rng = random.Random(0)
        prompt_lens = [_long_tailed(rng, *spec.prompt) for _ in range(spec.num_requests)]
        output_lens = [_long_tailed(rng, *spec.output) for _ in range(spec.num_requests)]
        prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in prompt_lens]
        return Workload(prompts, output_lens)
    work = uniform_workload(spec.num_requests, spec.prompt, vocab_size, spec.prefix)
    if spec.output == spec.prompt:  # the standard workload: output lengths drawn with prompts
        return work
    rng = random.Random(1)
    return Workload(work.prompts, [rng.randint(*spec.output) for _ in work.prompts])


def uniform_workload(
    num_requests: int,
    lengths: tuple[int, int],
    vocab_size: int,
    prefix: int = 0,
    seed: int = 0,
    fixed: tuple[int | None, int | None] = (None, None),
) -> Workload:
    """Random prompts (after a shared prefix of `prefix` tokens) and output lengths, each
    uniform in `lengths` unless `fixed` (input, output) gives it."""
    rng = random.Random(seed)

    def length(given: int | None) -> int:
        return given if given is not None else rng.randint(*lengths)

    shared = [rng.randrange(vocab_size) for _ in range(prefix)]
    prompts, outputs = [], []
    for _ in range(num_requests):
        prompts.append(shared + [rng.randrange(vocab_size) for _ in range(length(fixed[0]))])
        outputs.append(length(fixed[1]))
    return Workload(prompts, outputs)


def _long_tailed(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return min(high, max(low, round(rng.lognormvariate(math.log(median), sigma))))
