"""Views that change on a live pipeline (``lambdalake.view_versions``): a changed view is a new version
built beside the one serving answers, then switched to at once; a view added to a running pipeline is
built from the master dataset; a removed one leaves serving. Planning is checked alone; the whole path with
the deployed jobs, against a plain-Python reference of the records read back by confluent's client."""

from __future__ import annotations

import os
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from lambdalake.batch.job import BatchJob
from lambdalake.cassandra.active import read_meta
from lambdalake.cassandra.session import connect
from lambdalake.control.pipelines import deployed_pipeline as deployed_views
from lambdalake.pipeline import Pipeline, configured_pipeline
from lambdalake.produce.producer import EventProducer
from lambdalake.serving import ServingClient
from lambdalake.settings import Settings
from lambdalake.speed.reset import reset_speed
from lambdalake.view_versions import Registry, deployed_pipeline, plan
from tests.conftest import isolated, port, run_cli
from tests.user_pipeline import SCHEMA_V1, payments, read_back, reference, write_pipeline

# --- planning, alone ------------------------------------------------------------------------


def _pipelines(tmp_path: Path, base: Settings) -> tuple[Pipeline, Pipeline]:
    """The payments pipeline as first written, and with its windowed view changed and a view added."""
    first = write_pipeline(base, tmp_path / "a", "payments-plan", [SCHEMA_V1])
    second = write_pipeline(base, tmp_path / "b", "payments-plan", [SCHEMA_V1])
    changed_file(second)
    return configured_pipeline("payments", first), configured_pipeline("payments", second)


CHANGED_VIEW = """[[views]]
name = "account_region_5m"
kind = "windowed"
key = ["account_id", "region"]
window = "1 minute"
aggregates = [
  { name = "payments", fn = "count" },
  { name = "total", fn = "sum", column = "amount" },
  { name = "largest", fn = "max", column = "amount" },
]

[[views]]
name = "region_status_1m"
kind = "windowed"
key = ["region", "status"]
window = "1 minute"
aggregates = [
  { name = "payments", fn = "count" },
  { name = "total", fn = "sum", column = "amount" },
]
"""


def changed_file(settings: Settings) -> None:
    """Rewrite the pipeline file: the windowed view gets 1-minute windows and fewer aggregates (a
    changed definition); a view keyed by region and status is added (the views after it stay)."""
    path = settings.pipelines_dir / "payments.toml"
    text = path.read_text()
    start = text.index('[[views]]\nname = "account_region_5m"')
    end = text.find("[[views]]", start + 1)
    path.write_text(text[:start] + CHANGED_VIEW + ("\n" + text[end:] if end >= 0 else ""))


def narrower_latest(settings: Settings) -> None:
    """Rewrite the pipeline file: the latest view keeps three columns (a changed definition)."""
    path = settings.pipelines_dir / "payments.toml"
    kept = 'version = "attempt"\ncolumns = ["account_id", "amount", "attempt"]'
    path.write_text(path.read_text().replace('version = "attempt"', kept, 1))


def test_deploy_plans_versions_for_changed_added_and_removed_views(
    settings: Settings, tmp_path: Path
) -> None:
    old, new = _pipelines(tmp_path, settings)
    registry, changes = plan(old, Registry())
    assert {(c.view, c.kind, c.version) for c in changes} == {
        ("payment_latest", "registered", 1), ("account_region_5m", "registered", 1)
    }  # fmt: skip
    assert plan(old, registry)[1] == []  # the same definitions: nothing to do

    changed, changes = plan(new, Registry.parse(registry.to_text()))
    kinds = {c.view: (c.kind, c.version, c.detail) for c in changes}
    assert kinds == {
        "account_region_5m": ("changed", 2, "building"),
        "region_status_1m": ("added", 1, "building"),
    }
    assert changed.active("account_region_5m").name == "account_region_5m"  # still serving v1
    jobs = deployed_pipeline(new, changed)
    assert [v.name for v in jobs.views] == [
        "payment_latest", "account_region_5m", "account_region_5m__v2", "region_status_1m"
    ]  # fmt: skip
    assert jobs.views[2].window == "1 minute" and jobs.views[1].window == "5 minutes"

    # Taken back before the build finished: the build is dropped, v1 stays.
    reverted, changes = plan(old, changed)
    assert {(c.view, c.kind) for c in changes} == {
        ("account_region_5m", "reverted"),
        ("region_status_1m", "removed"),
    }
    assert set(reverted.retired) == {"account_region_5m__v2", "region_status_1m"}
    # ...and changed again later: a new number, never a name used before.
    again, _ = plan(new, reverted)
    assert again.views["account_region_5m"].building.name == "account_region_5m__v3"
    assert again.views["region_status_1m"].building.name == "region_status_1m__v2"

    # A view added after the first deploy is built beside even while the master dataset is empty: records the
    # running job archives before it restarts with the view would be missed by a view active at once.
    quiet, changes = plan(new, registry)
    assert quiet.active("region_status_1m") is None and quiet.views["region_status_1m"].building


