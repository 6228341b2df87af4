"""Cassandra sessions from settings, one cached per process (executors reuse theirs across tasks)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from cassandra import ConsistencyLevel, DriverException, OperationTimedOut, Unavailable, WriteTimeout
from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile, NoHostAvailable, Session
from cassandra.policies import ConstantReconnectionPolicy

from lambdalake.cassandra.routing import SchemaLagPolicy
from lambdalake.errors import ConfigurationError, ServiceUnavailable
from lambdalake.secure import certificate_fault
from lambdalake.settings import CassandraSettings

# The driver warns about system tables it cannot describe: noise, not a problem.
logging.getLogger("cassandra.metadata").setLevel(logging.ERROR)
log = logging.getLogger("lambdalake.cassandra")

_sessions: dict[tuple, Session] = {}
_lock = threading.Lock()


def connect(settings: CassandraSettings, *, keyspace: str | None = None) -> Session:
    """A session to the cluster (cached per process and contact points)."""
    # The principal and the CA are part of the key: roles of several principals in one process
    # (a test of each one's rights) get sessions of their own.
    key = (
        tuple(settings.contact_points), settings.port, settings.protocol_version, keyspace,
        settings.username, settings.ssl_ca_location, settings.ssl_check_hostname,
    )  # fmt: skip
    with _lock:
        session = _sessions.get(key)
        if session is not None and not session.is_shutdown:
            return session
        cluster = Cluster(
            settings.contact_points,
            port=settings.port,
            **settings.driver_options(),
            connect_timeout=10,
            control_connection_timeout=10,
            # DDL (a batch's version tables, a view's new version) returns once the nodes that are up
            # agree on the schema, or after this wait (checked again by `execute_ddl`).
            max_schema_agreement_wait=settings.schema_agreement_wait_s,
            # Come back quickly after a Cassandra restart; the default backs off up to 10 minutes.
            reconnection_policy=ConstantReconnectionPolicy(2.0, max_attempts=None),
            # Every read and write of the layers states its consistency here, once (settings).
            execution_profiles={
                EXEC_PROFILE_DEFAULT: ExecutionProfile(
                    # Replicas first, and a node that just returned last until it has the schema.
                    load_balancing_policy=SchemaLagPolicy(),
                    request_timeout=30,
                    consistency_level=consistency(settings),
                    serial_consistency_level=serial_consistency(settings),
                )
            },
        )
        try:
            session = cluster.connect(keyspace)
        except Exception as exc:  # NoHostAvailable and friends
            cluster.shutdown()
            refused = refusal(exc, settings)
            if refused is not None:
                raise refused from None
            raise ServiceUnavailable(
                f"cannot reach Cassandra at {settings.contact_points}:{settings.port}: {exc}",
                fix="start the embedded services with `lambdalake up`, "
                "or set LAMBDALAKE_CASSANDRA__CONTACT_POINTS",
            ) from exc
        _sessions[key] = session
        return session


def _gathered_text(exc: BaseException) -> str:
    """Every node's error of a failed connect, lower-cased (the driver gathers one per node: a dict
    for NoHostAvailable, a list or None for some of its other errors)."""
    gathered = getattr(exc, "errors", None)
    errors = list(gathered.values() if isinstance(gathered, dict) else gathered or []) or [exc]
    return " ".join(f"{type(e).__name__}: {e}" for e in errors).lower()


#: Cassandra's words for a login it could not check: too few replicas of the roles answered.
_LOGIN_UNCHECKED = "cannot achieve consistency level"


def logins_unavailable(exc: BaseException) -> bool:
    """Whether a failed connect is a login the node could not check: too few replicas of the roles
    answered (their consistency level), as on a secured ring whose other nodes are down."""
    return _LOGIN_UNCHECKED in _gathered_text(exc)


def refusal(exc: BaseException, settings: CassandraSettings) -> ConfigurationError | None:
    """The settings' fault a failed connect shows, as an error naming the setting to fix (None: the
    nodes could not be reached, or said something else)."""
    lowered = _gathered_text(exc)
    if _LOGIN_UNCHECKED in lowered:  # "Unable to perform authentication": the nodes', not the login's
        return None
    who = f"user {settings.username!r}" if settings.username else "no user"
    if "authenticat" in lowered or "bad credentials" in lowered:
        given = "wrong" if settings.username else "missing"
        return ConfigurationError(
            f"Cassandra refused the login ({who}): the credentials are {given}",
            fix="set LAMBDALAKE_CASSANDRA__USERNAME and LAMBDALAKE_CASSANDRA__PASSWORD to a role of "
            "the cluster",
        )
    fault = certificate_fault(lowered)
    if fault == "names another host":
        return ConfigurationError(
            "a Cassandra node's certificate does not name the address it was reached at "
            f"({', '.join(settings.contact_points)})",
            fix="use contact points the certificates name, or reissue them with those names; only for "
            "certificates without names, set LAMBDALAKE_CASSANDRA__SSL_CHECK_HOSTNAME=false",
        )
    if fault == "expired":
        return ConfigurationError(
            "a Cassandra node's certificate has expired",
            fix="reissue the nodes' certificates (the embedded ones: `lambdalake up --secure` renews them)",
        )
    if fault == "untrusted":
        return ConfigurationError(
            f"a Cassandra node's certificate is not signed by the CA in {settings.ssl_ca_location}",
            fix="set LAMBDALAKE_CASSANDRA__SSL_CA_LOCATION to the PEM file of the CA that signed the "
            "nodes' certificates",
        )
    return None


def consistency(settings: CassandraSettings) -> int:
    """The driver's level for ``settings.consistency`` (every read and write)."""
    return ConsistencyLevel.name_to_value[settings.consistency]


