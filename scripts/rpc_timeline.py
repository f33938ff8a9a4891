"""Where one Propose's time goes, phase by phase: client -> handler -> step worker -> handler -> client.

    python scripts/rpc_timeline.py --preset tiny --device cpu
    python scripts/rpc_timeline.py --preset llama3-8b --device cuda --out docs/bench/rpc_timeline_h200.json

Starts a drafter (own process, Unix socket) with DRAFTER_TRACE_RPC set, so that it logs the time.perf_counter() of
each phase of every Propose; on Linux that clock is CLOCK_MONOTONIC, the same in both processes, so the client's
send/receive times line up with the server's. Runs batch-1 decode steps (m committed tokens, k drafts, fixed
context) as unary calls, on one ProposeStream and through a step channel (docs/step_channel.md), and prints the
median and 90th percentile of each phase. With --batch N (N > 1) it times N-sequence steps of the batch API instead
(propose_batch: columns in and out), by unary gRPC ("batch-unary-sN": ProposeChunked where the states reach the
client's 2 MiB threshold, as at batch 128 of an 8B shape, spread over N connections; --upload-streams 1,2 --rounds R
alternates clients of both), on a ProposeStream session ("batch-stream", taking its turn in each round; one message
per step) and through a step channel ("batch-channel"; with --engine-gap-ms 0,5,20 also "batch-channel-gap5ms" and
"batch-channel-gap20ms": before each of their steps the client spins that long, as an engine runs its target's forward
between two steps, so that the drafter's side of a step runs as long after its last one as it does in serving):

  to handler      client's call -> handler entered (client packing, gRPC both sides, the server's event loop;
                  for the channel: packing, the mailbox write, the step thread's poll, reading the request)
  noticed         (channel only) client's call -> the step thread sees the doorbell
  parse           decoding and checking the request (ProposeChunked: the header, before any of the states)
  upload          (ProposeChunked only) the header checked -> the last chunk copied into the staging tensor
  to worker       handler -> step worker thread starts the batch (scheduler queue, thread hand-off)
  worker          Proposer.step; for a step from columns (Proposer.step_batch) also split into its admission, the
                  record / copy / graph launches, the host work while the GPU drafts and the wait for it, and the
                  work after the drafts
  to handler      worker done -> handler resumes (thread hand-off back to the event loop)
  reply           encoding the response
  to client       handler returns -> client has the parsed result (gRPC both sides, client parsing)
With --batch, the unary calls are split further on the client's side: "client packing" (the call -> the request's
first message handed to gRPC), "reply to the client" (the handler returns -> the client's gRPC call returns) and
"client parsing" (-> the answer); for ProposeChunked, "to chunked handler" (-> the server's handler begins, before it
reads a chunk) and "first chunk in" (-> the header read, the staging tensor made).
"""
import argparse
import asyncio
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

PHASES = [("client packing", "send", "packed"), ("to chunked handler", "packed", "handler"),
          ("first chunk in", "handler", "enter"), ("to handler", "send", "enter"), ("noticed", "send", "seen"),
          ("parse", "enter", "checked"), ("upload", "checked", "parsed"), ("to worker", "ready", "worker_start"),
          ("worker", "worker_start", "worker_end"), ("  admission", "worker_start", "admitted"),
          ("  to the launches' end", "admitted", "launched"), ("  meanwhile + GPU wait", "launched", "synced"),
          ("  after the drafts", "synced", "worker_end"), ("to handler (back)", "worker_end", "resumed"),
          ("reply", "resumed", "replied"), ("reply to the client", "replied", "answered"),
          ("client parsing", "answered", "recv"), ("to client", "replied", "recv"), ("total", "send", "recv")]
MODES = ("unary", "stream", "channel")


