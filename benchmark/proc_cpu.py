"""CPU time of processes and threads from Linux /proc, for the benchmark scripts: a server's
process tree by role (sweep_serving.py's per-point `cpu_util`) and this process's threads
(profile_decode_step.py's `*_thread_cpu_share`)."""

from __future__ import annotations

import os

from sglang.srt.utils.process import SCHEDULER_PROCESS_NAME


def stat_cpu_seconds(stat_path: str) -> float | None:
    """User + system CPU seconds so far of the process or thread whose /proc stat file is
    stat_path (utime + stime, fields 14 and 15; all threads for a process); None when it is
    gone."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_comm(comm_path: str) -> str:
    """The name in a /proc comm file ("" when the process or thread is gone)."""
    try:
        with open(comm_path) as f:
            return f.read().strip()
    except OSError:
        return ""


def process_tree(root: int) -> list[int]:
    """root and its descendants' pids, from /proc/<pid>/stat parent links (Linux)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def cpu_seconds_by_role(root: int, scheduler_name: str = SCHEDULER_PROCESS_NAME) -> dict:
    """CPU seconds so far of a server's process tree by role: `http` (the root: HTTP server
    and tokenizer manager), `scheduler` (processes named scheduler_name, which
    run_scheduler_process sets; the detokenization runs there too) and `other` (the rest,
    e.g. multiprocessing's resource tracker)."""
    out = {"http": 0.0, "scheduler": 0.0, "other": 0.0}
    for pid in process_tree(root):
        secs = stat_cpu_seconds(f"/proc/{pid}/stat")
        if secs is None:
            continue
        role = "http" if pid == root else "other"
        if pid != root and read_comm(f"/proc/{pid}/comm") == scheduler_name:
            role = "scheduler"
        out[role] += secs
    return out


def thread_cpu_seconds() -> dict[str, tuple[str, float]]:
    """Per thread of this process: tid -> (name, CPU seconds so far); the main thread's name
    ends in " (main)"."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        secs = stat_cpu_seconds(f"/proc/self/task/{tid}/stat")
        name = read_comm(f"/proc/self/task/{tid}/comm")
        if secs is None or not name:  # the thread ended
            continue
        name += " (main)" if int(tid) == os.getpid() else ""
        out[tid] = (name, secs)
    return out


def cpu_share(before: dict, after: dict, wall_s: float) -> list[str]:
    """The busiest threads between two thread_cpu_seconds() readings: 'name/tid: CPU seconds
    per wall second', after a 'total' line."""
    rows = []
    for tid, (name, cpu) in after.items():
        rows.append((cpu - before.get(tid, (name, 0.0))[1], f"{name}/{tid}"))
    rows.sort(reverse=True)
    total = sum(c for c, _ in rows)
    return [f"total: {total / wall_s:.2f}"] + [f"{n}: {c / wall_s:.2f}" for c, n in rows[:8]]


def waits_snapshot() -> dict[str, float]:
    """Counters of what can slow this thread other than its own work (Linux; a missing source
    reads 0): `minflt` / `majflt` (this process's page faults, getrusage), `nvcsw` / `nivcsw`
    (its voluntary and involuntary context switches), `run_delay_s` (this thread's time spent
    runnable but waiting for a CPU, /proc/thread-self/schedstat field 2, in seconds) and
    `steal_s` / `busy_s` (the whole host's CPU time taken by the hypervisor, and spent
    non-idle, summed over CPUs, /proc/stat, in seconds)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    out = {
        "minflt": float(ru.ru_minflt),
        "majflt": float(ru.ru_majflt),
        "nvcsw": float(ru.ru_nvcsw),
        "nivcsw": float(ru.ru_nivcsw),
        "run_delay_s": 0.0,
        "steal_s": 0.0,
        "busy_s": 0.0,
    }
    try:
        with open("/proc/thread-self/schedstat") as f:
            out["run_delay_s"] = int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        pass
    try:
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]  # the "cpu" line: all CPUs
        tick = os.sysconf("SC_CLK_TCK")
        # user nice system idle iowait irq softirq steal ...
        out["steal_s"] = (cpu[7] if len(cpu) > 7 else 0) / tick
        out["busy_s"] = (sum(cpu[:8]) - cpu[3] - cpu[4]) / tick
    except (OSError, ValueError):
        pass
    return out


def waits_per_step(before: dict[str, float], after: dict[str, float], steps: int) -> dict:
    """waits_snapshot() differences per step (times in microseconds, `_us` keys), for a window
    of `steps` steps (>= 1)."""
    out = {}
    for k, v in after.items():
        d = (v - before.get(k, 0.0)) / max(1, steps)
        if k.endswith("_s"):
            out[k[:-2] + "_us"] = round(1e6 * d, 2)
        else:
            out[k] = round(d, 3)
    return out
