"""`Processor`: a prompt (text or token ids) to a checked `EngineCoreRequest`, in the front end.

Everything the core would refuse is refused here, up front, with a ValueError naming the
problem: an empty prompt, one that leaves no room under `max_model_len`, token ids outside the
vocabulary (in the prompt or `logit_bias`), a prompt larger than the whole KV cache, a
structured-output spec the grammar compiler refuses (the compiler's message; compiled grammars are
cached, so each distinct spec is compiled once). Each request gets a core id of its own
(`request id#n`), so that a request id may be used again at once after its request has ended,
while the core may still be reporting on the old one.
"""

from __future__ import annotations

import itertools

from transformers import PreTrainedTokenizerBase

from attnserve.config.structured_outputs import StructuredOutputsConfig
from attnserve.engine.core.grammar import grammar_cache
from attnserve.engine.core.messages import EngineCoreRequest
from attnserve.lora.checker import LoRAChecker
from attnserve.lora.config import LoRAConfig
from attnserve.lora.request import LoRARequest
from attnserve.model.config import ModelConfig
from attnserve.sampling_params import MAX_LOGPROBS, SamplingParams


class Processor:
    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: PreTrainedTokenizerBase | None,
        kv_cache_tokens: int,
        structured_outputs_config: StructuredOutputsConfig | None = None,
        max_logprobs: int = MAX_LOGPROBS,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        """`max_logprobs`: the most log-probabilities a request may ask for per token (-1: no
        cap, as vLLM's --max-logprobs)."""
        self.model_config = model_config
        self.structured_outputs_config = structured_outputs_config
        self.tokenizer = tokenizer
        self.kv_cache_tokens = kv_cache_tokens
        self.max_logprobs = max_logprobs
        self.lora_checker = LoRAChecker(model_config, lora_config)
        self._counter = itertools.count()

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token id lists")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def check_prompt(self, token_ids: list[int]) -> None:
        max_len = self.model_config.max_model_len
        vocab = self.model_config.vocab_size
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= max_len:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens leaves no room under max_model_len {max_len}"
            )
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
        if len(token_ids) + 1 > self.kv_cache_tokens:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens does not fit the KV cache "
                f"({self.kv_cache_tokens} tokens)"
            )

    def check_params(self, params: SamplingParams) -> None:
        """What `SamplingParams` cannot check alone: token ids against the vocabulary, the
        log-probabilities asked for against `max_logprobs`."""
        for name in ("logprobs", "prompt_logprobs"):
            problem = self.too_many_logprobs(name, getattr(params, name))
            if problem is not None:
                raise ValueError(problem)
        vocab = self.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias token ids must be in 0..{vocab - 1}")

    def too_many_logprobs(self, name: str, asked: int | None) -> str | None:
        """Why `asked` log-probabilities per token are refused (vLLM's wording); None: served."""
        cap = self.max_logprobs
        if asked is None or cap < 0 or asked <= cap:
            return None
        return f"Requested {name} of {asked}, which is greater than max allowed: {cap}"

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's structured-output grammar, if it has one (a cache hit for a
        spec seen before); ValueError with the compiler's message for a bad spec, or naming
        the limit (size, compile time) it is past."""
        if params.structured_outputs is not None:
            config = self.structured_outputs_config
            cache = grammar_cache(self.model_config, self.tokenizer, config)
            cache.check(params.structured_outputs)

    def process(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> EngineCoreRequest:
        """The checked request, under a fresh core id."""
        self.check_prompt(token_ids)
        self.check_params(params)
        self.lora_checker.check(lora_request)
        self.compile_grammar(params)
        core_id = f"{request_id}#{next(self._counter)}"
        return EngineCoreRequest(core_id, token_ids, params, priority, lora_request)
