"""The object store under an ``s3://`` storage root: what its clients are told, from the settings.

pyarrow's S3 filesystem (small files: :mod:`lambdalake.storage`) and delta-rs (the master dataset) both read
the standard ``AWS_*`` variables; this module is the one place that sets them, for this process
(:func:`use`) and for the processes it starts (:func:`client_env`). Secrets travel in environments
only, never on a command line or in a log.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from lambdalake.errors import ConfigurationError, LambdalakeError, ServiceUnavailable
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


#: How each client says the store did not answer: pyarrow (the AWS SDK for C++), delta-rs
#: (object_store), S3A (the AWS SDK for Java).
_UNREACHABLE = (
    "NETWORK_CONNECTION", "Could not connect to server", "error sending request", "Connection refused",
    "ConnectException", "Unable to execute HTTP request", "connect timed out",
)  # fmt: skip
_NO_BUCKET = (
    "NoSuchBucket", "NO_SUCH_BUCKET", "UnknownStoreException", "The specified bucket does not exist",
)  # fmt: skip
_WRONG_KEY = (
    "SignatureDoesNotMatch", "SIGNATURE_DOES_NOT_MATCH", "InvalidAccessKeyId", "INVALID_ACCESS_KEY_ID",
)  # fmt: skip
_DENIED = ("AccessDenied", "ACCESS_DENIED", "lacked the necessary privileges", "403 Forbidden")
#: The fix for a store that does not answer.
_START = (
    "start it (`lambdalake up` runs the embedded one), or set LAMBDALAKE_OBJECT_STORE__ENDPOINT to where "
    "it listens"
)


def explain(error: BaseException | str, settings: Settings) -> LambdalakeError | None:
    """A store's failure as one error naming the setting to fix: a missing bucket, a wrong key or one
    without the rights the lake needs (:class:`ConfigurationError`: a person must act), or a store that
    did not answer (:class:`ServiceUnavailable`: it may pass). None for any other error, and for a
    local storage root."""
    root = settings.storage_root
    if not on_object_store(root):
        return None
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    store = settings.object_store
    where = urlsplit(store.endpoint).netloc
    # Only errors that are the store's: its address, or a client's S3 wording.
    if where not in text and "S3" not in text and "s3a" not in text.lower() and "AWS Error" not in text:
        return None
    name = bucket(root)
    if any(m in text for m in _NO_BUCKET):
        return ConfigurationError(
            f"the bucket {name!r} of the storage root {root} does not exist on the object store at "
            f"{store.endpoint}",
            fix="create the bucket, or set LAMBDALAKE_STORAGE_ROOT to s3://<a bucket that exists>/<prefix>",
        )
    if any(m in text for m in _WRONG_KEY):
        return ConfigurationError(
            f"the object store at {store.endpoint} did not accept the key {store.access_key!r}: the access "
            "key or its secret is wrong",
            fix="set LAMBDALAKE_OBJECT_STORE__ACCESS_KEY and LAMBDALAKE_OBJECT_STORE__SECRET_KEY to a key "
            "of the store",
        )
    if any(m in text for m in _DENIED):
        return ConfigurationError(
            f"the object store at {store.endpoint} denied the key {store.access_key!r} a right on "
            f"s3://{name}: the lake reads, writes, lists and deletes under the storage root",
            fix="grant the key s3:GetObject, s3:PutObject, s3:DeleteObject and s3:ListBucket on "
            f"s3://{name}, or set LAMBDALAKE_OBJECT_STORE__ACCESS_KEY and __SECRET_KEY to a key with them",
        )
    if any(m in text for m in _UNREACHABLE):
        return ServiceUnavailable(
            f"the object store at {store.endpoint} did not answer",
            fix=f"{_START}; then run the command again (a batch it stopped published nothing)",
        )
    return None


def answers(settings: Settings) -> bool:
    """Whether the store of an ``s3://`` root answers HTTP at all (any status: an anonymous request
    is refused, which is an answer)."""
    import httpx

    try:
        httpx.get(settings.object_store.endpoint, timeout=5)
    except httpx.HTTPError:
        return False
    return True


def _writes(settings: Settings) -> bool:
    """Whether a small object can be written and deleted under the storage root: False while the
    store does not answer; an error naming the fix when it refuses (rights, bucket, key)."""
    import socket
    import uuid

    from lambdalake.layout import probe_file
    from lambdalake.storage import delete_file, write_bytes

    probe = probe_file(settings.storage_root, f"{socket.gethostname()}-{uuid.uuid4().hex[:12]}")
    try:
        write_bytes(probe, b"")
        delete_file(probe)
    except Exception as exc:
        known = explain(exc, settings)
        if isinstance(known, ServiceUnavailable):
            return False
        raise known or exc from None
    return True


def wait_for_store(
    settings: Settings,
    *,
    patience_s: float,
    on_wait: Callable[[], None] | None = None,
    pause: Callable[[float], object] = time.sleep,
) -> None:
    """Before a job that writes the lake: wait up to ``patience_s`` for the store of an ``s3://``
    root to answer (a store restarting, or down for a minute, is waited out rather than failing the
    run half way); then an error naming it and the fix. Once it answers, one small object is
    written and deleted under the root, so a key without write rights (or a missing bucket) is
    refused before the job writes anywhere else, not half way through a Spark stage. A local root
    returns at once. ``pause`` waits between probes (a stop event's ``wait`` lets a signal end the
    wait early: it returns True)."""
    if not on_object_store(settings.storage_root):
        return
    deadline = time.monotonic() + patience_s
    told = False
    while not answers(settings) or not _writes(settings):
        if time.monotonic() >= deadline:
            raise ServiceUnavailable(
                f"the object store at {settings.object_store.endpoint} did not answer in {patience_s:.0f}s",
                fix=_START,
            )
        if not told and on_wait is not None:
            on_wait()
            told = True
        if pause(2) is True:
            return
