"""The drafter's Prometheus metrics, on prometheus_client; serve_http() serves them on --metrics-port (server.py).

Every Metrics holds its own CollectorRegistry (never prometheus_client's global one), so one process can run several
servers (the tests do). Two kinds of series live in it:

- Per-sequence counters of the step thread (steps, tokens, acceptance by position, per-sequence statuses) are plain
  ints that only the step thread writes, exported at scrape time by a collector: no lock per increment on the step
  path. A scrape may see a step half counted, which Prometheus tolerates.
- The histograms, and every counter written from more than one thread (Propose timings, request errors,
  evictions), are prometheus_client Histogram / Counter objects. Gauges of state that lives elsewhere (KV blocks,
  live sequences, queue depth, step channels, shared-memory regions) are read when scraped.

Names follow the Prometheus conventions (promtool check metrics passes: tests/test_metrics_promtool.py): counters
end in _total, no other series ends in _sum / _count / _bucket, gauges do not end in _total, base units (seconds,
bytes, ratio), status labels are gRPC code names ("NOT_FOUND"). The table of every series is in docs/deployment.md.
"""
import errno
import logging
import socket
import threading
from http.server import HTTPServer
from socketserver import TCPServer, ThreadingMixIn
from typing import Callable
from urllib.parse import urlparse

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import MetricsHandler

from drafter_service.engine.sequence import SequenceCounters

log = logging.getLogger(__name__)

# No "<name>_created" series next to every counter and histogram: they double the series and nothing here reads
# them. (A process-wide prometheus_client switch; this module is the drafter server's.)
disable_created_metrics()

# Latency buckets from 0.1 ms (a step-channel round trip, a CUDA-graph step) to 5 s.
LATENCY_BUCKETS_S = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_SEQUENCES_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
MAX_TRACKED_POSITIONS = 16

# gRPC status code numbers (fixed by the gRPC spec) -> names, for per-sequence statuses (the engine has no grpc).
CODE_NAMES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
              "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
              "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")


def code_name(code: int) -> str:
    return CODE_NAMES[code] if 0 <= code < len(CODE_NAMES) else str(code)


