"""`SchedulerConfig`: how many sequences and tokens a step takes, how prompts share it and how
a full KV cache makes room."""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's: arrival order, or (priority, arrival)
LONG_PREFILL_FRACTION = 0.04  # of max_model_len: vLLM's default long-prefill threshold


@dataclass(frozen=True)
class SchedulerConfig:
    """Per step at most max_num_seqs sequences and max_num_batched_tokens new tokens; when the
    KV cache runs out, sequences are preempted by "recompute" or "swap". With async_scheduling
    the engine schedules the next step while the device runs the current one."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    async_scheduling: bool = True
    long_prefill_token_threshold: int = 0  # 0: 4% of max_model_len (vLLM's value)
    max_long_partial_prefills: int = 1

    @property
    def long_prefill_tokens(self) -> int:
        """A prompt with more tokens than this left to compute is long (the scheduler's
        docstring says how long prompts share the budget)."""
        if self.long_prefill_token_threshold:
            return self.long_prefill_token_threshold
        return max(1, int(self.max_model_len * LONG_PREFILL_FRACTION))

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0: 4% of max_model_len), got "
                f"{self.long_prefill_token_threshold}"
            )
        if self.max_long_partial_prefills < 1:
            raise ValueError(
                f"max_long_partial_prefills must be >= 1, got {self.max_long_partial_prefills}"
            )
