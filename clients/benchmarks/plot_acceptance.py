"""Plot acceptance JSONs written by acceptance.py: mean acceptance length against k, and per-position acceptance
at the largest k, one line per file.

    python -m drafter_client.benchmarks.plot_acceptance docs/bench/acceptance_*_stdlib_cpu.json --out docs/acceptance.png
"""
import argparse
import json
import pathlib
import sys

from drafter_client.benchmarks import pyplot


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    plt = pyplot()
    if plt is None:
        return 1
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for f in a.files:
        d = json.loads(pathlib.Path(f).read_text())
        label = f"{pathlib.Path(d['head']).name}, {d['prompts']} prompts"
        ks = [r["k"] for r in d["by_k"]]
        left.plot(ks, [r["mean_acceptance_length"] for r in d["by_k"]], marker="o", label=label)
        last = d["by_k"][-1]
        pos = last["per_position_acceptance"]
        right.plot(range(1, len(pos) + 1), pos, marker="o", label=f"{label}, k={last['k']}")
    left.set(xlabel="k (drafts per step)", ylabel="mean acceptance length (1 + accepted / drafts)",
             title="Acceptance length")
    right.set(xlabel="draft position", ylabel="acceptance rate (unconditional)", title="Acceptance by position",
              ylim=(0, 1))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
