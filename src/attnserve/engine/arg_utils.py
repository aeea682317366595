"""vLLM's import path of `EngineArgs` (`vllm.engine.arg_utils`); the class lives in
`attnserve.config`."""

from attnserve.config.engine_args import EngineArgs

__all__ = ["EngineArgs"]
