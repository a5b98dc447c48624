"""Disaggregated serving through `serval router --prefill URL --decode URL`, real processes and the official client:
each prompt runs on the prefill worker (`serve --role prefill`), whose KV the decode worker (`--role decode`), asked
at the same time, fetches; greedy answers, streamed or not, equal the decode worker's own when it computes the prompt
itself; a request a worker's role cannot serve gets a 400; a decode worker that dies fails its requests with a clear
error (an SSE error event for a stream it had started, a 503 for the next) and the prefill worker's held blocks come
back."""

from __future__ import annotations

import signal

import httpx
import openai
import pytest
from serverproc import Router, Server, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2-135m-instruct"
QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.",
             "Write one sentence about a cat who likes boats, and say where the boats sail."]
FLAGS = ["--kv-cache-memory", "0.2"]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("disaggregated")
    # dtype None: serve's default (what users get)
    prefill = Server([*FLAGS, "--role", "prefill", "--kv-transfer-timeout", "3"], logs / "prefill.log", dtype=None)
    decode = Server([*FLAGS, "--role", "decode"], logs / "decode.log", dtype=None)
    try:
        prefill.start()
        decode.start()
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop()
        decode.stop()


def _chat(client: openai.OpenAI, question: str, **kwargs):
    return client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=24, temperature=0, messages=[{"role": "user", "content": question}], **kwargs)


def test_answers_equal_the_decode_workers_own_and_the_kv_moves(workers, tmp_path):
    prefill, decode = workers
    alone = {q: _chat(decode.client(), q).parse().choices[0].message.content for q in QUESTIONS}  # no transfer
    router = Router(["--prefill", prefill.url, "--decode", decode.url], tmp_path / "router.log").start()
    try:
        router.wait_ready()
        sent_before = prefill.metrics()["serval:kv_transfer_sent_blocks_total"]
        received_before = decode.metrics()["serval:kv_transfer_received_blocks_total"]
        for question in QUESTIONS:
            raw = _chat(router.client(), question)
            assert raw.headers["x-serval-prefill-replica"] == prefill.url
            assert raw.headers["x-serval-replica"] == decode.url
            assert raw.parse().choices[0].message.content == alone[question]
        stream = router.client().chat.completions.create(
            model=MODEL, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": QUESTIONS[2]}])
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == alone[QUESTIONS[2]]
        completion = router.client().completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16,
                                                        temperature=0)
        assert completion.choices[0].text == decode.client().completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0).choices[0].text
        sent = prefill.metrics()["serval:kv_transfer_sent_blocks_total"] - sent_before
        received = decode.metrics()["serval:kv_transfer_received_blocks_total"] - received_before
        # The decode worker had computed these prompts itself above: its prefix cache held their full blocks, so
        # only the partial last blocks came (the engine tests count them exactly); the same count on both sides.
        assert sent == received > 0
        assert decode.metrics()["serval:kv_transfer_failed_fetches_total"] == 0
        # Each prefill ran beside its decode (the router sends both at once): its answer may come after the decode
        # worker's.
        assert wait_for(lambda: 'serval_router:kv_transfers_total{outcome="prefilled"} 5.0' in
                        httpx.get(f"{router.url}/metrics", timeout=10).text, timeout=20)
        assert {r["role"] for r in router.state()["replicas"]} == {"prefill", "decode"}
    finally:
        router.stop()


def test_a_request_a_workers_role_cannot_serve_is_a_400(workers):
    prefill, decode = workers
    with pytest.raises(openai.BadRequestError, match="prefill worker"):
        _chat(decode.client(), QUESTIONS[0], extra_body={"kv_transfer_params": {"do_remote_decode": True}})
    with pytest.raises(openai.BadRequestError, match="decode worker"):
        _chat(prefill.client(), QUESTIONS[0], extra_body={"kv_transfer_params": {"do_remote_prefill": True}})
    with pytest.raises(openai.BadRequestError, match="n = 1"):
        _chat(prefill.client(), QUESTIONS[0], n=2, extra_body={"kv_transfer_params": {"do_remote_decode": True}})
    # A prefill worker's answer says where its KV is held.
    body = httpx.post(f"{prefill.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Hello there", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    held = body.json()["kv_transfer_params"]
    assert held["remote_address"].startswith("tcp://") and held["num_tokens"] >= 2
    # ... and so does its /health, for a router to name transfers before the prefill has run.
    assert httpx.get(f"{prefill.url}/health", timeout=10).json()["kv_transfer"]["address"] == held["remote_address"]
    with pytest.raises(openai.BadRequestError, match="transfer_id and remote_address"):
        _chat(decode.client(), QUESTIONS[0], extra_body={"kv_transfer_params": {"do_remote_prefill": True}})


def test_a_dead_decode_worker_fails_its_requests_clearly_and_frees_the_held_kv(workers, tmp_path):
    prefill, _ = workers
    doomed = Server([*FLAGS, "--role", "decode"], tmp_path / "doomed.log", dtype=None).start().wait_ready()
    router = Router(["--prefill", prefill.url, "--decode", doomed.url, "--health-interval", "60",
                     "--health-failures", "1000"], tmp_path / "router.log").start()
    try:
        router.wait_ready()
        assert _chat(router.client(), QUESTIONS[0]).parse().choices[0].message.content
        stream = router.client().completions.create(model=MODEL, prompt="Once upon a time", max_tokens=400,
                                                    stream=True, extra_body={"ignore_eos": True})
        received = 0
        with pytest.raises(openai.APIError, match="replica serving this request failed"):  # told, not cut short
            for _ in stream:
                received += 1
                if received == 3:  # killed mid-answer
                    doomed.proc.send_signal(signal.SIGKILL)
        assert 3 <= received < 400
        doomed.proc.wait(10)
        assert f'serval_router:cut_responses_total{{replica="{doomed.url}"}} 1.0' in \
            httpx.get(f"{router.url}/metrics", timeout=10).text
        with pytest.raises(openai.APIStatusError) as failure:
            _chat(router.client(), QUESTIONS[1])
        assert failure.value.status_code == 503 and "every replica refused or failed it" in str(failure.value)
        # The prefill started beside the refused decode; the router cancelled it (the prefill worker aborts it) or,
        # had it ended first, its hold is released after 3 s: either way no block stays owned.
        assert wait_for(lambda: prefill.metrics()["serval:kv_transfer_held_blocks"] == 0
                        and prefill.metrics()["serval:kv_cache_blocks_owned"] == 0, timeout=20), \
            "the prefill worker kept the dead decode worker's KV"
    finally:
        router.stop()
        doomed.stop()
