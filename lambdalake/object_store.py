"""The object store under an ``s3://`` storage root: what its clients are told, from the settings.

pyarrow's S3 filesystem (small files: :mod:`lambdalake.storage`) and delta-rs (the master dataset) both read
the standard ``AWS_*`` variables; this module is the one place that sets them, for this process
(:func:`use`) and for the processes it starts (:func:`client_env`). Secrets travel in environments
only, never on a command line or in a log.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from lambdalake.settings import Settings


def on_object_store(root: str) -> bool:
    """Whether a storage root is on an S3-compatible store."""
    return root.startswith("s3://")


def bucket(root: str) -> str:
    """The bucket of an ``s3://bucket/prefix`` root."""
    return urlsplit(root).netloc


def client_env(settings: Settings) -> dict[str, str]:
    """The ``AWS_*`` variables pyarrow and delta-rs read for ``settings``' store (none for a local
    root)."""
    if not on_object_store(settings.storage_root):
        return {}
    store = settings.object_store
    env = {
        "AWS_ENDPOINT_URL": store.endpoint,
        "AWS_ACCESS_KEY_ID": store.access_key,
        "AWS_SECRET_ACCESS_KEY": store.secret_key.get_secret_value(),
        "AWS_REGION": store.region,
        "AWS_DEFAULT_REGION": store.region,
    }
    if store.endpoint.startswith("http://"):
        env["AWS_ALLOW_HTTP"] = "true"  # delta-rs refuses plain HTTP unless told
    return env


def use(settings: Settings) -> None:
    """Point this process's S3 clients at ``settings``' store (a local root changes nothing)."""
    os.environ.update(client_env(settings))
