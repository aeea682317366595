"""`warm_up`: a few short requests through every engine core before a server says it is ready,
so that no client request pays for a first-time compile or allocation.

Per core: a prefill with greedy decodes; then, together, a prefill that continues the first
prompt's cached blocks (prefix caching) with temperature / top-p sampled decodes and
log-probabilities, and a second greedy request. Prompts are token ids (a model need not have a
tokenizer), sized to fit `max_model_len` and the KV cache. Then the cores' counters start again
(`reset_stats`), so `/metrics` counts no warm-up (its prefix-cache hits, above all).
"""

from __future__ import annotations

import asyncio
import logging
import time

from attnserve.engine.async_llm_engine import AsyncLLMEngine
from attnserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

WARMUP_TOKENS = 4  # generated per warm-up request
_FINAL = RequestOutputKind.FINAL_ONLY


def _prompt(length: int, vocab_size: int, salt: int) -> list[int]:
    return [(7 * i + 3 + salt) % vocab_size for i in range(length)]


async def _run(
    engine: AsyncLLMEngine, prompt: list[int], params: SamplingParams, name: str, rank: int
) -> None:
    async for _ in engine.generate(prompt, params, name, data_parallel_rank=rank):
        pass


async def _warm_core(engine: AsyncLLMEngine, rank: int) -> None:
    model_config = engine.engine.model_config
    block = engine.engine.config.cache_config.block_size
    room = min(model_config.max_model_len, engine.engine.processor.kv_cache_tokens)
    limit = max(1, room - WARMUP_TOKENS - 1)
    first = _prompt(min(2 * block + 3, max(1, limit // 2)), model_config.vocab_size, rank)
    longer = first + _prompt(max(0, min(block, limit - len(first))), model_config.vocab_size, 11)
    greedy = SamplingParams(
        temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True, output_kind=_FINAL
    )
    sampled = SamplingParams(
        temperature=0.8,
        top_p=0.9,
        seed=rank,
        max_tokens=WARMUP_TOKENS,
        ignore_eos=True,
        logprobs=2,
        output_kind=_FINAL,
    )
    prefix = f"warmup-{rank}"
    await _run(engine, first, greedy, f"{prefix}-prefill", rank)
    second = _prompt(len(first), model_config.vocab_size, 5)
    await asyncio.gather(
        _run(engine, longer, sampled, f"{prefix}-cached-prefix", rank),
        _run(engine, second, greedy, f"{prefix}-greedy", rank),
    )


async def warm_up(engine: AsyncLLMEngine) -> None:
    """Warm every engine core (all at once)."""
    started = time.perf_counter()
    cores = range(engine.engine.data_parallel_size)
    await asyncio.gather(*(_warm_core(engine, rank) for rank in cores))
    await asyncio.to_thread(engine.engine.reset_stats)  # no client's: out of every counter
    logger.info("warm-up done in %.1f s", time.perf_counter() - started)
