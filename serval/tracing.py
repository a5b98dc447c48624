"""OpenTelemetry traces of a request's path, off unless configured (`--otlp-traces-endpoint`).

The router's span ("route /v1/...") and its call to a replica (a client span) carry W3C ``traceparent`` to the
replica, whose server span ("POST /v1/...") gets three children when the request ends: ``queue`` (arrival to first
scheduled), ``prefill`` (to the first token) and ``decode`` (to the last), with the request's token counts and
finish reasons as attributes. Each component has its own tracer (a service name, an exporter), so a router and a
server in one process (tests) keep apart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

# Wall clock minus monotonic clock, read once: every instant converts with the same offset, so two spans that
# start at one monotonic instant start at one epoch instant too. Every span's start and end go through it (never
# OpenTelemetry's own wall-clock reads): a wall clock stepped after import (NTP, a resumed VM) would otherwise put
# a child span before its parent.
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def epoch_ns(monotonic_s: float) -> int:
    """A time.monotonic() instant as the epoch nanoseconds spans take."""
    return round(monotonic_s * 1e9) + _EPOCH_OFFSET_NS


@dataclass
class Tracing:
    """A tracer and the W3C propagator, for one component."""

    tracer: Any
    provider: Any

    @classmethod
    def create(cls, service_name: str, endpoint: str | None = None, exporter: Any = None) -> Tracing:
        """Spans go to an OTLP/HTTP collector at ``endpoint`` (batched), or to ``exporter`` as each one ends."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        else:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        return cls(provider.get_tracer("serval"), provider)

    def start_span(self, name: str, headers: Any = None, parent: Any = None, kind: str = "SERVER",
                   start_monotonic: float | None = None):
        """A span whose parent is the ``traceparent`` in ``headers`` (or the span ``parent``)."""
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if parent is not None:
            context = trace.set_span_in_context(parent)
        else:
            context = TraceContextTextMapPropagator().extract(carrier=dict(headers or {}))
        start = epoch_ns(time.monotonic() if start_monotonic is None else start_monotonic)
        return self.tracer.start_span(name, context=context, kind=getattr(trace.SpanKind, kind), start_time=start)

    @staticmethod
    def end(span) -> None:
        """Ends ``span`` now, on the spans' one clock."""
        span.end(end_time=epoch_ns(time.monotonic()))

    @staticmethod
    def inject(span, headers: dict) -> dict:
        """``headers`` with the span's ``traceparent`` added (for a call it makes)."""
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        TraceContextTextMapPropagator().inject(headers, context=trace.set_span_in_context(span))
        return headers

    def finish_request(self, span, log: dict, started: float) -> None:
        """Ends a server span with the request's phases as child spans, from its log line's timings (seconds after
        ``started``, time.monotonic())."""
        end = time.monotonic()
        queue_s, ttft_s = log.get("queue_s"), log.get("ttft_s")
        phases = []
        if queue_s is not None:
            phases.append(("queue", started, started + queue_s))
            if ttft_s is not None:
                phases += [("prefill", started + queue_s, started + ttft_s), ("decode", started + ttft_s, end)]
        for name, begin, finish in phases:
            child = self.start_span(name, parent=span, kind="INTERNAL", start_monotonic=begin)
            child.end(end_time=epoch_ns(finish))
        for key, value in (("http.status_code", log.get("status")), ("serval.request_id", log.get("request_id")),
                           ("gen_ai.usage.prompt_tokens", log.get("prompt_tokens")),
                           ("gen_ai.usage.completion_tokens", log.get("completion_tokens")),
                           ("serval.cached_tokens", log.get("cached_tokens")),
                           ("gen_ai.response.finish_reasons", log.get("finish_reasons"))):
            if value is not None:
                span.set_attribute(key, value)
        span.end(end_time=epoch_ns(end))
