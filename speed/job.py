"""The speed job of one pipeline: one main streaming query over the pipeline's topic, decoding once.

``<pipeline>-main``: each Kafka partition's range goes through one task
(:class:`speed.sinks.ArchiveSink`) that decodes each record once, dead-letters the failures, writes
the valid events as master-dataset files, upserts the ``latest`` views with a write timestamp
taken from the version and marks repeats of an identity within the watermark delay
(:mod:`speed.dedup`, decided from the log alone, so no Spark state and no shuffle).
The first deliveries flow on into every windowed view, aggregated in one stateful step
(:func:`lambdalake.spark.views.windowed_together`) per (view, key, event-time window, ingest epoch)
and upserted as absolute values: one read and one decode of the topic feed every view. After the
windowed rows are written, the driver commits the batch's master files to Delta in one app
transaction. The watermark is on ingest time (the Kafka record timestamp), so an event days late in
event time still counts at once in the current epoch's row. An event whose *ingest* time is behind
the watermark is archived, but dropped from the windowed views and left to the batch layer. Spark
counts the drop (``dropped_behind_watermark`` in the status file) after its partial aggregation:
groups, not events.

The checkpoint's Spark state is made for the windowed views it started with: when they change, the
main query moves to a new checkpoint (:mod:`lambdalake.speed.starts`). Running the job, restarts and
failures are :mod:`lambdalake.speed.supervisor`'s; its files beside the checkpoints,
:mod:`lambdalake.speed.checkpoints`'.

Progress lives in each query's checkpoint; results are durable before Spark commits an offset, and
every write is idempotent, so a batch replayed after a crash leaves the same views and the master dataset.
"""

from __future__ import annotations

import json
import logging
import time

from py4j.protocol import Py4JError
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.streaming import StreamingQuery

from lambdalake.cassandra.session import connect
from lambdalake.cassandra.tables import TableDef, deploy_speed_tables, speed_table_def
from lambdalake.compaction import Compactor
from lambdalake.kafka.admin import require_log_append_time
from lambdalake.layout import speed_status_file
from lambdalake.master import master_of
from lambdalake.pipeline import LatestView, Pipeline, WindowedView
from lambdalake.registry import subject_schemas
from lambdalake.settings import Settings
from lambdalake.spark.decode import DecodeSpec
from lambdalake.spark.kafka import source_options
from lambdalake.spark.realtime import start_latest_query
from lambdalake.spark.session import spark_session
from lambdalake.spark.sinks import upsert_views
from lambdalake.spark.stopping import interruptible, stop_quietly
from lambdalake.spark.views import INGEST_TS, together_column, together_row, windowed, windowed_together
from lambdalake.speed.checkpoints import Checkpoints, Reset, offset_ranges
from lambdalake.speed.dedup import DedupLog
from lambdalake.speed.last_read import LastReadCheck, LastRecords, lost_tail
from lambdalake.speed.options import SpeedOptions, runs_realtime_query
from lambdalake.speed.progress import ProgressLog
from lambdalake.speed.sinks import ArchiveSink, FileSet, LatestSink, PartitionProgress, RecordCounts, drain
from lambdalake.speed.starts import choose_main, latest_start
from lambdalake.views import windowed_inputs

log = logging.getLogger("lambdalake.speed")


