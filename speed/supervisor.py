"""Runs a speed job (:mod:`lambdalake.speed.job`) and keeps it running: catches its queries up (tests,
backfills), restarts them from their checkpoints after a failure that may pass, stops the job with
an error naming the fix after one that needs a person, and teaches the Real-time query a writer schema
it meets for the first time."""

from __future__ import annotations

import logging
import signal
import threading
import time

from pyspark.errors import StreamingQueryException
from pyspark.sql.streaming import StreamingQuery

from lambdalake.errors import ConfigurationError, LambdalakeError
from lambdalake.grants import refused
from lambdalake.object_store import explain, wait_for_store
from lambdalake.spark.decode import REGISTRY_PATIENCE_S
from lambdalake.spark.realtime import unknown_schema_id
from lambdalake.speed.job import SpeedJob
from lambdalake.speed.last_read import offset_changed
from lambdalake.speed.progress import progress_end
from lambdalake.writer_schemas import SchemaIdNotFound, fetcher

log = logging.getLogger("lambdalake.speed")

#: Spark's error class for a checkpoint whose stateful operators differ from the query's.
_PLAN_CHANGED = "STREAMING_STATEFUL_OPERATOR_NOT_MATCH_IN_STATE_METADATA"


#: Restarts of the queries after a failure of no known cause before the job gives up and exits
#: (its supervisor, or `lambdalake deploy`, starts it again): at most this many within the window,
#: the first after RESTART_DELAY_S, each later one after twice the wait before it.
RESTARTS = 5
RESTART_WINDOW_S = 600.0
RESTART_DELAY_S = 5.0


