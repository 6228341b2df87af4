"""What `lambdalake up --secure` records in the state folder, read by the settings of every command
that follows: that the embedded services are secured, where the CA is, and the principals' logins.

Layout under ``<state_dir>/secure/`` (owner-only):

- ``ca.pem``, ``server.pem``, ``server.key``, ``server-bundle.pem``: the embedded CA and the
  certificate every embedded service presents (:mod:`lambdalake.infra.tls` writes them);
- ``principals.json``: ``{"kafka": {"username": ..., "password": ...}, "cassandra": ..., "registry":
  ...}``, the logins `up --secure` created (passwords drawn at random once, never printed).

This module owns that layout; the settings take their secured defaults from it.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

#: The folder under the state folder.
FOLDER = "secure"
PRINCIPALS = "principals.json"
#: The services `up --secure` secures with a login.
SERVICES = ("kafka", "cassandra", "registry")
#: The role `up --secure` creates for the platform's own commands (a superuser of the cluster).
ADMIN = "lambdalake"


def folder(state_dir: Path) -> Path:
    return state_dir / FOLDER


def recorded(state_dir: Path) -> bool:
    """Whether `lambdalake up --secure` secured the embedded services of ``state_dir``."""
    return (folder(state_dir) / PRINCIPALS).exists()


def ca_file(state_dir: Path) -> Path:
    return folder(state_dir) / "ca.pem"


def principals(state_dir: Path) -> dict[str, dict[str, str]]:
    """Each service's login recorded by `up --secure` ({} when none)."""
    try:
        return json.loads((folder(state_dir) / PRINCIPALS).read_text())
    except (OSError, ValueError):
        return {}


def ensure_principals(state_dir: Path) -> dict[str, dict[str, str]]:
    """The recorded logins, drawn (a random password per service) and written on the first call."""
    known = principals(state_dir)
    wanted = {name: {"username": ADMIN, "password": secrets.token_urlsafe(24)} for name in SERVICES}
    if all(name in known for name in wanted):
        return known
    merged = {**wanted, **known}
    path = folder(state_dir) / PRINCIPALS
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(json.dumps(merged, indent=2))
    return merged
