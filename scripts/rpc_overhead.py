"""Where the sidecar's per-step overhead goes: round trips over a Unix socket, each in its own server process.

    python scripts/rpc_overhead.py            # prints a table (median us of 500 calls each)

1. a bare grpc.aio unary echo (asyncio server, then uvloop server): the floor of any Python gRPC round trip;
2. the drafter's GetInfo (handler hops to the step thread and back);
3. the drafter's Propose with a tiny head (hidden 64): k = 0 (one forward, nothing copied back) and k = 1.
"""
import asyncio
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

ECHO_SERVER = r'''
import asyncio, sys, grpc
from drafter_client.protocol import pb, pb_grpc
class Echo(pb_grpc.DrafterServicer):
    async def GetInfo(self, request, context):
        return pb.GetInfoResponse(model_name="echo")
async def main():
    server = grpc.aio.server(); pb_grpc.add_DrafterServicer_to_server(Echo(), server)
    server.add_insecure_port(sys.argv[1]); await server.start(); await server.wait_for_termination()
loop_factory = None
if sys.argv[2] == "uvloop":
    import uvloop; loop_factory = uvloop.new_event_loop
with asyncio.Runner(loop_factory=loop_factory) as r: r.run(main())
'''


async def time_calls(call, n=500) -> float:
    for _ in range(50):
        await call()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def wait_for(path: pathlib.Path) -> None:
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


async def main() -> int:
    import grpc
    import torch

    from checkpoints import write_eagle1
    from drafter_client import DrafterClient, SequenceStep
    from drafter_client.protocol import pb, pb_grpc

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        for loop in ("asyncio", "uvloop"):
            sock = tmp / f"echo-{loop}.sock"
            proc = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, f"unix:{sock}", loop], env=env)
            try:
                wait_for(sock)
                async with grpc.aio.insecure_channel(f"unix:{sock}") as ch:
                    stub = pb_grpc.DrafterStub(ch)
                    rows.append((f"bare grpc.aio echo ({loop} server)",
                                 await time_calls(lambda: stub.GetInfo(pb.GetInfoRequest()))))
            finally:
                proc.terminate()
                proc.wait()
        head, target = write_eagle1(tmp / "tiny")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        sock = tmp / "drafter.sock"
        proc = subprocess.Popen([sys.executable, "-m", "drafter_service.cli", "--model", str(head), "--target-model",
                                 str(target), "--listen", f"unix:{sock}", "--device", device, "--dtype", "float32",
                                 "--log-level", "WARNING"], env=env)
        try:
            async with DrafterClient(f"unix:{sock}", step_timeout_s=None) as c:
                await c.wait_ready(120)
                rows.append(("drafter GetInfo", await time_calls(c.get_info)))
                hid = torch.randn(3, 64)
                for k in (0, 1):
                    step = [SequenceStep("s", 0, [1, 2, 3], hid, 4, k)]
                    rows.append((f"drafter Propose, tiny head, 3 tokens, k={k} ({device})",
                                 await time_calls(lambda: c.propose(step), n=300)))
        finally:
            proc.terminate()
            proc.wait()
    print(f"{'round trip over a Unix socket':<52} {'median us':>10}")
    for name, us in rows:
        print(f"{name:<52} {us:>10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
