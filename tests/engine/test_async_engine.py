"""AsyncEngine.from_config: the thread that loads the model is the thread that steps it (one OpenMP worker pool in
the process, not two side by side), and a failed load is raised to the caller."""

from __future__ import annotations

import asyncio
import threading

import pytest
from real_model import requires_model

from serval import SamplingParams
from serval.config import CacheConfig, EngineConfig
from serval.engine import async_engine
from serval.engine.async_engine import AsyncEngine


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