#: A windowed view of the payments pipeline keyed by an int, with the min/max of one and the sum of
#: another: a schema version widening them (int to long, int to double) changes its table and state.
BRANCH_VIEW = """
[[views]]
name = "branch_5m"
kind = "windowed"
key = ["branch"]
window = "5 minutes"
aggregates = [
  { name = "payments", fn = "count" },
  { name = "lowest_fee", fn = "min", column = "fee_cents" },
  { name = "highest_fee", fn = "max", column = "fee_cents" },
  { name = "load_total", fn = "sum", column = "load" },
]
"""
NARROW = [{"name": "branch", "type": "int"}, {"name": "fee_cents", "type": "int"},
          {"name": "load", "type": "int"}]  # fmt: skip
WIDE = [{"name": "branch", "type": "long"}, {"name": "fee_cents", "type": "long"},
        {"name": "load", "type": "double"}]  # fmt: skip
BRANCH_V1 = {**SCHEMA_V1, "fields": [*SCHEMA_V1["fields"], *NARROW]}
BRANCH_V2 = {**SCHEMA_V1, "fields": [*SCHEMA_V1["fields"], *WIDE]}
#: v2 also gives the amount (summed, min and max by account_region_5m) two more digits: its Spark
#: state would not resume (STATE_STORE_VALUE_SCHEMA_NOT_COMPATIBLE), so that view is rebuilt too.
BRANCH_V2["fields"] = [
    {**f, "type": {**f["type"], "precision": 14}} if f["name"] == "amount" else f for f in BRANCH_V2["fields"]
]


def branch_pipeline(base: Settings, root: Path, topic: str, schemas: list[dict[str, Any]]) -> Settings:
    settings = write_pipeline(base, root, topic, schemas)
    path = settings.pipelines_dir / "payments.toml"
    path.write_text(path.read_text() + BRANCH_VIEW)
    return settings


def test_a_widening_of_what_a_windowed_view_stores_plans_a_version_made_with_the_new_types(
    settings: Settings, tmp_path: Path
) -> None:
    from lambdalake.cassandra.tables import speed_table_def
    from lambdalake.view_types import held_types
    from lambdalake.view_versions import retype_pending

    def load(name: str, *schemas: dict[str, Any]) -> Pipeline:
        return configured_pipeline("payments", branch_pipeline(settings, tmp_path / name, "t", [*schemas]))

    v1, v2 = load("a", BRANCH_V1), load("b", BRANCH_V1, BRANCH_V2)
    registry, _ = plan(v1, Registry())
    assert registry.active("branch_5m").types == {"branch": "int32", "fee_cents": "int32", "load": "int32"}

    widened, changes = plan(v2, Registry.parse(registry.to_text()))
    (change,) = [c for c in changes if c.view == "branch_5m"]
    assert (change.kind, change.version) == ("changed", 2), change
    assert "stored types widen" in change.detail and "fee_cents int32 to int64" in change.detail, change
    (amount,) = [c for c in changes if c.view == "account_region_5m"]
    assert "amount decimal128(12, 2) to decimal128(14, 2)" in amount.detail, amount
    # The latest view keeps its promoted fields beside the old ones: no new version.
    assert sorted(c.view for c in changes) == ["account_region_5m", "branch_5m"]
    assert retype_pending(v2, widened) == ["account_region_5m", "branch_5m"]
    jobs = deployed_pipeline(v2, widened)
    old, new = (v for v in jobs.views if v.name.startswith("branch_5m"))
    assert held_types(jobs, jobs.views[1]) == {"amount": pa.decimal128(12, 2)}  # account_region_5m v1
    assert held_types(jobs, old) == {"branch": pa.int32(), "fee_cents": pa.int32(), "load": pa.int32()}
    assert held_types(jobs, new) == {}
    columns = lambda view: dict(speed_table_def(jobs, view).columns)  # noqa: E731
    assert [columns(old)[c] for c in ("branch", "lowest_fee", "load_total")] == ["int", "int", "bigint"]
    assert [columns(new)[c] for c in ("branch", "lowest_fee", "load_total")] == ["bigint", "bigint", "double"]

    assert plan(v2, widened)[1] == []  # deployed again while it builds: the build resumes
    switched = Registry.parse(widened.to_text())
    for state in switched.views.values():
        state.active, state.building = state.building or state.active, None
    assert plan(v2, switched)[1] == [] and retype_pending(v2, switched) == []
    back, changes = plan(v1, widened)  # the widening taken back: the build is dropped
    assert sorted((c.view, c.kind) for c in changes) == [
        ("account_region_5m", "reverted"), ("branch_5m", "reverted")
    ]  # fmt: skip
    assert back.views["branch_5m"].building is None


