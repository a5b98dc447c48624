"""Many users on one server: with two API keys, what one key stores (responses, conversation sessions) is its own.
The other key meets it as an id that does not exist (the same 404), and ids a client chooses never collide across
keys. Through the official client, on a server in the configuration users get (no flags but the keys)."""

from __future__ import annotations

import re
import threading
import time
import types

import httpx
import openai
import pytest
from serverproc import MODEL, Server, running

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
QUESTION = "What is the capital city of Korea?"


@pytest.fixture(scope="module")
def two_keys(tmp_path_factory):
    server = Server(["--api-key", KEY_A, "--api-key", KEY_B], tmp_path_factory.mktemp("tenancy") / "serve.log",
                    api_keys=[KEY_A, KEY_B], dtype=None)
    with running({"two_keys": server}):
        yield server.wait_ready()


@pytest.fixture(scope="module")
def one_seat_two_keys(tmp_path_factory):
    server = Server(["--api-key", KEY_A, "--api-key", KEY_B, "--max-num-seqs", "1"],
                    tmp_path_factory.mktemp("tenancy") / "one-seat.log", api_keys=[KEY_A, KEY_B], dtype=None)
    with running({"one_seat": server}):
        yield server.wait_ready()


def _not_found(call) -> dict:
    """The 404 error body a call gets (it must get one)."""
    with pytest.raises(openai.NotFoundError) as caught:
        call()
    return caught.value.body


def _kept_sessions(client: openai.OpenAI) -> list[str]:
    return [s["session_id"] for s in client.get("/../debug/kv", cast_to=object)["sessions"]["kept"]]


def _wait_kept(client: openai.OpenAI, session: str) -> list[str]:
    deadline = time.monotonic() + 30  # the core keeps a session as its turn ends, a step after the answer
    while session not in (kept := _kept_sessions(client)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return kept


def test_a_stored_response_is_its_keys_alone(two_keys):
    a, b = two_keys.client(KEY_A), two_keys.client(KEY_B)
    first = a.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0, store=True)
    unknown = _not_found(lambda: b.responses.retrieve("resp_" + "0" * 32))
    # Key B: read and continue get the 404 of an id that never was, word for word but the id.
    assert _not_found(lambda: b.responses.retrieve(first.id)) == {
        **unknown, "message": unknown["message"].replace("resp_" + "0" * 32, first.id)}
    continued = _not_found(lambda: b.responses.create(model=MODEL, input="And of Japan?", max_output_tokens=8,
                                                      previous_response_id=first.id))
    assert continued["param"] == "previous_response_id" and continued["code"] == "not_found"
    # Key A still reads and continues its own.
    assert a.responses.retrieve(first.id).output_text == first.output_text
    second = a.responses.create(model=MODEL, input="And of Japan?", max_output_tokens=8, temperature=0,
                                previous_response_id=first.id)
    assert second.previous_response_id == first.id


def test_a_session_is_its_keys_alone(two_keys):
    a, b = two_keys.client(KEY_A), two_keys.client(KEY_B)
    session = "conversation-1"
    messages = [{"role": "user", "content": QUESTION}]
    a.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                              extra_body={"session_id": session})
    assert session in _wait_kept(a, session)
    assert session not in _kept_sessions(b)  # /debug/kv lists the caller's sessions only
    assert _not_found(lambda: b.delete(f"/sessions/{session}", cast_to=object))["code"] == "not_found"
    assert session in _kept_sessions(a)  # B's delete ended nothing
    # B's session of the same name is B's own: A's is neither read nor replaced by it.
    b.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}], max_tokens=4,
                              temperature=0, extra_body={"session_id": session})
    assert session in _wait_kept(b, session) and session in _kept_sessions(a)
    assert a.delete(f"/sessions/{session}", cast_to=object) == {"id": session, "object": "session", "deleted": True}
    deadline = time.monotonic() + 30
    while session in _kept_sessions(a) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session not in _kept_sessions(a) and session in _kept_sessions(b)
    assert _not_found(lambda: a.delete(f"/sessions/{session}", cast_to=object))["code"] == "not_found"  # gone


