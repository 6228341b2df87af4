"""One writer per pipeline and role, on every host: a lease in Cassandra.

A writer takes its pipeline's lease for what it writes with a lightweight transaction (``INSERT ...
IF NOT EXISTS USING TTL``) in the pipeline's keyspace, renews it while it runs (``UPDATE ... IF
holder = me``, every third of the TTL) and releases it on a clean stop (``DELETE ... IF holder =
me``). A holder killed with -9 blocks no one for longer than the TTL (default 30 s): its row expires.
A writer on the holder's own machine does not wait that long: when the holder's process is gone from
the same kernel and PID namespace (its id names both), it deletes the dead holder's row with ``DELETE
... IF holder = theirs`` and takes the lease at once. A holder elsewhere, or whose PID is alive (even
reused), is waited for.

Which writers exclude which follows from what each writes:

========== ============ =======================================================================
lease      taken by     why
========== ============ =======================================================================
``speed``  speed job,   two jobs on one checkpoint interleave its logs and overwrite each
           speed reset  other's absolute view values; a reset deletes the checkpoint under a job
``batch``  batch run,   two publishes of one pipeline, or a publish and a restore, race for the
           restore      active version (the publish's own transactions keep it exact, the lease
                        keeps operators apart)
``replay`` replay       two recomputes of one epoch write it twice
========== ============ =======================================================================

A batch run or a replay beside the speed job is allowed (docs/concepts.md): they take other
leases.

Delivery guarantee: mutual exclusion while the holder renews in time. A holder whose lease was
taken over after it expired learns it at the next renewal: :attr:`Lease.lost` is set and the holder
stops. One whose lease expired while none of its renewals reached Cassandra (a node restarted, no
quorum) takes it back if nobody holds it, in one ``INSERT ... IF NOT EXISTS``
(:meth:`Lease._take_back` says what that cannot see).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from cassandra.cluster import Session
from cassandra.query import SimpleStatement

from lambdalake.cassandra.session import execute_lwt
from lambdalake.cassandra.tables import TableDef, create_keyspace, ensure_table
from lambdalake.errors import LambdalakeError
from lambdalake.layout import LEASES_TABLE, layout_comment
from lambdalake.procs import pid_alive
from lambdalake.settings import CassandraSettings, Settings

log = logging.getLogger("lambdalake.lease")

Role = Literal["speed job", "speed reset", "batch run", "batch restore", "replay", "view build"]
#: The lease each role takes: roles that share one exclude each other.
LEASE_OF: dict[str, str] = {
    "speed job": "speed",
    "speed reset": "speed",
    "batch run": "batch",
    "batch restore": "batch",
    "replay": "replay",
    "view build": "view build",
}

LEASES = TableDef(
    LEASES_TABLE,
    (
        ("pipeline", "text"), ("lease", "text"), ("holder", "text"), ("role", "text"), ("host", "text"),
        ("pid", "int"), ("since", "timestamp"), ("renewed", "timestamp"),
    ),
    ("pipeline",),
    ("lease",),
    comment=layout_comment(),
)  # fmt: skip


class LeaseHeld(LambdalakeError):
    """Another writer holds the lease (exit 2, naming it and the fix)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, and for how long it lasts without a renewal."""

    role: str
    host: str
    pid: int
    since: datetime | None
    renewed: datetime | None
    expires_in_s: int | None

    def describe(self) -> str:
        def at(t: datetime | None) -> str:
            return t.replace(tzinfo=UTC).isoformat(timespec="seconds") if t is not None else "?"

        when = f"since {at(self.since)}, last renewed {at(self.renewed)}"
        return f"{self.role} on {self.host} (pid {self.pid}) {when}"


class Lease:
    """The lease of one pipeline and role, held from :meth:`acquire` to :meth:`release`.

    Args:
        session: A Cassandra session.
        cassandra: The cluster's settings (keyspace).
        pipeline: The pipeline's name.
        role: What the holder does; decides the lease (:data:`LEASE_OF`).
        ttl_s: Seconds the lease lasts without a renewal. Default ``cassandra.lease_ttl_s`` (30).

    Use as a context manager: ``with Lease(...).acquire():`` renews in a thread and releases on exit.
    """

    def __init__(
        self,
        *,
        session: Session,
        cassandra: CassandraSettings,
        pipeline: str,
        role: Role,
        ttl_s: int | None = None,
    ) -> None:
        self.session = session
        self.keyspace = cassandra.keyspace
        self.cassandra = cassandra
        self.pipeline = pipeline
        self.role = role
        self.lease = LEASE_OF[role]
        self.ttl_s = ttl_s or cassandra.lease_ttl_s
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}@{_process_space()}"
        #: Set when a renewal found the lease gone or taken: the holder must stop writing.
        self.lost = threading.Event()
        self._since_ms = 0
        #: When a renewal last reached Cassandra (monotonic), and whether every renewal since failed
        #: to reach it (an outage, not a takeover, would then explain a lease found gone).
        self._reached_at = time.monotonic()
        self._unreached = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _table(self) -> str:
        return f'"{self.keyspace}"."{LEASES.name}"'

    def acquire(self, *, wait_s: float = 0.0) -> Lease:
        """Take the lease, or raise :class:`LeaseHeld` naming the holder and the fix.

        Args:
            wait_s: How long to keep trying while another writer holds it (a predecessor stopped by
                SIGKILL leaves its lease until the TTL ends). Default 0: refuse at once.
        """
        create_keyspace(self.session, self.cassandra)
        ensure_table(self.session, self.keyspace, LEASES)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self._take()
            except LeaseHeld:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def _insert(self) -> SimpleStatement:
        """The transaction that takes the lease when nobody holds it."""
        return SimpleStatement(
            f"INSERT INTO {self._table()} (pipeline, lease, holder, role, host, pid, since, renewed) "
            f"VALUES (%s, %s, %s, %s, %s, %s, %s, %s) IF NOT EXISTS USING TTL {self.ttl_s}",
        )

    def _take(self) -> Lease:
        now = int(time.time() * 1000)
        insert = self._insert()
        self._since_ms = now
        host, pid = socket.gethostname(), os.getpid()
        values = [self.pipeline, self.lease, self.holder, self.role, host, pid, now, now]

        def mine(row: Any) -> bool:
            return row.holder == self.holder

        taken = execute_lwt(self.session, insert, values, mine=mine)
        if not taken and self._break_dead_holder():
            taken = execute_lwt(self.session, insert, values, mine=mine)
        if not taken:
            holder = self.current()
            message, fix = self._refusal(holder)
            raise LeaseHeld(message, fix=fix)
        self._reached_at, self._unreached = time.monotonic(), False
        self._thread = threading.Thread(target=self._renew, name=f"lease-{self.lease}", daemon=True)
        self._thread.start()
        log.info("took the %s lease of %s (%s)", self.lease, self.pipeline, self.holder)
        return self

    def _refusal(self, holder: Holder | None) -> tuple[str, str]:
        who = holder.describe() if holder is not None else "another writer (it just released it: try again)"
        message = f"{self.role} of {self.pipeline!r} refused: the {self.lease} lease is held by {who}"
        left = (
            f"{holder.expires_in_s} s"
            if holder is not None and holder.expires_in_s is not None
            else "the TTL"
        )
        fix = (
            f"stop that writer first (`lambdalake undeploy --pipeline {self.pipeline}` for a deployed speed "
            f"job or scheduler), or, if it crashed, wait for its lease to expire: {left} at most"
        )
        return message, fix

    def _break_dead_holder(self) -> bool:
        """Delete the lease of a holder whose process is gone from this machine; True if deleted."""
        row = self.session.execute(
            SimpleStatement(
                f"SELECT holder, pid FROM {self._table()} WHERE pipeline = %s AND lease = %s",
            ),
            [self.pipeline, self.lease],
        ).one()
        if row is None or not dead_here(row.holder, row.pid):
            return False
        # IF holder = theirs: a holder that renewed or replaced it since keeps it.
        deleted = self.session.execute(
            SimpleStatement(f"DELETE FROM {self._table()} WHERE pipeline = %s AND lease = %s IF holder = %s"),
            [self.pipeline, self.lease, row.holder],
        ).was_applied
        if deleted:
            log.info("the %s lease of %s was held by pid %d of this machine, which is gone: taking it",
                     self.lease, self.pipeline, row.pid)  # fmt: skip
        return deleted

    def current(self) -> Holder | None:
        """Who holds the lease now (None: nobody)."""
        row = self.session.execute(
            SimpleStatement(
                f"SELECT role, host, pid, since, renewed, TTL(holder) AS left FROM {self._table()} "
                "WHERE pipeline = %s AND lease = %s",
            ),
            [self.pipeline, self.lease],
        ).one()
        if row is None:
            return None
        return Holder(row.role, row.host, row.pid, row.since, row.renewed, row.left)

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            if not self._renew_once():
                return

    def _renew_once(self) -> bool:
        """Renew once; False when the lease is lost (:attr:`lost` is then set)."""
        update = SimpleStatement(
            # Every column again: each cell carries its own TTL, and the row lives while one does.
            f"UPDATE {self._table()} USING TTL {self.ttl_s} SET holder = %s, role = %s, host = %s, pid = %s, "
            "since = %s, renewed = %s WHERE pipeline = %s AND lease = %s IF holder = %s",
        )
        try:
            applied = self.session.execute(
                update,
                [self.holder, self.role, socket.gethostname(), os.getpid(), self._since_ms,
                 int(time.time() * 1000), self.pipeline, self.lease, self.holder],
            ).was_applied  # fmt: skip
        except Exception as exc:  # Cassandra down for a moment: try again before the TTL runs out
            log.warning("renewing the %s lease of %s failed: %s", self.lease, self.pipeline, exc)
            self._unreached = True
            return True
        outage = self._unreached and time.monotonic() - self._reached_at >= self.ttl_s
        self._reached_at, self._unreached = time.monotonic(), False
        if not applied and outage and self._take_back():
            return True
        if not applied:
            log.error("the %s lease of %s was lost (expired and taken?): stopping", self.lease, self.pipeline)
            self.lost.set()
        return applied

    def _take_back(self) -> bool:
        """After an outage longer than the TTL in which no renewal reached Cassandra: take the lease
        again if nobody holds it (``INSERT ... IF NOT EXISTS``, the same step that takes it first).

        A single node restarted, or a cluster without a quorum, let no other writer take it
        meanwhile. What this cannot see is a writer that reached a quorum this holder could not (a
        network partition), took the lease, and released it before the outage ended.
        """
        insert = self._insert()
        now = int(time.time() * 1000)
        try:
            taken = self.session.execute(
                insert, [self.pipeline, self.lease, self.holder, self.role, socket.gethostname(),
                         os.getpid(), self._since_ms, now],
            ).was_applied  # fmt: skip
        except Exception as exc:  # unreachable again: the next renewal tries
            log.warning("taking back the %s lease of %s failed: %s", self.lease, self.pipeline, exc)
            self._unreached = True
            return True
        if taken:
            log.warning("the %s lease of %s expired while Cassandra was unreachable, and nobody took it "
                        "meanwhile: taken back", self.lease, self.pipeline)  # fmt: skip
        return bool(taken)

    def release(self) -> None:
        """Stop renewing and give the lease back (only if still ours)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        try:
            self.session.execute(
                SimpleStatement(
                    f"DELETE FROM {self._table()} WHERE pipeline = %s AND lease = %s IF holder = %s",
                ),
                [self.pipeline, self.lease, self.holder],
            )
        except Exception as exc:  # it expires with its TTL anyway
            log.warning("releasing the %s lease of %s failed (it expires in %d s): %s", self.lease,
                        self.pipeline, self.ttl_s, exc)  # fmt: skip

    def __enter__(self) -> Lease:
        return self if self._thread is not None else self.acquire()

    def __exit__(self, *_exc: object) -> None:
        self.release()


def _process_space() -> str:
    """This kernel's boot and this process's PID namespace: where a PID names one process."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:  # not Linux: no holder is ever judged dead here
        return ""
    return f"{boot}/{namespace}"


def dead_here(holder: str, pid: int) -> bool:
    """Whether ``holder`` ran in this kernel and PID namespace and its process ``pid`` is gone."""
    space = _process_space()
    if not space or holder.rpartition("@")[2] != space:
        return False
    return not pid_alive(pid)


@contextmanager
def writer_lease(settings: Settings, pipeline: str, role: Role, *, wait_s: float = 0.0) -> Iterator[Lease]:
    """Hold the pipeline's lease for ``role`` while the block runs; taken before any Spark session
    starts, so a refused writer exits 2 at once."""
    from lambdalake.cassandra.session import connect

    lease = Lease(
        session=connect(settings.cassandra), cassandra=settings.cassandra, pipeline=pipeline, role=role
    )
    lease.acquire(wait_s=wait_s)
    try:
        yield lease
    finally:
        lease.release()
