"""/metrics (drafter_service/metrics.py, on prometheus_client): after steps of every kind (unary Propose, a
ProposeStream, a step channel, shared memory, a per-sequence error and a request refused as a whole) the scrape
passes `promtool check metrics` without a word, and its series count exactly what was sent. The endpoint answers
on IPv4 and IPv6, each server has its own registry, and every metric name the docs and the Helm chart use exists.

promtool comes from Debian's `prometheus` package (.ci/run installs it); without it that one test skips.
"""
import asyncio
import pathlib
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from conftest import ServerThread, make_config
from drafter_client import DrafterClient, DrafterError, SequenceStep
from drafter_service import __version__
from drafter_service.metrics import Metrics, serve_http

ROOT = pathlib.Path(__file__).resolve().parent.parent
H, V = 64, 512
K = 3
UNARY, STREAM, CHANNEL, SHM = 2, 3, 4, 2  # answered Propose requests of each kind (drive() below)
REQUESTS = UNARY + STREAM + CHANNEL + SHM
T = 120.0  # each step's deadline: generous, so that a busy CI machine never turns a step into a fallback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, host: str = "127.0.0.1") -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        return r.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def step(sid: str, p: int = 0, m: int = 4, nxt: int = 1, k: int = K) -> SequenceStep:
    return SequenceStep(sid, p, list(range(10, 10 + m)), torch.randn(m, H), nxt, k)


async def drive(server: ServerThread, port: int) -> str:
    """Steps of every kind; returns the scrape taken while every client is still connected."""
    loop = asyncio.get_running_loop()
    async with DrafterClient(server.tcp, namespace="unary") as unary, \
            DrafterClient(server.uds, namespace="stream") as streamer, \
            DrafterClient(server.uds, namespace="channel") as channel, \
            DrafterClient(server.uds, namespace="shm") as shm:
        # unary: a new sequence and an unknown one (NOT_FOUND), then one draft accepted out of K
        r = await unary.propose([step("a"), step("b", p=5)], timeout=T)
        assert r.sequences[0].ok and r.sequences[1].code == grpc.StatusCode.NOT_FOUND.value[0]
        d = r.sequences[0].drafts.tolist()
        r = await unary.propose([SequenceStep("a", 4, [1, d[0]], torch.randn(2, H), (d[1] + 1) % V, K)], timeout=T)
        assert r.sequences[0].accepted_drafts == 1
        # refused as a whole: hidden states one column too wide
        with pytest.raises(DrafterError) as e:
            await unary.propose([SequenceStep("c", 0, [1, 2], torch.randn(2, H + 1), 1, K)], timeout=T)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        session = streamer.stream()
        for i in range(STREAM):
            assert (await session.propose([step(f"s{i}")], timeout=T)).sequences[0].ok
        await session.close()
        m = server.server.runtime.metrics
        # the stream's end frees the sequences it created (on the step thread, soon after)
        await loop.run_in_executor(None, wait_until, lambda: m.value("drafter_sequences_freed_on_close_total") == STREAM)
        assert await channel.open_step_channel()
        for i in range(CHANNEL):
            assert (await channel.propose([step(f"c{i}")], timeout=T)).sequences[0].ok
        assert channel.steps_through_channel == CHANNEL
        assert await shm.enable_shared_memory(max_step_tokens=64, dtype=torch.float32) == "system"
        for i in range(SHM):
            assert (await shm.propose([step(f"m{i}")], timeout=T)).sequences[0].ok
        assert shm.steps_by_reference == SHM
        # the step thread counts a channel request and the queue waits just after it has handed the reply back
        await loop.run_in_executor(None, wait_until, lambda: (
            m.value("drafter_queue_wait_seconds_count") == REQUESTS
            and m.value("drafter_step_channel_requests_total") == CHANNEL))
        text = await loop.run_in_executor(None, scrape, port)
        rt = server.server.runtime  # the state the scrape shows (clients still connected: their sequences live)
        server.state = server.call(lambda: (rt.kv.pool.num_free, rt.kv.num_blocks, len(rt.proposer.table)))
        return text


