"""AsyncEngine.from_config: the thread that loads the model is the thread that steps it (one OpenMP worker pool in
the process, not two side by side), and a failed load is raised to the caller. Bad input is raised to the caller of
generate through the engine thread's answer (client.settle)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from real_model import requires_model

from serval import SamplingParams
from serval.config import CacheConfig, EngineConfig
from serval.engine import async_engine
from serval.engine.async_engine import AsyncEngine
from serval.engine.client import settle


@pytest.mark.slow
@requires_model
def test_the_loading_thread_steps_the_engine(monkeypatch):
    threads = {"load": set(), "step": set()}
    real_init, real_step = async_engine.LLMEngine.__init__, async_engine.LLMEngine.step

    def init(self, *args, **kwargs):
        threads["load"].add(threading.get_ident())
        real_init(self, *args, **kwargs)

    def step(self):
        threads["step"].add(threading.get_ident())
        return real_step(self)

    monkeypatch.setattr(async_engine.LLMEngine, "__init__", init)
    monkeypatch.setattr(async_engine.LLMEngine, "step", step)
    engine = AsyncEngine.from_config(EngineConfig(dtype="float32", max_model_len=256, cache=CacheConfig(num_blocks=32)))
    engine.start()
    try:
        async def one() -> str:
            params = SamplingParams(temperature=0, max_tokens=4)
            return [out async for out in engine.generate("r", "The capital of France is", params)][-1].outputs[0].text

        assert asyncio.run(one())
    finally:
        engine.shutdown()
    assert len(threads["load"]) == 1 and threads["step"] == threads["load"]
    assert threading.get_ident() not in threads["load"]


def test_a_failed_load_is_raised_to_the_caller_and_leaves_no_thread():
    def engine_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "serval-engine" and t.is_alive()}

    before = engine_threads()
    with pytest.raises(FileNotFoundError):
        AsyncEngine.from_config(EngineConfig(model="/nonexistent/model.gguf"))
    assert engine_threads() <= before


@pytest.mark.slow
@requires_model
def test_shutdown_before_start_ends_the_waiting_thread():
    """A loaded engine that is never started must not leave its thread waiting forever."""
    engine = AsyncEngine.from_config(EngineConfig(dtype="float32", max_model_len=256, cache=CacheConfig(num_blocks=32)))
    engine.shutdown(timeout=5)
    assert not engine._thread.is_alive()


@pytest.mark.slow
@requires_model
def test_sessions_and_the_kv_state_through_the_engine_thread():
    """A session's turn keeps its blocks, kv_state() (read on the engine thread) shows them, end_session lets go."""
    engine = AsyncEngine.from_config(EngineConfig(dtype="float32", max_model_len=256, cache=CacheConfig(num_blocks=32)))
    engine.start()
    try:
        async def conversation() -> tuple[dict, dict]:
            params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
            prompt = "Once upon a time, in a small village by the sea, there lived"
            async for _ in engine.generate("turn", prompt, params, session_id="conv"):
                pass
            kept = await engine.kv_state()
            engine.end_session("conv")
            return kept, await engine.kv_state()

        kept, ended = asyncio.run(conversation())
    finally:
        engine.shutdown()
    tier = kept["tiers"][0]
    assert tier["blocks"] == 32 == tier["owned"] + tier["cached_free"] + tier["empty"]
    assert [s["session_id"] for s in kept["sessions"]["kept"]] == ["conv"]
    assert kept["sessions"]["kept"][0]["blocks"] == tier["owned_by_sessions"] == tier["owned"] >= 1
    assert ended["sessions"]["kept"] == [] and ended["tiers"][0]["owned"] == 0
    assert ended["tiers"][0]["cached_free"] == tier["owned"] + tier["cached_free"]  # still in the prefix cache


def test_settle_sets_a_result_or_an_error_once_and_leaves_a_done_future_alone():
    async def settled() -> tuple:
        loop = asyncio.get_running_loop()
        answered, failed, cancelled = loop.create_future(), loop.create_future(), loop.create_future()
        settle(answered, {"blocks": 1})
        settle(answered, {"blocks": 2})  # a second answer is dropped
        settle(failed, None, ValueError("bad input"))
        cancelled.cancel()  # its waiter left
        settle(cancelled, None, ValueError("too late"))
        with pytest.raises(ValueError, match="bad input"):
            await failed
        return await answered, cancelled.cancelled()

    assert asyncio.run(settled()) == ({"blocks": 1}, True)


@pytest.mark.slow
@requires_model
def test_bad_input_is_raised_to_the_caller_and_the_engine_serves_on():
    engine = AsyncEngine.from_config(EngineConfig(dtype="float32", max_model_len=256, cache=CacheConfig(num_blocks=32)))
    engine.start()
    try:
        async def bad_then_good() -> str:
            params = SamplingParams(temperature=0, max_tokens=4)
            with pytest.raises(ValueError, match="context"):
                async for _ in engine.generate("long", list(range(1, 300)), params):
                    pass
            return [out async for out in engine.generate("r", "The capital of France is", params)][-1].outputs[0].text

        assert asyncio.run(bad_then_good())
        assert engine.is_alive and engine.num_active_requests == 0
    finally:
        engine.shutdown()
