"""What the CUDA graphs cost at start-up, with and without the decode-step chains, the packed first-step graphs and the
sampled decode graphs (a script, not a test).

cuda_graphs.py captures, per padded batch size, one graph of one decode step, chains of DECODE_CHAIN_LENGTHS decode
steps back to back (a step's k - 1 decode steps replay as one to three graphs instead of k - 1), one sampled decode
step per top-N width (0, 16, the cap), and the first-step graphs, padded and packed. This script builds the drafter's runtime (bench_step's random head of --preset,
max_batch_seqs --max-batch-seqs, --first-step-graph-tokens 8, --first-step-graph-rows 2048, k <= 8) in a fresh process
per arm, alternating over --rounds rounds:

  chains     the drafter as it is
  none       DECODE_CHAIN_LENGTHS = () (single decode steps only, as before the twenty-fourth session)
  unpacked   --first-step-graph-rows 0 (no packed first-step graphs, as before the twenty-eighth session)
  unsampled  --no-sampled-step-graphs (sampling steps' decode steps run eagerly, as before the twenty-ninth session)

and prints each arm's capture time (DecodeGraphs.capture_seconds, the median and range over rounds), the device
memory the graphs hold (capture_bytes) and how many graphs of each kind; JSON to --out (device, date, command).
capture_seconds counts the warm-up run before each capture, which compiles the Triton kernels where the cache does
not hold them yet: a first process (the chains arm, its figures dropped) fills the cache before the rounds.

    python benchmarks/bench_graph_capture.py --preset llama3-8b-eagle3 --rounds 2 --out docs/bench/graph_capture.json
"""
import argparse
import datetime
import json
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ARMS = ("chains", "none", "unpacked", "unsampled")


def child(preset: str, arm: str, max_batch_seqs: int) -> dict:
    """In this process: the runtime with the arm's chains; its graphs' figures."""
    import torch

    from drafter_client.benchmarks import bench_step as b
    from drafter_service.engine import cuda_graphs

    if arm == "none":
        cuda_graphs.DECODE_CHAIN_LENGTHS = ()
    shape = b.PRESETS[preset]
    with tempfile.TemporaryDirectory() as tmp:
        rt = b.random_head_runtime(pathlib.Path(tmp), shape, 2048, device="cuda", kv_cache_tokens=max_batch_seqs * 1100,
                                   max_batch_seqs=max_batch_seqs, first_step_graph_tokens=8, max_draft_tokens=8,
                                   first_step_graph_rows=0 if arm == "unpacked" else 2048,
                                   sampled_step_graphs=arm != "unsampled",
                                   engine_applies_fc=preset.endswith("eagle3"))
        g = rt.proposer.decode_graphs
        return dict(arm=arm, decode_graphs=len(g.graphs), chains=len(g.chains), chain_lengths=list(g.chain_lengths),
                    first_step_graphs=len(g.first_graphs), packed_graphs=len(g.packed_graphs),
                    sampled_graphs=len(g.sampled_graphs), capture_seconds=g.capture_seconds,
                    capture_mib=g.capture_bytes / 2**20, device=torch.cuda.get_device_name())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-8b-eagle3")
    ap.add_argument("--max-batch-seqs", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench_out/graph_capture.json")
    ap.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)  # (one arm in this process: JSON on stdout)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.preset, a.child, a.max_batch_seqs)))
        return 0
    import torch

    from drafter_client.benchmarks import bench_step as b
    from drafter_client.benchmarks.report import write_json

    if not torch.cuda.is_available():
        print("bench_graph_capture.py needs a GPU: it captures CUDA graphs", file=sys.stderr)
        return 2
    if a.preset not in b.PRESETS:
        ap.error(f"--preset: one of {', '.join(sorted(b.PRESETS))}")
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    warmup = [(0, "chains")]  # (round 0: compiles into the Triton cache; not counted)
    for r, arm in warmup + [(r, arm) for r in range(1, a.rounds + 1) for arm in ARMS]:
        done = subprocess.run([sys.executable, __file__, "--preset", a.preset, "--max-batch-seqs",
                               str(a.max_batch_seqs), "--child", arm], capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        x = json.loads(done.stdout.strip().splitlines()[-1])
        if r > 0:
            runs[arm].append(x)
        print(f"{f'round {r}' if r else 'warm-up'} {arm}: captured in {x['capture_seconds']:.2f} s, "
              f"{x['capture_mib']:.1f} MiB", flush=True)
    print(f"\n{a.preset}, max_batch_seqs {a.max_batch_seqs}, {a.rounds} rounds after a warm-up process (a fresh "
          f"process per arm and round)")
    print("arm       decode graphs  chains  first-step graphs  packed  sampled  capture s (median [range])  MiB")
    rows = []
    for arm in ARMS:
        xs = runs[arm]
        secs = [x["capture_seconds"] for x in xs]
        row = dict(arm=arm, decode_graphs=xs[0]["decode_graphs"], chains=xs[0]["chains"],
                   chain_lengths=xs[0]["chain_lengths"], first_step_graphs=xs[0]["first_step_graphs"],
                   packed_graphs=xs[0]["packed_graphs"], sampled_graphs=xs[0]["sampled_graphs"],
                   capture_seconds=secs, capture_seconds_median=statistics.median(secs),
                   capture_mib=[x["capture_mib"] for x in xs])
        rows.append(row)
        print(f"{arm:9s} {row['decode_graphs']:13d} {row['chains']:7d} {row['first_step_graphs']:18d} "
              f"{row['packed_graphs']:7d} {row['sampled_graphs']:8d}  "
              f"{row['capture_seconds_median']:.2f} [{min(secs):.2f}, {max(secs):.2f}]"
              f"{'':12s}{statistics.median(row['capture_mib']):.1f}")
    write_json(a.out, dict(device=runs["chains"][0]["device"], host=platform.node(),
                           date=datetime.date.today().isoformat(),
                           command=shlex.join([sys.executable, *sys.argv]), preset=a.preset,
                           max_batch_seqs=a.max_batch_seqs, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
