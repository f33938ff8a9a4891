"""Where the time of a step through a step channel goes, the engine's side and the drafter's (a script, not a test).

bench_step's random head and decode steps (m committed tokens, k drafts, fixed context) in a drafter subprocess;
the engine side is this process. Per batch size, --iters timed steps, each split by timestamps into

  client pack    propose() until the request is in the mailbox (serialize + the states' copy; with --api ipc the
                 copy into a CUDA IPC ring slot on the GPU and its synchronization)
  round trip     the mailbox written -> the reply seen (the drafter's parse, queue, step and reply inside it)
  client parse   the reply bytes -> the ProposeResult / BatchDrafts
and, from the drafter's /metrics over the same steps, its parse, wait (queue + step) and reply. What the round
trip holds beyond those is the hand-off both ways (the drafter noticing the request, the client noticing the reply).
--cprofile also prints the client's python functions by own time over the timed steps.

    python scripts/profile_channel.py --preset llama3-8b --batches 1,128 --device cuda
"""
import argparse
import asyncio
import cProfile
import dataclasses
import pathlib
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks import bench_step as b  # noqa: E402


class Marks:
    """Timestamps of one step, set by the wrapped client functions below."""

    def __init__(self):
        self.t: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.t[name] = time.perf_counter()


def instrument(marks: Marks):
    """Wrap StepChannel._send (mailbox written) and _reply (the poll that found the reply) to time the phases."""
    from drafter_client import step_channel as sc

    send, reply = sc.StepChannel._send, sc.StepChannel._reply

    def timed_send(self, payload):
        marks.mark("send_start")
        try:
            return send(self, payload)
        finally:
            marks.mark("sent")

    def timed_reply(self, seq):
        r = reply(self, seq)
        if r is not None:
            marks.mark("reply_seen")
        return r

    sc.StepChannel._send, sc.StepChannel._reply = timed_send, timed_reply


async def run(target: str, batch: int, a, width: int, vocab: int, metrics_port: int, marks: Marks, api: str):
    from drafter_client import DrafterClient
    from drafter_client.messages import build_request

    prefill, decode = b.make_steps(batch, a.context, a.m, a.k, width, vocab, seed=batch)
    rows = []
    async with DrafterClient(target, namespace="prof", step_timeout_s=None) as c:
        await c.wait_ready(600)
        for i in range(0, batch, 8):
            await c.propose(prefill[i : i + 8])
        request_bytes = max(16 * 2**20, 2 * build_request("prof", decode, None).ByteSize())
        assert await c.open_step_channel(request_bytes=request_bytes)
        as_batch = b.as_step_batch(decode)
        if api == "ipc":  # the states on the engine's GPU, passed by CUDA IPC reference through a ring slot
            dev = torch.device("cuda", torch.cuda.current_device())
            on_gpu = [dataclasses.replace(s, hidden_states=s.hidden_states.to(dev)) for s in decode]
            plane = await c.enable_shared_memory(batch * a.m, dtype=on_gpu[0].hidden_states.dtype, kind="cuda",
                                                 device=dev)
            assert plane == "cuda", plane
            call = lambda: c.propose(on_gpu)  # noqa: E731
        else:
            call = (lambda: c.propose(decode)) if api == "steps" else (lambda: c.propose_batch(as_batch))
        for _ in range(5):
            await call()
        before = b.scrape_server_seconds(metrics_port)
        prof = cProfile.Profile() if a.cprofile else None
        for _ in range(a.iters):
            marks.t.clear()
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            await call()
            if prof:
                prof.disable()
            t1 = time.perf_counter()
            m = marks.t
            rows.append({"total": t1 - t0, "pack": m["sent"] - t0, "round_trip": m["reply_seen"] - m["sent"],
                         "parse": t1 - m["reply_seen"]})
        after = b.scrape_server_seconds(metrics_port)
        if api == "ipc":
            await c.disable_shared_memory()
        c.close_step_channel()
        await c.release([s.sequence_id for s in decode])
    server = {k: (after[k] - before[k]) / a.iters for k in ("worker", "parse", "wait", "reply")}
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"batch {batch:4d} {api:6s}: total {med['total'] * 1e3:.3f} ms = client pack {med['pack'] * 1e3:.3f} + round "
          f"trip {med['round_trip'] * 1e3:.3f} + client parse {med['parse'] * 1e3:.3f} (medians); drafter (means): "
          f"parse {server['parse'] * 1e3:.3f} + wait {server['wait'] * 1e3:.3f} (step {server['worker'] * 1e3:.3f}) + "
          f"reply {server['reply'] * 1e3:.3f}; hand-offs ~{(med['round_trip'] - server['parse'] - server['wait'] - server['reply']) * 1e3:.3f}",
          flush=True)
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.cprofile)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-8b", choices=sorted(b.PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,128")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--m", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--api", default="steps,batch", help="comma-separated: steps (propose), batch (propose_batch), "
                    "ipc (propose with the states on the GPU, by CUDA IPC reference; CUDA only)")
    ap.add_argument("--cprofile", type=int, default=0, help="print this many client functions by own time")
    ap.add_argument("--metrics-port", type=int, default=9479)
    ap.add_argument("--drafter-flag", action="append", default=[])
    a = ap.parse_args()
    shape = b.PRESETS[a.preset]
    dtype = "bfloat16" if a.device.startswith("cuda") else "float32"
    batches = [int(x) for x in a.batches.split(",")]
    marks = Marks()
    instrument(marks)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        head, target = b.write_random_head(tmp, shape, a.context + 64)
        kv_tokens = (max(batches) + 8) * (a.context + 96)
        cmd = [sys.executable, "-m", "drafter_service.cli", "--model", str(head), "--target-model", str(target),
               "--listen", f"unix:{tmp}/d.sock", "--device", a.device, "--dtype", dtype, "--kv-cache-tokens",
               str(kv_tokens), "--max-model-len", str(a.context + 64), "--max-batch-seqs", "4096", "--log-level",
               "WARNING", "--metrics-port", str(a.metrics_port), *a.drafter_flag]
        server = subprocess.Popen(cmd)
        try:
            # the width of the states the engine sends: the hidden size, three of them for an EAGLE-3 head (one when
            # the engine applies its fc: --drafter-flag=--engine-applies-fc)
            three = shape.get("method") == "eagle3" and "--engine-applies-fc" not in a.drafter_flag
            width = shape["hidden_size"] * (3 if three else 1)
            for batch in batches:
                for api in a.api.split(","):
                    asyncio.run(run(f"unix:{tmp}/d.sock", batch, a, width, shape["vocab_size"], a.metrics_port, marks,
                                    api))
        finally:
            server.terminate()
            server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
