"""HTTPS and mutual TLS through uvicorn's own TLS, with certificates made here by trustme (never committed)."""

from __future__ import annotations

import datetime
import socket
import ssl
import subprocess
import time

import httpx
import openai
import pytest
import trustme
from serverproc import LOAD_TIMEOUT_S, SERVAL, Server, running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def pki(ca, tmp_path_factory):
    """Files on disk: the CA, the server's certificate and key, a client certificate, and a stranger CA."""
    d = tmp_path_factory.mktemp("pki")
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    files = {"ca": d / "ca.pem", "cert": d / "server.pem", "key": d / "server.key", "client": d / "client.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    server_cert.cert_chain_pems[0].write_to_path(str(files["cert"]))
    server_cert.private_key_pem.write_to_path(str(files["key"]))
    ca.issue_cert("client@serval.test").private_key_and_cert_chain_pem.write_to_path(str(files["client"]))
    return files


class TLSServer(Server):
    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def wait_ready_tls(self, ctx: ssl.SSLContext) -> TLSServer:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serval serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", verify=ctx, timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"TLS server not healthy:\n{self.log()[-4000:]}")


def _client_context(pki, with_cert: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    if with_cert:
        ctx.load_cert_chain(str(pki["client"]))
    return ctx


@pytest.fixture(scope="module")
def tls_servers(pki, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tls-logs")
    tls_args = ["--ssl-certfile", str(pki["cert"]), "--ssl-keyfile", str(pki["key"])]
    with running({"tls": TLSServer(tls_args, logs / "tls.log"),
                  "mtls": TLSServer(tls_args + ["--ssl-ca-certs", str(pki["ca"]), "--ssl-cert-reqs", "required"],
                                    logs / "mtls.log")}) as servers:
        servers["tls"].wait_ready_tls(_client_context(pki, with_cert=False))
        servers["mtls"].wait_ready_tls(_client_context(pki, with_cert=True))
        yield servers


def test_openai_client_streams_over_https_with_the_test_ca(tls_servers, pki):
    server = tls_servers["tls"]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                           http_client=httpx.Client(verify=_client_context(pki, with_cert=False)))
    stream = client.completions.create(model="smollm2-135m-instruct", prompt="The capital city of Korea is",
                                       max_tokens=8, temperature=0, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert "Seoul" in text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_client_that_does_not_trust_the_ca_fails_the_handshake(tls_servers):
    server = tls_servers["tls"]
    stranger = ssl.create_default_context(cadata=trustme.CA().cert_pem.bytes().decode())
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{server.url}/health", verify=stranger, timeout=10)


def test_plain_http_to_the_tls_port_gets_no_model_output(tls_servers):
    server = tls_servers["tls"]
    body = b'{"prompt": "The capital city of Korea is", "max_tokens": 8, "temperature": 0}'
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    received = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request)
        try:
            while chunk := sock.recv(4096):
                received += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    assert b"Seoul" not in received and b"choices" not in received


def test_mutual_tls_refuses_a_client_without_a_certificate(tls_servers, pki):
    server = tls_servers["mtls"]
    with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
        response = httpx.get(f"{server.url}/health", verify=_client_context(pki, with_cert=False), timeout=10)
        response.raise_for_status()


def test_mutual_tls_lets_a_ca_signed_client_through(tls_servers, pki):
    server = tls_servers["mtls"]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                           http_client=httpx.Client(verify=_client_context(pki, with_cert=True)))
    out = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_tokens=16,
                                         messages=[{"role": "user", "content": "What is the capital city of Korea?"}])
    assert "Seoul" in out.choices[0].message.content


# -- start-up refuses bad files with one line that names the file ---------------------------------------------------


def _serve_fails(args: list[str]) -> str:
    proc = subprocess.run([str(SERVAL), "serve", "--port", "1", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_missing_certificate_stops_startup(pki, tmp_path):
    line = _serve_fails(["--ssl-certfile", str(tmp_path / "absent.pem"), "--ssl-keyfile", str(pki["key"])])
    assert "absent.pem" in line and "no such file" in line


def test_unreadable_key_stops_startup(pki, tmp_path):
    line = _serve_fails(["--ssl-certfile", str(pki["cert"]), "--ssl-keyfile", str(tmp_path)])
    assert str(tmp_path) in line and "not a file" in line


def test_expired_certificate_stops_startup(ca, tmp_path):
    old = ca.issue_cert("127.0.0.1", not_before=datetime.datetime(2020, 1, 1),
                       not_after=datetime.datetime(2021, 1, 1))
    cert, key = tmp_path / "old.pem", tmp_path / "old.key"
    old.cert_chain_pems[0].write_to_path(str(cert))
    old.private_key_pem.write_to_path(str(key))
    line = _serve_fails(["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)])
    assert "old.pem" in line and "expired" in line


def test_key_that_does_not_match_the_certificate_stops_startup(ca, pki, tmp_path):
    other_key = tmp_path / "other.key"
    ca.issue_cert("127.0.0.1").private_key_pem.write_to_path(str(other_key))
    line = _serve_fails(["--ssl-certfile", str(pki["cert"]), "--ssl-keyfile", str(other_key)])
    assert "other.key" in line and "does not match" in line


def test_garbage_certificate_stops_startup(pki, tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    line = _serve_fails(["--ssl-certfile", str(junk), "--ssl-keyfile", str(pki["key"])])
    assert "junk.pem" in line and "PEM" in line
