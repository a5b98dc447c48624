"""/v1/completions with echo, as evaluation harnesses (lm-eval) score log-likelihoods: the echoed prompt's tokens
come with their logprobs, and max_tokens=0 scores the prompt without generating. Through the official client."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from serval.layers.linear import use_activation_quantization
from serval.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2-135m-instruct"
PROMPT = "The serval is a wild cat native to Africa. It has the longest legs of any cat relative to its size."


def tokenize(server, prompt: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}, headers=server.headers, timeout=30)
    r.raise_for_status()
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def engine_scores(make_llm) -> list:
    """The offline engine's prompt logprobs (top 5) of PROMPT, on the same float32 weights and settings (the
    server's activation quantization, "auto", included)."""
    llm = make_llm(activation_quantization="auto")
    scores = llm.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=5), use_tqdm=False)[0].prompt_logprobs
    use_activation_quantization(llm.engine.model, "none")  # the shared weights back to make_llm's default
    return scores


def stream_choice(stream) -> tuple[str, dict, str | None, object, int]:
    """(text, joined logprobs, finish_reason, usage, number of chunks with text) of a one-choice stream."""
    text, finish, usage, num_text_chunks = "", None, None, 0
    logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.text
            num_text_chunks += bool(choice.text)
            finish = choice.finish_reason or finish
            if choice.logprobs is not None:
                for key in logprobs:
                    logprobs[key] += getattr(choice.logprobs, key)
    return text, logprobs, finish, usage, num_text_chunks


def test_echo_with_max_tokens_zero_scores_the_prompt(server, client, engine_scores):
    ids = tokenize(server, PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0, logprobs=5)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    assert r.usage.total_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert all(isinstance(v, float) and v < 0 for v in lp.token_logprobs[1:])
    assert math.isfinite(sum(lp.token_logprobs[1:]))
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in engine_scores[1:]], abs=1e-5)
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert len(top) == 5 and max(top.values()) >= value - 1e-6
        if token in top:
            assert top[token] == pytest.approx(value)
    # Offsets point into the echoed text.
    assert "".join(lp.tokens) == PROMPT
    assert all(PROMPT[offset:].startswith(token) for token, offset in zip(lp.tokens, lp.text_offset))


def test_echo_with_generation_covers_the_prompt_then_the_new_tokens(server, client, engine_scores):
    ids = tokenize(server, PROMPT)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=3, temperature=0, logprobs=2)
    choice = r.choices[0]
    generated = plain.choices[0]
    assert choice.text == PROMPT + generated.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 3
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([e.logprob for e in engine_scores[1:]], abs=1e-5)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert lp.tokens[len(ids):] == generated.logprobs.tokens
    assert lp.token_logprobs[len(ids):] == pytest.approx(generated.logprobs.token_logprobs, abs=1e-5)
    assert lp.text_offset[len(ids):] == [len(PROMPT) + o for o in generated.logprobs.text_offset]
    assert "".join(lp.tokens) == choice.text


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_stream_equals_non_stream(client, max_tokens):
    kwargs = dict(model=MODEL, prompt=PROMPT, echo=True, max_tokens=max_tokens, temperature=0, logprobs=3)
    full = client.completions.create(**kwargs).choices[0]
    stream = client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT)  # the first chunk carries the prompt and its logprobs
    assert first.logprobs.token_logprobs[0] is None and len(first.logprobs.tokens) >= len(full.logprobs.tokens) - 3
    text, logprobs, finish, usage, _ = stream_choice(iter(chunks))
    assert text == full.text and finish == full.finish_reason == "length"
    assert logprobs["tokens"] == full.logprobs.tokens and logprobs["text_offset"] == full.logprobs.text_offset
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(full.logprobs.token_logprobs[1:], abs=1e-5)
    assert usage.completion_tokens == max_tokens


def test_echo_without_logprobs_and_of_token_ids(server, client):
    ids = tokenize(server, PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0)
    assert r.choices[0].text == PROMPT and r.choices[0].logprobs is None and r.usage.completion_tokens == 0
    by_ids = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=0, logprobs=1)
    assert by_ids.choices[0].text == PROMPT  # decoded
    assert len(by_ids.choices[0].logprobs.tokens) == len(ids)


def test_max_tokens_zero_without_echo_is_refused(client):
    # As vLLM: max_tokens=0 would return nothing at all, so it is a client error unless the prompt is echoed.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert info.value.param == "max_tokens" and "echo" in info.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=0)
