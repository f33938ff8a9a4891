"""Data-plane benchmark: per-step time and achieved GB/s of getting one engine step's hidden states to the
drafter, inline bytes vs host shared memory vs CUDA IPC (a script, not a test).

What is timed: one ProposeStream round trip per step, from the engine holding the step's hidden states (a host
tensor on a CPU run, a tensor on --engine-device on a GPU run) to the drafter's reply. Modes "system+channel" and
"cuda+channel" send the same descriptors through a shared-memory step channel (docs/step_channel.md) instead of
the stream: the control plane without gRPC, so what is left is the data plane itself. The drafter runs in its
own process (a Unix socket, as a sidecar) in ingest-only mode (DrafterServicer.ingest_only): it decodes and
checks the request and copies the hidden states once into a tensor of its own on its device (references: out of
the shared memory; inline: out of the message), then answers with no drafts. The draft head never runs, so the
numbers are the data plane alone: client-side copies, the gRPC round trip, the server-side copy. The head is the
tests' tiny EAGLE-1 checkpoint, loaded only to start the server; its accepted width is overridden per shape.

Shapes: Llama-3.1-8B (hidden 4096), EAGLE-1 (4096 columns) and EAGLE-3 (3 x 4096), bf16, 4 committed tokens per
sequence at batch 1, 8, 32, 64, 128, and a 4096-token prefill chunk (EAGLE-3: 96 MiB).

    python benchmarks/bench_data_plane.py                       # CPU: inline vs host shared memory
    python benchmarks/bench_data_plane.py --device cuda         # + CUDA IPC; engine tensors on cuda:0
    python benchmarks/bench_data_plane.py --device cuda --engine-device cuda:1   # engine on a peer GPU

Prints a table, writes JSON (device, date, versions, results) and a PNG plot (when matplotlib is installed) to
--out (default docs/bench/, beside the other benchmarks' JSON).
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

ROOT = pathlib.Path(__file__).resolve().parent.parent
HIDDEN = 4096  # Llama-3.1-8B
WIDTHS = {"eagle1": HIDDEN, "eagle3": 3 * HIDDEN}
BATCHES = (1, 8, 32, 64, 128)
TOKENS_PER_SEQ = 4
PREFILL_TOKENS = 4096
DTYPE = torch.bfloat16


# ---- the drafter, in its own process ----

def serve_ingest_only(model_dir: str, target_dir: str, sock: str, width: int, device: str, threads: int,
                      metrics_port: int, ready) -> None:
    from drafter_service.config import ServerConfig
    from drafter_service.server import DrafterServer

    torch.set_num_threads(threads)

    async def main():
        cfg = ServerConfig(model=model_dir, target_model=target_dir, listen=[f"unix:{sock}"], device=device,
                           dtype="float32", kv_cache_tokens=4096, max_batch_tokens=PREFILL_TOKENS,
                           max_message_bytes=512 * 2**20, log_level="WARNING", metrics_port=metrics_port)
        server = DrafterServer(cfg)
        await server.start()
        server.servicer.ingest_only = True
        server.runtime.limits.hidden_states_width = width  # the head never runs: accept the benchmark's shapes
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


# ---- measurements ----

def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def server_shm_totals(metrics_port: int) -> tuple[float, float]:
    """(references read, seconds spent checking + copying them) from the drafter's /metrics."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    v = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return float(v.get("drafter_shm_reads_total", 0)), float(v.get("drafter_shm_read_seconds_total", 0))


