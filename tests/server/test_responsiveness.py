"""One request must never freeze the server: big grammars, long chats and many-prompt completions are handled off
the event loop and off the step loop, and oversized grammars are refused with a 400 naming their field."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from serverproc import Server, wait_for

from serval.config import StructuredOutputConfig
from serval.model.registry import resolve_model_path
from serval.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2-135m-instruct"
LIMITS = StructuredOutputConfig()
HEALTH_DEADLINE_S = 10.0  # generous: an idle /health answers in milliseconds


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """--context-policy sliding_window --max-model-len 1024 (one server for the module: two shared cores)."""
    s = Server(["--context-policy", "sliding_window", "--max-model-len", "1024"],
               tmp_path_factory.mktemp("serval-responsiveness") / "serve.log")
    try:
        yield s.start().wait_ready()
    finally:
        s.stop()


def optional_properties(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


def health_while(server: Server, work) -> tuple[object, list[float]]:
    """Runs ``work()`` on a thread and probes /health until it ends: (its result, each probe's latency). A probe
    that gets no answer within HEALTH_DEADLINE_S fails the test."""
    result: list = []
    worker = threading.Thread(target=lambda: result.append(work()))
    worker.start()
    latencies = []
    while True:
        started = time.monotonic()
        try:
            response = httpx.get(f"{server.url}/health", timeout=HEALTH_DEADLINE_S)
        except httpx.TimeoutException:
            worker.join()
            pytest.fail(f"/health did not answer within {HEALTH_DEADLINE_S} s")
        assert response.status_code == 200
        latencies.append(time.monotonic() - started)
        if not worker.is_alive():
            break
        time.sleep(0.1)
    worker.join()
    return result[0], latencies


def chat_body(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Describe a cat."}], "max_tokens": 4, **extra}


def test_health_answers_while_huge_guided_json_and_guided_choice_are_handled(server):
    """The issue's requests: 30,000 optional properties (919 KB) froze /health for over 7 minutes; 90,000 choices
    for 56 s. Both are past the limits: refused at once, naming their field, and /health never waits."""
    huge_json = chat_body(guided_json=optional_properties(30_000))
    huge_choice = chat_body(guided_choice=[f"o{i}" for i in range(90_000)])
    assert 900_000 < len(json.dumps(huge_json)) < 1 << 20 and len(json.dumps(huge_choice)) < 1 << 20  # body limit

    def post_both() -> list[httpx.Response]:
        with httpx.Client(timeout=600) as http:
            return [http.post(f"{server.url}/v1/chat/completions", json=body) for body in (huge_json, huge_choice)]

    responses, latencies = health_while(server, post_both)
    assert latencies
    for response, field in zip(responses, ("guided_json", "guided_choice"), strict=True):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field


@pytest.mark.parametrize("field, value, words", [
    ("guided_json", optional_properties(LIMITS.max_schema_members + 1), "properties"),
    ("guided_json", {"type": "string", "enum": [f"v{i}" for i in range(LIMITS.max_schema_members + 1)]},
     "enum values"),
    ("guided_json", {"type": "string", "description": "x" * LIMITS.max_schema_bytes}, "limit is"),
    ("response_format", {"type": "json_schema", "json_schema": {
        "name": "big", "schema": optional_properties(LIMITS.max_schema_members + 1)}}, "properties"),
    ("guided_choice", [f"c{i}" for i in range(LIMITS.max_choices + 1)], "choices"),
    ("guided_regex", "a" * (LIMITS.max_regex_chars + 1), "regex"),
    ("guided_grammar", 'root ::= "a"' + " " * LIMITS.max_grammar_chars, "grammar"),
])
def test_an_oversized_grammar_gets_a_400_naming_its_field(server, field, value, words):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, **({"response_format": value}
                                                                if field == "response_format" else
                                                                {"extra_body": {field: value}}))
    assert info.value.param == field
    assert "limit" in info.value.message and words in info.value.message
    state = httpx.get(f"{server.url}/engine/state", timeout=10).json()
    assert state["num_waiting"] == 0 and state["num_running"] == 0


def test_another_clients_stream_keeps_flowing_while_a_big_grammar_compiles(server):
    """A schema under the limits that takes a second or more to compile (800 optional properties): other
    streams keep getting tokens meanwhile, and the request itself is answered."""
    arrivals: list[float] = []
    stop = threading.Event()

    def stream() -> None:
        with server.client().completions.create(model=MODEL, prompt="Once upon a time", max_tokens=900,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True}) as s:
            for _ in s:
                arrivals.append(time.monotonic())
                if stop.is_set():
                    break

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        assert wait_for(lambda: len(arrivals) >= 5, timeout=120)
        started = time.monotonic()
        response = httpx.post(f"{server.url}/v1/chat/completions", timeout=300,
                              json=chat_body(guided_json=optional_properties(800), max_tokens=2))
        ended = time.monotonic()
    finally:
        stop.set()
        reader.join(timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"].startswith("{")
    window = [t for t in arrivals if started <= t <= ended]
    gaps = [b - a for a, b in zip([started, *window], [*window, ended])]
    # Before, the front end and then the core compiled it on their loops: the stream stood still for most of it.
    # (A third of the window failed once on a full CI run where the compile took only 1.9 s: one 0.67 s gap among
    # 19 tokens. Half still tells a flowing stream from one that stood still.)
    assert len(window) >= 3 and max(gaps) < (ended - started) / 2, (ended - started, gaps)


def test_a_sliding_window_over_thousands_of_messages_answers_and_health_stays_live(server):
    """2,501 short messages took 156 s with /health blocked for 42 s: the window is found in a few renders, off
    the event loop."""
    messages = [{"role": "system", "content": "You are brief."}]
    for i in range(1_250):
        messages += [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]
    messages.append({"role": "user", "content": "What is the capital of France?"})

    def ask() -> httpx.Response:
        return httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                          json={"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0})

    response, latencies = health_while(server, ask)
    assert response.status_code == 200, response.text
    dropped = int(response.headers["X-Serval-Dropped-Messages"])
    assert 2_000 < dropped < len(messages) - 1
    assert dropped % 2 == 0  # the kept chat opens with a user's turn
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + 4 <= 1024 and usage["completion_tokens"] >= 1
    # The most recent turns that fit were kept: one more pair would not have fit.
    tokenizer = Tokenizer.load(resolve_model_path(None))
    kept = messages[:1] + messages[1 + dropped:]
    assert len(tokenizer.apply_chat_template(kept)) == usage["prompt_tokens"]
    assert len(tokenizer.apply_chat_template(messages[:1] + messages[1 + dropped - 2:])) > 1024 - 4


def test_many_prompts_in_one_completions_request_run_as_one_batch(server):
    """Each prompt used to be added after the previous one's first token (300 x 32 tokens did not finish in
    300 s): now all are added at once, so the engine takes far fewer steps than there are prompts."""
    prompts = [f"Item {i} on the list is" for i in range(40)]
    before = httpx.get(f"{server.url}/engine/state", timeout=10).json()
    r = server.client().completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    after = httpx.get(f"{server.url}/engine/state", timeout=10).json()
    assert sorted(c.index for c in r.choices) == list(range(40))
    assert r.usage.completion_tokens == 40 * 8
    assert after["num_steps"] - before["num_steps"] < len(prompts)


def idle(server: Server) -> bool:
    state = httpx.get(f"{server.url}/engine/state", timeout=10).json()
    return (state["num_running"] == 0 and state["num_waiting"] == 0
            and state["num_free_blocks"] == state["num_blocks"])


def test_a_client_that_leaves_a_many_prompt_request_aborts_every_prompt(server):
    """More prompts than the engine runs at once (--max-num-seqs 64), each long: the client gives up before any
    prompt is done, and everything is aborted and freed (it used to go on adding prompts for minutes)."""
    prompts = [f"Story {i}: once upon a time" for i in range(80)]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", timeout=3,
                   json={"model": MODEL, "prompt": prompts, "max_tokens": 900, "ignore_eos": True})
    assert wait_for(lambda: idle(server), timeout=60), httpx.get(f"{server.url}/engine/state", timeout=10).json()


def test_a_client_that_leaves_a_many_prompt_stream_aborts_every_prompt(server):
    chunks = 0
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": [f"Poem {i}:" for i in range(16)], "max_tokens": 900,
                            "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 20:
                break
    assert chunks == 20
    assert wait_for(lambda: idle(server), timeout=60), httpx.get(f"{server.url}/engine/state", timeout=10).json()
    r = server.client().completions.create(model=MODEL, prompt="Afterwards,", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


# -- rendering big answers ------------------------------------------------------------------------------------------
RENDER_GATE_HOOK = """\
import os, pathlib, time
if os.environ.get("SERVAL_TEST_RENDER_GATE"):
    gate = pathlib.Path(os.environ["SERVAL_TEST_RENDER_GATE"])
    import serval.server.render as render
    import serval.server.serving as serving

    def gated(function):
        def wrapper(*args, **kwargs):
            try:
                (gate / "armed").unlink()  # only the first render once armed waits
            except FileNotFoundError:
                return function(*args, **kwargs)
            (gate / "rendering").touch()
            while not (gate / "open").exists():
                time.sleep(0.02)
            return function(*args, **kwargs)
        return wrapper

    serving.full_response = gated(serving.full_response)  # a whole answer
    render.prompt_logprobs = gated(render.prompt_logprobs)  # a stream's echoed prompt with its logprobs
