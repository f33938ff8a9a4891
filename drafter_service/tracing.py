"""OpenTelemetry traces of engine steps (off by default; the ``tracing`` extra installs the SDK).

On with ``--otel-endpoint URL`` (OTLP over gRPC) or the standard variables (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; ``OTEL_SERVICE_NAME`` names the service, default "drafter"). Each Propose,
ProposeStream message and step-channel request becomes one span ``drafter.step`` whose children are its phases
(``parse``, ``step`` (queue wait + the proposer step), ``reply``), with attributes: transport (unary, stream,
channel), namespace, request id, sequences, committed tokens, drafts asked, and the status. A W3C ``traceparent``
in the call's metadata makes the span a child of the engine's trace.

Phase times are taken with time.perf_counter() where the work happens (the servicer, the step channels) and turned
into span timestamps here, after the reply left, so tracing adds no work inside the step.
"""
import logging
import os
import time

log = logging.getLogger(__name__)

_tracer = None  # opentelemetry Tracer while tracing is on
_provider = None


def _epoch_ns(perf_t: float, now_perf: float, now_ns: int) -> int:
    return now_ns - int((now_perf - perf_t) * 1e9)


def setup_tracing(endpoint: str | None, exporter=None) -> bool:
    """Turn tracing on when endpoint, the OTEL_* variables or an exporter (tests: the SDK's in-memory one) say so.
    Returns whether it is on. Raises RuntimeError naming the missing package when the SDK is not installed."""
    global _tracer, _provider
    env = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not (endpoint or env or exporter is not None):
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        raise RuntimeError("tracing needs the OpenTelemetry SDK: pip install 'drafter-sidecar[tracing]'") from None
    from drafter_service import __version__

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "drafter"),
                                "service.version": __version__})
    provider = TracerProvider(resource=resource)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint) if endpoint
                                                       else OTLPSpanExporter()))
    _provider, _tracer = provider, provider.get_tracer("drafter_service")
    log.info("OpenTelemetry traces on (%s)", endpoint or env or "in-process exporter")
    return True


def shutdown_tracing() -> None:
    """Flush and stop the exporter (server shutdown)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


def record_step(transport: str, request, phases: dict[str, float], code: str = "OK", metadata=None) -> None:
    """One span for an engine step that is over. phases: perf_counter() times "enter", "parsed", "stepped",
    "replied" (missing ones end the span early: a refused request has no "stepped"). metadata: the call's
    invocation metadata, for a W3C traceparent."""
    tracer = _tracer
    if tracer is None or "enter" not in phases:
        return
    from opentelemetry import propagate, trace

    now_perf, now_ns = time.perf_counter(), time.time_ns()
    ns = {k: _epoch_ns(v, now_perf, now_ns) for k, v in phases.items()}
    end = ns.get("replied") or max(ns.values())
    parent = propagate.extract({k: v for k, v in (metadata or ()) if isinstance(v, str)}) if metadata else None
    sequences, committed, asked = _request_size(request)
    attrs = {"drafter.transport": transport, "drafter.namespace": request.namespace,
             "drafter.request_id": int(request.request_id), "drafter.sequences": sequences,
             "drafter.committed_tokens": committed, "drafter.drafts_asked": asked, "drafter.status": code}
    span = tracer.start_span("drafter.step", context=parent, start_time=ns["enter"], attributes=attrs)
    if code != "OK":
        span.set_status(trace.Status(trace.StatusCode.ERROR, code))
    ctx = trace.set_span_in_context(span)
    marks = [("parse", "enter", "parsed"), ("step", "parsed", "stepped"), ("reply", "stepped", "replied")]
    for name, a, b in marks:
        if a in ns and b in ns:
            tracer.start_span(name, context=ctx, start_time=ns[a]).end(end_time=ns[b])
    span.end(end_time=end)


def _request_size(request) -> tuple[int, int, int]:
    """(sequences, committed tokens, drafts asked) of a request, per-sequence messages or columns (a column that
    does not decode, in a refused request, counts 0), or a step channel's request frame."""
    from drafter_client.protocol.step_frame import RequestFrame
    if isinstance(request, RequestFrame):
        return len(request.sequence_ids), int(request.token_ids.shape[0]), int(request.columns["num_drafts"].sum())
    if not request.HasField("columns"):
        steps = request.steps
        return len(steps), sum(s.num_tokens for s in steps), sum(s.num_drafts for s in steps)
    from drafter_client.protocol import pb
    from drafter_client.protocol.wire import WireError, decode_tensor

    c = request.columns

    def total(t) -> int:
        try:
            return sum(decode_tensor(t, "", (pb.INT32, pb.INT64), rank=1).tolist())
        except WireError:
            return 0

    return len(c.sequence_ids), total(c.num_tokens), total(c.num_drafts)
