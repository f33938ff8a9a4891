"""Large steps inside gRPC over TCP (pool mode across nodes): one engine step's hidden states of 8, 32 and 96 MiB
(a 1024 / 4096 / 12288-token prefill of bf16 states 4096 wide, the Llama-3.1-8B EAGLE-1 shape), sent by the client
library, against a bare gRPC echo of the same bytes, in one run (a script, not a test).

Modes (each server in its own process, on 127.0.0.1 over TCP; the client is this process, with glibc's malloc
left as an engine's would be):

    tcp             no gRPC: the bytes through a plain socket (sendall / recv_into a buffer), a 1-byte answer
                    (what Python moves over loopback TCP here at all)
    echo            a minimal grpc.aio server: one unary message of the bytes in, a 2-byte answer out (the
                    ceiling of one message on this machine)
    echo-chunked    the same bytes as a client stream of --chunk-bytes messages, copied into a buffer on arrival
                    (the ceiling of chunking)
    echo-parallelN  the same chunks over N streams at once, each on a channel (TCP connection) of its own, 1/N of the
                    bytes each (does more than one connection lift gRPC's ceiling where cores are free?)
    old             DrafterClient.propose, the states inline in one ProposeRequest (unary Propose: the path before
                    ProposeChunked), drafter with malloc tuned (ServerConfig.tune_malloc, now the default)
    new             DrafterClient.propose as engines call it: the client picks ProposeChunked (1 MiB chunks)
    new-parallelN   the same with DrafterClient(upload_streams=N): from 8 MiB the upload is spread over N
                    ProposeChunked calls at once, each on a connection of its own (ProposeChunk.part)
    *-untuned       the same against servers with glibc's default malloc thresholds (old-untuned is the state
                    before this work: docs/performance.md, "Large steps over TCP")

The drafter runs in ingest-only mode (DrafterServicer.ingest_only, as in bench_data_plane.py): it decodes and
checks the request, has the states in a tensor of its own (one copy), and answers without running the head, so the
numbers are the data plane alone. Modes alternate in rounds so that a busy machine slows them alike.

    python benchmarks/bench_bulk_grpc.py                 # 8, 32, 96 MiB, all modes
    python benchmarks/bench_bulk_grpc.py --mib 32 --reps 20 --modes echo,old,new

Prints a table, writes JSON (CPU, date, versions, load, per-mode times) to --out (default docs/bench/).
"""
import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import pathlib
import platform
import socket
import statistics
import sys
import tempfile
import time

import torch

from drafter_client.messages import CHUNK_BYTES, CHUNKED_MIN_BYTES

ROOT = pathlib.Path(__file__).resolve().parent.parent
WIDTH = 4096  # Llama-3.1-8B hidden size: EAGLE-1's hidden_states_width
DTYPE = torch.bfloat16
ALL_MODES = ("tcp", "echo", "echo-chunked", "old", "new", "echo-untuned", "old-untuned", "new-untuned", "echo-parallel2",
             "echo-parallel4", "new-parallel2", "new-parallel4")


# ---- servers, each in its own process ----

def serve_tcp(max_bytes: int, out) -> None:
    """A plain socket: an 8-byte length, that many bytes into one buffer, a 1-byte answer; one client."""
    listener = socket.create_server(("127.0.0.1", 0))
    out.put(f"127.0.0.1:{listener.getsockname()[1]}")
    conn, _ = listener.accept()
    buf = memoryview(bytearray(max_bytes))
    while True:
        head = conn.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return
        n, got = int.from_bytes(head, "little"), 0
        while got < n:
            k = conn.recv_into(buf[got:n])
            if not k:
                return
            got += k
        conn.sendall(b"k")


