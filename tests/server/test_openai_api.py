"""The OpenAI API as a client sees it, through the official `openai` package, against a real server."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionTokenLogprob
from openai.types.chat.chat_completion_token_logprob import TopLogprob

import serval
from serval.config import auto_dtype
from serval.layers.linear import use_activation_quantization
from serval.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2-135m-instruct"
KOREA = [{"role": "user", "content": "What is the capital city of Korea?"}]
BLOCKED_WORD = "Seoul"  # on the guarded server's blocklist; the model says it for KOREA
PROMPT = "The three primary colors are"


def tokenize(server, **body) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json=body, headers=server.headers, timeout=30)
    r.raise_for_status()
    return r.json()["tokens"]


def collect_completion_stream(stream) -> tuple[str, str | None, object]:
    """(text, finish_reason, usage) of a one-choice completions stream."""
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return text, finish, usage


def collect_chat_stream(stream) -> tuple[str, str | None, object, list]:
    """(content, finish_reason, usage, chunks) of a one-choice chat stream."""
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = next((c.choices[0].finish_reason for c in reversed(chunks) if c.choices and c.choices[0].finish_reason),
                  None)
    usage = next((c.usage for c in chunks if c.usage is not None), None)
    return content, finish, usage, chunks


# -- plain endpoints -----------------------------------------------------------------------------------------------
def test_health_version_and_models(server, client):
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/version", timeout=10).json() == {"version": serval.__version__}
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    state = httpx.get(f"{server.url}/engine/state", timeout=10).json()
    assert state["alive"] is True and state["num_blocks"] > 0


def test_tokenize_detokenize_round_trip(server):
    text = "Serval serves small models, quickly."
    ids = tokenize(server, prompt=text, add_special_tokens=False)
    assert ids and all(isinstance(t, int) for t in ids)
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=30)
    assert r.status_code == 200 and r.json()["prompt"] == text


# -- completions and chat --------------------------------------------------------------------------------------------
def test_completion_stream_equals_non_stream(server, client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    choice = full.choices[0]
    assert choice.text and choice.finish_reason in ("length", "stop") and choice.index == 0
    assert full.object == "text_completion" and full.model == MODEL

    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    text, finish, usage = collect_completion_stream(stream)
    assert text == choice.text
    assert finish == choice.finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens == len(tokenize(server, prompt=PROMPT))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_stream_equals_non_stream(server, client):
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "Name a fruit that is yellow."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    assert full.object == "chat.completion"
    assert full.usage.prompt_tokens == len(tokenize(server, messages=messages))

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    content, finish, usage, chunks = collect_chat_stream(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert content == message.content
    assert finish == full.choices[0].finish_reason
    # the usage chunk comes last and has no choices
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_without_include_usage_has_no_usage(client):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_repeated_long_prompt_reports_cached_tokens(server, client):
    prompt = f"Note {uuid.uuid4().hex}. " + "Serval is a small wild cat of Africa with long legs. " * 12
    num_prompt_tokens = len(tokenize(server, prompt=prompt))
    assert num_prompt_tokens > 64
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == num_prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < num_prompt_tokens
    assert second.choices[0].text == first.choices[0].text


def test_n_choices_have_their_indices(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("length", "stop") for c in r.choices)
    assert r.usage.completion_tokens >= 3

    stream = client.chat.completions.create(model=MODEL, messages=KOREA, max_tokens=6, temperature=1.0, seed=7, n=2,
                                            stream=True)
    finished = {}
    for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert sorted(finished) == [0, 1]


def test_stop_string_cuts_the_text(client):
    prompt = "Count: 1, 2, 3, 4, 5,"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 4, full
    stop = words[2]
    expected = full[: full.index(stop)]

    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == expected
    assert stop not in cut.choices[0].text
    assert cut.choices[0].finish_reason == "stop"

    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                       stream=True)
    text, finish, _ = collect_completion_stream(stream)
    assert text == expected and finish == "stop"


def test_completion_logprobs_shape(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    choice = r.choices[0]
    lp = choice.logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0
        assert 1 <= len(top) <= 2
        assert top[token] == pytest.approx(max(top.values()))  # greedy: the chosen token is the likeliest


def assert_openai_token_logprobs(content: list[dict], num_top: int) -> None:
    """Raw `choices[].logprobs.content` items have exactly the fields of the openai client's typed objects."""
    for item in content:
        assert set(item) == set(ChatCompletionTokenLogprob.model_fields)
        token = ChatCompletionTokenLogprob.model_validate(item)
        assert token.logprob <= 0 and token.bytes == list(token.token.encode())
        assert len(item["top_logprobs"]) == num_top
        for top in item["top_logprobs"]:
            assert set(top) == set(TopLogprob.model_fields) and top["bytes"] == list(top["token"].encode())
        if num_top:  # greedy: the chosen token is the likeliest
            assert token.logprob == pytest.approx(max(top.logprob for top in token.top_logprobs))


