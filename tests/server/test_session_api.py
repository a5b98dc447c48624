"""Conversation sessions through the HTTP API and the official client, in the default dtype: a chat turn that
names a session (``session_id``, or ``user``) is counted as a session hit on its next turn, ``GET /debug/kv`` shows
it, ``DELETE /v1/sessions/{id}`` and ``end_session`` let the kept KV go, and a bad session id is a 400. (That kept KV
survives traffic that cycles the cache is tests/engine/test_sessions.py's.)"""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2-135m-instruct"
QUESTION = "Tell me about the history of the bicycle in a few sentences."


def _wait_for(server, name: str, predicate, timeout: float = 10.0) -> float:
    """A metric's value once it satisfies ``predicate`` (the core reports its counters after each command)."""
    deadline = time.monotonic() + timeout
    while True:
        value = server.metrics().get(name, 0.0)
        if predicate(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


@pytest.mark.parametrize("field", ["session_id", "user"])
def test_the_second_turn_of_a_session_is_a_session_hit(default_dtype_server, field):
    server, client = default_dtype_server, default_dtype_server.client()
    session = f"conv-{uuid.uuid4().hex[:8]}"
    extra = {"extra_body": {"session_id": session}} if field == "session_id" else {"user": session}
    messages = [{"role": "user", "content": QUESTION}]
    before = server.metrics()
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0, **extra)
    kept = _wait_for(server, "serval:session_cache_sessions", lambda v: v > before["serval:session_cache_sessions"])
    assert kept == before["serval:session_cache_sessions"] + 1
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And who invented the pedal?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, **extra)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * (first.usage.prompt_tokens // 16 + 1)  # the answer's blocks too, not only the prompt's
    after = server.metrics()
    assert after["serval:session_cache_requests_total"] == before["serval:session_cache_requests_total"] + 1
    assert after["serval:session_cache_hits_total"] == before["serval:session_cache_hits_total"] + cached
    state = httpx.get(f"{server.url}/debug/kv", headers=server.headers, timeout=10).json()
    ours = [s for s in state["sessions"]["kept"] if s["session_id"] == session]
    assert len(ours) == 1 and ours[0]["tokens"] == 16 * ours[0]["blocks"] >= cached
    assert 0 < ours[0]["expires_in_s"] <= state["sessions"]["ttl_s"]
    tier = state["tiers"][0]
    assert tier["blocks"] == tier["owned"] + tier["cached_free"] + tier["empty"]
    assert state["sessions"]["blocks"] >= tier["owned_by_sessions"] >= ours[0]["blocks"]  # shared blocks once
    assert 0 < state["prefix_cache"]["hit_rate"] <= 1
    r = httpx.delete(f"{server.url}/v1/sessions/{session}", headers=server.headers, timeout=10)
    assert r.status_code == 200 and r.json() == {"id": session, "object": "session", "deleted": True}
    assert _wait_for(server, "serval:session_cache_sessions", lambda v: v == kept - 1) == kept - 1
    state = httpx.get(f"{server.url}/debug/kv", headers=server.headers, timeout=10).json()
    assert session not in [s["session_id"] for s in state["sessions"]["kept"]]


def test_a_last_turn_keeps_nothing_and_bad_session_ids_are_refused(default_dtype_server):
    server, client = default_dtype_server, default_dtype_server.client()
    session = f"conv-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": QUESTION}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                   extra_body={"session_id": session})
    kept = _wait_for(server, "serval:session_cache_sessions", lambda v: v >= 1)
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                   extra_body={"session_id": session, "end_session": True})
    assert _wait_for(server, "serval:session_cache_sessions", lambda v: v == kept - 1) == kept - 1
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                       extra_body={"session_id": ""})
    assert error.value.body["param"] == "session_id"


def test_the_kv_view_needs_the_api_key_where_there_is_one(guarded):
    assert httpx.get(f"{guarded.url}/debug/kv", timeout=10).status_code == 401
    r = httpx.get(f"{guarded.url}/debug/kv", headers=guarded.headers, timeout=10)
    assert r.status_code == 200 and r.json()["tiers"][0]["blocks"] > 0
