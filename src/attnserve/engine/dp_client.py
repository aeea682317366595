"""`DPClient`: data parallelism on one host — `data_parallel_size` engine cores, each a process
of its own (on CUDA with its own `tensor_parallel_size` GPUs, through CUDA_VISIBLE_DEVICES; on
CPU sharing the host's cores), behind one front end.

`CoreBalancer` picks each request's core: with prefix caching, the core that last got the
longest prefix of full prompt blocks this request shares (so its cached KV is reused), unless
that core has clearly more outstanding requests than the least busy one; otherwise the least
busy core. The cores' outputs arrive through one queue, one message per step of any core.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from attnserve.config.engine import EngineConfig
from attnserve.engine.core.messages import EngineCoreOutputs, EngineCoreRequest
from attnserve.engine.core_client import EngineCoreClient, EngineDeadError
from attnserve.engine.proc_client import ProcClient, core_num_threads
from attnserve.spec_decode.metrics import SPEC_DECODE_COUNTS, spec_decode_stats

MAX_REMEMBERED_PREFIXES = 1 << 16
_SUMMED_STATS = (
    "num_running",
    "num_waiting",
    "num_swapped",
    "num_preemptions",
    "num_requests_added",
)
T = TypeVar("T")


class CoreBalancer:
    """Outstanding requests per core, and which core last got each prompt-prefix block."""

    def __init__(self, num_cores: int, block_size: int, prefix_caching: bool) -> None:
        self.load = [0] * num_cores
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._owners: OrderedDict[int, int] = OrderedDict()  # chained block hash -> core
        self._assigned: dict[str, int] = {}

    def _block_hashes(self, prompt: list[int]) -> list[int]:
        """Chained hashes of the prompt's full blocks that a cache hit can cover (the last
        prompt token is always computed)."""
        if not self.prefix_caching:
            return []
        hashes, parent, size = [], 0, self.block_size
        for start in range(0, len(prompt) - size, size):
            parent = hash((parent, tuple(prompt[start : start + size])))
            hashes.append(parent)
        return hashes

    def pick(self, prompt: list[int]) -> int:
        least = min(range(len(self.load)), key=lambda core: (self.load[core], core))
        for block_hash in reversed(self._block_hashes(prompt)):
            owner = self._owners.get(block_hash)
            if owner is not None:
                slack = max(2, self.load[least] // 4)
                return owner if self.load[owner] <= self.load[least] + slack else least
        return least

    def assign(self, request_id: str, core: int, prompt: list[int]) -> None:
        self._assigned[request_id] = core
        self.load[core] += 1
        for block_hash in self._block_hashes(prompt):
            self._owners[block_hash] = core
            self._owners.move_to_end(block_hash)
        while len(self._owners) > MAX_REMEMBERED_PREFIXES:
            self._owners.popitem(last=False)

    def core_of(self, request_id: str) -> int | None:
        return self._assigned.get(request_id)

    def release(self, request_id: str) -> None:
        core = self._assigned.pop(request_id, None)
        if core is not None:
            self.load[core] -= 1


def core_environment(config: EngineConfig, rank: int) -> dict[str, str]:
    """What core `rank`'s process needs in its environment: on CUDA, its GPUs."""
    if config.device.type != "cuda":
        return {}
    tp = config.parallel_config.tensor_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        devices = [str(i) for i in range(torch.cuda.device_count())]
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices[rank * tp : (rank + 1) * tp])}


class DPClient(EngineCoreClient):
    def __init__(self, config: EngineConfig) -> None:
        size = config.parallel_config.data_parallel_size
        self._outputs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threads = core_num_threads(config)
        self.clients: list[ProcClient] = []
        try:
            for rank in range(size):  # all start loading at once
                env = core_environment(config, rank)
                name = f"attnserve-engine-core-dp{rank}"
                self.clients.append(ProcClient(config, self._outputs, env, threads, name))
            for client in self.clients:
                client.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.ready = self.clients[0].ready
        cache = config.cache_config
        self.balancer = CoreBalancer(size, cache.block_size, cache.enable_prefix_caching)
        self._lock = threading.Lock()

    def add_request(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None:
        prompt = request.prompt_token_ids
        if data_parallel_rank is not None and not 0 <= data_parallel_rank < len(self.clients):
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank} is out of range for "
                f"{len(self.clients)} engine cores"
            )
        with self._lock:
            core = self.balancer.pick(prompt) if data_parallel_rank is None else data_parallel_rank
            self.balancer.assign(request.request_id, core, prompt)
        try:
            self.clients[core].add_request(request)
        except BaseException:
            with self._lock:
                self.balancer.release(request.request_id)
            raise

    def _by_core(self, items: list[T], request_id: Callable[[T], str]) -> dict[int, list[T]]:
        """`items` grouped by the core that holds their request (unknown ones dropped)."""
        groups: dict[int, list[T]] = {}
        for item in items:
            core = self.balancer.core_of(request_id(item))
            if core is not None:
                groups.setdefault(core, []).append(item)
        return groups

    def abort_requests(self, request_ids: list[str]) -> None:
        with self._lock:
            groups = self._by_core(request_ids, str)
            for request_id in request_ids:
                self.balancer.release(request_id)
        for core, ids in groups.items():
            self.clients[core].abort_requests(ids)

    def finish_sequences(self, sequences: list[tuple[str, int]]) -> None:
        with self._lock:
            groups = self._by_core(sequences, lambda sequence: sequence[0])
        for core, group in groups.items():
            self.clients[core].finish_sequences(group)

    def get_output(self) -> EngineCoreOutputs:
        item = self._outputs.get()
        if isinstance(item, EngineDeadError):
            self._outputs.put(item)
            raise item
        with self._lock:
            for request_id in item.finished_requests:
                self.balancer.release(request_id)
        result: EngineCoreOutputs = item
        return result

    def core_stats(self) -> list[dict[str, float]]:
        """Each core's own `stats()`."""
        return [client.stats() for client in self.clients]

    def stats(self) -> dict[str, float]:
        return _merged_stats(self.core_stats())

    def latest_stats(self) -> dict[str, float]:
        return _merged_stats([client.latest_stats() for client in self.clients])

    def reset_stats(self) -> None:
        for client in self.clients:
            client.reset_stats()

    def check_health(self) -> None:
        for client in self.clients:
            client.check_health()

    @property
    def core_pids(self) -> list[int]:
        return [pid for client in self.clients for pid in client.core_pids]

    def shutdown(self) -> None:
        for client in self.clients:
            client.shutdown()


def _merged_stats(each: list[dict[str, float]]) -> dict[str, float]:
    """The cores' gauges as one engine's: counts summed, rates averaged."""
    merged = {key: sum(s[key] for s in each) for key in _SUMMED_STATS}
    for key in ("kv_cache_usage", "prefix_cache_hit_rate"):  # equal caches: the mean
        merged[key] = sum(s[key] for s in each) / len(each)
    if SPEC_DECODE_COUNTS[0] in each[0]:
        merged |= spec_decode_stats(*(sum(s[k] for s in each) for k in SPEC_DECODE_COUNTS))
    return merged
