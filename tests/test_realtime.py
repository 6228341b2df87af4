"""The latest views' two paths (``speed.latest``) on the real services: the Real-time query with its
JVM writer and the micro-batch job's archive pass leave the same winner per key in Cassandra, and
that winner is the delivery a plain reference picks from what the topic holds (decoded here with
fastavro, judged by the edge's rules, ranked by version, then the first copy).

The stream has duplicates, null and tied versions, ties across partitions, records the rules refuse,
values that do not decode, frames that are not the wire format and a writer id the registry lacks; a
second writer schema registered while the Real-time job runs, and a kill -9 of that job mid-stream.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastavro
import pytest
from cassandra.cluster import NoHostAvailable, OperationTimedOut
from confluent_kafka import Producer

from lambdalake.avro import WireEncoder, parse_schema
from lambdalake.cassandra.session import connect
from lambdalake.cassandra.tables import speed_table_def
from lambdalake.infra.services import CassandraService
from lambdalake.pipeline import LatestView, Pipeline, configured_pipeline
from lambdalake.registry import subject_schemas
from lambdalake.settings import PROJECT_ROOT, Settings
from lambdalake.validation import RecordValidator, checked_rules
from tests.conftest import env_for, isolated, run_cli
from tests.helpers import consume_all, run_speed_once, stop_job
from tests.realtime_pipeline import SCHEMA_V1, SCHEMA_V2, kinds_records, write_kinds

pytestmark = [pytest.mark.services, pytest.mark.slow]

#: A writer schema id no registry here holds.
ABSENT_ID = 2**31 - 1
#: A line of a Java or Python stack trace.
STACK_LINE = re.compile(r"^\s+at [\w$.]+\(|^Traceback \(most recent call last\)", re.M)


def _producer(settings: Settings) -> Producer:
    return Producer({**settings.kafka.client_config(), "acks": "all", "enable.idempotence": True})


def _send(producer: Producer, topic: str, values: list[bytes], *, key_of: Any = None) -> None:
    """Send framed values as they are (no edge validation: the job must judge them) and require
    every one acknowledged."""
    failed: list[Any] = []
    for i, value in enumerate(values):
        producer.produce(topic, value=value, key=(key_of(i) if key_of else None),
                         on_delivery=lambda err, _m: failed.append(err) if err else None)  # fmt: skip
        producer.poll(0)
    assert producer.flush(60) == 0 and not failed, failed[:3]


def _wave(
    schema_id: int, schema: dict[str, Any], n: int, *, seed: int, now_ms: int, pad: int = 0
) -> list[bytes]:
    """``n`` records framed with ``schema_id``, a few broken, each record sent twice in a tenth of
    cases (a producer's retry); ``pad`` more characters in each name."""
    encoder = WireEncoder(schema_id, parse_schema(schema))
    out = []
    for i, record in enumerate(kinds_records(n, seed=seed, now_ms=now_ms, keys=30)):
        record["name"] += "n" * pad
        if "channel" in {f["name"] for f in schema["fields"]}:
            record["channel"] = "app"
        value = encoder.encode(record)
        if i % 41 == 0:
            value = value[: len(value) // 2]  # does not decode
        elif i % 43 == 0:
            value = b"\x01" + value[1:]  # not the wire format
        elif i % 47 == 0:
            value = value[:1] + ABSENT_ID.to_bytes(4, "big") + value[5:]
        out.append(value)
        if i % 10 == 0:
            out.append(value)
    return out


def _reference(settings: Settings, pipeline: Pipeline, schemas: dict[int, str]) -> dict[str, dict]:
    """Per latest view, the winning delivery's (partition, offset) by key, from what the topic holds,
    decoded with fastavro and judged by the edge's rules at its Kafka timestamp."""
    reader = parse_schema(pipeline.reader_schema)
    validator = RecordValidator(checked_rules(pipeline), schema=pipeline.reader_schema, parsed_schema=reader,
                                check_shape=False)  # fmt: skip
    fields = pipeline.reader_schema["fields"]
    millis = {f["name"] for f in fields if isinstance(f["type"], dict)
              and f["type"].get("logicalType") == "timestamp-millis"}  # fmt: skip
    valid = []
    for msg in consume_all(settings, pipeline.topic.name):
        value = msg.value()
        if len(value) < 5 or value[0] != 0:
            continue
        schema_id = int.from_bytes(value[1:5], "big", signed=True)
        if schema_id not in schemas:
            continue
        try:
            writer = parse_schema(json.loads(schemas[schema_id]))
            record = fastavro.schemaless_reader(io.BytesIO(value[5:]), writer, reader)
        except Exception:
            continue
        _, ts_ms = msg.timestamp()
        # The rules see a timestamp-millis field as the epoch milliseconds the record carries.
        ruled = {k: (_floor_ms(v) if k in millis else v) for k, v in record.items()}
        if validator.check(ruled, now=ts_ms / 1000) is None:
            valid.append((record, msg.partition(), msg.offset(), ts_ms // 1000))
    out: dict[str, dict] = {}
    for view in pipeline.views:
        if not isinstance(view, LatestView):
            continue
        where = pipeline.view_filter(view)
        best: dict[tuple, tuple] = {}
        for record, partition, offset, ingest_s in valid:
            if where is not None and not _keeps(view, record):
                continue
            version = record[view.version]
            if hasattr(version, "timestamp"):
                version = _micros(version)
            order = (
                version is not None,
                version if version is not None else 0,
                -ingest_s,
                -partition,
                -offset,
            )
            key = tuple(record[k] for k in view.key)
            if key not in best or order > best[key][0]:
                best[key] = (order, (partition, offset))
        out[view.name] = {key: coords for key, (_, coords) in best.items()}
    return out


def _floor_ms(t: Any) -> int | None:
    return None if t is None else _micros(t) // 1000


def _micros(t: Any) -> int:
    from datetime import UTC, datetime

    delta = t - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _keeps(view: LatestView, record: dict[str, Any]) -> bool:
    """The filtered view's ``where`` (tests/realtime_pipeline.py), written here in plain Python."""
    assert view.where == "price < 100 and flag = true", view.where
    return record["price"] < 100 and record["flag"] is True


def _winners(settings: Settings, pipeline: Pipeline) -> dict[str, dict]:
    """Per latest view, the served winner's (partition, offset) by key, read from Cassandra."""
    session = connect(settings.cassandra)
    out = {}
    for view in pipeline.views:
        if isinstance(view, LatestView):
            table = speed_table_def(pipeline, view)
            cql = f'SELECT * FROM "{settings.cassandra.keyspace}"."{table.name}" PER PARTITION LIMIT 1'
            result = session.execute(cql)
            rows = [dict(zip(result.column_names, r, strict=True)) for r in result.all()]
            out[view.name] = {tuple(r[k] for k in view.key): (r["_partition"], r["_offset"]) for r in rows}
    return out


def _rows(settings: Settings, pipeline: Pipeline) -> dict[str, list[tuple]]:
    """Per latest view, every winner row whole (every column of ``pipeline``'s table), sorted."""
    session = connect(settings.cassandra)
    out = {}
    for view in pipeline.views:
        if isinstance(view, LatestView):
            table = speed_table_def(pipeline, view)
            columns = ", ".join(f'"{c}"' for c in table.column_names)
            cql = (
                f'SELECT {columns} FROM "{settings.cassandra.keyspace}"."{table.name}" PER PARTITION LIMIT 1'
            )
            out[view.name] = sorted(tuple(r) for r in session.execute(cql).all())
    return out


def _wait_for(settings: Settings, pipeline: Pipeline, want: dict[str, dict], job: subprocess.Popen,
              *, timeout: float = 240) -> float:  # fmt: skip
    """Wait until the served winners are ``want``; returns how long it took."""
    t0 = time.monotonic()
    while True:
        try:
            got = _winners(settings, pipeline)
        except (NoHostAvailable, OperationTimedOut):  # this test's session reconnecting after a restart
            got = {}
        if got == want:
            return time.monotonic() - t0
        assert job.poll() is None, f"the speed job exited with {job.returncode}"
        if time.monotonic() - t0 > timeout:
            diff = {
                v: [
                    (k, want[v].get(k), got.get(v, {}).get(k))
                    for k in set(want[v]) | set(got.get(v, {}))
                    if want[v].get(k) != got.get(v, {}).get(k)
                ][:5]
                for v in want
            }
            raise AssertionError(f"winners differ from the reference after {timeout:.0f}s: {diff}")
        time.sleep(0.5)


def _start(settings: Settings, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lambdalake", "speed", "run", "kinds"], env=env_for(settings),
        cwd=PROJECT_ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


@dataclass
class Deployed:
    """The kinds pipeline deployed (topic, first schema, tables) with the Real-time path on."""

    settings: Settings
    pipeline: Pipeline
    schemas: dict[int, str]
    v1_id: int
    producer: Producer

    def reference(self) -> dict[str, dict]:
        self.schemas = subject_schemas(self.settings, self.pipeline.schema_.subject)
        return _reference(self.settings, self.pipeline, self.schemas)


def _deployed(base: Settings, root: Path, topic: str) -> Deployed:
    realtime = base.model_copy(update={"speed": base.speed.model_copy(update={"latest": "realtime"})})
    settings = write_kinds(realtime, root, topic, versions=1)
    deployed = run_cli(settings, "deploy", "kinds", "--no-jobs")
    assert deployed.returncode == 0, deployed.stderr.decode()[-2000:]
    pipeline = configured_pipeline("kinds", settings)
    schemas = subject_schemas(settings, pipeline.schema_.subject)
    (v1_id,) = schemas
    return Deployed(settings, pipeline, schemas, v1_id, _producer(settings))


def test_both_paths_leave_the_reference_winners_through_a_new_writer_schema_and_a_kill(
    services: Settings, spark, tmp_path: Path, unique: str
) -> None:
    topic = f"kinds-{unique}"
    base = isolated(services, tmp_path, unique)
    kinds = _deployed(base, tmp_path / "v1", topic)
    v1_settings, pipeline, v1_id, producer = kinds.settings, kinds.pipeline, kinds.v1_id, kinds.producer
    now_ms = int(time.time() * 1000)
    # A backlog of names of 20,000 characters: any three waiting candidates go over Cassandra's
    # 50 KiB batch limit, so the writer's batches are sent again in halves. (With 4,000 characters a
    # batch needed thirteen waiting, and on a fast machine the writer kept up and never had them.)
    _send(producer, topic, _wave(v1_id, SCHEMA_V1, 600, seed=1, now_ms=now_ms, pad=20_000))

    log = tmp_path / "job.log"
    job = _start(v1_settings, log)
    try:
        took = _wait_for(v1_settings, pipeline, kinds.reference(), job)
        print(f"first wave served after {took:.1f}s")
        assert "too large for the cluster; sending it in halves" in log.read_text()

        # A second writer schema while the job runs: its records reach the views once the query
        # restarts knowing it (the log says so).
        v2_settings = write_kinds(v1_settings, tmp_path / "v2", topic, versions=2)
        assert run_cli(v2_settings, "deploy", "kinds", "--no-jobs").returncode == 0
        (v2_id,) = set(subject_schemas(v1_settings, pipeline.schema_.subject)) - {v1_id}
        _send(producer, topic, _wave(v2_id, SCHEMA_V2, 300, seed=2, now_ms=now_ms))
        took = _wait_for(v1_settings, pipeline, kinds.reference(), job)
        print(f"records of a new writer schema served after {took:.1f}s")
        text = log.read_text()
        assert f"met writer schema id {v2_id}" in text
        # Each restart for a writer id is the job's one line, not Spark's reports of the tasks it
        # stopped (each with a stack trace, four attempts each).
        assert not STACK_LINE.search(text), text[-4000:]

        # kill -9 while a wave is sent: the restarted job resumes from its checkpoint, nothing lost.
        sender = threading.Thread(target=_send, args=(producer, topic, _wave(v1_id, SCHEMA_V1, 900, seed=3,
                                                                            now_ms=now_ms)))  # fmt: skip
        sender.start()
        time.sleep(2)
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)
        sender.join()
        job = _start(v1_settings, log)
        _wait_for(v1_settings, pipeline, kinds.reference(), job)
    finally:
        stop_job(job)

    # The micro-batch path over the same topic, in a keyspace of its own: the same rows, whole.
    microbatch = v1_settings.model_copy(update={
        "speed": base.speed, "storage_root": str(tmp_path / "microbatch"),
        "cassandra": base.cassandra.model_copy(update={"keyspace": f"m_{unique}"}),
    })  # fmt: skip
    run_speed_once(microbatch, pipeline, spark)
    assert _winners(microbatch, pipeline) == kinds.reference()
    mine, theirs = _rows(microbatch, pipeline), _rows(v1_settings, pipeline)
    for view in mine:
        different = [(a, b) for a, b in zip(mine[view], theirs[view], strict=True) if a != b]
        assert not different, (view, different[:2])


def test_the_real_time_writer_waits_out_cassandra_and_loses_no_candidate(
    services: Settings, tmp_path: Path, unique: str
) -> None:
    """Cassandra stopped while the Real-time job writes: the job keeps running (its writer retries),
    and once Cassandra is back every candidate of what was sent meanwhile is there. (The job's lease
    lasts longer than the outage here: a lease not renewed in time stops a job by design.)"""
    topic = f"kinds-{unique}"
    base = isolated(services, tmp_path, unique)
    base = base.model_copy(update={"cassandra": base.cassandra.model_copy(update={"lease_ttl_s": 600})})
    kinds = _deployed(base, tmp_path, topic)
    settings, pipeline = kinds.settings, kinds.pipeline
    now_ms = int(time.time() * 1000)
    _send(kinds.producer, topic, _wave(kinds.v1_id, SCHEMA_V1, 300, seed=4, now_ms=now_ms))
    log = tmp_path / "job.log"
    job = _start(settings, log)
    cassandra = CassandraService(services)
    try:
        _wait_for(settings, pipeline, kinds.reference(), job)
        assert cassandra.stop()
        _send(kinds.producer, topic, _wave(kinds.v1_id, SCHEMA_V1, 600, seed=5, now_ms=now_ms))
        time.sleep(15)
        assert job.poll() is None, f"the job must wait for Cassandra, not exit:\n{log.read_text()[-3000:]}"
        cassandra.start()
        took = _wait_for(settings, pipeline, kinds.reference(), job)
        print(f"served {took:.1f}s after Cassandra answered again")
    finally:
        cassandra.start()
        stop_job(job)
    # The outage is told in the writers' own lines, each naming what failed, with no stack trace.
    # (Up to the job's stop: a task still retrying as the session ends can meet Spark's shutdown,
    # which Spark logs with a stack trace of its own.)
    text = log.read_text().split("INFO lambdalake.speed: stopping", 1)[0]
    assert "candidate writes to Cassandra failed" in text, text[-4000:]
    assert not STACK_LINE.search(text), text[-4000:]


def test_a_checkpoint_killed_in_its_first_batch_loses_only_its_stray_files(tmp_path: Path) -> None:
    """A Real-time query killed while it wrote its first commit left a temporary commit file and no
    offset log entry; killed while it wrote its first offset log entry, a temporary offsets file
    (both seen under make test-realtime; Spark then refuses the checkpoint for good): those files
    go, the initial offsets stay. A checkpoint with a logged batch is left alone."""
    from lambdalake.speed.checkpoints import Checkpoints

    checkpoints = Checkpoints(str(tmp_path), "p")
    # Kills in the first commit, then in the first offset log entry.
    for log_dir, uuid in (("commits", "365e3a65"), ("offsets", "f31406b6")):
        name = f"killed-in-{log_dir}"
        killed = Path(checkpoints.folder(name))
        for sub in ("commits", "offsets", "sources/0"):
            (killed / sub).mkdir(parents=True)
        (killed / log_dir / f".0.{uuid}.tmp").write_text("v1\n{}")
        (killed / log_dir / f"..0.{uuid}.tmp.crc").write_text("crc")
        (killed / "sources" / "0" / "0").write_text('v1\n{"t":{"0":274}}')
        dropped = checkpoints.drop_unlogged_batch(name)
        assert sorted(Path(u).name for u in dropped) == [f"..0.{uuid}.tmp.crc", f".0.{uuid}.tmp"]
        assert list((killed / log_dir).iterdir()) == []
        assert (killed / "sources" / "0" / "0").exists()

    running = Path(checkpoints.folder("running"))
    for sub in ("commits", "offsets"):
        (running / sub).mkdir(parents=True)
    (running / "offsets" / "0").write_text("v1")
    (running / "commits" / ".1.abc.tmp").write_text("v1")
    assert checkpoints.drop_unlogged_batch("running") == []
    assert (running / "commits" / ".1.abc.tmp").exists()


def test_a_real_time_checkpoint_left_by_a_kill_in_its_first_commit_starts_again(
    services: Settings, tmp_path: Path, unique: str
) -> None:
    """The checkpoint a kill -9 leaves when it lands in the Real-time query's first commit: a
    temporary commit file and no offset log entry (Spark refuses it for good). With the latest rows
    emptied too, the restarted job must write every winner again from the initial offsets."""
    topic = f"kinds-{unique}"
    kinds = _deployed(isolated(services, tmp_path, unique), tmp_path, topic)
    settings, pipeline = kinds.settings, kinds.pipeline
    _send(kinds.producer, topic, _wave(kinds.v1_id, SCHEMA_V1, 300, seed=4, now_ms=int(time.time() * 1000)))
    log = tmp_path / "job.log"
    job = _start(settings, log)
    try:
        _wait_for(settings, pipeline, kinds.reference(), job)
        stop_job(job)
        (latest,) = (Path(settings.storage_root) / "checkpoints" / "kinds").glob("latest-*")
        for sub in ("offsets", "commits"):
            for f in (latest / sub).iterdir():
                f.unlink()
        (latest / "commits" / ".0.365e3a65-6658-4650-83a1-4fabdbb4333c.tmp").write_text(
            'v1\n{"nextBatchWatermarkMs":0}'
        )
        session = connect(settings.cassandra)
        for view in pipeline.views:
            if isinstance(view, LatestView):
                session.execute(
                    f'TRUNCATE "{settings.cassandra.keyspace}"."{speed_table_def(pipeline, view).name}"'
                )
        assert _winners(settings, pipeline) == {
            v.name: {} for v in pipeline.views if isinstance(v, LatestView)
        }
        job = _start(settings, log)
        _wait_for(settings, pipeline, kinds.reference(), job)
        assert "the Real-time query's checkpoint had committed nothing" in log.read_text()
    finally:
        stop_job(job)
