"""A real `serval serve` process on a free loopback port, and the settings the server tests share."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

SERVAL = Path(sys.executable).parent / "serval"
LOAD_TIMEOUT_S = 240.0  # two slow shared cores: a load can take a minute when the machine is busy

# The guarded server's settings; the tests that use it name the same values.
GUARDED_KEYS = ["sk-serval-test", "sk-serval-other"]  # the rate-limit test spends only the second key's budget
GUARDED_RPM = 12
GUARDED_MAX_BODY = 4096
GUARDED_BLOCKLIST = "Seoul,forbiddenword"
SMALL_KEY = "sk-serval-small"

# The routing tests' replicas and conversations (tests/server/test_router.py, test_ray_serve.py): two offices whose
# long system prompts a cache-aware router should keep apart.
MODEL = "smollm2-135m-instruct"
SYSTEMS = {name: f"You are the {name} office's assistant. " + (
    f"The {name} office opens at nine, closes at five, handles parcels, letters and passports, and never discusses "
    "the weather. Answer in one short sentence. ") * 4 for name in ("harbour", "airport")}
QUESTIONS = ["When do you open?", "Can I send a parcel?", "Do you handle passports?"]
REPLICA_FLAGS = ["--max-num-seqs", "4", "--kv-cache-memory", "0.2"]


def wait_for(condition, timeout: float, interval: float = 0.2):
    """Polls ``condition`` until it returns something truthy (returned) or ``timeout`` seconds pass (its last
    value is returned)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


_ports_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free now, and never one handed out before in this test process. Another process may still
    take it before the server binds it: Server.wait_ready then starts the server again on another."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _ports_handed_out:
            _ports_handed_out.add(port)
            return port


def streamed_chat(client, messages: list[dict], max_tokens: int) -> tuple[list, str, list[str]]:
    """A greedy streamed chat with usage on the server's one model: (chunks, text, finish reasons)."""
    model = client.models.list().data[0].id
    chunks = list(client.chat.completions.create(model=model, messages=messages, stream=True, temperature=0,
                                                 max_tokens=max_tokens, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return chunks, text, finish


@dataclass
class Server:
    """One `serval serve` subprocess; its stderr (the request log included) goes to ``log_path``."""

    args: list[str]
    log_path: Path
    port: int = field(default_factory=free_port)
    api_keys: list[str] = field(default_factory=list)
    log_level: str | None = "INFO"  # None: serve's own default
    dtype: str | None = "float32"  # None: serve's own default (what users get)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_key(self) -> str | None:
        return self.api_keys[0] if self.api_keys else None

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self) -> Server:
        log_level = ["--log-level", self.log_level] if self.log_level else []
        dtype = ["--dtype", self.dtype] if self.dtype else []
        cmd = [str(SERVAL), *log_level, "serve", "--port", str(self.port), *dtype, *self.args]
        env = {k: v for k, v in os.environ.items() if k != "SERVAL_API_KEY"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_ready(self, timeout: float = LOAD_TIMEOUT_S) -> Server:
        deadline = time.monotonic() + timeout
        num_port_retries = 3
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                # The port was free when chosen, and something took it before the server bound it: another one.
                if "Address already in use" in self.log() and num_port_retries > 0:
                    num_port_retries -= 1
                    self.port = free_port()
                    self.start()
                    continue
                raise RuntimeError(f"serval serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", headers=self.headers, timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"serval serve not healthy after {timeout} s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, api_key: str | None = None, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or self.api_key or "unused", max_retries=0,
                             timeout=120, **kwargs)

    def async_client(self, api_key: str | None = None, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key or self.api_key or "unused",
                                  max_retries=0, timeout=180, **kwargs)

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of /metrics, by name."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values


@dataclass
class Router(Server):
    """A `serval router` process (no model: it is ready as soon as it listens)."""

    dtype: str | None = None

    def start(self) -> Router:
        cmd = [str(SERVAL), "--log-level", "INFO", "router", "--port", str(self.port), "--health-interval", "0.3",
               *self.args]
        env = {k: v for k, v in os.environ.items() if k != "SERVAL_API_KEY"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def state(self) -> dict:
        return httpx.get(f"{self.url}/router/state", headers=self.headers, timeout=10).json()


@contextlib.contextmanager
def running(servers: dict[str, Server]) -> Iterator[dict[str, Server]]:
    """Starts every server before waiting on any (their loads overlap) and stops them all on the way out."""
    try:
        for s in servers.values():
            s.start()
        yield servers
    finally:
        for s in servers.values():
            s.stop()
