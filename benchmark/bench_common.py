"""Helpers shared by the benchmark scripts in this folder: run metadata, JSON output, engine
arguments from argparse, and the weight bytes a decode step reads."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS_DIR = os.path.join(HERE, "results")


def git_commit() -> str | None:
    """HEAD of the repository holding this file, or None (no git, or not a checkout)."""
    try:
        out = subprocess.run(
            ["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001 - metadata is best-effort
        return None


def run_meta(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line, time, versions and device of this run."""
    argv = sys.argv if argv is None else argv
    meta: dict[str, Any] = {
        "command": "python " + " ".join(shlex.quote(a) for a in argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
        "cuda": torch.cuda.is_available(),
    }
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        meta["gpu"] = props.name
        meta["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    siblings = cpu_siblings()
    if siblings:
        meta["cpu_siblings"] = siblings
    return meta


def parse_cpu_list_groups(groups: list[str]) -> list[int]:
    """All CPUs of cpu_siblings() groups ("0,8", "2-3"), in order, repeats kept."""
    out: list[int] = []
    for group in groups:
        for item in group.split(","):
            lo, _, hi = item.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    return out


def cpu_siblings() -> list[str]:
    """The host's CPUs grouped by physical core (Linux thread_siblings_list, e.g. ["0,8",
    "1,9", ...]; one CPU per group without SMT), in CPU order; [] where unknown. Paired runs
    pin servers to CPU sets: sets that split a core's siblings share that core."""
    groups: list[str] = []
    base = "/sys/devices/system/cpu"
    try:
        cpus = sorted(int(n[3:]) for n in os.listdir(base) if n[3:].isdigit() and n[:3] == "cpu")
    except OSError:
        return []
    for cpu in cpus:
        try:
            with open(f"{base}/cpu{cpu}/topology/thread_siblings_list") as f:
                group = f.read().strip()
        except OSError:
            continue
        if group not in groups:
            groups.append(group)
    return groups


def write_json(path: str, obj: Any) -> None:
    """Write obj as indented JSON through a temporary file (a crash never leaves half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


def git_commit_of_cwd() -> str:
    """Short HEAD of the checkout the current directory is in ('' outside git): the host
    profiles run from worktrees of other commits, so this, not git_commit(), names the code."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip()


def append_run(path: str, command: str, result: dict[str, Any]) -> None:
    """Append `result` to the "runs" list of the JSON file at path, creating it as
    {"command": command, "runs": []} when missing."""
    try:
        with open(path) as f:
            runs = json.load(f)
    except FileNotFoundError:
        runs = {"command": command, "runs": []}
    runs["runs"].append(result)
    write_json(path, runs)


def engine_kwargs(args: Any) -> dict[str, Any]:
    """ServerArgs fields (all of them, as parsed by ServerArgs.add_cli_args) from argparse args."""
    from sglang.srt.server_args import ServerArgs

    return {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerArgs)}


def error_record(e: BaseException) -> str:
    """One-line description of an exception for a JSON result."""
    return f"{type(e).__name__}: {e}"[:2000]


def failed_parts(result: dict) -> list[str]:
    """What failed in a sweep_serving.py or paired_serving.py result: the run's own error, each
    configuration that failed to start and each point that raised ("error") or was cancelled
    ("timeout"), as short labels. Skipped points (deadline, budget) are not failures. The tools
    exit 1 when this is not empty, after writing their JSON."""
    out = [f"run: {result['error']}"[:200]] if result.get("error") else []
    points = list(result.get("points", []))
    for cfg in result.get("configs", []):
        if cfg.get("status") == "error":
            out.append(f"{cfg.get('name')}: {str(cfg.get('error', '')).splitlines()[0][:200]}")
        points += [dict(p, config=cfg.get("name")) for p in cfg.get("points", [])]
    for p in points:
        if p.get("status") in ("error", "timeout"):
            where = f"{p.get('config')} c={p.get('concurrency')}"
            where += f" round {p['round']}" if "round" in p else ""
            out.append(f"{where}: {p['status']}")
    return out


def exit_status(result: dict) -> int:
    """0 when every configuration started and no point failed (failed_parts), else 1 with the
    failures listed on stderr."""
    bad = failed_parts(result)
    for line in bad:
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if bad else 0


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _cfg_get(cfg: Any, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def llama_weight_bytes(hf_config: Any, dtype_bytes: int) -> dict[str, int]:
    """Bytes of weights one decode step reads for a Llama-architecture model (one token per
    request, batch 1): every decoder layer's projections and norms, the final norm and the
    lm_head (V x H, also when tied: it is read as the output matrix); the embedding is a row
    gather (H values). Returns {"layers", "lm_head", "embedding_row", "norm", "total"}."""

    def get(name: str, default: Any = None) -> Any:
        return _cfg_get(hf_config, name, default)

    h, n_layers = get("hidden_size"), get("num_hidden_layers")
    heads = get("num_attention_heads")
    kv_heads = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or h // heads
    inter, vocab = get("intermediate_size"), get("vocab_size")
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h  # qkv, o, gate/up/down, norms
    if get("attention_bias", False):
        per_layer += q + 2 * kv
    parts = {
        "layers": n_layers * per_layer * dtype_bytes,
        "lm_head": vocab * h * dtype_bytes,
        "embedding_row": h * dtype_bytes,
        "norm": h * dtype_bytes,
    }
    parts["total"] = sum(parts.values())
    return parts


def kv_bytes_per_token(hf_config: Any, dtype_bytes: int) -> int:
    """K and V bytes of one token over all layers."""

    def get(name: str, default: Any = None) -> Any:
        return _cfg_get(hf_config, name, default)

    heads = get("num_attention_heads")
    head_dim = get("head_dim") or get("hidden_size") // heads
    kv_heads = get("num_key_value_heads") or heads
    return 2 * get("num_hidden_layers") * kv_heads * head_dim * dtype_bytes


def measure_copy_bandwidth(n_bytes: int, device: str, iters: int = 10) -> dict[str, float]:
    """Device-to-device copy bandwidth: (read + write bytes) / time of `iters` copies of an
    n_bytes buffer, after 2 warm-up copies. CUDA timing uses events; CPU, perf_counter.
    Returns {"bytes", "iters", "seconds", "bandwidth_gb_s"} (GB = 1e9 bytes). Frees the
    buffers before returning."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    sync(device)
    if str(device).startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1000.0
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    del src, dst
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    return {
        "bytes": n_bytes,
        "iters": iters,
        "seconds": seconds,
        "bandwidth_gb_s": 2 * n_bytes * iters / seconds / 1e9,
    }


def tiny_target_and_draft() -> tuple[str, str]:
    """The CPU host-cost benchmarks' models: one torch thread, then a tiny random Llama
    (sglang.test.tiny_models) and a tiny EAGLE-3 draft for it (sglang.test.tiny_eagle3) in a
    fresh temporary folder. Returns (model dir, draft dir)."""
    import tempfile

    from sglang.test.tiny_eagle3 import make_tiny_eagle3_dir
    from sglang.test.tiny_models import make_tiny_model_dir

    torch.set_num_threads(1)
    d = tempfile.mkdtemp()
    model = make_tiny_model_dir(d + "/m")
    return model, make_tiny_eagle3_dir(d + "/e", model)


def plain_and_adaptive_no_drafts(draft: str, k: int = 3) -> dict[str, dict]:
    """Scheduler kwargs of the two CPU host-cost configurations: `plain` (no speculation) and
    `adaptive_no_drafts` (EAGLE-3 with `draft`, K = k, --speculative-adaptive under a fixed
    step-time model where drafting never pays: every step is a plain decode, the common case
    under load)."""
    never = {"time_model": {"verify_tokens": 1.0}, "online_correction": False}
    return {
        "plain": {},
        "adaptive_no_drafts": dict(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=draft,
            speculative_num_steps=k,
            speculative_adaptive=True,
            speculative_adaptive_config=json.dumps(never),
        ),
    }


def overlap_cpu_scheduler(model: str, kw: dict):
    """An in-process Scheduler on the CPU with overlap scheduling on (as a CUDA server runs),
    float32, a 65536-token KV pool; kw: further ServerArgs fields (speculation)."""
    from sglang.test.scheduler_utils import make_scheduler

    return make_scheduler(
        model,
        device="cpu",
        dtype="float32",
        max_total_tokens=65536,
        disable_overlap_schedule=False,
        **kw,
    )


class TopUpLoad:
    """A serving-like load on an in-process scheduler: streamed greedy requests (ignore_eos) of
    out_lens[0]..out_lens[1] output tokens (uniform, inclusive, from a numpy generator seeded
    with `seed`), topped up to `bs` requests in the system (in_system) before every step, as
    `bs` clients that each send a new request when their last one finished, so that requests
    finish and join every few steps. Prompts: ids 10..39, the same for every request
    (input_len None), or input_len random ids in [100, 30000) each from the same generator
    (no two share a cached prefix, as distinct conversations' uncached parts)."""

    def __init__(
        self,
        sched,
        bs: int,
        seed: int = 0,
        out_lens: tuple[int, int] = (8, 40),
        input_len: int | None = None,
    ):
        import numpy as np

        self.s, self.bs, self.out_lens, self.input_len = sched, bs, out_lens, input_len
        self.rng = np.random.default_rng(seed)
        self.submitted = 0

    def in_system(self) -> int:
        """Requests submitted and not yet finished and committed: waiting, running, and those
        of a prefill step in flight (overlap scheduling: they join `running` when the step is
        committed) or mid-prompt (the chunked request). Counting only running and waiting
        ones, as before the thirty-eighth session, topped a load of 2 up to 4 requests for
        36% of its decode steps (8: 16 for 17%; benchmark/README.md, thirty-eighth session)."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        s = self.s
        reqs = {id(r): r for r in (*s.running, *s.waiting_queue)}
        step = getattr(s, "inflight", None)
        if step is not None and step.batch.forward_mode == ForwardMode.EXTEND:
            reqs.update((id(r), r) for r in step.batch.reqs)
        if getattr(s, "chunked_req", None) is not None:
            reqs[id(s.chunked_req)] = s.chunked_req
        return sum(not r.finished() for r in reqs.values())

    def prompt(self) -> list[int]:
        if self.input_len is None:
            return list(range(10, 40))
        return self.rng.integers(100, 30000, self.input_len).tolist()

    def run(self, steps: int) -> None:
        """Top up, then step the scheduler; `steps` times."""
        from sglang.test.scheduler_utils import submit

        s, (lo, hi) = self.s, self.out_lens
        for _ in range(steps):
            n = self.in_system()
            while n < self.bs:
                params = {
                    "max_new_tokens": int(self.rng.integers(lo, hi + 1)),
                    "temperature": 0,
                    "ignore_eos": True,
                }
                submit(s, f"r{self.submitted}", self.prompt(), params, stream=True)
                now = self.in_system()
                if now <= n:  # finished at once: it would top up forever
                    raise RuntimeError(
                        f"the scheduler rejected request r{self.submitted} at submit (a prompt "
                        "longer than the context, or a full waiting queue): cannot top up"
                    )
                n = now
                self.submitted += 1
            s.step()


class PhaseTimers:
    """Wall time of named methods, by phase: `targets` are (object, method name, phase) triples;
    each method is replaced on that instance by a wrapper that adds its wall ms to the phase
    (several methods may share one) until restore(). The object may also be a module (a
    function looked up as a module global at its call sites): restore() puts the function
    back. take() returns the ms accumulated since the last take (rounded to the microsecond)
    and starts over."""

    def __init__(self, targets: list[tuple[Any, str, str]]) -> None:
        self.ms: dict[str, float] = {}
        self.undo: list[tuple[Any, str, Any]] = []  # (object, name, own attribute or None)
        for obj, name, phase in targets:
            self._wrap(obj, name, phase)

    def _wrap(self, obj: Any, name: str, phase: str) -> None:
        fn = getattr(obj, name)
        own = getattr(obj, "__dict__", {}).get(name)  # a module's function, an own attribute

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms[phase] = self.ms.get(phase, 0.0) + 1e3 * (time.perf_counter() - t)

        setattr(obj, name, timed)
        self.undo.append((obj, name, own))

    def take(self) -> dict[str, float]:
        out, self.ms = {k: round(v, 3) for k, v in sorted(self.ms.items())}, {}
        return out

    def restore(self) -> None:
        for obj, name, own in reversed(self.undo):
            if own is None:
                delattr(obj, name)  # back to the class's method
            else:
                setattr(obj, name, own)
        self.undo = []
