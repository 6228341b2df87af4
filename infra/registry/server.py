"""HTTP front of the registry: the Confluent Schema Registry REST routes confluent-kafka's client uses,
on FastAPI/Starlette (served by uvicorn), answering every error in Confluent's form
``{"error_code": ..., "message": ...}``.

Request parsing, size limits and content types are checked before any route runs, so a wrong-shaped
request gets a 4xx answer and never reaches Kafka.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import unicodedata
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lambdalake.infra.registry.store import KafkaBackedStore, RegistryError

log = logging.getLogger("lambdalake.registry")

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
#: Content types Confluent's registry accepts for request bodies.
ACCEPTED_TYPES = (
    "application/vnd.schemaregistry.v1+json",
    "application/vnd.schemaregistry+json",
    "application/json",
    "application/octet-stream",
)
#: Largest schema accepted, in bytes of its JSON text. The broker refuses records near 1 MB, and a
#: schema that large is a generated mistake rather than an event definition.
MAX_SCHEMA_BYTES = 256 * 1024
#: Request bodies carry one schema and a little JSON around it; a body up to this size is read, so
#: a schema over its own limit is answered with that limit named (42209) rather than a bare 413.
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_SUBJECT_CHARS = 255


class RegistryResponse(JSONResponse):
    media_type = CONTENT_TYPE


def _error(status: int, code: int, message: str) -> RegistryResponse:
    return RegistryResponse({"error_code": code, "message": message}, status_code=status)


def registered(subject: str, version: int, sid: int, schema: str) -> dict[str, Any]:
    return {"subject": subject, "version": version, "id": sid, "schema": schema}


def check_subject(subject: str) -> str:
    if not subject or len(subject) > MAX_SUBJECT_CHARS:
        raise RegistryError(422, 42208, f"Invalid subject: length must be 1-{MAX_SUBJECT_CHARS} characters")
    bad = [c for c in subject if unicodedata.category(c)[0] == "C"]
    if bad:
        raise RegistryError(
            422, 42208, f"Invalid subject {subject!r}: control characters {sorted(set(map(repr, bad)))}"
        )
    return subject


async def json_body(request: Request) -> Any:
    """The request's JSON body, refused with a 4xx before any route logic when it cannot be one."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind and kind not in ACCEPTED_TYPES:
        raise RegistryError(415, 415, f"HTTP 415 Unsupported Media Type {kind!r}; use {CONTENT_TYPE}")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RegistryError(
            413, 413, f"request body of {declared} bytes is above the limit of {MAX_BODY_BYTES} bytes"
        )
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise RegistryError(413, 413, f"request body is above the limit of {MAX_BODY_BYTES} bytes")
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise RegistryError(400, 400, f"request body is not JSON: {exc}") from None


Body = Annotated[Any, Depends(json_body)]


def _object(body: Any) -> dict[str, Any]:
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise RegistryError(422, 422, f"request body must be a JSON object, not {type(body).__name__}")
    return body


def schema_str(body: Any) -> str:
    body = _object(body)
    if body.get("schemaType", "AVRO") != "AVRO":
        raise RegistryError(422, 42201, "only AVRO schemas are supported by the embedded registry")
    if body.get("references"):
        raise RegistryError(422, 42201, "schema references are not supported by the embedded registry")
    if "schema" not in body:
        raise RegistryError(422, 42201, "request body has no 'schema'")
    schema = body["schema"]
    if not isinstance(schema, str):
        raise RegistryError(422, 42201, f"'schema' must be a string of JSON, not {type(schema).__name__}")
    size = len(schema.encode("utf-8", "surrogatepass"))
    if size > MAX_SCHEMA_BYTES:
        raise RegistryError(
            422, 42209, f"Schema of {size} bytes is above the limit of {MAX_SCHEMA_BYTES} bytes"
        )
    return schema


def level_of(body: Any) -> str:
    level = _object(body).get("compatibility")
    if not isinstance(level, str):
        raise RegistryError(
            422, 42203, f"Invalid compatibility level {level!r}: give 'compatibility' as a string"
        )
    return level


def make_app(
    store: KafkaBackedStore, users: dict[str, str] | None = None, writers: frozenset[str] | None = None
) -> FastAPI:
    """The registry's ASGI app over ``store``; ``users`` (name: password): HTTP basic auth on every
    route, as Confluent's registry with basic auth answers (401, error code 40101); ``writers``: the
    users who may change anything (register, delete, set a level or mode), the others only read
    (403, 40301, as Confluent's registry with access rules answers). None: every user may."""
    app = FastAPI(title="lambdalake schema registry", docs_url=None, redoc_url=None, openapi_url=None)
    if users:
        _add_basic_auth(app, users, writers)
    _add_error_handlers(app)
    _add_schema_routes(app, store)
    _add_subject_routes(app, store)
    _add_compatibility_and_config_routes(app, store)
    return app


