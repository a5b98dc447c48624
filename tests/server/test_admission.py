"""Admission counts sequences, not requests: a request of p prompts with n samples each takes p × n places of
--max-waiting, all or none; one that could never fit, or that lists more prompts than --max-prompts-per-request, is a
400 naming its field; and none of it keeps the next client out."""

from __future__ import annotations

import threading

import httpx
import pytest
from serverproc import MODEL, Server, running, wait_for

pytestmark = pytest.mark.slow

MAX_WAITING = 32


@pytest.fixture(scope="module")
def one_seat(tmp_path_factory):
    """One running sequence at a time, and 32 places in the queue."""
    server = Server(["--max-num-seqs", "1", "--max-waiting", str(MAX_WAITING)],
                    tmp_path_factory.mktemp("admission") / "serve.log")
    with running({"one_seat": server}):
        yield server.wait_ready()


def _completions(server: Server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, **body}, timeout=300)


def _chat_answers(server: Server) -> bool:
    client = server.client()
    answer = client.chat.completions.create(model=MODEL, max_tokens=4,
                                            messages=[{"role": "user", "content": "What is the capital of Korea?"}])
    return answer.usage.completion_tokens > 0


def test_a_small_request_of_many_sequences_is_refused_whole_and_the_next_client_is_served(one_seat):
    # 558 bytes that used to queue 1,600 sequences and turn every other client away with 503 until they drained.
    r = _completions(one_seat, prompt=["a"] * 100, n=16, max_tokens=1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert "1600 sequences" in r.json()["error"]["message"]
    r = _completions(one_seat, prompt=["a"] * (MAX_WAITING + 1), max_tokens=1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = _completions(one_seat, prompt=["a"] * 257, max_tokens=1)  # past --max-prompts-per-request's 256
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "at most 256 prompts" in r.json()["error"]["message"]
    assert _chat_answers(one_seat)
    state = httpx.get(f"{one_seat.url}/engine/state", timeout=10).json()
    assert state["num_waiting"] == 0 and state["num_running"] == 0  # the refused took no place


def test_a_request_whose_sequences_do_not_fit_the_queue_is_503_and_takes_no_place(one_seat):
    seated = threading.Event()

    def hold_the_seat():  # a long stream in the only seat, so every later sequence waits
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{one_seat.url}/v1/completions", json=body, timeout=300) as r:
            for _ in r.iter_lines():
                seated.set()
                if done.is_set():
                    return

    done = threading.Event()
    holder = threading.Thread(target=hold_the_seat, daemon=True)
    holder.start()
    waiting = {}
    try:
        assert seated.wait(120)
        queued = threading.Thread(target=lambda: waiting.update(r=_completions(
            one_seat, prompt=[f"Tale {i}:" for i in range(MAX_WAITING - 2)], max_tokens=2)), daemon=True)
        queued.start()

        def num_waiting() -> int:
            return httpx.get(f"{one_seat.url}/engine/state", timeout=10).json()["num_waiting"]

        assert wait_for(lambda: num_waiting() == MAX_WAITING - 2, timeout=120)
        r = _completions(one_seat, prompt=["x", "y", "z"], max_tokens=2)  # 30 + 3 > 32: refused whole
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
        assert r.headers["retry-after"] == "1"
        assert num_waiting() == MAX_WAITING - 2  # it took no place
        fits = threading.Thread(target=lambda: waiting.update(fits=_completions(
            one_seat, prompt=["x", "y"], max_tokens=2)), daemon=True)  # 30 + 2 fit
        fits.start()
        assert wait_for(lambda: num_waiting() == MAX_WAITING, timeout=120)
    finally:
        done.set()
        holder.join(120)
    queued.join(300)
    fits.join(300)
    assert waiting["r"].status_code == 200 and len(waiting["r"].json()["choices"]) == MAX_WAITING - 2
    assert waiting["fits"].status_code == 200 and len(waiting["fits"].json()["choices"]) == 2
