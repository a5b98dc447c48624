"""`serval bench serve` end to end: the CLI against a real Serval server (the embedded model, served in-process
over HTTP on a loopback port), and against no server at all."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn

from serval.benchmark.client import Endpoint, LoadConfig, run_load
from serval.benchmark.workloads import BenchRequest
from serval.cli import main
from serval.config import CacheConfig, EngineConfig
from serval.engine.async_engine import AsyncEngine
from serval.engine.engine import LLMEngine
from serval.server.app import ServerConfig, create_app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(smollm_fp32):
    """The base URL of a Serval server on the shared float32 weights, serving the model as "smollm2"."""
    model, tokenizer = smollm_fp32
    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32", max_model_len=512, cache=CacheConfig(num_blocks=64)),
                                   model=model, tokenizer=tokenizer))
    engine.start()
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, ServerConfig(served_model_name="smollm2")),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1", tokenizer
    finally:
        server.should_exit = True
        thread.join(30)
        engine.shutdown()


@pytest.mark.slow
def test_bench_serve_reports_what_the_server_generated(served, tmp_path, capsys):
    base_url, tokenizer = served
    out = tmp_path / "run.json"
    code = main(["bench", "serve", "--base-url", base_url, "--model", "smollm2", "--num-requests", "3",
                 "--concurrency", "2", "--input-words", "5:12", "--output-tokens", "3:6", "--ignore-eos",
                 "--seed", "5", "--slo", "ttft=100000,tpot=100000", "--warmup", "0", "--no-progress",
                 "--output", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("machine: ") and "TTFT" in printed and "goodput" in printed

    report = json.loads(out.read_text())
    assert set(report) == {"machine", "description", "config", "summary", "requests"}
    summary, requests = report["summary"], report["requests"]
    assert (summary["num_requests"], summary["completed"], summary["failed"]) == (3, 3, 0)
    assert summary["token_counts_from"] == "usage"
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(summary[key]) == {"mean", "p50", "p90", "p99"}
    assert summary["goodput"]["requests_met"] == 3  # SLOs no request can miss

    # ignore_eos: every request generated exactly what it asked for, and the totals add up.
    assert [r["output_tokens"] for r in requests] == [r["max_tokens"] for r in requests]
    assert all(3 <= r["max_tokens"] <= 6 for r in requests)
    assert summary["output_tokens"] == sum(r["max_tokens"] for r in requests)
    # The prompt tokens the server reported are the tokenizer's count of the prompts the workload built.
    from serval.benchmark.workloads import WorkloadConfig, build_requests

    prompts = build_requests(WorkloadConfig("random", 3, (5, 12), (3, 6), seed=5))
    assert [r["prompt_tokens"] for r in requests] == [len(tokenizer.encode(p.prompt)) for p in prompts]
    assert summary["prompt_tokens"] == sum(len(tokenizer.encode(p.prompt)) for p in prompts)
    assert all(0 < len(r["itl"]) <= r["output_tokens"] - 1 for r in requests)


def test_bench_serve_counts_failed_requests_when_nothing_answers(tmp_path, capsys):
    out = tmp_path / "run.json"
    code = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{_free_port()}/v1", "--num-requests", "2",
                 "--output-tokens", "4", "--warmup", "0", "--no-progress", "--output", str(out)])
    assert code == 1  # nothing completed
    summary = json.loads(out.read_text())["summary"]
    assert (summary["completed"], summary["failed"]) == (0, 2)
    assert summary["errors"] and "ClientConnectorError" in summary["errors"][0]
    assert "2 failed" in capsys.readouterr().out


def test_bench_serve_counts_a_refused_request_as_failed_with_the_servers_message(served, tmp_path, capsys):
    base_url, _ = served
    out = tmp_path / "run.json"
    code = main(["bench", "serve", "--base-url", base_url, "--model", "no-such-model", "--num-requests", "2",
                 "--output-tokens", "4", "--warmup", "0", "--no-progress", "--output", str(out)])
    assert code == 1
    summary = json.loads(out.read_text())["summary"]
    assert (summary["completed"], summary["failed"]) == (0, 2)
    assert summary["errors"][0].startswith("StreamError: HTTP 404: The model `no-such-model` does not exist.")


def test_the_client_reads_crlf_events_and_counts_an_error_in_the_stream_as_a_failure():
    """A server of another make: events ending in CRLF, usage in a chunk without choices, and an error sent after
    a 200 and a first token (what a server whose engine dies mid-stream sends)."""
    from aiohttp import web

    def event(data: dict | str) -> bytes:
        return f"data: {data if isinstance(data, str) else json.dumps(data)}\r\n\r\n".encode()

    async def completions(request):
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if body["prompt"] == "bad":
            await response.write(event({"choices": [{"index": 0, "text": "a"}]}))
            await response.write(event({"error": {"message": "the engine died", "code": "engine_dead"}}))
        else:
            for text in "abc":
                await response.write(event({"choices": [{"index": 0, "text": text}]}))
            await response.write(event({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}))
        await response.write(event("[DONE]"))
        return response

    async def scenario():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", _free_port())
        await site.start()
        try:
            return await run_load(Endpoint(f"http://{site.name.removeprefix('http://')}/v1", "m"),
                                  [BenchRequest("good", 3), BenchRequest("bad", 3)], LoadConfig(concurrency=1),
                                  progress=False)
        finally:
            await runner.cleanup()

    (good, bad), _ = asyncio.run(scenario())
    assert good.ok and good.usage_reported and (good.prompt_tokens, good.output_tokens) == (2, 3)
    assert len(good.itl) == 2  # a gap between each two of the three text chunks
    assert not bad.ok and bad.error == "StreamError: HTTP 200: the engine died"
