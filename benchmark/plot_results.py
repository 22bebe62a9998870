"""PNG plots and a markdown table for benchmark JSON results, written next to each JSON file.

    python benchmark/plot_results.py benchmark/results/sweep_smollm2_h200.json [more.json ...]

Recognised files (by content):
- sweep (benchmark/sweep_serving.py): <stem>.png with output tok/s, median ITL and tok/s
  relative to no_spec against concurrency, one line per configuration; <stem>.md with one
  table per metric and, when no_spec and adaptive are present, issue 7's goal ratios.
- roofline (benchmark/bench_decode_roofline.py): <stem>.png bars (measured vs roofline tok/s),
  <stem>.md.
- vs-HF (benchmark/bench_vs_hf.py): <stem>.png grouped bars of decode tok/s per batch size
  (log scale, speedups annotated), <stem>.md.
- paired (benchmark/paired_serving.py): <stem>.png with output tok/s and median ITL per
  configuration (median over rounds, min-max bars) and each configuration's paired ratio to
  the first one with issue 7's 0.97 / 0.98 goal lines; the run's own <stem>.md gets a link to
  the plot.
Needs matplotlib (not on the GPU machine: run this here on the fetched JSON).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

FIXED = ("fixed_k1", "fixed_k3", "fixed_k5")


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _meta_md(res: dict, title: str) -> str:
    m = res.get("meta", {})
    out = f"# {title}\n\n"
    out += f"Command: `{m.get('command', '?')}`\n\n"
    keys = ("gpu", "torch", "transformers", "git_commit", "started")
    bits = [f"{k}: {m[k]}" for k in keys if m.get(k) is not None]
    return out + "; ".join(b for b in bits if not b.endswith(": None")) + "\n\n"


def _concurrency_axes(axes, conc: list[int], titles) -> None:
    """Log2 concurrency x axes with one tick per measured concurrency, titles and a grid."""
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(x) for x in conc])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)


# ---- sweep ----------------------------------------------------------------------------------
def _metric(cfg: dict, key: str) -> dict[int, float]:
    return {
        p["concurrency"]: p[key]
        for p in cfg.get("points", [])
        if p.get("status") == "ok" and p.get(key) is not None
    }


def sweep_report(res: dict, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfgs = [c for c in res["configs"] if c.get("points")]
    conc = sorted({p["concurrency"] for c in cfgs for p in c["points"]})
    tput = {c["name"]: _metric(c, "output_throughput") for c in cfgs}
    base = tput.get("no_spec", {})
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    for c in cfgs:
        name = c["name"]
        for ax, data in (
            (axes[0], tput[name]),
            (axes[1], _metric(c, "median_itl_ms")),
            (axes[2], {k: v / base[k] for k, v in tput[name].items() if base.get(k)}),
        ):
            xs = sorted(data)
            ax.plot(xs, [data[x] for x in xs], marker="o", label=name)
    _concurrency_axes(
        axes, conc, ("output tokens/s", "median ITL (ms)", "output tokens/s / no_spec")
    )
    axes[0].set_yscale("log")
    axes[0].legend()
    fig.suptitle(f"sweep_serving {res['settings'].get('preset')} ({res['meta'].get('gpu', '')})")
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=110)
    plt.close(fig)

    md = _meta_md(res, f"Serving sweep: {res['settings'].get('preset')}")
    s = res["settings"]
    md += (
        f"Prompts: {s.get('dataset')} ({os.path.basename(str(s.get('dataset_path')))}, chat "
        f"template {s.get('chat_template')}), output {s.get('output_len')} tokens, greedy, "
        f"ignore_eos; prompts per point max({s.get('min_prompts')}, "
        f"{s.get('prompts_per_concurrency')} x c) capped at {s.get('max_prompts')}.\n\n"
    )
    names = [c["name"] for c in cfgs]
    for key, label, digits in (
        ("output_throughput", "Output tokens/s", 1),
        ("median_itl_ms", "Median ITL (ms)", 2),
        ("p99_itl_ms", "P99 ITL (ms)", 2),
        ("median_ttft_ms", "Median TTFT (ms)", 1),
        ("accept_length", "Accept length (tokens per verify)", 2),
    ):
        data = {c["name"]: _metric(c, key) for c in cfgs}
        rows = [[str(x)] + [_fmt(data[n].get(x), digits) for n in names] for x in conc]
        md += f"## {label}\n\n" + _table(["concurrency"] + names, rows) + "\n"
    if "adaptive" in tput and base:
        rows = []
        for x in conc:
            a, b = tput["adaptive"].get(x), base.get(x)
            fixed = [tput[f][x] for f in FIXED if f in tput and x in tput[f]]
            best = max([b] + fixed) if b else None
            rows.append(
                [
                    str(x),
                    _fmt(a / b if a and b else None, 3),
                    _fmt(a / best if a and best else None, 3),
                ]
            )
        md += "## Issue 7 ratios\n\n"
        md += _table(
            ["concurrency", "adaptive / no_spec", "adaptive / max(no_spec, fixed K)"], rows
        )
        md += "\n"
    problems = [
        f"- {c['name']}: {c.get('status')} {c.get('error') or c.get('reason') or ''}".rstrip()
        for c in res["configs"]
        if c.get("status") != "ok"
    ]
    problems += [
        f"- {c['name']} c={p['concurrency']}: {p['status']} {p.get('error') or p.get('reason', '')}"
        for c in res["configs"]
        for p in c.get("points", [])
        if p.get("status") != "ok"
    ]
    if problems:
        md += "## Not measured\n\n" + "\n".join(problems) + "\n\n"
    md += f"![sweep]({os.path.basename(stem)}.png)\n"
    return _write(stem, md)


# ---- paired ---------------------------------------------------------------------------------
def paired_report(res: dict, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["summary"]
    names = list(dict.fromkeys(r["config"] for r in rows))
    conc = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    for name in names:
        mine = sorted((r for r in rows if r["config"] == name), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        med = [r["output_tok_s_median"] for r in mine]
        err = [
            [m - r["output_tok_s_min"] for m, r in zip(med, mine, strict=True)],
            [r["output_tok_s_max"] - m for m, r in zip(med, mine, strict=True)],
        ]
        axes[0].errorbar(xs, med, yerr=err, marker="o", capsize=3, label=name)
        axes[1].plot(xs, [r["median_itl_ms"] for r in mine], marker="o", label=name)
        ratio = [r for r in mine if r.get("ratio_to_base_median") is not None]
        if ratio:
            rm = [r["ratio_to_base_median"] for r in ratio]
            rerr = [
                [m - r["ratio_to_base_min"] for m, r in zip(rm, ratio, strict=True)],
                [r["ratio_to_base_max"] - m for m, r in zip(rm, ratio, strict=True)],
            ]
            axes[2].errorbar(
                [r["concurrency"] for r in ratio], rm, yerr=rerr, marker="o", capsize=3,
                label=f"{name} / {names[0]}",
            )  # fmt: skip
    axes[2].axhline(0.97, color="gray", linestyle="--", label="0.97 goal")
    axes[2].axhline(0.98, color="gray", linestyle=":", label="0.98 goal")
    axes[2].axhline(1.0, color="black", linewidth=0.5)
    titles = (
        "output tokens/s (median, min-max over rounds)",
        "median ITL (ms, median over rounds)",
        "paired ratio (same round; median, min-max)",
    )
    _concurrency_axes(axes, conc, titles)
    for ax in axes:
        ax.legend()
    axes[0].set_yscale("log")
    settings = res.get("settings", {})
    fig.suptitle(
        f"paired_serving {settings.get('preset')}, {settings.get('rounds')} rounds "
        f"({res.get('meta', {}).get('gpu', '')})"
    )
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=110)
    plt.close(fig)
    out = [stem + ".png"]
    link = f"![paired]({os.path.basename(stem)}.png)"
    if os.path.exists(stem + ".md"):
        with open(stem + ".md", encoding="utf-8") as f:
            text = f.read()
        if link not in text:
            with open(stem + ".md", "a", encoding="utf-8") as f:
                f.write(f"\n{link}\n")
        out.append(stem + ".md")
    return out


# ---- roofline -------------------------------------------------------------------------------
def roofline_report(res: dict, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res.get("summary", {})
    md = _meta_md(res, "Single-stream decode vs memory roofline")
    st = res.get("settings", {})
    md += (
        f"Model {os.path.basename(str(st.get('model_path')))} ({st.get('load_format')}, "
        f"{st.get('dtype')}), batch 1, input {st.get('input_len')}, output "
        f"{st.get('output_len')}, median of {st.get('repeats')} runs.\n\n"
    )
    rows = [
        ["decode tokens/s", _fmt(s.get("decode_tok_s"))],
        ["step time (ms)", _fmt(s.get("step_ms"), 3)],
        ["weight bytes per step (GB)", _fmt((s.get("weight_bytes_per_step") or 0) / 1e9, 3)],
        ["copy bandwidth (GB/s)", _fmt(s.get("copy_bandwidth_gb_s"))],
        ["roofline step time (ms)", _fmt(s.get("roofline_step_ms"), 3)],
        ["roofline tokens/s", _fmt(s.get("roofline_tok_s"))],
        ["roofline fraction", _fmt(s.get("roofline_fraction"), 3)],
        ["TTFT (ms)", _fmt(s.get("ttft_ms"))],
        ["engine start (s)", _fmt(res.get("engine_start_s"))],
    ]
    md += _table(["metric", "value"], rows)
    if res.get("error"):
        md += f"\nError: {res['error']}\n"
    files = []
    if s.get("decode_tok_s") and s.get("roofline_tok_s"):
        fig, ax = plt.subplots(figsize=(5, 4))
        vals = [s["decode_tok_s"], s["roofline_tok_s"]]
        ax.bar(["measured", "roofline"], vals, color=["tab:blue", "tab:gray"])
        ax.set_ylabel("decode tokens/s (batch 1)")
        ax.set_title(f"roofline fraction {s['roofline_fraction']:.1%}")
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom")
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=110)
        plt.close(fig)
        md += f"\n![roofline]({os.path.basename(stem)}.png)\n"
    return files + _write(stem, md)


# ---- vs HF ----------------------------------------------------------------------------------
def vs_hf_report(res: dict, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    hf = sorted({k for r in rows for k in r if k.startswith("hf_")}, key=lambda k: k != "hf_static")
    sides = ["sglang"] + hf
    bss = [r["batch_size"] for r in rows]
    md = _meta_md(res, "Decode throughput vs HF transformers generate")
    st = res.get("settings", {})
    md += (
        f"Input {st.get('input_len')}, output {st.get('output_len')} tokens, greedy; HF cache "
        f"{st.get('hf_cache')}, torch.compile {st.get('hf_torch_compile')}. Decode tokens/s = "
        "batch x (output - 1) / (time(output tokens) - time(1 token)).\n\n"
    )
    header = ["batch"] + [f"{s} tok/s" for s in sides] + [f"x vs {s}" for s in sides[1:]]
    table = []
    for r in rows:
        line = [str(r["batch_size"])]
        line += [_fmt(r.get(s, {}).get("decode_tok_s")) for s in sides]
        line += [_fmt(r.get(f"speedup_vs_{s}"), 2) for s in sides[1:]]
        table.append(line)
    md += _table(header, table)
    errs = [
        f"- bs {r['batch_size']} {s}: {r[s]['error']}"
        for r in rows
        for s in sides
        if isinstance(r.get(s), dict) and "error" in r[s]
    ]
    errs += [f"- {k}: {v}" for k, v in res.items() if k.endswith("_error")]
    if errs:
        md += "\nErrors:\n" + "\n".join(errs) + "\n"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(sides)
    for i, side in enumerate(sides):
        vals = [r.get(side, {}).get("decode_tok_s") or 0 for r in rows]
        xs = [j + (i - (len(sides) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, vals, width, label=side)
        if side != "sglang":
            continue
        for x, r, v in zip(xs, rows, vals, strict=True):
            sp = r.get(f"speedup_vs_{sides[1]}") if len(sides) > 1 else None
            if v and sp:
                ax.text(x, v, f"{sp:.1f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), [str(b) for b in bss])
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(f"decode tok/s, engine vs HF ({res['meta'].get('gpu', '')})")
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=110)
    plt.close(fig)
    md += f"\n![vs_hf]({os.path.basename(stem)}.png)\n"
    return _write(stem, md)


def _write(stem: str, md: str) -> list[str]:
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write(md)
    return [stem + ".md", stem + ".png"]


def report(path: str) -> list[str]:
    """Write the plot and table of one result file; returns the files written.

    Raises ValueError for a JSON file of no known kind."""
    with open(path, encoding="utf-8") as f:
        res = json.load(f)
    stem = os.path.splitext(path)[0]
    if "summary" in res and "points" in res:
        return paired_report(res, stem)
    if "configs" in res:
        return sweep_report(res, stem)
    if "rows" in res and any("sglang" in r or "hf_static" in r for r in res["rows"]):
        return vs_hf_report(res, stem)
    if "runs" in res or "bandwidth" in res:
        return roofline_report(res, stem)
    raise ValueError(f"{path}: not a sweep, paired, roofline or vs-HF result")


def main(argv: list[str] | None = None) -> None:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        raise SystemExit(__doc__)
    for path in paths:
        try:
            print("\n".join(f for f in report(path) if os.path.exists(f)))
        except Exception as e:  # noqa: BLE001 - one bad file must not stop the others
            print(f"{path}: {type(e).__name__}: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
