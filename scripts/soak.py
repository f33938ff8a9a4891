"""Fault and soak harness: several engine processes drive a local drafter for a bounded time while faults are
injected; every checked draft must equal the naive reference, no engine step may wait past its deadline, and no
sequence may stay behind once every engine has left.

    python scripts/soak.py                                   # 60 s, 4 engines x 12 sequences, every fault kind
    python scripts/soak.py --duration-s 600 --out docs/bench/soak_cpu.json

The drafter is drafter-serve in a child process on a tiny random EAGLE-1 head (the tests' checkpoint writer) with a
small KV pool and a short sequence lease. Each engine is a process
with its own DrafterClient (a per-step deadline, fallback, circuit breaker); engine i talks unary Propose, a
ProposeStream, a step channel or the batch API (propose_batch) (i % 4; all but the step channel over TCP through
a proxy that can cut connections, the step channel on the Unix socket). The unary engines send half their steps as
ProposeChunked uploads spread over two connections (ProposeChunk.part, in 512-byte chunks), so that cuts and
restarts land mid-upload too. Engines of odd index ask for pre-drafting
(--predraft-branches, docs/predraft.md), so that passes, branches and hits run through the same faults; the batch
engines keep --batch-sequences sequences, enough for columnar requests (ProposeRequest.columns). An engine keeps
--sequences sequences with random tokens and hidden states, accepts a random
number of the drafts each step (a new sequence takes the place of a finished one, which is released), resends from
the last confirmed position after a step without drafts and from position 0 when the reply says needs_resync, and
checks one drafting step in --check-every against the naive reference (recomputing the sequence without a KV
cache); an answer the drafter prepared while the engine verified (predrafted) is checked every time, against the
reference of its branch (the served drafts and the bonus token with the head's own features). Faults, one every
--fault-every-s, in turn:
  - cut: the proxy aborts every open TCP connection (a reset mid-stream);
  - kill: an engine is SIGKILLed (its sequences are never released) and a new one starts;
  - restart: the drafter is SIGKILLed and started again at the same address (every sequence is lost);
  - flood: a process opens sequences until the pool is full, then exits without releasing any.
At the end every engine releases its sequences and exits; the harness waits one lease and reads the drafter's KV
pool: blocks still held are leaked. Prints a table and writes JSON (device, date, command, figures).
Exit status 1 when a mismatch, a late step or a leak was seen. A late step is one past its deadline + --slack-s
without the time the engine's thread waited for a CPU (its run-queue wait, /proc/thread-self/schedstat); a step
late only by the wall clock is reported as starved.
"""
import argparse
import asyncio
import contextlib
import datetime
import multiprocessing as mp
import os
import pathlib
import platform
import random
import shlex
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # checkpoints.py (tiny heads) and naive_eagle.py (the reference)

H, V = 64, 512  # the tiny head's hidden size and vocabulary
K = 3  # drafts per step
NEAR_TIE = 1e-4  # fp64 logit gap within which a float32 drafter may pick either token (see naive_eagle.divergence)
MODES = ("unary", "stream", "channel", "batch")  # how engine i talks to the drafter: MODES[i % 4]


# ---- an engine (a child process) ----

def engine_main(index: int, address: str, args: dict, head: str, target: str, results, stop_at: float) -> None:
    import torch

    import logging
    import traceback

    torch.set_num_threads(1)
    # the client's fallback warnings ("the drafter ... failed a call") are the point of the run: counted, not printed
    logging.basicConfig(level=logging.ERROR)
    try:
        asyncio.run(Engine(index, address, args, head, target).run(results, stop_at))
    except BaseException:  # an exception out of the client into the engine is a failure of the run
        traceback.print_exc()
        results.put(dict(index=index, crashed=traceback.format_exc()))


