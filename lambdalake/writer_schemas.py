"""Writer schemas by registry id, over the registry's REST API with the standard library.

The tasks that decode records need one call of the registry (``GET /schemas/ids/{id}``) per writer
schema they meet. confluent-kafka's ``SchemaRegistryClient`` answers it too, but importing it brings
httpx and authlib into every Python worker, with their memory and import time, for one GET. The
rest of the platform (registering, compatibility) keeps using confluent-kafka's client
(:mod:`lambdalake.registry`).

Credentials are taken as confluent-kafka's client takes them: ``basic.auth.user.info`` when given,
else the URL's user info.
"""

from __future__ import annotations

import base64
import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from lambdalake.settings import mask_url

_ACCEPT = "application/vnd.schemaregistry.v1+json, application/json"


class SchemaIdNotFound(LookupError):
    """The registry answered that it holds no schema of this id."""


class RegistryUnavailable(RuntimeError):
    """The registry did not answer, or answered with an error other than 'not found'."""


def _endpoint(registry: Mapping[str, Any]) -> tuple[str, str | None]:
    """(base URL without user info, ``Authorization`` header value or None)."""
    parts = urlsplit(str(registry["url"]))
    user_info = registry.get("basic.auth.user.info")
    netloc = parts.netloc
    if "@" in netloc:
        in_url, _, netloc = netloc.rpartition("@")
        user_info = user_info or unquote(in_url)
    base = urlunsplit(parts._replace(netloc=netloc)).rstrip("/")
    if not user_info:
        return base, None
    return base, "Basic " + base64.b64encode(str(user_info).encode()).decode()


def tls_context(registry: Mapping[str, Any]) -> ssl.SSLContext:
    """The TLS context trusting the registry's CA: its PEM text (``ssl.ca.pem``, as tasks get it),
    its file (``ssl.ca.location``), or else the system's CAs."""
    if registry.get("ssl.ca.pem"):
        return ssl.create_default_context(cadata=str(registry["ssl.ca.pem"]))
    return ssl.create_default_context(cafile=registry.get("ssl.ca.location"))


def fetcher(
    registry: Mapping[str, Any],
    *,
    attempts: int = 3,
    backoff_s: float = 0.5,
    timeout_s: float = 30.0,
    patience_s: float | None = None,
) -> Callable[[int], str]:
    """A ``schema id -> schema text`` lookup, cached (a registry never changes the schema of an id).

    Args:
        registry: The client config of :meth:`lambdalake.settings.RegistrySettings.client_config`.
        attempts: Calls per id before a connection failure or a 5xx answer is raised. Default 3.
        backoff_s: Wait before the second call, doubled before each next one. Default 0.5 s.
        timeout_s: Per call. Default 30 s.
        patience_s: Keep calling (waits of at most 5 s) for this long before a connection failure
            or a 5xx answer is raised, whatever ``attempts`` says: a stream's decoder rides out a
            registry's restart instead of failing its tasks until the query dies. Default None.

    The lookup raises :class:`SchemaIdNotFound` for an id the registry does not hold, and
    :class:`RegistryUnavailable` (naming the URL without credentials) when it cannot tell.
    """
    base, auth = _endpoint(registry)
    context = tls_context(registry) if base.startswith("https:") else None
    cache: dict[int, str] = {}

    def get(schema_id: int) -> str:
        if schema_id in cache:
            return cache[schema_id]
        request = urllib.request.Request(f"{base}/schemas/ids/{int(schema_id)}", headers={"Accept": _ACCEPT})
        if auth is not None:
            request.add_header("Authorization", auth)
        wait = backoff_s
        deadline = time.monotonic() + patience_s if patience_s is not None else None
        attempt = 0
        while True:
            attempt += 1
            try:
                with urllib.request.urlopen(request, timeout=timeout_s, context=context) as answer:
                    body = json.loads(answer.read())
                cache[schema_id] = body["schema"]
                return cache[schema_id]
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    raise SchemaIdNotFound(f"schema id {schema_id} is not in the registry") from None
                problem: Exception = exc
                if exc.code < 500:  # 401, 403...: asking again will not help
                    break
            except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
                problem = exc
            if attempt >= attempts and (deadline is None or time.monotonic() + wait > deadline):
                break
            time.sleep(wait)
            wait = min(wait * 2, 5.0) if deadline is not None else wait * 2
        raise RegistryUnavailable(
            f"cannot read schema id {schema_id} from the registry at {mask_url(base)}: {problem}"
        ) from problem

    return get