@pytest.fixture(scope="module")
def scraped(tiny_model, tmp_path_factory):
    """(the server, its scrape after drive()); a server of its own, so that the counts are exact."""
    port = free_port()
    cfg = make_config(*tiny_model, tmp_path_factory.mktemp("prom"), metrics_port=port)
    with ServerThread(cfg) as s:
        text = asyncio.run(drive(s, port))
        yield s, port, text


def test_scrape_passes_promtool(scraped):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; .ci/run installs it)")
    _, _, text = scraped
    p = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout + p.stderr) == (0, ""), p.stdout + p.stderr


def test_series_count_what_was_sent(scraped):
    server, _, text = scraped
    v = samples(text)

    def get(name, **labels):
        return v[(name, frozenset(labels.items()))]

    assert get("drafter_build_info", version=__version__, method="eagle", device="cpu", dtype="float32") == 1
    # requests: unary + stream + shared memory through gRPC, the rest through the channel
    assert get("drafter_rpc_propose_total") == REQUESTS
    assert get("drafter_propose_seconds_count", transport="grpc") == UNARY + STREAM + SHM
    assert get("drafter_propose_seconds_count", transport="step_channel") == CHANNEL
    assert get("drafter_propose_seconds_bucket", transport="grpc", le="+Inf") == UNARY + STREAM + SHM
    assert get("drafter_propose_seconds_sum", transport="grpc") > 0
    assert get("drafter_step_channel_requests_total") == CHANNEL
    phases = [get("drafter_rpc_propose_phase_seconds_total", phase=p) for p in ("parse", "wait", "reply")]
    assert all(x > 0 for x in phases)
    assert get("drafter_queue_wait_seconds_count") == REQUESTS
    assert get("drafter_queue_depth") == 0
    # one batch per request (they came one at a time)
    assert get("drafter_steps_total") == REQUESTS
    assert get("drafter_step_seconds_count") == REQUESTS
    assert get("drafter_batch_sequences_count") == REQUESTS
    assert get("drafter_batch_sequences_sum") == REQUESTS + 1  # the first unary request had two sequences
    assert get("drafter_sequence_steps_total") == REQUESTS + 1
    assert get("drafter_sequence_errors_total", code="NOT_FOUND") == 1
    assert get("drafter_rpc_errors_total", code="INVALID_ARGUMENT") == 1
    assert get("drafter_committed_tokens_total") == 4 * REQUESTS - 2  # 4 tokens a step, 2 in the accepting one
    assert get("drafter_draft_tokens_total") == K * REQUESTS
    # acceptance (vLLM's spec-decode counters): one proposal of K drafts evaluated, the first accepted
    assert get("drafter_draft_proposals_evaluated_total") == 1
    assert get("drafter_drafts_evaluated_total") == K and get("drafter_drafts_accepted_total") == 1
    assert [get("drafter_drafts_evaluated_by_position_total", position=str(i)) for i in range(K + 1)] == [1] * K + [0]
    assert [get("drafter_drafts_accepted_by_position_total", position=str(i)) for i in range(K)] == [1, 0, 0]
    assert server.server.runtime.metrics.mean_acceptance_length == 2.0
    # state gauges
    free, total, live = server.state
    assert get("drafter_kv_capacity_blocks") == total == 16384 // 16
    assert get("drafter_kv_blocks_free") == free
    assert get("drafter_kv_used_ratio") == pytest.approx((total - free) / total) and 0 < (total - free) / total < 1
    assert get("drafter_live_sequences") == live == 1 + CHANNEL + SHM  # (the stream's were freed when it ended)
    assert get("drafter_sequences_freed_on_close_total") == STREAM
    assert get("drafter_step_channels") == 1
    assert get("drafter_shm_reads_total") >= SHM and get("drafter_shm_read_bytes_total") >= SHM * 4 * H * 4
    assert get("drafter_shm_regions") == 1 and get("drafter_shm_region_bytes") > 0
    for name in ("drafter_sequences_evicted_total", "drafter_sequences_expired_total", "drafter_quota_refusals_total",
                 "drafter_shm_regions_expired_total"):
        assert get(name) == 0
    # labels carry gRPC code names, never numbers
    codes = {dict(k[1]).get("code") for k in v if "code" in dict(k[1])}
    assert codes and all(re.fullmatch(r"[A-Z_]+", c) for c in codes), codes


