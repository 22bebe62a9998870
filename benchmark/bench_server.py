"""A `python -m sglang.launch_server` subprocess for the benchmark scripts: start on a free
port with its log in a file, wait until it serves, query it, kill its whole process tree."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from typing import Any

import requests
from proc_cpu import process_tree


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


def parse_cpu_list(text: str) -> set[int]:
    """CPU numbers of a Linux CPU list such as "0-3,8,10-11" (taskset -c / cpuset syntax).
    Raises ValueError for an empty list, a malformed item or a reversed range."""
    cpus: set[int] = set()
    for item in text.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: item {item!r} is not N or N-M")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"bad CPU list {text!r}: range {item!r} is reversed")
        cpus.update(range(a, b + 1))
    return cpus


def affinity_preexec(cpus: str | None):
    """For subprocess.Popen's preexec_fn: pins the child (and what it starts) to the CPU list
    `cpus`, or None when `cpus` is empty. Raises ValueError for a malformed list (here, not in
    the child)."""
    if not cpus:
        return None
    cpu_set = parse_cpu_list(cpus)
    return lambda: os.sched_setaffinity(0, cpu_set)


_ENV_WORD = re.compile(r"[A-Z_][A-Z0-9_]*=")


def split_env(flags: list[str]) -> tuple[dict[str, str], list[str]]:
    """A configuration's leading NAME=VALUE words (environment variables of its server, as in
    `env NAME=VALUE cmd`: e.g. --add-config 'x=SGLANG_SCHEDULER_HUGEPAGE_HEAP=0
    --speculative-adaptive') and the launch_server flags after them."""
    i = 0
    while i < len(flags) and _ENV_WORD.match(flags[i]):
        i += 1
    env = dict(word.split("=", 1) for word in flags[:i])
    return env, flags[i:]


class Server:
    """A launch_server subprocess (same process group as this one, so a killed sweep does not
    leave it running); stop() kills its whole tree. With `cpus` (a CPU list, parse_cpu_list)
    the server and every process it starts run on those CPUs only (the affinity is set in the
    child before exec and inherited), so that servers side by side do not share cores. Leading
    NAME=VALUE words of `flags` are set in the server's environment (split_env)."""

    def __init__(self, flags: list[str], log_path: str, cpus: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env, flags = split_env(flags)
        self.env = env  # set in the server's environment on top of this process's
        cmd = [sys.executable, "-m", "sglang.launch_server", *flags]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        self.cmd = [*(f"{k}={v}" for k, v in env.items()), *cmd]
        self.log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed in stop()
        self.log.write("$ " + self.shell_command() + "\n")
        self.log.flush()
        if cpus:
            self.log.write(f"# CPU affinity: {cpus}\n")
            self.log.flush()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=affinity_preexec(cpus),
            env={**os.environ, **env},
        )

    def shell_command(self) -> str:
        """The command as a shell runs it: the NAME=value words first, each value quoted alone
        (a quoted whole word would not be an assignment)."""
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join([*env, *(shlex.quote(c) for c in self.cmd[len(env) :])])

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

    def set_cpus(self, cpus: str) -> int:
        """Pin every thread of the server's process tree (as it is now) to the CPU list
        `cpus` (parse_cpu_list); returns how many threads were pinned. Threads that exit
        meanwhile are skipped. Linux only (/proc). Raises ValueError for a malformed list."""
        cpu_set = parse_cpu_list(cpus)
        pinned = 0
        for pid in process_tree(self.proc.pid):
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    os.sched_setaffinity(int(tid), cpu_set)
                    pinned += 1
                except OSError:
                    pass
        return pinned

    def stop(self) -> None:
        from sglang.srt.utils.process import kill_process_tree

        if self.proc.poll() is None:
            kill_process_tree(self.proc.pid, timeout_s=15.0)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()