class Engine:
    def __init__(self, index: int, address: str, args: dict, head: str, target: str):
        import torch

        from naive_eagle import NaiveEagle1
        from naive_predraft import Naive

        self.torch = torch
        self.index, self.address, self.args = index, address, args
        self.rng = random.Random(1000 + index)
        self.gen = torch.Generator().manual_seed(index)
        self.naive = NaiveEagle1(head, target)
        self.branch_naive = Naive(self.naive)
        self.budget = args["predraft_branches"] if index % 2 else 0  # engines of odd index pre-draft
        self.next_id = 0
        self.stats = dict(steps=0, steps_with_drafts=0, fallback_steps=0, resyncs=0, checked=0, mismatches=0,
                          near_ties=0,
                          late_steps=0, starved_steps=0, late_samples=[], predrafted=0, fallback_reasons={},
                          fallback_examples={}, latencies_ms=[], fallback_latencies_ms=[],
                          columnar=False)  # (batch mode: whether it sent columns at any point of the run)
        self.started = time.monotonic()

    def new_sequence(self) -> dict:
        self.next_id += 1
        n = self.rng.randint(4, 24)
        return dict(sid=f"e{self.index}-{self.next_id}", tokens=[self.rng.randrange(V) for _ in range(n + 1)],
                    hidden=self.torch.randn(n, H, generator=self.gen), sent=0)  # sent: positions the drafter has

    def step_of(self, s: dict):
        from drafter_client import SequenceStep

        p = s["sent"]
        n = len(s["tokens"]) - 1  # committed tokens with hidden states; tokens[-1] is the next token
        return SequenceStep(s["sid"], p, s["tokens"][p:n], s["hidden"][p:n], s["tokens"][n], K,
                            predraft_branches=self.budget)

    async def client(self):
        from drafter_client import DrafterClient, DrafterError

        mode = self.args["mode"]
        # the unary engines send half their steps as ProposeChunked uploads spread over two connections (run(); small
        # chunks, so that a cut or a restart lands mid-upload), the other half as one Propose
        spread = dict(chunk_bytes=512, upload_streams=2, upload_streams_min_bytes=0) if mode == "unary" else {}
        if mode == "unary":  # (this process only: steps of any size may take the chunked path, not only >= 64 KiB)
            from drafter_client import messages
            messages.DIRECT_STATES_MIN_BYTES = 1
        c = DrafterClient(self.address, namespace=f"engine-{self.index}", step_timeout_s=self.args["deadline_s"],
                          **spread)
        if mode == "channel":  # (a replacement engine may start while the drafter restarts: wait for it, as an
            # engine starting next to a drafter would)
            for attempt in range(5):
                try:
                    await c.wait_ready(30)
                    if await c.open_step_channel():
                        break
                except (DrafterError, TimeoutError) as e:
                    print(f"engine {self.index}: no step channel yet ({e}); trying again", flush=True)
                await asyncio.sleep(0.5)
            else:
                raise RuntimeError("no step channel")
        return c, (c.stream() if mode == "stream" else None)

    async def run(self, results, stop_at: float) -> None:
        torch = self.torch
        count = self.args["batch_sequences" if self.args["mode"] == "batch" else "sequences"]
        seqs = [self.new_sequence() for _ in range(count)]
        client, session = await self.client()
        deadline = self.args["deadline_s"]
        try:
            while time.monotonic() < stop_at:
                steps = [self.step_of(s) for s in seqs]
                t0, queued0 = time.perf_counter(), run_queue_wait_s()
                if self.args["mode"] == "batch":
                    reply = as_result(await client.propose_batch(as_batch(steps)))
                    # requests as columns at some point of the run (the client asks again after each fault: a run
                    # that ends in a fault's backoff ends without knowing)
                    self.stats["columnar"] |= bool(client._step_columns)
                elif self.args["mode"] == "unary":
                    # a spread upload, or one Propose
                    client.chunk_min_bytes = 0 if self.rng.random() < 0.5 else 1 << 62
                    reply = await client.propose(steps)
                else:
                    reply = await (session.propose(steps) if session is not None else client.propose(steps))
                took, queued = time.perf_counter() - t0, run_queue_wait_s() - queued0
                self.stats["steps"] += 1
                # answered steps and fallbacks apart: a fallback while the breaker is open takes microseconds
                self.stats["fallback_latencies_ms" if reply.fallback else "latencies_ms"].append(took * 1e3)
                if took > deadline + self.args["slack_s"]:
                    # past the deadline by the wall clock. Late by the client's own doing only when it is so
                    # without the time this thread waited for a CPU (a starved machine delays any process)
                    starved = took - queued <= deadline + self.args["slack_s"]
                    self.stats["starved_steps" if starved else "late_steps"] += 1
                    self.stats["late_samples"].append(dict(
                        mode=self.args["mode"], at_s=round(time.monotonic() - self.started, 3),
                        took_ms=round(took * 1e3, 1), run_queue_ms=round(queued * 1e3, 1), starved=starved,
                        fallback=reason_of(reply)))
                if reply.fallback:
                    self.stats["fallback_steps"] += 1
                    why = reply.fallback_reason.split(":")[0][:40]
                    self.stats["fallback_reasons"][why] = self.stats["fallback_reasons"].get(why, 0) + 1
                    self.stats["fallback_examples"].setdefault(why, reply.fallback_reason[:300])
                await asyncio.sleep(self.args["target_step_s"])  # the target verifies the drafts
                for s, st, r in zip(seqs, steps, reply.sequences):
                    if r.ok:
                        s["sent"] = st.start_position + len(st.token_ids)
                        drafts = r.drafts.tolist()
                        self.stats["steps_with_drafts"] += 1
                        if r.predrafted:  # prepared during the last verification: the branch of this outcome
                            # (the context below C = the step's start with the target's states; then x[C]'s
                            # successors D_1..D_a and the bonus, the step's other tokens, with the head's features)
                            self.stats["predrafted"] += 1
                            c = st.start_position
                            forced = [int(t) for t in st.token_ids[1:]] + [st.next_token]
                            want = self.branch_naive.drafts(s["tokens"][: c + 1], s["hidden"][:c], forced,
                                                            len(drafts), lambda logits, j: int(logits.argmax()))
                        elif self.rng.random() < 1 / self.args["check_every"]:
                            want = self.naive.drafts(s["tokens"], s["hidden"], len(drafts))
                        else:
                            want = None
                        if want is not None:
                            self.stats["checked"] += 1
                            # a plain draft that differs where the fp64 reference's top two logits are within
                            # NEAR_TIE is a tie the float32 drafter broke the other way, not a wrong draft
                            where = (None if drafts == want or r.predrafted else
                                     self.naive.divergence(s["tokens"], s["hidden"], drafts))
                            if where is not None and where[1] <= NEAR_TIE:
                                self.stats["near_ties"] += 1
                                print(f"near-tie engine {self.index} {s['sid']}: draft {where[0]} {drafts} vs "
                                      f"{want}, logit gap {where[1]:.2e} in fp64", flush=True)
                            elif drafts != want:
                                self.stats["mismatches"] += 1
                                print(f"MISMATCH engine {self.index} {s['sid']} (predrafted {r.predrafted}): "
                                      f"{drafts} != {want}" + (f"; at draft {where[0]} the reference's logit gap "
                                                               f"is {where[1]:.2e}" if where else ""), flush=True)
                        accepted = drafts[: self.rng.randint(0, len(drafts))]
                    else:
                        accepted = []
                        if r.needs_resync:  # the drafter lost the context: resend it whole next step
                            s["sent"] = 0
                            self.stats["resyncs"] += 1
                    # the target commits the accepted drafts and its own next token: a random one, or (pre-drafting
                    # engines, now and then) the drafter's likeliest after the accepted ones, so that hits happen
                    bonus = self.rng.randrange(V)
                    if r.ok and self.budget and self.rng.random() < self.args["likely_bonus"]:
                        rejected = drafts[len(accepted)] if len(accepted) < len(drafts) else -1
                        bonus = self.branch_naive.drafts(
                            s["tokens"], s["hidden"], accepted, 1,
                            lambda logits, j: next(int(t) for t in logits.topk(2).indices if int(t) != rejected))[0]
                    new = accepted + [bonus]
                    s["hidden"] = torch.cat([s["hidden"], torch.randn(len(new), H, generator=self.gen)])
                    s["tokens"] = s["tokens"] + new
                finished = [s for s in seqs if len(s["tokens"]) > self.args["max_len"]]
                if finished:
                    await client.release([s["sid"] for s in finished])
                    seqs = [s for s in seqs if s not in finished] + [self.new_sequence() for _ in finished]
            await client.release([s["sid"] for s in seqs])
        finally:
            if session is not None:
                await session.close()
            await client.close()
        self.stats["streams_opened"] = session.streams_opened if session is not None else 0
        self.stats["breaker_opened"] = client.breaker.times_opened
        self.stats["spread_steps"] = client.steps_spread  # steps uploaded over two connections (unary engines)
        lat, fb = self.stats.pop("latencies_ms"), self.stats.pop("fallback_latencies_ms")
        results.put(dict(self.stats, index=self.index, mode=self.args["mode"], latencies_ms=lat,
                         fallback_latencies_ms=fb))


