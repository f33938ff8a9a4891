"""The gRPC server process: listeners, health, reflection, metrics endpoint, graceful shutdown.

Start-up order: listen at once with health NOT_SERVING (Drafter RPCs answer UNAVAILABLE), load the model on a
thread, then SERVING. SIGTERM/SIGINT: health NOT_SERVING, stop taking RPCs, let in-flight steps finish (up to
--shutdown-grace-s), exit 0.
"""
import asyncio
import functools
import gc
import logging
import os
import pathlib
import signal
import socket
import stat

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from drafter_service import tracing
from drafter_service.config import ServerConfig
from drafter_client.protocol.mailbox import checksums_needed
from drafter_client.protocol import pb, pb_grpc
from drafter_service.metrics import MetricsServer, serve_http
from drafter_service.runtime import Runtime, build_runtime
from drafter_service.engine.host_staging import pin_mapping, pinned_bytes
from drafter_service.engine.scheduler import StepScheduler
from drafter_service.transport.auth import (AuthInterceptor, Authorizer, load_tokens, restrict_socket,
                                            server_credentials)
from drafter_service.transport.chunked import parse_chunk
from drafter_service.transport.received_request import read_request
from drafter_service.transport.servicer import DrafterServicer, serialize_reply
from drafter_service.transport.step_channels import ChannelLimits, ChannelSet

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Drafter"].full_name  # "drafter.v1.Drafter"


class _Handlers:
    """Stands in for a server to catch the method handlers that the generated add_DrafterServicer_to_server
    builds (add_drafter_service changes one of them)."""

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.handlers = handlers


def add_drafter_service(servicer: DrafterServicer, server: grpc.aio.Server) -> None:
    """pb_grpc.add_DrafterServicer_to_server, but ProposeChunked reads its messages with chunked.parse_chunk (the
    data as a view of the received bytes) instead of protobuf (which copies it twice), and Propose / ProposeStream
    with received_request.read_request (large inline states likewise)."""
    catch = _Handlers()
    pb_grpc.add_DrafterServicer_to_server(servicer, catch)
    handlers = dict(catch.handlers)
    handlers["ProposeChunked"] = grpc.stream_unary_rpc_method_handler(
        servicer.ProposeChunked, request_deserializer=parse_chunk,
        response_serializer=serialize_reply)
    # Propose and ProposeStream: large inline states stay a view of the received bytes (received_request.py)
    handlers["Propose"] = grpc.unary_unary_rpc_method_handler(
        servicer.Propose, request_deserializer=read_request, response_serializer=serialize_reply)
    handlers["ProposeStream"] = grpc.stream_stream_rpc_method_handler(
        servicer.ProposeStream, request_deserializer=read_request,
        response_serializer=serialize_reply)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _prepare_unix_socket(address: str) -> None:
    path = pathlib.Path(address.removeprefix("unix:").removeprefix("//"))
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        if not stat.S_ISSOCK(path.stat().st_mode):
            raise ValueError(f"--listen {address}: {path} exists and is not a socket")
        path.unlink()  # a stale socket from a previous run