async def run_client(address: str, shape: dict, a) -> dict[str, dict[int, tuple[float, float]]]:
    """request_id -> (send, recv) for each mode."""
    import grpc

    from drafter_client import DrafterClient
    from drafter_client.benchmarks import bench_step as b
    from drafter_client.client import build_request, parse_response
    from drafter_client.protocol import pb_grpc

    if a.batch > 1:
        return await run_batch_client(address, shape, a)
    times: dict[str, dict[int, tuple[float, float]]] = {mode: {} for mode in MODES}
    async with DrafterClient(address, namespace="bench", step_timeout_s=None) as c:
        await c.wait_ready(900)
        info = await c.get_info()
        prefill, decode = b.make_steps(1, a.context, a.m, a.k, info.hidden_states_width, shape["vocab_size"], seed=1)
        assert (await c.propose(prefill)).sequences[0].ok
        if await c.open_step_channel():
            for _ in range(a.iters):
                t0 = time.perf_counter()
                r = await c.propose(decode)  # packing and parsing count: they are the client's work
                times["channel"][r.request_id] = (t0, time.perf_counter())
                assert r.sequences[0].ok and r.sequences[0].drafts.numel() == a.k
            assert c.steps_through_channel == a.iters
            c.close_step_channel()
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.DrafterStub(ch)
        rid = 10**6  # (apart from the request ids the DrafterClient above gave its steps)
        for _ in range(a.iters):
            rid += 1
            t0 = time.perf_counter()
            req = build_request("bench", decode, request_id=rid)  # packing counts: it is the client's work
            r = parse_response(await stub.Propose(req))
            times["unary"][rid] = (t0, time.perf_counter())
            assert r.sequences[0].ok and r.sequences[0].drafts.numel() == a.k
        call = stub.ProposeStream()
        for _ in range(a.iters):
            rid += 1
            t0 = time.perf_counter()
            await call.write(build_request("bench", decode, request_id=rid))
            r = parse_response(await call.read())
            times["stream"][rid] = (t0, time.perf_counter())
            assert r.sequences[0].ok
        await call.done_writing()
    # the client's own packing and parsing, alone (part of "to handler" and "to client" above)
    from drafter_client.protocol import pb
    reply_bytes = build_reply(a.k)
    pack, unpack = [], []
    for _ in range(a.iters):
        t0 = time.perf_counter()
        build_request("bench", decode, request_id=1).SerializeToString()
        t1 = time.perf_counter()
        parse_response(pb.ProposeResponse.FromString(reply_bytes))
        t2 = time.perf_counter()
        pack.append(t1 - t0)
        unpack.append(t2 - t1)
    times["client packing us"] = statistics.median(pack) * 1e6
    times["client parsing us"] = statistics.median(unpack) * 1e6
    return times


