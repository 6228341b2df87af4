"""Views that change on a live pipeline (``lambdalake.view_versions``): a changed view is a new version
built beside the one serving answers, then switched to at once; a view added to a running pipeline is
built from bronze; a removed one leaves serving. Planning is checked alone; the whole path with the
deployed jobs, against a plain-Python reference of the records read back by confluent's client."""

from __future__ import annotations

import os
import random
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from lambdalake.cassandra.active import read_meta
from lambdalake.cassandra.session import connect
from lambdalake.pipeline import Pipeline, configured_pipeline
from lambdalake.produce.producer import EventProducer
from lambdalake.settings import Settings
from lambdalake.view_versions import Registry, deployed_pipeline, plan
from serving import ServingClient
from tests.conftest import isolated, run_cli
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
    changed definition); a view keyed by region and status is added."""
    path = settings.pipelines_dir / "payments.toml"
    text = path.read_text()
    path.write_text(text[: text.rindex("[[views]]")] + CHANGED_VIEW)


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

    # A view added after the first deploy is built beside even while bronze is empty: records the
    # running job archives before it restarts with the view would be missed by a view active at once.
    quiet, changes = plan(new, registry)
    assert quiet.active("region_status_1m") is None and quiet.views["region_status_1m"].building


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
def sending(settings: Settings, pipeline: Pipeline, *, first: int, n: int, every_s: float) -> Iterator[None]:
    """A producer sending ``n`` payments every ``every_s`` (ids from ``first`` on) while the block runs."""
    stop = threading.Event()

    def run() -> None:
        sender = EventProducer(settings=settings, pipeline=pipeline)
        i = 0
        while not stop.is_set():
            send(sender, payments(n, seed=first + i, start=first + n * i))
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


@pytest.mark.services
@pytest.mark.slow
def test_a_view_changed_and_one_added_on_a_live_pipeline_are_built_then_switched(
    services: Settings, tmp_path: Path
) -> None:
    """Deployed with its jobs; events archived and a batch published; then the windowed view changes
    (1-minute windows, other aggregates), the latest view keeps fewer columns and a view is added,
    while a producer keeps sending. Serving
    answers the old version until deploy has built the new one (batch from bronze, closed epochs
    recomputed, open ones by the job) and then the new one only; both equal the reference, and again
    after a speed reset; the old version's tables and checkpoint are gone and `status` shows v2."""
    settings, pipeline = live_payments(services, tmp_path, port=18482)
    producer = EventProducer(settings=settings, pipeline=pipeline)
    try:
        deployed = run_cli(settings, "deploy", "payments")
        assert deployed.returncode == 0, (deployed.stdout + deployed.stderr).decode()[-3000:]
        wave = payments(1200, seed=21)
        send(producer, wave + random.Random(22).sample(wave, 50))
        five = 5 * 60_000
        assert (
            eventually(
                lambda: served_problems(settings, "account_region_5m", ("account_id", "region"), five, NEW)
            )
            == []
        )
        time.sleep(pipeline.layers.epoch_seconds + 2)
        batch = run_cli(settings, "batch", "run", "payments")
        assert batch.returncode == 0, (batch.stdout + batch.stderr).decode()[-3000:]

        # The change, deployed while a producer sends; serving is read all along.
        changed_file(settings)
        narrower_latest(settings)
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
            with sending(settings, pipeline, first=100_000, n=40, every_s=0.5):
                redeploy = run_cli(settings, "deploy", "payments", timeout=900)
        finally:
            stop.set()
            reader.join()
        output = (redeploy.stdout + redeploy.stderr).decode()
        assert redeploy.returncode == 0, output[-4000:]
        assert errors == [], errors[:3]
        assert "v2 active (serving switched)" in output and "region_status_1m" in output, output[-4000:]
        # Every answer came whole from one version: the old aggregates, then the new ones.
        # (an old answer also carries avg's parts, mean_sum and mean_count)
        shapes = ["old" if set(OLD) <= set(s) else "new" if set(s) == set(NEW) else str(s) for s in seen]
        assert set(shapes) == {"old", "new"}, set(shapes)
        switched = shapes.index("new")
        assert all(s == "new" for s in shapes[switched:]), "serving went back to the old version"

        send(producer, payments(500, seed=23, start=200_000))
        minute = 60_000
        new_view = ("account_region_5m", ("account_id", "region"), minute, NEW)
        added = ("region_status_1m", ("region", "status"), minute, ("payments", "total"))
        for args in (new_view, added):
            assert eventually(lambda args=args: served_problems(settings, *args)) == [], args[0]

        # The latest view (v2: fewer columns) kept up through both restarts and the main query's move.
        latest = reference(read_back(settings, pipeline.topic.name))[1]
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
        registry = read_meta(session, settings.cassandra.keyspace, "payments").registry
        assert registry.active("account_region_5m").version == 2 and not registry.building()
        assert registry.active("payment_latest").name == "payment_latest__v2"
        assert "payments__payment_latest__speed_ranked" not in tables
        assert registry.retired == []
        status = run_cli(settings, "status")
        assert "v2" in status.stdout.decode(), status.stdout.decode()

        # A speed reset rebuilds the versions deployed (the main query takes the first windowed one).
        assert run_cli(settings, "undeploy").returncode == 0
        reset = run_cli(settings, "speed", "reset", "payments", "--yes")
        assert reset.returncode == 0, (reset.stdout + reset.stderr).decode()[-3000:]
        redeployed = run_cli(settings, "deploy", "payments")
        assert redeployed.returncode == 0, (redeployed.stdout + redeployed.stderr).decode()[-3000:]
        send(producer, payments(300, seed=24, start=300_000))
        for args in (new_view, added):
            assert eventually(lambda args=args: served_problems(settings, *args)) == [], args[0]
    finally:
        run_cli(settings, "undeploy")


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
    settings, pipeline = live_payments(services, tmp_path, port=18483)
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
