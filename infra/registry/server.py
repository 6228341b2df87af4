"""HTTP front of the registry: the Confluent Schema Registry REST routes confluent-kafka's client uses."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from infra.registry.store import KafkaBackedStore, RegistryError

log = logging.getLogger("lambdalake.registry")

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
Handler = Callable[["Request"], Any]
ROUTES: list[tuple[str, re.Pattern[str], str]] = []


def route(method: str, pattern: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        ROUTES.append((method, re.compile(f"^{pattern}$"), fn.__name__))
        return fn

    return register


class Request:
    def __init__(
        self, store: KafkaBackedStore, params: dict[str, str], query: dict[str, list[str]], body: Any
    ):
        self.store, self.params, self.query, self.body = store, params, query, body

    def flag(self, name: str) -> bool:
        return self.query.get(name, ["false"])[0].lower() == "true"

    @property
    def subject(self) -> str:
        return unquote(self.params["subject"])

    def schema_str(self) -> str:
        body = self.body or {}
        if body.get("schemaType", "AVRO") != "AVRO":
            raise RegistryError(422, 42201, "only AVRO schemas are supported by the embedded registry")
        if body.get("references"):
            raise RegistryError(422, 42201, "schema references are not supported by the embedded registry")
        if "schema" not in body:
            raise RegistryError(422, 42201, "request body has no 'schema'")
        return body["schema"]


def registered(subject: str, version: int, sid: int, schema: str) -> dict[str, Any]:
    return {"subject": subject, "version": version, "id": sid, "schema": schema}


class Routes:
    @staticmethod
    @route("GET", "/")
    def root(req: Request) -> Any:
        return {}

    @staticmethod
    @route("GET", "/schemas/types")
    def schema_types(req: Request) -> Any:
        return ["AVRO"]

    @staticmethod
    @route("GET", r"/schemas/ids/(?P<id>\d+)")
    def schema_by_id(req: Request) -> Any:
        return {"schema": req.store.schema(int(req.params["id"]))}

    @staticmethod
    @route("GET", r"/schemas/ids/(?P<id>\d+)/schema")
    def raw_schema_by_id(req: Request) -> Any:
        return json.loads(req.store.schema(int(req.params["id"])))

    @staticmethod
    @route("GET", r"/schemas/ids/(?P<id>\d+)/(?P<what>subjects|versions)")
    def usages_of_id(req: Request) -> Any:
        sid = int(req.params["id"])
        req.store.schema(sid)
        uses = [
            (subject, v)
            for subject, versions in sorted(req.store.state.subjects.items())
            for v, ver in sorted(versions.items())
            if ver.id == sid and (req.flag("deleted") or not ver.deleted)
        ]
        if req.params["what"] == "subjects":
            return sorted({s for s, _ in uses})
        return [{"subject": s, "version": v} for s, v in uses]

    @staticmethod
    @route("GET", "/subjects")
    def subjects(req: Request) -> Any:
        return req.store.subjects(include_deleted=req.flag("deleted"))

    @staticmethod
    @route("GET", r"/subjects/(?P<subject>[^/]+)/versions")
    def versions(req: Request) -> Any:
        return list(req.store.live_versions(req.subject, include_deleted=req.flag("deleted")))

    @staticmethod
    @route("GET", r"/subjects/(?P<subject>[^/]+)/versions/(?P<version>[^/]+)")
    def get_version(req: Request) -> Any:
        v, ver = req.store.version(req.subject, req.params["version"], include_deleted=req.flag("deleted"))
        return registered(req.subject, v, ver.id, ver.schema)

    @staticmethod
    @route("GET", r"/subjects/(?P<subject>[^/]+)/versions/(?P<version>[^/]+)/schema")
    def get_version_schema(req: Request) -> Any:
        return json.loads(req.store.version(req.subject, req.params["version"])[1].schema)

    @staticmethod
    @route("POST", r"/subjects/(?P<subject>[^/]+)/versions")
    def register(req: Request) -> Any:
        schema = req.schema_str()
        sid, version = req.store.register(req.subject, schema)
        log.info("registered %s version %d as id %d", req.subject, version, sid)
        return registered(req.subject, version, sid, schema)

    @staticmethod
    @route("POST", r"/subjects/(?P<subject>[^/]+)")
    def lookup(req: Request) -> Any:
        v, ver = req.store.lookup(req.subject, req.schema_str())
        return registered(req.subject, v, ver.id, ver.schema)

    @staticmethod
    @route("DELETE", r"/subjects/(?P<subject>[^/]+)")
    def delete_subject(req: Request) -> Any:
        return req.store.delete_subject(req.subject, permanent=req.flag("permanent"))

    @staticmethod
    @route("DELETE", r"/subjects/(?P<subject>[^/]+)/versions/(?P<version>[^/]+)")
    def delete_version(req: Request) -> Any:
        return req.store.delete_version(req.subject, req.params["version"], permanent=req.flag("permanent"))

    @staticmethod
    @route("POST", r"/compatibility/subjects/(?P<subject>[^/]+)/versions(?:/(?P<version>[^/]+))?")
    def test_compatibility(req: Request) -> Any:
        version = req.params.get("version")
        if version is not None:
            req.store.version(req.subject, version)  # 404s like Confluent's for a missing subject/version
        reasons = req.store.compatibility_errors(req.subject, req.schema_str(), version)
        answer: dict[str, Any] = {"is_compatible": not reasons}
        if req.flag("verbose"):
            answer["messages"] = reasons
        return answer

    @staticmethod
    @route("GET", "/config")
    def get_global_config(req: Request) -> Any:
        return {"compatibilityLevel": req.store.level(None)}

    @staticmethod
    @route("PUT", "/config")
    def put_global_config(req: Request) -> Any:
        level = (req.body or {}).get("compatibility", "")
        req.store.set_level(None, level)
        return {"compatibility": level.upper()}

    @staticmethod
    @route("GET", r"/config/(?P<subject>[^/]+)")
    def get_subject_config(req: Request) -> Any:
        if req.subject not in req.store.state.configs and not req.flag("defaultToGlobal"):
            raise RegistryError(
                404, 40408, f"Subject '{req.subject}' does not have subject-level compatibility configured"
            )
        return {"compatibilityLevel": req.store.level(req.subject)}

    @staticmethod
    @route("PUT", r"/config/(?P<subject>[^/]+)")
    def put_subject_config(req: Request) -> Any:
        level = (req.body or {}).get("compatibility", "")
        req.store.set_level(req.subject, level)
        return {"compatibility": level.upper()}

    @staticmethod
    @route("DELETE", r"/config/(?P<subject>[^/]+)")
    def delete_subject_config(req: Request) -> Any:
        return {"compatibilityLevel": req.store.delete_level(req.subject)}

    @staticmethod
    @route("GET", "/mode")
    def get_mode(req: Request) -> Any:
        return {"mode": "READWRITE"}


def make_server(store: KafkaBackedStore, host: str, port: int) -> ThreadingHTTPServer:
    class RegistryHandler(BaseHTTPRequestHandler):
        server_version = "lambdalake-registry/0.1"

        def _dispatch(self, method: str) -> None:
            url = urlparse(self.path)
            path = url.path.rstrip("/") or "/"
            status, payload = 404, {"error_code": 404, "message": f"HTTP 404 Not Found: {method} {path}"}
            try:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                for m, pattern, name in ROUTES:
                    match = pattern.match(path)
                    if m == method and match:
                        params = {k: v for k, v in match.groupdict().items() if v is not None}
                        req = Request(store, params, parse_qs(url.query), body)
                        status, payload = 200, getattr(Routes, name)(req)
                        break
            except RegistryError as exc:
                status, payload = exc.status, {"error_code": exc.code, "message": exc.message}
            except json.JSONDecodeError as exc:
                status, payload = 400, {"error_code": 400, "message": f"request body is not JSON: {exc}"}
            except Exception as exc:
                log.exception("internal error on %s %s", method, path)
                status, payload = 500, {"error_code": 50001, "message": f"internal error: {exc}"}
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def do_PUT(self) -> None:
            self._dispatch("PUT")

        def do_DELETE(self) -> None:
            self._dispatch("DELETE")

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s - %s", self.address_string(), format % args)

    server = ThreadingHTTPServer((host, port), RegistryHandler)
    server.daemon_threads = True
    return server