@pytest.mark.parametrize("top_logprobs", [None, 0, 2, 20])
def test_chat_logprobs_have_the_openai_shape(client, top_logprobs):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=KOREA, max_tokens=8, temperature=0,
                                                           logprobs=True, top_logprobs=top_logprobs)
    body = raw.http_response.json()
    r = ChatCompletion.model_validate(body)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == r.usage.completion_tokens == 8
    assert "".join(t["token"] for t in content) == r.choices[0].message.content
    assert_openai_token_logprobs(content, top_logprobs or 0)

    stream = client.chat.completions.create(model=MODEL, messages=KOREA, max_tokens=8, temperature=0, logprobs=True,
                                            top_logprobs=top_logprobs, stream=True)
    streamed = [item.model_dump() for chunk in stream for c in chunk.choices if c.logprobs
                for item in c.logprobs.content]
    assert_openai_token_logprobs(streamed, top_logprobs or 0)
    assert [t["token"] for t in streamed] == [t["token"] for t in content]
    # the prompt's KV now comes from the prefix cache: the same values up to float rounding
    assert [t["logprob"] for t in streamed] == pytest.approx([t["logprob"] for t in content], abs=1e-4)

    without = client.chat.completions.create(model=MODEL, messages=KOREA, max_tokens=2, temperature=0)
    assert without.choices[0].logprobs is None


def test_seeded_sampling_repeats(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=1234)
    first = client.completions.create(**kwargs).choices[0].text
    second = client.completions.create(**kwargs).choices[0].text
    assert first == second
    # ...and the seed is what fixes it: another seed samples another story (deterministic too, so never flaky).
    assert client.completions.create(**{**kwargs, "seed": 4321}).choices[0].text != first
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12,
                temperature=1.0, seed=99)
    assert (client.chat.completions.create(**chat).choices[0].message.content
            == client.chat.completions.create(**chat).choices[0].message.content)


def test_vllm_sampling_extras_change_the_output(client):
    """Each extra does what it says: compared with the same seeded request without it, the output changes."""
    def text(prompt: str = "Once upon a time", **kwargs) -> str:
        settings = {"max_tokens": 16, "temperature": 1.8, "seed": 5, **kwargs}
        extra = {k: settings.pop(k) for k in ("top_k", "min_p", "repetition_penalty") if k in settings}
        r = client.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **settings)
        return r.choices[0].text

    hot, greedy = text(), text(temperature=0)
    assert hot != greedy  # at 1.8 the draw wanders off the greedy path...
    assert text(top_k=1) == greedy  # ...unless only the likeliest token is left, by top_k
    assert text(min_p=1.0) == greedy  # or by min_p (only tokens as likely as the top one)

    counting = "1, 2, 3, 1, 2, 3, 1, 2, 3,"
    repeats = text(counting, temperature=0)
    assert "1, 2, 3" in repeats  # greedy keeps the pattern going...
    assert text(counting, temperature=0, repetition_penalty=2.0) != repeats  # ...a heavy penalty breaks it


def test_min_tokens_ignore_eos_and_stop_token_ids(server, client):
    short = client.chat.completions.create(model=MODEL, messages=KOREA, max_tokens=64, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 30  # ends on eos
    longer = client.chat.completions.create(model=MODEL, messages=KOREA, max_tokens=64, temperature=0,
                                            extra_body={"min_tokens": 40})
    assert longer.usage.completion_tokens >= 40
    assert longer.choices[0].message.content.startswith(short.choices[0].message.content)
    endless = client.chat.completions.create(model=MODEL, messages=KOREA, max_tokens=64, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert endless.usage.completion_tokens == 64 and endless.choices[0].finish_reason == "length"

    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0).choices[0].text
    (first_id,) = tokenize(server, prompt=first, add_special_tokens=False)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"stop_token_ids": [first_id]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1


# -- the newer OpenAI fields -------------------------------------------------------------------------------------------
def test_logit_bias_forces_and_bans_tokens(server, client):
    (banana,) = tokenize(server, prompt=" banana", add_special_tokens=False)
    forced = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                       logit_bias={str(banana): 100})
    assert forced.choices[0].text == " banana" * 3
    chat = client.chat.completions.create(model=MODEL, messages=KOREA, max_tokens=2, temperature=0,
                                          logit_bias={str(banana): 100})
    assert chat.choices[0].message.content == " banana banana"

    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0).choices[0].text
    (first_id,) = tokenize(server, prompt=first, add_special_tokens=False)
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(first_id): -100}).choices[0].text
    assert banned and banned != first
    # a sampled request never draws a banned token either
    sampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=1.5, seed=2, n=16,
                                        logit_bias={str(first_id): -100})
    assert first not in [c.text for c in sampled.choices]


