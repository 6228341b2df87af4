"""The merged query over HTTP (FastAPI; OpenAPI at ``/docs``), with ``/health`` and ``/metrics``.

    GET /v1/pipelines/{pipeline}/views/{view}/keys/{key}?from=&to=

A bearer token is required on every route but ``/health`` when ``settings.serving.token`` is set;
it is compared in constant time and never logged.
"""

from __future__ import annotations

import gc
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from cassandra import (
    ConsistencyLevel,
    DriverException,
    OperationTimedOut,
    ReadFailure,
    ReadTimeout,
    Unauthorized,
    Unavailable,
)
from cassandra.cluster import NoHostAvailable
from cassandra.connection import ConnectionException
from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lambdalake.errors import LambdalakeError, ServiceUnavailable
from lambdalake.grants import refused
from lambdalake.serving.client import (
    BadQuery,
    NotDeployed,
    NotFound,
    SchemaCatchingUp,
    ServingClient,
    moment_ms,
    quantile_list,
)
from lambdalake.serving.contract import TIME_PARAMETER, AnswerBody, HealthBody, answers
from lambdalake.serving.metrics import make_registry
from lambdalake.settings import Settings

_bearer = HTTPBearer(auto_error=False)
QUERY_PATH = "/v1/pipelines/{pipeline}/views/{view}/keys/{key}"
log = logging.getLogger("lambdalake.serving")
#: Seconds a client is asked to wait when Cassandra is unavailable.
RETRY_AFTER_S = 5


def unavailable_detail(exc: BaseException) -> str:
    """What a 503 says: the consistency level that could not be met, and how many replicas
    answered, when Cassandra said so (never the driver's text, which names hosts)."""
    consistency = getattr(exc, "consistency", None)
    if consistency is None:
        return "the view store (Cassandra) is unavailable"
    name = ConsistencyLevel.value_to_name.get(consistency, str(consistency))
    required = getattr(exc, "required_replicas", None) or getattr(exc, "required_responses", None)
    alive = getattr(exc, "alive_replicas", None)
    if alive is None:
        alive = getattr(exc, "received_responses", None)
    counts = f": {alive} of the {required} replicas it needs answered" if required is not None else ""
    return (
        f"the view store (Cassandra) could not read at consistency {name}{counts}; no partial answer is given"
    )


#: The driver's errors of a store that is down or overloaded (a 503, not a 500).
UNAVAILABLE = (ServiceUnavailable, NoHostAvailable, OperationTimedOut, Unavailable, ReadTimeout, ReadFailure)


def _failure(exc: Exception, pipeline: str, view: str) -> JSONResponse | None:
    """The answer to a query that failed with ``exc`` (None: not a failure the API answers, raised
    on): a 4xx for the client's mistakes, a 503 naming the cause for the store's, never a 500."""
    if isinstance(exc, NotFound):
        return _error(404, exc)
    if isinstance(exc, BadQuery):
        return _error(422, exc)
    if isinstance(exc, (NotDeployed, SchemaCatchingUp)):
        return _error(503, exc, headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, UNAVAILABLE):
        log.warning("query of %s/%s: Cassandra unavailable: %s", pipeline, view, exc)
        return JSONResponse(
            {"detail": unavailable_detail(exc), "fix": "retry later; bring the Cassandra nodes that are "
             "down back up"},
            status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)},
        )  # fmt: skip
    if isinstance(exc, Unauthorized):
        right = refused(exc)  # serving's principal lacks SELECT: an operator's grant is the fix
        log.warning("query of %s/%s: Cassandra refused the read: %s", pipeline, view, exc)
        return JSONResponse(
            {"detail": right.message if right else str(exc), "fix": right.fix if right else None},
            status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)},
        )  # fmt: skip
    if isinstance(exc, (DriverException, ConnectionException)):
        # Any other error of the store's client (a connection reset by a node going down, a
        # request the coordinator failed): the store's trouble, not the server's, and logged whole.
        log.warning("query of %s/%s: Cassandra failed the read: %r", pipeline, view, exc)
        return JSONResponse(
            {"detail": f"the view store (Cassandra) failed the read ({type(exc).__name__}); no partial "
             "answer is given", "fix": "retry later"},
            status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)},
        )  # fmt: skip
    return None


