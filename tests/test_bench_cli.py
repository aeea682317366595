"""`attnserve bench latency` and `bench throughput` end to end on the tiny dummy preset, in
process (the command's `main`), with a small KV cache so the engine starts fast."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from typing import Any

import pytest

from attnserve.bench.plot import INSTALL_HINT, require_matplotlib
from attnserve.cli import main

TINY = ["--model", "llama-tiny", "--load-format", "dummy", "--device", "cpu"]
TINY += ["--kv-cache-memory-bytes", str(8 << 20)]


def test_latency_prints_the_figures_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "latency.json"
    sizes = ["--batch-size", "2", "--input-len", "8", "--output-len", "4", "--num-iters", "2"]
    assert main(["bench", "latency", *TINY, *sizes, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for field in ("mean_prefill_ms", "mean_tpot_ms", "median_e2e_latency_ms", "p99_e2e_latency_ms"):
        assert field in printed
    report = json.loads(out.read_text())
    assert report["batch_size"] == 2 and len(report["e2e_latencies_s"]) == 2
    # from the same requests: no request finishes before its first token, whatever the load
    assert report["mean_e2e_latency_ms"] >= report["mean_prefill_ms"] > 0
    assert report["mean_tpot_ms"] >= 0
    assert report["median_e2e_latency_ms"] >= report["median_prefill_ms"]


def test_latency_times_one_batch_from_its_streamed_requests() -> None:
    from attnserve.bench.latency import time_batch
    from attnserve.engine.arg_utils import EngineArgs
    from attnserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs("llama-tiny", load_format="dummy", device="cpu"))
    try:
        times = time_batch(engine, [[1, 2, 3], [4, 5, 6, 7, 8]], output_len=5)
    finally:
        engine.shutdown()
    assert len(times.first) == len(times.last) == 2
    assert all(0 < f <= last for f, last in zip(times.first, times.last, strict=True))
    assert times.e2e == max(times.last) and times.prefill == max(times.first)
    assert times.tpot(5) >= 0
    assert not engine.has_unfinished_requests()


def test_latency_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "latency", *TINY, "--output-len", "0"]) == 2
    assert "--output-len must be >= 1" in capsys.readouterr().err


def test_throughput_bound_breakdown_sweep_and_plot(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "throughput.json", tmp_path / "throughput.png"
    workload = ["--num-prompts", "4", "--min-len", "8", "--max-len", "16", "--profile-steps", "3"]
    extras = ["--batch-sizes", "2,4", "--json", str(out), "--plot", str(png)]
    assert main(["bench", "throughput", *TINY, *workload, *extras]) == 0
    printed, errors = capfd.readouterr()
    assert "USDT" not in errors  # the profiler's own lines on stderr
    for field in ("output_tokens_per_s", "bound_tokens_per_s", "fraction_of_bound", "host"):
        assert field in printed
    report = json.loads(out.read_text())
    assert 0 < report["fraction_of_bound"] < 1
    assert [row["batch_size"] for row in report["sweep"]] == [2, 4]
    assert report["breakdown"]["steps"] == 3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_throughput_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "throughput", *TINY, "--profile-steps", "-1"]) == 2
    assert "--profile-steps must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "throughput", *TINY, "--batch-sizes", "4,x"])


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ValueError, match="matplotlib") as error:
        require_matplotlib()
    assert str(error.value) == INSTALL_HINT


def _dummy_over_the_default_vocabulary(path: Path) -> Path:
    """A config-only HF directory (dummy weights) whose vocabulary is the default model's."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=2, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    config.save_pretrained(path)
    return path


def test_throughput_json_schema_on_a_dummy_model_takes_a_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnserve.model.default_model import default_model_dir

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "string"}}}))
    model = _dummy_over_the_default_vocabulary(tmp_path / "dummy")
    base = ["bench", "throughput", "--model", str(model), "--load-format", "dummy"]
    base += ["--device", "cpu", "--kv-cache-memory-bytes", str(32 << 20), "--profile-steps", "0"]
    base += ["--num-prompts", "2", "--min-len", "4", "--max-len", "8"]
    base += ["--json-schema", str(schema)]
    assert main(base) == 2
    assert "give one" in capsys.readouterr().err  # no tokenizer: the error names the option
    out = tmp_path / "out.json"
    assert main([*base, "--tokenizer", str(default_model_dir()), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["json_schema_output_tokens"] > 0 and "json_schema_cost" in report


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from attnserve.model.default_model import default_model_dir

    tokenizer = ["--tokenizer", str(default_model_dir())]
    assert main(["bench", "throughput", *TINY, *tokenizer, "--num-prompts", "1"]) == 2
    assert "49152 tokens, more than the 512" in capsys.readouterr().err


def test_the_profiled_engine_is_built_after_the_timed_one_is_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The profile rebuilds the engine with enforce_eager; on a GPU the first engine's KV cache
    must be gone by then, or the second one's memory budget is negative."""
    import gc
    import weakref

    from attnserve.bench import throughput

    runners: list[weakref.ref[Any]] = []
    build = throughput.LLM.from_engine_args
    eager = throughput._eager_engine

    def tracked(*args: Any, **kwargs: Any) -> Any:
        llm = build(*args, **kwargs)
        runners.append(weakref.ref(llm.llm_engine.executor.driver_runner))
        return llm

    def eager_after_the_first_is_freed(*args: Any, **kwargs: Any) -> Any:
        gc.collect()
        assert [r() for r in runners] == [None]
        return eager(*args, **kwargs)

    monkeypatch.setattr(throughput.LLM, "from_engine_args", tracked)
    monkeypatch.setattr(throughput, "_eager_engine", eager_after_the_first_is_freed)
    workload = ["--num-prompts", "2", "--min-len", "8", "--max-len", "8", "--profile-steps", "2"]
    assert main(["bench", "throughput", *TINY, *workload]) == 0
    assert len(runners) == 2