class Metrics:
    """The counters of one server. The step thread calls record_step / record_acceptance / observe_queue_wait; the
    handlers record_rpc_timing / record_rpc_error; runtime.py set_build_info. The sequence table's lifetime counters
    (evictions, expiries, quota refusals) are read from sequence_counters when scraped."""

    def __init__(self, kv_blocks_free: int = 0, kv_blocks_total: int = 0):
        # ---- written by the step thread only (plain ints; exported by _StepCollector) ----
        self.steps = 0  # batches run by the worker
        self.sequence_steps = 0  # per-sequence steps, all outcomes
        self.committed_tokens = 0  # rows of hidden states ingested
        self.draft_tokens = 0  # drafts proposed
        self.sequence_errors: dict[int, int] = {}  # per-sequence status code (number) -> count
        self.draft_proposals_evaluated = 0  # sequence steps whose previous drafts the engine reported on
        self.drafts_evaluated = 0  # drafts whose fate the engine told us (next step)
        self.drafts_accepted = 0
        self.evaluated_by_position = [0] * MAX_TRACKED_POSITIONS
        self.accepted_by_position = [0] * MAX_TRACKED_POSITIONS
        self.kv_blocks_free = kv_blocks_free
        self.kv_blocks_total = kv_blocks_total  # the pool's capacity (drafter_kv_capacity_blocks)
        self.live_sequences = 0
        self.step_worker_broken = False  # the proposer hit an unrecoverable error (health NOT_SERVING)
        # ---- state read when scraped (set by server.py / the servicer) ----
        self.shm: object | None = None  # shm_regions.RegionTable when shared memory is on: its totals are exported
        self.channels: object | None = None  # step_channels.ChannelSet when step channels are on
        self.queue_depth: Callable[[], int] | None = None  # StepScheduler.queue_depth
        # the sequence table's lifetime counters (the proposer puts its table's here; step thread writes)
        self.sequence_counters = SequenceCounters()
        self.predraft_counters = None  # predraft.PredraftCounters (the proposer's; step thread writes)
        self.merge_window_counters = None  # merge_window.MergeWindowCounters (the scheduler's; step thread writes)

        self.registry = r = CollectorRegistry()
        self.build_info = Gauge("drafter_build_info", "Always 1; the labels say what this drafter runs.",
                                ["version", "method", "device", "dtype"], registry=r)
        self.step_seconds = Histogram("drafter_step_seconds", "Step-thread time per batch (the proposer step).",
                                      buckets=LATENCY_BUCKETS_S, registry=r)
        self.batch_sequences = Histogram("drafter_batch_sequences", "Sequences per batch run by the step thread.",
                                         buckets=BATCH_SEQUENCES_BUCKETS, registry=r)
        self.queue_wait_seconds = Histogram(
            "drafter_queue_wait_seconds",
            "Time a Propose request (gRPC or step channel) waited for the step thread: queued (a step-channel request: "
            "its client's doorbell) to its batch's start.",
            buckets=LATENCY_BUCKETS_S, registry=r)
        self.propose_seconds = Histogram(
            "drafter_propose_seconds",
            "Server time of answered Propose requests, from the handler (or the channel poll) to the reply built.",
            ["transport"], buckets=LATENCY_BUCKETS_S, registry=r)
        self._propose_grpc = self.propose_seconds.labels("grpc")
        self._propose_channel = self.propose_seconds.labels("step_channel")
        self.rpc_propose = Counter("drafter_rpc_propose", "Propose requests answered (unary, stream, step channel).",
                                   registry=r)
        phase = Counter("drafter_rpc_propose_phase_seconds",
                        "Server time of answered Propose requests by phase: parse (validate, decode), wait (queue + "
                        "step; for a request whose steps ran from columns also its reply's encoding, done on the step "
                        "thread), reply (encode, on the event loop).", ["phase"], registry=r)
        self._phase = (phase.labels("parse"), phase.labels("wait"), phase.labels("reply"))
        self.rpc_errors = Counter("drafter_rpc_errors", "Requests refused as a whole, by gRPC code.", ["code"],
                                  registry=r)
        self.channel_requests = Counter("drafter_step_channel_requests",
                                        "Propose requests answered through shared-memory step channels (they count "
                                        "in drafter_rpc_propose_total too).", registry=r)
        uploads = Counter("drafter_chunked_uploads", "ProposeChunked uploads received whole, by the calls that "
                          "carried them: one, or spread over several connections (ProposeChunk.part).", ["calls"],
                          registry=r)
        upload_bytes = Counter("drafter_chunked_upload_bytes", "Hidden-state bytes of the ProposeChunked uploads "
                               "received whole.", ["calls"], registry=r)
        self._uploads = {calls: (uploads.labels(calls), upload_bytes.labels(calls)) for calls in ("one", "spread")}
        r.register(_StepCollector(self))

    def record_upload(self, spread: bool, nbytes: int) -> None:
        """A ProposeChunked upload received whole (event loop)."""
        count, total = self._uploads["spread" if spread else "one"]
        count.inc()
        total.inc(nbytes)

    # ---- the step thread ----

    def record_acceptance(self, num_drafts: int, accepted: int) -> None:
        self.draft_proposals_evaluated += 1
        self.drafts_evaluated += num_drafts
        self.drafts_accepted += accepted
        for i in range(min(num_drafts, MAX_TRACKED_POSITIONS)):
            self.evaluated_by_position[i] += 1
            if i < accepted:
                self.accepted_by_position[i] += 1

    def record_step(self, steps, outputs, seconds: float, blocks_free: int, blocks_total: int) -> None:
        self.steps += 1
        self.sequence_steps += len(steps)
        committed = drafts = 0
        for s, o in zip(steps, outputs):
            if o.code:
                self.sequence_errors[o.code] = self.sequence_errors.get(o.code, 0) + 1
            else:
                committed += s.num_tokens
                drafts += len(o.drafts)
        self.committed_tokens += committed
        self.draft_tokens += drafts
        self.step_seconds.observe(seconds)
        self.batch_sequences.observe(len(steps))
        self.kv_blocks_free, self.kv_blocks_total = blocks_free, blocks_total

    def record_acceptance_columns(self, num_drafts, accepted) -> None:
        """record_acceptance for many sequences at once: [n] int64 drafts evaluated and accepted of each (numpy
        arrays or tensors)."""
        self.draft_proposals_evaluated += num_drafts.shape[0]
        self.drafts_evaluated += int(num_drafts.sum())
        self.drafts_accepted += int(accepted.sum())
        for i in range(min(int(num_drafts.max()), MAX_TRACKED_POSITIONS)):
            self.evaluated_by_position[i] += int((num_drafts > i).sum())
            self.accepted_by_position[i] += int((accepted > i).sum())

    def record_step_columns(self, num_tokens: torch.Tensor, codes: torch.Tensor, num_drafts: torch.Tensor,
                            seconds: float, blocks_free: int, blocks_total: int) -> None:
        """record_step of a step that ran from columns (batch_io.py): [B] committed tokens, status codes, drafts."""
        if not bool(codes.any()):  # (every sequence drafted)
            self.record_step_totals(codes.shape[0], int(num_tokens.sum()), int(num_drafts.sum()), seconds,
                                    blocks_free, blocks_total)
            return
        ok = codes == 0
        for code, count in zip(*(t.tolist() for t in torch.unique(codes[~ok], return_counts=True))):
            self.sequence_errors[code] = self.sequence_errors.get(code, 0) + count
        self.record_step_totals(codes.shape[0], int(num_tokens[ok].sum()), int(num_drafts[ok].sum()), seconds,
                                blocks_free, blocks_total)

    def record_step_totals(self, num_sequences: int, committed_tokens: int, draft_tokens: int, seconds: float,
                           blocks_free: int, blocks_total: int) -> None:
        """A step of num_sequences sequences, from its totals over the sequences that succeeded (no tensor op: the
        columns path calls it for a step where every sequence did, the sums already known)."""
        self.steps += 1
        self.sequence_steps += num_sequences
        self.committed_tokens += committed_tokens
        self.draft_tokens += draft_tokens
        self.step_seconds.observe(seconds)
        self.batch_sequences.observe(num_sequences)
        self.kv_blocks_free, self.kv_blocks_total = blocks_free, blocks_total

    def observe_queue_wait(self, seconds: float) -> None:
        self.queue_wait_seconds.observe(seconds)

    # ---- any thread ----

    def record_rpc_timing(self, parse_s: float, wait_s: float, reply_s: float, channel: bool = False) -> None:
        """One answered Propose request (channel: it came through a step channel)."""
        self.rpc_propose.inc()
        self._phase[0].inc(parse_s)
        self._phase[1].inc(wait_s)
        self._phase[2].inc(reply_s)
        (self._propose_channel if channel else self._propose_grpc).observe(parse_s + wait_s + reply_s)
        if channel:
            self.channel_requests.inc()

    def record_rpc_error(self, code_name: str) -> None:
        """A request refused as a whole; code_name: grpc.StatusCode.name ("INVALID_ARGUMENT")."""
        self.rpc_errors.labels(code_name).inc()

    def set_build_info(self, version: str, method: str, device: str, dtype: str) -> None:
        self.build_info.clear()
        self.build_info.labels(version, method, device, dtype).set(1)

    # ---- reading ----

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / evaluated proposals, as vLLM reports it (per sequence step that had drafts)."""
        n = self.draft_proposals_evaluated
        return 1.0 + self.drafts_accepted / n if n else 0.0

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample's current value by its exposed name (e.g. "drafter_propose_seconds_count"), or None."""
        return self.registry.get_sample_value(name, labels)

    def prometheus_text(self) -> str:
        """The Prometheus text exposition (format 0.0.4) of this server's series."""
        return generate_latest(self.registry).decode()


