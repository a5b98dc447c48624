"""OpenTelemetry spans of one request's path, router -> replica HTTP -> queue -> prefill -> decode, caught by in-memory
exporters (one per component, as two processes would have): the W3C traceparent the client sends is the root, the
router's call to the replica carries it on, and the replica's span holds the request's phases and token counts."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from serverproc import Server

from serval import tracing as tracing_module
from serval.cluster.router import RouterConfig, create_router_app
from serval.config import CacheConfig, EngineConfig
from serval.engine.async_engine import AsyncEngine
from serval.engine.engine import LLMEngine
from serval.server.app import ServerConfig, create_app
from serval.tracing import Tracing

pytestmark = pytest.mark.slow
TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@contextmanager
def _serving(app):
    """``app`` on a free loopback port, on a thread of this process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_request_through_the_router_is_one_trace_down_to_its_decode(smollm_fp32, tmp_path, monkeypatch):
    model, tokenizer = smollm_fp32
    # The wall clock stepped 41 s forward since serval.tracing read it (as NTP did once in CI): the spans still nest,
    # since every start and end is on the spans' one clock, not OpenTelemetry's own wall-clock reads.
    monkeypatch.setattr(tracing_module, "_EPOCH_OFFSET_NS", tracing_module._EPOCH_OFFSET_NS - 41_000_000_000)
    router_spans, server_spans = InMemorySpanExporter(), InMemorySpanExporter()
    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32", max_model_len=512, cache=CacheConfig(num_blocks=64)),
                                   model=model, tokenizer=tokenizer))
    engine.start()
    server_config = ServerConfig(tracing=Tracing.create("serval", exporter=server_spans))
    try:
        with _serving(create_app(engine, server_config)) as replica:
            router_config = RouterConfig([replica], tracing=Tracing.create("serval-router", exporter=router_spans))
            with _serving(create_router_app(router_config)) as router:
                client = Server([], tmp_path / "unused.log", port=int(router.rsplit(":", 1)[1])).client()
                answer = client.chat.completions.create(
                    model="smollm2-135m-instruct", max_tokens=6, temperature=0,
                    messages=[{"role": "user", "content": "Name a colour."}],
                    extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
                deadline = time.monotonic() + 10
                while len(server_spans.get_finished_spans()) < 4 or len(router_spans.get_finished_spans()) < 2:
                    assert time.monotonic() < deadline, "spans did not arrive"
                    time.sleep(0.05)
    finally:
        engine.shutdown()

    by_name = {s.name: s for s in router_spans.get_finished_spans() + server_spans.get_finished_spans()}
    route, call = by_name["route /v1/chat/completions"], by_name[f"POST {replica}/v1/chat/completions"]
    served = by_name["POST /v1/chat/completions"]
    queue, prefill, decode = by_name["queue"], by_name["prefill"], by_name["decode"]
    assert {f"{s.context.trace_id:032x}" for s in by_name.values()} == {TRACE_ID}  # one trace, the client's
    assert f"{route.parent.span_id:016x}" == PARENT_ID
    assert call.parent.span_id == route.context.span_id and served.parent.span_id == call.context.span_id
    assert all(s.parent.span_id == served.context.span_id for s in (queue, prefill, decode))
    assert route.resource.attributes["service.name"] == "serval-router"
    assert served.resource.attributes["service.name"] == "serval"
    assert call.attributes["serval.replica"] == replica and call.attributes["serval.routing.policy"] == "cache_aware"
    assert served.attributes["gen_ai.usage.completion_tokens"] == answer.usage.completion_tokens == 6
    assert served.attributes["gen_ai.usage.prompt_tokens"] == answer.usage.prompt_tokens
    assert list(served.attributes["gen_ai.response.finish_reasons"]) == ["length"]
    # The phases follow one another inside the request, inside the router's call, inside the route.
    assert route.start_time <= call.start_time <= served.start_time <= queue.start_time
    assert queue.end_time == prefill.start_time and prefill.end_time == decode.start_time
    assert decode.end_time <= served.end_time <= call.end_time <= route.end_time