class Supervisor:
    """Runs ``job``'s queries: :meth:`catch_up` to process what is available now,
    :meth:`run_until_stopped` to run until a signal."""

    def __init__(self, job: SpeedJob) -> None:
        self.job = job

    def learn_writer_schema(self, query: StreamingQuery, error: BaseException | None) -> bool:
        """If the Real-time query stopped on a writer schema id it did not know: learn it (or that
        the registry does not hold it: such records are the main query's dead letters) and start
        the query again from its checkpoint. Returns whether it did."""
        found = unknown_schema_id(error) if query is self.job.latest_query else None
        if found is None:
            return False
        registry = self.job.settings.registry.client_config()
        try:
            schema: str | None = fetcher(registry, patience_s=REGISTRY_PATIENCE_S)(found)
        except SchemaIdNotFound:
            schema = None
        log.info("the latest views' query met writer schema id %d; starting it again with it", found)
        self.job.restart_latest(found, schema)
        return True

    def catch_up(self) -> None:
        """Process everything available now (tests and backfills)."""
        for q in list(self.job.queries):
            while True:
                try:
                    q.processAllAvailable()
                    break
                except StreamingQueryException as exc:
                    if not self.learn_writer_schema(q, exc):
                        raise self.failure(q, exc) from exc
                    q = self.job.queries[-1]
        if self.job.realtime:
            self._await_latest_progress()
        self.job.progress.poll(self.job.queries)  # the status is complete when this returns

    def _await_latest_progress(self) -> None:
        """Wait until the Real-time query has reported a batch that read as far as the main query
        (caught up just before): its rows are written as it reads, but its progress, which the
        status counts, comes only at the end of each batch (``speed.realtime_batch_s``)."""
        main = self.job.queries[0].lastProgress
        want = progress_end(main) if main is not None else {}
        deadline = time.monotonic() + 3 * self.job.settings.speed.realtime_batch_s + 60
        while True:
            q = self.job.latest_query
            last = q.lastProgress
            got = progress_end(last) if last is not None else {}
            if all(got.get(tp, -1) >= off for tp, off in want.items()):
                return
            failed = q.exception()
            if failed is not None:
                if not self.learn_writer_schema(q, failed):
                    raise self.failure(q, failed)
                continue
            if time.monotonic() > deadline:
                raise LambdalakeError(
                    f"query {q.name} reported no batch that read as far as {want} in "
                    f"{3 * self.job.settings.speed.realtime_batch_s + 60}s (its last: {got})",
                    fix="see the speed job's log for the query's error; it resumes from its checkpoint",
                )
            time.sleep(0.2)

    def failure(self, query: StreamingQuery, exc: BaseException | None) -> Exception:
        """The error to show for a failed query, naming the fix where there is a known one."""
        if _PLAN_CHANGED in str(exc):
            return ConfigurationError(
                f"query {query.name} cannot resume its checkpoint under {self.job.checkpoints.root}: it was "
                "written by a speed job with other stateful steps (a lambdalake before deduplication left "
                "Spark state, or a pipeline whose windowed views changed)",
                fix=(
                    f"stop the job and run `lambdalake speed reset {self.job.pipeline.name}`: it rebuilds "
                    "the speed rows from the master dataset (kept: it may hold records compaction "
                    "removed from the topic) and starts new checkpoints at the oldest open epoch"
                ),
            )
        text = str(exc)
        refused_right = refused(text, self.job.settings)
        if refused_right is not None:  # a person grants it: restarting would be refused again
            return ConfigurationError(
                f"query {query.name} stopped: {refused_right.message}", fix=refused_right.fix
            )
        store = explain(text, self.job.settings)  # a bucket or key (a person) or the store's silence
        if store is not None:
            kind = type(store)
            return kind(f"query {query.name} stopped: {store.message}", fix=store.fix)
        lost = offset_changed(text)
        if lost is not None:
            return LambdalakeError(f"query {query.name} stopped: {lost.message}", fix=lost.fix)
        if "org.apache.kafka.common.errors.TimeoutException" in text:
            return LambdalakeError(
                f"query {query.name} stopped: the Kafka broker at "
                f"{self.job.settings.kafka.bootstrap_servers} did not answer within "
                f"{self.job.options.broker_wait_s:.0f}s",
                fix="start the broker (`lambdalake up`), or raise `speed run --broker-wait`; the job "
                "resumes from its checkpoint",
            )
        # Errors whose own message names the partition, offsets, broker or table, and the fix.
        for marker in ("DATA LOSS", "Cassandra refused writes"):
            if marker in text:
                detail = text[text.index(marker) :]
                message, _, fix = detail.replace("\n  fix: ", " Fix: ").partition(" Fix: ")
                return LambdalakeError(
                    f"query {query.name} stopped: {message.splitlines()[0]}",
                    fix=fix.splitlines()[0] if fix else None,
                )
        return RuntimeError(f"query {query.name} stopped: {exc}")

    def run_until_stopped(self, *, lost: threading.Event | None = None) -> None:
        """Run until SIGTERM/SIGINT; then stop the queries (every write is idempotent, so stopping
        mid-batch is safe: the batch is replayed from the checkpoint next time).

        Args:
            lost: Set when this job's lease was lost (:mod:`lambdalake.lease`): the job stops with
                an error, since another job may now write the same checkpoint and views.
        """
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        self.job.start()
        failures: list[float] = []
        try:
            while not stop.is_set():
                failed = next((q for q in self.job.queries if not q.isActive), None)
                if failed is not None and self.learn_writer_schema(failed, failed.exception()):
                    continue
                if failed is not None:
                    error = self.failure(failed, failed.exception())
                    now = time.monotonic()
                    failures = [t for t in failures if t > now - RESTART_WINDOW_S] + [now]
                    # A definition or checkpoint that cannot run, and lost records, need a person;
                    # anything else (a Python worker that did not connect back on a loaded machine,
                    # a service down longer than the writers wait) may pass, and every write is
                    # idempotent, so the queries start again from their checkpoints.
                    needs_person = isinstance(error, ConfigurationError) or "DATA LOSS" in str(error)
                    if needs_person or len(failures) > RESTARTS:
                        raise error
                    delay = RESTART_DELAY_S * 2 ** (len(failures) - 1)
                    log.warning("%s; restarting the queries from their checkpoints in %.0f s (restart %d "
                                "of at most %d within %.0f s)", error, delay, len(failures), RESTARTS,
                                RESTART_WINDOW_S)  # fmt: skip
                    self.job.stop()
                    if stop.wait(delay):
                        break
                    # A store down for a while: wait until it answers instead of spending the
                    # restarts on it (a query's start reads its checkpoint there).
                    settings = self.job.settings
                    wait_for_store(
                        settings,
                        patience_s=settings.object_store.patience_s,
                        on_wait=lambda at=settings.object_store.endpoint: log.warning(
                            "waiting for the object store at %s", at),
                        pause=stop.wait,
                    )  # fmt: skip
                    if stop.is_set():
                        break
                    self.job.start()
                    continue
                if lost is not None and lost.is_set():
                    raise LambdalakeError(
                        f"the speed job of {self.job.pipeline.name!r} lost its lease (not renewed in time): "
                        "another job may be running, so this one stops",
                        fix="check `lambdalake status`; start it again once no other speed job runs",
                    )
                stop.wait(0.5)
        finally:
            log.info("stopping %s", ", ".join(q.name for q in self.job.queries))
            self.job.close()