def make_app(settings: Settings, *, client: ServingClient | None = None) -> FastAPI:
    """The API for ``settings`` (``client``: a :class:`ServingClient` to share; default a new one)."""
    client = client or ServingClient(settings=settings, meta_ttl_s=settings.serving.meta_ttl_s)
    registry, latency = make_registry(settings, client)
    token = settings.serving.token.get_secret_value().encode() if settings.serving.token else None
    app = FastAPI(
        title="lambdalake serving",
        description="Exact answers merging each view's batch rows (ingest epochs up to the horizon) "
        "with its speed rows (later epochs).",
        version="1",
    )

    authorized = _bearer_auth(app, token)
    app.add_middleware(_Timed, latency=latency)
    names = client.pipeline_names()
    views = sorted({v.name for name in names for v in client.pipeline(name).views})

    _add_operations(app, client, registry, authorized)

    @app.get(
        QUERY_PATH,
        summary="The merged answer for one key of a view",
        dependencies=[Depends(authorized)],
        response_model=AnswerBody,
        responses=answers(400, 401, 404, 422, 503),
    )  # fmt: skip
    async def query(
        pipeline: Annotated[str, Path(description="A pipeline's name")],
        view: Annotated[str, Path(description="One of its views")],
        key: Annotated[str, Path(description="The key; a composite one as its values joined by commas")],
        start: Annotated[
            str | None,
            Query(
                alias="from",
                description="Windows starting at or after this (RFC 3339 date-time or epoch "
                "ms; empty: no bound)",
                json_schema_extra=TIME_PARAMETER,
            ),
        ] = None,
        end: Annotated[
            str | None,
            Query(
                alias="to",
                description="Windows starting before this (RFC 3339 date-time or epoch ms; empty: no bound)",
                json_schema_extra=TIME_PARAMETER,
            ),
        ] = None,
        q: Annotated[
            list[str] | None,
            Query(
                description="Quantiles every `quantiles` aggregate answers instead of its own `q`: "
                "numbers in [0, 1], repeated or comma-separated (`q=0.5,0.999`)",
            ),
        ] = None,
    ) -> Response:
        start, end = start or None, end or None  # an empty value is absent
        try:
            if start is not None and end is not None and moment_ms(start, "from") > moment_ms(end, "to"):
                return JSONResponse({"detail": f"from ({start}) is after to ({end})"}, status_code=400)
            wanted = quantile_list(q) if q else None
            answer = await client.aquery(pipeline, view, key, start=start, end=end, quantiles=wanted)
        except Exception as exc:
            failed = _failure(exc, pipeline, view)
            if failed is None:
                raise
            return failed
        if not answer.found:
            return JSONResponse(
                {
                    "detail": f"no rows for key {key!r} in {pipeline}/{view}",
                    "provenance": answer.to_dict()["provenance"],
                },
                status_code=404,
            )
        return Response(answer.to_json(), media_type="application/json")

    _with_enums(app, names, views)
    return app


def _bearer_auth(app: FastAPI, token: bytes | None) -> Callable[..., Awaitable[None]]:
    """The dependency that requires ``token`` as a bearer token (none: every request passes), and
    the 401 it answers otherwise."""

    # async: a plain `def` dependency would hop to the threadpool on every request.
    async def authorized(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> None:
        if token is None:
            return
        given = credentials.credentials.encode() if credentials is not None else b""
        if credentials is None or not hmac.compare_digest(given, token):
            raise _Unauthorized()

    @app.exception_handler(_Unauthorized)
    async def _unauthorized(_request: Request, _exc: _Unauthorized) -> JSONResponse:
        return JSONResponse(
            {"detail": "a valid bearer token is required (Authorization: Bearer <token>)"},
            status_code=401, headers={"WWW-Authenticate": "Bearer"},
        )  # fmt: skip

    return authorized


def _add_operations(
    app: FastAPI, client: ServingClient, registry: Any, authorized: Callable[..., Awaitable[None]]
) -> None:
    """``/health`` (open) and ``/metrics`` (behind the token)."""

    @app.get(
        "/health", summary="Liveness and Cassandra reachability (open: no token needed)",
        response_model=HealthBody,
        responses={503: {"description": "Cassandra is unreachable", "model": HealthBody,
                         "headers": {"Retry-After": {"schema": {"type": "integer"}}}}},
    )  # fmt: skip
    def health() -> JSONResponse:
        try:
            client.session.execute("SELECT release_version FROM system.local", timeout=5)
        except Exception as exc:  # unhealthy, not an error page
            # The driver's text names hosts and internals: logged for operators, not shown to anyone.
            log.warning("health check: Cassandra unreachable: %s", exc)
            return JSONResponse(
                {"status": "unavailable", "detail": "Cassandra is unreachable"},
                status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)},
            )  # fmt: skip
        return JSONResponse({"status": "ok"})

    @app.get(
        "/metrics", summary="Prometheus metrics", dependencies=[Depends(authorized)],
        response_class=PlainTextResponse,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                         "description": "Prometheus text exposition format"},
                   **answers(401, media_type="application/json")},
    )  # fmt: skip
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _with_enums(app: FastAPI, names: list[str], views: list[str]) -> None:
    """The generated document, with the pipelines and views this server knows as enums."""
    document = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = document()
            for parameter in spec["paths"][QUERY_PATH]["get"]["parameters"]:
                known = {"pipeline": names, "view": views}.get(parameter["name"])
                if known:
                    parameter["schema"]["enum"] = known
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app() -> FastAPI:
    """The app for the settings of the environment (uvicorn's factory, one per worker process)."""
    from lambdalake.settings import get_settings

    app = make_app(get_settings().as_role("serving"))  # serving's principal: it may only read
    # What startup built (pipelines, the app, the driver) lives as long as the worker: out of the
    # cyclic collector's way, so its passes over young objects stay short (tail latency).
    gc.freeze()
    return app


class _Timed:
    """Observes each request's latency by route and status (plain ASGI: Starlette's
    ``BaseHTTPMiddleware`` costs more per request than a merged query)."""

    def __init__(self, app: Any, *, latency: Any) -> None:
        self.app = app
        self.latency = latency

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [500]

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            self.latency.labels(getattr(route, "path", "unmatched"), str(status[0])).observe(
                time.perf_counter() - t0
            )


class _Unauthorized(Exception):
    pass


def _error(status: int, exc: LambdalakeError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": exc.message, "fix": exc.fix}, status_code=status, headers=headers)