"""


@pytest.fixture(scope="module")
def gated_server(tmp_path_factory):
    """A server whose first render of an answer once ``gate/armed`` exists waits until ``gate/open`` does (a
    sitecustomize hook): while it waits, the server must answer other requests, which it cannot if the render holds
    its event loop."""
    folder = tmp_path_factory.mktemp("serval-render-gate")
    (folder / "hook").mkdir()
    (folder / "hook" / "sitecustomize.py").write_text(RENDER_GATE_HOOK)
    gate = folder / "gate"
    gate.mkdir()
    s = Server([], folder / "serve.log")
    path = os.pathsep.join(p for p in (str(folder / "hook"), os.environ.get("PYTHONPATH", "")) if p)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", path)
        patch.setenv("SERVAL_TEST_RENDER_GATE", str(gate))
        s.start()
    try:
        yield s.wait_ready(), gate
    finally:
        s.stop()


def loaded_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_the_server_process_has_no_torch_nor_grammar_library_and_its_core_loads_them(gated_server):
    """The server's process maps no torch (the core settles the config and runs the model; the server builds the
    tokenizer without it) and imports no xgrammar (its front end only checks a grammar's size; the core parses and
    compiles it); its engine core imports xgrammar on a thread once the model is loaded: on the step loop at the
    first request with a grammar, the import (0.7 s) stood another stream still for 0.96 s (measured). Grammars, a
    required tool call and scored prompts then work. (This module's own server: no request with a grammar has
    reached it.)"""
    server, _ = gated_server
    children = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()
    core = next(int(pid) for pid in children
                if b"serval.engine.core_process" in Path(f"/proc/{pid}/cmdline").read_bytes())
    assert wait_for(lambda: "libxgrammar_bindings" in loaded_libraries(core), timeout=60)
    for body in (chat_body(response_format={"type": "json_object"}, max_tokens=8),
                 chat_body(guided_choice=["yes", "no"]),
                 chat_body(tools=[{"type": "function", "function": {
                     "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}],
                           tool_choice="required", max_tokens=100, temperature=0)):  # greedy: sampled, its
        # arguments could run past max_tokens, and the reply then held no finished call (a flake seen in CI)
        response = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json=body)
        assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    bad = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json=chat_body(guided_regex="(unclosed"))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"  # found by the core's compile
    scored = httpx.post(f"{server.url}/v1/completions", timeout=120,
                        json={"model": MODEL, "prompt": "One two three", "echo": True, "logprobs": 2, "max_tokens": 1})
    assert scored.status_code == 200
    assert "libxgrammar" not in loaded_libraries(server.proc.pid)
    assert "libtorch" not in loaded_libraries(server.proc.pid) and "libtorch_cpu" in loaded_libraries(core)


@pytest.mark.parametrize("request_body", [
    {"url": "/v1/chat/completions", "n": 16, "logprobs": True, "top_logprobs": 20,
     "messages": [{"role": "user", "content": "Tell me a story."}]},
    {"url": "/v1/completions", "prompt": "word " * 300, "echo": True, "logprobs": 20, "stream": True},
], ids=["chat-n16-top-logprobs-20", "streamed-echo-logprobs-20"])
def test_other_requests_are_answered_while_a_big_answer_renders(gated_server, request_body):
    """The answer of n samples' top logprobs, or of an echoed prompt's logprobs, is megabytes of JSON: rendered
    on the event loop it stood every other stream still (1.5 s at n=16, 256 tokens, measured). Off the loop, a
    chat is answered while it renders."""
    server, gate = gated_server
    (gate / "open").unlink(missing_ok=True)
    (gate / "rendering").unlink(missing_ok=True)
    (gate / "armed").touch()
    url, body = request_body["url"], {k: v for k, v in request_body.items() if k != "url"}
    big: list = []

    def send() -> None:
        with httpx.stream("POST", f"{server.url}{url}", timeout=300,
                          json={"model": MODEL, "max_tokens": 16, **body}) as response:
            big.append((response.status_code, response.read()))

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert wait_for(lambda: (gate / "rendering").exists(), timeout=120)
        # A liveness deadline: with the render on the event loop, no answer ever comes while the gate is shut.
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json=chat_body())
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 4
        assert sender.is_alive()  # still held at the gate: the chat was answered during the render
    finally:
        (gate / "open").touch()
        sender.join(timeout=120)
    status, content = big[0]
    assert status == 200, content[:500]
    if body.get("stream"):
        assert content.rstrip().endswith(b"data: [DONE]")
        first = json.loads(content.split(b"\n\n")[0].removeprefix(b"data: "))
        assert len(first["choices"][0]["logprobs"]["top_logprobs"]) > 300
    else:
        choices = json.loads(content)["choices"]
        assert len(choices) == 16 and all(len(c["logprobs"]["content"][0]["top_logprobs"]) == 20 for c in choices)
