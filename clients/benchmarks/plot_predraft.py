"""Plot pre-drafting runs against pre-drafting off, run by run (a script; docs/predraft.md, docs/performance.md).

Each JSON is one run of the `predraft` benchmark. Within a run, every row's tokens/s and median wait are divided by
the mean of the same batch's F = 0 rows (a run may interleave F = 0 with the budgets, as `--budgets 0,8,16,0,16,8,0`
does, so that the run's drift shows in the F = 0 spread); rows of one (batch, F) are averaged, and the F = 0 rows'
own spread is drawn as an error bar at 1.0. One group of bars per run (its label: LABEL=PATH, or the file name).

    python -m drafter_client.benchmarks.plot_predraft "odds check=docs/bench/predraft_interleaved_h200_2026-11-26.json" \\
        "no check=docs/bench/predraft_interleaved_no-odds-check_h200_2026-11-26.json" --out docs/bench/predraft_odds_h200.png
"""
import argparse
import json
import pathlib
import statistics
import sys


def relative(result: dict) -> dict:
    """{(batch, F): (tok/s over F = 0's mean, wait p50 over F = 0's mean)} averaged over the run's rows, and F = 0's
    own (min, max) under the key (batch, "spread")."""
    rows = [r for r in result["rows"] if r.get("budget") is not None and r.get("wait_ms_p50") is not None]
    out = {}
    for B in sorted({r["batch"] for r in rows}):
        base = [r for r in rows if r["batch"] == B and r["budget"] == 0]
        if not base:
            continue
        tok0 = statistics.fmean(r["tokens_per_s"] for r in base)
        wait0 = statistics.fmean(r["wait_ms_p50"] for r in base)
        out[(B, "spread")] = (min(r["tokens_per_s"] for r in base) / tok0, max(r["tokens_per_s"] for r in base) / tok0)
        for F in sorted({r["budget"] for r in rows if r["batch"] == B and r["budget"]}):
            same = [r for r in rows if r["batch"] == B and r["budget"] == F]
            out[(B, F)] = (statistics.fmean(r["tokens_per_s"] for r in same) / tok0,
                           statistics.fmean(r["wait_ms_p50"] for r in same) / wait0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="LABEL=PATH or PATH of predraft benchmark JSON")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default=None)
    a = ap.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return 1
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for spec in a.runs:
        label, _, path = spec.rpartition("=")
        result = json.loads(pathlib.Path(path).read_text())
        runs.append((label or pathlib.Path(path).stem, result, relative(result)))
    keys = sorted({k for _, _, rel in runs for k in rel if k[1] != "spread"})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4))
    width = 0.8 / len(runs)
    for i, (label, _, rel) in enumerate(runs):
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(keys))]
        ax1.bar(xs, [rel.get(k, (float("nan"),))[0] for k in keys], width, label=label)
        ax2.bar(xs, [rel.get(k, (0, float("nan")))[1] for k in keys], width, label=label)
        for j, k in enumerate(keys):  # F = 0's own spread in this run
            lo, hi = rel.get((k[0], "spread"), (1.0, 1.0))
            ax1.plot([xs[j], xs[j]], [lo, hi], color="k", lw=1, alpha=0.5)
    for ax, what in ((ax1, "tokens/s over pre-drafting off (F = 0, mean of the run)"),
                     (ax2, "engine's median wait over F = 0's")):
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(keys)), [f"batch {B}\nF = {F}" for B, F in keys], fontsize=8)
        ax.set_ylabel(what, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    ax1.set_ylim(0.5, 1.25)  # (the differences of interest are a few percent; bars start below the axis)
    ax2.set_ylim(0.0, 1.3)
    first = runs[0][1]
    fig.suptitle(a.title or f"pre-drafting against F = 0, {first['drafter']['method']} head, {first['date'][:10]} "
                 "(thin lines: F = 0's own spread in the run)", fontsize=10)
    fig.tight_layout()
    pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    plt.close(fig)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
