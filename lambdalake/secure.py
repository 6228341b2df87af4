"""What `lambdalake up --secure` records in the state folder, read by the settings of every command
that follows: that the embedded services are secured, where the CA is, and the principals' logins.

Layout under ``<state_dir>/secure/`` (owner-only):

- ``ca.pem``, ``server.pem``, ``server.key``, ``server-bundle.pem``: the embedded CA and the
  certificate every embedded service presents (:mod:`lambdalake.infra.tls` writes them);
- ``principals.json``: ``{"admin": {"username": ..., "password": ...}, "producer": ..., "speed": ...,
  "batch": ..., "serving": ...}``, one principal per role, each with the same login on Kafka
  (a SCRAM user), Cassandra (a role) and the registry (a basic-auth user); passwords drawn at
  random once, never printed. What each role may do is :mod:`lambdalake.grants`'.

This module owns that layout; the settings take their secured defaults from it.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Literal

#: The folder under the state folder.
FOLDER = "secure"
PRINCIPALS = "principals.json"
#: The services `up --secure` secures with a login.
SERVICES = ("kafka", "cassandra", "registry")
#: The principal of the platform's own set-up commands (up, deploy, topics, schemas, restore, speed
#: reset): a superuser of every service.
ADMIN = "lambdalake"
Role = Literal["admin", "producer", "speed", "batch", "serving"]
#: Every role, each a principal of its own: the admin, then the roles of the running platform with
#: only their rights (:mod:`lambdalake.grants`).
ROLES: tuple[Role, ...] = ("admin", "producer", "speed", "batch", "serving")


def username(role: Role) -> str:
    """The login name of ``role``'s principal on every service (an identifier Cassandra takes unquoted)."""
    return ADMIN if role == "admin" else f"{ADMIN}_{role}"


def folder(state_dir: Path) -> Path:
    return state_dir / FOLDER


def recorded(state_dir: Path) -> bool:
    """Whether `lambdalake up --secure` secured the embedded services of ``state_dir``."""
    return (folder(state_dir) / PRINCIPALS).exists()


def ca_file(state_dir: Path) -> Path:
    return folder(state_dir) / "ca.pem"


def server_cert(state_dir: Path) -> Path:
    """The certificate every embedded service presents (the serving API's too)."""
    return folder(state_dir) / "server.pem"


def server_key(state_dir: Path) -> Path:
    return folder(state_dir) / "server.key"


def principals(state_dir: Path) -> dict[str, dict[str, str]]:
    """Each role's login recorded by `up --secure` ({} when none)."""
    try:
        return json.loads((folder(state_dir) / PRINCIPALS).read_text())
    except (OSError, ValueError):
        return {}


def ensure_principals(state_dir: Path) -> dict[str, dict[str, str]]:
    """The recorded logins, drawn (a random password per role) and written on the first call."""
    known = principals(state_dir)
    if all(role in known for role in ROLES):
        return known
    wanted = {role: {"username": username(role), "password": secrets.token_urlsafe(24)} for role in ROLES}
    merged = {**wanted, **{role: login for role, login in known.items() if role in ROLES}}
    path = folder(state_dir) / PRINCIPALS
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(json.dumps(merged, indent=2))
    return merged


CertificateFault = Literal["names another host", "expired", "untrusted"]


def certificate_fault(error: str) -> CertificateFault | None:
    """What a TLS client's error text says was wrong with the server's certificate (OpenSSL's and
    Python's words, as librdkafka, the Cassandra driver and the registry's HTTP client report them):
    it names other hosts, it has expired, or no trusted CA signed it; None for anything else."""
    text = error.lower()
    if "mismatch" in text and ("hostname" in text or "ip address" in text):
        return "names another host"
    if "certificate has expired" in text or ("expired" in text and "certificate" in text):
        return "expired"
    if "certificate verify failed" in text:
        return "untrusted"
    return None


def server_certificate_fault(
    address: str, ca_location: str | None, *, check_hostname: bool = True, timeout_s: float = 5.0
) -> CertificateFault | None:
    """What is wrong with the certificate the TLS server at ``address`` (``host:port``) presents,
    checked with Python's own TLS client against ``ca_location`` (None: the system store): it names
    other hosts, it has expired, no trusted CA signed it; None when it passes or nothing answers.

    Some clients say only that verification failed (librdkafka: "certificate verify failed");
    OpenSSL's own verdict, which this reads, says why."""
    import socket
    import ssl

    host, _, port = address.rpartition(":")
    context = ssl.create_default_context(cafile=ca_location)
    context.check_hostname = check_hostname
    try:
        with (
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as raw,
            context.wrap_socket(raw, server_hostname=host.strip("[]")),
        ):
            return None
    except ssl.SSLCertVerificationError as exc:
        return certificate_fault(f"{exc.verify_message} {exc}") or "untrusted"
    except (OSError, ValueError):
        return None
