"""Choosing the attention backend: `get_attn_backend` for one spec, `get_model_attn_backend`
for all the specs of a model.

The selector knows backends only through the registry and their declared capabilities: it keeps
those that can serve the request on this machine and picks the highest priority. A name forced
by argument or by `ATTNSERVE_ATTENTION_BACKEND` wins, or fails with the reason and the
alternatives.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from attnserve.attention.abstract import (
    AttentionBackend,
    AttentionSpec,
    BackendCapabilities,
)
from attnserve.attention.registry import backend_names, get_backend_cls

ENV_VAR = "ATTNSERVE_ATTENTION_BACKEND"

logger = logging.getLogger(__name__)


def default_device() -> str:
    """'cuda' when a GPU is visible, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def registered_capabilities() -> dict[str, BackendCapabilities]:
    """The declared capabilities of every registered backend that imports here."""
    found = {}
    for name in backend_names():
        try:
            found[name] = get_backend_cls(name).capabilities
        except ImportError:
            continue
    return found


def describe_capabilities(caps: BackendCapabilities) -> str:
    """One line a person can read: what a backend supports."""
    dtypes = "/".join(str(d).removeprefix("torch.") for d in caps.dtypes)
    heads = "any" if caps.head_sizes is None else ",".join(map(str, caps.head_sizes))
    features = [
        f
        for f, on in [
            ("window", caps.sliding_window),
            ("alibi", caps.alibi),
            ("soft-cap", caps.logits_soft_cap),
            ("graphs", caps.graphs),
        ]
        if on
    ]
    return (
        f"{dtypes} on {','.join(caps.devices)}; head sizes {heads}; blocks "
        f"{caps.min_block_size}..{caps.max_block_size}; kv {','.join(caps.kv_cache_dtypes)}; "
        f"{'+'.join(features) or 'no window/alibi/soft-cap/graphs'}; priority {caps.priority}"
    )


def backend_report(specs: Sequence[AttentionSpec]) -> dict[str, list[str]]:
    """For every registered backend, why it cannot serve all of `specs` (empty list: it can)."""
    report: dict[str, list[str]] = {}
    for name in backend_names():
        try:
            backend = get_backend_cls(name)
        except ImportError as error:
            report[name] = [f"cannot be imported here: {error}"]
            continue
        reasons = (reason for spec in specs for reason in backend.unsupported_reasons(spec))
        report[name] = list(dict.fromkeys(reasons))
    return report


def get_attn_backend(
    spec: AttentionSpec, attention_backend: str | None = None
) -> type[AttentionBackend]:
    """The best registered backend that serves `spec` here, or the forced one."""
    return get_model_attn_backend([spec], attention_backend)


def get_model_attn_backend(
    specs: Sequence[AttentionSpec], attention_backend: str | None = None
) -> type[AttentionBackend]:
    """One backend for every spec of a model: the best that serves them all, or the forced one
    (`attention_backend`, else `ATTNSERVE_ATTENTION_BACKEND`)."""
    if not specs:
        raise ValueError("a model with no attention layers has no attention backend to select")
    forced = attention_backend or os.environ.get(ENV_VAR) or None
    report = backend_report(specs)
    able = [name for name, reasons in report.items() if not reasons]
    if forced is not None:
        return _forced_backend(forced.upper(), report, able)
    if not able:
        wanted = specs[0] if len(specs) == 1 else list(specs)
        raise ValueError(f"no attention backend serves {wanted}: {report}")
    best = max(able, key=lambda name: get_backend_cls(name).capabilities.priority)
    for name, reasons in report.items():
        if reasons and name != best:
            logger.debug("attention backend %s not used: %s", name, "; ".join(reasons))
    return get_backend_cls(best)


def _forced_backend(
    name: str, report: dict[str, list[str]], able: list[str]
) -> type[AttentionBackend]:
    if name not in report:
        raise ValueError(
            f"unknown attention backend {name!r}; registered: {list(report)}; "
            f"able to serve this request: {able}"
        )
    if report[name]:
        raise ValueError(
            f"attention backend {name} cannot serve this request: {'; '.join(report[name])}. "
            f"Backends that can: {able}"
        )
    return get_backend_cls(name)
