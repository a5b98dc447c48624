"""Connections that never finish are closed: a request must arrive whole within --request-read-timeout (a slowloris
client, half a request line, a socket that sends nothing), an idle keep-alive connection closes after
--keep-alive-timeout, and past --max-connections a new connection gets a 503. /health answers throughout."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from serverproc import Server, running

pytestmark = pytest.mark.slow

READ_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 20
CLOSED_WITHIN_S = 30.0  # a liveness bound on two busy cores: the server closes them after READ_TIMEOUT_S


@pytest.fixture(scope="module")
def _servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("connections")
    quick = Server(["--request-read-timeout", str(READ_TIMEOUT_S), "--keep-alive-timeout", "1"], logs / "quick.log")
    # The default read timeout (10 s): the held connections stay open while the test opens one more.
    few = Server(["--max-connections", str(MAX_CONNECTIONS)], logs / "few.log")
    with running({"quick": quick, "few": few}) as servers:
        yield servers


@pytest.fixture(scope="module")
def guarded(_servers):
    """Short read and keep-alive timeouts."""
    return _servers["quick"].wait_ready()


@pytest.fixture(scope="module")
def few_connections(_servers):
    return _servers["few"].wait_ready()


def _connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=CLOSED_WITHIN_S)


def _closed_by_server(sock: socket.socket) -> bool:
    """Reads until the server closes the connection (True), or CLOSED_WITHIN_S passes (False)."""
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _healthy(server: Server) -> bool:
    return httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}


def test_a_slowloris_client_is_closed_while_health_answers(guarded):
    sock = _connect(guarded)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    sock.settimeout(0.5)
    deadline = time.monotonic() + CLOSED_WITHIN_S
    closed = False
    for i in range(1000):  # one more header line every half second, as slowloris does, until the server hangs up
        assert time.monotonic() < deadline, "the server kept a slowloris connection open"
        try:
            sock.sendall(f"X-Slow-{i}: a\r\n".encode())
            if sock.recv(4096) == b"":
                closed = True
                break
        except TimeoutError:
            assert _healthy(guarded)
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
    assert closed
    assert _healthy(guarded)


@pytest.mark.parametrize("sent", [b"", b"GET /hea", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                  b"Content-Length: 100\r\n\r\n{\"prompt\": "], ids=["nothing", "half a request line",
                                                                                    "half a body"])
def test_a_request_that_does_not_arrive_whole_is_closed(guarded, sent):
    sock = _connect(guarded)
    sock.sendall(sent)
    assert _healthy(guarded)
    assert _closed_by_server(sock)
    sock.close()


def test_an_idle_keep_alive_connection_is_closed(guarded):
    sock = _connect(guarded)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
        answer += sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 200")  # answered, and kept alive for the next request, which never comes
    assert _closed_by_server(sock)
    sock.close()


def test_past_max_connections_a_new_one_gets_503(few_connections):
    guarded = few_connections
    held = [_connect(guarded) for _ in range(MAX_CONNECTIONS)]
    try:
        extra = _connect(guarded)
        refusal = b""
        while chunk := extra.recv(4096):
            refusal += chunk
        assert refusal.startswith(b"HTTP/1.1 503") and b"too_many_connections" in refusal
        extra.close()
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + CLOSED_WITHIN_S
    while time.monotonic() < deadline:  # the held ones are gone once the server has seen them close
        try:
            if _healthy(guarded):
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    assert _healthy(guarded)
