"""Talking to the schema registry: registering a pipeline's schema versions, fetching writer schemas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from lambdalake.errors import ConfigurationError, ServiceUnavailable
from lambdalake.pipeline import Pipeline
from lambdalake.secure import certificate_fault
from lambdalake.settings import Settings, mask_url


@dataclass(frozen=True)
class RegisteredVersion:
    file: str
    schema_id: int
    version: int


def client(settings: Settings) -> SchemaRegistryClient:
    return SchemaRegistryClient(settings.registry.client_config())


def _unavailable(settings: Settings, exc: Exception) -> ServiceUnavailable:
    return ServiceUnavailable(
        f"cannot reach the schema registry at {settings.registry.url}: {exc.__class__.__name__}",
        fix="start the embedded services with `lambdalake up`, or set LAMBDALAKE_REGISTRY__URL",
    )


def refusal(settings: Settings, exc: Exception) -> ConfigurationError | None:
    """The settings' fault an error of the registry's client shows, naming the setting to fix (None:
    another error)."""
    registry = settings.registry
    user = (
        registry.basic_auth_user_info.get_secret_value().partition(":")[0]
        if registry.basic_auth_user_info
        else None
    )
    if isinstance(exc, SchemaRegistryError) and exc.http_status_code == 403 and exc.error_code == 40301:
        return ConfigurationError(
            f"the schema registry refused user {user!r} a change (it may only read): {exc.error_message}",
            fix="register schemas with `lambdalake deploy` (the admin's login), or grant this user "
            "write rights on the subject",
        )
    if isinstance(exc, SchemaRegistryError) and exc.http_status_code in (401, 403):
        who = f"user {user!r}" if user else "no login"
        return ConfigurationError(
            f"the schema registry at {mask_url(registry.url)} refused the login ({who}): "
            f"HTTP {exc.http_status_code}",
            fix="set LAMBDALAKE_REGISTRY__BASIC_AUTH_USER_INFO to <user>:<password> of a registry user",
        )
    fault = certificate_fault(str(exc))
    if fault == "names another host":
        return ConfigurationError(
            f"the schema registry's certificate does not name the host of {mask_url(registry.url)}",
            fix="set LAMBDALAKE_REGISTRY__URL to a name its certificate holds, or reissue the certificate",
        )
    if fault == "expired":
        return ConfigurationError(
            "the schema registry's certificate has expired",
            fix="reissue it (the embedded one: `lambdalake up --secure` renews it)",
        )
    if fault == "untrusted":
        return ConfigurationError(
            "the schema registry's certificate is not signed by the CA in "
            f"{registry.ssl_ca_location or 'the system store'}",
            fix="set LAMBDALAKE_REGISTRY__SSL_CA_LOCATION to the PEM file of the CA that signed it",
        )
    return None


def call(settings: Settings, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a registry client method, turning connection failures and refused logins into an error
    naming the fix."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # also requests/httpx connection errors of the client
        refused = refusal(settings, exc)
        if refused is not None:
            raise refused from None
        if isinstance(exc, SchemaRegistryError):
            raise
        raise _unavailable(settings, exc) from exc


@dataclass(frozen=True)
class Compatibility:
    """The registry's verdict on a candidate schema under a subject, with its reasons."""

    compatible: bool
    reasons: list[str]


def check_compatibility(
    settings: Settings, sr: SchemaRegistryClient, subject: str, schema: Schema
) -> Compatibility:
    """The registry's compatibility verdict on ``schema`` under ``subject``, without registering it.

    Raises:
        SchemaRegistryError: the registry refused the request (404: the subject is new).
    """
    # The client's public test_compatibility returns a bare boolean; the verbose answer names why.
    answer = call(
        settings,
        sr._rest_client.post,
        f"compatibility/subjects/{subject}/versions?verbose=true",
        body=schema.to_dict(),
    )
    return Compatibility(bool(answer.get("is_compatible", False)), list(answer.get("messages", [])))


def subject_schemas(settings: Settings, subject: str) -> dict[int, str]:
    """Every schema registered under ``subject``, by registry id (empty for an unknown subject)."""
    sr = client(settings)
    try:
        versions = call(settings, sr.get_versions, subject)
    except SchemaRegistryError as exc:
        if exc.http_status_code == 404:
            return {}
        raise
    out = {}
    for version in versions:
        registered = call(settings, sr.get_version, subject, version)
        out[registered.schema_id] = registered.schema.schema_str
    return out


def _lookup(settings: Settings, sr: SchemaRegistryClient, subject: str, schema: Schema) -> Any:
    """``schema``'s registration under ``subject`` (id and version), or None when it has none."""
    try:
        return call(settings, sr.lookup_schema, subject, schema)
    except SchemaRegistryError as exc:
        if exc.http_status_code == 404:
            return None
        raise


def register_pipeline(
    settings: Settings,
    pipeline: Pipeline,
    *,
    up_to: int | None = None,
    sr: SchemaRegistryClient | None = None,
) -> list[RegisteredVersion]:
    """Register the pipeline's schema versions in order (idempotent); ``sr``: the caller's client.

    Raises:
        ConfigurationError: the registry refused a version, with its reason (e.g. incompatible).
    """
    sr = sr or client(settings)
    subject = pipeline.schema_.subject
    out = []
    for i, file in enumerate(pipeline.schema_.versions[:up_to], start=1):
        schema = Schema(pipeline.schema_text(i), "AVRO")
        if not settings.provisions:  # it only reads schemas: deploy registered them
            found = _lookup(settings, sr, subject, schema)
            if found is not None:
                out.append(RegisteredVersion(file, found.schema_id, found.version))
                continue
        try:
            registered = call(settings, sr.register_schema_full_response, subject, schema)
            # Older servers answer only {"id"}; ask for the version explicitly then.
            version = registered.version or call(settings, sr.lookup_schema, subject, schema).version
        except SchemaRegistryError as exc:
            raise ConfigurationError(
                f"the registry refused {file} for subject {subject!r}: {exc.error_message}",
                fix="make the new version compatible (e.g. give new fields a default) or change the "
                "subject's compatibility level",
            ) from exc
        out.append(RegisteredVersion(file, registered.schema_id, version))
    return out