def run_queue_wait_s() -> float:
    """How long this thread has waited on a run queue for a CPU, in all (Linux /proc/thread-self/schedstat, second
    field, in ns); 0.0 where the kernel does not tell."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def reason_of(reply) -> str:
    return reply.fallback_reason[:200] if reply.fallback else ""


def as_batch(steps):
    """The batch API's columns for a list of SequenceSteps (the "batch" engines use propose_batch)."""
    import torch

    from drafter_client import StepBatch

    return StepBatch(sequence_ids=[s.sequence_id for s in steps],
                     start_positions=torch.tensor([s.start_position for s in steps]),
                     num_tokens=torch.tensor([len(s.token_ids) for s in steps]),
                     token_ids=torch.tensor([t for s in steps for t in s.token_ids]),
                     hidden_states=torch.cat([s.hidden_states for s in steps]),
                     next_tokens=torch.tensor([s.next_token for s in steps]),
                     num_drafts=torch.tensor([s.num_drafts for s in steps]),
                     predraft_branches=torch.tensor([s.predraft_branches for s in steps]))


def as_result(b):
    """BatchDrafts seen per sequence, as the harness checks them (drafts split by num_drafts)."""
    from types import SimpleNamespace

    drafts = b.draft_token_ids.split(b.num_drafts.tolist())
    seqs = [SimpleNamespace(ok=int(c) == 0, drafts=d, needs_resync=bool(rs), predrafted=bool(pd))
            for c, d, rs, pd in zip(b.codes.tolist(), drafts, b.needs_resync.tolist(), b.predrafted.tolist())]
    return SimpleNamespace(sequences=seqs, fallback=b.fallback, fallback_reason=b.fallback_reason)


