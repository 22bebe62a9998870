"""A `python -m sglang.launch_server` subprocess for the benchmark scripts: start on a free
port with its log in a file, wait until it serves, query it, kill its whole process tree."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
import time
from typing import Any

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: str, lines: int = 60) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


class Server:
    """A launch_server subprocess (same process group as this one, so a killed sweep does not
    leave it running); stop() kills its whole tree."""

    def __init__(self, flags: list[str], log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "sglang.launch_server", *flags]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        self.cmd = cmd
        self.log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed in stop()
        self.log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float) -> None:
        """Until /health answers and one short /generate succeeds. Raises RuntimeError if the
        process exits, TimeoutError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    r = requests.post(self.url + "/generate", json=body, timeout=120)
                    if r.status_code == 200:
                        return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout_s:.0f} s")

    def get(self, path: str) -> Any:
        return requests.get(self.url + path, timeout=30).json()

    def flush_cache(self) -> bool:
        for _ in range(20):
            try:
                if requests.post(self.url + "/flush_cache", timeout=30).status_code == 200:
                    return True
            except requests.RequestException:
                pass
            time.sleep(0.5)
        return False

    def stop(self) -> None:
        from sglang.srt.utils.process import kill_process_tree

        if self.proc.poll() is None:
            kill_process_tree(self.proc.pid, timeout_s=15.0)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()
