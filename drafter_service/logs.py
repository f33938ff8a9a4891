"""Logging set-up of drafter-serve: human-readable lines (the default) or one JSON object per line
(``--log-format json``) with time, level, logger, message and, where known, the request id and namespace.

Request context: the gRPC handlers set ``request_context`` (a contextvar) while they handle a call, so every line
logged on their behalf carries it; a line can also pass ``extra={"namespace": ..., "request_id": ...}``.
"""
import contextvars
import datetime
import json
import logging

# (namespace, request_id) of the call being handled on this task, or None
request_context: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("drafter_request",
                                                                                         default=None)
HUMAN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, [namespace, request_id],
    [exception]."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                   timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        ctx = request_context.get()
        namespace = getattr(record, "namespace", None) or (ctx[0] if ctx else None)
        request_id = getattr(record, "request_id", None) or (ctx[1] if ctx else None)
        if namespace is not None:
            out["namespace"] = namespace
        if request_id:
            out["request_id"] = request_id
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(level: str, fmt: str = "text") -> None:
    """Configure the root logger once: level name, and fmt "text" or "json"."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(HUMAN_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