class _StepCollector:
    """The step thread's plain counters and the gauges read when scraped, as metric families."""

    def __init__(self, m: Metrics):
        self.m = m

    def collect(self):
        m = self.m

        def counter(name, help_, value):
            return CounterMetricFamily(name, help_, value=value)

        def gauge(name, help_, value):
            return GaugeMetricFamily(name, help_, value=value)

        yield counter("drafter_steps", "Batches run by the step thread.", m.steps)
        yield counter("drafter_sequence_steps", "Per-sequence steps received, all outcomes.", m.sequence_steps)
        yield counter("drafter_committed_tokens", "Committed tokens (hidden-state rows) ingested.", m.committed_tokens)
        yield counter("drafter_draft_tokens", "Draft tokens proposed.", m.draft_tokens)
        yield counter("drafter_draft_proposals_evaluated",
                      "Sequence steps whose previous drafts the engine reported on (vLLM: num_drafts); mean "
                      "acceptance length = 1 + drafter_drafts_accepted_total / this.", m.draft_proposals_evaluated)
        yield counter("drafter_drafts_evaluated", "Draft tokens whose outcome the engine reported (vLLM: "
                      "num_draft_tokens).", m.drafts_evaluated)
        yield counter("drafter_drafts_accepted", "Draft tokens the engine accepted (vLLM: num_accepted_tokens).",
                      m.drafts_accepted)
        by_pos = [("drafter_drafts_evaluated_by_position", "Draft tokens evaluated, by draft position (0-based).",
                   list(m.evaluated_by_position)),
                  ("drafter_drafts_accepted_by_position", "Draft tokens accepted, by draft position (0-based; "
                   "vLLM: num_accepted_tokens_per_pos).", list(m.accepted_by_position))]
        for name, help_, values in by_pos:
            f = CounterMetricFamily(name, help_, labels=["position"])
            for i, v in enumerate(values):
                f.add_metric([str(i)], v)
            yield f
        f = CounterMetricFamily("drafter_sequence_errors", "Per-sequence statuses other than OK, by gRPC code.",
                                labels=["code"])
        for c, v in sorted(dict(m.sequence_errors).items()):
            f.add_metric([code_name(c)], v)
        yield f
        c = m.sequence_counters
        yield counter("drafter_sequences_evicted", "Idle sequences evicted, least recently used first, to make "
                      "room (KV pool, --max-sequences or a namespace quota).", c.evicted)
        yield counter("drafter_sequences_expired", "Sequences freed because no step touched them for "
                      "--sequence-lease-s.", c.expired)
        yield counter("drafter_sequences_freed_on_close", "Sequences freed because the ProposeStream or step "
                      "channel that created them ended.", c.owner_closed)
        yield counter("drafter_quota_refusals", "Sequence steps refused (RESOURCE_EXHAUSTED) because their "
                      "namespace or the drafter was at a quota (--max-sequences*, --namespace-pool-share).",
                      c.quota_refusals)
        yield counter("drafter_pool_full_refusals", "Sequence steps refused (RESOURCE_EXHAUSTED) because the KV "
                      "pool was full of sequences in use.", c.pool_refusals)
        mw = m.merge_window_counters
        if mw is not None:
            yield counter("drafter_merge_window_waits", "Batch starts that waited for engines that arrived together "
                          "with the queued ones at their previous step (--merge-window-us).", mw.waits)
            yield counter("drafter_merge_window_complete", "Merge-window waits that ended with every engine waited "
                          "for queued (the others ran out of time).", mw.complete)
            yield counter("drafter_merge_window_wait_seconds", "Time the step thread spent in merge-window waits.",
                          mw.waited_s)
            yield counter("drafter_merge_window_late", "Batch starts that left out engines that had arrived together "
                          "with the queued ones, without a wait: the queue's first request had already waited as "
                          "long as the last batch took (the step thread was busy).", mw.late)
        pc = m.predraft_counters
        if pc is not None:
            yield counter("drafter_predraft_hits", "Sequence steps answered from branches prepared while the engine "
                          "verified (pre-drafting).", pc.hits)
            yield counter("drafter_predraft_misses", "Sequence steps of pre-drafting sequences whose outcome no "
                          "prepared branch had (drafted as usual).", pc.misses)
            yield counter("drafter_predraft_unprepared", "Sequence steps of pre-drafting sequences that found "
                          "nothing prepared (the pass was stopped, skipped or had no room).", pc.unprepared)
            yield counter("drafter_predraft_branches_prepared", "Branches prepared by pre-drafting passes.",
                          pc.branches_prepared)
            yield counter("drafter_predraft_passes", "Pre-drafting passes that finished, with at least one batch of "
                          "sequences prepared.", pc.passes)
            yield counter("drafter_predraft_passes_stopped", "Pre-drafting passes stopped because a request "
                          "arrived (each makes the next passes back off).", pc.passes_stopped)
            yield counter("drafter_predraft_passes_skipped", "Batches of a pre-drafting pass (one per k) not started "
                          "because they were expected to outlast the idle time between steps (the drafter falls "
                          "back).",
                          pc.passes_skipped)
            yield counter("drafter_predraft_refused_by_odds", "Step batches after which no pre-drafting pass ran "
                          "because all of their pre-drafting sequences were unlikely to hit (--predraft-min-all-hit).",
                          pc.refused_by_odds)
            yield counter("drafter_predraft_pass_seconds", "Step-thread seconds spent in pre-drafting passes, "
                          "finished or stopped.", pc.pass_seconds)
        free, total = m.kv_blocks_free, m.kv_blocks_total
        yield gauge("drafter_kv_blocks_free", "Free KV blocks.", free)
        yield gauge("drafter_kv_capacity_blocks", "KV blocks in the pool.", total)
        yield gauge("drafter_kv_used_ratio", "Share of the KV pool's blocks in use (0..1).",
                    (total - free) / total if total else 0.0)
        yield gauge("drafter_live_sequences", "Sequences holding draft-KV.", m.live_sequences)
        yield gauge("drafter_step_worker_broken", "1 once the step worker hit an error it cannot recover from (a "
                    "sticky CUDA error, or batches failing in a row): health is NOT_SERVING until a restart.",
                    int(m.step_worker_broken))
        if m.queue_depth is not None:
            yield gauge("drafter_queue_depth", "Propose requests queued for the step thread, not yet in a batch.",
                        m.queue_depth())
        if m.channels is not None:
            yield gauge("drafter_step_channels", "Step channels open.", m.channels.open_count())
        if m.shm is not None:
            t = m.shm
            yield counter("drafter_shm_reads", "Tensors read by reference from shared-memory regions.", t.reads_total)
            yield counter("drafter_shm_read_bytes", "Bytes copied out of shared-memory regions.", t.read_bytes_total)
            yield counter("drafter_shm_read_seconds",
                          "Seconds spent checking references and copying them into staging tensors.",
                          t.read_seconds_total)
            yield counter("drafter_shm_regions_expired",
                          "Regions unmapped because their lease expired (client gone without unregistering).",
                          t.expired_total)
            regions = list(t.regions.values())
            yield gauge("drafter_shm_regions", "Shared-memory regions registered.", len(regions))
            yield gauge("drafter_shm_region_bytes", "Bytes of the registered shared-memory regions.",
                        sum(r.byte_size for r in regions))


