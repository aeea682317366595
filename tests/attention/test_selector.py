"""Selector and registry: defaults, forcing by argument and environment, errors, entry points."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from attnserve.attention import AttentionSpec, registry
from attnserve.attention.backends.cpu_native import CpuNativeBackend
from attnserve.attention.backends.torch_sdpa import TorchSDPABackend
from attnserve.attention.selector import ENV_VAR, get_attn_backend, get_model_attn_backend


def _spec(head_size: int, dtype: torch.dtype, **features: object) -> AttentionSpec:
    return AttentionSpec(4, 2, head_size, dtype, device="cpu", **features)  # type: ignore[arg-type]


# the native CPU kernel where it builds (an AVX2 CPU, a C compiler), else the torch reference
CPU_FP32 = CpuNativeBackend if CpuNativeBackend.unavailable_reason() is None else TorchSDPABackend


def test_cpu_default_is_the_native_kernel_in_fp32_else_torch_sdpa(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert get_attn_backend(_spec(64, torch.float32)) is CPU_FP32
    assert get_attn_backend(_spec(64, torch.bfloat16)) is TorchSDPABackend


def test_env_var_forces_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "torch_sdpa")
    assert get_attn_backend(_spec(128, torch.bfloat16)).get_name() == "TORCH_SDPA"


def test_unknown_name_is_a_value_error_listing_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "NO_SUCH_BACKEND")
    with pytest.raises(ValueError, match=r"unknown attention backend 'NO_SUCH_BACKEND'.*SDPA"):
        get_attn_backend(_spec(64, torch.float32))


def test_argument_wins_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "NO_SUCH_BACKEND")
    backend = get_attn_backend(_spec(64, torch.float32), attention_backend="TORCH_SDPA")
    assert backend is TorchSDPABackend


def test_forced_backend_that_cannot_serve_names_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(ValueError, match=r"TORCH_SDPA cannot serve.*block size 512"):
        get_attn_backend(_spec(64, torch.float32, block_size=512), attention_backend="TORCH_SDPA")


def test_request_no_backend_serves_is_a_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(ValueError, match="no attention backend serves"):
        get_attn_backend(_spec(64, torch.int8))


def test_model_backend_serves_every_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers that differ (a window on some) get one backend that serves them all; a forced
    backend that cannot serve one of them is refused with that layer's reason."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    specs = [_spec(64, torch.float32), _spec(64, torch.float32, sliding_window=8)]
    assert get_model_attn_backend(specs) is CPU_FP32
    with pytest.raises(ValueError, match="no attention layers"):
        get_model_attn_backend([])
    with pytest.raises(ValueError, match=r"TORCH_SDPA cannot serve.*block size 512"):
        get_model_attn_backend([*specs, _spec(64, torch.float32, block_size=512)], "TORCH_SDPA")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_heads": 6, "num_kv_heads": 4}, "multiple of num_kv_heads"),
        ({"num_heads": 0}, "num_heads must be a positive int"),
        ({"num_kv_heads": 2.0}, "num_kv_heads must be a positive int"),
        ({"head_size": True}, "head_size must be a positive int"),
        ({"dtype": "float32"}, "dtype must be a torch.dtype"),
        ({"sliding_window": 0}, "sliding_window must be >= 1"),
    ],
)
def test_spec_rejects_bad_fields(fields: dict[str, object], message: str) -> None:
    values: dict[str, object] = {
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": torch.float32,
    }
    with pytest.raises(ValueError, match=message):
        AttentionSpec(**{**values, **fields})  # type: ignore[arg-type]


def test_block_axis_is_read_off_the_kv_cache_shape() -> None:
    class Flat(TorchSDPABackend):
        @staticmethod
        def get_kv_cache_shape(
            num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
        ) -> tuple[int, ...]:
            return (num_blocks * block_size, 2, num_kv_heads, head_size)

    assert TorchSDPABackend.get_kv_cache_block_dim() == 1
    with pytest.raises(ValueError, match="exactly one axis of num_blocks"):
        registry.register_backend("FLAT", Flat)


def test_register_backend_rejects_lower_case_names() -> None:
    with pytest.raises(ValueError, match="upper-case"):
        registry.register_backend("mine", TorchSDPABackend)


def test_entry_point_backend_is_registered_without_code_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_backend.py").write_text(
        textwrap.dedent(
            """
            from attnserve.attention.abstract import BackendCapabilities
            from attnserve.attention.backends.torch_sdpa import TorchSDPABackend
            import torch

            class MyBackend(TorchSDPABackend):
                capabilities = BackendCapabilities(
                    dtypes=(torch.float32,), devices=("cpu",), priority=100
                )

                @staticmethod
                def get_name() -> str:
                    return "MY_BACKEND"
            """
        )
    )
    dist = tmp_path / "my_backend-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-backend\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[attnserve.attention_backends]\nMY_BACKEND = my_backend:MyBackend\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert "MY_BACKEND" in registry.backend_names()
    chosen = get_attn_backend(_spec(64, torch.float32))
    assert chosen.get_name() == "MY_BACKEND"  # its priority beats TORCH_SDPA's
    assert get_attn_backend(_spec(64, torch.bfloat16)) is TorchSDPABackend
    sys.modules.pop("my_backend", None)
