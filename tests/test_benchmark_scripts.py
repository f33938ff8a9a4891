"""The benchmark scripts run end to end (tiny head, CPU, a few steps) and write the JSON their docs describe.

Numbers are never checked (the machine's speed is not a test); what is checked is that each script still runs,
measures every path it names, and reports in the shape docs/performance.md and docs/predraft.md read.
"""
import importlib.util
import json
import pathlib
import statistics
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def run(args: list[str], out: pathlib.Path) -> dict:
    done = subprocess.run([sys.executable, *args, "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def refused_without_a_gpu(script: str) -> None:
    """A CUDA-only script run here without a GPU: it says it needs one and fails (skips where a GPU is here: the
    script's GPU test runs it)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip(f"a GPU is here: {script}'s GPU test runs it")
    done = subprocess.run([sys.executable, script, "--preset", "tiny"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "needs a GPU" in done.stderr, done.stderr[-2000:]


def test_predraft_mechanics_runs_the_engine_in_a_process_of_its_own(tmp_path):
    iters = 3
    result = run(["-m", "drafter_client.benchmarks.predraft_mechanics", "--preset", "tiny", "--device", "cpu",
                  "--batches", "1,2", "--iters", str(iters), "--warmup", "2", "--verify-ms", "5"],
                 tmp_path / "pm.json")
    assert result["benchmark"] == "predraft_mechanics" and result["warmup"] == 2 and result["date"]
    assert [r["batch"] for r in result["rows"]] == [1, 2]
    for r in result["rows"]:
        for key in ("plain", "pass", "hit", "miss", "sidecar_plain", "sidecar_predraft", "server_step_plain",
                    "server_step_predraft", "server_pass_ms"):
            assert r[key] > 0, (key, r)
        # every timed step of the pre-drafting phase is a hit, a miss or "busy", as the engine process saw it
        assert r["sidecar_hit_steps"] + r["sidecar_miss_steps"] + r["sidecar_busy_steps"] == iters
        assert r["server_passes"] + r["server_passes_stopped"] + r["server_passes_skipped"] > 0
        # the pass log holds every pass that ran: [sequences, ms, finished, probe]
        assert len(r["server_pass_log"]) == r["server_passes"] + r["server_passes_stopped"]
        assert all(n == r["batch"] and ms > 0 for n, ms, _, _ in r["server_pass_log"])


def test_bench_step_fails_at_once_when_the_drafter_cannot_start(tmp_path):
    """A drafter that exits at start (here: its --metrics-port already taken, as when two runs share a machine) ends
    the run with its exit code within seconds, instead of the client waiting 600 s for a health SERVING that never
    comes (a CI run once waited out its 300 s that way); and the default port is a free one, so two runs side by
    side do not collide."""
    import socket
    import time

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "drafter_client.benchmarks.bench_step", "--preset", "tiny",
                               "--device", "cpu", "--batches", "1", "--iters", "1", "--prefill-tokens", "0",
                               "--threads", "1", "--rounds", "1", "--rounds-only", "--metrics-port", str(port),
                               "--out", str(tmp_path / "bs.json")], cwd=REPO, capture_output=True, text=True,
                              timeout=300)
    assert done.returncode != 0 and time.monotonic() - t0 < 120, done.stderr[-2000:]
    assert "exited with code" in done.stderr and "Address already in use" in done.stderr, done.stderr[-2000:]


def test_bench_step_measures_every_path(tmp_path):
    result = run(["-m", "drafter_client.benchmarks.bench_step", "--preset", "tiny", "--device", "cpu",
                  "--batches", "1,32", "--iters", "2", "--prefill-tokens", "0", "--threads", "1", "--rounds", "2"],
                 tmp_path / "bs.json")
    assert result["benchmark"] == "bench_step" and result["cpu_threads"] == 1 and result["rounds"] == 2
    assert result["complete"] is True
    for r in result["rows"]:
        for key in ("in_process_ms", "sidecar_ms", "sidecar_batch_api_ms", "sidecar_stream_ms", "sidecar_channel_ms",
                    "sidecar_channel_batch_api_ms", "floor_ms", "sidecar_worker_ms"):
            assert r[key] > 0, (key, r)
        # --rounds: each round's medians and ratios, in-process and through the channel alternated
        rounds = r["rounds"]
        for key in ("in_process_ms", "in_process_columns_ms", "channel_ms", "channel_batch_api_ms", "unary_batch_api_ms",
                    "channel_over_in_process", "channel_batch_api_over_in_process", "unary_batch_api_over_in_process",
                    "channel_batch_api_over_in_process_columns", "unary_batch_api_over_in_process_columns"):
            assert len(rounds[key]) == 2 and all(x > 0 for x in rounds[key]), (key, rounds)
        assert rounds["channel_over_in_process"][0] == pytest.approx(rounds["channel_ms"][0] / rounds["in_process_ms"][0])
        # the batch API (columns) like for like: against the in-process step from columns
        assert rounds["unary_batch_api_over_in_process_columns"][1] == pytest.approx(
            rounds["unary_batch_api_ms"][1] / rounds["in_process_columns_ms"][1])
        assert min(rounds["channel_over_in_process"]) <= r["rounds_median"]["channel_over_in_process"] <= max(
            rounds["channel_over_in_process"])


def test_bench_step_rounds_only_with_the_grpc_floor(tmp_path):
    """--rounds-only: the in-process step, its floor and the rounds, no single pass through the sidecar; the JSON says
    the run finished (a run stopped by its time limit leaves complete: false and the rows measured so far).
    --grpc-floor: each round also sends the unary batch API's bytes through a bare grpc.aio server; the floor is the
    in-process step plus that round trip. --engine-gap-ms: each step of every path after the engine's own work
    (test_the_engine_gap_is_a_spin_of_at_least_its_length)."""
    result = run(["-m", "drafter_client.benchmarks.bench_step", "--preset", "tiny", "--device", "cpu",
                  "--batches", "1,32", "--iters", "2", "--prefill-tokens", "0", "--threads", "1", "--rounds", "2",
                  "--rounds-only", "--grpc-floor", "--engine-gap-ms", "1"], tmp_path / "bs.json")
    assert result["complete"] is True and result["rounds_only"] is True and result["engine_gap_ms"] == 1
    for r in result["rows"]:
        assert r["in_process_ms"] > 0 and r["floor_ms"] > 0 and r["in_process_over_floor"] > 0
        assert "sidecar_ms" not in r and "sidecar_channel_ms" not in r
        rounds = r["rounds"]
        assert len(rounds["channel_over_in_process"]) == 2 and r["rounds_median"]["unary_batch_api_over_in_process"] > 0
        assert len(rounds["bare_grpc_ms"]) == 2 and all(t > 0 for t in rounds["bare_grpc_ms"]), rounds
        for t_in, t_bare, floor in zip(rounds["in_process_columns_ms"], rounds["bare_grpc_ms"],
                                       rounds["unary_floor_over_in_process_columns"]):
            assert floor == pytest.approx((t_in + t_bare) / t_in)
        assert r["rounds_median"]["unary_floor_over_in_process_columns"] > 1
        # the drafter's own step, round by round from its /metrics (the bench asserts one batch per step), over the
        # in-process step's mean
        for key in ("drafter_step_ms", "drafter_step_batch_api_ms", "in_process_mean_ms", "in_process_columns_mean_ms"):
            assert len(rounds[key]) == 2 and all(t > 0 for t in rounds[key]), (key, rounds)
        for t, t_in, ratio in zip(rounds["drafter_step_batch_api_ms"], rounds["in_process_columns_mean_ms"],
                                  rounds["drafter_step_batch_api_over_in_process_columns"]):
            assert ratio == pytest.approx(t / t_in)


@pytest.mark.parametrize("args,why", [
    (["--rounds-only"], "--rounds-only needs --rounds"),
    (["--grpc-floor", "--batches", "1"], "--grpc-floor needs --rounds"),
    (["--grpc-floor", "--rounds", "1", "--upload-streams", "2"], "one upload stream"),
    (["--preset", "tiny", "--engine-applies-fc"], "--engine-applies-fc is for EAGLE-3 presets"),
    (["--engine-gap-ms", "5"], "--engine-gap-ms needs --rounds"),
    (["--rounds", "1", "--engine-gap-ms", "-1"], "--engine-gap-ms must be >= 0")])
def test_bench_step_refuses_arguments_that_do_not_go_together(args, why, capsys):
    from drafter_client.benchmarks import bench_step

    with pytest.raises(SystemExit) as stopped:
        bench_step.main(["--device", "cpu", "--out", "unused.json", *args])
    assert stopped.value.code == 2 and why in capsys.readouterr().err


def test_the_engine_gap_is_a_spin_of_at_least_its_length():
    """bench_step.engine_work (bench_step and rpc_timeline --engine-gap-ms): it returns no sooner than its length."""
    import time

    from drafter_client.benchmarks.bench_step import engine_work

    for ms in (0.0, 2.0, 5.0):
        t0 = time.perf_counter()
        engine_work(ms)
        assert time.perf_counter() - t0 >= ms / 1e3


async def test_the_bare_server_takes_the_unary_steps_messages_in_each_form(server, tmp_path):
    """bare_grpc: the messages unary_step_bytes builds are those the client sends (one Propose message, or
    ProposeChunked's header and chunks: the drafter answers them), and the bare server takes either form and
    answers with the reply's size."""
    import grpc
    import torch

    from drafter_client import DrafterClient
    from drafter_client.batch import StepBatch
    from drafter_client.benchmarks.bare_grpc import BareClient, BareServer
    from drafter_client.benchmarks.bench_step import unary_step_bytes
    from drafter_client.protocol import pb

    g = torch.Generator().manual_seed(3)
    rows = [600, 25]  # (625 x 64 fp32 states: 160 KB, above DIRECT_STATES_MIN_BYTES, where chunking applies)
    batch = StepBatch(sequence_ids=["bare-a", "bare-b"], start_positions=torch.tensor([0, 0]),
                      num_tokens=torch.tensor(rows), token_ids=torch.randint(0, 512, (sum(rows),), generator=g),
                      hidden_states=torch.randn(sum(rows), 64, generator=g), next_tokens=torch.tensor([5, 6]),
                      num_drafts=3)
    with BareServer(f"unix:{tmp_path / 'bare.sock'}") as bare:
        async with grpc.aio.insecure_channel(bare.address) as ch:
            for chunk_min_bytes, chunked in ((None, False), (0, True)):
                async with DrafterClient(server.uds, namespace="bare", chunk_min_bytes=chunk_min_bytes,
                                         chunk_bytes=4099) as c:
                    messages, is_chunked, reply = await unary_step_bytes(c, server.uds, batch)
                    assert is_chunked is chunked
                    assert len(messages) == (1 + -(-sum(rows) * 64 * 4 // 4099) if chunked else 1)
                    answer = pb.ProposeResponse.FromString(reply)
                    assert [r.num_drafts for r in answer.results] == [3, 3], answer
                    assert await BareClient(ch).round_trip(messages, chunked, len(reply)) > 0
                    assert await BareClient(ch).round_trip(messages, chunked, 0) > 0


def test_bench_step_with_the_engine_applying_fc(tmp_path):
    """--engine-applies-fc (EAGLE-3 presets): in-process and sidecar run with the flag, the steps carry H columns,
    the engine's fc is timed apart, the floor has no fc and H columns."""
    args = ["-m", "drafter_client.benchmarks.bench_step", "--device", "cpu", "--batches", "1,8", "--iters", "2",
            "--prefill-tokens", "0", "--threads", "1", "--rounds", "1", "--rounds-only"]
    fc = run([*args, "--preset", "tiny-eagle3", "--engine-applies-fc"], tmp_path / "fc.json")
    assert fc["complete"] is True and fc["engine_applies_fc"] is True and "--engine-applies-fc" in fc["drafter_flags"]
    from drafter_client.benchmarks.bench_step import PRESETS, floor_bytes

    for r in fc["rows"]:
        assert r["engine_fc_ms"] > 0 and r["rounds_median"]["unary_batch_api_over_in_process"] > 0
        shape = PRESETS["tiny-eagle3"]
        H = shape["hidden_size"]
        raw = floor_bytes(shape, 4, r["batch"], fc["context"], 3, 5)
        assert r["floor_bytes"] == raw - H * 3 * H * 4 - r["batch"] * 3 * 2 * H * 4  # (no fc; H columns, not 3H)
    # (an EAGLE-1 preset refuses the flag: test_bench_step_refuses_arguments_that_do_not_go_together)


def test_bench_request_codec_reads_requests_as_the_server_does(tmp_path):
    result = run(["benchmarks/bench_request_codec.py", "--batches", "1,32", "--rounds", "1", "--reps", "2",
                  "--width", "64", "--scattered-states", "--context", "16"], tmp_path / "codec.json")
    assert result["malloc_tuned"] in (True, False) and result["scattered_states"] is True
    assert {(r["batch"], r["form"]) for r in result["rows"]} == {
        (b, f) for b in (1, 32) for f in ("message", "rows", "batch-rows", "batch-cols", "steps-cols")}
    assert all(r["server parse"] > 0 and r["client pack"] > 0 for r in result["rows"])


def test_bench_frame_prototype_times_the_frame_beside_protobuf(tmp_path):
    result = run(["benchmarks/bench_frame_prototype.py", "--batches", "1,16", "--rounds", "1", "--reps", "2",
                  "--width", "64"], tmp_path / "frame.json")
    assert {(r["batch"], r["form"]) for r in result["rows"]} == {
        (b, f) for b in (1, 16) for f in ("rows", "batch-rows", "batch-cols", "frame")}
    assert all(r["server parse"] > 0 and r["client parse"] > 0 for r in result["rows"])


def test_the_frame_prototype_reads_back_what_it_wrote_and_refuses_bad_columns():
    """The prototype's frames round-trip (so that what it times is a working codec), and its checks refuse what
    parse_propose refuses on columns."""
    import numpy as np
    import pytest
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_frame_prototype as fp
    from drafter_service.transport.validation import Limits

    limits = Limits(hidden_states_width=8, vocab_size=100, max_draft_tokens=5, max_request_tokens=1 << 20,
                    max_request_seqs=64)
    ids = "\0".join(["a", "bb", "c"]).encode()
    columns = np.array([[0, 4, 9], [2, 1, 3], [7, 8, 9], [5, 0, 2]], dtype=np.int64)
    tokens = np.arange(6, dtype=np.int64)
    states = torch.randn(6, 8).to(torch.bfloat16)
    buf = bytearray(fp.frame_size(3, 6, 8, ids, b"ns"))
    size = fp.write_request(buf, b"ns", ids, 3, columns, tokens, states, 7)
    got = fp.read_request(buf, size, limits)
    assert got["namespace"] == "ns" and got["sequence_ids"] == ["a", "bb", "c"]
    assert got["num_tokens"].tolist() == [2, 1, 3] and got["token_ids"].tolist() == list(range(6))
    assert torch.equal(got["hidden_states"], states)
    for row, col, bad in ((0, 1, -1), (1, 0, 0), (2, 2, 100), (3, 1, 6)):
        broken = columns.copy()
        broken[row, col] = bad
        fp.write_request(buf, b"ns", ids, 3, broken, tokens, states, 7)
        with pytest.raises(ValueError):
            fp.read_request(buf, size, limits)
    reply = bytearray(fp.REPLY_HEADER.itemsize + 8 * (12 + 7))
    fp.write_reply(reply, np.array([[0, 5, 0], [5, 0, 2], [1, 0, 2], [9, 5, 12]]), np.arange(7), 7)
    drafts = fp.read_reply(reply, ["a", "bb", "c"])
    assert drafts.codes.tolist() == [0, 5, 0] and drafts.num_drafts.tolist() == [5, 0, 2]
    assert drafts.draft_token_ids.tolist() == list(range(7)) and drafts.request_id == 7


def test_host_phases_splits_the_step(tmp_path):
    result = run(["scripts/host_phases.py", "--preset", "tiny", "--device", "cpu", "--batches", "1,8", "--iters", "3"],
                 tmp_path / "phases.json")
    for r in result["rows"]:  # (medians per phase: they need not add up to the step's median, and are not timed here)
        assert all(r[k] > 0 for k in ("step_ms", "admission_ms", "run_ms", "after_ms", "metadata_ms")), r


def test_bench_channel_write_writes_both_ways(tmp_path):
    result = run(["benchmarks/bench_channel_write.py", "--shapes", "1024x32", "--rounds", "1", "--reps", "2"],
                 tmp_path / "cw.json")
    assert [(r["width"], r["batch"]) for r in result["rows"]] == [(1024, 32)]
    assert result["rows"][0]["direct_ms"] > 0 and result["rows"][0]["via-buffer_ms"] > 0


@pytest.mark.parametrize("scattered", [False, True])
def test_bench_parallel_copy_times_both_ways(tmp_path, scattered):
    result = run(["benchmarks/bench_parallel_copy.py", "--shapes", "256x8,4096x400", "--rounds", "1", "--reps", "2",
                  *(["--scattered"] if scattered else [])], tmp_path / "pc.json")
    assert [(r["width"], r["batch"], r["split"]) for r in result["rows"]] == [(256, 8, False), (4096, 400, True)]
    assert all(r["one thread_ms"] > 0 and r["split_ms"] > 0 for r in result["rows"]) and result["scattered"] == scattered


def test_bench_cold_host_work_times_every_piece_in_every_condition(tmp_path):
    result = run(["benchmarks/bench_cold_host_work.py", "--batches", "1,8", "--width", "64", "--calls", "2",
                  "--rounds", "1", "--idle-ms", "0.5,2"], tmp_path / "cold.json")
    assert [(r["batch"], r["piece"]) for r in result["rows"]] == [
        (b, p) for b in (1, 8) for p in ("client pack", "drafter parse", "drafter reply", "client parse")]
    conditions = ["warm", "spin", "32MB read", "rehearsed", "loop 0.5 ms", "sleep 0.5 ms", "loop 2 ms", "sleep 2 ms"]
    assert result["conditions"] == conditions
    assert all(r[f"{c}_us"] > 0 for r in result["rows"] for c in conditions)


def test_bench_predraft_fallback_compares_both_sets(tmp_path):
    """The drafter's step with pre-drafting asked but refused by the odds check against plain, in-process."""
    result = run(["benchmarks/bench_predraft_fallback.py", "--device", "cpu", "--batches", "1,8", "--steps", "6"],
                 tmp_path / "fb.json")
    assert [r["batch"] for r in result["rows"]] == [1, 8] and result["min_all_hit"] == 0.25
    for r in result["rows"]:
        assert r["step_ms_off_p50"] > 0 and r["step_ms_on_p50"] > 0 and r["on_over_off"] > 0
    assert result["rows"][1]["refused_by_odds"] > 0  # (random outcomes: batch 8 is refused)


def test_profile_channel_splits_a_channel_step():
    done = subprocess.run([sys.executable, "scripts/profile_channel.py", "--preset", "tiny", "--device", "cpu",
                           "--batches", "2", "--iters", "3", "--metrics-port", "9491"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [x for x in done.stdout.splitlines() if x.startswith("batch")]
    assert len(lines) == 2 and all("client pack" in x and "hand-offs" in x for x in lines), done.stdout


def test_plot_predraft_draws_runs_against_f0(tmp_path):
    import pytest
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (the plot is skipped, not the benchmark)")

    def row(batch, budget, tok, wait):
        return {"batch": batch, "budget": budget, "tokens_per_s": tok, "wait_ms_p50": wait}

    result = {"date": "2026-11-26T00:00:00", "drafter": {"method": "eagle3"},
              "rows": [row(1, 0, 100, 2.0), row(1, 8, 110, 1.0), row(1, 0, 90, 2.0), row(4, 0, 300, 3.0),
                       row(4, 8, 290, 3.3), {"batch": 4, "budget": None, "tokens_per_s": 250}]}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(result))
    from drafter_client.benchmarks.plot_predraft import main, relative
    rel = relative(result)
    assert rel[(1, 8)] == (110 / 95, 0.5) and rel[(4, 8)][0] == 290 / 300 and rel[(1, "spread")] == (90 / 95, 100 / 95)
    assert main([f"a={path}", str(path), "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_bench_step_host_ops_times_every_piece_and_says_which_path_ran(tmp_path):
    result = run(["benchmarks/bench_step_host_ops.py", "--device", "cpu", "--batches", "1,8,32", "--width", "64",
                  "--rounds", "1", "--iters", "2"], tmp_path / "ho.json")
    variants = {(r["batch"], r["variant"]) for r in result["rows"]}
    for b in (1, 8, 32):
        assert {(b, v) for v in ("metadata, step buffers", "metadata, new buffers", "record + states in",
                                 "steps, run stubbed (per-sequence)")} <= variants
    # step_batch: a step of fewer than STEP_BATCH_MIN_SEQUENCES sequences (and few rows) goes the per-sequence way
    assert (1, "columns step, run stubbed (per-sequence)") in variants
    assert {(8, "columns step, run stubbed (columns)"), (32, "columns step, run stubbed (columns)")} <= variants
    assert all(r["host_us"] > 0 for r in result["rows"])


def test_spin_gil_handoff_times_every_case(tmp_path):
    result = run(["scripts/spin_gil_handoff.py", "--rounds", "1", "--calls", "3"], tmp_path / "spin.json")
    assert result["benchmark"] == "spin_gil_handoff" and result["spin_handoff_every"] >= 1
    assert len(result["rows"]) == 4 and all(r["median_ms"] > 0 for r in result["rows"])


def test_bench_merged_engines_runs_every_engine_count_and_window(tmp_path):
    result = run(["benchmarks/bench_merged_engines.py", "--preset", "tiny", "--device", "cpu", "--batch", "8",
                  "--engines", "1,2", "--iters", "3", "--merge-windows", "0,300", "--jitter-ms", "1"],
                 tmp_path / "merged.json")
    assert result["benchmark"] == "merged_engines" and result["date"] and result["in_process_ms"] > 0
    assert [(r["merge_window_us"], r["engines"], r["sequences_per_engine"]) for r in result["rows"]] == [
        (0, 1, 8), (0, 2, 4), (300, 1, 8), (300, 2, 4)]
    for r in result["rows"]:
        assert r["engine_ms"] > 0 and r["worker_ms"] > 0
        assert (r["send_spread_ms"] == 0) == (r["engines"] == 1) and r["send_spread_ms"] <= r["send_spread_ms_p90"]
        assert (r["doorbell_spread_ms"] == 0) == (r["engines"] == 1)
        assert r["doorbell_spread_ms"] <= r["doorbell_spread_ms_p90"] and r["late_per_step"] >= 0
        # the drafter's batches over the timed steps held one engine's sequences at least, all of them at most
        assert r["sequences_per_engine"] <= r["seqs_per_batch"] <= 8
        if r["engines"] == 1 or r["merge_window_us"] == 0:  # one engine has no partner; a window of 0 never waits
            assert r["seqs_per_batch"] == 8 or r["engines"] > 1
            assert r["waits_per_step"] == 0 and r["waits_complete"] is None


@pytest.mark.gpu
def test_bench_record_write_times_every_piece(tmp_path):
    result = run(["benchmarks/bench_record_write.py", "--batches", "1,8", "--iters", "20"], tmp_path / "record.json")
    assert result["benchmark"] == "record_write_pieces" and result["device"].startswith("cuda")
    assert [r["batch"] for r in result["rows"]] == [1, 8]
    for r in result["rows"]:
        assert all(r[key] > 0 for key in ("write", "numpy part", "copy, sliced", "copy, kept views", "event record"))


def test_rpc_timeline_splits_batch_steps_by_path(tmp_path):
    """--batch: the batch API by unary calls of two kinds of client taking turns, on a ProposeStream session and
    through a step channel, each with the server's phases lined up with the client's (a few steps each)."""
    got = run(["scripts/rpc_timeline.py", "--preset", "tiny", "--device", "cpu", "--batch", "4", "--iters", "14",
               "--rounds", "2", "--upload-streams", "1,2", "--engine-gap-ms", "0,2"], tmp_path / "timeline.json")
    assert got["batch"] == 4 and got["upload_streams"] == "1,2" and got["rounds"] == 2
    assert got["engine_gap_ms"] == [0, 2]
    modes = got["modes"]
    assert set(modes) == {"batch-unary-s1", "batch-unary-s2", "batch-stream", "batch-channel", "batch-channel-gap2ms"}
    assert {"noticed", "worker", "reply", "total"} <= set(modes["batch-channel-gap2ms"])
    for mode in ("batch-unary-s1", "batch-unary-s2"):  # (the client's own marks: a step this small is one message)
        assert {"client packing", "to handler", "parse", "worker", "reply to the client", "client parsing",
                "total"} <= set(modes[mode]), modes[mode]
    assert {"to handler", "parse", "worker", "to client", "total"} <= set(modes["batch-stream"])
    assert {"noticed", "worker", "reply", "total"} <= set(modes["batch-channel"])
    assert all(v >= 0 for m in modes.values() for v in m.values())


@pytest.mark.parametrize("args", [["--engine-gap-ms", "5"], ["--batch", "4", "--engine-gap-ms", "0,-1"],
                                  ["--batch", "4", "--engine-gap-ms", "5,5"]])
def test_rpc_timeline_refuses_engine_gaps_it_cannot_run(args):
    done = subprocess.run([sys.executable, "scripts/rpc_timeline.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "--engine-gap-ms" in done.stderr


def test_bench_grpc_options_times_every_option_set(tmp_path):
    result = run(["benchmarks/bench_grpc_options.py", "--mib", "0.5", "--rounds", "1", "--reps", "2",
                  "--sets", "base,frame4M"], tmp_path / "options.json")
    assert set(result["echo_ms"]) == set(result["upload_ms"]) == {"base", "frame4M"}
    assert all(len(v) == 1 and v[0] > 0 for v in [*result["echo_ms"].values(), *result["upload_ms"].values()])
    assert result["options"]["frame4M"] == [["grpc.http2.max_frame_size", 4 << 20]]


def _targets(args: list[str], tmp_path, as_script: bool = False) -> dict:
    """batch_scale_targets.py's JSON for these arguments: its main() called in this process (a script that reads JSON
    only; the subprocess's imports cost seconds a call), or run as the script (as_script)."""
    out = tmp_path / "targets.json"
    if as_script:
        return run(["scripts/batch_scale_targets.py", *args], out)
    spec = importlib.util.spec_from_file_location("batch_scale_targets", REPO / "scripts" / "batch_scale_targets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([*args, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_batch_scale_targets_reads_the_benchmarks_json_and_says_where_each_target_is_met(tmp_path):
    """scripts/batch_scale_targets.py: issue #13's table from bench_step / profile_step JSON (synthetic figures in
    the scripts' shapes here; the committed runs below): each target met, not met, or met at some batch sizes."""
    rounds = lambda chan, cols, unary, floor: dict(  # noqa: E731  (bench_step's rounds_median)
        channel_over_in_process=chan, channel_batch_api_over_in_process_columns=cols,
        unary_batch_api_over_in_process_columns=unary, unary_floor_over_in_process_columns=floor)
    bench = dict(command="bench_step ...", device="cuda: X", date="2026-11-27T00:00:00", rows=[
        dict(batch=1, floor_ms=1.0, in_process_over_floor=1.3, in_process_columns_states_on_gpu_ms=1.2,
             rounds_median=rounds(1.05, 1.08, 2.0, 1.4)),
        dict(batch=128, floor_ms=2.0, in_process_over_floor=1.9, in_process_columns_states_on_gpu_ms=2.8,
             rounds_median=rounds(1.12, 1.09, 2.4, 1.8))])
    profile = dict(command="profile_step ...", device="cuda: X", date="2026-11-27T00:00:00", rows=[
        dict(batch=b, median=dict(wall_over_kernel=r, idle_ms=0.2)) for b, r in ((1, 1.2), (128, 1.1))])
    cpu = dict(command="bench_step --preset tiny", device="cpu: 2 cores", date="2026-11-27T00:00:00", rows=[
        dict(batch=1, in_process_ms=2.0, channel_worker_over_in_process=1.1, rounds=dict(in_process_ms=[2.0, 2.2]),
             rounds_median=dict(channel_over_in_process=1.2)),
        dict(batch=128, in_process_ms=20.0, channel_worker_over_in_process=1.3, rounds=dict(in_process_ms=[20.0, 22.0]),
             rounds_median=dict(channel_over_in_process=1.4))])
    files = {}
    for name, data in (("bench", bench), ("profile", profile), ("cpu", cpu)):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(data))
    result = _targets(["--bench", f"e1={files['bench']}", "--profile", f"e1={files['profile']}",
                       "--cpu-bench", str(files["cpu"])], tmp_path)
    met = {r["target"]: r["met"] for r in result["rows"]}
    assert met == {"in-process <= 1.15x its GPU kernel time": "at batch 128",  # 1.2 at batch 1
                   "in-process <= 1.5x the floor at batch 128": "yes",  # 2.8 / 2.0
                   "step channel <= 1.10x in-process": "at batch 1",  # the worse of the two APIs at 128: 1.12
                   "unary gRPC <= 1.5x in-process at batch 128": "no: below gRPC Python's floor",  # (the floor 1.8)
                   "CPU: in-process batch 128 <= 8x batch 1": "no",  # 10x
                   "CPU: the drafter's own step <= 1.2x the in-process step": "at batch 1",
                   "CPU: step channel <= 1.3x in-process at batch 1 and 128": "at batch 1"}
    floor = [r for r in result["rows"] if "floor at batch 128" in r["target"]]
    assert len(floor) == 1 and floor[0]["met"] == "yes" and floor[0]["values"] == {"128": 1.4}
    # a CPU run whose rounds read the drafter's own step (bench_step since the twenty-fourth session): those, like for
    # like, not the single pass's
    for row, x in zip(cpu["rows"], (1.3, 1.15)):
        row["rounds_median"]["drafter_step_batch_api_over_in_process_columns"] = x
    files["cpu"].write_text(json.dumps(cpu))
    worker = [r for r in _targets(["--cpu-bench", str(files["cpu"])], tmp_path)["rows"] if "own step" in r["target"]]
    assert worker[0]["values"] == {"1": 1.3, "128": 1.15} and worker[0]["met"] == "at batch 128", worker
    assert "the median of the rounds" in worker[0]["figures"]
    # a profile_step JSON from before its walls came first (no "wall_timed") is said to be biased; a newer one is not
    kernel = lambda res: [r for r in res["rows"] if "kernel time" in r["target"]][0]["figures"]  # noqa: E731
    assert "biased high" in kernel(result)
    files["profile"].write_text(json.dumps(dict(profile, wall_timed="before any profiler session")))
    assert "biased" not in kernel(_targets(["--profile", f"e1={files['profile']}"], tmp_path))
    # several runs of one head (separate processes): per batch, the median of the runs, their range beside it
    runs = []
    for i, (r1, r128) in enumerate(((1.2, 1.1), (1.1, 1.3), (1.14, 1.12))):
        runs.append(tmp_path / f"profile{i}.json")
        runs[-1].write_text(json.dumps(dict(profile, wall_timed="before any profiler session", rows=[
            dict(batch=b, median=dict(wall_over_kernel=r, idle_ms=0.2)) for b, r in ((1, r1), (128, r128))])))
    got = [r for r in _targets([x for path in runs for x in ("--profile", f"e1={path}")], tmp_path)["rows"]
           if "kernel time" in r["target"]][0]
    assert got["values"] == {"1": 1.14, "128": 1.12} and got["met"] == "yes" and got["processes"] == 3, got
    assert "each the median of 3 processes (their range: 1.10-1.20 / 1.10-1.30)" in got["figures"], got
    with pytest.raises(SystemExit):  # (bench_step: one run per head)
        _targets(["--bench", f"e1={files['bench']}", "--bench", f"e1={files['bench']}"], tmp_path)
    # drafter-demo --json runs: met in every run, in some, or not where the output differed from plain greedy
    demo = lambda speedup, same=True: dict(  # noqa: E731
        benchmark="drafter_demo", command="drafter-demo --json F", device="cpu: x86_64, 2 cores",
        date="2026-11-27T00:00:00", head="eagle3", speedup=speedup, identical_to_plain=same,
        rounds=[dict(speedup=speedup)] * 5)
    for runs, want in (([1.26, 1.3], "yes"), ([1.26, 1.17], "in 1 runs of 2"), ([1.1], "no")):
        paths = []
        for i, x in enumerate(runs):
            paths += ["--demo", str(tmp_path / f"demo{i}.json")]
            (tmp_path / f"demo{i}.json").write_text(json.dumps(demo(x)))
        row = _targets(paths, tmp_path)["rows"][0]
        assert row["met"] == want and row["values"] == {str(i + 1): x for i, x in enumerate(runs)}, row
        assert "each the median of 5 alternated rounds" in row["figures"], row
    (tmp_path / "demo0.json").write_text(json.dumps(demo(1.5, same=False)))
    assert _targets(["--demo", str(tmp_path / "demo0.json")], tmp_path)["rows"][0]["met"].startswith("no: the output")
    # the committed runs of the twentieth session read as they are
    bench_dir = REPO / "docs" / "bench"
    result = _targets(["--bench", f"eagle1={bench_dir / 'bench_step_b1-256_eagle1_h200_2026-11-27_twentieth.json'}",
                       "--cpu-bench", str(bench_dir / "bench_step_tiny_cpu_2026-11-27_twentieth.json")], tmp_path,
                      as_script=True)
    assert {r["target"] for r in result["rows"]} >= {"step channel <= 1.10x in-process",
                                                      "unary gRPC <= 1.5x in-process at batch 128"}
    assert all(r["met"] for r in result["rows"])


def test_bench_first_step_padding_distributions_and_its_gpu_requirement(tmp_path):
    """benchmarks/bench_first_step_padding.py: the m distributions its docstring names; without a GPU it says it
    needs one (it times CUDA graphs)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bfsp", REPO / "benchmarks" / "bench_first_step_padding.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    k = 5
    low = [mod.m_of("low", i, k) for i in range(64)]
    assert low.count(6) == 8 and low.count(1) == 56  # padded 64 x 6 = 384 rows for 104
    assert [mod.m_of("spread", i, k) for i in range(7)] == [1, 2, 3, 4, 5, 6, 1]
    assert {mod.m_of("uniform", i, k) for i in range(10)} == {3}
    import torch

    if not torch.cuda.is_available():  # (on a GPU the distributions above are this test; its GPU test runs the script)
        refused_without_a_gpu("benchmarks/bench_first_step_padding.py")


@pytest.mark.gpu
def test_bench_first_step_padding_times_every_way_on_a_gpu(tmp_path):
    from drafter_service.engine.cuda_graphs import packed_row_buckets, padded_batch_size

    result = run(["benchmarks/bench_first_step_padding.py", "--preset", "tiny", "--batches", "8,64", "--rounds", "1",
                  "--iters", "2", "--context", "128"], tmp_path / "fp.json")
    assert result["complete"] is True and result["first_step_small_rows"] == 768
    assert [(r["batch"], r["dist"]) for r in result["rows"]] == [
        (b, d) for b in (8, 64) for d in ("low", "spread", "uniform")]
    for r in result["rows"]:
        assert all(len(r["ms"][w]) == 1 and r["ms"][w][0] > 0 for w in ("rule", "graph", "packed", "eager")), r
        packed_rows = padded_batch_size(r["rows"], packed_row_buckets(2048))
        padded_fits = r["padded_rows"] <= max(2 * r["rows"], 768) and r["padded_rows"] <= 2 * packed_rows
        assert r["rule_path"] == ("graph" if padded_fits else "packed"), r


def test_bench_sampled_steps_settings_and_its_gpu_requirement():
    """benchmarks/bench_sampled_steps.py: the settings its docstring names (greedy first: the others' floor);
    without a GPU it says it needs one (it times CUDA graphs)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bss", REPO / "benchmarks" / "bench_sampled_steps.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.settings_of([8]) == [("greedy", 0.0, False, 0), ("T", 0.7, False, 0), ("T + log q", 0.7, True, 0),
                                    ("T + log q + top 8", 0.7, True, 8)]
    import torch

    if not torch.cuda.is_available():
        refused_without_a_gpu("benchmarks/bench_sampled_steps.py")


@pytest.mark.gpu
def test_bench_sampled_steps_times_both_ways_on_a_gpu(tmp_path):
    result = run(["benchmarks/bench_sampled_steps.py", "--preset", "tiny", "--batches", "1,33", "--rounds", "1",
                  "--iters", "2", "--context", "128", "--tops", "4,40"], tmp_path / "ss.json")
    assert result["complete"] is True
    assert [(r["batch"], r["setting"]) for r in result["rows"]] == [
        (b, s) for b in (1, 33) for s in ("greedy", "T", "T + log q", "T + log q + top 4", "T + log q + top 40")]
    for r in result["rows"]:  # (the script itself asserts which way each step ran)
        assert all(len(r["ms"][w]) == 1 and r["ms"][w][0] > 0 for w in ("graphs", "eager")), r


def test_bench_host_speed_times_both_loops_in_each_process(tmp_path):
    """benchmarks/bench_host_speed.py: per fresh process, each loop's rounds, median and fastest; the spread over the
    processes is the slowest median over the fastest."""
    result = run(["benchmarks/bench_host_speed.py", "--processes", "2", "--rounds", "3", "--iters", "200"],
                 tmp_path / "hs.json")
    assert result["benchmark"] == "host_speed" and [r["process"] for r in result["rows"]] == [1, 2]
    for kind in ("python", "numpy"):
        for r in result["rows"]:
            x = r[kind]
            assert len(x["rounds_us"]) == 3 and 0 < x["fastest_us"] <= x["median_us"], r
        medians = [r[kind]["median_us"] for r in result["rows"]]
        assert result["spread"][kind] == pytest.approx(max(medians) / min(medians))


def test_bench_graph_capture_needs_a_gpu():
    """benchmarks/bench_graph_capture.py captures CUDA graphs: without a GPU it says so and fails."""
    refused_without_a_gpu("benchmarks/bench_graph_capture.py")


@pytest.mark.gpu
def test_bench_graph_capture_with_and_without_chains_packed_and_sampled_graphs_on_a_gpu(tmp_path):
    result = run(["benchmarks/bench_graph_capture.py", "--preset", "tiny", "--max-batch-seqs", "16", "--rounds", "1"],
                 tmp_path / "gc.json")
    rows = {r["arm"]: r for r in result["rows"]}
    sizes = 5  # 1, 2, 4, 8, 16
    assert rows["chains"]["decode_graphs"] == rows["none"]["decode_graphs"] == sizes
    assert rows["chains"]["chains"] == 2 * sizes and rows["chains"]["chain_lengths"] == [4, 2]
    assert rows["none"]["chains"] == 0 and rows["none"]["chain_lengths"] == []
    assert all(r["capture_seconds"][0] > 0 and r["first_step_graphs"] == sizes * 8 for r in rows.values())
    # packed: sizes 1..16 with each of the 10 row buckets 32..2048 (all hold 16 sequences); none when unpacked
    assert rows["chains"]["packed_graphs"] == rows["none"]["packed_graphs"] == sizes * 10
    assert rows["unpacked"]["packed_graphs"] == 0
    # sampled: per size one per top-N width (0, 16, the cap: min(256, the tiny head's vocabulary)); none unsampled
    assert rows["chains"]["sampled_graphs"] == rows["unpacked"]["sampled_graphs"] == sizes * 3
    assert rows["unsampled"]["sampled_graphs"] == 0 and rows["unsampled"]["packed_graphs"] == sizes * 10


def stopped_bench_step_run() -> dict:
    """A --rounds-only bench_step JSON of a run stopped by its time limit inside batch 256: rounds at 1 and 128 only."""
    rounds = {"channel_ms": [2.0, 2.2, 2.1], "in_process_columns_ms": [1.5, 1.6, 1.4], "bare_grpc_ms": [0.5, 0.7, 0.6]}
    return {"preset": "llama3-8b", "dtype": "bfloat16", "context": 1024, "k": 5, "device": "cuda: test",
            "date": "2026-11-27T00:00:00", "complete": False,
            "rows": [{"batch": 1, "floor_ms": 1.0, "in_process_ms": 1.7, "rounds": rounds},
                     {"batch": 128, "floor_ms": 2.0, "in_process_ms": 3.0, "rounds": rounds},
                     {"batch": 256, "floor_ms": 3.0, "in_process_ms": 5.0}]}


def test_plot_step_takes_each_path_where_a_stopped_run_measured_it():
    from drafter_client.benchmarks.plot_step import measured
    rows = stopped_bench_step_run()["rows"]
    assert measured(rows, lambda r: r["in_process_ms"]) == ([1, 128, 256], [1.7, 3.0, 5.0])
    assert measured(rows, lambda r: statistics.median(r["rounds"]["channel_ms"])) == ([1, 128], [2.1, 2.1])
    assert measured(rows, lambda r: r["sidecar_ms"]) == ([], [])


def test_plot_step_draws_a_stopped_run(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (the plot is skipped, not the benchmark)")
    path = tmp_path / "run.json"
    path.write_text(json.dumps(stopped_bench_step_run()))
    from drafter_client.benchmarks.plot_step import main
    assert main([str(path), "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_admission_rehearsal_ab_needs_a_gpu():
    """scripts/admission_rehearsal_ab.py times graph-replayed steps: without a GPU it says so and fails."""
    refused_without_a_gpu("scripts/admission_rehearsal_ab.py")


@pytest.mark.gpu
def test_admission_rehearsal_ab_times_both_arms_on_a_gpu(tmp_path):
    result = run(["scripts/admission_rehearsal_ab.py", "--preset", "tiny", "--batches", "1,8", "--rounds", "2"],
                 tmp_path / "ab.json")
    rows = result["rows"]
    assert sorted((r["round"], r["rehearsal"], r["batch"]) for r in rows) == sorted(
        (r, on, batch) for r in range(2) for on in (False, True) for batch in (1, 8))
    assert all(r["wall_mean_ms"] > 0 and "admit" in r["phases"] and "did not replay" not in r["phases"] for r in rows)
    assert [(s["batch"], s["rehearsal"]) for s in result["summary"]] == [(1, False), (1, True), (8, False), (8, True)]


@pytest.mark.gpu
def test_profile_step_times_contexts_that_advance_on_a_gpu(tmp_path):
    """scripts/profile_step.py --advance: each step starts where the last one ended (the script checks at each rewind
    that every step committed its tokens); walls, phases and kernel times as for fixed contexts."""
    result = run(["scripts/profile_step.py", "--preset", "tiny", "--batches", "1,32", "--columns", "--advance",
                  "--states-on-gpu", "--phases", "--context", "256"], tmp_path / "ps.json")
    assert result["complete"] is True and result["advance"] is True
    assert [r["batch"] for r in result["rows"]] == [1, 32]
    assert all(r["wall_ms"][0] > 0 and r["kernel_ms"][0] > 0 for r in result["rows"])
    # warm-up, 20 timed, phases (5 + 30) and kernels (5 + 5) steps: every one of them advanced
    assert all(n >= 65 for n in result["advanced_steps"].values()), result["advanced_steps"]


def test_bench_block_growth_times_both_ways_over_the_same_steps(tmp_path):
    """benchmarks/bench_block_growth.py: both ways of taking a step's new blocks, over contexts that advance (the
    script checks that every step committed its tokens); the same sequences resized per step both ways."""
    result = run(["benchmarks/bench_block_growth.py", "--preset", "tiny", "--device", "cpu", "--batches", "8,32",
                  "--rounds", "2", "--iters", "6", "--context", "128"], tmp_path / "bg.json")
    assert result["complete"] is True and [r["batch"] for r in result["rows"]] == [8, 32]
    for row in result["rows"]:
        one, each = (row["rounds"][way] for way in ("one call", "one at a time"))
        assert len(one) == len(each) == 2
        assert [x["resized"] for x in one] == [x["resized"] for x in each], row  # (the same steps both ways)
        assert all(x["resized"] > 0 and x["resize_us"] > 0 and x["step_ms"] > 0 for x in one + each), row


def test_bench_arrivals_times_the_four_kinds_of_step(tmp_path):
    """benchmarks/bench_arrivals.py: steps that start new sequences from the columns, the same with the packed first
    step refused (no graphs on the CPU: the same way), the same kind made to go per sequence, and decode-only steps,
    over one advancing population (the script checks every answer's status)."""
    result = run(["benchmarks/bench_arrivals.py", "--preset", "tiny", "--device", "cpu", "--batches", "8",
                  "--steps", "3", "--prompt", "12", "--context", "64"], tmp_path / "arr.json")
    assert result["complete"] is True and [r["batch"] for r in result["rows"]] == [8]
    kinds = result["rows"][0]["kinds"]
    assert {kind: r["from_columns"] for kind, r in kinds.items()} == {"columns": 3, "eager first": 3,
                                                                      "per sequence": 0, "decode only": 3}
    assert all(r["steps"] == 3 and r["step_ms_mean"] > 0 and r["packed_first_steps"] == 0 for r in kinds.values())
    assert kinds["per sequence"]["phases_ms"] is None  # (the columns path's marks only)
    assert all(set(kinds[kind]["phases_ms"]) == {"admit", "to_launch", "to_sync", "after"}
               for kind in ("columns", "eager first", "decode only"))


def test_bench_arrivals_sends_prompts_in_chunks(tmp_path):
    """--prompt-chunks 3: a new sequence's prompt over three steps, k = 0 before its last chunk (the script checks
    every answer's status; columns and eager-first steps run from the columns with the chunks in them; batch 10: two
    sequences are mid-prompt, so that the decode-only steps' 8 take the columns way on the CPU too)."""
    result = run(["benchmarks/bench_arrivals.py", "--preset", "tiny", "--device", "cpu", "--batches", "10",
                  "--steps", "3", "--prompt", "30", "--prompt-chunks", "3", "--context", "64"], tmp_path / "arr.json")
    assert result["complete"] is True and result["prompt_chunks"] == 3
    kinds = result["rows"][0]["kinds"]
    assert {kind: r["from_columns"] for kind, r in kinds.items()} == {"columns": 3, "eager first": 3,
                                                                      "per sequence": 0, "decode only": 3}


@pytest.mark.gpu
def test_bench_arrivals_replays_packed_first_steps_on_a_gpu(tmp_path):
    """On CUDA the columns steps with a new sequence's prompt replay a packed first-step graph, the 'eager first'
    ones do not."""
    result = run(["benchmarks/bench_arrivals.py", "--preset", "tiny", "--device", "cuda", "--batches", "8",
                  "--steps", "3", "--prompt", "40", "--context", "64"], tmp_path / "arr.json")
    kinds = result["rows"][0]["kinds"]
    assert {kind: r["packed_first_steps"] for kind, r in kinds.items()} == {"columns": 3, "eager first": 0,
                                                                            "per sequence": 3, "decode only": 0}