def _add_basic_auth(app: FastAPI, users: dict[str, str], writers: frozenset[str] | None) -> None:
    """HTTP basic auth on every route (401, 40101), and writes for ``writers`` only (403, 40301)."""
    allowed = {name: password.encode() for name, password in users.items()}

    @app.middleware("http")
    async def basic_auth(request: Request, call_next: Any) -> Any:
        user = _authenticated(request.headers.get("authorization", ""), allowed)
        if user is None:
            response = _error(401, 40101, "Unauthorized: a valid login is required (HTTP basic auth)")
            response.headers["WWW-Authenticate"] = 'Basic realm="lambdalake schema registry"'
            return response
        if writers is not None and user not in writers and _writes(request.method, request.url.path):
            return _error(
                403, 40301,
                f"User {user} is denied operation Write on {request.url.path}: only "
                f"{', '.join(sorted(writers))} may register or change schemas",
            )  # fmt: skip
        return await call_next(request)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as Confluent's registry answers it: ``{"error_code", "message"}``."""

    @app.exception_handler(RegistryError)
    async def registry_error(_request: Request, exc: RegistryError) -> RegistryResponse:
        return _error(exc.status, exc.code, exc.message)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> RegistryResponse:
        return _error(
            exc.status_code, exc.status_code, f"HTTP {exc.status_code} {exc.detail}: {request.url.path}"
        )

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> RegistryResponse:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return _error(422, 422, f"invalid request: {problems}")

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> RegistryResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return _error(500, 50001, f"internal error: {type(exc).__name__}")


#: Every route answers JSON with the registry's media type.
OK: dict[str, Any] = {"response_class": RegistryResponse}


def _add_schema_routes(app: FastAPI, store: KafkaBackedStore) -> None:
    """``/``, ``/schemas/...``: schemas by id, and where each is used."""

    @app.get("/", **OK)
    def root() -> Any:
        return {}

    @app.get("/schemas/types", **OK)
    def schema_types() -> Any:
        return ["AVRO"]

    @app.get("/schemas/ids/{sid}", **OK)
    def schema_by_id(sid: int) -> Any:
        return {"schema": store.schema(sid)}

    @app.get("/schemas/ids/{sid}/schema", **OK)
    def raw_schema_by_id(sid: int) -> Any:
        return json.loads(store.schema(sid))

    def usages(sid: int, deleted: bool) -> list[tuple[str, int]]:
        store.schema(sid)
        return [
            (subject, v)
            for subject, versions in sorted(store.state.subjects.items())
            for v, ver in sorted(versions.items())
            if ver.id == sid and (deleted or not ver.deleted)
        ]

    @app.get("/schemas/ids/{sid}/subjects", **OK)
    def subjects_of_id(sid: int, deleted: bool = False) -> Any:
        return sorted({s for s, _ in usages(sid, deleted)})

    @app.get("/schemas/ids/{sid}/versions", **OK)
    def versions_of_id(sid: int, deleted: bool = False) -> Any:
        return [{"subject": s, "version": v} for s, v in usages(sid, deleted)]


def _add_subject_routes(app: FastAPI, store: KafkaBackedStore) -> None:
    """``/subjects/...``: versions, registering, looking up, deleting."""

    @app.get("/subjects", **OK)
    def subjects(deleted: bool = False) -> Any:
        return store.subjects(include_deleted=deleted)

    @app.get("/subjects/{subject}/versions", **OK)
    def versions(subject: str, deleted: bool = False) -> Any:
        return list(store.live_versions(check_subject(subject), include_deleted=deleted))

    @app.get("/subjects/{subject}/versions/{version}", **OK)
    def get_version(subject: str, version: str, deleted: bool = False) -> Any:
        v, ver = store.version(check_subject(subject), version, include_deleted=deleted)
        return registered(subject, v, ver.id, ver.schema)

    @app.get("/subjects/{subject}/versions/{version}/schema", **OK)
    def get_version_schema(subject: str, version: str) -> Any:
        return json.loads(store.version(check_subject(subject), version)[1].schema)

    @app.post("/subjects/{subject}/versions", **OK)
    def register(subject: str, body: Body) -> Any:
        schema = schema_str(body)
        sid, version = store.register(check_subject(subject), schema)
        log.info("registered %s version %d as id %d", subject, version, sid)
        return registered(subject, version, sid, schema)

    @app.post("/subjects/{subject}", **OK)
    def lookup(subject: str, body: Body) -> Any:
        schema = schema_str(body)
        v, ver = store.lookup(check_subject(subject), schema)
        return registered(subject, v, ver.id, ver.schema)

    @app.delete("/subjects/{subject}", **OK)
    def delete_subject(subject: str, permanent: bool = False) -> Any:
        return store.delete_subject(check_subject(subject), permanent=permanent)

    @app.delete("/subjects/{subject}/versions/{version}", **OK)
    def delete_version(subject: str, version: str, permanent: bool = False) -> Any:
        return store.delete_version(check_subject(subject), version, permanent=permanent)


