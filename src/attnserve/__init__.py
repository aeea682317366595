"""attnserve: a fast, compact LLM inference and serving engine with pluggable attention."""

from attnserve.inputs import TextPrompt, TokensPrompt
from attnserve.lora import LoRARequest
from attnserve.output_constraints import StructuredOutputsParams
from attnserve.outputs import CompletionOutput, Logprob, RequestOutput
from attnserve.sampling_params import SamplingParams
from attnserve.version import __version__ as __version__

__all__ = [
    "LLM",
    "CompletionOutput",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
]


def __getattr__(name: str) -> object:
    """`LLM` loads the engine (torch, transformers) only when asked for."""
    if name == "LLM":
        from attnserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
