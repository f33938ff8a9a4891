"""OpenTelemetry traces (drafter_service/tracing.py), with the SDK's in-memory exporter: a span per engine step on
the unary, stream and step-channel paths, its phases as children, attributes; a refused request's span says so;
an engine's traceparent makes the step span its child. Off by default: no span without setup."""
import pytest
import torch

pytest.importorskip("opentelemetry.sdk", reason="the OpenTelemetry SDK is not installed (the 'tracing' extra)")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from conftest import ServerThread, make_config  # noqa: E402
from drafter_client import DrafterClient, DrafterError, SequenceStep  # noqa: E402
from drafter_service import tracing  # noqa: E402

H = 64


def step(sid, p=0, k=2, width=H):
    return SequenceStep(sid, p, [1, 2, 3], torch.randn(3, width), 4, k)


@pytest.fixture
def exporter():
    exp = InMemorySpanExporter()
    assert tracing.setup_tracing(None, exporter=exp)
    yield exp
    tracing.shutdown_tracing()


def steps_of(exporter):
    return [s for s in exporter.get_finished_spans() if s.name == "drafter.step"]


async def test_a_span_per_step_on_every_path(tiny_model, tmp_path, exporter):
    with ServerThread(make_config(*tiny_model, tmp_path)) as s:
        async with DrafterClient(s.uds, namespace="traced") as c:
            await c.propose([step("a"), step("b", k=3)])
            async with c.stream() as session:
                await session.propose([step("a", p=3)])
            assert await c.open_step_channel(request_bytes=1 << 16, reply_bytes=1 << 16)
            await c.propose([step("a", p=6)])
            with pytest.raises(DrafterError):
                c.close_step_channel()
                await c.propose([step("c", width=H + 1)])
    spans = steps_of(exporter)
    assert [sp.attributes["drafter.transport"] for sp in spans] == ["unary", "stream", "channel", "unary"]
    first = spans[0]
    assert first.attributes["drafter.namespace"] == "traced" and first.attributes["drafter.sequences"] == 2
    assert first.attributes["drafter.committed_tokens"] == 6 and first.attributes["drafter.drafts_asked"] == 5
    children = [x for x in exporter.get_finished_spans() if x.parent and x.parent.span_id == first.context.span_id]
    assert [x.name for x in children] == ["parse", "step", "reply"]
    assert first.start_time <= children[0].start_time <= children[-1].end_time <= first.end_time
    refused = spans[-1]
    assert refused.attributes["drafter.status"] == "INVALID_ARGUMENT" and not refused.status.is_ok


async def test_columnar_requests_are_counted_too(tiny_model, tmp_path, exporter):
    """A batch sent as columns (propose_batch from COLUMNS_MIN_SEQUENCES sequences) has the same span attributes."""
    from drafter_client import StepBatch
    from drafter_client.client import COLUMNS_MIN_SEQUENCES

    n = COLUMNS_MIN_SEQUENCES
    batch = StepBatch(sequence_ids=[f"s{i}" for i in range(n)], start_positions=torch.zeros(n, dtype=torch.int64),
                      num_tokens=torch.full((n,), 2), token_ids=torch.ones(2 * n, dtype=torch.int64),
                      hidden_states=torch.randn(2 * n, H), next_tokens=torch.full((n,), 3), num_drafts=4)
    with ServerThread(make_config(*tiny_model, tmp_path)) as s:
        async with DrafterClient(s.uds, namespace="traced") as c:
            r = await c.propose_batch(batch)
            assert not r.fallback and c._step_columns
    (span,) = steps_of(exporter)
    assert span.attributes["drafter.sequences"] == n and span.attributes["drafter.committed_tokens"] == 2 * n
    assert span.attributes["drafter.drafts_asked"] == 4 * n


async def test_the_engines_trace_is_the_parent(tiny_model, tmp_path, exporter):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with ServerThread(make_config(*tiny_model, tmp_path)) as s:
        async with DrafterClient(s.uds, namespace="traced") as c:
            c._metadata = (("traceparent", f"00-{trace_id}-{parent_id}-01"),)
            await c.propose([step("a")])
    span = steps_of(exporter)[0]
    assert format(span.context.trace_id, "032x") == trace_id and format(span.parent.span_id, "016x") == parent_id


def test_off_unless_asked_for(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert not tracing.setup_tracing(None) and not tracing.enabled()
    tracing.record_step("unary", None, {"enter": 0.0})  # off: a no-op, whatever it is given
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc",
                        reason="the OTLP exporter is not installed (the 'tracing' extra)")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")  # the standard variable turns it on
    try:
        assert tracing.setup_tracing(None) and tracing.enabled()
    finally:
        tracing.shutdown_tracing()
