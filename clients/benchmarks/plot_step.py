"""Plot a bench_step JSON: ms per engine step against batch size for the in-process proposer (with and without
CUDA graphs when measured), the sidecar (unary, stream, step channel when measured), and the floor; with --rounds,
each path's median over the rounds (and with --grpc-floor, the unary path's floor).

    python -m drafter_client.benchmarks.plot_step docs/bench/step_llama3-8b_h200_graphs_ab.json --out docs/step_h200.png
"""
import argparse
import json
import pathlib
import statistics
import sys

from drafter_client.benchmarks import pyplot


def measured(rows: list[dict], value) -> tuple[list[int], list[float]]:
    """The batch sizes where value(row) is known (a KeyError: not measured there) and the values: a run stopped by
    its time limit ("complete": false) measured its last batch sizes' paths in part or not at all."""
    batches, values = [], []
    for r in rows:
        try:
            values.append(value(r))
        except KeyError:
            continue
        batches.append(r["batch"])
    return batches, values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    plt = pyplot()
    if plt is None:
        return 1
    d = json.loads(pathlib.Path(a.file).read_text())
    rows = d["rows"]
    b = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4.6))

    def plot(value, **style) -> None:  # a path over the batch sizes where it was measured, if any
        xs, ys = measured(rows, value)
        if xs:
            ax.plot(xs, ys, **style)

    # each path the JSON measured (a --rounds-only run has no single pass through the sidecar)
    lines = [("sidecar_ms", "sidecar (client over UDS, unary)"),
             ("sidecar_batch_api_ms", "sidecar (batch API, unary)"),
             ("sidecar_stream_ms", "sidecar (one ProposeStream)"),
             ("sidecar_channel_ms", "sidecar (step channel)"),
             ("sidecar_channel_batch_api_ms", "sidecar (step channel, batch API: columns)"),
             ("sidecar_channel_cuda_ipc_ms", "sidecar (step channel, states by CUDA IPC)"),
             ("in_process_ms", "in-process" + (" (CUDA graphs)" if d.get("cuda_graphs") else "")),
             ("in_process_states_on_gpu_ms", "in-process, states on the GPU"),
             ("in_process_columns_ms", "in-process, as columns (step_batch)"),
             ("in_process_columns_states_on_gpu_ms", "in-process, as columns, states on the GPU"),
             ("in_process_eager_ms", "in-process, eager")]
    for key, label in lines:
        plot(lambda r, key=key: r[key], marker="o", label=label)
    # --rounds: each path's median over the alternating rounds (a --rounds-only run has these only)
    rounds = [("channel_ms", "step channel (rounds)"), ("channel_batch_api_ms", "step channel, batch API (rounds)"),
              ("unary_batch_api_ms", "batch API by unary gRPC (rounds)"),
              ("in_process_columns_ms", "in-process, as columns (rounds)")]
    for key, label in rounds:
        plot(lambda r, key=key: statistics.median(r["rounds"][key]), marker="s", linestyle=":", label=label)
    plot(lambda r: statistics.median([t + g for t, g in zip(r["rounds"]["in_process_columns_ms"],
                                                            r["rounds"]["bare_grpc_ms"])]),
         linestyle="-.", color="grey", label="unary floor: in-process columns + bare gRPC (rounds)")
    ax.plot(b, [r["floor_ms"] for r in rows], linestyle="--", color="k", label="floor (bytes / bandwidth)")
    cut = "" if d.get("complete", True) else "\n(the run stopped before its end: some paths stop early)"
    ax.set(xscale="log", xlabel="batch (sequences)", ylabel="ms per engine step",
           title=f"{d['preset']}, {d['dtype']}, context {d['context']}, k={d['k']}\n{d['device']}, {d['date'][:10]}{cut}")
    ax.set_xticks(b, [str(x) for x in b])
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
