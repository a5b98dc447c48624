"""Sends a workload to an OpenAI-compatible server, streaming, and times every chunk. Load is a fixed number of
requests in flight, Poisson arrivals at a rate, or both (arrivals, then a cap).

The client is aiohttp reading the server-sent events itself, not the official openai client: on a machine whose
cores the server also uses, the client's own CPU time per chunk slows the server it measures, and the official
client's (an HTTP/1.1 parser in Python, a pydantic object per chunk) was about as much as the server's front end.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass

from serval.benchmark.metrics import RequestResult
from serval.benchmark.workloads import BenchRequest


@dataclass
class Endpoint:
    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str
    api_key: str | None = None
    chat: bool = False  # /v1/chat/completions instead of /v1/completions
    ignore_eos: bool = False
    temperature: float = 0.0
    timeout_s: float = 600.0


@dataclass
class LoadConfig:
    concurrency: int | None = None  # most requests in flight; None: no cap
    request_rate: float = math.inf  # requests per second with Poisson arrivals; inf: all sent at once
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"LoadConfig.concurrency must be positive, got {self.concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"LoadConfig.request_rate must be positive, got {self.request_rate}")


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """When each request is due, in seconds from the start: a seeded Poisson process (exponential gaps), the first
    at 0; all at 0 for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(num_requests):
        offsets.append(t)
        t += rng.expovariate(request_rate)
    return offsets


class StreamError(Exception):
    """The server refused the request or put an error in its stream."""


def _error_message(status: int, body: bytes) -> str:
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {status}: {message or body[:200].decode(errors='replace')}"


async def _events(response):
    """The data fields of a server-sent event stream, as bytes, until [DONE] or the end of the body."""
    pending = b""
    async for data in response.content.iter_any():
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return
                yield payload


async def send_one(session, endpoint: Endpoint, request: BenchRequest, run_start: float) -> RequestResult:
    """One streamed request. Any failure (HTTP error, an error in the stream, a dropped connection) is a failed
    result, not an exception: a benchmark counts failures."""
    # ignore_eos is an extension Serval, vLLM and llama.cpp's server all accept. min_tokens is not sent: with
    # ignore_eos it adds nothing, and not every server knows it.
    body = {"model": endpoint.model, "max_tokens": request.max_tokens, "temperature": endpoint.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint.ignore_eos:
        body["ignore_eos"] = True
    if endpoint.chat:
        url, body["messages"] = f"{endpoint.base_url.rstrip('/')}/chat/completions", request.chat_messages()
    else:
        url, body["prompt"] = f"{endpoint.base_url.rstrip('/')}/completions", request.completion_prompt()
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else None
    start = time.perf_counter()
    result = RequestResult(ok=False, start=start - run_start, max_tokens=request.max_tokens)
    chunk_times: list[float] = []
    usage = None
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                raise StreamError(_error_message(response.status, await response.read()))
            async for payload in _events(response):
                now = time.perf_counter()
                chunk = json.loads(payload)
                if chunk.get("error"):
                    raise StreamError(_error_message(200, payload))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") if endpoint.chat else choice.get("text")
                    if text:
                        chunk_times.append(now)
                        break
        end = time.perf_counter()
    except Exception as exc:  # noqa: BLE001  (every way a request can fail is a failed request)
        result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}".rstrip(": ")
        result.e2e = time.perf_counter() - start
        return result
    result.ok = True
    result.e2e = end - start
    result.ttft = (chunk_times[0] if chunk_times else end) - start
    result.itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    if usage is not None:
        result.usage_reported = True
        result.prompt_tokens = usage.get("prompt_tokens") or 0
        result.output_tokens = usage.get("completion_tokens") or 0
    else:
        result.output_tokens = len(chunk_times)
    return result


async def run_load(endpoint: Endpoint, requests: list[BenchRequest], load: LoadConfig,
                   progress: bool = True) -> tuple[list[RequestResult], float]:
    """Sends every request under ``load``; returns the results in request order and the wall time in seconds."""
    try:
        import aiohttp
    except ImportError:
        raise ValueError("bench serve needs aiohttp: pip install 'serval[bench]' (or aiohttp)") from None
    from tqdm import tqdm

    offsets = arrival_offsets(len(requests), load.request_rate, load.seed)
    limit = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    bar = tqdm(total=len(requests), unit="req", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    # No connection cap but the load's own; no retries (a benchmark counts failures). A connection a request: one
    # kept alive between requests may be one the server has just closed (llama-server does), and a request sent on
    # it fails for the client's reason, not the server's.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=endpoint.timeout_s)) as client:
        run_start = time.perf_counter()

        async def one(request: BenchRequest, offset: float) -> RequestResult:
            delay = run_start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                result = await send_one(client, endpoint, request, run_start)
            else:
                async with limit:
                    result = await send_one(client, endpoint, request, run_start)
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(r, t) for r, t in zip(requests, offsets)))
        duration = time.perf_counter() - run_start
    bar.close()
    return list(results), duration
