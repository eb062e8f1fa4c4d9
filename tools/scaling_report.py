"""Speed-up and efficiency of runs at several world sizes, from their summary.json files.

    python tools/scaling_report.py runs/to_distributed_training-1*/summary.json -o scaling.png
    python tools/scaling_report.py one/summary.json four/summary.json eight/summary.json

Give the summaries of the same training at 1, 4 and 8 GPUs (or 1 and 2 CPU processes). The run
with the fewest processes is the reference: speed-up = tokens/s / its tokens/s, ideal = world
size / its world size, efficiency = speed-up / ideal. The table goes to the terminal, the three
plots (tokens/s, speed-up against ideal, efficiency) to the PNG. Throughput is training tokens
per second (summary.json's tokens_per_s: evaluation and start-up left out), so the numbers
compare the training steps, not whole jobs; wall_time_s is printed next to them.

Only runs of the same training compare: the report refuses summaries of different scripts,
presets, precisions, sequence lengths, data or devices (a DDP run at 1 GPU against an FSDP run at
2 would draw a speed-up that means nothing), and two runs at the same world size (which one is
the point?).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_runs(paths: list[Path]) -> list[dict]:
    """One row per summary, sorted by world size; stops with one line on bad input."""
    runs = []
    for path in paths:
        try:
            summary = json.loads(Path(path).read_text())
            runs.append(dict(path=str(path), world_size=int(summary["world_size"]),
                             tokens_per_s=float(summary["tokens_per_s"]),
                             mfu=float(summary.get("mfu", float("nan"))),
                             wall_time_s=float(summary.get("wall_time_s", float("nan"))),
                             preset=summary.get("preset"),
                             precision=summary.get("precision", "fp32"),
                             same={key: json.dumps(summary.get(key), sort_keys=True)
                                   for key in SAME},
                             device=str(summary.get("device", "cpu")).split(":")[0]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            sys.exit(f"error: {path} is not a training summary.json ({type(e).__name__}: {e}): "
                     "give the OUT_DIR/summary.json files of finished runs")
    if not runs:
        sys.exit("error: give at least one summary.json")
    if not all(r["tokens_per_s"] > 0 for r in runs):
        bad = [r["path"] for r in runs if not r["tokens_per_s"] > 0]
        sys.exit(f"error: no measured throughput in {', '.join(bad)} (tokens_per_s is "
                 "NaN or 0): the run took fewer than 2 training steps")
    for key in SAME:
        values = {r["same"][key] for r in runs}
        if len(values) > 1:
            sys.exit(f"error: the runs differ in {key} ("
                     + ", ".join(f"{r['path']}: {json.loads(r['same'][key])}" for r in runs)
                     + "): compare runs of the same script and settings at different world "
                     "sizes only")
    sizes = [r["world_size"] for r in runs]
    twice = sorted({n for n in sizes if sizes.count(n) > 1})
    if twice:
        sys.exit(f"error: more than one run at world size {', '.join(map(str, twice))} ("
                 + ", ".join(r["path"] for r in runs if r["world_size"] in twice)
                 + "): give one summary per world size")
    return sorted(runs, key=lambda r: r["world_size"])


# What must be the same for a speed-up to mean anything (summary.json keys): the script, the
# model and its data, the precision and the sequence length, and the kind of device.
SAME = ("script", "preset", "model_config", "precision", "seq_len", "data", "device_type")


def scaling(runs: list[dict]) -> list[dict]:
    """Adds speedup, ideal and efficiency against the run with the fewest processes."""
    base = runs[0]
    for r in runs:
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["ideal"] = r["world_size"] / base["world_size"]
        r["efficiency"] = r["speedup"] / r["ideal"]
    return runs


def table(runs: list[dict]) -> str:
    lines = [f"{'world size':>10} {'tokens/s':>12} {'speed-up':>9} {'ideal':>6} "
             f"{'efficiency':>10} {'MFU':>6} {'wall time':>10}"]
    for r in runs:
        lines.append(f"{r['world_size']:>10} {r['tokens_per_s']:>12,.0f} {r['speedup']:>8.2f}x "
                     f"{r['ideal']:>5.0f}x {r['efficiency']:>10.0%} {r['mfu']:>6.1%} "
                     f"{r['wall_time_s']:>9.0f}s")
    return "\n".join(lines)


def plot(runs: list[dict], out: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # no display on a login node
    import matplotlib.pyplot as plt

    sizes = [r["world_size"] for r in runs]
    unit = "GPUs" if runs[0]["device"] == "cuda" else "CPU processes"  # what a process ran on
    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(14, 4))
    ax0.plot(sizes, [r["tokens_per_s"] for r in runs], "o-")
    for r in runs:
        ax0.annotate(f"{r['tokens_per_s']:,.0f}", (r["world_size"], r["tokens_per_s"]),
                     textcoords="offset points", xytext=(5, -12))
    ax0.set(xlabel=unit, ylabel="training tokens/s (all processes)",
            title="throughput", xticks=sizes, ylim=(0, None))
    ax1.plot(sizes, [r["ideal"] for r in runs], "--", color="grey", label="ideal")
    ax1.plot(sizes, [r["speedup"] for r in runs], "o-", label="measured")
    for r in runs:
        ax1.annotate(f"{r['speedup']:.2f}x", (r["world_size"], r["speedup"]),
                     textcoords="offset points", xytext=(5, -12))
    ax1.set(xlabel=unit, ylabel=f"speed-up over {sizes[0]}", title="speed-up",
            xticks=sizes)
    ax1.legend()
    ax2.axhline(100, ls="--", color="grey", label="ideal")
    ax2.plot(sizes, [100 * r["efficiency"] for r in runs], "o-", label="measured")
    ax2.set(xlabel=unit, ylabel="efficiency (%)", title="scaling efficiency",
            xticks=sizes, ylim=(0, max(110, 10 + max(100 * r["efficiency"] for r in runs))))
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)  # a complete PNG or none


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summaries", nargs="+", type=Path, help="summary.json of each run")
    parser.add_argument("-o", "--output", type=Path, default=Path("scaling.png"),
                        help="the plot (PNG; default scaling.png)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    runs = scaling(load_runs(args.summaries))
    print(table(runs))
    for r in runs:
        if r["efficiency"] > 1.15:  # more than ideal: the runs did not do the same work alike
            print(f"warning: {r['world_size']} processes reach {r['efficiency']:.0%} of ideal "
                  f"scaling: more than perfect means the runs are not comparable (threads per "
                  f"process, OMP_NUM_THREADS; other load on the machine; a shorter run)",
                  file=sys.stderr)
    title = args.title or (f"{runs[0]['preset']} preset, {runs[0]['precision']}: "
                           f"tokens/s against {runs[0]['world_size']} process(es)")
    plot(runs, args.output, title)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
