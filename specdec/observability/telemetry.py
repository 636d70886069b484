"""Tracing and logging set-up of one specdec process: a service, or the CLI client.

Tracing is off unless ``OTEL_TRACES_EXPORTER`` names exporters (comma-separated): ``otlp`` (OTLP
over gRPC to ``OTEL_EXPORTER_OTLP_ENDPOINT``, for Jaeger, Tempo or an OpenTelemetry Collector),
``console``, or any other installed OpenTelemetry span exporter by its entry-point name. The other
standard ``OTEL_*`` variables apply as the SDK reads them (endpoint, headers, sampler, batch span
processor). ``service.name`` is ``specdec-<service>`` unless ``OTEL_SERVICE_NAME`` is set.

With tracing on, opentelemetry-instrumentation-grpc instruments every gRPC server and channel the
process opens (health checks excepted): each call is a span, and the W3C ``traceparent`` rides in
the call's metadata, so one request is one trace across the coordinator, draft and verify
processes. The long-lived Step streams are left out too: each call they carry has its own client
and server span instead, its context in the call's header (:mod:`specdec.rpc.step_server`). With
tracing off no provider is installed and every span is the API's no-op.
"""

import contextlib
import importlib.metadata
import logging
import os

from opentelemetry import trace
from opentelemetry.instrumentation.grpc import (
    GrpcAioInstrumentorClient,
    GrpcAioInstrumentorServer,
    GrpcInstrumentorClient,
    GrpcInstrumentorServer,
)
from opentelemetry.instrumentation.grpc.filters import any_of, health_check, method_name, negate
from opentelemetry.instrumentation.logging import LoggingInstrumentor
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from pythonjsonlogger.json import JsonFormatter

EXPORTER_ENTRY_POINTS = "opentelemetry_traces_exporter"
# whether this process traces: None until configure_tracing decides (see current_span)
_tracing: bool | None = None


def exporter_names() -> list[str]:
    """The span exporters ``OTEL_TRACES_EXPORTER`` names (default ``none``: no tracing)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = (name.strip() for name in os.environ.get("OTEL_TRACES_EXPORTER", "none").split(","))
    return [name for name in names if name and name != "none"]


def _exporter(name: str):
    """The span exporter registered under ``name``; ``otlp`` is the OTLP exporter of the protocol
    ``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL`` sets (default grpc), as the SDK resolves it."""
    if name == "otlp":
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
            "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
        )
        name = "otlp_proto_grpc" if protocol == "grpc" else "otlp_proto_http"
    entries = importlib.metadata.entry_points(group=EXPORTER_ENTRY_POINTS, name=name)
    if not entries:
        installed = sorted(entry.name for entry in importlib.metadata.entry_points(group=EXPORTER_ENTRY_POINTS))
        raise ValueError(
            f"OTEL_TRACES_EXPORTER names {name!r}, which is not installed; installed: {', '.join(installed)}"
        )
    return next(iter(entries)).load()()


def configure_tracing(service: str) -> bool:
    """Installs the global tracer provider and instruments gRPC when ``OTEL_TRACES_EXPORTER`` names
    an exporter; returns whether it did. Spans are exported in batches, and flushed at exit.

    Raises:
        ValueError: an exporter that is not installed.
    """
    global _tracing
    names = exporter_names()
    if not names:
        _tracing = False
        return False
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: f"specdec-{service}"}
    provider = TracerProvider(resource=Resource.create(attributes))
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    trace.set_tracer_provider(provider)
    traced = negate(any_of(health_check(), method_name("Step")))
    for instrumentor in (
        GrpcInstrumentorServer,
        GrpcAioInstrumentorServer,
        GrpcInstrumentorClient,
        GrpcAioInstrumentorClient,
    ):
        instrumentor(filter_=traced).instrument()
    return True


def current_span(tracer: trace.Tracer, name: str, **kwargs) -> contextlib.AbstractContextManager[trace.Span]:
    """``tracer.start_as_current_span(name, **kwargs)`` where a tracer provider is installed; with
    tracing off, the invalid span without touching the current context. For spans made per round or
    per call: the API's no-op span still sets and resets the current context, and those of the
    coordinator's rounds and Step calls were 14% of its CPU at 64 streams with tracing off.

    In a process whose :func:`configure_tracing` installed nothing, tracing is off for good,
    without asking the API, whose ``get_tracer_provider`` looks ``OTEL_PYTHON_TRACER_PROVIDER`` up
    in the environment at every call (a KeyError raised and caught in ``os.environ``: 7% of the
    coordinator's CPU at 64 streams). A process that never called it (a test, an embedding
    program) asks the API each time."""
    if _tracing is False or (_tracing is None and isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)):
        return contextlib.nullcontext(trace.INVALID_SPAN)
    return tracer.start_as_current_span(name, **kwargs)


def configure_logging(service: str, level: str, log_format: str) -> None:
    """Root logging to stderr: ``text`` lines, or ``json`` lines (one object per record, with
    ``timestamp``, ``level``, ``logger``, ``message``, ``service``). Both carry the trace and span
    id of the span active when the record was made (``0`` outside any span or with tracing off)."""
    LoggingInstrumentor().instrument(inject_trace_context=True, enable_log_auto_instrumentation=False)
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s %(otelTraceID)s %(otelSpanID)s",
                rename_fields={
                    "asctime": "timestamp",
                    "levelname": "level",
                    "name": "logger",
                    "otelTraceID": "trace_id",
                    "otelSpanID": "span_id",
                },
                static_fields={"service": service},
            )
        )
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s [trace_id=%(otelTraceID)s]: %(message)s")
        )
    logging.basicConfig(level=level, handlers=[handler], force=True)