def test_ipv4_ipv6_and_404(scraped):
    server, port, _ = scraped
    assert "drafter_steps_total" in scrape(port, "127.0.0.1")
    if server.server.metrics_server.httpd.address_family == socket.AF_INET6:
        assert "drafter_steps_total" in scrape(port, "[::1]")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)
    assert e.value.code == 404


def test_each_server_has_its_own_registry():
    """Two endpoints in one process, each with its own counters; the sequence table's lifetime counters."""
    a, b = Metrics(kv_blocks_free=3, kv_blocks_total=4), Metrics()
    a.sequence_counters.evicted += 2
    a.sequence_counters.expired += 1
    a.sequence_counters.quota_refusals += 3
    b.record_rpc_error("NOT_FOUND")
    servers = [serve_http(0, lambda: a.registry), serve_http(0, lambda: b.registry), serve_http(0, lambda: None)]
    try:
        va, vb, vnone = (samples(scrape(s.port)) for s in servers)
    finally:
        for s in servers:
            s.close()
    assert va[("drafter_sequences_evicted_total", frozenset())] == 2
    assert va[("drafter_sequences_expired_total", frozenset())] == 1
    assert va[("drafter_quota_refusals_total", frozenset())] == 3
    assert va[("drafter_kv_used_ratio", frozenset())] == 0.25
    assert ("drafter_rpc_errors_total", frozenset({("code", "NOT_FOUND")})) not in va
    assert vb[("drafter_rpc_errors_total", frozenset({("code", "NOT_FOUND")}))] == 1
    assert vb[("drafter_sequences_evicted_total", frozenset())] == 0
    assert vnone == {}  # while the model loads: no series yet


def test_every_metric_the_docs_and_the_chart_name_exists(scraped):
    _, _, text = scraped
    exposed = {f.name for f in text_string_to_metric_families(text)}
    # a histogram's family is its base name; counters are exposed with _total
    names = exposed | {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    sources = [ROOT / "docs" / "deployment.md", ROOT / "README.md", ROOT / "tests" / "test_helm_chart.py",
               *sorted((ROOT / "helm").rglob("*.yaml")), *sorted((ROOT / "helm").rglob("*.tpl")),
               *sorted((ROOT / "helm").rglob("*.json"))]
    # (the deployment doc's note on renamed series names the old names on purpose)
    texts = [re.sub(r"Renamed from earlier versions:.*?(?=\n- \*\*)", "", p.read_text(), flags=re.S) for p in sources]
    used = {m for t in texts for m in re.findall(r"\bdrafter_[a-z0-9_]+", t)}
    used = {m for m in used if not m.startswith(("drafter_client", "drafter_service", "drafter_kernels",
                                                 "drafter_sidecar", "drafter_of", "drafter_serve"))}
    assert "drafter_kv_used_ratio" in used  # (the HPA example)
    missing = sorted(m for m in used if m not in names)
    assert not missing, f"named but not exposed: {missing}"
    # and the deployment doc's table lists every family
    table = set(re.findall(r"^\| `(drafter_[a-z0-9_]+)`", (ROOT / "docs" / "deployment.md").read_text(), re.M))
    families = {f.name + ("_total" if f.type == "counter" else "") for f in text_string_to_metric_families(text)}
    assert families == table, (sorted(families - table), sorted(table - families))