# ---- a pool flood: open sequences until the pool is full, then vanish ----

def flood_main(address: str, count: int) -> None:
    async def go():
        import torch

        from drafter_client import DrafterClient, SequenceStep

        async with DrafterClient(address, namespace="flood", step_timeout_s=5.0) as c:
            for i in range(0, count, 8):
                await c.propose([SequenceStep(f"f{i + j}", 0, list(range(40)), torch.randn(40, H), 1, 0)
                                 for j in range(8)])
        os._exit(0)  # no Release

    asyncio.run(go())


# ---- connection cuts: a TCP proxy in front of the drafter's Unix socket ----

class CuttingProxy:
    """Forwards TCP connections from the engines (unary and stream modes) to the drafter's Unix socket, on a thread
    of its own; cut() aborts every open connection at once (a TCP reset mid-stream, as a dying node or network
    would), and the engines' clients reconnect by themselves."""

    def __init__(self, sock: pathlib.Path):
        self.sock = sock
        self.loop = asyncio.new_event_loop()
        self.transports: set = set()
        ready = threading.Event()
        self.port = 0

        async def start():
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            ready.set()

        threading.Thread(target=self.loop.run_forever, daemon=True, name="cutting-proxy").start()
        asyncio.run_coroutine_threadsafe(start(), self.loop)
        ready.wait(10)

    async def _handle(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(str(self.sock))
        except OSError:  # the drafter is restarting: the client sees the connection drop and retries
            writer.transport.abort()
            return
        pair = (writer.transport, up_writer.transport)
        self.transports.update(pair)

        async def pipe(src, dst):
            try:
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self.transports.difference_update(pair)

    def open_connections(self) -> int:
        return len(self.transports) // 2  # (read from another thread: a set's len is one atomic look)

    def cut(self) -> int:
        """Abort every open connection; returns how many were cut (two transports each)."""
        async def go():
            cut = list(self.transports)
            self.transports.clear()
            for t in cut:
                t.abort()
            return len(cut) // 2

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(5)


# ---- the drafter: drafter-serve as a child process (SidecarProcess: start, SIGKILL, start again at the same address)

def rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def held_tokens(address: str) -> int:
    """KV tokens the drafter at address holds (GetInfo)."""
    async def go():
        from drafter_client import DrafterClient

        async with DrafterClient(address) as c:
            info = await c.get_info()
            return info.kv_capacity_tokens - info.kv_free_tokens

    return asyncio.run(go())


def logged_errors(drafter) -> list[str]:
    """The drafter's ERROR / CRITICAL log lines and uncaught exceptions (a thread's traceback on stderr, which goes
    to the same log), each with what follows it, from the log of its current process."""
    try:
        lines = drafter.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    marks = (" ERROR ", " CRITICAL ", "Exception in thread", "Traceback (most recent call last)")
    starts = [i for i, line in enumerate(lines) if any(m in line for m in marks)]
    # (a logged error's own traceback follows it: one entry per block)
    return ["\n".join(lines[i : i + 30]) for n, i in enumerate(starts) if n == 0 or i - starts[n - 1] > 30]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--engines", type=int, default=4, help="engine i uses MODES[i % 4]")
    ap.add_argument("--sequences", type=int, default=12, help="per engine")
    ap.add_argument("--batch-sequences", type=int, default=32,
                    help="per batch-API engine (from 32 its requests go as columns)")
    ap.add_argument("--predraft-branches", type=int, default=8,
                    help="the pre-drafting budget of the engines of odd index (0: none pre-drafts)")
    ap.add_argument("--likely-bonus", type=float, default=0.25,
                    help="pre-drafting engines: the share of steps whose bonus token is the drafter's likeliest "
                         "(the naive reference's) instead of a random one, so that prepared branches are hit")
    ap.add_argument("--max-len", type=int, default=96, help="a sequence is finished (released) past this length")
    ap.add_argument("--kv-tokens", type=int, default=8192, help="the drafter's pool (small: the flood fills it)")
    ap.add_argument("--lease-s", type=float, default=3.0, help="the drafter's --sequence-lease-s")
    ap.add_argument("--deadline-s", type=float, default=0.5, help="the engines' per-step deadline")
    ap.add_argument("--slack-s", type=float, default=0.5, help="a step later than deadline + slack counts as late")
    ap.add_argument("--target-step-ms", type=float, default=5.0,
                    help="each engine step also waits this long (the target's forward pass)")
    ap.add_argument("--merge-window-us", type=int, default=1000,
                    help="the drafter's --merge-window-us (0 by default on CPU): its waits for engines that step "
                         "together run through the same faults")
    ap.add_argument("--fault-every-s", type=float, default=4.0)
    ap.add_argument("--check-every", type=int, default=10, help="check one drafting step in N against the naive")
    ap.add_argument("--faults", default="flood,cut,kill,restart", help="the fault kinds, injected in this order")
    ap.add_argument("--out", default="bench_out/soak.json")
    a = ap.parse_args(argv)
    from checkpoints import write_eagle1

    from drafter_client.benchmarks.report import write_json
    from drafter_client.engine.sidecar_process import SidecarProcess

    mp_ctx = mp.get_context("spawn")
    results = mp_ctx.Queue()
    faults = {k: 0 for k in ("cut", "kill", "restart", "flood")}
    kinds = [f for f in a.faults.split(",") if f]
    if set(kinds) - set(faults):
        ap.error(f"--faults: unknown kinds {sorted(set(kinds) - set(faults))}; the kinds are {', '.join(faults)} "
                 "(comma-separated)")
    t_start = time.monotonic()
    stop_at = t_start + a.duration_s
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as cleanup:
        tmp = pathlib.Path(tmp)
        head, target = write_eagle1(tmp / "model", seed=0, fc_bias=True)
        drafter = SidecarProcess(head, target, device="cpu", extra_args=[
            "--kv-cache-tokens", str(a.kv_tokens), "--max-model-len", str(a.max_len + 32),
            "--sequence-lease-s", str(a.lease_s), "--merge-window-us", str(a.merge_window_us),
            "--log-level", "WARNING"]).start()
        cleanup.callback(drafter.close)  # (however the run ends: an exception here left the drafter running)
        address = drafter.address
        proxy = CuttingProxy(pathlib.Path(address.removeprefix("unix:")))
        engine_args = dict(sequences=a.sequences, batch_sequences=a.batch_sequences, max_len=a.max_len,
                           deadline_s=a.deadline_s, slack_s=a.slack_s, check_every=a.check_every,
                           target_step_s=a.target_step_ms / 1e3, predraft_branches=a.predraft_branches,
                           likely_bonus=a.likely_bonus)
        engines, modes = {}, {}

        def start_engine(i: int, mode: str | None = None) -> None:
            # engine i: unary Propose, a ProposeStream, the batch API (through the cutting proxy, over TCP) or a
            # step channel (on the Unix socket: same node, shared memory); a replacement keeps its victim's mode
            mode = mode or MODES[i % len(MODES)]
            modes[i] = mode
            where = address if mode == "channel" else f"127.0.0.1:{proxy.port}"  # (batch: unary over TCP)
            p = mp_ctx.Process(target=engine_main, args=(i, where, dict(engine_args, mode=mode), str(head),
                                                         str(target), results, stop_at), daemon=True)
            p.start()
            engines[i] = p

        for i in range(a.engines):
            start_engine(i)
        next_engine = a.engines
        rss_start = None
        fault_at = time.monotonic() + a.fault_every_s
        turn = 0
        connections_cut = 0
        drafter_errors: list[str] = []
        flood = None  # the flood process running, if any
        while time.monotonic() < stop_at - 1.0:
            time.sleep(0.1)
            if rss_start is None and time.monotonic() > t_start + min(5.0, a.duration_s / 10):
                rss_start = rss_mib(drafter.proc.pid)
            if time.monotonic() < fault_at or not kinds:
                continue
            fault_at = time.monotonic() + a.fault_every_s
            kind = kinds[turn % len(kinds)]
            turn += 1
            if kind == "cut":
                # a cut that lands before any engine has connected resets nothing (a loaded 2-core runner: the
                # engines' processes were still starting at the first cut): wait for one (the later faults move with
                # it)
                while proxy.open_connections() == 0 and time.monotonic() < stop_at - 1.0:
                    time.sleep(0.05)
                fault_at = time.monotonic() + a.fault_every_s  # (the next fault a full period after this one)
                n = proxy.cut()
                connections_cut += n
                print(f"[{time.monotonic() - t_start:6.1f}s] cut {n} connections", flush=True)
            elif kind == "kill":
                victim = sorted(engines)[faults["kill"] % len(engines)]  # the first kill takes engine 0, ...
                engines.pop(victim).kill()  # SIGKILL: its sequences are never released
                next_engine += (next_engine - victim) % 2  # (the same parity: pre-drafting or not, as the victim)
                start_engine(next_engine, modes[victim])
                next_engine += 1
            elif kind == "restart":
                drafter.kill()
                drafter_errors += logged_errors(drafter)  # (the new process starts a new log)
                drafter.start()
                rss_start = None  # a new process: measure its growth from its own warm state
            elif kind == "flood":
                if flood is not None:  # (one flood at a time)
                    flood.join(30)
                # the flood runs while the next faults come on time (a slow machine took ~15 s for one, and
                # waiting for it left the kill's replacement engine too little of a short run to step at all)
                flood = mp_ctx.Process(target=flood_main, args=(address, a.kv_tokens // 48 + 16), daemon=True)
                flood.start()
            if kind:
                faults[kind] += 1
                print(f"[{time.monotonic() - t_start:6.1f}s] fault: {kind}", flush=True)
        reports = []  # one per engine alive at the end (a killed engine reports nothing, unless it crashed)
        while not set(engines) <= {r["index"] for r in reports}:
            reports.append(results.get(timeout=a.deadline_s + 120))
        for p in engines.values():
            p.join(30)
        if flood is not None:
            flood.join(30)
        rss_end = rss_mib(drafter.proc.pid)
        time.sleep(a.lease_s + 1.5)  # sequences of killed engines and floods expire
        held = held_tokens(address)
        drafter_errors += logged_errors(drafter)
        drafter.close()
    crashed = [r for r in reports if "crashed" in r]
    reports = [r for r in reports if "crashed" not in r]
    lat = [x for r in reports for x in r["latencies_ms"]]
    fb = [x for r in reports for x in r["fallback_latencies_ms"]]
    total = {k: sum(r[k] for r in reports) for k in ("steps", "steps_with_drafts", "fallback_steps", "resyncs",
                                                       "checked", "predrafted", "mismatches", "near_ties",
                                                       "late_steps", "starved_steps", "spread_steps")}
    late_samples = sorted((x for r in reports for x in r["late_samples"]), key=lambda x: -x["took_ms"])
    result = dict(benchmark="soak", date=datetime.datetime.now().isoformat(timespec="seconds"),
                  device=f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                  command=" ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]), args=vars(a),
                  engines_reporting=len(reports), engines_crashed=len(crashed), faults=faults,
                  columnar_engines=sum(r["columnar"] for r in reports),
                  connections_cut=connections_cut, **total, leaked_kv_tokens=held,
                  late_samples=late_samples[:10],
                  drafter_errors=len(drafter_errors), drafter_error_samples=drafter_errors[:3],
                  step_ms_p50=percentile(lat, 0.5), step_ms_p99=percentile(lat, 0.99),
                  fallback_step_ms_p50=percentile(fb, 0.5), fallback_step_ms_p99=percentile(fb, 0.99),
                  drafter_rss_mib_start=rss_start, drafter_rss_mib_end=rss_end)
    out = write_json(a.out, result, say=False)
    print(f"\nsoak {a.duration_s:.0f} s, {a.engines} engines x {a.sequences} sequences, {result['date']}")
    for key in ("engines_reporting", "engines_crashed", "columnar_engines", "faults", "connections_cut", "steps",
                "steps_with_drafts", "fallback_steps", "resyncs", "checked", "predrafted", "spread_steps", "mismatches",
                "near_ties", "drafter_errors", "late_steps", "starved_steps", "leaked_kv_tokens", "step_ms_p50",
                "step_ms_p99",
                "fallback_step_ms_p50", "fallback_step_ms_p99", "drafter_rss_mib_start", "drafter_rss_mib_end"):
        v = result[key]
        print(f"  {key:22s} {v:.2f}" if isinstance(v, float) else f"  {key:22s} {v}")
    for r in sorted(reports, key=lambda r: r["index"]):
        print(f"  engine {r['index']} ({r['mode']}): {r['steps']} steps, "
              f"{r['steps_with_drafts']} drafting sequence-steps ({r['predrafted']} predrafted), "
              f"{r['fallback_steps']} fallback steps, "
              f"{r['resyncs']} resyncs, breaker opened {r['breaker_opened']}x; fallbacks: {r['fallback_reasons']}")
        for why, example in r["fallback_examples"].items():
            if not why.startswith(("UNAVAILABLE", "circuit breaker", "DEADLINE_EXCEEDED")):
                print(f"    {why}: {example}")
    for x in late_samples[:5]:
        print(f"  {'starved' if x['starved'] else 'LATE'} step: {x}")
    print(f"wrote {out}")
    for sample in drafter_errors[:1]:
        print(f"the drafter logged {len(drafter_errors)} errors; the first:\n{sample}")
    bad = (total["mismatches"] or total["late_steps"] or held or crashed or not total["checked"]
           or drafter_errors)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
