"""Real `serval serve` processes on free loopback ports, started few times and always stopped."""

from __future__ import annotations

import openai
import pytest
from serverproc import GUARDED_BLOCKLIST, GUARDED_KEYS, GUARDED_MAX_BODY, GUARDED_RPM, SMALL_KEY, Server, running


@pytest.fixture(scope="session")
def _launched(tmp_path_factory):
    """Starts every server of the session at once, so their model loads overlap; each test waits for its own."""
    logs = tmp_path_factory.mktemp("serval-logs")
    plain = Server([], logs / "plain.log", log_level=None)
    guarded = Server(["--api-key", GUARDED_KEYS[0], "--api-key", GUARDED_KEYS[1],
                      "--rate-limit-rpm", str(GUARDED_RPM), "--max-body-bytes", str(GUARDED_MAX_BODY),
                      "--blocklist", GUARDED_BLOCKLIST], logs / "guarded.log", api_keys=GUARDED_KEYS)
    small = Server(["--max-num-seqs", "1", "--max-waiting", "1", "--api-key", SMALL_KEY, "--protect-health",
                    "--shutdown-timeout", "40"], logs / "small.log", api_keys=[SMALL_KEY])
    default_dtype = Server([], logs / "default-dtype.log", dtype=None)
    with running({"plain": plain, "guarded": guarded, "small": small, "default_dtype": default_dtype}) as servers:
        yield servers


@pytest.fixture(scope="session")
def server(_launched) -> Server:
    """A server with the default flags (float32, no auth, no limits, the default log level)."""
    return _launched["plain"].wait_ready()


@pytest.fixture(scope="session")
def default_dtype_server(_launched) -> Server:
    """A server with no flags at all: the dtype users get (``--dtype auto``: bfloat16 on a CPU with native bf16)."""
    return _launched["default_dtype"].wait_ready()


@pytest.fixture(scope="session")
def guarded(_launched) -> Server:
    """A server with two API keys (sk-serval-test, sk-serval-other), a limit of 12 requests a minute per key,
    a 4096-byte body limit and the blocklist "Seoul,forbiddenword"."""
    return _launched["guarded"].wait_ready()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.client()
