"""Counters of the drafter, exposed in the Prometheus text format (server.py serves them on --metrics-port).

Written by the step worker thread, read by the event loop: plain ints, no locks (a scrape may see a step half
counted, which Prometheus tolerates).
"""
from dataclasses import dataclass, field

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
MAX_TRACKED_POSITIONS = 16


@dataclass
class Metrics:
    steps: int = 0  # batches run by the worker
    sequence_steps: int = 0  # per-sequence steps, all outcomes
    committed_tokens: int = 0  # rows of hidden states ingested
    draft_tokens: int = 0  # drafts proposed
    sequence_errors: dict[int, int] = field(default_factory=dict)  # per-sequence status code -> count
    drafts_evaluated: int = 0  # drafts whose fate the engine told us (next step)
    drafts_accepted: int = 0
    evaluated_by_position: list[int] = field(default_factory=lambda: [0] * MAX_TRACKED_POSITIONS)
    accepted_by_position: list[int] = field(default_factory=lambda: [0] * MAX_TRACKED_POSITIONS)
    step_seconds_sum: float = 0.0
    step_seconds_buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS_S))
    batch_sequences_sum: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    live_sequences: int = 0
    rpc_errors: dict[str, int] = field(default_factory=dict)  # request-level gRPC code name -> count
    # Where a Propose request's time goes inside the server (handler entry to response built):
    rpc_propose_count: int = 0
    rpc_parse_seconds_sum: float = 0.0  # validate + decode tensors (+ shared-memory copies)
    rpc_wait_seconds_sum: float = 0.0  # queued for the worker + the batch's step + hand-back
    rpc_reply_seconds_sum: float = 0.0  # encode the response
    shm: object | None = None  # shm_regions.RegionTable when shared memory is on: its totals are exported too
    channel_requests_total: int = 0  # Propose requests answered through step channels (also in rpc_propose_total)
    channels: object | None = None  # step_channels.ChannelSet when step channels are on

    def record_acceptance(self, num_drafts: int, accepted: int) -> None:
        self.drafts_evaluated += num_drafts
        self.drafts_accepted += accepted
        for i in range(min(num_drafts, MAX_TRACKED_POSITIONS)):
            self.evaluated_by_position[i] += 1
            if i < accepted:
                self.accepted_by_position[i] += 1

    def record_step(self, steps, outputs, seconds: float, blocks_free: int, blocks_total: int) -> None:
        self.steps += 1
        self.sequence_steps += len(steps)
        self.batch_sequences_sum += len(steps)
        for s, o in zip(steps, outputs):
            if o.code:
                self.sequence_errors[o.code] = self.sequence_errors.get(o.code, 0) + 1
            else:
                self.committed_tokens += s.num_tokens
                self.draft_tokens += len(o.drafts)
        self.step_seconds_sum += seconds
        for i, bound in enumerate(LATENCY_BUCKETS_S):
            if seconds <= bound:
                self.step_seconds_buckets[i] += 1
        self.kv_blocks_free, self.kv_blocks_total = blocks_free, blocks_total

    def record_rpc_timing(self, parse_s: float, wait_s: float, reply_s: float) -> None:
        self.rpc_propose_count += 1
        self.rpc_parse_seconds_sum += parse_s
        self.rpc_wait_seconds_sum += wait_s
        self.rpc_reply_seconds_sum += reply_s

    def record_rpc_error(self, code_name: str) -> None:
        self.rpc_errors[code_name] = self.rpc_errors.get(code_name, 0) + 1

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / evaluated steps, as vLLM reports it (per step that had drafts)."""
        evaluated_steps = self.evaluated_by_position[0]
        return 1.0 + self.drafts_accepted / evaluated_steps if evaluated_steps else 0.0

    def prometheus_text(self) -> str:
        lines = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP drafter_{name} {help_}")
            lines.append(f"# TYPE drafter_{name} {kind}")
            for labels, value in samples:
                lines.append(f"drafter_{name}{labels} {value}")

        metric("steps_total", "counter", "Batches run by the step worker.", [("", self.steps)])
        metric("sequence_steps_total", "counter", "Per-sequence steps received.", [("", self.sequence_steps)])
        metric("committed_tokens_total", "counter", "Committed tokens (hidden-state rows) ingested.",
               [("", self.committed_tokens)])
        metric("draft_tokens_total", "counter", "Draft tokens proposed.", [("", self.draft_tokens)])
        metric("drafts_evaluated_total", "counter", "Drafts whose outcome the engine reported.",
               [("", self.drafts_evaluated)])
        metric("drafts_accepted_total", "counter", "Drafts the engine accepted.", [("", self.drafts_accepted)])
        metric("drafts_evaluated_by_position_total", "counter", "Drafts evaluated, by draft position (0-based).",
               [(f'{{position="{i}"}}', v) for i, v in enumerate(self.evaluated_by_position)])
        metric("drafts_accepted_by_position_total", "counter", "Drafts accepted, by draft position (0-based).",
               [(f'{{position="{i}"}}', v) for i, v in enumerate(self.accepted_by_position)])
        metric("sequence_errors_total", "counter", "Per-sequence statuses other than OK, by gRPC code number.",
               [(f'{{code="{c}"}}', v) for c, v in sorted(self.sequence_errors.items())])
        metric("rpc_errors_total", "counter", "Request-level errors, by gRPC code.",
               [(f'{{code="{c}"}}', v) for c, v in sorted(self.rpc_errors.items())])
        buckets = [(f'{{le="{b}"}}', c) for b, c in zip(LATENCY_BUCKETS_S, self.step_seconds_buckets)]
        buckets.append(('{le="+Inf"}', self.steps))
        lines.append("# HELP drafter_step_seconds Worker time per batch.")
        lines.append("# TYPE drafter_step_seconds histogram")
        lines += [f"drafter_step_seconds_bucket{lab} {v}" for lab, v in buckets]
        lines.append(f"drafter_step_seconds_sum {self.step_seconds_sum}")
        lines.append(f"drafter_step_seconds_count {self.steps}")
        metric("batch_sequences_sum", "counter", "Sum of sequences per batch (divide by steps_total).",
               [("", self.batch_sequences_sum)])
        metric("rpc_propose_total", "counter", "Propose requests answered (unary and stream).",
               [("", self.rpc_propose_count)])
        metric("rpc_propose_seconds_sum", "counter",
               "Server time of Propose requests by phase: parse (validate, decode), wait (queue + step), reply.",
               [('{phase="parse"}', self.rpc_parse_seconds_sum), ('{phase="wait"}', self.rpc_wait_seconds_sum),
                ('{phase="reply"}', self.rpc_reply_seconds_sum)])
        if self.channels is not None:
            metric("step_channel_requests_total", "counter",
                   "Propose requests that came through shared-memory step channels.",
                   [("", self.channel_requests_total)])
            metric("step_channels", "gauge", "Step channels open.", [("", self.channels.open_count())])
        if self.shm is not None:
            t = self.shm
            metric("shm_reads_total", "counter", "Tensors read by reference from shared-memory regions.",
                   [("", t.reads_total)])
            metric("shm_read_bytes_total", "counter", "Bytes copied out of shared-memory regions.",
                   [("", t.read_bytes_total)])
            metric("shm_read_seconds_total", "counter",
                   "Seconds spent checking references and copying them into staging tensors.",
                   [("", t.read_seconds_total)])
            metric("shm_regions_expired_total", "counter",
                   "Regions unmapped because their lease expired (client gone without unregistering).",
                   [("", t.expired_total)])
            regions = list(t.regions.values())
            metric("shm_regions", "gauge", "Shared-memory regions registered.", [("", len(regions))])
            metric("shm_region_bytes", "gauge", "Bytes of the registered shared-memory regions.",
                   [("", sum(r.byte_size for r in regions))])
        metric("kv_blocks_free", "gauge", "Free KV blocks.", [("", self.kv_blocks_free)])
        metric("kv_blocks_total", "gauge", "KV blocks in the pool.", [("", self.kv_blocks_total)])
        metric("live_sequences", "gauge", "Sequences holding draft-KV.", [("", self.live_sequences)])
        return "\n".join(lines) + "\n"
