"""What the blocking client costs per step through a step channel, against the async client.

    python scripts/sync_channel.py --preset llama3-8b --device cuda --iters 300 --out sync_channel.json

One drafter (own process, Unix socket); batch-1 decode steps (m committed tokens, k drafts, fixed context) through
a step channel, median ms per step over --iters, in rounds that alternate the three ways of calling it:

  async        DrafterClient.propose() on an event loop (the client spins on its loop while it waits)
  sync         SyncDrafterClient.propose(): the step goes through the channel on the calling thread
  sync, loop   the same client with the step handed to its event-loop thread and the caller woken when it is
               done (SyncDrafterClient before the calling-thread path; two thread wake-ups per step)
"""
import argparse
import asyncio
import datetime
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

MODES = ("async", "sync", "sync, loop")


def main() -> int:
    from drafter_client import DrafterClient
    from drafter_client.benchmarks import bench_step as b
    from drafter_client.engine.sidecar_process import SidecarProcess
    from drafter_client.sync import SyncDrafterClient

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(b.PRESETS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--m", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--iters", type=int, default=200, help="steps per mode per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    shape = b.PRESETS[a.preset]
    context = shape["context"]
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        head, target = b.write_random_head(tmp / "model", shape, context + 64)
        flags = ["--dtype", "bfloat16" if a.device.startswith("cuda") else "float32", "--kv-cache-tokens",
                 str(8 * (context + 64)), "--max-batch-seqs", "8", "--log-level", "WARNING"]
        with SidecarProcess(head, target, a.device, flags, ready_timeout_s=900,
                            env={"PYTHONPATH": os.pathsep.join(sys.path)}) as sidecar:
            with SyncDrafterClient(sidecar.address, namespace="sync", step_timeout_s=None) as sync:
                sync.wait_ready(900)
                width = sync.get_info().hidden_states_width
                prefill, decode = b.make_steps(1, context, a.m, a.k, width, shape["vocab_size"], seed=1)
                assert sync.propose(prefill).sequences[0].ok
                assert sync.open_step_channel()
                client = sync._client

                def sync_steps(on_loop: bool) -> None:
                    if on_loop:  # the step goes to the loop thread, as before the calling-thread path
                        client.propose_blocking = lambda *args, **kwargs: None
                    try:
                        for i in range(a.iters + 10):
                            t0 = time.perf_counter()
                            assert sync.propose(decode).sequences[0].ok
                            if i >= 10:
                                times["sync, loop" if on_loop else "sync"].append(time.perf_counter() - t0)
                    finally:
                        client.__dict__.pop("propose_blocking", None)

                async def async_steps() -> None:
                    async with DrafterClient(sidecar.address, namespace="async", step_timeout_s=None) as c:
                        assert (await c.propose(prefill)).sequences[0].ok
                        assert await c.open_step_channel()
                        for i in range(a.iters + 10):
                            t0 = time.perf_counter()
                            assert (await c.propose(decode)).sequences[0].ok
                            if i >= 10:
                                times["async"].append(time.perf_counter() - t0)
                        assert c.steps_through_channel == a.iters + 10
                        await c.release([s.sequence_id for s in decode])

                for r in range(a.rounds):
                    asyncio.run(async_steps())
                    sync_steps(on_loop=False)
                    sync_steps(on_loop=True)
                    print(f"round {r + 1}/{a.rounds} done", flush=True)
                assert client.steps_through_channel == 2 * a.rounds * (a.iters + 10)
    result = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), preset=a.preset, device=a.device,
                  m=a.m, k=a.k, context=context, iters=a.iters, rounds=a.rounds,
                  command=" ".join([pathlib.Path(sys.argv[0]).name, *sys.argv[1:]]),
                  median_ms={mode: statistics.median(t) * 1e3 for mode, t in times.items()},
                  p90_ms={mode: sorted(t)[int(0.9 * (len(t) - 1))] * 1e3 for mode, t in times.items()})
    if a.device.startswith("cuda"):
        import torch
        result["gpu"] = torch.cuda.get_device_name()
    print(f"{'mode':<12} {'median ms':>10} {'p90 ms':>8}")
    for mode in MODES:
        print(f"{mode:<12} {result['median_ms'][mode]:>10.3f} {result['p90_ms'][mode]:>8.3f}")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
