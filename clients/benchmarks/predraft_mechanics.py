"""Benchmark: what pre-drafting costs and saves on the drafter's side, at the 8B head shapes (in-process proposer).

    python -m drafter_client.benchmarks.predraft_mechanics --preset llama3-8b --device cuda
    python -m drafter_client.benchmarks.predraft_mechanics --preset llama3-8b-eagle3 --device cuda --batches 1,16,64

The head has random weights of the preset's shape (bench_step.write_random_head), so acceptance means nothing here:
the outcomes are chosen by the benchmark (clients/benchmarks/predraft.py measures hit rates and acceptance with a
real target). B sequences at a context of --context tokens; every iteration, per batch size:
  plain    a decode step with pre-drafting off (m = a + 1 committed tokens, k drafts): the drafter's step today;
  pass     the preparation pass that follows a step (what must fit in the engine's verification time);
  hit      the next step when every sequence's outcome was prepared (picked among its branches): no device work;
  miss     the next step when no sequence's outcome was prepared: a plain step that also runs the pending rows of
           the hit before it.
With --sidecar (default), the engine's wait through a step channel (run_sidecar: the drafter in this process, the
engine in a child process of its own), with a sleep of --verify-ms standing for the engine's verification before
every step, after --warmup steps: first --iters steps with pre-drafting off, then --iters
with it on, where a step takes a prepared outcome for every sequence whenever all have one (a hit: the benchmark
picks it; with a real target a share of outcomes is unprepared, see predraft.py), else an unprepared outcome (a miss,
or "busy" when the pass had not finished: the step stops it and is drafted as usual).
Medians over --iters, in ms, with the pass's share of a given verification time. The drafter runs without the
cycle check (passes whenever they fit; also the default), so that no turn without passes falls inside a timed phase:
what is measured is what passes save, not a policy that decides when to run them. Prints a table and writes JSON
(device, date, command) to --out. Through the sidecar, a step also pays its transport (bench_step's table).
"""
import argparse
import datetime
import pathlib
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time

import torch

from drafter_client.benchmarks.bench_step import PRESETS, write_random_head
from drafter_client.benchmarks.report import write_json


def _median_ms(seconds: list[float]) -> float | None:
    return statistics.median(seconds) * 1e3 if seconds else None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_batch(rt, B: int, context: int, k: int, budget: int, iters: int, seed: int) -> dict:
    from drafter_service.engine.step_io import StepInput

    proposer, device = rt.proposer, rt.device
    width, vocab = rt.limits.hidden_states_width, rt.limits.vocab_size
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    ids = [f"s{b}" for b in range(B)]
    tokens = {sid: torch.randint(0, vocab, (context + 1,), generator=g).tolist() for sid in ids}
    state = {}  # sid -> (committed length C, drafts served)

    def states(n: int) -> torch.Tensor:
        return torch.randn(n, width, generator=g).to(torch.bfloat16)

    def make(outcomes: dict, budget_now: int) -> list:
        """The next step of every sequence for outcomes sid -> (a, b) (built before the clock starts)."""
        inputs = []
        for sid in ids:
            C, drafts = state[sid]
            a, b = outcomes[sid]
            tokens[sid] = tokens[sid][: C + 1] + drafts[:a] + [b]
            inputs.append(StepInput("mech", sid, C, torch.tensor(tokens[sid][C : C + a + 1]), states(a + 1), b, k,
                                    predraft_branches=budget_now))
        return inputs

    def run(inputs: list) -> list:
        out = proposer.step(inputs)
        for sid, s, o in zip(ids, inputs, out):
            assert o.code == 0, o.message
            state[sid] = (s.start_position + s.num_tokens, o.drafts)
        return out

    def step(outcomes: dict, budget_now: int) -> list:
        return run(make(outcomes, budget_now))

    out = proposer.step([StepInput("mech", sid, 0, torch.tensor(tokens[sid][:context]), states(context),
                                   tokens[sid][context], k, predraft_branches=budget) for sid in ids])
    for sid, o in zip(ids, out):
        state[sid] = (context, o.drafts)

    def random_outcomes() -> dict:
        picked = {}
        for sid in ids:
            drafts = state[sid][1]
            a = rng.randint(0, k - 1)
            picked[sid] = (a, next(t for t in range(vocab) if t != drafts[a] and t != tokens[sid][-1]))
        return picked

    times = {"plain": [], "pass": [], "hit": [], "miss": []}
    for i in range(iters + 2):
        keep = i >= 2  # two warm-up iterations
        inputs = make(random_outcomes(), 0)
        sync(device)
        t0 = time.perf_counter()
        run(inputs)  # pre-drafting off: the plain step
        sync(device)
        t1 = time.perf_counter()
        step(random_outcomes(), budget)  # (a plain step that turns pre-drafting on: not timed)
        sync(device)
        t2 = time.perf_counter()
        assert proposer.predraft.prepare(lambda: False)
        sync(device)
        t3 = time.perf_counter()
        hits = {}
        for sid in ids:
            br = proposer.table.get("mech", sid).predraft.branches
            hits[sid] = next(iter(br.outcomes))
        inputs = make(hits, budget)
        t3b = time.perf_counter()
        out = run(inputs)
        sync(device)
        t4 = time.perf_counter()
        assert all(o.predrafted for o in out)
        # a miss right after the hit: an unprepared outcome, the hit's pending rows ride with it
        misses = {}
        for sid in ids:
            drafts = state[sid][1]
            a = rng.randint(0, k - 1)
            misses[sid] = (a, next(t for t in range(vocab) if t != drafts[a]))
        inputs = make(misses, budget)
        t5 = time.perf_counter()
        out = run(inputs)
        sync(device)
        t6 = time.perf_counter()
        assert not any(o.predrafted for o in out)
        if keep:
            times["plain"].append(t1 - t0)
            times["pass"].append(t3 - t2)
            times["hit"].append(t4 - t3b)
            times["miss"].append(t6 - t5)
    for sid in ids:
        proposer.table.release("mech", sid)
    return {name: statistics.median(v) * 1e3 for name, v in times.items()} | {
        name + "_spread": [min(v) * 1e3, max(v) * 1e3] for name, v in times.items()}


