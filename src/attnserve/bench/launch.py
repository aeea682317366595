"""`bench serve --launch`: a real `attnserve serve` subprocess for the benchmark, and the same
engine arguments as an offline `LLM` for the `--compare-generate` baseline.

The server is started on a free loopback port with the given `serve` arguments and is ready once
`GET /health` answers 200; it is stopped with SIGTERM (then killed, past a grace period) before
the baseline runs, so the two never share the machine.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from attnserve.distributed.utils import get_open_port

READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0


def serve_parser() -> argparse.ArgumentParser:
    """The flags of `attnserve serve` (engine and server), to read a `--launch` string."""
    from attnserve.config import EngineArgs, FrontendArgs

    parser = argparse.ArgumentParser(prog="attnserve serve", add_help=False)
    EngineArgs.add_cli_args(parser, positional_model=True)
    FrontendArgs.add_cli_args(parser)
    return parser


def parse_serve_args(launch: str) -> list[str]:
    """The `--launch` string as arguments; ValueError when `serve` would refuse them."""
    args = shlex.split(launch)
    if any(a == "--port" or a.startswith("--port=") for a in args):
        raise ValueError("--launch picks a free port itself: leave --port out of it")
    try:
        serve_parser().parse_args(args)
    except SystemExit as error:
        raise ValueError(f"--launch: not valid `attnserve serve` arguments: {launch!r}") from error
    return args


class LaunchedServer:
    """`attnserve serve ARGS` on a free loopback port, ready when constructed."""

    def __init__(self, args: list[str]) -> None:
        self.port = get_open_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "attnserve.cli", "serve", *args]
        command += ["--port", str(self.port), "--uvicorn-log-level", "warning"]
        self.log: IO[str] = tempfile.NamedTemporaryFile(  # noqa: SIM115
            "w+", suffix=".log", delete=False
        )
        env = dict(os.environ)
        source = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([source, env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the launched server exited:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the launched server was not ready in time:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return Path(self.log.name).read_text()[-3000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def generate_baseline(serve_args: list[str], requests: list[tuple[list[int], int]]) -> float:
    """Seconds for `LLM.generate` of `requests` (greedy, ignore_eos) with the server's engine
    arguments, after a warm-up generate of a few of them."""
    from attnserve.bench.common import Workload, run_engine
    from attnserve.config import EngineArgs
    from attnserve.entrypoints.llm import LLM

    llm = LLM.from_engine_args(EngineArgs.from_cli_args(serve_parser().parse_args(serve_args)))
    try:
        workload = Workload([p for p, _ in requests], [n for _, n in requests])
        run_engine(llm, Workload(workload.prompts[:4], [4] * min(4, len(requests))))
        return run_engine(llm, workload)
    finally:
        llm.shutdown()
