"""Which coordinator a request goes to, and telling a coordinator that lags the schema from a table
that is really missing.

A node that returns after DDL ran without it (a batch published its version tables while it was
down) opens its CQL port seconds before it pulls the new schema. Meanwhile it answers a read or a
write of those tables with "table ... does not exist" (``InvalidRequest``; also raised when the
driver re-prepares a statement on it) or "Unknown CF" (``ServerError``), though the two other
replicas hold the table and its rows. Such an error is the coordinator's, not the request's: it is
retried on another host, and the host goes to the end of every query plan until it has had time to
catch up (:class:`SchemaLagPolicy`).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

from cassandra import CoordinationFailure, InvalidRequest
from cassandra.policies import DCAwareRoundRobinPolicy, LoadBalancingPolicy, TokenAwarePolicy
from cassandra.protocol import ServerError

log = logging.getLogger("lambdalake.cassandra")

#: How long a host that just came up, or was caught lagging, is tried after the others. A node
#: here pulled the schema about 4 s after opening its CQL port; this leaves room for a loaded one.
PROBATION_S = 30.0

_MISSING = re.compile(
    r"(?:unconfigured table|table) \"?(?P<table>[\w.]+?)\"? does not exist|unconfigured table (?P<old>\w+)",
    re.IGNORECASE,
)


class SchemaLagPolicy(LoadBalancingPolicy):
    """Token-aware and DC-aware (replicas of the partition first, the local data centre's nodes
    before others), with hosts on probation last: one that just came up, and one caught answering
    as if a table the cluster has did not exist. Probation ends by itself; a host still lagging is
    caught again."""

    def __init__(self, child: LoadBalancingPolicy | None = None, probation_s: float = PROBATION_S) -> None:
        super().__init__()
        self._child = child or TokenAwarePolicy(DCAwareRoundRobinPolicy())
        self._probation_s = probation_s
        self._until: dict[Any, float] = {}
        self._guard = threading.Lock()

    def suspect(self, host: Any) -> None:
        """Put ``host`` last in query plans for the probation time (from now)."""
        if host is None:
            return
        with self._guard:
            self._until[host] = time.monotonic() + self._probation_s

    def on_probation(self, host: Any) -> bool:
        return self._until.get(host, 0.0) > time.monotonic()

    def populate(self, cluster: Any, hosts: Any) -> None:
        self._child.populate(cluster, hosts)

    def distance(self, host: Any) -> int:
        return self._child.distance(host)

    def check_supported(self) -> None:
        self._child.check_supported()

    def make_query_plan(self, working_keyspace: str | None = None, query: Any = None) -> Iterator[Any]:
        later = []
        for host in self._child.make_query_plan(working_keyspace, query):
            if self.on_probation(host):
                later.append(host)
            else:
                yield host
        yield from later

    def on_up(self, host: Any) -> None:
        # Up again: its schema may be older than the cluster's until it pulls the changes it missed.
        self.suspect(host)
        self._child.on_up(host)

    def on_down(self, host: Any) -> None:
        self._child.on_down(host)

    def on_add(self, host: Any) -> None:
        self.suspect(host)
        self._child.on_add(host)

    def on_remove(self, host: Any) -> None:
        with self._guard:
            self._until.pop(host, None)
        self._child.on_remove(host)


def missing_table(error: BaseException) -> str | None:
    """The table a coordinator said does not exist (``InvalidRequest``), or None."""
    if not isinstance(error, InvalidRequest):
        return None
    found = _MISSING.search(str(error))
    if found is None:
        return None
    return (found.group("table") or found.group("old")).split(".")[-1]


def lags_schema(error: BaseException, known: set[str] | frozenset[str] | None = None) -> bool:
    """Whether ``error`` is a coordinator's that has not seen a table yet: "Unknown CF", or a
    missing table among ``known`` (tables the cluster has, by what the caller knows: the driver's
    schema, the active-version row). Anything else is the request's own error."""
    if isinstance(error, ServerError) and "unknown cf" in str(error).lower():
        return True
    table = missing_table(error)
    return table is not None and known is not None and table in known


#: Cassandra's ``RequestFailureReason.INCOMPATIBLE_SCHEMA``: a replica asked for rows of a table it
#: has not seen yet (5.0's ``RequestFailureReason``, sent in a failure's error-code map).
INCOMPATIBLE_SCHEMA = 3


def replica_lacks_schema(error: BaseException) -> bool:
    """Whether ``error`` is a read's or write's failure because a replica (not the coordinator) has
    not seen the table yet: a node back from an outage, asked for its data before it pulled the
    schema. Another coordinator may send the request to the same replica: what helps is waiting for
    the nodes to agree on the schema (:func:`lambdalake.cassandra.session.await_schema_agreement`)."""
    if not isinstance(error, CoordinationFailure):
        return False
    codes = getattr(error, "error_code_map", None) or {}
    return INCOMPATIBLE_SCHEMA in codes.values() or "INCOMPATIBLE_SCHEMA" in str(error)


def table_known(session: Any, keyspace: str, table: str) -> bool:
    """Whether the cluster's schema, as the driver last read it, has ``keyspace.table``."""
    ks = session.cluster.metadata.keyspaces.get(keyspace)
    return ks is not None and table in ks.tables


def suspect_coordinator(session: Any, future: Any) -> None:
    """Put the host that answered ``future`` (a ``ResponseFuture`` that failed) on probation."""
    policy = session.cluster.profile_manager.default.load_balancing_policy
    host = getattr(future, "_current_host", None)  # the driver names the coordinator only on success
    if isinstance(policy, SchemaLagPolicy):
        log.info("Cassandra host %s has not seen a table yet; other coordinators are tried first", host)
        policy.suspect(host)