# ---- the HTTP endpoint ----


class _Lazy:
    """Collects from the registry get() returns at scrape time (None while the model loads: no series yet)."""

    def __init__(self, get: Callable[[], CollectorRegistry | None]):
        self.get = get

    def collect(self):
        registry = self.get()
        return registry.collect() if registry is not None else iter(())


class _Handler(MetricsHandler):
    registry: CollectorRegistry  # set per server (serve_http)

    def do_GET(self) -> None:
        if urlparse(self.path).path != "/metrics":
            body = b"not found (try /metrics)\n"
            self.send_response(404)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()


class _HTTPServer(ThreadingMixIn, HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 too (mapped addresses)
        TCPServer.server_bind(self)  # (not HTTPServer's: it resolves the host name, which can wait on DNS)
        self.server_name, self.server_port = "drafter", self.server_address[1]


class _DualStack(_HTTPServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """/metrics over HTTP on one port, IPv6 and IPv4 (one dual-stack socket on [::]; 0.0.0.0 where the host has no
    IPv6), on a daemon thread."""

    def __init__(self, port: int, get_registry: Callable[[], CollectorRegistry | None]):
        registry = CollectorRegistry()
        registry.register(_Lazy(get_registry))
        handler = type("DrafterMetricsHandler", (_Handler,), {"registry": registry})
        self.httpd = None
        if socket.has_ipv6:
            try:
                self.httpd = _DualStack(("::", port), handler)
            except OSError as e:
                if e.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT):
                    raise  # (a port in use, say)
                log.info("metrics: no IPv6 on this host (%s); IPv4 only", e)  # IPv6 off in the kernel / container
        if self.httpd is None:
            self.httpd = _HTTPServer(("0.0.0.0", port), handler)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="drafter-metrics", daemon=True)
        self._thread.start()
        host = "[::]" if self.httpd.address_family == socket.AF_INET6 else "0.0.0.0"
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        """Stop serving (blocks up to half a second for the serving thread) and close the socket."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5)


def serve_http(port: int, get_registry: Callable[[], CollectorRegistry | None]) -> MetricsServer:
    """Serve /metrics on port (0: a free one, see .port) from the registry get_registry() returns when scraped."""
    return MetricsServer(port, get_registry)
