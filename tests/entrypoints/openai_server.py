"""Helpers for the server tests: a real `attnserve serve` process on a free loopback port, its
Prometheus metrics parsed, and a tiny random Llama that carries the default model's tokenizer
(and chat template) so fuzzing runs at full speed."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

import attnserve
from attnserve.distributed.utils import get_open_port
from tests.conftest import HANG_GUARD_S

SRC = Path(attnserve.__file__).resolve().parents[1]
API_KEY = "test-key"  # the default model's shared server (tests/entrypoints/conftest.py)
TINY_MODEL = "tiny"  # the tiny chat model's served name, limits and request size limit
TINY_MAX_MODEL_LEN = 128
TINY_MAX_BYTES = 65536


class ServerProcess:
    """`attnserve serve ARGS` in a subprocess; ready (GET /health 200) when constructed. Every
    wait polls for its condition and fails only on a hang (HANG_GUARD_S)."""

    def __init__(self, args: list[str], api_key: str | None = None) -> None:
        self.port = get_open_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
        env.setdefault("ATTNSERVE_ATTENTION_BACKEND", "TORCH_SDPA")
        env.pop("ATTNSERVE_API_KEY", None)
        command = [sys.executable, "-m", "attnserve.cli", "serve", *args]
        command += ["--port", str(self.port), "--uvicorn-log-level", "warning"]
        if api_key:
            command += ["--api-key", api_key]
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + HANG_GUARD_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.log_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        log = self.log_text()[-3000:]
        raise RuntimeError(f"the server was not ready in {HANG_GUARD_S:.0f} s (a hang):\n{log}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_text(self) -> str:
        return Path(self.log.name).read_text()

    def metrics(self) -> dict[str, float]:
        """`name{labels}` -> value, for every sample of GET /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=HANG_GUARD_S).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def wait_idle(self) -> dict[str, float]:
        """The metrics once nothing runs or waits."""
        deadline = time.monotonic() + HANG_GUARD_S
        while True:
            metrics = self.metrics()
            busy = (
                metrics["attnserve:num_requests_running"]
                + metrics["attnserve:num_requests_waiting"]
            )
            if not busy:
                return metrics
            if time.monotonic() > deadline:
                raise AssertionError(f"requests still busy after {HANG_GUARD_S:.0f} s: a hang")
            time.sleep(0.1)

    def children(self) -> list[int]:
        """The server's child processes (engine cores, multiprocessing's resource tracker)."""
        return child_pids(self.proc.pid)

    def engine_core_pids(self) -> list[int]:
        return [pid for pid in self.children() if "resource_tracker" not in _cmdline(pid)]

    def stop(self) -> int:
        """SIGTERM, then (only on a hang) SIGKILL; the exit code."""
        self.proc.terminate()
        try:
            code = self.proc.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)
        return code


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def child_pids(parent: int) -> list[int]:
    """The live children of `parent`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and is_running(int(entry.name)):
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == parent:
                    found.append(int(entry.name))
    return found


def is_running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def tiny_model_with_tokenizer(path: Path) -> Path:
    """A 2-layer random Llama over the default model's vocabulary, with its tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from attnserve.model.default_model import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