def serve_echo(tuned: bool, max_bytes: int, out, listen: str = "127.0.0.1:0") -> None:
    """Echo: "Echo" takes one message, "Upload" a stream of pieces (8-byte offset + data) into one buffer; both
    answer 2 bytes."""
    import grpc

    if tuned:
        from drafter_service.runtime import keep_large_blocks_in_heap
        keep_large_blocks_in_heap()

    async def main():
        opts = [("grpc.max_receive_message_length", max_bytes), ("grpc.max_send_message_length", max_bytes)]
        server = grpc.aio.server(options=opts)
        buf = bytearray(max_bytes)
        view = memoryview(buf)

        async def echo(request, context):
            return len(request).to_bytes(8, "little")[:2]

        async def upload(chunks, context):
            n = 0
            async for c in chunks:
                o = int.from_bytes(c[:8], "little")
                view[o : o + len(c) - 8] = memoryview(c)[8:]
                n += len(c) - 8
            return n.to_bytes(8, "little")[:2]

        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", {
            "Echo": grpc.unary_unary_rpc_method_handler(echo),
            "Upload": grpc.stream_unary_rpc_method_handler(upload)}),))
        port = server.add_insecure_port(listen)
        await server.start()
        out.put(listen if listen.startswith("unix:") else f"127.0.0.1:{port}")
        await server.wait_for_termination()

    torch.set_num_threads(1)
    asyncio.run(main())


def serve_drafter(model_dir: str, target_dir: str, tuned: bool, max_rows: int, max_bytes: int, out,
                  listen: str = "127.0.0.1:0") -> None:
    from drafter_service.config import ServerConfig
    from drafter_service.server import DrafterServer

    torch.set_num_threads(1)

    async def main():
        cfg = ServerConfig(model=model_dir, target_model=target_dir, listen=[listen], device="cpu",
                           dtype="float32", kv_cache_tokens=4096, max_batch_tokens=max_rows,
                           max_message_bytes=max_bytes, log_level="WARNING", tune_malloc=tuned,
                           step_channels=False, shared_memory=False)
        server = DrafterServer(cfg)
        await server.start()
        server.servicer.ingest_only = True
        server.runtime.limits.hidden_states_width = WIDTH  # the head never runs: accept the benchmark's shape
        out.put(server.bound_addresses[0])
        await asyncio.Event().wait()

    asyncio.run(main())


# ---- the client side: one callable per mode ----

def server_of(mode: str) -> str:
    """The server process a mode talks to: echo, echo-untuned, drafter or drafter-untuned."""
    if mode == "tcp":
        return "tcp"
    return ("echo" if mode.startswith("echo") else "drafter") + ("-untuned" if mode.endswith("-untuned") else "")