# --- the whole path -------------------------------------------------------------------------


def firsts(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first copy of each identity by (ingest time, partition, offset)."""
    seen: dict[tuple, dict] = {}
    for r in sorted(records, key=lambda r: (r["_ts"], r["_partition"], r["_offset"])):
        seen.setdefault((r["payment_id"], r["attempt"]), r)
    return list(seen.values())


def windows(records: list[dict[str, Any]], key: tuple[str, ...], window_ms: int) -> dict[tuple, dict]:
    """count, sum and max of the amount per key and window (a plain-Python reference)."""
    cells: dict[tuple, list[Decimal]] = defaultdict(list)
    for r in firsts(records):
        cells[(*[r[k] for k in key], r["paid_at"] // window_ms * window_ms)].append(r["amount"])
    return {
        cell: {"payments": len(a), "total": sum(a, Decimal(0)), "largest": max(a)}
        for cell, a in cells.items()
    }


def served_problems(
    settings: Settings, view: str, key: tuple[str, ...], window_ms: int, names: tuple
) -> list:
    """How serving's merged answers of ``view`` differ from the reference of every record sent."""
    want = windows(read_back(settings, settings_topic(settings)), key, window_ms)
    client = ServingClient(settings=settings, meta_ttl_s=0)
    problems = []
    for k in sorted({cell[:-1] for cell in want}):
        answer = client.query("payments", view, list(k))
        got = {(*k, round(w.window_start.timestamp() * 1000)): w.values for w in answer.windows}
        expected = {c: row for c, row in want.items() if c[:-1] == k}
        if set(got) != set(expected):
            problems.append(f"{k}: windows {sorted(got)[:3]}... != {sorted(expected)[:3]}...")
            continue
        for cell, row in expected.items():
            for name in names:
                if got[cell][name] != row[name]:
                    problems.append(f"{cell} {name}: want {row[name]!r}, got {got[cell][name]!r}")
    return problems


def settings_topic(settings: Settings) -> str:
    return configured_pipeline("payments", settings).topic.name


def eventually(check, timeout: float = 180.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        problems = check()
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(3)


def send(producer: EventProducer, records: list[dict[str, Any]]) -> None:
    outcome = producer.send_batch(records)
    assert not outcome.refused, outcome.refused[:3]
    assert producer.flush().unacknowledged == 0


def live_payments(services: Settings, tmp_path: Path, *, port: int) -> tuple[Settings, Pipeline]:
    """The payments pipeline on the session's services, with a keyspace, storage, state folder (deploy
    starts its jobs there) and serving port of its own. Its row-count check is loosened: producers
    send more while a view builds than the check lets a view grow by from one batch to the next."""
    unique = os.urandom(4).hex()
    base = isolated(services, tmp_path, unique).model_copy(
        update={
            "state_dir": tmp_path / "state",
            "serving": services.serving.model_copy(update={"port": port}),
        }
    )
    settings = write_pipeline(base, tmp_path / "files", f"payments-{unique}", [SCHEMA_V1])
    (settings.pipelines_dir / "payments.expectations.json").write_text('{"row_count_tolerance": 100}')
    return settings, configured_pipeline("payments", settings)


@contextmanager
def sending(
    settings: Settings,
    pipeline: Pipeline,
    *,
    first: int,
    n: int,
    every_s: float,
    shape: Callable[[dict[str, Any]], dict[str, Any]] = lambda r: r,
) -> Iterator[None]:
    """A producer sending ``n`` payments (each made by ``shape``) every ``every_s`` (ids from ``first``
    on) while the block runs."""
    stop = threading.Event()

    def run() -> None:
        sender = EventProducer(settings=settings, pipeline=pipeline)
        i = 0
        while not stop.is_set():
            send(sender, [shape(p) for p in payments(n, seed=first + i, start=first + n * i)])
            i += 1
            stop.wait(every_s)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


OLD = ("payments", "total", "smallest", "largest", "mean")
NEW = ("payments", "total", "largest")


#: The changed view with 2-minute windows, and without the added view.
TWO_MINUTES = CHANGED_VIEW.replace('window = "1 minute"', 'window = "2 minutes"', 1).split(
    '[[views]]\nname = "region'
)[0]
#: The windowed views the soak cycles through: (the file's view sections, {view: (key, window ms)}).
SOAK_DEFINITIONS = [
    (CHANGED_VIEW, {"account_region_5m": (("account_id", "region"), 60_000),
                    "region_status_1m": (("region", "status"), 60_000)}),
    (TWO_MINUTES, {"account_region_5m": (("account_id", "region"), 120_000)}),
    (CHANGED_VIEW.replace('key = ["account_id", "region"]', 'key = ["region"]'),
     {"account_region_5m": (("region",), 60_000), "region_status_1m": (("region", "status"), 60_000)}),
]  # fmt: skip


@pytest.mark.services
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("LAMBDALAKE_VIEW_SOAK_ROUNDS"), reason="make soak runs it")
def test_view_changes_soak(services: Settings, tmp_path: Path) -> None:
    """``LAMBDALAKE_VIEW_SOAK_ROUNDS`` deploys in a row, each changing the views (window, key, a view
    added and removed in turn) while a producer sends: after each, every answer of every view equals
    the reference with that round's definition."""
    rounds = int(os.environ["LAMBDALAKE_VIEW_SOAK_ROUNDS"])
    settings, pipeline = live_payments(services, tmp_path, port=port(18483))
    producer = EventProducer(settings=settings, pipeline=pipeline)
    path = settings.pipelines_dir / "payments.toml"
    head = path.read_text()[: path.read_text().rindex("[[views]]")]
    try:
        assert run_cli(settings, "deploy", "payments").returncode == 0
        send(producer, payments(800, seed=31))
        for i in range(rounds):
            views, expected = SOAK_DEFINITIONS[i % len(SOAK_DEFINITIONS)]
            path.write_text(head + views)
            with sending(settings, pipeline, first=1_000_000 * (i + 1), n=20, every_s=1.0):
                done = run_cli(settings, "deploy", "payments", timeout=900)
            assert done.returncode == 0, (done.stdout + done.stderr).decode()[-3000:]
            for view, (key, window_ms) in expected.items():
                check = lambda view=view, key=key, window_ms=window_ms: served_problems(  # noqa: E731
                    settings, view, key, window_ms, ("payments", "total")
                )
                assert eventually(check) == [], (i, view)
            if i % 2 == 1:
                time.sleep(pipeline.layers.epoch_seconds + 2)
                assert run_cli(settings, "batch", "run", "payments").returncode == 0
    finally:
        run_cli(settings, "undeploy")


def branch_reference(records: list[dict[str, Any]], load: type) -> dict[tuple[int, int], dict[str, Any]]:
    """branch_5m per (branch, window start ms) over first copies: count, min and max fee, load sum
    (``load``: int while summed as v1's int, float once v2 makes it a double)."""
    cells: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for r in firsts(records):
        cells[(r["branch"], r["paid_at"] // 300_000 * 300_000)].append(r)
    return {
        cell: {"payments": len(rows), "lowest_fee": min(r["fee_cents"] for r in rows),
               "highest_fee": max(r["fee_cents"] for r in rows),
               "load_total": load(sum(r["load"] for r in rows))}
        for cell, rows in cells.items()
    }  # fmt: skip


def branch_problems(settings: Settings, load: type) -> list[str]:
    """How serving's branch_5m answers differ from the reference, value for value and type for type."""
    want = branch_reference(read_back(settings, settings_topic(settings)), load)
    client = ServingClient(settings=settings, meta_ttl_s=0)
    problems = []
    for branch in sorted({b for b, _ in want}):
        answer = client.query("payments", "branch_5m", branch)
        got = {(branch, round(w.window_start.timestamp() * 1000)): w.values for w in answer.windows}
        expected = {c: row for c, row in want.items() if c[0] == branch}
        if set(got) != set(expected):
            problems.append(f"{branch}: windows {sorted(got)} != {sorted(expected)}")
            continue
        for cell, row in expected.items():
            values = {k: got[cell][k] for k in row}
            if values != row or any(type(values[k]) is not type(v) for k, v in row.items()):
                problems.append(f"{cell}: want {row}, got {values}")
    return problems


def branched(p: dict[str, Any]) -> dict[str, Any]:
    """A payment with the fields schema v1 adds: one of 7 branches, a fee and a load, all from its id."""
    n = int(p["payment_id"].removeprefix("pay-"))
    return {**p, "branch": n % 7, "fee_cents": 1_000 + n % 500, "load": n % 50}


def batch_run(settings: Settings, spark: Any) -> str:
    """A batch run of ``payments`` as deployed (its view versions) in ``spark``; its outcome."""
    run = BatchJob(settings=settings, pipeline=deployed_views(settings, "payments"), spark=spark).run()
    return run.outcome


@pytest.mark.services
@pytest.mark.slow
def test_views_changed_added_and_widened_on_a_live_pipeline_are_built_then_switched(
    services: Settings, spark: Any, tmp_path: Path
) -> None:
    """Deployed with its jobs; events archived and a batch published. Then one deploy, while a
    producer keeps sending and serving is read: the windowed view changes (1-minute windows, other
    aggregates), the latest view keeps fewer columns, a view is added, and a schema v2 widens what a
    windowed view stores (its key and the field its min and max keep, int to long; the one it sums,
    int to double) and gives the amount the first windowed view sums two more digits. Deploy builds
    each new version beside the serving one (batch from the master dataset, closed epochs recomputed,
    open ones by the job) while holding v2 back from the registry (no value the old tables cannot
    hold is sent meanwhile), switches, then registers v2: serving answers the old version until then
    and the new one only after. Values beyond the old types follow; every view equals the reference,
    as v2's types, before and after a batch and again after a speed reset; the old versions' tables
    and checkpoint are gone and `status` shows v2."""
    from confluent_kafka.schema_registry import SchemaRegistryClient

    settings, _ = live_payments(services, tmp_path, port=port(18482))
    settings = branch_pipeline(settings, tmp_path / "files", settings_topic(settings), [BRANCH_V1])
    pipeline = configured_pipeline("payments", settings)
    registry = SchemaRegistryClient(settings.registry.client_config())
    producer = EventProducer(settings=settings, pipeline=pipeline)
    try:
        deployed = run_cli(settings, "deploy", "payments")
        assert deployed.returncode == 0, (deployed.stdout + deployed.stderr).decode()[-3000:]
        wave = [{**p, "branch": i % 7, "fee_cents": 2**31 - 1 - i, "load": i % 50}
                for i, p in enumerate(payments(1200, seed=21))]  # fmt: skip
        send(producer, wave + random.Random(22).sample(wave, 50))
        five = ("account_region_5m", ("account_id", "region"), 5 * 60_000, NEW)
        assert eventually(lambda: served_problems(settings, *five)) == []
        assert eventually(lambda: branch_problems(settings, int)) == []
        time.sleep(pipeline.layers.epoch_seconds + 2)
        # A batch run of the deployed pipeline in the test's own Spark session: a command's own driver
        # JVM costs ~20 CPU-seconds, and `batch run` has tests of its own.
        assert batch_run(settings, spark) == "published"

        # The change, deployed while a producer sends with v1; serving is read all along.
        topic = settings_topic(settings)
        settings = branch_pipeline(settings, tmp_path / "files", topic, [BRANCH_V1, BRANCH_V2])
        changed_file(settings)
        narrower_latest(settings)
        v2 = configured_pipeline("payments", settings)
        stop = threading.Event()
        seen: list[tuple[str, ...]] = []
        errors: list[str] = []

        def keep_reading() -> None:
            client = ServingClient(settings=settings, meta_ttl_s=0)
            while not stop.is_set():
                try:
                    answer = client.query("payments", "account_region_5m", ["acct-01", "eu"])
                except Exception as exc:  # every answer must be whole, during the switch too
                    errors.append(repr(exc))
                else:
                    seen.extend(tuple(w.values) for w in answer.windows)
                stop.wait(0.2)

        reader = threading.Thread(target=keep_reading)
        reader.start()
        try:
            # A send every 3 s, not every micro-batch: each micro-batch with records costs the job
            # about a CPU-second, beside the view build's batch on two cores.
            with sending(settings, pipeline, first=100_000, n=200, every_s=3.0, shape=branched):
                redeploy = run_cli(settings, "deploy", "payments", timeout=900)
        finally:
            stop.set()
            reader.join()
        output = " ".join((redeploy.stdout + redeploy.stderr).decode().split())
        assert redeploy.returncode == 0, output[-4000:]
        assert errors == [], errors[:3]
        assert "v2 active (serving switched)" in output and "region_status_1m" in output, output[-4000:]
        assert "stored types widen" in output and "held" in output, output[-4000:]
        assert registry.get_versions(pipeline.schema_.subject) == [1, 2]  # registered once v2 served
        # Every answer came whole from one version: the old aggregates, then the new ones.
        # (an old answer also carries avg's parts, mean_sum and mean_count)
        shapes = ["old" if set(OLD) <= set(s) else "new" if set(s) == set(NEW) else str(s) for s in seen]
        assert set(shapes) == {"old", "new"}, set(shapes)
        switched = shapes.index("new")
        assert all(s == "new" for s in shapes[switched:]), "serving went back to the old version"

        # Keys and fees beyond 32 bits and amounts of 14 digits with v2, v1's records beside them.
        later = [{**p, "branch": 2**33 + i % 3, "fee_cents": 3_000_000_000 + i, "load": i / 4,
                  "amount": Decimal("987654321098.76") if i % 10 == 0 else p["amount"]}
                 for i, p in enumerate(payments(300, seed=43, start=50_000))]  # fmt: skip
        send(EventProducer(settings=settings, pipeline=v2), later)
        send(
            producer,
            [{**p, "branch": 3, "fee_cents": -5, "load": 9} for p in payments(500, seed=23, start=200_000)],
        )
        minute = 60_000
        new_view = ("account_region_5m", ("account_id", "region"), minute, NEW)
        added = ("region_status_1m", ("region", "status"), minute, ("payments", "total"))
        for args in (new_view, added):
            assert eventually(lambda args=args: served_problems(settings, *args)) == [], args[0]
        assert eventually(lambda: branch_problems(settings, float)) == []

        # The latest view (v2: fewer columns) kept up through both restarts and the main query's move.
        latest = reference(read_back(settings, topic))[1]
        client = ServingClient(settings=settings, meta_ttl_s=0)
        for payment_id in random.Random(5).sample(sorted(latest), 150):
            got = client.query("payments", "payment_latest", payment_id).latest
            assert got is not None and got.values["amount"] == latest[payment_id]["amount"], payment_id
            assert got.values["attempt"] == latest[payment_id]["attempt"], payment_id
            assert "status" not in got.values  # the new version's columns

        session = connect(settings.cassandra)
        session.cluster.refresh_schema_metadata()
        tables = set(session.cluster.metadata.keyspaces[settings.cassandra.keyspace].tables)
        assert "payments__account_region_5m__v2__speed" in tables
        assert not any(t.startswith("payments__account_region_5m__") and "__v2" not in t for t in tables), (
            tables
        )
        checkpoints = Path(settings.storage_root) / "checkpoints" / "payments"
        assert (
            not (checkpoints / "account_region_5m").exists() and (checkpoints / "region_status_1m").exists()
        )
        meta = read_meta(session, settings.cassandra.keyspace, "payments").registry
        assert meta.active("account_region_5m").version == 2 and not meta.building()
        assert meta.active("branch_5m").name == "branch_5m__v2"
        assert meta.active("payment_latest").name == "payment_latest__v2"
        assert "payments__payment_latest__speed_latest" not in tables
        assert meta.retired == []
        status = run_cli(settings, "status")
        assert "v2" in status.stdout.decode(), status.stdout.decode()

        time.sleep(v2.layers.epoch_seconds + 2)
        assert batch_run(settings, spark) == "published"
        assert branch_problems(settings, float) == []
        assert served_problems(settings, *new_view) == []

        # A speed reset rebuilds the versions deployed (the main query takes the first windowed one).
        # (In the test's Spark session: the `speed reset` command runs in tests/test_replay.py.)
        assert run_cli(settings, "undeploy").returncode == 0
        reset_speed(settings, deployed_views(settings, "payments"), spark)
        redeployed = run_cli(settings, "deploy", "payments")
        assert redeployed.returncode == 0, (redeployed.stdout + redeployed.stderr).decode()[-3000:]
        send(
            EventProducer(settings=settings, pipeline=v2),
            [{**branched(p), "load": 0.5} for p in payments(300, seed=24, start=300_000)],
        )
        for args in (new_view, added):
            assert eventually(lambda args=args: served_problems(settings, *args)) == [], args[0]
        assert eventually(lambda: branch_problems(settings, float)) == []
    finally:
        run_cli(settings, "undeploy")