async def time_steps(session, steps, hidden, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = await session.propose(steps, hidden)
        times.append(time.perf_counter() - t0)
        assert r.sequences[0].ok, r.sequences[0].message
    return times


def shapes() -> list[tuple[str, str, int, int]]:
    """(name, head, sequences, rows) per case."""
    out = []
    for head in WIDTHS:
        out += [(f"{head} decode b={b}", head, b, b * TOKENS_PER_SEQ) for b in BATCHES]
        out.append((f"{head} prefill {PREFILL_TOKENS}", head, 1, PREFILL_TOKENS))
    return out


async def run_width(sock: str, head: str, width: int, modes: list[str], engine_device: torch.device,
                    budget_s: float, max_iters: int, rounds: int, metrics_port: int) -> list[dict]:
    """Every case runs all modes in alternating rounds, so that a busy machine slows them alike."""
    from drafter_client import DrafterClient, SequenceStep

    max_rows = max(PREFILL_TOKENS, max(BATCHES) * TOKENS_PER_SEQ)
    clients, sessions = {}, {}
    for mode in modes:
        client = DrafterClient(f"unix:{sock}", namespace=f"bench-{mode}", max_message_bytes=512 * 2**20,
                               step_timeout_s=None)
        await client.wait_ready(120)
        kind, _, channel = mode.partition("+")
        if kind != "inline":
            plane = await client.enable_shared_memory(max_rows, dtype=DTYPE, kind=kind, slots=2,
                                                      device=engine_device, width=width)
            assert plane == kind, plane
        if channel:
            assert await client.open_step_channel(request_bytes=2**20), "no step channel"
            clients[mode], sessions[mode] = client, client  # client.propose: through the channel
        else:
            clients[mode], sessions[mode] = client, client.stream()
    results = []
    try:
        for name, h, seqs, rows in shapes():
            if h != head:
                continue
            hidden = torch.randn(rows, width, device=engine_device).to(DTYPE)
            nbytes = hidden.numel() * hidden.element_size()
            m = rows // seqs
            steps = [SequenceStep(f"s{i}", 0, torch.randint(0, 500, (m,)), None, 1, 0) for i in range(seqs)]
            times: dict[str, list[float]] = {mode: [] for mode in modes}
            # data movement alone (shared-memory modes): the client's copy into the slot + the drafter's checks and
            # copy out of it, summed over every step of the case (warm-up included) -> mean per step
            moved = {mode: [0.0, 0] for mode in modes}

            async def timed(mode: str, n: int) -> list[float]:
                c = clients[mode]
                staging0, (reads0, read_s0) = c.staging_seconds, server_shm_totals(metrics_port)
                ts = await time_steps(sessions[mode], steps, hidden, n)
                reads1, read_s1 = server_shm_totals(metrics_port)
                assert mode == "inline" or reads1 - reads0 == n, "one reference read per step"
                moved[mode][0] += c.staging_seconds - staging0 + read_s1 - read_s0
                moved[mode][1] += n
                return ts

            for mode in modes:  # warm-up, and a first estimate of the step time
                await timed(mode, 3)
                times[mode] += await timed(mode, 2)
            per_round = {mode: max(1, min(max_iters // rounds, int(budget_s / rounds / statistics.median(times[mode]))))
                         for mode in modes}
            for _ in range(rounds):
                for mode in modes:
                    times[mode] += await timed(mode, per_round[mode])
            for mode in modes:
                med = statistics.median(times[mode])
                results.append(dict(mode=mode, case=name, head=head, sequences=seqs, rows=rows, width=width,
                                    bytes=nbytes, iters=len(times[mode]), median_ms=med * 1e3,
                                    p10_ms=percentile(times[mode], 0.1) * 1e3,
                                    p90_ms=percentile(times[mode], 0.9) * 1e3, gb_per_s=nbytes / med / 1e9,
                                    data_movement_ms=None if mode == "inline" else
                                    moved[mode][0] / moved[mode][1] * 1e3))
                dm = results[-1]["data_movement_ms"]
                print(f"  {mode:14s} {name:24s} {nbytes / 2**20:8.2f} MiB  {med * 1e3:9.3f} ms  "
                      f"{nbytes / med / 1e9:7.2f} GB/s  ({len(times[mode])} steps)"
                      + (f"  data movement {dm:.3f} ms" if dm is not None else ""), flush=True)
    finally:
        for mode in modes:
            if sessions[mode] is not clients[mode]:
                await sessions[mode].close()
            else:
                assert clients[mode].steps_through_grpc == 0, "a step missed the channel"
            if mode != "inline":
                assert clients[mode].steps_inline == 0, "a step went inline: the ring is too small"
            await clients[mode].close()
    return results


def reference_numbers(engine_device: torch.device) -> dict:
    """Copy bandwidths on this machine, to read the table against (the floor of each data plane)."""
    n = 96 * 2**20
    src = torch.empty(n, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)

    def bw(fn, reps=5) -> float:
        fn()
        if engine_device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if engine_device.type == "cuda":
            torch.cuda.synchronize()
        return n * reps / (time.perf_counter() - t0) / 1e9

    ref = {"host_memcpy_gb_per_s": bw(lambda: dst.copy_(src))}
    if engine_device.type == "cuda":
        pinned = src.pin_memory()
        dev_a = torch.empty(n, dtype=torch.uint8, device=engine_device)
        dev_b = torch.empty_like(dev_a)
        ref["pinned_h2d_gb_per_s"] = bw(lambda: dev_a.copy_(pinned, non_blocking=True))
        ref["pageable_h2d_gb_per_s"] = bw(lambda: dev_a.copy_(src))
        ref["d2d_gb_per_s_counting_bytes_once"] = bw(lambda: dev_b.copy_(dev_a))
    return ref


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def plot(results: list[dict], path: pathlib.Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for mode in dict.fromkeys(r["mode"] for r in results):
        rs = sorted((r for r in results if r["mode"] == mode), key=lambda r: r["bytes"])
        ax.plot([r["bytes"] / 2**20 for r in rs], [r["gb_per_s"] for r in rs], marker="o", label=mode)
    ax.set_xscale("log")
    ax.set_xlabel("hidden states per step (MiB)")
    ax.set_ylabel("achieved GB/s (payload / median step time)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="the drafter's device: cpu or cuda[:N]")
    ap.add_argument("--engine-device", default=None, help="where the engine's hidden states are "
                    "(default: the drafter's device)")
    ap.add_argument("--modes", default=None, help="comma list of inline,system,cuda,system+channel,cuda+channel "
                    "(default: all that apply)")
    ap.add_argument("--budget-s", type=float, default=2.0, help="time per case and mode (at least 5 steps)")
    ap.add_argument("--max-iters", type=int, default=400, help="steps per case and mode, at most")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of the modes per case")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads in each process (1: a memcpy needs no more, and OpenMP spinning "
                         "on a small shared machine makes copies stall)")
    ap.add_argument("--metrics-port", type=int, default=9478, help="the drafter's metrics port (scraped for the "
                    "time its shared-memory reads take)")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "bench")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoints import write_eagle1

    device = torch.device(a.device)
    engine_device = torch.device(a.engine_device) if a.engine_device else device
    modes = a.modes.split(",") if a.modes else (["inline", "system", "system+channel"]
                                                + (["cuda", "cuda+channel"] if device.type == "cuda" else []))
    if device.type != "cuda" and any(m.startswith("cuda") for m in modes):
        print("CUDA IPC skipped: the drafter is not on CUDA (--device cuda)")
        modes = [m for m in modes if not m.startswith("cuda")]
    a.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    meta = dict(device=device_name(engine_device), drafter_device=str(device), engine_device=str(engine_device),
                date=stamp.isoformat(timespec="seconds"), host=socket.gethostname(), cores=os.cpu_count(),
                python=platform.python_version(), torch=torch.__version__,
                grpc=__import__("grpc").__version__,
                transport="unix socket, one ProposeStream; +channel modes: a step channel (unary, shared memory)",
                method="drafter in ingest-only mode in its own process: decode, check, copy the hidden states once "
                       "onto its device, answer without drafting; time = one stream round trip per step, from the "
                       "engine's tensor to the reply, the modes in alternating rounds; GB/s = payload bytes / "
                       "median step time",
                dtype="bfloat16", tokens_per_sequence=TOKENS_PER_SEQ, torch_threads=a.threads,
                load_average_at_start=os.getloadavg(),
                env={k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "OMP_", "CUDA_VISIBLE"))})
    print(f"data plane on {meta['device']} ({meta['cores']} cores, load {os.getloadavg()[0]:.1f}), drafter on "
          f"{device}, engine tensors on {engine_device}; modes {', '.join(modes)}")
    meta["reference"] = reference_numbers(engine_device)
    print("reference: " + ", ".join(f"{k} {v:.1f}" for k, v in meta["reference"].items()))

    ctx = multiprocessing.get_context("spawn")
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-dp-") as tmp:
        head_dir, target_dir = write_eagle1(pathlib.Path(tmp), seed=0)
        for head, width in WIDTHS.items():
            sock = os.path.join(tmp, f"{head}.sock")
            ready = ctx.Event()
            proc = ctx.Process(target=serve_ingest_only, args=(str(head_dir), str(target_dir), sock, width,
                                                               str(device), a.threads, a.metrics_port, ready),
                               daemon=True)
            proc.start()
            try:
                if not ready.wait(300):
                    raise RuntimeError("the drafter did not start")
                results += asyncio.run(run_width(sock, head, width, modes, engine_device, a.budget_s, a.max_iters,
                                                 a.rounds, a.metrics_port))
            finally:
                proc.terminate()
                proc.join(30)

    print()
    print(f"{'case':26s} {'MiB':>8s} " + " ".join(f"{m + ' ms':>11s} {m + ' GB/s':>12s}" for m in modes))
    for name, *_ in shapes():
        row = {r["mode"]: r for r in results if r["case"] == name}
        if not row:
            continue
        nbytes = next(iter(row.values()))["bytes"]
        cells = " ".join(f"{row[m]['median_ms']:11.3f} {row[m]['gb_per_s']:12.2f}" if m in row else " " * 24
                         for m in modes)
        moved = " ".join(f"{m}: {row[m]['data_movement_ms']:.3f}" for m in modes
                         if m in row and row[m]["data_movement_ms"] is not None)
        print(f"{name:26s} {nbytes / 2**20:8.2f} {cells}   data movement ms (client copy + drafter read): {moved}")

    tag = f"{'cuda' if engine_device.type == 'cuda' else 'cpu'}_{stamp.strftime('%Y%m%d-%H%M%S')}"
    meta["load_average_at_end"] = os.getloadavg()
    path = a.out / f"data_plane_{tag}.json"
    path.write_text(json.dumps(dict(meta, results=results), indent=1))
    print(f"\njson: {path}")
    plot(results, a.out / f"data_plane_{tag}.png", f"data plane, {meta['device']} ({meta['date'][:10]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