async def run_batch_client(address: str, shape: dict, a) -> dict[str, dict[int, tuple[float, float]]]:
    """--batch N: the batch API by unary gRPC, one client per --upload-streams value ("batch-unary-sN"), the clients
    taking turns over --rounds rounds (a host's speed drifts within minutes), then through a step channel; request_id
    -> (send, recv, the client's marks) per mode, and the client's own packing alone."""
    import contextlib

    from drafter_client import DrafterClient
    from drafter_client.batch import serialize_batch
    from drafter_client.benchmarks import bench_step as b
    from drafter_client.messages import ChunkedRequest

    streams = [int(x) for x in str(a.upload_streams).split(",")]
    unary_modes = [f"batch-unary-s{n}" for n in streams]
    channel_modes = {gap: "batch-channel" if gap == 0 else f"batch-channel-gap{gap:g}ms" for gap in a.engine_gap_ms}
    times: dict = {mode: {} for mode in (*unary_modes, "batch-stream", *channel_modes.values())}
    marks: dict[str, float] = {}  # the current call's client-side marks: packed (first message made), answered
    messages, call = ChunkedRequest.messages, DrafterClient._call

    def marked_messages(self, *args, **kwargs):
        for i, message in enumerate(messages(self, *args, **kwargs)):
            if i == 0:
                marks.setdefault("packed", time.perf_counter())
            yield message

    async def marked_call(self, rpc, request, timeout):
        if isinstance(request, bytes):
            marks.setdefault("packed", time.perf_counter())
        try:
            return await call(self, rpc, request, timeout)
        finally:
            marks["answered"] = time.perf_counter()
    ChunkedRequest.messages, DrafterClient._call = marked_messages, marked_call
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(DrafterClient(
            address, namespace="bench", step_timeout_s=None, upload_streams=n, upload_streams_min_bytes=2 << 20))
            for n in streams]
        for i, c in enumerate(clients):
            c._next_request_id = 1 + i * 10**6  # (the server's trace is keyed by request id)
        c = clients[0]
        await c.wait_ready(900)
        info = await c.get_info()
        prefill, decode = b.make_steps(a.batch, a.context, a.m, a.k, info.hidden_states_width, shape["vocab_size"],
                                       seed=1)
        for i in range(0, a.batch, 8):  # (the drafter's --max-batch-seqs is 8 for the prefill)
            assert all(s.ok for s in (await c.propose(prefill[i : i + 8])).sequences)
        batch = b.as_step_batch(decode)
        per_round = max(1, a.iters // a.rounds)
        streamer = await stack.enter_async_context(DrafterClient(address, namespace="bench", step_timeout_s=None))
        streamer._next_request_id = 1 + 10 * 10**6
        session = await stack.enter_async_context(streamer.stream())
        for _ in range(a.rounds):
            for mode, client in zip(unary_modes, clients):
                for _ in range(per_round):
                    marks.clear()
                    rid, t0 = client._next_request_id, time.perf_counter()  # (BatchDrafts carry no request id)
                    r = await client.propose_batch(batch)
                    times[mode][rid] = (t0, time.perf_counter(), dict(marks))
                    assert bool((r.codes == 0).all()) and int(r.num_drafts.sum()) == a.batch * a.k
            for _ in range(per_round):  # the batch API on a ProposeStream session (one message per step)
                rid, t0 = streamer._next_request_id, time.perf_counter()
                r = await session.propose_batch(batch)
                times["batch-stream"][rid] = (t0, time.perf_counter())
                assert not r.fallback and bool((r.codes == 0).all()), r.messages
        times["chunked steps"] = {mode: cl.steps_chunked for mode, cl in zip(unary_modes, clients)}
        times["spread steps"] = {mode: cl.steps_spread for mode, cl in zip(unary_modes, clients)}
        ChunkedRequest.messages, DrafterClient._call = messages, call
        request_bytes = batch.hidden_states.numel() * 2 + a.batch * a.m * 8 + 2**20
        if await c.open_step_channel(request_bytes=request_bytes):
            for _ in range(a.rounds):  # (the engine gaps take turns, as the unary clients do)
                for gap, mode in channel_modes.items():
                    for _ in range(per_round):
                        b.engine_work(gap)  # (the engine's own work: its target's forward)
                        rid, t0 = c._next_request_id, time.perf_counter()
                        r = await c.propose_batch(batch)
                        times[mode][rid] = (t0, time.perf_counter())
                        assert bool((r.codes == 0).all())
            c.close_step_channel()
        pack = []
        for _ in range(a.iters):
            t0 = time.perf_counter()
            payload = serialize_batch("bench", batch, None, 1, c.chunk_min_bytes, columns=True)
            for message in (payload.messages(c.chunk_bytes) if hasattr(payload, "messages") else [payload]):
                pass  # (ProposeChunked: the chunks are built lazily, as gRPC asks for them)
            pack.append(time.perf_counter() - t0)
        times["client packing us"] = statistics.median(pack) * 1e6
    return times


def build_reply(k: int) -> bytes:
    """A serialized one-sequence ProposeResponse with k drafts (what the drafter answers a batch-1 step)."""
    from drafter_service.transport.servicer import build_response
    from drafter_service.engine.step_io import StepOutput

    return build_response([StepOutput(drafts=list(range(k)), committed_length=1)], ["b0"], 1).SerializeToString()


def main() -> int:
    from drafter_client.benchmarks import bench_step as b
    from drafter_client.engine.sidecar_process import SidecarProcess

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(b.PRESETS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--m", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--batch", type=int, default=1, help="sequences per step: above 1, the batch API's modes")
    ap.add_argument("--upload-streams", default="1", help="--batch: DrafterClient(upload_streams=N) for ProposeChunked "
                    "uploads of 2 MiB or more; a comma list (1,2): one client per value, taking turns")
    ap.add_argument("--rounds", type=int, default=1, help="--batch: the unary clients' turns (iters steps in all)")
    ap.add_argument("--engine-gap-ms", default="0",
                    help="--batch: the engine's own work before each step-channel step, ms (a spin on the client's "
                         "thread, as a target's forward between two steps); a comma list (0,5,20): one "
                         "batch-channel mode per gap, the gaps taking turns over --rounds")
    ap.add_argument("--out", default=None, help="JSON file for the medians")
    ap.add_argument("server_args", nargs="*", help="extra drafter-serve flags (after --)")
    a = ap.parse_args()
    a.engine_gap_ms = [float(x) for x in a.engine_gap_ms.split(",")]
    if any(gap < 0 for gap in a.engine_gap_ms) or len(set(a.engine_gap_ms)) != len(a.engine_gap_ms):
        ap.error("--engine-gap-ms: distinct values >= 0")
    if a.engine_gap_ms != [0.0] and a.batch <= 1:
        ap.error("--engine-gap-ms is for the batch API's channel mode (--batch N, N > 1)")
    shape = b.PRESETS[a.preset]
    a.context = a.context or shape["context"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        head, target = b.write_random_head(tmp / "model", shape, a.context + 64)
        trace = tmp / "trace.jsonl"
        flags = ["--dtype", "bfloat16" if a.device.startswith("cuda") else "float32", "--kv-cache-tokens",
                 str(max(4, a.batch + 2) * (a.context + 64)), "--max-batch-seqs", str(max(8, a.batch)),
                 "--log-level", "WARNING", *a.server_args]
        with SidecarProcess(head, target, a.device, flags, ready_timeout_s=900,
                            env={"DRAFTER_TRACE_RPC": str(trace), "PYTHONPATH": os.pathsep.join(sys.path)}) as sidecar:
            client_times = asyncio.run(run_client(sidecar.address, shape, a))
        server = {}
        for line in trace.read_text().splitlines():
            rec = json.loads(line)
            server[rec["request_id"]] = rec
    result = dict(device=a.device, preset=a.preset, context=a.context, m=a.m, k=a.k, iters=a.iters,
                  date=datetime.datetime.now().isoformat(timespec="seconds"), host=platform.node(),
                  command=" ".join([pathlib.Path(sys.argv[0]).name, *sys.argv[1:]]), modes={})
    if a.device.startswith("cuda"):
        import torch
        result["gpu"] = torch.cuda.get_device_name()
    result["client packing us"] = client_times.pop("client packing us")
    result["client parsing us"] = client_times.pop("client parsing us", float("nan"))
    result["batch"], result["upload_streams"], result["rounds"] = a.batch, a.upload_streams, a.rounds
    result["engine_gap_ms"] = a.engine_gap_ms
    for key in ("chunked steps", "spread steps"):
        if key in client_times:
            result[key] = client_times.pop(key)
    modes = [m for m in client_times if client_times[m]]
    for mode in modes:
        rows = []
        for rid, (send, recv, *client_marks) in list(client_times[mode].items())[10:]:  # the first calls warm up
            rec = dict(server[rid], **(client_marks[0] if client_marks else {}))
            # (a step without a chunked upload, or a channel's: checked when parsed; ready: parsed, or for a channel's
            # frame read ahead of its doorbell, seen, as the drafter's wait metric counts it: step_channels._answer)
            row = dict(rec, send=send, recv=recv, checked=rec.get("checked", rec.get("parsed")))
            if "parsed" in rec:
                row["ready"] = max(rec["parsed"], rec.get("seen", rec["parsed"]))
            rows.append(row)
        phases = [(name, sorted((r[end] - r[start]) * 1e6 for r in rows))
                  for name, start, end in PHASES if start in rows[0] and end in rows[0]]
        result["modes"][mode] = {name: statistics.median(v) for name, v in phases}
        result["p90"] = result.get("p90", {})
        result["p90"][mode] = {name: v[int(0.9 * (len(v) - 1))] for name, v in phases}
    print(f"{'phase (us)':<20}" + "".join(f" {m + ' p50':>12} {m + ' p90':>12}" for m in modes))
    for name in [p[0] for p in PHASES]:
        print(f"{name:<20}" + "".join(f" {result['modes'][m].get(name, float('nan')):>12.0f} "
                                      f"{result['p90'][m].get(name, float('nan')):>12.0f}" for m in modes))
    print(f"client alone: packing + serializing the request {result['client packing us']:.0f} us, parsing the reply "
          f"{result['client parsing us']:.0f} us")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
