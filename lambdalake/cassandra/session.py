"""Cassandra sessions from settings, one cached per process (executors reuse theirs across tasks)."""

from __future__ import annotations

import logging
import threading

from cassandra.auth import PlainTextAuthProvider
from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile, Session
from cassandra.policies import ConstantReconnectionPolicy, RoundRobinPolicy

from lambdalake.errors import ServiceUnavailable
from lambdalake.settings import CassandraSettings

# The driver warns about every Cassandra 2.1 system table it cannot describe: noise, not a problem.
logging.getLogger("cassandra.metadata").setLevel(logging.ERROR)

_sessions: dict[tuple, Session] = {}
_lock = threading.Lock()


def connect(settings: CassandraSettings, *, keyspace: str | None = None) -> Session:
    """A session to the cluster (cached per process and contact points)."""
    key = (tuple(settings.contact_points), settings.port, settings.protocol_version, keyspace)
    with _lock:
        session = _sessions.get(key)
        if session is not None and not session.is_shutdown:
            return session
        auth = None
        if settings.username and settings.password:
            auth = PlainTextAuthProvider(settings.username, settings.password.get_secret_value())
        cluster = Cluster(
            settings.contact_points,
            port=settings.port,
            protocol_version=settings.protocol_version,
            auth_provider=auth,
            connect_timeout=10,
            control_connection_timeout=10,
            # Come back quickly after a Cassandra restart; the default backs off up to 10 minutes.
            reconnection_policy=ConstantReconnectionPolicy(2.0, max_attempts=None),
            execution_profiles={
                EXEC_PROFILE_DEFAULT: ExecutionProfile(
                    load_balancing_policy=RoundRobinPolicy(), request_timeout=30
                )
            },
        )
        try:
            session = cluster.connect(keyspace)
        except Exception as exc:  # NoHostAvailable and friends
            cluster.shutdown()
            raise ServiceUnavailable(
                f"cannot reach Cassandra at {settings.contact_points}:{settings.port}: {exc}",
                fix="start the embedded services with `lambdalake up`, "
                "or set LAMBDALAKE_CASSANDRA__CONTACT_POINTS",
            ) from exc
        _sessions[key] = session
        return session
