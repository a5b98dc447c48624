"""`serval serve --num-scheduler-steps 4` (multi-step decoding, CUDA's default, asked for here on the CPU) through the
official client: concurrent streamed chats with the model's own sampling defaults (what a user gets: SmolLM2's
temperature 0.2, top-p 0.9) and a seed each, half of them asking for logprobs, get the text, finish and logprobs the
default server (one forward a step) gives each chat alone, and their tokens arrive in runs (fewer content chunks than
tokens)."""

from __future__ import annotations

import asyncio

import pytest
from serverproc import MODEL, Server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOPICS = ["rivers", "owls", "bread", "volcanoes", "chess", "tea"]
MAX_TOKENS = 24


async def _chat(server: Server, topic: str, seed: int) -> tuple[str, str, int, int, list]:
    """(text, finish reason, content chunks, completion tokens, (token, logprob, top tokens) each) of a streamed chat
    with no sampling field but a seed; an even seed asks for logprobs with 2 top ones."""
    logprobs = {"logprobs": True, "top_logprobs": 2} if seed % 2 == 0 else {}
    async with server.async_client() as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Tell me one fact about {topic}."}], stream=True,
            seed=seed, max_tokens=MAX_TOKENS, stream_options={"include_usage": True}, **logprobs)
        text, finish, content_chunks, tokens, scored = "", None, 0, 0, []
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                content_chunks += bool(choice.delta.content)
                finish = choice.finish_reason or finish
                if choice.logprobs is not None:
                    scored += [(lp.token, lp.logprob, [top.token for top in lp.top_logprobs])
                               for lp in choice.logprobs.content or []]
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return text, finish, content_chunks, tokens, scored


async def _concurrent(server: Server) -> list[tuple[str, str, int, int, list]]:
    return list(await asyncio.gather(*(_chat(server, topic, seed) for seed, topic in enumerate(TOPICS))))


def test_seeded_chats_with_the_models_sampling_defaults_get_one_forward_a_steps_text(server, tmp_path):
    # Speculation off: a step with guessed tokens runs one forward, and n-gram guesses come often at a few streams.
    multi_step = Server(["--num-scheduler-steps", "4", "--speculative-model", "none"], tmp_path / "multi-step.log")
    multi_step.start()
    try:
        alone = [asyncio.run(_chat(server, topic, seed)) for seed, topic in enumerate(TOPICS)]
        multi_step.wait_ready()
        together = asyncio.run(_concurrent(multi_step))
    finally:
        multi_step.stop()
    assert [(text, finish, scored) for text, finish, _, _, scored in together] == \
        [(text, finish, scored) for text, finish, _, _, scored in alone]
    assert all(text and finish in ("stop", "length") for text, finish, *_ in alone)
    assert len({text for text, *_ in alone}) == len(TOPICS)
    # Every token of a chat that asked has its logprob and 2 top ones; the others have none.
    assert [len(scored) == tokens and all(len(top) == 2 for *_, top in scored)
            for _, _, _, tokens, scored in alone] == [True, False] * (len(TOPICS) // 2)
    # One forward a step sends about a chunk a token; runs of 4 send a run's tokens together.
    assert sum(chunks for _, _, chunks, _, _ in alone) > 0.8 * sum(tokens for _, _, _, tokens, _ in alone)
    assert sum(chunks for _, _, chunks, _, _ in together) < sum(tokens for _, _, _, tokens, _ in together) / 2
