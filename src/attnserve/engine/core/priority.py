"""The "priority" scheduling policy's order (vLLM's): lower priority values first, then earlier
arrivals. The scheduler keeps its waiting queue in this order and preempts from its far end."""

from __future__ import annotations

from collections import deque

from attnserve.engine.core.sequence import Sequence


def priority_order(seq: Sequence) -> tuple[int, int]:
    """Where `seq` stands: its priority, then its request's arrival."""
    return seq.priority, seq.arrival_order


def enqueue_by_priority(queue: deque[Sequence], seq: Sequence) -> None:
    """Put `seq` into a queue kept in `priority_order`, after every sequence not behind it."""
    key = priority_order(seq)
    position = next((i for i, s in enumerate(queue) if priority_order(s) > key), len(queue))
    queue.insert(position, seq)
