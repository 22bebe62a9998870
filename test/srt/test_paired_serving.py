"""benchmark/paired_serving.py's bookkeeping (no servers): the ABBA order of a round and the
summary's medians and paired ratios over rounds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmark"))

from bench_common import exit_status, failed_parts  # noqa: E402
from paired_report import failures, markdown, summarize  # noqa: E402
from paired_serving import main, round_order  # noqa: E402


def _point(c: int, r: int, name: str, tput: float, ttft: float = 10.0, itl: float = 2.0):
    return {
        "concurrency": c,
        "round": r,
        "config": name,
        "status": "ok",
        "output_throughput": tput,
        "median_ttft_ms": ttft,
        "median_itl_ms": itl,
    }


def test_round_order_alternates():
    cfgs = ["no_spec", "adaptive", "fixed_k3"]
    assert [round_order(cfgs, r) for r in range(3)] == [cfgs, cfgs[::-1], cfgs]
    assert round_order(cfgs, 1) is not cfgs  # a copy: callers may not reorder the settings


def test_schedule_orders_points_by_round_or_by_concurrency():
    from paired_serving import schedule

    cfgs = ["no_spec", "adaptive"]
    by_round = schedule([1, 4], 2, cfgs, "round")
    assert by_round == [
        (1, 0, "no_spec"), (1, 0, "adaptive"), (4, 0, "no_spec"), (4, 0, "adaptive"),
        (1, 1, "adaptive"), (1, 1, "no_spec"), (4, 1, "adaptive"), (4, 1, "no_spec"),
    ]  # fmt: skip
    by_c = schedule([1, 4], 2, cfgs, "concurrency")
    assert by_c == [
        (1, 0, "no_spec"), (1, 0, "adaptive"), (1, 1, "adaptive"), (1, 1, "no_spec"),
        (4, 0, "no_spec"), (4, 0, "adaptive"), (4, 1, "adaptive"), (4, 1, "no_spec"),
    ]  # fmt: skip
    assert sorted(by_round) == sorted(by_c)  # the same points
    with pytest.raises(ValueError, match="order"):
        schedule([1], 1, cfgs, "config")


def test_summary_pairs_rounds_and_skips_failed_points():
    pts = [
        _point(4, 0, "no_spec", 100.0, ttft=20.0),
        _point(4, 0, "adaptive", 90.0),
        _point(4, 1, "adaptive", 120.0, itl=3.0),
        _point(4, 1, "no_spec", 100.0, ttft=40.0),
        _point(4, 2, "no_spec", 200.0),
        {**_point(4, 2, "adaptive", 1.0), "status": "error"},  # not counted anywhere
        _point(16, 0, "adaptive", 50.0),  # no baseline in its round: no ratio
    ]
    rows = {(r["concurrency"], r["config"]): r for r in summarize(pts, ["no_spec", "adaptive"])}
    base, ad = rows[(4, "no_spec")], rows[(4, "adaptive")]
    assert base["rounds"] == 3 and ad["rounds"] == 2
    assert base["output_tok_s_median"] == 100.0
    assert (base["output_tok_s_min"], base["output_tok_s_max"]) == (100.0, 200.0)
    assert base["median_ttft_ms"] == 20.0 and "ratio_to_base_median" not in base
    # rounds 0 and 1: 90 / 100 and 120 / 100
    assert ad["ratio_to_base_median"] == pytest.approx(1.05)
    assert (ad["ratio_to_base_min"], ad["ratio_to_base_max"]) == (0.9, 1.2)
    assert ad["median_itl_ms"] == 2.5
    assert rows[(16, "adaptive")]["rounds"] == 1
    assert "ratio_to_base_median" not in rows[(16, "adaptive")]
    assert rows[(16, "no_spec")]["rounds"] == 0
    assert "cpu_client_median" not in base  # the points carry no cpu_util


def test_summary_takes_the_median_cores_busy_per_role():
    def util(x: float) -> dict:
        return {"client": x, "http": 2 * x, "scheduler": 0.9, "other": 0.0}

    pts = [
        {**_point(8, r, "no_spec", 100.0), "cpu_util": util(x)}
        for r, x in enumerate((0.2, 0.4, 0.3))
    ]
    (row,) = summarize(pts, ["no_spec"])
    assert (row["cpu_client_median"], row["cpu_http_median"]) == (0.3, 0.6)
    assert row["cpu_scheduler_median"] == 0.9


def test_markdown_lists_every_row_with_the_command():
    util = {"client": 0.91, "http": 0.5, "scheduler": 0.97, "other": 0.0}
    host = {"recv": 5.0, "plan": 100.0, "build": 50.0, "launch": 300.0, "resolve": 700.0}
    host |= {"commit": 80.0, "flush": 60.0, "launch_extend": 120.0, "plan_extend": 10.0}
    adaptive = {**_point(1, 0, "adaptive", 97.0), "cpu_util": util, "host_us_per_step": host}
    adaptive["gc_per_step"] = {"us": 12.4, "gen0": 30, "gen1": 2, "gen2": 0}
    pts = [_point(1, 0, "no_spec", 100.0), adaptive]
    result = {
        "meta": {"command": "python benchmark/paired_serving.py --preset smollm2"},
        "settings": {"preset": "smollm2", "configs": ["no_spec", "adaptive"], "rounds": 1},
        "summary": summarize(pts, ["no_spec", "adaptive"])
        + [{"concurrency": 4, "config": "adaptive", "rounds": 0}],
    }
    md = markdown(result)
    assert "python benchmark/paired_serving.py --preset smollm2" in md
    assert "| 1 | no_spec | 1 | 100 (100-100) | - | 10.0 | 2.00 | - | - |" in md  # neither
    row = "| 1 | adaptive | 1 | 97 (97-97) | 0.970 (0.970-0.970) | 10.0 | 2.00 "
    # busy: every phase but resolve (their prefill parts are inside them)
    row += "| 0.91 / 0.50 / 0.97 | 595 / 700 (gc 12) |"
    assert row in md
    assert "| 4 | adaptive | 0 | - | - | - | - | - | - |" in md


def test_markdown_says_what_was_not_measured():
    pts = [
        _point(1, 0, "no_spec", 0.46),
        {**_point(1, 0, "adaptive", 0.0), "status": "error", "error": "TimeoutError: x\ny"},
        {
            "concurrency": 4,
            "round": 0,
            "config": "no_spec",
            "status": "skipped",
            "reason": "deadline",
        },
        {
            "concurrency": 4,
            "round": 0,
            "config": "adaptive",
            "status": "skipped",
            "reason": "deadline",
        },
    ]
    result = {
        "meta": {"command": "python benchmark/paired_serving.py"},
        "settings": {"preset": "smollm2", "configs": ["no_spec", "adaptive"], "rounds": 1},
        "configs": [
            {"name": "no_spec"},
            {"name": "adaptive", "status": "error", "error": "server start: RuntimeError: rc 2"},
        ],
        "points": pts,
        "summary": summarize(pts, ["no_spec", "adaptive"]),
        "error": "interrupted, SystemExit: 143",
    }
    md = markdown(result)
    assert "| 1 | no_spec | 1 | 0.46 (0.46-0.46) |" in md  # small tok/s keep their digits
    assert "- run stopped: interrupted, SystemExit: 143" in md
    assert "- adaptive: server start: RuntimeError: rc 2" in md
    assert "- c=1 round 0 adaptive: error: TimeoutError: x\n" in md
    assert "- 2 point(s) skipped: deadline" in md
    assert failures({"configs": [{"name": "a"}], "points": pts[:1]}) == []


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--configs", "no_spec", "no_spec"], "twice"),
        (["--configs", "no_spec", "adaptive", "--concurrency", "0"], ">= 1"),
        (["--configs", "no_spec", "adaptive", "--rounds", "0"], ">= 1"),
        (["--configs", "no_spec"], ">= 2"),
        (["--configs", "no_spec", "adaptive", "--host-probe-cpu", "100000"], "not a CPU"),
        (
            ["--configs", "no_spec", "adaptive", "--cpu-sets", "0", "1", "--host-probe-cpu", "0"],
            "a CPU of its own",
        ),
    ],
)
def test_bad_arguments_stop_before_any_server(argv, why, tmp_path):
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit, match=why):
        main(["--preset", "smollm2", "--result-file", str(out), *argv])
    assert not out.exists()


def test_plot_results_draws_a_paired_run_and_links_it_once(tmp_path):
    """plot_results.py recognises a paired result: it writes the PNG and appends its link to
    the run's markdown once (a second run does not repeat it), leaving the table as it was."""
    pytest.importorskip("matplotlib")
    from plot_results import report

    pts = [
        _point(c, r, name, t * c)
        for c in (1, 4)
        for r in range(3)
        for name, t in (("no_spec", 100.0 + r), ("adaptive", 95.0 + 2 * r))
    ]
    res = {
        "meta": {"command": "python benchmark/paired_serving.py"},
        "settings": {"preset": "tiny", "rounds": 3},
        "configs": [{"name": "no_spec"}, {"name": "adaptive"}],
        "points": pts,
        "summary": summarize(pts, ["no_spec", "adaptive"]),
    }
    path = tmp_path / "paired_tiny.json"
    path.write_text(__import__("json").dumps(res))
    table = "| c | config |\n"
    (tmp_path / "paired_tiny.md").write_text(table)
    written = report(str(path))
    assert written == [str(tmp_path / "paired_tiny.png"), str(tmp_path / "paired_tiny.md")]
    png = (tmp_path / "paired_tiny.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    report(str(path))
    md = (tmp_path / "paired_tiny.md").read_text()
    assert md.startswith(table) and md.count("![paired](paired_tiny.png)") == 1


def test_cpu_lists_parse_and_pin_a_child():
    from bench_server import affinity_preexec, parse_cpu_list

    assert parse_cpu_list("0-2,5,7-8") == {0, 1, 2, 5, 7, 8}
    assert parse_cpu_list("3") == {3}
    for bad in ("", "a", "1-", "4-2", "1,,2"):
        with pytest.raises(ValueError, match="bad CPU list"):
            parse_cpu_list(bad)
    assert affinity_preexec(None) is None and affinity_preexec("") is None
    cpu = min(os.sched_getaffinity(0))
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        preexec_fn=affinity_preexec(str(cpu)),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == f"[{cpu}]"


_TREE = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def _allowed(tid: int) -> str:
    with open(f"/proc/{tid}/status") as f:
        return next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list"))


def test_set_cpus_repins_every_thread_of_the_server_tree():
    """--rotate-cpu-sets re-pins running servers: Server.set_cpus moves every thread of the
    process tree (a second thread, a child process), not only the main thread."""
    from types import SimpleNamespace

    from bench_server import Server
    from proc_cpu import process_tree

    cpus = sorted(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(proc.stdout.readline())
        time.sleep(0.2)  # the thread started before the print; the child is running
        assert set(process_tree(proc.pid)) >= {proc.pid, child}
        pinned = Server.set_cpus(SimpleNamespace(proc=proc), str(cpus[-1]))
        tids = [int(t) for pid in (proc.pid, child) for t in os.listdir(f"/proc/{pid}/task")]
        assert pinned >= len(tids) >= 3
        assert {_allowed(t) for t in tids} == {str(cpus[-1])}
    finally:
        proc.kill()
        proc.wait()
        if child is not None:
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize(
    "extra, why",
    [
        (["--rotate-cpu-sets"], "needs --cpu-sets"),
        (["--cpu-sets", "0-1"], "1 CPU lists"),
        (["--cpu-sets", "0-1", "x"], "bad CPU list"),
        (["--cpu-sets", "0", "1", "--client-cpus", "3-2"], "reversed"),
    ],
)
def test_bad_cpu_sets_stop_before_any_server(extra, why, tmp_path):
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit, match=why):
        main(
            ["--preset", "smollm2", "--configs", "no_spec", "adaptive", "--result-file", str(out)]
            + extra
        )
    assert not out.exists()


_CLIENT_ONLY_PIN = """
import os, subprocess, sys
sys.path.insert(0, sys.argv[1])
import bench_server, paired_serving

seen = []

class ChildAffinity:  # what a server started like bench_server.Server would run on
    def __init__(self, flags, log_path, cpus=None):
        probe = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
        out = subprocess.run(probe, preexec_fn=bench_server.affinity_preexec(cpus),
                             capture_output=True, text=True, check=True)
        seen.append(out.stdout.strip())
        raise RuntimeError("no server in this test")

paired_serving.Server = ChildAffinity
paired_serving.main(["--preset", "smollm2", "--configs", "no_spec", "adaptive",
                     "--result-file", sys.argv[2], "--log-dir", sys.argv[3],
                     "--client-cpus", sys.argv[4]])
print("SERVER", seen[0])
print("CLIENT", sorted(os.sched_getaffinity(0)))
"""


def test_client_cpus_alone_leave_the_servers_their_cpus(tmp_path):
    """--client-cpus without --cpu-sets pins the client only: a server keeps the CPUs the
    benchmark had before (a child inherits its parent's affinity, so without care every
    server would run on the client's CPUs)."""
    before = sorted(os.sched_getaffinity(0))
    if len(before) < 2:
        pytest.skip("needs 2 CPUs")
    bench = os.path.join(os.path.dirname(__file__), "..", "..", "benchmark")
    argv = [str(tmp_path / "r.json"), str(tmp_path / "logs"), str(before[0])]
    out = subprocess.run(
        [sys.executable, "-c", _CLIENT_ONLY_PIN, bench, *argv],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["CLIENT"] == f"[{before[0]}]"
    assert lines["SERVER"] == str(before)


def test_run_meta_records_cpu_siblings():
    """Every run's meta names the physical-core groups of the host's CPUs (what --cpu-sets
    should follow): each online CPU in exactly one group."""
    from bench_common import cpu_siblings, parse_cpu_list_groups, run_meta

    groups = cpu_siblings()
    if not groups:
        pytest.skip("no /sys CPU topology here")
    assert run_meta([])["cpu_siblings"] == groups
    cpus = parse_cpu_list_groups(groups)
    assert len(cpus) == len(set(cpus)) and set(os.sched_getaffinity(0)) <= set(cpus)


_NAMED_TREE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import sys, time
sys.path.insert(0, "python")
from sglang.srt.utils.process import SCHEDULER_PROCESS_NAME, set_process_name
set_process_name(SCHEDULER_PROCESS_NAME)
print("named", flush=True)
end = time.process_time() + 0.6
while time.process_time() < end:
    pass
time.sleep(60)
'''], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "named"
print(child.pid, flush=True)
time.sleep(60)
"""


def test_cpu_seconds_by_role_tells_the_scheduler_from_the_http_process():
    """A point's cpu_util splits the server's CPU time by role: the root process (HTTP and
    tokenizer manager) and the process run_scheduler_process names "sglang::sched". Here the
    child named so burns 0.6 s of CPU and the root none."""
    from proc_cpu import cpu_seconds_by_role, read_comm

    repo = os.path.join(os.path.dirname(__file__), "..", "..")
    child = None
    proc = subprocess.Popen(
        [sys.executable, "-c", _NAMED_TREE], stdout=subprocess.PIPE, text=True, cwd=repo
    )
    try:
        child = int(proc.stdout.readline())
        assert read_comm(f"/proc/{child}/comm") == "sglang::sched"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            roles = cpu_seconds_by_role(proc.pid)
            if roles["scheduler"] >= 0.6:
                break
            time.sleep(0.1)
        assert 0.6 <= roles["scheduler"] < 5.0
        assert roles["http"] < 0.5  # started a child, then slept
        assert roles["other"] == 0.0
    finally:
        proc.kill()
        proc.wait()
        if child:
            os.kill(child, signal.SIGKILL)


def test_host_us_per_step_from_two_server_states():
    from sweep_serving import host_us_per_step

    before = {"forward_steps": 100, "host_s_plan": 1.0, "host_s_flush": 0.5, "x": 3}
    after = {"forward_steps": 300, "host_s_plan": 1.02, "host_s_flush": 0.53, "x": 9}
    assert host_us_per_step(before, after) == {"plan": 100.0, "flush": 150.0}
    assert host_us_per_step(before, before) == {}  # no step ran
    assert host_us_per_step({"forward_steps": 0}, after) == {}  # an older server: no keys


def test_gc_per_step_from_two_server_states():
    from sweep_serving import gc_per_step

    before = {"forward_steps": 100, "gc_s_gen0": 0.5, "gc_s_gen1": 0.25, "gc_s_gen2": 1.0}
    before |= {"gc_collections_gen0": 10, "gc_collections_gen1": 2, "gc_collections_gen2": 1}
    after = {"forward_steps": 600, "gc_s_gen0": 0.5025, "gc_s_gen1": 0.25, "gc_s_gen2": 1.0125}
    after |= {"gc_collections_gen0": 40, "gc_collections_gen1": 4, "gc_collections_gen2": 2}
    # (0.0025 + 0.0125) s over 500 steps = 30 us per step
    assert gc_per_step(before, after) == {"us": 30.0, "gen0": 30, "gen1": 2, "gen2": 1}
    assert gc_per_step(before, before) == {}  # no step ran
    assert gc_per_step({"forward_steps": 0}, after) == {}  # an older server: no keys


def test_ratio_to_the_twins_geometric_mean():
    """With an A/A twin of the base (no_spec_b), the other configurations also get their ratio
    to the two servers' geometric mean per round; the twin itself and the base do not, and a
    round that lacks either twin does not count. The table gains the column."""
    pts = [
        _point(4, 0, "no_spec", 100.0),
        _point(4, 0, "no_spec_b", 121.0),
        _point(4, 0, "adaptive", 110.0),  # 110 / sqrt(100 * 121) = 1.0
        _point(4, 1, "no_spec", 100.0),
        _point(4, 1, "no_spec_b", 100.0),
        _point(4, 1, "adaptive", 90.0),  # 0.9
        _point(4, 2, "no_spec", 100.0),
        _point(4, 2, "adaptive", 50.0),  # no twin this round: not counted
    ]
    configs = ["no_spec", "no_spec_b", "adaptive"]
    rows = {r["config"]: r for r in summarize(pts, configs)}
    assert "ratio_to_twins_median" not in rows["no_spec"]
    assert "ratio_to_twins_median" not in rows["no_spec_b"]
    ad = rows["adaptive"]
    assert (ad["ratio_to_twins_min"], ad["ratio_to_twins_max"]) == pytest.approx((0.9, 1.0))
    assert ad["ratio_to_twins_median"] == pytest.approx(0.95)
    assert ad["ratio_to_base_median"] == pytest.approx(0.9)  # 1.1, 0.9, 0.5
    result = {
        "settings": {"configs": configs, "preset": "smollm2", "rounds": 3},
        "meta": {"command": "python benchmark/paired_serving.py"},
        "summary": summarize(pts, configs),
    }
    table = markdown(result)
    assert "geometric mean" in table and "| 0.950 (0.900-1.000) |" in table
    assert all(line.count("|") == 11 for line in table.splitlines() if line.startswith("| 4 "))
    no_twin = markdown({**result, "summary": summarize(pts, ["no_spec", "adaptive"])})
    assert "geometric mean" not in no_twin


def test_waits_per_step_counts_this_process_faults():
    """profile_decode_step's waits_per_step: touching 64 MiB of fresh memory over 4 "steps"
    costs this process a minor fault per page, 4096 per step with 4 KiB pages and at least 8
    with 2 MiB huge pages; times come out in microseconds per step."""
    from proc_cpu import waits_per_step, waits_snapshot

    before = waits_snapshot()
    buf = bytearray(64 << 20)  # zero-filled on first touch, page by page
    for i in range(0, len(buf), 4096):
        buf[i] = 1
    after = waits_snapshot()
    per = waits_per_step(before, after, 4)
    assert set(per) == {
        "minflt",
        "majflt",
        "nvcsw",
        "nivcsw",
        "run_delay_us",
        "steal_us",
        "busy_us",
    }
    assert per["minflt"] >= 8
    assert per["busy_us"] >= 0 and per["steal_us"] >= 0
    synthetic = waits_per_step(
        {"run_delay_s": 1.0, "nvcsw": 2.0}, {"run_delay_s": 1.5, "nvcsw": 6.0}, 2
    )
    assert synthetic == {"run_delay_us": 250000.0, "nvcsw": 2.0}


class _FakeServer:
    """bench_server.Server's surface as PairedRun uses it, recording starts and stops."""

    log: list = []

    def __init__(self, flags, log_path, cpus=None) -> None:
        self.flags, self.cmd = flags, ["fake", *flags]
        self.proc = type("P", (), {"poll": staticmethod(lambda: None)})()
        self.stopped = False
        _FakeServer.log.append(("start", log_path))

    def wait_ready(self, timeout_s: float) -> None:
        pass

    def shell_command(self) -> str:
        return " ".join(self.cmd)

    def stop(self) -> None:
        self.stopped = True
        _FakeServer.log.append(("stop", id(self)))

    def set_cpus(self, cpus: str) -> int:
        return 0


def test_restart_every_runs_rounds_on_fresh_server_instances(monkeypatch, tmp_path):
    """--restart-every 2 with 5 rounds: every configuration's server is started three times
    (before rounds 0, 2 and 4), the old one stopped first, each point records the instance
    that ran it (r // 2), each configuration its restarts; the prompts are read once."""
    import paired_serving
    from sweep_serving import Sweep

    _FakeServer.log = []
    monkeypatch.setattr(paired_serving, "Server", _FakeServer)
    loads = []
    monkeypatch.setattr(paired_serving, "load_rows", lambda srv, a, n: loads.append(n) or [0] * n)

    def fake_point(self, server, name, point, left_s):
        assert not server.stopped
        point.update(status="ok", output_throughput=100.0, completed=point["num_prompts"])
        point.update(median_ttft_ms=5.0, median_itl_ms=1.0)

    monkeypatch.setattr(Sweep, "run_point", fake_point)
    out = tmp_path / "r.json"
    argv = ["--preset", "smollm2", "--configs", "no_spec", "adaptive", "--concurrency", "1"]
    argv += ["--rounds", "5", "--restart-every", "2", "--result-file", str(out)]
    argv += ["--log-dir", str(tmp_path / "logs")]
    result = main(argv)
    starts = [e for e in _FakeServer.log if e[0] == "start"]
    assert len(starts) == 6 and len(loads) == 1
    assert sum(e[0] == "stop" for e in _FakeServer.log) == 6  # 4 restarts + the end
    by_round = {(p["config"], p["round"]): p["instance"] for p in result["points"]}
    assert by_round == {(n, r): r // 2 for n in ("no_spec", "adaptive") for r in range(5)}
    for cfg in result["configs"]:
        assert [x["instance"] for x in cfg["restarts"]] == [1, 2]
        assert all("startup_s" in x for x in cfg["restarts"])
    assert result["settings"]["restart_every"] == 2


@pytest.mark.parametrize(
    "extra,why",
    [
        (["--restart-every", "0"], ">= 1"),
        (["--restart-every", "2", "--order", "concurrency"], "round"),
    ],
)
def test_bad_restart_every_stops_before_any_server(extra, why, tmp_path):
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit, match=why):
        main(
            [
                "--preset",
                "smollm2",
                "--configs",
                "no_spec",
                "adaptive",
                "--result-file",
                str(out),
                *extra,
            ]
        )
    assert not out.exists()


def test_configuration_env_words_reach_only_that_server(monkeypatch, tmp_path):
    """Leading NAME=VALUE words of a configuration's flags are its server's environment (e.g.
    SGLANG_SCHEDULER_HUGEPAGE_HEAP=0 for a pair that tells the scheduler heap's effect), not
    launch_server flags; a flag's own '=' value is not mistaken for one."""
    import bench_server
    from bench_server import Server, split_env

    assert split_env(["A_1=x", "B=", "--flag", "C=y"]) == ({"A_1": "x", "B": ""}, ["--flag", "C=y"])
    assert split_env(['--speculative-adaptive-config={"a": 1}']) == (
        {},
        ['--speculative-adaptive-config={"a": 1}'],
    )
    assert split_env(["lower=1"]) == ({}, ["lower=1"])
    seen = {}

    class _Popen:
        def __init__(self, cmd, **kw):
            seen.update(cmd=cmd, env=kw["env"])

    monkeypatch.setattr(bench_server.subprocess, "Popen", _Popen)
    monkeypatch.delenv("SGLANG_SCHEDULER_HUGEPAGE_HEAP", raising=False)
    s = Server(["SGLANG_SCHEDULER_HUGEPAGE_HEAP=0", "--speculative-adaptive"], str(tmp_path / "l"))
    s.log.close()
    assert seen["cmd"][1:3] == ["-m", "sglang.launch_server"]
    assert (
        "--speculative-adaptive" in seen["cmd"]
        and "SGLANG_SCHEDULER_HUGEPAGE_HEAP=0" not in seen["cmd"]
    )
    assert seen["env"]["SGLANG_SCHEDULER_HUGEPAGE_HEAP"] == "0"
    assert seen["env"]["PATH"] == os.environ["PATH"]  # the rest of the environment is kept
    assert s.cmd[0] == "SGLANG_SCHEDULER_HUGEPAGE_HEAP=0"
    # recorded as a shell runs it: a value that needs quoting is quoted alone
    assert s.shell_command().startswith("SGLANG_SCHEDULER_HUGEPAGE_HEAP=0 ")
    q = Server(["FOO=a b", "--flag"], str(tmp_path / "q"))
    q.log.close()
    assert seen["env"]["FOO"] == "a b"
    monkeypatch.undo()  # a real subprocess from here on
    prefix = q.shell_command().split(" -m ")[0]  # FOO='a b' <python>
    code = prefix + " -c 'import os; print(os.environ[\"FOO\"])'"
    out = subprocess.run(["bash", "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "a b", out.stderr
    assert "SGLANG_SCHEDULER_HUGEPAGE_HEAP" not in os.environ


def test_config_flags_keep_a_configurations_env_words_first():
    """The preset's model flags go after a configuration's environment words, which must lead
    the flags for Server to take them as environment (split_env)."""
    from sweep_presets import CONFIGS, PRESETS, config_flags

    preset = PRESETS["smollm2"]
    extra = {"x": ["SGLANG_SCHEDULER_HUGEPAGE_HEAP=0", "--speculative-algorithm", "EAGLE3"]}
    flags = config_flags(preset, "x", extra)
    assert flags[0] == "SGLANG_SCHEDULER_HUGEPAGE_HEAP=0"
    assert flags[1:] == preset.model_flags + preset.draft_flags + extra["x"][1:]
    assert config_flags(preset, "no_spec", {}) == preset.model_flags + CONFIGS["no_spec"]


def test_failed_parts_name_what_failed_in_sweep_and_paired_results(capsys):
    """The tools' exit status: 1 for a server that did not start, a point that raised or timed
    out, or a run stopped by an error; skipped points (deadline, budget) are not failures."""
    sweep = {
        "configs": [
            {"name": "no_spec", "status": "ok", "points": [{"concurrency": 1, "status": "ok"}]},
            {"name": "fixed_k1", "status": "error", "error": "server start: RuntimeError: rc 1\nx"},
            {
                "name": "adaptive",
                "status": "partial",
                "points": [
                    {"concurrency": 1, "status": "timeout"},
                    {"concurrency": 2, "status": "skipped", "reason": "config budget"},
                ],
            },
        ]
    }
    assert failed_parts(sweep) == [
        "fixed_k1: server start: RuntimeError: rc 1",
        "adaptive c=1: timeout",
    ]
    assert exit_status(sweep) == 1
    assert "FAILED adaptive c=1: timeout" in capsys.readouterr().err
    paired = {
        "configs": [{"name": "no_spec"}, {"name": "adaptive"}],
        "points": [
            {"concurrency": 4, "round": 1, "config": "adaptive", "status": "error"},
            {"concurrency": 8, "round": 0, "config": "no_spec", "status": "skipped"},
        ],
        "error": "interrupted, SystemExit: 143",
    }
    assert failed_parts(paired) == [
        "run: interrupted, SystemExit: 143",
        "adaptive c=4 round 1: error",
    ]
    ok = {"configs": [{"name": "a", "status": "ok", "points": [{"status": "skipped"}]}]}
    assert failed_parts(ok) == [] and exit_status(ok) == 0


def test_smollm2_dummy_preset_is_the_bundled_models_shape() -> None:
    """The smollm2_dummy preset stands in for the bundled model in host-time runs: its config
    must give the converted GGUF's shape, its tokenizer the GGUF's files and chat template, and
    its speculative configurations the bundled draft."""
    import json

    from sweep_presets import LLAMA8B_DIR, PRESETS, SMOLLM2_DUMMY_DIR, config_flags

    from sglang.srt.model_loader.bundled import bundled_gguf_path
    from sglang.srt.model_loader.gguf_convert import convert_gguf_to_hf
    from sglang.srt.speculative.bundled_draft import bundled_draft_path

    real = convert_gguf_to_hf(bundled_gguf_path())
    with open(os.path.join(real, "config.json")) as f:
        want = json.load(f)
    with open(os.path.join(SMOLLM2_DUMMY_DIR, "config.json")) as f:
        got = json.load(f)
    shape = ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"]
    shape += ["num_hidden_layers", "head_dim", "vocab_size", "tie_word_embeddings"]
    shape += ["rope_parameters", "max_position_embeddings", "rms_norm_eps", "eos_token_id"]
    assert {k: got[k] for k in shape} == {k: want[k] for k in shape}
    with open(os.path.join(real, "tokenizer.json"), "rb") as a:
        with open(os.path.join(LLAMA8B_DIR, "tokenizer.json"), "rb") as b:
            assert a.read() == b.read()
    with open(os.path.join(real, "chat_template.jinja")) as f:
        template = f.read()
    with open(os.path.join(LLAMA8B_DIR, "tokenizer_config.json")) as f:
        assert json.load(f)["chat_template"] == template
    preset = PRESETS["smollm2_dummy"]
    flags = config_flags(preset, "adaptive", {})
    i = flags.index("--speculative-draft-model-path")
    assert flags[i + 1] == bundled_draft_path() and bundled_draft_path() is not None
    assert "--speculative-draft-model-path" not in config_flags(preset, "no_spec", {})
    assert preset.chat_template