def test_the_same_request_id_from_two_keys_at_once_serves_both(two_keys):
    """X-Request-Id is the client's to choose: it labels the log line and the answer, never the engine's request, so
    one client cannot collide with (or probe for) another's."""
    def start(key: str, max_tokens: int):
        raw = two_keys.client(key).chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to twenty."}], max_tokens=max_tokens,
            temperature=0, stream=True, extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "shared-id"})
        assert raw.headers["x-request-id"] == "shared-id"
        return raw.parse()

    def finish(chunks) -> str:
        return [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]

    a = start(KEY_A, 100)
    first = next(iter(a))  # A's request is in the engine, and runs for 100 tokens
    b = start(KEY_B, 8)
    assert finish(b) == ["length"]
    assert finish([first, *a]) == ["length"]


# Open to a caller without a key on a keyed server: the chat page (it asks for the key), the liveness probe and the
# Prometheus scrape (each of the last two unless its --protect-* flag is set). Every other route needs the key.
OPEN_ROUTES = {"/", "/health", "/metrics"}


def _app_routes() -> list[tuple[str, str]]:
    """(method, path) of every route of the app, path parameters filled in."""
    from serval.server.app import create_app
    from serval.server.config import ServerConfig

    app = create_app(types.SimpleNamespace(tokenizer=None), ServerConfig())  # the routes only: nothing is served
    return [(method, re.sub(r"\{[^}]+\}", "x", route.path))
            for route in app.routes for method in sorted(route.methods) if method != "HEAD"]


def test_every_route_but_the_page_health_and_metrics_needs_the_key(two_keys):
    routes = _app_routes()
    assert len(routes) >= 17 and ("GET", "/engine/state") in routes and ("GET", "/docs") in routes
    for method, path in routes:
        r = httpx.request(method, f"{two_keys.url}{path}", timeout=30)
        if path in OPEN_ROUTES:
            assert r.status_code == 200, (method, path, r.status_code)
        else:
            assert r.status_code == 401, (method, path, r.status_code)
            assert r.json()["error"]["code"] == "invalid_api_key"
            keyed = httpx.request(method, f"{two_keys.url}{path}", timeout=30,
                                  headers={"Authorization": f"Bearer {KEY_B}"})
            assert keyed.status_code != 401, (method, path)


def test_one_keys_backlog_does_not_starve_another_key(one_seat_two_keys):
    """One sequence runs at a time. Key A queues six prompts in one request; key B's one prompt, sent after, runs
    as soon as A's first is done (tenants take turns in the waiting queue), not after all six."""
    server = one_seat_two_keys
    backlog = {}

    def key_a() -> None:
        backlog["a"] = server.client(KEY_A).completions.create(
            model=MODEL, prompt=[f"Story {i}: once upon a time" for i in range(6)], max_tokens=24,
            extra_body={"ignore_eos": True})

    a = threading.Thread(target=key_a, daemon=True)
    a.start()

    def num_waiting() -> int:
        return httpx.get(f"{server.url}/engine/state", headers={"Authorization": f"Bearer {KEY_A}"},
                         timeout=10).json()["num_waiting"]

    deadline = time.monotonic() + 120
    while (queued := num_waiting()) < 5 and time.monotonic() < deadline:  # A queued
        time.sleep(0.05)
    assert queued >= 5  # five, or all six before the first takes the seat
    b = server.client(KEY_B).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24,
                                                extra_body={"ignore_eos": True})
    assert b.usage.completion_tokens == 24
    assert a.is_alive(), "B's one prompt waited for all of A's"
    a.join(300)
    assert [c.finish_reason for c in backlog["a"].choices] == ["length"] * 6