def run_sidecar(cfg, B: int, context: int, k: int, budget: int, iters: int, verify_ms: float, seed: int,
                warmup: int = 20, engine_threads: int | None = None) -> dict:
    """The engine's wait for drafts through a step channel (plain, hit, miss). The drafter runs in this process (so
    that the benchmark can see which outcomes its proposer prepared), the engine in a child process of its own
    (engine_process), as in a deployment: the two share no GIL. Between two steps the engine "verifies" for verify_ms
    (a sleep; the pass runs then), then asks this process over a pipe which outcomes are prepared (a few
    microseconds of this process's time). Each phase times iters steps after `warmup` (the drafter's averages of the
    idle window and of the pass time settle; a first pass that compiles kernels is measured again after
    PROBE_AFTER_SKIPS skipped ones, predraft.py)."""
    import asyncio
    import multiprocessing
    import threading

    from drafter_service.server import DrafterServer

    loop = asyncio.new_event_loop()
    server = DrafterServer(cfg)
    threading.Thread(target=loop.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(600)
    proposer = server.runtime.proposer
    address = next(a for a in server.bound_addresses if a.startswith("unix:"))
    step_s: list[float] = []  # the proposer's own step times (server side), one per request, in order
    plain_step = proposer.step

    def timed_step(inputs):
        t0 = time.perf_counter()
        try:
            return plain_step(inputs)
        finally:
            step_s.append(time.perf_counter() - t0)

    proposer.step = timed_step
    limits = server.runtime.limits
    spawn = multiprocessing.get_context("spawn")
    here, there = spawn.Pipe()
    engine = spawn.Process(
        target=engine_process, args=(there, address, B, context, k, budget, iters, warmup, verify_ms, seed,
                                     limits.vocab_size, limits.hidden_states_width, engine_threads), daemon=True)
    try:
        engine.start()
        while True:  # answer the engine's questions until it reports
            if not here.poll(600):
                raise RuntimeError("the engine process stopped answering")
            what, ids = here.recv()  # (EOFError when the engine process died without a word)
            if what == "done":
                result = ids
                break
            if what == "failed":
                raise RuntimeError(f"the engine process failed:\n{ids}")
            hits = {}
            for sid in ids:  # (read from this thread while the step thread may run a pass: a snapshot is enough)
                st = proposer.table.get("mech", sid).predraft
                if st is None or st.branches is None:
                    break
                hits[sid] = next(iter(st.branches.outcomes))
            here.send((hits if len(hits) == len(ids) else None, bool(proposer.predraft._waiting)))
        engine.join(60)
    finally:
        if engine.is_alive():
            engine.kill()
        asyncio.run_coroutine_threadsafe(server.stop(1.0), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
    # the proposer's steps: the prefill requests (8 sequences each), then iters + warmup per phase, one per request
    first = -(-B // 8)
    per_phase = iters + warmup
    c = proposer.predraft.counters
    result.update(
        server_step_plain=_median_ms(step_s[first + warmup: first + per_phase]),
        server_step_predraft=_median_ms(step_s[first + per_phase + warmup: first + 2 * per_phase]),
        server_passes=c.passes, server_passes_stopped=c.passes_stopped, server_passes_skipped=c.passes_skipped,
        server_pass_ms=c.pass_seconds / max(1, c.passes + c.passes_stopped) * 1e3,
        # every pass in order: [sequences, ms, finished, probe] (the first ones may compile kernels)
        server_pass_log=[[n, round(s * 1e3, 3), done, probe] for n, s, done, probe in proposer.predraft.recent_passes])
    return result


def engine_process(conn, address: str, B: int, context: int, k: int, budget: int, iters: int, warmup: int,
                   verify_ms: float, seed: int, vocab: int, width: int, threads: int | None = None) -> None:
    """The engine of run_sidecar, in a process of its own: B sequences through a step channel, first with
    pre-drafting off, then on; each step takes a prepared outcome for every sequence when all of them have one (a
    hit; conn tells which), else an unprepared one (a miss, or "busy" when the pass still ran). Sends ("done",
    medians) on conn."""
    import asyncio

    from drafter_client import DrafterClient, SequenceStep

    if threads:
        torch.set_num_threads(threads)  # (the engine process's torch threads: its copies into the mailbox use them)

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    ids = [f"s{b}" for b in range(B)]
    tokens = {sid: torch.randint(0, vocab, (context + 1,), generator=g).tolist() for sid in ids}
    pool = torch.randn(4096, width, generator=g).to(torch.bfloat16)  # states are sliced from it (no randn per step)

    async def main() -> dict:
        async with DrafterClient(address, namespace="mech", step_timeout_s=None) as client:
            assert await client.open_step_channel(request_bytes=64 * 2**20)
            state = {}
            for c in range(0, B, 8):
                res = await client.propose([SequenceStep(sid, 0, tokens[sid][:context], pool[:context],
                                                         tokens[sid][context], k, predraft_branches=budget)
                                            for sid in ids[c : c + 8]])
                for sid, r in zip(ids[c : c + 8], res.sequences):
                    assert r.ok, r.message
                    state[sid] = (context, r.drafts.tolist())
            # (a prefill of 8 long sequences may exceed the channel's mailbox and go by gRPC: not counted)
            through_channel = client.steps_through_channel

            def make(outcomes, f):
                steps = []
                for sid in ids:
                    C, drafts = state[sid]
                    a, b = outcomes[sid]
                    tokens[sid] = tokens[sid][: C + 1] + drafts[:a] + [b]
                    steps.append(SequenceStep(sid, C, tokens[sid][C : C + a + 1], pool[: a + 1], b, k,
                                              predraft_branches=f))
                return steps

            def unprepared():
                out = {}
                for sid in ids:
                    drafts = state[sid][1]
                    a = rng.randint(0, k - 1)
                    out[sid] = (a, next(t for t in range(vocab) if t != drafts[a]))
                return out

            waits = {"plain": [], "predraft": []}
            kinds = {"hit": [], "miss": [], "busy": []}
            for phase, f in (("plain", 0), ("predraft", budget)):
                for i in range(iters + warmup):
                    await asyncio.sleep(verify_ms / 1e3)
                    conn.send(("peek", ids))
                    hits, busy = conn.recv()
                    kind = "hit" if hits is not None else "busy" if busy else "miss"
                    steps = make(hits if kind == "hit" else unprepared(), f)
                    t0 = time.perf_counter()
                    res = await client.propose(steps)
                    dt = time.perf_counter() - t0
                    for sid, st, r in zip(ids, steps, res.sequences):
                        assert r.ok, r.message
                        state[sid] = (st.start_position + len(st.token_ids), r.drafts.tolist())
                    assert all(r.predrafted for r in res.sequences) == (kind == "hit")
                    if i >= warmup:
                        waits[phase].append(dt)
                        if f:
                            kinds[kind].append(dt)
            assert client.steps_through_channel - through_channel == 2 * (iters + warmup), "a step missed the channel"
            await client.release(ids)
            return {"sidecar_plain": _median_ms(waits["plain"]), "sidecar_predraft": _median_ms(waits["predraft"]),
                    "sidecar_predraft_p99": sorted(waits["predraft"])[int(0.99 * len(waits["predraft"]))] * 1e3,
                    "sidecar_plain_p99": sorted(waits["plain"])[int(0.99 * len(waits["plain"]))] * 1e3,
                    **{f"sidecar_{kind}": _median_ms(v) for kind, v in kinds.items()},
                    **{f"sidecar_{kind}_steps": len(v) for kind, v in kinds.items()}}

    try:
        conn.send(("done", asyncio.run(main())))
    except BaseException:  # the benchmark's process raises it (instead of waiting for an answer that never comes)
        import traceback

        conn.send(("failed", traceback.format_exc()))
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--budget", type=int, default=8, help="pre-drafting budget F per sequence")
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=20, help="steps before the timed ones in each sidecar phase")
    ap.add_argument("--verify-ms", type=float, default=12.0,
                    help="the engine's verification time to compare the pass with (e.g. an 8B target at batch 1)")
    ap.add_argument("--sidecar", action=argparse.BooleanOptionalAction, default=True,
                    help="also the engine's wait through a step channel (the drafter in a thread of this process)")
    ap.add_argument("--engine-threads", type=int, default=None,
                    help="torch threads of the engine process (default: torch's, one per core)")
    ap.add_argument("--out", default="bench_out/predraft_mechanics.json")
    a = ap.parse_args(argv)
    shape = PRESETS[a.preset]
    context = a.context or shape["context"]
    batches = [int(b) for b in a.batches.split(",")]
    device = torch.device(a.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    max_len = context + (16 * (a.iters + 2) + 2 * a.warmup) * (a.k + 1) + 64
    from drafter_service.config import ServerConfig
    from drafter_service.runtime import build_runtime

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        print(f"writing a random {a.preset} head ...", flush=True)
        head, target = write_random_head(pathlib.Path(tmp), shape, max_len)
        rt = build_runtime(ServerConfig(model=str(head), target_model=str(target), device=a.device, dtype=dtype,
                                        kv_cache_tokens=(max(batches) * 2 + 8) * max_len, max_model_len=max_len,
                                        max_batch_seqs=max(256, max(batches)), max_draft_tokens=max(8, a.k),
                                        predraft_min_all_hit=0.0))
        cfg = ServerConfig(model=str(head), target_model=str(target), device=a.device, dtype=dtype,
                           kv_cache_tokens=(max(batches) * 2 + 8) * max_len, max_model_len=max_len,
                           max_batch_seqs=max(256, max(batches)), max_draft_tokens=max(8, a.k),
                           listen=[f"unix:{tmp}/drafter.sock"], log_level="WARNING",
                           # (the mechanics of passes and hits, not the policy: no turns without passes mid-phase,
                           # and no batch refused on the prior hit rate, which outcomes picked to hit would not bear out)
                           predraft_cycle_check=False, predraft_min_all_hit=0.0)
        print(f"in-process: {'batch':>5} {'plain ms':>9} {'pass ms':>8} {'hit ms':>7} {'miss ms':>8} "
              f"{'pass/verify':>11}")
        for B in batches:
            r = run_batch(rt, B, context, a.k, a.budget, a.iters, seed=B)
            r = {"batch": B, **r, "pass_over_verify": r["pass"] / a.verify_ms}
            rows.append(r)
            print(f"{'':12}{B:>5} {r['plain']:>9.2f} {r['pass']:>8.2f} {r['hit']:>7.3f} {r['miss']:>8.2f} "
                  f"{r['pass_over_verify']:>11.2f}", flush=True)
        del rt
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if a.sidecar:
            print(f"engine's wait through a step channel (verification {a.verify_ms} ms), median ms: batch, "
                  "pre-drafting off, on (hit / miss / busy: steps of each kind and their median)")
            for r in rows:
                r.update(run_sidecar(cfg, r["batch"], context, a.k, a.budget, a.iters, a.verify_ms, seed=r["batch"],
                                     warmup=a.warmup, engine_threads=a.engine_threads))
                fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
                print(f"{'':12}{r['batch']:>5} off {fmt(r['sidecar_plain'])} on {fmt(r['sidecar_predraft'])} "
                      f"(hit {r['sidecar_hit_steps']} x {fmt(r['sidecar_hit'])}, miss {r['sidecar_miss_steps']} x "
                      f"{fmt(r['sidecar_miss'])}, busy {r['sidecar_busy_steps']} x {fmt(r['sidecar_busy'])}); passes "
                      f"{r['server_passes']} done, {r['server_passes_stopped']} stopped, {r['server_passes_skipped']} "
                      f"skipped, {r['server_pass_ms']:.2f} ms each; the proposer's step off / on "
                      f"{fmt(r['server_step_plain'])} / "
                      f"{fmt(r['server_step_predraft'])}", flush=True)
                print(f"{'':18}passes (ms; s: stopped, p: probe): " + " ".join(
                    f"{ms:.1f}{'' if done else 's'}{'p' if probe else ''}" for _, ms, done, probe in r["server_pass_log"]),
                      flush=True)
    out = {"benchmark": "predraft_mechanics",
           "command": shlex.join(["python", "-m", "drafter_client.benchmarks.predraft_mechanics",
                                  *(sys.argv[1:] if argv is None else argv)]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"platform": platform.platform(), "python": platform.python_version(),
                       "torch": torch.__version__, "device": str(device),
                       "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None},
           "preset": a.preset, "context": context, "k": a.k, "budget": a.budget, "iters": a.iters, "warmup": a.warmup,
           "verify_ms": a.verify_ms, "engine_threads": a.engine_threads, "rows": rows}
    write_json(a.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