class SpeedJob:
    """The speed layer of one pipeline.

    Args:
        settings: Cluster addresses and the storage root.
        pipeline: The pipeline definition (topic, schema, views).
        options: Tuning; default :class:`SpeedOptions`.
        spark: An existing session; default one built from ``settings.spark``.
    """

    def __init__(
        self,
        *,
        settings: Settings,
        pipeline: Pipeline,
        options: SpeedOptions | None = None,
        spark: SparkSession | None = None,
    ) -> None:
        self.settings = settings
        self.pipeline = pipeline
        self.options = options or SpeedOptions()
        #: Whether the latest views are a Real-time query of their own (``speed.latest``).
        self.realtime = runs_realtime_query(settings, pipeline)
        self._owns_spark = spark is None
        # A Real-time query holds a task slot per Kafka partition for as long as it runs: a local
        # session gets that many more than the micro-batch query's.
        slots = pipeline.topic.partitions if self.realtime else 0
        self.spark = spark or spark_session(settings, f"lambdalake-speed-{pipeline.name}", extra_slots=slots)
        self.spec = DecodeSpec.of(pipeline, settings)
        self.master = master_of(settings, pipeline)
        self.compactor: Compactor | None = None
        self.checkpoints = Checkpoints(settings.storage_root, pipeline.name)
        self.progress = ProgressLog(speed_status_file(settings.storage_root, pipeline.name))
        self.queries: list[StreamingQuery] = []
        self.windowed_views = [v for v in pipeline.views if isinstance(v, WindowedView)]
        #: The windowed views the main query aggregates, in its checkpoint's order (:meth:`_choose_main`).
        self.counted: list[WindowedView] = list(self.windowed_views)
        #: The main query's checkpoint folder, its name and path (:meth:`_choose_main`).
        self.main_name = "main"
        self.main_dir = self.checkpoints.folder(self.main_name)
        self._main_offsets: str | None = None
        #: The ingest time from which the main query's checkpoint counts (None: every record it reads).
        self._from_ms: int | None = None
        #: Per windowed view, its table, its columns in the main query's rows and which rows are its.
        self._view_tables: list[tuple[TableDef, dict[str, str], str | None]] = []
        self.files = self.spark.sparkContext.accumulator(frozenset(), FileSet())
        self.read_progress = self.spark.sparkContext.accumulator({}, PartitionProgress())
        self.records_read = self.spark.sparkContext.accumulator({}, RecordCounts())
        self.last_read = self.spark.sparkContext.accumulator({}, LastRecords())
        self.reads_check: LastReadCheck | None = None
        self.run_id = ""
        #: The Real-time query of the latest views (None: they are the main query's).
        self.latest_query: StreamingQuery | None = None
        #: Writer schemas the Real-time query decodes, by id, and the ids the registry does not hold.
        self._writers: dict[int, str] = {}
        self._missing: set[int] = set()
        #: Where the main query starts when it has no checkpoint yet (None: it resumes one).
        self._main_fresh_start: str | None = None

    # --- building blocks ----------------------------------------------------------------------

    def deploy(self) -> None:
        """Create the pipeline's Cassandra tables (idempotent: a table deploy made takes no DDL)."""
        deploy_speed_tables(connect(self.settings.cassandra), self.settings.cassandra, self.pipeline)

    def _archived(self) -> dict[int, int]:
        """Per partition, the highest offset before which the master dataset has covered every offset (what a
        rebuilt checkpoint re-reads): those are neither archived nor dead-lettered again."""
        topic = self.pipeline.topic.name
        every = self.master.read_progress()
        return {int(k.rsplit("/", 1)[1]): v for k, v in every.items() if k.rsplit("/", 1)[0] == topic}

    def starting_offsets(self) -> str:
        """Where queries without a checkpoint start: ``speed reset`` leaves its choice beside the
        checkpoints; otherwise the options' (default ``earliest``)."""
        return self._starting(self.checkpoints.reset())

    def _starting(self, reset: Reset | None) -> str:
        return json.dumps(reset.offsets) if reset is not None else self.options.starting_offsets

    def records(self, *, starting: str | None = None, bounded: bool = True) -> DataFrame:
        """The pipeline's topic as a stream of Kafka records, read by Spark's own Kafka source;
        ``starting``: where a fresh checkpoint starts (default :meth:`starting_offsets`);
        ``bounded``: at most ``max_offsets_per_trigger`` records a micro-batch (Real-time Mode has
        no micro-batches to bound, and refuses the option).

        What the source does not check is checked around each micro-batch (:meth:`_main_batch`):
        offsets the broker gave to new records, and a plan that goes behind the checkpoint."""
        options = source_options(self.settings, broker_wait_s=self.options.broker_wait_s)
        if bounded:
            options["maxOffsetsPerTrigger"] = str(self.options.max_offsets_per_trigger)
        return (
            self.spark.readStream.format("kafka")
            .options(**options)
            .option("subscribe", self.pipeline.topic.name)
            .option("startingOffsets", starting or self.starting_offsets())
            .option("failOnDataLoss", str(self.options.fail_on_data_loss).lower())
            .load()
        )

    def _windowed_inputs(self, views: list[WindowedView]) -> list[str]:
        """What the windowed path reads of an event: identity, ingest time and the views' inputs."""
        needed = [*self.pipeline.event.identity, INGEST_TS]
        needed += [c for v in views for c in windowed_inputs(self.pipeline, v)]
        return list(dict.fromkeys(needed))

    def _dedup(self, query: str) -> DedupLog:
        """How a query tells first deliveries from repeats (segment files beside its checkpoint)."""
        return DedupLog(
            root=self.checkpoints.dedup_root(query),
            identity=tuple(self.pipeline.event.identity),
            window_us=self.pipeline.layers.dedup_delay_seconds * 1_000_000,
        )

    def _windowed(self, first_deliveries: DataFrame, views: list[WindowedView]) -> DataFrame:
        """The views' rows of ``first_deliveries`` ingested from :attr:`_from_ms` on (a checkpoint that
        starts one deduplication window early reads the earlier records only so that its
        deduplication knows them: their epochs are counted already)."""
        if self._from_ms is not None:
            first_deliveries = first_deliveries.filter(
                F.col(INGEST_TS) >= F.timestamp_millis(F.lit(self._from_ms))
            )
        events = first_deliveries.select(*self._windowed_inputs(views))
        layers = self.pipeline.layers
        events = events.withWatermark(INGEST_TS, f"{layers.dedup_delay_seconds} seconds")
        epoch = F.window(F.col(INGEST_TS), f"{layers.epoch_seconds} seconds")
        if len(views) == 1:  # the plan of one view alone: checkpoints made before it resume
            return windowed(events, self.pipeline, views[0], epoch=epoch)
        return windowed_together(events, self.pipeline, views, epoch=epoch)

    def _choose_main(self) -> None:
        """The main query's checkpoint and the windowed views it aggregates (:func:`choose_main`)."""
        reset = self.checkpoints.reset()  # where `speed reset` left the windowed views to count from
        chosen = choose_main(
            self.settings, self.pipeline, self.checkpoints, self.windowed_views, archived=self._archived,
            reset_from_ms=reset.from_ms if reset is not None else None,
            default=self._starting(reset),
        )  # fmt: skip
        self.main_name = chosen.record.dir
        self.main_dir = self.checkpoints.folder(chosen.record.dir)
        self.counted = chosen.counted
        self._from_ms = chosen.record.from_ms
        self._main_offsets = chosen.offsets
        self._main_fresh_start = chosen.fresh_start

    def main_stream(self) -> DataFrame:
        """The main query's plan: the archive pass (decoding included), then the windowed views."""
        latest_sinks = tuple(
            LatestSink(
                table=speed_table_def(self.pipeline, view),
                key=tuple(view.key),
                version=view.version,
                where=self.pipeline.view_filter(view),
            )
            for view in self.pipeline.views
            if isinstance(view, LatestView) and not self.realtime
        )
        sink = ArchiveSink(
            decode=self.spec,
            dlq_topic=self.pipeline.topic.dlq,
            kafka_config=self.settings.kafka.client_config(),
            master_path=self.master.path,
            event_time=self.pipeline.event.time,
            file_prefix=self.run_id,
            latest=latest_sinks,
            cassandra=self.settings.cassandra,
            files=self.files,
            progress=self.read_progress,
            read=self.records_read,
            passthrough=tuple(self._windowed_inputs(self.counted)) if self.counted else (),
            dedup=self._dedup(self.main_name) if self.counted else None,
            archived=self._archived(),
            last_read=self.last_read,
        )
        archived = self.records(starting=self._main_offsets).mapInArrow(
            sink, from_arrow_schema(sink.output_schema)
        )
        tables = [speed_table_def(self.pipeline, v) for v in self.counted]
        if len(tables) == 1:  # the rows of one view alone (:meth:`_windowed`)
            self._view_tables = [(tables[0], {c: c for c in tables[0].source_columns}, None)]
        else:
            self._view_tables = [
                (table, {c: together_column(i, c) for c in table.source_columns}, together_row(i))
                for i, table in enumerate(tables)
            ]
        return self._windowed(archived, self.counted) if self.counted else archived

    def _main_batch(self, df: DataFrame, batch_id: int) -> None:
        t0 = time.monotonic()
        start, end = self.checkpoints.batch_offsets(self.main_name, batch_id)
        behind = [
            (t, int(p), int(start[t][p]), int(o))
            for t, ps in end.items() for p, o in ps.items() if int(o) < int(start.get(t, {}).get(p, o))
        ]  # fmt: skip
        if behind:
            # Spark's source told to go on (failOnDataLoss false) plans from a log's end that went
            # behind the checkpoint: the next batches would read offsets the broker handed out again.
            raise lost_tail(*behind[0])
        ranges = offset_ranges(start, end)
        assert self.reads_check is not None
        self.reads_check.check(list(ranges))
        self.files.value = frozenset()
        self.read_progress.value = {}
        self.records_read.value = {}
        self.last_read.value = {}
        if self._view_tables:
            upsert_views(df, tables=self._view_tables, cassandra=self.settings.cassandra)
        else:
            drain(df)
        t1 = time.monotonic()
        self.progress.records_read(
            f"{self.pipeline.name}-main", batch_id, sum(self.records_read.value.values())
        )
        files = self.files.value
        # Every batch commits, with no files too (dead letters only, or nothing valid): its ranges
        # are the partitions' progress, which the batch horizon waits for.
        self.master.commit(
            files, app_id=f"speed-{self.pipeline.name}-{self.run_id}", batch_id=batch_id,
            layers=self.pipeline.layers, partitions=self.read_progress.value,
            ranges=ranges, speed=True,
        )  # fmt: skip
        self.reads_check.record(self.last_read.value)
        if self.compactor is not None:
            self.compactor.committed()
        log.debug("main batch %d: pass %.2fs, commit %.2fs (%d files)", batch_id, t1 - t0,
                  time.monotonic() - t1, len(files))  # fmt: skip

    def start(self) -> list[StreamingQuery]:
        self.master.check_layers(self.pipeline.layers, pipeline=self.pipeline.name)
        require_log_append_time(self.settings, self.pipeline)
        self.deploy()
        self._choose_main()
        # A kill in the main query's first batch (the job's first seconds) can leave such files too.
        self._drop_unlogged_batch(self.main_name, "the main query's")
        self.reads_check = LastReadCheck(
            settings=self.settings, checkpoint=self.main_dir, fail=self.options.fail_on_data_loss
        )
        self.run_id = self.checkpoints.run_id(self.main_name)
        self.master.clear_staging(f"{self.run_id}-")
        # What a killed round staged carries the run id: this start clears it (above).
        self.compactor = Compactor.of(
            self.settings.master, self.master.path, staging_prefix=f"{self.run_id}-"
        )
        trigger = {"processingTime": f"{self.options.trigger_seconds} seconds"}
        name = self.pipeline.name
        main = self.main_stream().writeStream.queryName(f"{name}-main")
        if self.counted:
            main = main.outputMode("update")
        self.queries = [
            main.option("checkpointLocation", self.main_dir)
            .foreachBatch(interruptible(self._main_batch)).trigger(**trigger).start()
        ]  # fmt: skip
        if self.realtime:
            self._writers = {**subject_schemas(self.settings, self.pipeline.schema_.subject), **self._writers}
            self.queries.append(self._start_latest())
        for q in self.queries:
            log.info("query %s started (id %s)", q.name, q.id)
        self.progress.follow(self.queries)
        return self.queries

    def _drop_unlogged_batch(self, name: str, whose: str) -> None:
        """Remove what a kill in a checkpoint's first batch left half-written (a temporary offset
        log or commit file and no entry: Spark would refuse the checkpoint for good), and say so."""
        stray = self.checkpoints.drop_unlogged_batch(name)
        if stray:
            names = ", ".join(u.rsplit("/", 1)[1] for u in stray)
            log.warning("%s checkpoint had committed nothing: removed %s; its first batch runs again",
                        whose, names)  # fmt: skip

    def _start_latest(self) -> StreamingQuery:
        """Start the latest views' Real-time query (:mod:`lambdalake.spark.realtime`) from its
        checkpoint, decoding the writer schemas known so far."""
        self._drop_unlogged_batch(self._latest_name(), "the Real-time query's")
        query = start_latest_query(
            self.spark, self.settings, self.pipeline,
            self.records(starting=self._latest_start(), bounded=False),
            checkpoint=self.checkpoints.folder(self._latest_name()), writers=self._writers,
            missing=frozenset(self._missing),
        )  # fmt: skip
        self.latest_query = query
        return query

    def restart_latest(self, writer_id: int, schema: str | None) -> None:
        """Start the Real-time query again from its checkpoint, knowing writer schema ``writer_id``
        (its text; None: the registry does not hold it, such records are the main query's dead letters)."""
        if schema is None:
            self._missing.add(writer_id)
        else:
            self._writers[writer_id] = schema
        if self.latest_query in self.queries:
            self.queries.remove(self.latest_query)
        self.queries.append(self._start_latest())
        self.progress.follow(self.queries)

    def _latest_name(self) -> str:  # one checkpoint per set of latest view versions written
        return self.checkpoints.latest_dir(
            [speed_table_def(self.pipeline, v).name for v in self.pipeline.views if isinstance(v, LatestView)]
        )

    def _latest_start(self) -> str:
        """Where a new Real-time checkpoint starts (:func:`latest_start`)."""
        fresh = self._main_fresh_start
        default = fresh or self.starting_offsets()
        return latest_start(self.pipeline, self._archived(), default, main_fresh=fresh)

    def stop(self) -> None:
        for q in self.queries:
            try:
                # A job that made its session ends with it: its loggers stay quiet to the end.
                stop_quietly(self.spark, q, restore=not self._owns_spark)
            except Py4JError as exc:
                # A signal to the whole process group reaches the JVM too, whose shutdown hook may
                # stop Spark first: the query is gone either way (its batch replays next start).
                if "stopped SparkContext" not in str(exc):
                    raise
                log.info("query %s: Spark had stopped already", q.name)
        if self.compactor is not None:
            # A round cut short by the process's exit leaves the master dataset as it was (its staged file is
            # cleared at the next start), so a stop waits for it a while, not for ever.
            self.compactor.close(timeout=30)
        if self.reads_check is not None:
            self.reads_check.close()
        self.progress.close(self.queries)

    def close(self) -> None:
        """Stop the queries, and the Spark session if this job created it."""
        self.stop()
        if self._owns_spark:
            self.spark.stop()
