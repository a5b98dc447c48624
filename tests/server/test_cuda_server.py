"""`serval serve --device cuda` with the GPU's defaults: 32 concurrent streamed chats each get the text the same
request gets alone, greedy and with the model's sampling defaults and a seed (both run in multi-step runs). Skipped
without a CUDA device."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from real_model import requires_model
from serverproc import MODEL, Server

pytestmark = [pytest.mark.gpu, requires_model,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOPICS = ["rivers", "owls", "bread", "volcanoes", "chess", "tea", "bicycles", "glaciers", "bees", "lighthouses",
          "comets", "violins", "deserts", "octopuses", "paper", "thunder", "maple trees", "trains", "coral reefs",
          "clocks", "penguins", "salt", "windmills", "fireflies", "bridges", "honey", "caves", "kites", "whales",
          "mushrooms", "tides", "glass"]
MAX_TOKENS = 32


async def _chats(server: Server, concurrent: bool, sampled: bool = False) -> list[tuple[str, str]]:
    """(text, finish reason) of a streamed chat about each topic, greedy or (``sampled``) with the model's sampling
    defaults and the topic's index as its seed: all at once, or one after another."""
    async with server.async_client() as client:
        async def one(seed: int, topic: str) -> tuple[str, str]:
            sampling = {"seed": seed} if sampled else {"temperature": 0}
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Tell me one fact about {topic}."}], stream=True,
                max_tokens=MAX_TOKENS, **sampling)
            text, finish = "", None
            async for chunk in stream:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
            return text, finish

        if concurrent:
            return list(await asyncio.gather(*(one(seed, topic) for seed, topic in enumerate(TOPICS))))
        return [await one(seed, topic) for seed, topic in enumerate(TOPICS)]


@pytest.mark.parametrize("flags", [[], ["--async-scheduling"]], ids=["defaults", "async-scheduling"])
def test_32_concurrent_streamed_chats_each_equal_the_same_chat_alone(tmp_path, flags):
    server = Server(["--device", "cuda", *flags], tmp_path / "cuda-serve.log").start()  # float32, else every default
    try:
        server.wait_ready()
        start = time.perf_counter()
        alone = asyncio.run(_chats(server, concurrent=False))
        alone_s = time.perf_counter() - start
        start = time.perf_counter()
        together = asyncio.run(_chats(server, concurrent=True))
        together_s = time.perf_counter() - start
        print(f"\n{len(TOPICS)} chats of up to {MAX_TOKENS} tokens on {torch.cuda.get_device_name()}: "
              f"{alone_s:.2f} s one after another, {together_s:.2f} s all at once")
        print("\n".join(line for line in server.log().splitlines() if "KV cache" in line))
        sampled_alone = asyncio.run(_chats(server, concurrent=False, sampled=True))
        sampled_together = asyncio.run(_chats(server, concurrent=True, sampled=True))
    finally:
        server.stop()
    assert all(text and finish in ("stop", "length") for text, finish in alone + sampled_alone)
    assert together == alone
    assert sampled_together == sampled_alone and sampled_alone != alone