def test_max_completion_tokens_limits_the_answer(client):
    r = client.chat.completions.create(model=MODEL, messages=KOREA, max_completion_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    # with both, max_completion_tokens wins (it supersedes max_tokens, as in vLLM)
    r = client.chat.completions.create(model=MODEL, messages=KOREA, max_completion_tokens=3, max_tokens=9,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_chat_stop_as_a_string_or_a_list(client):
    full = client.chat.completions.create(model=MODEL, messages=KOREA, max_tokens=24, temperature=0)
    content = full.choices[0].message.content
    words = content.split()
    assert len(words) >= 3, content
    stop = words[2]
    expected = content[: content.index(stop)]
    for stop_arg in (stop, ["never-in-the-text", stop]):
        r = client.chat.completions.create(model=MODEL, messages=KOREA, max_tokens=24, temperature=0, stop=stop_arg)
        assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
        stream = client.chat.completions.create(model=MODEL, messages=KOREA, max_tokens=24, temperature=0,
                                                stop=stop_arg, stream=True)
        streamed, finish, _, _ = collect_chat_stream(stream)
        assert streamed == expected and finish == "stop"


# -- concurrency ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("server_fixture", "dtype"), [("server", "float32"), ("default_dtype_server", "auto")])
def test_32_concurrent_streams_match_one_by_one(request, server_fixture, dtype, make_llm):
    """In float32 and in the default dtype: batching on the server never changes a greedy answer."""
    server = request.getfixturevalue(server_fixture)
    dtype = auto_dtype("cpu") if dtype == "auto" else dtype
    prompts = [f"Here is fact number {i} about the ocean:" for i in range(32)]

    async def run(indices: list[int], concurrent: bool) -> dict[int, tuple[str, str, int]]:
        async with server.async_client() as aclient:
            async def one(i: int) -> tuple[str, str, int]:
                stream = await aclient.completions.create(model=MODEL, prompt=prompts[i], max_tokens=16,
                                                          temperature=0, stream=True,
                                                          stream_options={"include_usage": True})
                text, finish, usage = "", None, None
                async for chunk in stream:
                    usage = chunk.usage or usage
                    for c in chunk.choices:
                        text += c.text
                        finish = c.finish_reason or finish
                return text, finish, usage.completion_tokens

            if concurrent:
                return dict(zip(indices, await asyncio.gather(*(one(i) for i in indices))))
            return {i: await one(i) for i in indices}

    together = asyncio.run(run(list(range(32)), concurrent=True))
    assert len(together) == 32
    for text, finish, num_tokens in together.values():
        assert finish in ("length", "stop") and text
        assert num_tokens == 16 or finish == "stop"
    # Every stream equals the offline engine's greedy text for its prompt, on the same weights in the same dtype with
    # the server's activation quantization, "auto" (the engine tests prove offline results do not depend on batching)...
    llm = make_llm(dtype=dtype, activation_quantization="auto")
    offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    use_activation_quantization(llm.engine.model, "none")  # the shared weights back to make_llm's default
    for i, output in enumerate(offline):
        assert together[i][0] == output.outputs[0].text, f"prompt {i}: {together[i][0]!r} != {output.text!r}"
    # ...and, through the server itself, one by one (slow on two cores: every fourth prompt).
    alone = asyncio.run(run(list(range(0, 32, 4)), concurrent=False))
    for i, result in alone.items():
        assert together[i] == result, f"prompt {i}: batched {together[i]!r} != alone {result!r}"


# -- request ids and the request log ---------------------------------------------------------------------------------
def log_lines_of(server, request_id: str, timeout: float = 10) -> list[str]:
    """The server's log lines that name ``request_id``, once there is at least one (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in server.log().splitlines() if request_id in line]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)


def test_default_log_level_logs_one_line_per_api_request(server, client):
    """The `server` runs with serve's default flags: each API request still gets one INFO line, polling does not."""
    tag = uuid.uuid4().hex[:8]

    def record(request_id: str) -> dict:
        lines = log_lines_of(server, request_id)
        assert len(lines) == 1, lines
        assert " INFO serval.requests: " in lines[0]
        rec = json.loads(lines[0][lines[0].index("{"):])
        assert rec["request_id"] == request_id and rec["latency_s"] >= 0
        return rec

    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                  extra_headers={"X-Request-Id": f"plain-{tag}"})
    rec = record(f"plain-{tag}")
    assert (rec["method"], rec["path"], rec["status"], rec["stream"]) == ("POST", "/v1/completions", 200, False)
    assert rec["prompt_tokens"] == r.usage.prompt_tokens and rec["completion_tokens"] == 3
    assert 0 <= rec["ttft_s"] <= rec["latency_s"]

    stream = client.chat.completions.create(model=MODEL, messages=KOREA, max_tokens=3, temperature=0, stream=True,
                                            extra_headers={"X-Request-Id": f"stream-{tag}"})
    assert len(list(stream)) >= 2
    rec = record(f"stream-{tag}")
    assert (rec["method"], rec["path"], rec["status"], rec["stream"]) == ("POST", "/v1/chat/completions", 200, True)
    assert rec["completion_tokens"] == 3 and 0 <= rec["ttft_s"] <= rec["latency_s"]

    httpx.get(f"{server.url}/v1/models", headers={"X-Request-Id": f"models-{tag}"}, timeout=10)
    assert {k: v for k, v in record(f"models-{tag}").items() if k != "latency_s"} == {
        "request_id": f"models-{tag}", "method": "GET", "path": "/v1/models", "status": 200}
    httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "temperature": 9},
               headers={"X-Request-Id": f"bad-{tag}"}, timeout=10)
    assert record(f"bad-{tag}")["status"] == 400

    for path in ("/health", "/metrics", "/engine/state"):  # polling: DEBUG, not shown by default
        httpx.get(f"{server.url}{path}", headers={"X-Request-Id": f"poll-{tag}"}, timeout=10)
    httpx.get(f"{server.url}/version", headers={"X-Request-Id": f"last-{tag}"}, timeout=10)
    assert record(f"last-{tag}")["status"] == 200  # logged after the polls, so they had their chance
    assert log_lines_of(server, f"poll-{tag}", timeout=0) == []


