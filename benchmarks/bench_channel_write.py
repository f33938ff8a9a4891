"""The client's side of a large step through a step channel: serializing it and writing it into the mailbox (a
script, not a test). Two ways, alternated in rounds:

  via-buffer    the request built into a buffer of its own, then copied into the mailbox (the client before
                DirectRequest: two copies of the states)
  direct        DirectRequest.write_into the mailbox (what the client does now: one copy)

One decode step of B sequences, m = 3 rows each, bf16 states W wide (4096: EAGLE-1 8B; 12288: EAGLE-3 8B), into an
anonymous mapping laid out as a mailbox. Prints a table, writes JSON.

    python benchmarks/bench_channel_write.py --out docs/bench/channel_write_cpu.json
"""
import argparse
import datetime
import mmap
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks.report import write_json  # noqa: E402
from drafter_client import SequenceStep  # noqa: E402
from drafter_client.messages import DirectRequest, serialize_request  # noqa: E402
from drafter_client.protocol.mailbox import Mailbox  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x128,12288x128,12288x256", help="WIDTHxBATCH,...")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench_out/channel_write.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for shape in a.shapes.split(","):
        width, batch = (int(x) for x in shape.split("x"))
        m = 3
        hidden = torch.randn(batch * m, width).to(torch.bfloat16)
        steps = [SequenceStep(f"s{i}", 1000, list(range(m)), hidden[i * m:(i + 1) * m], 5, 5) for i in range(batch)]
        request = serialize_request("ns", steps)
        assert isinstance(request, DirectRequest)
        size = len(request)
        mm = mmap.mmap(-1, Mailbox.segment_bytes(size, 4096))
        box = Mailbox.initialize(mm, size, 4096, checksums=False)

        def via_buffer():
            r = serialize_request("ns", steps)
            buf = bytearray(len(r))
            r.write_into(buf)
            box.write(box.request, 1, buf)

        def direct():
            box.write(box.request, 1, serialize_request("ns", steps))

        times = {"via-buffer": [], "direct": []}
        for _ in range(a.rounds):
            for name, fn in (("via-buffer", via_buffer), ("direct", direct)):
                xs = []
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    fn()
                    xs.append(time.perf_counter() - t0)
                times[name].append(statistics.median(xs) * 1e3)
        box.release()
        mm.close()
        row = dict(width=width, batch=batch, mbytes=hidden.numel() * 2 / 1e6,
                   **{f"{k}_ms": statistics.median(v) for k, v in times.items()},
                   **{f"{k}_spread_ms": [min(v), max(v)] for k, v in times.items()})
        rows.append(row)
        print(f"W={width:5d} B={batch:4d} {row['mbytes']:5.1f} MB: via a buffer {row['via-buffer_ms']:.2f} ms "
              f"({min(times['via-buffer']):.2f}-{max(times['via-buffer']):.2f}), straight into the mailbox "
              f"{row['direct_ms']:.2f} ms ({min(times['direct']):.2f}-{max(times['direct']):.2f})", flush=True)
    result = dict(benchmark="bench_channel_write", date=datetime.datetime.now().isoformat(timespec="seconds"),
                  device=f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, 1 torch thread",
                  torch=torch.__version__, command=" ".join(sys.argv), rounds=a.rounds, reps=a.reps, rows=rows)
    write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