def _add_compatibility_and_config_routes(app: FastAPI, store: KafkaBackedStore) -> None:
    """``/compatibility/...``, ``/config/...`` and ``/mode``."""

    def compatibility(subject: str, version: str | None, body: Any, verbose: bool) -> Any:
        schema = schema_str(body)
        check_subject(subject)
        if version is not None:
            store.version(subject, version)  # 404s like Confluent's for a missing subject/version
        reasons = store.compatibility_errors(subject, schema, version)
        answer: dict[str, Any] = {"is_compatible": not reasons}
        if verbose:
            answer["messages"] = reasons
        return answer

    @app.post("/compatibility/subjects/{subject}/versions", **OK)
    def test_compatibility_all(subject: str, body: Body, verbose: bool = False) -> Any:
        return compatibility(subject, None, body, verbose)

    @app.post("/compatibility/subjects/{subject}/versions/{version}", **OK)
    def test_compatibility(subject: str, version: str, body: Body, verbose: bool = False) -> Any:
        return compatibility(subject, version, body, verbose)

    @app.get("/config", **OK)
    def get_global_config() -> Any:
        return {"compatibilityLevel": store.level(None)}

    @app.put("/config", **OK)
    def put_global_config(body: Body) -> Any:
        level = level_of(body)
        store.set_level(None, level)
        return {"compatibility": level.upper()}

    @app.get("/config/{subject}", **OK)
    def get_subject_config(subject: str, defaultToGlobal: bool = False) -> Any:
        if check_subject(subject) not in store.state.configs and not defaultToGlobal:
            raise RegistryError(
                404, 40408, f"Subject '{subject}' does not have subject-level compatibility configured"
            )
        return {"compatibilityLevel": store.level(subject)}

    @app.put("/config/{subject}", **OK)
    def put_subject_config(subject: str, body: Body) -> Any:
        level = level_of(body)
        store.set_level(check_subject(subject), level)
        return {"compatibility": level.upper()}

    @app.delete("/config/{subject}", **OK)
    def delete_subject_config(subject: str) -> Any:
        return {"compatibilityLevel": store.delete_level(check_subject(subject))}

    @app.get("/mode", **OK)
    def get_mode() -> Any:
        return {"mode": "READWRITE"}


def _authenticated(header: str, allowed: dict[str, bytes]) -> str | None:
    """The user a basic-auth ``header`` logs in, or None."""
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        name, _, password = base64.b64decode(encoded, validate=True).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        return None
    known = allowed.get(name)
    # Compared in constant time, and against something when the name is unknown too.
    return name if hmac.compare_digest(password.encode(), known or b"\0") and known is not None else None


def _writes(method: str, path: str) -> bool:
    """Whether a request changes the registry. Two POSTs only read: a lookup of a schema under a
    subject (``POST /subjects/{subject}``) and a compatibility check (``POST /compatibility/...``)."""
    if method in ("GET", "HEAD", "OPTIONS"):
        return False
    if method == "POST":
        parts = path.strip("/").split("/")
        return not (parts[0] == "compatibility" or (parts[0] == "subjects" and len(parts) == 2))
    return True


def make_server(
    store: KafkaBackedStore,
    host: str,
    port: int,
    *,
    users: dict[str, str] | None = None,
    writers: frozenset[str] | None = None,
    tls: tuple[str, str] | None = None,
) -> Any:
    """A uvicorn server for the registry app (``.run()`` serves until SIGTERM/SIGINT); ``tls``: the
    certificate and key files to serve HTTPS with."""
    import uvicorn

    config = uvicorn.Config(
        make_app(store, users, writers),
        host=host,
        port=port,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
        log_level="warning",
        access_log=False,
        # Header-size and malformed-request limits are h11's: a garbage or negative Content-Length
        # gets a 400 from the server before any route runs.
        http="h11",
        timeout_keep_alive=30,
    )
    return uvicorn.Server(config)
