"""One launcher for a real vLLM OpenAI server on 127.0.0.1, shared by the tests' CPU servers
(``tests/test_reload_vllm.py``), ``scripts/bench_reload.py`` and ``scripts/gpu_vllm_check.py``:
start ``vllm.entrypoints.openai.api_server`` with the caller's flags, wait until ``/health`` answers,
stop the whole process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

#: The small CPU server of the tests and of bench_reload.py (the caller adds qconvert's worker extension).
CPU_TEST_FLAGS = (
    "--enforce-eager",
    "--max-model-len",
    "256",
    "--max-num-seqs",
    "8",
    "--dtype",
    "bfloat16",
    "--enable-scale-out",
    "--seed",
    "0",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server --model MODEL --port P --host 127.0.0.1 FLAGS``
    with ``env`` added to this process's environment, output to ``log``. Returns once ``/health``
    answers 200 (``start_s``: seconds until then); RuntimeError with the log's tail if the process
    exits first or ``timeout`` seconds pass."""

    def __init__(
        self,
        model: Path,
        log: Path,
        flags: list[str] | tuple[str, ...],
        env: dict | None = None,
        timeout: float = 300.0,
        poll_s: float = 1.0,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        cmd += ["--port", str(self.port), "--host", "127.0.0.1", *flags]
        self.log = log
        self._f = open(log, "wb")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._f,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, **(env or {})),
            start_new_session=True,
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self._f.close()
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    self.start_s = time.perf_counter() - t0
                    return
            except requests.RequestException:
                pass
            time.sleep(poll_s)
        self.stop()
        raise RuntimeError(f"vLLM did not start in {timeout:.0f} s:\n{log.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._f.close()
