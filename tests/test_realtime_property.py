"""The latest views' two paths compared on generated streams: for any sequence of deliveries, the
Real-time query (``speed.latest = "realtime"``, its JVM writer) and the micro-batch job's archive
pass leave the same rows, whole, in Cassandra, and their winners are the ones a plain reference
picks from what the topic holds.

Each example is a stream of its own keys on one shared topic: keys that collide, versions null or
tied or at the ends of the 64-bit range, copies of a delivery in its partition or the other, two
writer schemas (the second registered while the Real-time job runs), records the edge's rules
refuse, values that do not decode, frames that are not the wire format and a writer id the
registry lacks. The Real-time job runs as ``lambdalake speed run`` for the whole module; the
micro-batch job runs in this process over the same topic, under a pipeline name of its own (so
its own tables), catching up at a drawn cut inside the example and at its end.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cassandra.cluster import NoHostAvailable, OperationTimedOut
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from lambdalake.avro import WireEncoder, parse_schema
from lambdalake.cassandra.tables import speed_table_def
from lambdalake.pipeline import LatestView, Pipeline
from lambdalake.registry import subject_schemas
from lambdalake.settings import Settings
from lambdalake.speed.job import SpeedJob
from lambdalake.speed.supervisor import Supervisor
from tests.conftest import isolated, run_cli
from tests.helpers import stop_job
from tests.realtime_pipeline import SCHEMA_V1, SCHEMA_V2, kinds_records, write_kinds
from tests.test_realtime import ABSENT_ID, Deployed, _deployed, _rows, _start, _winners

pytestmark = [pytest.mark.services, pytest.mark.slow]

#: What becomes of a drawn record on its way to the topic.
FATES = ["valid", "valid", "valid", "refused", "undecodable", "not_wire", "absent_id"]


@dataclass
class TwoPaths:
    """The kinds pipeline with a Real-time job running, and an in-process micro-batch job over the
    same topic under the name ``kinds_mb``."""

    kinds: Deployed
    realtime_job: Any
    microbatch: SpeedJob
    ids: dict[str, int]
    now_ms: int
    log: Path
    #: Examples run, and those that left rows in a latest view (the module checks both at its end).
    examples: int = 0
    with_rows: int = 0


@pytest.fixture(scope="module")
def two_paths(services: Settings, spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoPaths]:
    unique = os.urandom(4).hex()
    root = tmp_path_factory.mktemp("two-paths")
    topic = f"kinds-{unique}"
    kinds = _deployed(isolated(services, root, unique), root / "v1", topic)
    log = root / "job.log"
    job = _start(kinds.settings, log)
    micro_settings = kinds.settings.model_copy(update={
        "speed": kinds.settings.speed.model_copy(update={"latest": "microbatch"}),
        "storage_root": str(root / "microbatch"),
    })  # fmt: skip
    micro = SpeedJob(
        settings=micro_settings, pipeline=kinds.pipeline.model_copy(update={"name": "kinds_mb"}), spark=spark
    )
    micro.start()
    try:
        # The second writer schema is registered once the Real-time query runs: the first example
        # that sends a record of it makes the query start again knowing it.
        deadline = time.monotonic() + 180
        while "query kinds-latest started" not in (log.read_text() if log.exists() else ""):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        v2 = write_kinds(kinds.settings, root / "v2", topic, versions=2)
        deployed = run_cli(v2, "deploy", "kinds", "--no-jobs")
        assert deployed.returncode == 0, deployed.stderr.decode()[-2000:]
        schemas = subject_schemas(kinds.settings, kinds.pipeline.schema_.subject)
        (v2_id,) = set(schemas) - {kinds.v1_id}
        paths = TwoPaths(kinds, job, micro, {"v1": kinds.v1_id, "v2": v2_id}, int(time.time() * 1000), log)
        yield paths
        # The examples compared rows, not only empty tables (the explicit example leaves rows; a
        # drawn one may not: half of ten did not in one run), and the Real-time job met the writer
        # schema registered while it ran.
        print(f"{paths.with_rows} of {paths.examples} examples left rows")
        assert paths.examples == 0 or paths.with_rows >= 1, (paths.with_rows, paths.examples)
        assert paths.examples == 0 or f"met writer schema id {v2_id}" in log.read_text()
    finally:
        micro.stop()
        stop_job(job)


_runs = itertools.count()

deliveries = st.lists(
    st.fixed_dictionaries({
        "key": st.integers(0, 2),  # few keys: they collide
        "rev": st.none() | st.integers(0, 1) | st.sampled_from([-(2**63), 2**63 - 1]),
        "at": st.integers(0, 1),  # the filtered view's version: few values, so they tie
        "price": st.sampled_from([5.5, 150.0]),  # the filtered view keeps price < 100 ...
        "flag": st.booleans(),  # ... and flag = true
        "writer": st.sampled_from(["v1", "v2"]),
        "partition": st.integers(0, 1),
        "fate": st.sampled_from(FATES),
        "copy": st.sampled_from([None, None, "same", "other"]),  # a retry's copy, here or there
    }),
    min_size=1,
    max_size=16,
)  # fmt: skip


def _frames(drawn: list[dict[str, Any]], paths: TwoPaths, run: int) -> list[tuple[int, bytes]]:
    """The drawn deliveries as (partition, framed value), in the order they are sent."""
    base = kinds_records(len(drawn), seed=run, now_ms=paths.now_ms, invalid=0)
    out = []
    for d, record in zip(drawn, base, strict=True):
        record.update(id=f"r{run}-{d['key']}", rev=d["rev"], price=d["price"], flag=d["flag"],
                      at=paths.now_ms - 1000 * d["at"])  # fmt: skip
        schema = SCHEMA_V1 if d["writer"] == "v1" else SCHEMA_V2
        if d["writer"] == "v2":
            record["channel"] = "app"
        if d["fate"] == "refused":
            record["qty"] = 0  # the range rule refuses it
        value = WireEncoder(paths.ids[d["writer"]], parse_schema(schema)).encode(record)
        if d["fate"] == "undecodable":
            value = value[: len(value) // 2]
        elif d["fate"] == "not_wire":
            value = b"\x01" + value[1:]
        elif d["fate"] == "absent_id":
            value = value[:1] + ABSENT_ID.to_bytes(4, "big") + value[5:]
        out.append((d["partition"], value))
        if d["copy"] is not None:
            out.append((d["partition"] if d["copy"] == "same" else 1 - d["partition"], value))
    return out


def _send_to(paths: TwoPaths, frames: list[tuple[int, bytes]]) -> None:
    """Send framed values as they are (the job judges them), each to its partition, all acknowledged."""
    failed: list[Any] = []
    producer = paths.kinds.producer
    for partition, value in frames:
        producer.produce(paths.kinds.pipeline.topic.name, value=value, partition=partition,
                         on_delivery=lambda err, _m: failed.append(err) if err else None)  # fmt: skip
    assert producer.flush(60) == 0 and not failed, failed[:3]


def _mine(rows: dict[str, list[tuple]], pipeline: Pipeline, prefix: str) -> dict[str, list[tuple]]:
    """Per latest view, its rows whose ``id`` starts with ``prefix`` (one example's keys)."""
    out = {}
    for view in pipeline.views:
        if isinstance(view, LatestView):
            at = speed_table_def(pipeline, view).column_names.index("id")
            out[view.name] = [r for r in rows[view.name] if r[at].startswith(prefix)]
    return out


def _realtime_rows(paths: TwoPaths, want: dict[str, list[tuple]], prefix: str) -> dict[str, list[tuple]]:
    """The Real-time path's rows of the example once they equal ``want`` (the micro-batch path's),
    or as they are after a timeout long enough for a restart on a new writer schema."""
    settings, pipeline = paths.kinds.settings, paths.kinds.pipeline
    deadline = time.monotonic() + 180
    while True:
        try:
            got = _mine(_rows(settings, pipeline), pipeline, prefix)
        except (NoHostAvailable, OperationTimedOut):
            got = {}
        if got == want or time.monotonic() > deadline:
            return got
        assert paths.realtime_job.poll() is None, paths.log.read_text()[-3000:]
        time.sleep(0.3)


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    # A failing example waits out the Real-time path's timeout: shrinking would repeat that many
    # times; the example is printed as drawn.
    phases=[Phase.explicit, Phase.generate],
)
@given(drawn=deliveries, cut=st.integers(0, 16))
# Rows whatever is drawn: a valid record of the second writer schema copied to the other partition,
# tying on version with a first-schema record there, and a refused record sent twice.
@example(
    drawn=[
        {"key": 0, "rev": 1, "at": 0, "price": 5.5, "flag": True, "writer": "v2", "partition": 0,
         "fate": "valid", "copy": "other"},
        {"key": 0, "rev": 1, "at": 0, "price": 5.5, "flag": True, "writer": "v1", "partition": 1,
         "fate": "valid", "copy": None},
        {"key": 1, "rev": None, "at": 1, "price": 150.0, "flag": False, "writer": "v1", "partition": 0,
         "fate": "refused", "copy": "same"},
    ],
    cut=1,
)  # fmt: skip
def test_both_paths_leave_the_same_rows_for_any_stream(
    two_paths: TwoPaths, drawn: list[dict], cut: int
) -> None:
    paths = two_paths
    run = next(_runs)
    prefix = f"r{run}-"
    frames = _frames(drawn, paths, run)
    cut = min(cut, len(frames))
    # Two micro-batches of the micro-batch job at a drawn point of the stream.
    _send_to(paths, frames[:cut])
    Supervisor(paths.microbatch).catch_up()
    _send_to(paths, frames[cut:])
    Supervisor(paths.microbatch).catch_up()

    kinds, micro = paths.kinds, paths.microbatch
    want = _mine(_rows(micro.settings, micro.pipeline), micro.pipeline, prefix)
    paths.examples += 1
    paths.with_rows += any(want.values())
    got = _realtime_rows(paths, want, prefix)
    assert got == want, {v: (got[v], want.get(v)) for v in got if got[v] != want.get(v)}

    # And both are the winners a plain reference picks from the topic.
    reference = kinds.reference()
    winners = _winners(kinds.settings, kinds.pipeline)
    for view in reference:
        expected = {k: c for k, c in reference[view].items() if k[-1].startswith(prefix)}
        served = {k: c for k, c in winners[view].items() if k[-1].startswith(prefix)}
        assert served == expected, (view, served, expected)
    # Still the same once the reference is read: the Real-time path had not stopped half-way.
    assert _mine(_rows(kinds.settings, kinds.pipeline), kinds.pipeline, prefix) == want