def test_request_id_is_echoed_generated_and_logged(server):
    rid = f"test-{uuid.uuid4().hex}"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == rid

    generated = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).headers["x-request-id"]
    other = httpx.get(f"{server.url}/health", timeout=10).headers["x-request-id"]
    assert generated and other and generated != other and rid not in (generated, other)

    def request_log() -> list[dict]:
        records = []
        for line in server.log().splitlines():
            if "serval.requests" in line:
                records.append(json.loads(line[line.index("{"):]))
        return records

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(rec["request_id"] == generated for rec in request_log()):
        time.sleep(0.2)
    mine = [rec for rec in request_log() if rec["request_id"] == rid]
    assert len(mine) == 1, mine
    assert mine[0]["endpoint"] == "completions" and mine[0]["completion_tokens"] == 2
    assert mine[0]["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert 0 <= mine[0]["queue_s"] <= mine[0]["ttft_s"] <= mine[0]["latency_s"]  # timings, in order
    assert mine[0]["finish_reasons"] == ["length"]
    assert any(rec["request_id"] == generated for rec in request_log())


# -- the output filter -------------------------------------------------------------------------------------------------
def test_blocklist_ends_with_content_filter(server, guarded):
    plain = server.client().chat.completions.create(model=MODEL, messages=KOREA, max_tokens=24, temperature=0)
    assert BLOCKED_WORD in plain.choices[0].message.content  # the model does say it, unfiltered

    client = guarded.client()
    r = client.chat.completions.create(model=MODEL, messages=KOREA, max_tokens=24, temperature=0)
    assert r.choices[0].finish_reason == "content_filter"
    assert BLOCKED_WORD.lower() not in r.choices[0].message.content.lower()
    assert plain.choices[0].message.content.startswith(r.choices[0].message.content)

    stream = client.chat.completions.create(model=MODEL, messages=KOREA, max_tokens=24, temperature=0, stream=True)
    content, finish, _, _ = collect_chat_stream(stream)
    assert finish == "content_filter"
    assert BLOCKED_WORD.lower() not in content.lower()
    assert content == r.choices[0].message.content
