"""Server configuration: one dataclass, filled by the CLI (cli.py) or directly by tests and benchmarks."""
from dataclasses import dataclass, field

# --first-step-graph-tokens at most: one first-step CUDA graph per (padded batch size, m) is captured at start-up,
# so the graphs and their memory pool stay bounded (engine/cuda_graphs.py)
MAX_FIRST_STEP_GRAPH_TOKENS = 16
# --first-step-graph-rows at most: the packed first-step graphs' largest row bucket (their count grows with its log)
MAX_FIRST_STEP_GRAPH_ROWS = 8192
MAX_MERGE_WINDOW_US = 10_000  # --merge-window-us: longer than a drafter step, a wait costs more than it saves
DEFAULT_MERGE_WINDOW_US = 300  # on CUDA (ServerConfig.merge_window_us_for)


@dataclass
class ServerConfig:
    model: str  # EAGLE head directory (Hugging Face layout)
    target_model: str | None = None  # target model directory: embed_tokens / lm_head when the head lacks them
    # EAGLE-3 only: the engine applies the head's fc to its three layers' states and sends [n, hidden_size] rows
    # (a third of the bytes; docs/methods.md "The fc on the engine's side")
    engine_applies_fc: bool = False
    listen: list[str] = field(default_factory=lambda: ["127.0.0.1:50061"])  # "host:port" or "unix:/path"
    device: str | None = None  # "cpu" | "cuda" | "cuda:N"; None = cuda when present
    dtype: str | None = None  # "float32" | "bfloat16" | "float16"; None = bfloat16 on CUDA, float32 on CPU
    block_size: int = 16
    kv_cache_tokens: int | None = None  # pool size in tokens; None = from gpu_memory_fraction (CUDA) or 131072 (CPU)
    gpu_memory_fraction: float = 0.25  # of total device memory, for weights + KV pool, when kv_cache_tokens is None
    max_model_len: int | None = None  # None = the head's max_position_embeddings
    max_draft_tokens: int = 8  # k at most, per sequence per step
    max_batch_tokens: int | None = None  # committed rows merged into one batch; None = max(8192, max_model_len)
    max_batch_seqs: int = 1024  # sequences in one batch / one request
    # Sequence lifetime (docs/protocol.md "Sequence lifetime"); idle sequences are also evicted, least recently used
    # first, when the KV pool or a limit below needs room
    sequence_lease_s: float = 300.0  # a sequence no step touched for this long is freed; 0 = never
    max_sequences: int = 0  # live sequences in all; 0 = only the KV pool limits them
    max_sequences_per_namespace: int = 0  # live sequences of one namespace; 0 = no limit
    namespace_pool_share: float = 1.0  # fraction of the KV blocks one namespace may hold, in (0, 1]
    cuda_graphs: bool = True  # CUDA only: decode steps replayed from CUDA graphs captured at start-up
    # with cuda_graphs: the first draft step of a greedy batch whose sequences all draft and bring at most this many
    # committed tokens each (padded to the batch's largest m, up to 256 sequences) is replayed from a graph too; one
    # graph per (padded batch, m); 0 = never
    first_step_graph_tokens: int = 8
    # with cuda_graphs: a greedy step that the padded first-step graphs cannot take (a sequence joining with its
    # prompt, any m past first_step_graph_tokens) replays a *packed* first-step graph when its rows fit this many
    # (one graph per padded batch size, a power of two, and row bucket: 32, 64, 128, 256, then steps of 1.5x);
    # 0 = such first steps run eagerly
    first_step_graph_rows: int = 2048
    # with cuda_graphs: the decode steps of a sampling step (a temperature above 0, log q, top-N) replay graphs of
    # their own (per padded batch size and top-N width: 0, 16, the top-N cap); False = they run eagerly
    sampled_step_graphs: bool = True
    # pre-drafting passes only while they shorten the engine's step cycle, measured in turns with and without them
    # (engine/predraft_cycle.py); False (the default, until a measurement shows it pays): passes whenever they fit
    # the idle window
    predraft_cycle_check: bool = False
    # pre-drafting passes only after step batches whose pre-drafting sequences all hit with at least this estimated
    # chance (h^n for n sequences and a measured per-sequence hit rate h; engine/predraft_odds.py); 0 = always
    predraft_min_all_hit: float = 0.25
    max_message_bytes: int = 256 * 1024 * 1024
    # ProposeChunked uploads (docs/protocol.md): staging bytes in flight, for the server and for one namespace, and
    # the time one upload may take
    max_chunked_bytes: int = 2**31
    max_chunked_bytes_per_namespace: int = 2**29
    chunked_upload_timeout_s: float = 60.0
    max_upload_parts: int = 8  # most ProposeChunked calls one upload may be spread over (ProposeChunk.part); 1: none
    # Large blocks (messages, staging tensors) stay in the heap instead of fresh mmaps that every use page-faults
    # in again (runtime.keep_large_blocks_in_heap, called by build_runtime: a drafter in an engine's process too;
    # docs/performance.md "Large steps over TCP"). glibc only.
    tune_malloc: bool = True
    # CPU only: torch's intra-op threads for the draft step; 0 = torch's default (one per core). Where the engine
    # shares the cores (a CPU sidecar), give each a share: two busy thread pools on the same cores slow both
    # (docs/performance.md "Columnar requests: the host work around the proposer")
    cpu_threads: int = 0
    metrics_port: int = 0  # Prometheus metrics on http://[::]:PORT/metrics (IPv6 and IPv4); 0 = off
    shutdown_grace_s: float = 30.0
    log_level: str = "INFO"
    log_format: str = "text"  # "text" (human-readable lines) or "json" (one object per line; logs.py)
    otel_endpoint: str | None = None  # OTLP/gRPC endpoint of OpenTelemetry traces (tracing.py); None: OTEL_* vars
    # Shared-memory data plane (docs/shared_memory.md)
    shared_memory: bool = True  # accept RegisterSharedMemory and Tensor.shm references
    shm_dir: str = "/dev/shm"  # where POSIX shared-memory objects are (the container's /dev/shm mount)
    shm_lease_s: float = 15.0  # a region nobody renewed for this long is unmapped (clients heartbeat at 1/3)
    shm_max_lease_s: float = 300.0
    shm_max_regions_per_namespace: int = 64
    shm_max_bytes_per_namespace: int = 16 * 2**30
    # Step channels (docs/step_channel.md): same-node steps through a shared-memory mailbox the step thread polls
    step_channels: bool = True
    step_channel_socket: str | None = None  # None: "<the first unix --listen path>.steps"; no unix listener: off
    step_channel_spin_s: float = 0.05  # after a channel request the step thread busy-polls (one core) this long
    step_channel_idle_poll_s: float = 0.0002  # then it polls this often
    # while it spins, this long after its last batch the step thread starts re-reading the last request frame every
    # 0.5 ms (at most a fifth of the time), to keep that code warm for the next step, which an engine sends a target
    # forward after its last one (step_channels.ChannelSet.rehearse; docs/step_channel.md); 0: never
    step_channel_rehearse_after_s: float = 0.002
    # and, where the last request ran from columns, the proposer's host work before that step's launches with nothing
    # changed or sent (Proposer.rehearse_columns: lookup, admission, acceptance count, the record's host copy)
    step_channel_rehearse_admission: bool = True
    # Batching (engine/merge_window.py): before a batch starts, wait for the engines that arrived within this many
    # microseconds of the queued ones at their previous step; 0: never wait; None: DEFAULT_MERGE_WINDOW_US on CUDA, 0 on
    # CPU (merge_window_us_for)
    merge_window_us: int | None = None
    step_channel_checksums: bool | None = None  # crc32 over every message; None: only on weakly ordered CPUs
    step_channel_frames: bool = True  # request frames on channels whose client asks (step_frame.py); False: protobuf
    # a request frame is checked from its head bell, while the client still copies its states (step_channels.py,
    # "Reading ahead"); False: once the whole request is in
    step_channel_read_ahead: bool = True
    step_channel_max: int = 64  # channels open at once
    step_channel_max_total_bytes: int = 2**30  # mailbox bytes of all open channels
    # Identity and isolation (transport/auth.py, docs/deployment.md "Security")
    tls_cert: str | None = None  # PEM server certificate (chain) for the TCP listeners
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_client_ca: str | None = None  # PEM CA: clients must present a certificate it signed (mutual TLS)
    auth_token_file: str | None = None  # bearer tokens, one a line: "<token> <namespace>[,<namespace>...]"
    namespace_from_client_cert: bool = False  # TLS clients may use only the namespaces their certificate names
    socket_group: str | None = None  # group of the Unix sockets (mode 0660); None: the process's group
    reflection: bool = False  # grpc server reflection (grpcurl without the .proto)

    def merge_window_us_for(self, device_type: str) -> int:
        """The merge window on this device: as set, or by default DEFAULT_MERGE_WINDOW_US on CUDA and 0 on CPU, where a
        step's cost grows with its batch (compute-bound), so that merging engines' steps saves nothing and delays
        each engine to the end of the others' (docs/deployment.md, "Engines that step together")."""
        if self.merge_window_us is not None:
            return self.merge_window_us
        return DEFAULT_MERGE_WINDOW_US if device_type == "cuda" else 0

    def step_channel_path(self) -> str | None:
        """Where the step-channel socket listens, or None when channels are off."""
        if not self.step_channels:
            return None
        if self.step_channel_socket:
            return self.step_channel_socket
        for address in self.listen:
            if address.startswith("unix:"):
                return address.removeprefix("unix:").removeprefix("//") + ".steps"
        return None

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128 (got {self.block_size})")
        if self.max_draft_tokens < 1:
            raise ValueError("max_draft_tokens must be >= 1")
        if self.cpu_threads < 0:
            raise ValueError("cpu_threads must be >= 0 (0: torch's default)")
        if not 0 <= self.first_step_graph_tokens <= MAX_FIRST_STEP_GRAPH_TOKENS:
            raise ValueError(f"first_step_graph_tokens must be in [0, {MAX_FIRST_STEP_GRAPH_TOKENS}] (got "
                             f"{self.first_step_graph_tokens}): one first-step CUDA graph per padded batch size and "
                             "m is captured at start-up")
        if not 0 <= self.first_step_graph_rows <= MAX_FIRST_STEP_GRAPH_ROWS:
            raise ValueError(f"first_step_graph_rows must be in [0, {MAX_FIRST_STEP_GRAPH_ROWS}] (got "
                             f"{self.first_step_graph_rows}): packed first-step CUDA graphs of up to this many rows "
                             "are captured at start-up")
        if not self.listen:
            raise ValueError("at least one --listen address is needed")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError("gpu_memory_fraction must be in (0, 1]")
        if not self.sequence_lease_s >= 0:  # (also refuses NaN)
            raise ValueError("sequence_lease_s must be >= 0 (0: no lease)")
        if self.max_sequences < 0 or self.max_sequences_per_namespace < 0:
            raise ValueError("max_sequences and max_sequences_per_namespace must be >= 0 (0: no limit)")
        if not 0.0 < self.namespace_pool_share <= 1.0:
            raise ValueError("namespace_pool_share must be in (0, 1]")
        if self.step_channel_spin_s < 0 or self.step_channel_idle_poll_s <= 0:
            raise ValueError("step_channel_spin_s must be >= 0 and step_channel_idle_poll_s > 0")
        if self.step_channel_rehearse_after_s < 0:
            raise ValueError("step_channel_rehearse_after_s must be >= 0 (0: no rehearsals)")
        if self.merge_window_us is not None and not 0 <= self.merge_window_us <= MAX_MERGE_WINDOW_US:
            raise ValueError(f"merge_window_us must be in [0, {MAX_MERGE_WINDOW_US}] (got {self.merge_window_us}): "
                             "a wait longer than a step costs more than the step it saves")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS)")
        if self.namespace_from_client_cert and not self.tls_client_ca:
            raise ValueError("--namespace-from-client-cert needs --tls-client-ca (client certificates)")
        if self.max_chunked_bytes < 0 or self.max_chunked_bytes_per_namespace < 0:
            raise ValueError("max_chunked_bytes and max_chunked_bytes_per_namespace must be >= 0")
        if not self.chunked_upload_timeout_s > 0:
            raise ValueError("chunked_upload_timeout_s must be > 0")
        if not 1 <= self.max_upload_parts <= 64:
            raise ValueError("max_upload_parts must be in [1, 64]")
        if not 0.0 < self.shm_lease_s <= self.shm_max_lease_s:
            raise ValueError("shm_lease_s must be in (0, shm_max_lease_s]")
