"""Faults a server must survive: clients that vanish, overload, and SIGTERM while streams are running."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import uuid

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serverproc import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def small(_launched):
    """The single-sequence server: --max-num-seqs 1 --max-waiting 1 --api-key --protect-health. The graceful
    shutdown test stops it, so it is the last test here to use it."""
    return _launched["small"].wait_ready()


def assert_openai_error(response: httpx.Response, status: int, type: str) -> None:
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.json()["error"]["type"] == type


def sse_events(lines) -> list[dict | str]:
    """Parsed `data:` payloads of an SSE line iterator (the final "[DONE]" stays a string)."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_disconnect_storm_frees_everything_and_logs_one_line_each(server):
    body = {"model": MODEL, "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
    request_ids = [f"storm-{uuid.uuid4().hex[:8]}-{i}" for i in range(16)]
    log_start = len(server.log())

    async def start_and_leave(i: int) -> int:
        chunks = 0
        async with httpx.AsyncClient(timeout=120) as http:
            async with http.stream("POST", f"{server.url}/v1/completions", headers={"X-Request-Id": request_ids[i]},
                                   json={**body, "prompt": f"Story {i}: once upon a time"}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        chunks += 1
                        if chunks == 3:
                            break  # leaving the block closes the connection mid-stream
        return chunks

    async def storm() -> list[int]:
        return await asyncio.gather(*(start_and_leave(i) for i in range(16)))

    assert asyncio.run(storm()) == [3] * 16

    def idle() -> bool:
        m = server.metrics()
        return (m["serval:kv_cache_blocks_owned"] == 0 and m["serval:num_requests_running"] == 0
                and m["serval:num_requests_waiting"] == 0)

    assert wait_for(idle, timeout=60), server.metrics()  # a hang guard: two loaded cores abort 16 streams in seconds
    state = httpx.get(f"{server.url}/engine/state", timeout=10).json()
    assert state["num_running"] == 0 and state["num_free_blocks"] == state["num_blocks"]
    r = server.client().completions.create(model=MODEL, prompt="After the storm,", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4

    # The log stays clean: no traceback, and one request line per abandoned stream that says it was aborted.
    log = server.log()[log_start:]
    assert "Traceback" not in log and "RuntimeError" not in log and "ERROR" not in log, log[-3000:]
    for rid in request_ids:
        lines = [line for line in log.splitlines() if rid in line]
        assert len(lines) == 1, lines
        assert " INFO serval.requests: " in lines[0]
        record = json.loads(lines[0][lines[0].index("{"):])
        assert record["request_id"] == rid and record["aborted"] is True
        assert record["finish_reasons"] == ["abort"] and record["completion_tokens"] >= 2


def scrape(server) -> dict[str, float]:
    """Every unlabelled sample of /metrics, parsed as Prometheus text exposition."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if not sample.labels}


@pytest.mark.parametrize("stream, n", [(False, 1), (True, 1), (False, 2), (True, 2)])
def test_metrics_count_one_ttft_per_choice_and_the_rest_as_inter_token_latencies(server, stream, n):
    tokens = 10
    before = scrape(server)
    r = server.client().completions.create(model=MODEL, prompt="Metrics matter because", max_tokens=tokens,
                                           temperature=0.7, seed=1, n=n, stream=stream,
                                           extra_body={"ignore_eos": True})
    if stream:
        r = list(r)
        assert len(r) >= tokens
    after = scrape(server)

    def grew(name: str) -> float:
        return after[f"serval:{name}"] - before[f"serval:{name}"]

    assert grew("generation_tokens_total") == n * tokens
    assert grew("time_to_first_token_seconds_count") == n
    assert grew("inter_token_latency_seconds_count") == n * (tokens - 1)
    assert grew("e2e_request_latency_seconds_count") == 1
    assert grew("time_to_first_token_seconds_sum") > 0 and grew("e2e_request_latency_seconds_sum") > 0
    assert grew("e2e_request_latency_seconds_sum") >= grew("time_to_first_token_seconds_sum") / n
    assert after["serval:engine_alive"] == 1 and after["serval:kv_cache_blocks_total"] > 0


def test_protect_health_requires_the_key(small):
    assert httpx.get(f"{small.url}/health", timeout=10).status_code == 401
    assert httpx.get(f"{small.url}/health", headers=small.headers, timeout=10).json() == {"status": "ok"}


def test_overload_is_503_and_the_admitted_complete(small):
    """One running, one waiting: of six at once, the rest are shed with 503 and the admitted ones finish."""

    async def burst():
        async with small.async_client() as client:
            async def one(i: int):
                try:
                    return await client.completions.create(model=MODEL, prompt=f"Tale {i}:", max_tokens=24,
                                                           temperature=0, extra_body={"ignore_eos": True})
                except openai.APIStatusError as exc:
                    return exc

            return await asyncio.gather(*(one(i) for i in range(6)))

    results = asyncio.run(burst())
    shed = [r for r in results if isinstance(r, openai.APIStatusError)]
    served = [r for r in results if not isinstance(r, openai.APIStatusError)]
    assert shed, results
    for e in shed:
        assert_openai_error(e.response, 503, type="server_error")
        assert e.response.headers.get("retry-after")
    assert 1 <= len(served) <= 2, results
    assert all(r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length" for r in served)
    assert small.client().completions.create(model=MODEL, prompt="Calm again", max_tokens=2).usage


def test_sigterm_drains_running_streams_then_exits(small):
    """Keep this test last in the file: it stops the `small` server."""
    shutdown_timeout = float(small.args[small.args.index("--shutdown-timeout") + 1])
    events: list = []
    first_chunk = threading.Event()

    def stream():
        # Long enough to outlast the signal and the late request below on a quiet machine (speculation included).
        body = {"model": MODEL, "prompt": "A long poem about the sea:", "max_tokens": 256, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{small.url}/v1/completions", json=body, headers=small.headers,
                          timeout=120) as r:
            for line in r.iter_lines():
                events.extend(sse_events([line]))
                first_chunk.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert first_chunk.wait(60)
    small.proc.send_signal(signal.SIGTERM)
    sent_at = time.monotonic()
    time.sleep(0.5)  # the signal handler runs on the server's main thread

    # During the drain a new request is refused: the listener is closed, or the server answers 503.
    try:
        late = httpx.post(f"{small.url}/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 1},
                          headers=small.headers, timeout=10)
    except httpx.TransportError:
        pass
    else:
        assert_openai_error(late, 503, type="server_error")
    assert reader.is_alive(), "the stream ended before the drain could be observed"

    reader.join(shutdown_timeout + 10)
    assert not reader.is_alive()
    assert events and events[-1] == "[DONE]"
    choices = [c for e in events[:-1] for c in e["choices"]]
    assert choices[-1]["finish_reason"] == "length" and "".join(c["text"] for c in choices)
    assert events[-2]["usage"]["completion_tokens"] == 256  # all of it, not cut off by the shutdown

    rc = small.proc.wait(shutdown_timeout + 10)
    assert rc == 0, small.log()[-3000:]
    assert time.monotonic() - sent_at < shutdown_timeout


def test_a_client_that_leaves_a_non_streamed_request_frees_its_blocks(server):
    """Not streamed, nothing is written to the client until the end: the server watches the connection instead, and
    a client that gives up (a timeout, a router that cancelled) aborts its request as a stream's would."""
    rid = f"gone-{uuid.uuid4().hex[:8]}"
    log_start = len(server.log())
    body = {"model": MODEL, "prompt": "A very long story begins:", "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=3)

    def idle() -> bool:
        m = server.metrics()
        return m["serval:kv_cache_blocks_owned"] == 0 and m["serval:num_requests_running"] == 0

    def logged():
        return [line for line in server.log()[log_start:].splitlines() if rid in line]

    assert wait_for(lambda: idle() and logged(), timeout=30), server.metrics()
    record = json.loads(logged()[0][logged()[0].index("{"):])
    assert record["aborted"] is True and record["finish_reasons"] == ["abort"]
    assert 0 < record["completion_tokens"] < 4000