def serial_consistency(settings: CassandraSettings) -> int:
    """The driver's level for ``settings.serial_consistency`` (lightweight transactions)."""
    return ConsistencyLevel.name_to_value[settings.serial_consistency]


def refresh_metadata(
    session: Session, keyspace: str, table: str | None = None, *, wait_s: float = 60.0
) -> None:
    """Read the schema of ``keyspace`` (or of one ``table`` in it) again from the cluster.

    The driver's control connection may still be coming back after a Cassandra restart (measured in
    the tests: a job deployed right after one failed with "Table metadata was not refreshed"), and a
    table just created may not show yet when the schema agreement wait ran out on a loaded machine
    (seen: a KeyError right after CREATE TABLE, and after CREATE KEYSPACE on three nodes): the
    refresh is asked again until the keyspace (or the table) shows or ``wait_s`` has passed, then
    its error is raised.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if table is None:
                session.cluster.refresh_keyspace_metadata(keyspace)
                if keyspace in session.cluster.metadata.keyspaces:
                    return
            elif keyspace in session.cluster.metadata.keyspaces:
                session.cluster.refresh_table_metadata(keyspace, table)
            else:  # created by another process since this session read the schema
                session.cluster.refresh_keyspace_metadata(keyspace)
            ks = session.cluster.metadata.keyspaces.get(keyspace)
            if table is not None and ks is not None and table in ks.tables:
                return
            if time.monotonic() > deadline:
                what = keyspace if table is None else f"{keyspace}.{table}"
                raise DriverException(f"{what} is not in the cluster's schema after {wait_s:g}s")
        except DriverException:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def execute_ddl(session: Session, cql: str, *, timeout: float = 60) -> bool:
    """Run a schema change and wait until the nodes that are up agree on the schema (the driver
    waits ``max_schema_agreement_wait`` itself; this asks once more). Returns whether they agreed;
    a node that is down takes the change from the others when it returns."""
    result = session.execute(cql, timeout=timeout)
    if result.response_future.is_schema_agreed:
        return True
    agreed = session.cluster.control_connection.wait_for_schema_agreement(
        wait_time=session.cluster.max_schema_agreement_wait
    )
    if not agreed:
        log.warning(
            "the Cassandra nodes that are up do not agree on the schema yet after: %s", cql.split("(")[0]
        )
    return bool(agreed)


def await_schema_agreement(session: Session, wait_s: float) -> bool:
    """Wait up to ``wait_s`` until the nodes that are up report one schema version (a node back from
    an outage has then pulled the tables made without it). Returns whether they agreed."""
    try:
        return bool(session.cluster.control_connection.wait_for_schema_agreement(wait_time=wait_s))
    except DriverException:  # the control connection itself lost its host: the caller retries anyway
        return False


def hosts_down(session: Session) -> list[str]:
    """The addresses of the cluster's nodes the driver sees down."""
    return sorted(str(h.address) for h in session.cluster.metadata.all_hosts() if h.is_up is False)


#: Errors after which a lightweight transaction may or may not have applied: a replica died under
#: it (Paxos timed out), the coordinator did not answer in time, no coordinator was reachable.
AMBIGUOUS = (WriteTimeout, Unavailable, OperationTimedOut, NoHostAvailable)


def execute_lwt(
    session: Session,
    statement: Any,
    values: Sequence[Any],
    *,
    mine: Callable[[Any], bool],
    patience_s: float = 120.0,
) -> bool:
    """Run a lightweight transaction; whether it applied.

    One whose outcome is unknown (:data:`AMBIGUOUS`: a Cassandra node killed under it, say) is sent
    again, with backoff, for up to ``patience_s``. A repeat that does not apply because the row is
    already the caller's own (``mine(current row)``, the columns the transaction returns when it
    does not apply) counts as applied: the lost answer was of an attempt that did.
    """
    deadline = time.monotonic() + patience_s
    delay = 0.5
    again = False
    while True:
        try:
            result = session.execute(statement, values)
        except AMBIGUOUS as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("a lightweight transaction did not complete (%s); sending it again in %.1fs",
                        type(exc).__name__, delay)  # fmt: skip
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
            again = True
            continue
        if result.was_applied:
            return True
        return again and bool(mine(result.one()))