async def make_modes(addresses: dict[str, str], modes: list[str], max_bytes: int, chunk_bytes: int,
                     chunk_min_bytes: int):
    import grpc

    from drafter_client import DrafterClient

    opts = [("grpc.max_receive_message_length", max_bytes), ("grpc.max_send_message_length", max_bytes)]
    closers, calls = [], {}
    for mode in modes:
        kind = mode.removesuffix("-untuned")
        server = addresses[server_of(mode)]
        if kind == "tcp":
            host, port = server.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)))
            closers.append(_closer(sock))

            async def call(payload, sock=sock):
                data = payload["bytes"]
                sock.sendall(len(data).to_bytes(8, "little"))
                sock.sendall(data)
                assert sock.recv(1) == b"k"
        elif kind.startswith("echo-parallel"):  # the chunks over N streams, each on its own channel (connection)
            n_streams = int(kind.removeprefix("echo-parallel"))
            rpcs = []
            for _ in range(n_streams):
                ch = grpc.aio.insecure_channel(server, options=opts + [("grpc.use_local_subchannel_pool", 1)])
                closers.append(ch.close)
                rpcs.append(ch.stream_unary("/bench.Echo/Upload"))

            def part_pieces(data: bytes, lo: int, hi: int):
                view = memoryview(data)
                for o in range(lo, hi, chunk_bytes):
                    yield o.to_bytes(8, "little") + view[o : min(o + chunk_bytes, hi)]

            async def call(payload, rpcs=rpcs):
                data = payload["bytes"]
                step = -(-len(data) // len(rpcs) // chunk_bytes) * chunk_bytes  # whole chunks per stream
                await asyncio.gather(*(rpc(part_pieces(data, i * step, min((i + 1) * step, len(data))))
                                       for i, rpc in enumerate(rpcs)))
        elif kind in ("echo", "echo-chunked"):
            ch = grpc.aio.insecure_channel(server, options=opts)
            closers.append(ch.close)
            if kind == "echo":
                rpc = ch.unary_unary("/bench.Echo/Echo")

                async def call(payload, rpc=rpc):
                    await rpc(payload["bytes"])
            else:
                rpc = ch.stream_unary("/bench.Echo/Upload")

                def pieces(data: bytes):
                    view = memoryview(data)
                    for o in range(0, len(data), chunk_bytes):
                        yield o.to_bytes(8, "little") + view[o : o + chunk_bytes]  # one copy, as ProposeChunked

                async def call(payload, rpc=rpc):
                    await rpc(pieces(payload["bytes"]))
        else:
            streams = int(kind.removeprefix("new-parallel")) if kind.startswith("new-parallel") else 1
            client = DrafterClient(server, namespace=f"bench-{mode}", max_message_bytes=max_bytes,
                                   step_timeout_s=None, raise_on_error=True,
                                   chunk_min_bytes=None if kind == "old" else chunk_min_bytes,
                                   chunk_bytes=chunk_bytes, upload_streams=streams)
            await client.wait_ready(120)
            closers.append(client.close)

            async def call(payload, client=client, kind=kind, streams=streams):
                before, spread_before = client.steps_chunked, client.steps_spread
                r = await client.propose(payload["steps"], payload["hidden"])
                assert r.sequences[0].ok, r.sequences[0].message
                chunked = kind.startswith("new") and payload["nbytes"] >= chunk_min_bytes
                spread = streams > 1 and payload["nbytes"] >= client.upload_streams_min_bytes
                assert client.steps_chunked - before == chunked, "the step took the wrong path"
                assert client.steps_spread - spread_before == spread, "the upload was not spread as asked"
        calls[mode] = call
    return calls, closers


def _closer(sock: socket.socket):
    async def close():
        sock.close()
    return close


def payload_for(mib: int):
    from drafter_client import SequenceStep

    rows = int(mib * 2**20) // (WIDTH * DTYPE.itemsize)
    hidden = torch.randn(rows, WIDTH).to(DTYPE)
    steps = [SequenceStep("s0", 0, torch.randint(0, 500, (rows,)), None, 1, 0)]
    return dict(rows=rows, hidden=hidden, steps=steps, bytes=hidden.view(torch.int16).numpy().tobytes(),
                nbytes=hidden.numel() * hidden.element_size())


async def run(addresses: dict[str, str], modes: list[str], sizes: list[int], reps: int, rounds: int,
              max_bytes: int, chunk_bytes: int, chunk_min_bytes: int) -> list[dict]:
    calls, closers = await make_modes(addresses, modes, max_bytes, chunk_bytes, chunk_min_bytes)
    results = []
    try:
        for mib in sizes:
            payload = payload_for(mib)
            times = {m: [] for m in modes}
            for m in modes:  # warm-up
                for _ in range(2):
                    await calls[m](payload)
            per_round = max(1, reps // rounds)
            for _ in range(rounds):
                for m in modes:
                    for _ in range(per_round):
                        t0 = time.perf_counter()
                        await calls[m](payload)
                        times[m].append(time.perf_counter() - t0)
            for m in modes:
                ts = sorted(times[m])
                med = statistics.median(ts)
                q = lambda f: ts[min(len(ts) - 1, int(f * len(ts)))]  # noqa: E731
                results.append(dict(mode=m, mib=mib, bytes=payload["nbytes"], rows=payload["rows"], iters=len(ts),
                                    p50_ms=med * 1e3, p10_ms=q(0.1) * 1e3, p90_ms=q(0.9) * 1e3,
                                    min_ms=ts[0] * 1e3, max_ms=ts[-1] * 1e3, gb_per_s=payload["nbytes"] / med / 1e9,
                                    gb_per_s_p10_p90=[payload["nbytes"] / q(0.9) / 1e9,
                                                      payload["nbytes"] / q(0.1) / 1e9]))
                r = results[-1]
                print(f"  {m:14s} {mib:4d} MiB  p50 {r['p50_ms']:8.1f} ms  [p10 {r['p10_ms']:.1f}, p90 "
                      f"{r['p90_ms']:.1f}]  {r['gb_per_s']:5.2f} GB/s", flush=True)
    finally:
        for close in closers:
            await close()
    return results


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", default="8,32,96", help="payload sizes in MiB, comma list")
    ap.add_argument("--modes", default=",".join(ALL_MODES), help=f"comma list of {', '.join(ALL_MODES)}")
    ap.add_argument("--reps", type=int, default=15, help="timed calls per size and mode")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of the modes")
    ap.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES,
                    help="chunk size of the new and echo-chunked modes (the client's default: CHUNK_BYTES)")
    ap.add_argument("--chunk-min-bytes", type=int, default=CHUNKED_MIN_BYTES,
                    help="the new mode chunks steps from this size (the client's default: CHUNKED_MIN_BYTES)")
    ap.add_argument("--uds", action="store_true",
                    help="gRPC over Unix sockets (an engine and a drafter on one node) instead of TCP; no tcp mode")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "bench")
    a = ap.parse_args()
    torch.set_num_threads(1)
    modes = a.modes.split(",")
    bad = set(modes) - set(ALL_MODES)
    if bad:
        ap.error(f"unknown modes {sorted(bad)}")
    if a.uds and "tcp" in modes:
        ap.error("--uds: leave out the tcp mode")
    sizes = [int(x) for x in a.mib.split(",")]
    max_bytes = (max(sizes) + 16) * 2**20
    max_rows = max(sizes) * 2**20 // (WIDTH * DTYPE.itemsize)

    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoints import write_eagle1

    stamp = datetime.datetime.now(datetime.timezone.utc)
    import grpc
    import google.protobuf

    meta = dict(device=cpu_name(), cores=os.cpu_count(), host=socket.gethostname(),
                date=stamp.isoformat(timespec="seconds"), python=platform.python_version(), torch=torch.__version__,
                grpc=grpc.__version__, protobuf=google.protobuf.__version__, glibc=" ".join(platform.libc_ver()),
                transport="Unix sockets, one channel per mode" if a.uds else "TCP on 127.0.0.1, one channel per mode", width=WIDTH, dtype="bfloat16",
                chunk_bytes=a.chunk_bytes, chunk_min_bytes=a.chunk_min_bytes, load_average_at_start=os.getloadavg(),
                method="servers in their own processes (drafter: ingest-only, decode + check + one copy of the "
                       "states into its own tensor, no head); time = one call from the engine's tensor (echo: "
                       "prepared bytes) to the reply; modes in alternating rounds; GB/s = payload / p50")
    print(f"bulk gRPC on {meta['device']} ({meta['cores']} cores, load {os.getloadavg()[0]:.1f}); "
          f"sizes {sizes} MiB; modes {', '.join(modes)}")
    ctx = multiprocessing.get_context("spawn")
    procs, addresses = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-bulk-") as tmp:
        head_dir, target_dir = write_eagle1(pathlib.Path(tmp), seed=0)
        wanted = {server_of(m) for m in modes}
        try:
            for name in sorted(wanted):
                q = ctx.Queue()
                tuned = not name.endswith("-untuned")
                listen = f"unix:{tmp}/{name}.sock" if a.uds else "127.0.0.1:0"
                if name == "tcp":
                    p = ctx.Process(target=serve_tcp, args=(max_bytes, q), daemon=True)
                elif name.startswith("echo"):
                    p = ctx.Process(target=serve_echo, args=(tuned, max_bytes, q, listen), daemon=True)
                else:
                    p = ctx.Process(target=serve_drafter, args=(str(head_dir), str(target_dir), tuned, max_rows,
                                                                max_bytes, q, listen), daemon=True)
                p.start()
                procs.append(p)
                addresses[name] = q.get(timeout=300)
            results = asyncio.run(run(addresses, modes, sizes, a.reps, a.rounds, max_bytes, a.chunk_bytes,
                                      a.chunk_min_bytes))
        finally:
            for p in procs:
                p.terminate()
                p.join(30)

    print()
    print(f"{'mode':14s} {'MiB':>5s} {'p50 ms':>9s} {'p10-p90 ms':>15s} {'GB/s':>6s} {'GB/s p90..p10':>14s} "
          f"{'vs echo':>8s}")
    for mib in sizes:
        echo = next((r for r in results if r["mib"] == mib and r["mode"] == "echo"), None)
        for r in (r for r in results if r["mib"] == mib):
            rel = f"{r['gb_per_s'] / echo['gb_per_s']:8.2f}" if echo else ""
            lo, hi = r["gb_per_s_p10_p90"]
            print(f"{r['mode']:14s} {mib:5d} {r['p50_ms']:9.1f} {r['p10_ms']:7.1f}-{r['p90_ms']:<7.1f} "
                  f"{r['gb_per_s']:6.2f} {lo:6.2f}..{hi:<6.2f} {rel}")
    meta["load_average_at_end"] = os.getloadavg()
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"bulk_grpc_cpu_{stamp.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(dict(meta, results=results), indent=1))
    print(f"\njson: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
