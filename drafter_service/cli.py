"""`drafter-serve`: command-line entry point of the drafter sidecar."""
import argparse
import logging
import pathlib
import sys

from drafter_client.cli_help import HelpFormatter
from drafter_service.config import ServerConfig
from drafter_service.loader import ModelLoadError
from drafter_service.logs import setup_logging


def _bundled_models() -> pathlib.Path:
    """The bundled demo models (target, eagle1, eagle3): the repository's models/ is installed by a wheel as
    drafter_service/bundled_models (pyproject.toml); a checkout or an editable install has only models/ itself."""
    here = pathlib.Path(__file__).resolve().parent
    installed = here / "bundled_models"
    return installed if installed.is_dir() else here.parent / "models"


BUNDLED_MODELS = _bundled_models()
BUNDLED_MODEL = BUNDLED_MODELS / "eagle1"  # the default --model
BUNDLED_TARGET = BUNDLED_MODELS / "target"  # the default --target-model with a bundled head


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    d = ServerConfig(model="")
    ap = argparse.ArgumentParser(prog="drafter-serve", description="EAGLE drafter sidecar (gRPC).",
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", default=str(BUNDLED_MODEL),
                    help="EAGLE head directory (Hugging Face layout; default: the bundled demo EAGLE-1 head)")
    ap.add_argument("--target-model", default=None,
                    help="target model directory; embed_tokens / lm_head are read from it when the head lacks them "
                         "(default: the bundled target when --model is a bundled head)")
    ap.add_argument("--engine-applies-fc", action="store_true",
                    help="EAGLE-3 heads: the engine applies the head's fc (fc.weight) to its three layers' states "
                         "and sends [n, hidden_size] rows, a third of the bytes (docs/methods.md)")
    ap.add_argument("--listen", action="append", default=None,
                    help="HOST:PORT or unix:/path/to.sock; repeat for several (default 127.0.0.1:50061)")
    ap.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when present)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="model and KV dtype (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--block-size", type=int, default=d.block_size, help="KV block size in tokens")
    ap.add_argument("--kv-cache-tokens", type=int, default=None,
                    help="KV pool size in tokens (default: on CUDA, what --gpu-memory-fraction of device memory "
                         "leaves after the weights; on CPU 131072)")
    ap.add_argument("--gpu-memory-fraction", type=float, default=d.gpu_memory_fraction,
                    help="with no --kv-cache-tokens on CUDA: fraction of device memory for weights + KV pool")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the head's max_position_embeddings")
    ap.add_argument("--max-draft-tokens", type=int, default=d.max_draft_tokens, help="largest k per sequence")
    ap.add_argument("--max-batch-tokens", type=int, default=None,
                    help="committed tokens per batch and per request (default max(8192, max_model_len))")
    ap.add_argument("--max-batch-seqs", type=int, default=d.max_batch_seqs, help="sequences per batch/request")
    ap.add_argument("--sequence-lease-s", type=float, default=d.sequence_lease_s,
                    help="a sequence no step touched for this long is freed (its client is gone); 0 = never. Idle "
                         "sequences are also evicted, least recently used first, when the KV pool needs room")
    ap.add_argument("--max-sequences", type=int, default=d.max_sequences,
                    help="live sequences in all (0 = only the KV pool limits them)")
    ap.add_argument("--max-sequences-per-namespace", type=int, default=d.max_sequences_per_namespace,
                    help="live sequences of one namespace (0 = no limit)")
    ap.add_argument("--namespace-pool-share", type=float, default=d.namespace_pool_share,
                    help="fraction of the KV blocks one namespace may hold, in (0, 1]")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=d.cuda_graphs,
                    help="on CUDA: capture the decode steps as CUDA graphs at start-up and replay them "
                         "(--no-cuda-graphs: run them eagerly)")
    ap.add_argument("--first-step-graph-tokens", type=int, default=d.first_step_graph_tokens,
                    help="with CUDA graphs: also replay the first draft step of greedy batches whose sequences all "
                         "draft and bring at most N committed tokens each, padded to the batch's largest m (one "
                         "graph per padded batch size and m, captured at start-up); 0 = run every first step "
                         "eagerly; at most 16")
    ap.add_argument("--first-step-graph-rows", type=int, default=d.first_step_graph_rows,
                    help="with CUDA graphs: replay the first draft step of other greedy batches (a sequence joining "
                         "with its prompt, m past --first-step-graph-tokens) from a packed graph when its committed "
                         "rows fit N (one graph per padded batch size and row bucket, captured at start-up); "
                         "0 = run those first steps eagerly; at most 8192")
    ap.add_argument("--sampled-step-graphs", action=argparse.BooleanOptionalAction, default=d.sampled_step_graphs,
                    help="with CUDA graphs: replay the decode steps of sampling steps (temperature > 0, log q, top-N) "
                         "from graphs of their own, one per padded batch size and top-N width (0, 16, the top-N "
                         "cap), captured at start-up (--no-sampled-step-graphs: run them eagerly)")
    ap.add_argument("--predraft-cycle-check", action=argparse.BooleanOptionalAction, default=d.predraft_cycle_check,
                    help="pre-drafting: run passes only while they shorten an engine's step cycle, measured in turns "
                         "of 24 requests with and without them (docs/predraft.md; experimental); off (the default): "
                         "whenever a pass fits the idle time between requests")
    ap.add_argument("--predraft-min-all-hit", type=float, default=d.predraft_min_all_hit,
                    help="pre-drafting: prepare after a step batch only when all of its pre-drafting sequences are "
                         "expected to hit with at least this chance (h^n, h the measured per-sequence hit rate; a "
                         "batch answered in part waits for its misses anyway; docs/predraft.md); 0 = always")
    ap.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes, help="gRPC message size limit")
    ap.add_argument("--max-chunked-bytes", type=int, default=d.max_chunked_bytes,
                    help="hidden-state bytes of all ProposeChunked uploads in flight (staging memory)")
    ap.add_argument("--max-chunked-bytes-per-namespace", type=int, default=d.max_chunked_bytes_per_namespace,
                    help="... of one namespace's uploads")
    ap.add_argument("--chunked-upload-timeout-s", type=float, default=d.chunked_upload_timeout_s,
                    help="a ProposeChunked upload that takes longer ends with DEADLINE_EXCEEDED")
    ap.add_argument("--max-upload-parts", type=int, default=d.max_upload_parts,
                    help="most ProposeChunked calls (connections) one upload may be spread over "
                         "(DrafterClient(upload_streams=N); docs/protocol.md); 1: every upload in one call")
    ap.add_argument("--no-tune-malloc", action="store_true",
                    help="leave glibc's malloc thresholds alone (by default large blocks are kept in the heap: "
                         "messages of many MiB then cost no page faults; docs/performance.md)")
    ap.add_argument("--cpu-threads", type=int, default=d.cpu_threads,
                    help="torch threads for the draft step (0 = on CPU one per core, on CUDA 1: the host side of a "
                         "CUDA step is small tensors); on CPU, where the engine runs on the same cores, give the "
                         "drafter its share (docs/performance.md)")
    ap.add_argument("--metrics-port", type=int, default=d.metrics_port,
                    help="Prometheus metrics on http://[::]:PORT/metrics, IPv6 and IPv4 (0 = off; docs/deployment.md)")
    ap.add_argument("--shutdown-grace-s", type=float, default=d.shutdown_grace_s,
                    help="on SIGTERM, how long in-flight steps may take")
    ap.add_argument("--log-level", default=d.log_level, type=str.upper,
                    choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], help="logging threshold")
    ap.add_argument("--log-format", default=d.log_format, choices=["text", "json"],
                    help="text: human-readable lines; json: one JSON object per line (time, level, logger, message, "
                         "namespace and request_id where known)")
    ap.add_argument("--no-shared-memory", action="store_true",
                    help="refuse shared-memory regions; tensors travel inline only (docs/shared_memory.md)")
    ap.add_argument("--shm-dir", default=d.shm_dir, help="where POSIX shared-memory objects are")
    ap.add_argument("--shm-lease-s", type=float, default=d.shm_lease_s,
                    help="a region nobody renewed for this long (client gone) is unmapped")
    ap.add_argument("--no-step-channels", action="store_true",
                    help="no shared-memory step channels: every step is a gRPC message (docs/step_channel.md)")
    ap.add_argument("--step-channel-socket", default=None,
                    help="Unix socket where clients open step channels (default: the unix --listen path + .steps)")
    ap.add_argument("--step-channel-spin-s", type=float, default=d.step_channel_spin_s,
                    help="after a channel request, the step thread busy-polls the channels this long (one core)")
    ap.add_argument("--step-channel-rehearse-after-s", type=float, default=d.step_channel_rehearse_after_s,
                    help="while it spins for channel requests, this long after its last batch the step thread starts "
                         "re-reading the last request frame every 0.5 ms (at most a fifth of the time), so that the "
                         "next step's parse runs warm after the engine's target forward (docs/step_channel.md); "
                         "0: never")
    ap.add_argument("--no-step-channel-rehearse-admission", action="store_true",
                    help="rehearse the last request frame's parse alone, not also the proposer's admission and the "
                         "rest of its host work before the step's launches (nothing changed, nothing sent to the GPU)")
    ap.add_argument("--merge-window-us", type=int, default=d.merge_window_us,
                    help="before a batch starts, wait for the engines (step channels, streams) that arrived within "
                         "this many microseconds of the queued ones at their previous step, so that engines stepping "
                         "in lockstep share one batch; 0: never wait (default: 300 on CUDA, 0 on CPU, where merging "
                         "saves nothing; docs/deployment.md, Scaling)")
    ap.add_argument("--step-channel-checksums", choices=("auto", "on", "off"), default="auto",
                    help="crc32 over every step-channel message (auto: only on CPUs that may reorder stores, i.e. "
                         "not x86-64; docs/step_channel.md)")
    ap.add_argument("--no-step-channel-frames", action="store_true",
                    help="step channels carry protobuf only: a client asking for request frames gets none "
                         "(docs/step_channel.md, \"Request frames\")")
    ap.add_argument("--no-step-channel-read-ahead", action="store_true",
                    help="check a request frame only once its whole request is in, not from its head bell while the "
                         "client still copies its states (docs/step_channel.md, \"Reading ahead\")")
    ap.add_argument("--otel-endpoint", default=None,
                    help="send OpenTelemetry traces (a span per engine step with its phases) to this OTLP/gRPC "
                         "endpoint, e.g. http://otel-collector:4317 (default: off, unless OTEL_EXPORTER_OTLP_ENDPOINT "
                         "is set; needs the 'tracing' extra)")
    sec = ap.add_argument_group("identity and isolation (docs/deployment.md, Security)")
    sec.add_argument("--tls-cert", default=None, help="PEM certificate: the TCP listeners serve TLS")
    sec.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    sec.add_argument("--tls-client-ca", default=None,
                     help="PEM CA: clients must present a certificate it signed (mutual TLS)")
    sec.add_argument("--auth-token-file", default=None,
                     help="bearer tokens, one a line '<token> <namespace>[,<namespace>...]' ('*': any); every "
                          "Drafter call then needs 'authorization: Bearer <token>' and may only use its namespaces")
    sec.add_argument("--namespace-from-client-cert", action="store_true",
                     help="with mutual TLS: a client may only use the namespaces its certificate names (CN, SANs)")
    sec.add_argument("--socket-group", default=None,
                     help="group owning the Unix sockets (mode 0660: owner and group only; default: the "
                          "process's group)")
    sec.add_argument("--reflection", action="store_true", help="serve gRPC server reflection (off by default)")
    a = ap.parse_args(argv)
    target = a.target_model
    if target is None and pathlib.Path(a.model).resolve().parent == BUNDLED_MODELS and BUNDLED_TARGET.is_dir():
        target = str(BUNDLED_TARGET)  # a bundled head (eagle1, eagle3): the bundled target's embeddings / lm_head
    return ServerConfig(
        model=a.model, target_model=target, listen=a.listen or ["127.0.0.1:50061"], device=a.device, dtype=a.dtype,
        block_size=a.block_size, kv_cache_tokens=a.kv_cache_tokens, gpu_memory_fraction=a.gpu_memory_fraction,
        max_model_len=a.max_model_len, max_draft_tokens=a.max_draft_tokens, max_batch_tokens=a.max_batch_tokens,
        max_batch_seqs=a.max_batch_seqs, sequence_lease_s=a.sequence_lease_s, max_sequences=a.max_sequences,
        max_sequences_per_namespace=a.max_sequences_per_namespace, namespace_pool_share=a.namespace_pool_share,
        max_message_bytes=a.max_message_bytes, metrics_port=a.metrics_port,
        max_chunked_bytes=a.max_chunked_bytes, max_chunked_bytes_per_namespace=a.max_chunked_bytes_per_namespace,
        chunked_upload_timeout_s=a.chunked_upload_timeout_s, max_upload_parts=a.max_upload_parts,
        tune_malloc=not a.no_tune_malloc,
        cpu_threads=a.cpu_threads,
        shutdown_grace_s=a.shutdown_grace_s, log_level=a.log_level, shared_memory=not a.no_shared_memory,
        shm_dir=a.shm_dir, shm_lease_s=a.shm_lease_s, cuda_graphs=a.cuda_graphs,
        first_step_graph_tokens=a.first_step_graph_tokens, first_step_graph_rows=a.first_step_graph_rows,
        sampled_step_graphs=a.sampled_step_graphs,
        predraft_cycle_check=a.predraft_cycle_check,
        engine_applies_fc=a.engine_applies_fc,
        predraft_min_all_hit=a.predraft_min_all_hit,
        step_channels=not a.no_step_channels,
        step_channel_socket=a.step_channel_socket, step_channel_spin_s=a.step_channel_spin_s,
        step_channel_rehearse_after_s=a.step_channel_rehearse_after_s,
        step_channel_rehearse_admission=not a.no_step_channel_rehearse_admission,
        merge_window_us=a.merge_window_us,
        step_channel_checksums={"auto": None, "on": True, "off": False}[a.step_channel_checksums],
        step_channel_frames=not a.no_step_channel_frames,
        step_channel_read_ahead=not a.no_step_channel_read_ahead,
        tls_cert=a.tls_cert, tls_key=a.tls_key, tls_client_ca=a.tls_client_ca, auth_token_file=a.auth_token_file,
        namespace_from_client_cert=a.namespace_from_client_cert, socket_group=a.socket_group,
        reflection=a.reflection, log_format=a.log_format, otel_endpoint=a.otel_endpoint)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)
    except ValueError as e:
        print(f"drafter-serve: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_level, cfg.log_format)
    from drafter_service.server import run

    try:
        return run(cfg)
    except (ModelLoadError, ValueError, OSError) as e:
        logging.getLogger("drafter-serve").error("%s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