class DrafterServer:
    """A running server; tests and benchmarks use it in-process, the CLI through serve()."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.servicer = DrafterServicer()
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.runtime: Runtime | None = None
        self.scheduler: StepScheduler | None = None
        self.channels: ChannelSet | None = None
        self.bound_addresses: list[str] = []
        self.metrics_server: MetricsServer | None = None  # /metrics on --metrics-port (its .port: the bound one)
        self.drained = asyncio.Event()  # set when a Drain is over (serve() then stops the server)
        self._drain_task: asyncio.Task | None = None

    async def start(self) -> None:
        cfg = self.config
        opts = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", 0)]
        tracing.setup_tracing(cfg.otel_endpoint)  # (off unless asked for; raises naming the missing package)
        authorizer = Authorizer(tokens=load_tokens(cfg.auth_token_file) if cfg.auth_token_file else None,
                                namespace_from_cert=cfg.namespace_from_client_cert)
        self.servicer.authorizer = authorizer
        interceptors = [AuthInterceptor(authorizer)] if authorizer.enabled else []
        self.server = grpc.aio.server(options=opts, interceptors=interceptors)
        add_drafter_service(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if cfg.reflection:
            reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                                self.server)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        tls = server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) if cfg.tls_cert else None
        for address in cfg.listen:
            if address.startswith("unix:"):
                _prepare_unix_socket(address)
                port = self.server.add_insecure_port(address)  # (file permissions guard it: restrict_socket)
            elif tls is not None:
                port = self.server.add_secure_port(address, tls)
            else:
                port = self.server.add_insecure_port(address)
            if not address.startswith("unix:") and port == 0:
                raise OSError(f"--listen {address}: could not bind")
            bound = address if address.startswith("unix:") else f"{address.rsplit(':', 1)[0]}:{port}"
            self.bound_addresses.append(bound)
        old_umask = os.umask(0o117)  # the sockets are created 0660 from the start (no window with a wider mode)
        try:
            await self.server.start()
        finally:
            os.umask(old_umask)
        for address in self.bound_addresses:
            if address.startswith("unix:"):
                restrict_socket(address.removeprefix("unix:").removeprefix("//"), cfg.socket_group)
        if cfg.metrics_port:
            self.metrics_server = serve_http(cfg.metrics_port,
                                             lambda: self.runtime.metrics.registry if self.runtime else None)
        log.info("listening on %s (loading the model; health NOT_SERVING)", ", ".join(self.bound_addresses))
        self.runtime = await asyncio.get_running_loop().run_in_executor(None, build_runtime, cfg)
        # What lives as long as the process (modules, the model, CUDA graphs) leaves the collector's reach: a
        # collection that a step triggers then walks only what steps allocate, not the whole heap.
        gc.freeze()
        rt = self.runtime
        self.scheduler = StepScheduler(rt.proposer, rt.limits.max_request_tokens, cfg.max_batch_seqs,
                                       cfg.step_channel_spin_s, cfg.step_channel_idle_poll_s,
                                       cfg.merge_window_us_for(rt.device.type) * 1e-6,
                                       cfg.step_channel_rehearse_after_s)
        self.servicer.attach(rt, self.scheduler)
        rt.metrics.queue_depth = self.scheduler.queue_depth
        rt.metrics.merge_window_counters = self.scheduler.merge_window.counters
        self.servicer.on_drain = self.drain
        self.channels = self._step_channels(cfg)
        loop = asyncio.get_running_loop()
        rt.proposer.on_fatal = lambda reason: loop.call_soon_threadsafe(
            lambda: asyncio.ensure_future(self._broken(reason)))  # (called on the step thread)
        self.scheduler.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving")

    async def _broken(self, reason: str) -> None:
        """The step worker hit an error it cannot recover from (Proposer.fatal): health NOT_SERVING for the
        server ("", the liveness probe's) and the Drafter service, so that Kubernetes restarts the container; the
        process keeps answering (every step UNAVAILABLE, which the client library turns into "no drafts")."""
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def _step_channels(self, cfg: ServerConfig) -> ChannelSet | None:
        path = cfg.step_channel_path()
        if path is None:
            return None
        if not (hasattr(os, "memfd_create") and hasattr(socket, "send_fds")):
            log.warning("step channels off: they need Linux (memfd, SCM_RIGHTS)")
            return None
        channels = ChannelSet(
            socket_path=path, limits=ChannelLimits(max_channels=cfg.step_channel_max,
                                                   max_area_bytes=cfg.max_message_bytes,
                                                   max_total_bytes=cfg.step_channel_max_total_bytes),
            decode=self.servicer.decode_propose,
            decode_frame=self.servicer.decode_frame if cfg.step_channel_frames else None,
            encode=self.servicer.encode_propose, metrics=self.runtime.metrics,
            authorizer=self.servicer.authorizer, socket_group=cfg.socket_group,
            trace_file=self.servicer.trace_file,
            may_read_ahead=lambda: cfg.step_channel_read_ahead and not self.servicer.ingest_only,
            read_buffer=pinned_bytes if self.runtime.proposer.device.type == "cuda" else None,
            pin=(functools.partial(pin_mapping, device=self.runtime.proposer.device)
                 if self.runtime.proposer.device.type == "cuda" else None),
            checksums=checksums_needed() if cfg.step_channel_checksums is None else cfg.step_channel_checksums)
        self.scheduler.attach_channels(channels)
        channels.start()
        self.servicer.step_channel_socket = path
        self.runtime.metrics.channels = channels
        return channels

    async def drain(self, grace_s: float | None = None) -> tuple[int, float]:
        """Health NOT_SERVING, no new sequences (per-sequence UNAVAILABLE); live sequences keep drafting until
        released or grace_s (default --shutdown-grace-s) passes, then ``drained`` is set. Returns (live sequences
        now, grace in force). A second call changes nothing."""
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        proposer = self.runtime.proposer

        def start_draining() -> int:
            proposer.draining = True
            return len(proposer.table)

        live = await self.scheduler.run_exclusive(start_draining)
        if self._drain_task is None:
            log.info("drain: health NOT_SERVING, no new sequences, %d live ones may finish (grace %.0fs)", live, grace)
            for name in ("", SERVICE_NAME):
                await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            self._drain_task = asyncio.ensure_future(self._wait_drained(grace))
        return live, grace

    async def _wait_drained(self, grace: float) -> None:
        deadline = asyncio.get_running_loop().time() + grace
        while asyncio.get_running_loop().time() < deadline:
            if await self.scheduler.run_exclusive(lambda: len(self.runtime.proposer.table)) == 0:
                break
            await asyncio.sleep(0.1)
        log.info("drain over")
        self.drained.set()

    async def stop(self, grace_s: float | None = None) -> None:
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        log.info("shutting down: health NOT_SERVING, finishing in-flight steps (grace %.0fs)", grace)
        await self.health.enter_graceful_shutdown()
        if self._drain_task is not None:
            self._drain_task.cancel()
        if self.server is not None:
            await self.server.stop(grace)
        if self.channels is not None:
            self.channels.stop()  # no new channels; the step thread closes the open ones as it ends
        if self.scheduler is not None:
            await self.scheduler.stop()
        await self.servicer.close()
        if self.metrics_server is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.metrics_server.close)
        for address in self.bound_addresses:
            if address.startswith("unix:"):
                pathlib.Path(address.removeprefix("unix:").removeprefix("//")).unlink(missing_ok=True)
        tracing.shutdown_tracing()
        log.info("stopped")


async def serve(config: ServerConfig) -> int:
    server = DrafterServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    start = asyncio.ensure_future(server.start())
    done, _ = await asyncio.wait({start, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    if start in done and start.exception() is not None:
        await server.stop(0)
        raise start.exception()
    drained = asyncio.ensure_future(server.drained.wait())
    await asyncio.wait({asyncio.ensure_future(stop.wait()), drained}, return_when=asyncio.FIRST_COMPLETED)
    if not start.done():
        start.cancel()
    await server.stop()
    return 0


def run(config: ServerConfig) -> int:
    import sys

    if os.environ.get("DRAFTER_GIL_SWITCH_INTERVAL_S"):  # experiment knob (see docs/performance.md)
        sys.setswitchinterval(float(os.environ["DRAFTER_GIL_SWITCH_INTERVAL_S"]))
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:  # uvloop is optional on platforms without it
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(serve(config))


__all__ = ["DrafterServer", "serve", "run"]
