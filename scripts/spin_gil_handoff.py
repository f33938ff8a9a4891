"""gRPC latency while the step thread spins over the step channels (a script, not a test).

After a step-channel request the drafter's step thread busy-polls the channels for --step-channel-spin-s, yielding the
GIL between polls. A gRPC request needs the GIL on the event loop's thread; after a time.sleep(0) the spinning thread
takes the GIL back before a woken thread can, and that one then waits out Python's 5 ms switch interval. So every
HANDOFF_EVERY-th yield is a real sleep of HANDOFF_S (clients/protocol/gil_yield.py). This script times a GetInfo over gRPC
(a job on the step thread: two GIL hand-offs each way) from a second client, with the drafter idle and while a step
channel keeps its step thread spinning, for the handoff as configured and for sleep(0) only, in alternating rounds.
The drafter runs in this process (ServerThread, tests/conftest.py), tiny head, CPU.

    python scripts/spin_gil_handoff.py --rounds 3 --out bench_out/spin_gil_handoff.json
"""
import argparse
import asyncio
import datetime
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

from drafter_client.protocol import gil_yield  # noqa: E402


async def time_get_info(server, spinning: bool, calls: int) -> list[float]:
    """ms of each GetInfo over TCP; spinning: a channel step 1 ms before each (the step thread spins after it), else
    60 ms of quiet (past the 50 ms spin: the thread waits on its idle poll)."""
    from drafter_client import DrafterClient, SequenceStep

    async with DrafterClient(server.uds, namespace="channel") as a, DrafterClient(server.tcp, namespace="grpc") as b:
        assert await a.open_step_channel(), "no step channel"
        step = SequenceStep("s", 0, list(range(10, 14)), torch.randn(4, 64), 1, 3)
        await a.propose([step])
        await b.get_info()
        times = []
        for _ in range(calls):
            if spinning:
                await a.propose([step])
                await asyncio.sleep(0.001)
            else:
                await asyncio.sleep(0.06)
            t0 = time.perf_counter()
            await b.get_info()
            times.append((time.perf_counter() - t0) * 1e3)
        await a.release(["s"])
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=60, help="GetInfo calls per case and round")
    ap.add_argument("--out", default="bench_out/spin_gil_handoff.json")
    a = ap.parse_args()
    from checkpoints import write_eagle1
    from conftest import ServerThread, make_config
    from drafter_client.benchmarks.report import write_json

    configured = gil_yield.HANDOFF_EVERY
    variants = {f"handoff every {configured} polls": configured, "sleep(0) only": 1 << 62}
    cases = [(v, spinning) for v in variants for spinning in (False, True)]
    got: dict[str, list[float]] = {f"{v}, {'spinning' if s else 'idle'}": [] for v, s in cases}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        head, target = write_eagle1(tmp / "model", seed=0, fc_bias=True)
        with ServerThread(make_config(head, target, tmp)) as server:
            for r in range(a.rounds):
                for v, spinning in cases:
                    gil_yield.HANDOFF_EVERY = variants[v]
                    ms = asyncio.run(time_get_info(server, spinning, a.calls))
                    got[f"{v}, {'spinning' if spinning else 'idle'}"] += ms
                    print(f"round {r + 1}: {v}, {'spinning' if spinning else 'idle'}: median "
                          f"{statistics.median(ms):.2f} ms", flush=True)
            gil_yield.HANDOFF_EVERY = configured
    rows = []
    print(f"\nGetInfo over gRPC, ms ({a.rounds} rounds x {a.calls} calls), {platform.machine()}, "
          f"{os.cpu_count()} cores")
    print(f"{'case':<42} {'median':>7} {'p90':>7} {'max':>7}")
    for case, ms in got.items():
        ms = sorted(ms)
        row = dict(case=case, median_ms=statistics.median(ms), p90_ms=ms[int(0.9 * (len(ms) - 1))], max_ms=ms[-1])
        rows.append(row)
        print(f"{case:<42} {row['median_ms']:>7.2f} {row['p90_ms']:>7.2f} {row['max_ms']:>7.2f}")
    out = write_json(a.out, dict(benchmark="spin_gil_handoff", date=datetime.datetime.now().isoformat(timespec="seconds"),
                                 device=f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                                 command=" ".join([sys.executable, *sys.argv]), args=vars(a),
                                 spin_handoff_every=configured, spin_handoff_s=gil_yield.HANDOFF_S, rows=rows))
    return 0 if out else 1


if __name__ == "__main__":
    sys.exit(main())
