"""TLS settings for the server (and later the router and clients), checked before anything starts.

uvicorn does the TLS itself; this module only holds the settings and proves they are usable, so a bad
certificate stops start-up with one line that names the file instead of a traceback mid-start.
"""

from __future__ import annotations

import datetime
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from serval.flags import flag

_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


class TLSConfigError(ValueError):
    """A TLS file is missing, unreadable, expired or does not fit its partner."""


@dataclass(frozen=True)
class TLSConfig:
    certfile: str | None = field(default=None, metadata=flag("serve HTTPS with this PEM certificate (chain)",
                                                             name="--ssl-certfile"))
    keyfile: str | None = field(default=None, metadata=flag("the certificate's PEM private key",
                                                            name="--ssl-keyfile"))
    keyfile_password: str | None = field(default=None, metadata=flag("unlocks an encrypted --ssl-keyfile",
                                                                     name="--ssl-keyfile-password"))
    ca_certs: str | None = field(default=None, metadata=flag(  # for mutual TLS
        "CA bundle for client certificates (mutual TLS)", name="--ssl-ca-certs"))
    cert_reqs: str = field(default="none", metadata=flag(
        "whether clients must present a certificate signed by --ssl-ca-certs", name="--ssl-cert-reqs",
        choices=tuple(_CERT_REQS)))

    @property
    def enabled(self) -> bool:
        return self.certfile is not None

    def validate(self) -> None:
        """Raises TLSConfigError with one line naming the faulty file."""
        if self.cert_reqs not in _CERT_REQS:
            raise TLSConfigError(f"--ssl-cert-reqs must be one of {', '.join(_CERT_REQS)}, got {self.cert_reqs!r}")
        if not self.enabled:
            if self.keyfile or self.ca_certs or self.cert_reqs != "none":
                raise TLSConfigError("TLS options need --ssl-certfile (and --ssl-keyfile)")
            return
        if not self.keyfile:
            raise TLSConfigError(f"--ssl-certfile {self.certfile} needs its --ssl-keyfile")
        if self.cert_reqs != "none" and not self.ca_certs:
            raise TLSConfigError(f"--ssl-cert-reqs {self.cert_reqs} needs --ssl-ca-certs to check client certificates")
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        cert_pem = _read(self.certfile, "certificate")
        try:
            cert = x509.load_pem_x509_certificate(cert_pem)
        except ValueError:
            raise TLSConfigError(f"TLS certificate {self.certfile}: not a PEM certificate") from None
        now = datetime.datetime.now(datetime.timezone.utc)
        if cert.not_valid_after_utc < now:
            raise TLSConfigError(f"TLS certificate {self.certfile}: expired on {cert.not_valid_after_utc:%Y-%m-%d}")
        if cert.not_valid_before_utc > now:
            raise TLSConfigError(f"TLS certificate {self.certfile}: not valid before "
                                 f"{cert.not_valid_before_utc:%Y-%m-%d}")
        key_pem = _read(self.keyfile, "key")
        password = self.keyfile_password.encode() if self.keyfile_password else None
        try:
            key = serialization.load_pem_private_key(key_pem, password=password)
        except TypeError:  # encrypted without a password, or a password for a plain key
            raise TLSConfigError(f"TLS key {self.keyfile}: wrong or missing --ssl-keyfile-password") from None
        except ValueError:
            raise TLSConfigError(f"TLS key {self.keyfile}: not a PEM private key, or the password is wrong") from None
        raw = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        if key.public_key().public_bytes(*raw) != cert.public_key().public_bytes(*raw):
            raise TLSConfigError(f"TLS key {self.keyfile} does not match the certificate {self.certfile}")
        if self.ca_certs:
            try:
                x509.load_pem_x509_certificates(_read(self.ca_certs, "CA bundle"))
            except ValueError:
                raise TLSConfigError(f"TLS CA bundle {self.ca_certs}: no PEM certificates in it") from None
        try:  # the same load uvicorn will do: whatever else is wrong shows here, with the file named
            self.server_context()
        except ssl.SSLError as exc:
            raise TLSConfigError(f"TLS certificate {self.certfile} / key {self.keyfile}: {exc.reason or exc}") from None

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.certfile, self.keyfile, self.keyfile_password)
        context.verify_mode = _CERT_REQS[self.cert_reqs]
        if self.ca_certs:
            context.load_verify_locations(self.ca_certs)
        return context

    def uvicorn_kwargs(self) -> dict:
        if not self.enabled:
            return {}
        return {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile,
                "ssl_keyfile_password": self.keyfile_password, "ssl_ca_certs": self.ca_certs,
                "ssl_cert_reqs": _CERT_REQS[self.cert_reqs]}


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise TLSConfigError(f"TLS {what} {path}: no such file") from None
    except IsADirectoryError:
        raise TLSConfigError(f"TLS {what} {path}: is a directory, not a file") from None
    except PermissionError:
        raise TLSConfigError(f"TLS {what} {path}: permission denied") from None
    except OSError as exc:
        raise TLSConfigError(f"TLS {what} {path}: cannot read ({exc.strerror})") from None
