"""`LLM`: the offline Python API, as in vLLM — `generate` and `chat` over one engine. Prompts
are strings, token id lists, or vLLM's `TextPrompt` / `TokensPrompt` dicts (`attnserve.inputs`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from attnserve.config import EngineArgs
from attnserve.engine.llm_engine import LLMEngine
from attnserve.inputs import PromptType
from attnserve.lora.request import LoRARequest
from attnserve.outputs import RequestOutput
from attnserve.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]  # what the engine takes
ParamsArg = SamplingParams | Mapping[str, Any] | Sequence[SamplingParams] | None
Message = dict[str, Any]
PROMPT_KEYS = {"prompt": str, "prompt_token_ids": list}
LoRAArg = LoRARequest | Sequence[LoRARequest | None] | None


class LLM:
    """An engine for offline batched generation. Keyword arguments are `EngineArgs` fields
    (quantization: "gguf", "fp8", "none" or None for the checkpoint's own; block_size,
    max_num_seqs, max_num_batched_tokens, gpu_memory_utilization, tensor_parallel_size,
    distributed_executor_backend, ...). Step limits not given take the offline defaults
    (`EngineArgs.with_offline_defaults`: vLLM's, larger on GPUs of 70 GiB or more)."""

    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        attention_backend: str | None = None,
        block_size: int = 16,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        load_format: str = "auto",
        quantization: str | None = None,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        args = EngineArgs(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            device=device,
            attention_backend=attention_backend,
            block_size=block_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            load_format=load_format,
            quantization=quantization,
            seed=seed,
            **kwargs,
        )
        self.llm_engine = LLMEngine.from_engine_args(args.with_offline_defaults())
        self._request_counter = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
        return cls(**fields)

    def shutdown(self) -> None:
        """Stop the engine's worker processes or Ray actors (also done when `LLM` is deleted)."""
        engine = getattr(self, "llm_engine", None)
        if engine is not None:
            engine.shutdown()

    def __del__(self) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use without sampling_params: the sampling fields of the
        model's generation_config.json (`generation_config`, as vLLM), else SamplingParams()."""
        return SamplingParams(**self.llm_engine.model_config.get_diff_sampling_param())

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: ParamsArg = None,
        use_tqdm: bool = True,
        lora_request: LoRAArg = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or a `TextPrompt` / `TokensPrompt`
        dict); outputs in input order. A dict of SamplingParams fields is taken as vLLM takes
        it. `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the
        base model; needs `enable_lora=True`)."""
        prompt_list = _as_prompt_list(prompts)
        final_only = RequestOutputKind.FINAL_ONLY  # offline: no intermediate outputs to build
        params = [
            dataclasses.replace(p, output_kind=final_only)
            for p in _broadcast(sampling_params, len(prompt_list), self.get_default_sampling_params)
        ]
        loras = _lora_per_prompt(lora_request, len(prompt_list))
        ids = []
        try:
            for prompt, p, lora in zip(prompt_list, params, loras, strict=True):
                ids.append(str(next(self._request_counter)))
                self.llm_engine.add_request(ids[-1], prompt, p, lora_request=lora)
            return self._run(ids, use_tqdm)
        except BaseException:
            for request_id in ids:
                self.llm_engine.abort_request(request_id)
            raise

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: ParamsArg = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (`chat_template`, else the tokenizer's) to each conversation,
        then generate; `continue_final_message` leaves the last message (the assistant's) open
        to be continued, and needs `add_generation_prompt=False`; `tools` (OpenAI-style tool
        dicts) go to the template's `tools`, `chat_template_kwargs` (Qwen3's
        `enable_thinking`, ...) to it as variables (vLLM's arguments)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        tokenizer = self.get_tokenizer()
        if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
            raise ValueError("this model has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not conversations or any(not conversation for conversation in conversations):
            raise ValueError("chat needs at least one message in every conversation")
        options = {
            **(chat_template_kwargs or {}),
            "chat_template": chat_template,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "tokenize": False,
        }
        prompts: list[PromptType] = [
            tokenizer.apply_chat_template(conversation, **options) for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm) as bar:
            while self.llm_engine.has_unfinished_requests() and len(finished) < len(wanted):
                for output in self.llm_engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[Prompt]:
    if isinstance(prompts, str | Mapping):
        return [_as_prompt(prompts)]
    if not isinstance(prompts, Sequence):
        raise ValueError(
            f"prompts must be a string, a list of token ids, a prompt dict or a list of those, "
            f"got {type(prompts).__name__}"
        )
    items: list[object] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]]  # type: ignore[call-overload]
    return [_as_prompt(item) for item in items]


def _as_prompt(item: object) -> Prompt:
    """One prompt as the engine takes it; a `TextPrompt` / `TokensPrompt` dict unwrapped."""
    if isinstance(item, Mapping):
        unknown = sorted(set(item) - PROMPT_KEYS.keys())
        if unknown or len(item) != 1:
            problem = f"unsupported fields {unknown}" if unknown else f"fields {sorted(item)}"
            raise ValueError(
                f"a prompt dict has one field, 'prompt' (TextPrompt) or 'prompt_token_ids' "
                f"(TokensPrompt); got {problem}"
            )
        ((key, value),) = item.items()
        if not isinstance(value, PROMPT_KEYS[key]):
            raise ValueError(f"{key} must be a {PROMPT_KEYS[key].__name__}, got {value!r}")
        item = value
    if isinstance(item, str):
        return item
    if isinstance(item, list) and item:
        return item
    raise ValueError(f"a prompt is a string or a non-empty list of token ids, got {item!r}")


def _lora_per_prompt(lora_request: LoRAArg, count: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt: `lora_request` for all, or one each."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if len(lora_request) != count:
        raise ValueError(f"{len(lora_request)} LoRA requests for {count} prompts")
    return list(lora_request)


def _broadcast(
    params: ParamsArg, count: int, default: Callable[[], SamplingParams]
) -> list[SamplingParams]:
    """One SamplingParams per prompt: a SamplingParams (or a dict of its fields, as vLLM takes)
    for all, or one each; `default()` for all when None."""
    if params is None:
        return [default()] * count
    if isinstance(params, Mapping):
        params = _from_mapping(params)
    if isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, Sequence) or isinstance(params, str):
        raise ValueError(
            f"sampling_params must be a SamplingParams, a dict of its fields or a list of "
            f"SamplingParams, got {type(params).__name__}"
        )
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return [_from_mapping(p) if isinstance(p, Mapping) else p for p in params]


def _from_mapping(fields: Mapping[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**fields)
    except TypeError as error:  # an unknown field
        raise ValueError(f"sampling_params: {error}") from None
