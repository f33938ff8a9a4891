"""gRPC's HTTP/2 and endpoint options against a step-sized payload (a script, not a test).

A unary batch-128 EAGLE-3 step moves 3 MiB of states through gRPC's Python binding at about 1.5 GB/s
(docs/performance.md, sixteenth session). This asks whether a channel/server option changes that: a bare grpc.aio
server per option set (in a process of its own, with the drafter's malloc setting), the same options on the client's
channel, over a Unix socket (--tcp: loopback TCP), and two calls per repetition, each timed from the call to its
answer:

  echo     one message of --mib MiB, a 2-byte answer (a unary Propose)
  upload   the same bytes as 1 MiB messages on a client stream (ProposeChunked)

The sets alternate, round after round; the table gives each round's median per set.

    python benchmarks/bench_grpc_options.py --mib 3 --rounds 3 --reps 40
"""
import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
MiB = 1 << 20
CHUNK = MiB
OPTION_SETS = {
    "base": [],
    "lookahead16M": [("grpc.http2.lookahead_bytes", 16 * MiB)],
    "read-chunks": [("grpc.experimental.tcp_read_chunk_size", MiB),
                    ("grpc.experimental.tcp_min_read_chunk_size", 256 << 10),
                    ("grpc.experimental.tcp_max_read_chunk_size", 8 * MiB)],
    "frame4M": [("grpc.http2.max_frame_size", 4 * MiB)],
    "no-bdp": [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16 * MiB)],
    "all": [("grpc.http2.lookahead_bytes", 16 * MiB), ("grpc.experimental.tcp_read_chunk_size", MiB),
            ("grpc.experimental.tcp_min_read_chunk_size", 256 << 10),
            ("grpc.experimental.tcp_max_read_chunk_size", 8 * MiB), ("grpc.http2.max_frame_size", 4 * MiB)],
}
MAX_BYTES = [("grpc.max_receive_message_length", 256 * MiB), ("grpc.max_send_message_length", 256 * MiB)]


def serve(listen: str, options: list, ready, port) -> None:
    """An echo server with these options; its port (TCP) into ``port``, then ``ready`` set."""
    import grpc

    sys.path.insert(0, str(ROOT))
    from drafter_service.runtime import keep_large_blocks_in_heap

    keep_large_blocks_in_heap()  # (as the drafter does)

    async def main():
        server = grpc.aio.server(options=MAX_BYTES + options)
        buf = memoryview(bytearray(256 * MiB))

        async def echo(request, context):
            return b"ok"

        async def upload(chunks, context):
            at = 0
            async for c in chunks:
                buf[at : at + len(c)] = c
                at += len(c)
            return b"ok"

        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Options", {
            "Echo": grpc.unary_unary_rpc_method_handler(echo),
            "Upload": grpc.stream_unary_rpc_method_handler(upload)}),))
        port.value = server.add_insecure_port(listen)
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


async def measure(target: str, options: list, payload: bytes, reps: int) -> tuple[float, float]:
    """(echo, upload) median seconds over reps calls each, after 5 warm-up calls."""
    import grpc

    async with grpc.aio.insecure_channel(target, options=MAX_BYTES + options) as ch:
        echo, upload = ch.unary_unary("/bench.Options/Echo"), ch.stream_unary("/bench.Options/Upload")
        view = memoryview(payload)

        async def pieces():
            for i in range(0, len(payload), CHUNK):
                yield bytes(view[i : i + CHUNK])  # (as the client copies each chunk out of the engine's tensor)

        for _ in range(5):
            await echo(payload)
            await upload(pieces())
        echoes, uploads = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            await echo(payload)
            t1 = time.perf_counter()
            await upload(pieces())
            echoes.append(t1 - t0)
            uploads.append(time.perf_counter() - t1)
    return statistics.median(echoes), statistics.median(uploads)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=float, default=3.0, help="payload MiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=40, help="timed calls of each kind per set and round")
    ap.add_argument("--sets", default=",".join(OPTION_SETS), help=f"comma list of {', '.join(OPTION_SETS)}")
    ap.add_argument("--tcp", action="store_true", help="loopback TCP instead of a Unix socket")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="JSON file")
    a = ap.parse_args()
    sets = a.sets.split(",")
    unknown = [s for s in sets if s not in OPTION_SETS]
    if unknown:
        ap.error(f"unknown option sets: {unknown}")
    payload = os.urandom(int(a.mib * MiB))
    ctx = mp.get_context("spawn")
    servers, targets = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for name in sets:
                listen = "127.0.0.1:0" if a.tcp else f"unix:{tmp}/{name}.sock"
                ready, port = ctx.Event(), ctx.Value("i", 0)
                p = ctx.Process(target=serve, args=(listen, OPTION_SETS[name], ready, port), daemon=True)
                p.start()
                servers.append(p)
                if not ready.wait(120):
                    raise RuntimeError(f"the server of {name} did not start")
                targets[name] = f"127.0.0.1:{port.value}" if a.tcp else listen
            rounds = {name: [] for name in sets}
            for r in range(a.rounds):
                for name in sets:
                    rounds[name].append(asyncio.run(measure(targets[name], OPTION_SETS[name], payload, a.reps)))
                print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
        finally:
            for p in servers:
                p.kill()
    print(f"{a.mib:g} MiB over {'loopback TCP' if a.tcp else 'a Unix socket'}, {a.rounds} rounds x {a.reps} calls: "
          "median ms per call, each round")
    print(f"{'options':<14} {'echo':<36} upload (1 MiB messages)")
    for name, v in rounds.items():
        print(f"{name:<14} " + " ".join(f"{e * 1e3:6.2f}" for e, _ in v).ljust(36) + " "
              + " ".join(f"{u * 1e3:6.2f}" for _, u in v))
    if a.out:
        try:
            import torch
            gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        except ImportError:
            gpu = None
        import grpc
        a.out.write_text(json.dumps(dict(
            date=datetime.datetime.now().isoformat(timespec="seconds"), host=platform.node(), gpu=gpu,
            cpus=os.cpu_count(), grpc=grpc.__version__, mib=a.mib, transport="tcp" if a.tcp else "uds",
            rounds=a.rounds, reps=a.reps, command=" ".join(sys.argv),
            options={name: [list(o) for o in OPTION_SETS[name]] for name in sets},
            echo_ms={name: [e * 1e3 for e, _ in v] for name, v in rounds.items()},
            upload_ms={name: [u * 1e3 for _, u in v] for name, v in rounds.items()}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
