"""The server's guards on their own: rate-limit buckets, the blocklist filter, and /health when the loop dies."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from serval.config import CacheConfig, EngineConfig
from serval.engine.async_engine import AsyncEngine
from serval.engine.engine import LLMEngine
from serval.server.app import create_app
from serval.server.filters import BlocklistFilter
from serval.server.limits import RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_bucket_refills_over_time():
    clock = Clock()
    limiter = RateLimiter(requests_per_minute=3, tokens_per_minute=None, clock=clock)
    assert [limiter.acquire("k", 1) for _ in range(3)] == [None, None, None]
    wait = limiter.acquire("k", 1)
    assert wait is not None and 1 <= wait <= 20  # one request refills in 20 s
    assert limiter.acquire("other-key", 1) is None  # buckets are per key
    clock.now += 20
    assert limiter.acquire("k", 1) is None


def test_tokens_per_minute_bucket_charges_tokens():
    clock = Clock()
    limiter = RateLimiter(requests_per_minute=None, tokens_per_minute=600, clock=clock)
    assert limiter.acquire("k", 500) is None
    wait = limiter.acquire("k", 200)  # 100 left, 100 more needed at 10 tokens/s
    assert wait == 10
    clock.now += 10
    assert limiter.acquire("k", 200) is None
    assert limiter.acquire("k", 601) == 60  # more than a minute's worth can never pass


def test_rate_limiter_forgets_idle_keys_and_stays_bounded():
    """Keys a client invents (an address, a key) cannot grow the map without bound: a key idle for a minute is
    forgotten (its buckets would be full again anyway), and at most max_keys are kept."""
    clock = Clock()
    limiter = RateLimiter(requests_per_minute=2, tokens_per_minute=1000, clock=clock, max_keys=100)
    for i in range(1000):
        assert limiter.acquire(f"ip:10.0.{i // 256}.{i % 256}", 1) is None
    assert limiter.num_keys == 100
    assert [limiter.acquire("busy", 1), limiter.acquire("busy", 1)] == [None, None]
    assert limiter.acquire("busy", 1) is not None  # the budget holds for a key in use
    clock.now += 59
    assert limiter.acquire("busy", 1) is None  # refilled (20 s a request), and it is used again
    clock.now += 1
    limiter.acquire("late", 1)
    assert limiter.num_keys == 2  # "busy" and "late": the others were idle for a minute, forgotten


def test_blocklist_finds_whole_words_only():
    f = BlocklistFilter(["Seoul", "bad phrase"])
    assert f.find("The capital is Seoul.") == len("The capital is ")
    assert f.find("the capital is seoul") is not None  # case-insensitive
    assert f.find("Seoulite cuisine") is None  # a word, not a substring
    assert f.find("a bad phrase here") == 2
    # A stream searches from where its last search stopped: a word boundary there still sees what precedes it.
    assert f.find("xSeoul", 1) is None and f.find("x Seoul", 1) == 2 and f.find("Seoul x", 1) is None


def test_blocklist_holds_back_what_could_still_become_a_blocked_word():
    f = BlocklistFilter(["Seoul"])
    assert "The capital is Seo"[: f.safe_length("The capital is Seo")] == "The capital is "
    assert f.safe_length("The capital is ") == len("The capital is ")
    phrase = BlocklistFilter(["bad phrase"])
    assert "It is a bad "[: phrase.safe_length("It is a bad ")] == "It is a "


def test_blocklist_needs_a_word():
    with pytest.raises(ValueError, match="at least one word"):
        BlocklistFilter([" ", ""])


def _app_over_a_real_engine(smollm_fp32):
    """(engine, its started AsyncEngine, the app) on the shared float32 weights, served in-process."""
    model, tokenizer = smollm_fp32
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=512, cache=CacheConfig(num_blocks=64)),
                       model=model, tokenizer=tokenizer)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    return engine, async_engine, create_app(async_engine)


@pytest.mark.slow
def test_health_fails_when_the_engine_loop_dies(smollm_fp32):
    engine, async_engine, app = _app_over_a_real_engine(smollm_fp32)

    def broken_step():
        raise RuntimeError("simulated fault in the engine loop")

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://serval") as client:
            assert (await client.get("/health")).status_code == 200
            engine.step = broken_step  # the next step kills the loop
            response = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
            assert response.status_code == 503  # the loop died under it: the server is down, not the request
            assert response.json()["error"]["code"] == "engine_dead"
            for _ in range(50):
                if not async_engine.is_alive:
                    break
                await asyncio.sleep(0.1)
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "dead"
            late = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
            assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"

    try:
        asyncio.run(scenario())
    finally:
        async_engine.shutdown()


@pytest.mark.slow
def test_a_bug_in_a_route_is_an_openai_shaped_500(smollm_fp32):
    _, async_engine, app = _app_over_a_real_engine(smollm_fp32)

    def broken_snapshot():
        raise KeyError("simulated bug")

    async def scenario():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # as a server does: answer, then log
        async with httpx.AsyncClient(transport=transport, base_url="http://serval") as client:
            async_engine.snapshot = broken_snapshot  # every generation route and /engine/state read it first
            for method, path, body in [("GET", "/engine/state", None),
                                       ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 4})]:
                response = await client.request(method, path, json=body, headers={"X-Request-Id": "bug-1"})
                assert response.status_code == 500, response.text
                assert response.json() == {"error": {
                    "message": "internal server error (request id bug-1)", "type": "server_error", "param": None,
                    "code": "internal_error"}}

    try:
        asyncio.run(scenario())
    finally:
        async_engine.shutdown()


@pytest.mark.slow
def test_sliding_window_chat_reports_dropped_turns(smollm_fp32):
    model, tokenizer = smollm_fp32
    config = EngineConfig(dtype="float32", max_model_len=160, context_policy="sliding_window",
                          cache=CacheConfig(num_blocks=64))
    async_engine = AsyncEngine(LLMEngine(config, model=model, tokenizer=tokenizer))
    async_engine.start()
    app = create_app(async_engine)
    history = []
    for i in range(8):
        history += [{"role": "user", "content": f"Tell me fact number {i} about the sea."},
                    {"role": "assistant", "content": f"Fact {i}: the sea is large and full of salty water."}]
    history.append({"role": "user", "content": "What is the capital city of Korea?"})

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://serval") as client:
            body = {"messages": history, "max_tokens": 16, "temperature": 0}
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            dropped = int(response.headers["x-serval-dropped-messages"])
            assert dropped > 0 and dropped % 2 == 0  # whole turns, oldest first
            assert response.json()["usage"]["prompt_tokens"] + 16 <= 160
            short = await client.post("/v1/chat/completions", json={**body, "messages": history[-1:]})
            assert "x-serval-dropped-messages" not in short.headers

    try:
        asyncio.run(scenario())
    finally:
        async_engine.shutdown()
