"""The speed layer beside a peer: lambdalake's speed job and quix-streams on the same offers backlog.

Both compute the two offers views (``offer_latest``, ``merchant_offers_hourly``) into Cassandra
(quix-streams: ``bench/peer_quix.py``, in a keyspace of its own, tables of the same shape). Sides:
lambdalake (``lambdalake speed run offers``), quix-streams with its defaults (commit interval 5 s)
and tuned (``--tuned-commit`` s). In each round every side, in turn (the order rotates), gets:

1. Throughput: a topic of its own holding the same ``--events`` generated offers (2 % copies); the
   side starts on it and the clock runs until everything is processed and durable (lambdalake: its
   status file counts every record in each query; quix-streams: its consumer group has committed
   the end of the topic and of its repartition topic, which it does only after its sinks flushed).
   Reported: events over the whole time from the process start, and over the time after the first
   progress was seen (without start-up).
2. Correctness, before any figure counts: both views of 500 sampled offers and 500 sampled
   merchants equal a DuckDB reference computed from the records sent (copies counted once, latest =
   highest version, hourly windows of ``updated_at``).
3. Freshness: the side still running, ``--rate`` events/s for ``--seconds`` s with a probe (a new
   offer of a new merchant) every 1/``--probe-rate`` s; per probe the time from its produce call
   until its row is visible in each view's table; p50/p99.
4. Memory: RSS summed over the side's process tree (lambdalake: driver, JVM, Python
   workers; quix-streams: its one process), sampled every 0.5 s through 1-3; median and max, and
   the steady state: the median over the second half of 3. Beside it the steady PSS (sampled every
   5 s), which shares each page among the processes mapping it: what the side costs the machine,
   where the RSS sum counts a forked worker's pages shared with its daemon once per process.

5. CPU through the drain (1): the side's process tree (every process seen, read from ``/proc``) as
   cores and as CPU ms per 1,000 events, and the whole machine's busy share over the same time, so a
   drain bounded by the two cores says so in the same run. The same two through the freshness run
   (3), as cores (``freshness_cpu``): what the steady rate costs the side and the machine.

With ``--floor`` each round starts with a Kafka-to-Kafka Real-time query's latency alone
(``bench.realtime_floor``); the side ``floor-beside-lambdalake`` is the micro-batch speed job with
that query running beside it through its freshness run (what two shared cores cost its tail). With
``--floor`` and the side ``lambdalake-realtime``, each round also drains the backlog with the Real-time
latest query alone, computing its candidates and writing none, then writing them
(``bench.realtime_drain``): what the second read and decode cost, and what the writes add.

The side ``lambdalake-realtime-nowrite`` is ``lambdalake-realtime``'s job with its Real-time query
computing every candidate and writing none: only its drain is measured, the floor under any
Real-time latest path that reads and decodes the topic beside the micro-batch query.

The side ``lambdalake-store`` is the micro-batch speed job with its whole lake on the embedded object
store (``--sides lambdalake,lambdalake-store``: the store against the local disk);
``lambdalake-secure`` runs it on secured services of their own, as `lambdalake up --secure` starts
them, each command as its role's principal (``--sides lambdalake,lambdalake-secure``: secured
against open services).

The peer runs in its own virtualenv (``.lambdalake/peer-venv``: quix-streams 3.28.1 pins
confluent-kafka below the version the project uses), made on first use.

The Real-time path's latest query reports the rows it read only as each of its batches ends
(``speed.realtime_batch_s``, 5 s), so a Real-time side's drain ends when its micro-batch query has
read every record and the sampled offers' latest rows equal the reference, checked in Cassandra.

With ``--warm-up`` a ``lambdalake`` side runs first and is not counted: the first side of a round
otherwise starts on cold services and a cold page cache (each side drained 0.79-0.83x as fast
first as second: docs/benchmarks-log.md, 2026-12-05, fifth).

With ``--baseline DIR`` (a checkout of another revision) its speed job runs too, as a side of its own
(``lambdalake-realtime-baseline`` among the sides: with its latest views in Real-time Mode).

    python -m bench.peers [--events 300000] [--rounds 2] [--rate 1000] [--seconds 120] [--baseline DIR]
        [--warm-up]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
from confluent_kafka import Consumer, TopicPartition

from bench import realtime_drain
from bench.common import bench_settings, probe_freshness, secure_settings, store_settings, write_result
from bench.sampling import RssSampler, machine_cpu
from lambdalake.cassandra.session import connect
from lambdalake.control.deploy import deploy
from lambdalake.infra.services import running
from lambdalake.layout import speed_status_file
from lambdalake.object_store import use
from lambdalake.pipeline import Pipeline, WindowedView, configured_pipeline
from lambdalake.produce.generator import Mix, generate
from lambdalake.produce.producer import EventProducer
from lambdalake.settings import PROJECT_ROOT, Settings
from lambdalake.storage import read_text
from lambdalake.views import speed_table

PEER_VENV = PROJECT_ROOT / ".lambdalake" / "peer-venv"
PEER_PACKAGES = ["quixstreams==3.28.1", "cassandra-driver>=3.29,<4"]
SAMPLE = 500
SIDES = ("lambdalake", "quix-default", "quix-tuned")
#: Sides run only when asked: the speed job with its latest views in Real-time Mode (speed.latest);
#: the micro-batch speed job with a Kafka-to-Kafka Real-time query beside it through its freshness
#: run (how much two cores shared with a micro-batch job cost a Real-time query's latency).
OTHER_SIDES = (
    "lambdalake-realtime",
    "lambdalake-realtime-nowrite",
    "floor-beside-lambdalake",
    "lambdalake-baseline",
    "lambdalake-realtime-baseline",
    "lambdalake-store",
    "lambdalake-secure",
)


def peer_python() -> Path:
    """The peer virtualenv's interpreter, made (idempotently) on first use."""
    python = PEER_VENV / "bin" / "python"
    if not python.exists() or subprocess.run([python, "-c", "import quixstreams"]).returncode != 0:
        subprocess.run([sys.executable, "-m", "venv", "--clear", PEER_VENV], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", *PEER_PACKAGES], check=True)
    return python


# --- the reference -----------------------------------------------------------------------------


def reference(records: list[dict]) -> tuple[dict[str, dict], dict[tuple[str, int], dict]]:
    """(latest row per offer, hourly row per (merchant, window start ms)) by DuckDB."""
    events = pa.Table.from_pylist(records)  # noqa: F841  (read by DuckDB by name)
    db = duckdb.connect()
    db.execute("CREATE TABLE firsts AS SELECT DISTINCT ON (offer_id, version) * FROM events")
    latest = db.execute(
        "SELECT * FROM firsts QUALIFY row_number() OVER (PARTITION BY offer_id ORDER BY version DESC) = 1"
    ).to_arrow_table()
    hourly = db.execute(
        """SELECT merchant_id, updated_at // 3600000 * 3600000 AS window_start, count(*) AS updates,
                  sum(price_cents) AS price_sum, min(price_cents) AS price_min,
                  max(price_cents) AS price_max, avg(price_cents) AS price_avg, sum(stock) AS stock_sum
           FROM firsts GROUP BY ALL"""
    ).to_arrow_table()
    return (
        {r["offer_id"]: r for r in latest.to_pylist()},
        {(r["merchant_id"], r["window_start"]): r for r in hourly.to_pylist()},
    )


def _ms(value: Any) -> Any:
    return round(value.timestamp() * 1000) if hasattr(value, "timestamp") else value


def _rows(session: Any, table: str, column: str, keys: list[str], *, first: bool = False) -> list[dict]:
    """Rows of ``keys`` (``first``: only each key's first row, a ranked latest table's winner)."""
    out = []
    limit = " PER PARTITION LIMIT 1" if first else ""
    for i in range(0, len(keys), 100):
        chunk = keys[i : i + 100]
        marks = ", ".join(["%s"] * len(chunk))
        query = f"SELECT * FROM {table} WHERE {column} IN ({marks}){limit}"
        out += [
            {k: _ms(v) for k, v in r._asdict().items()} for r in session.execute(query, chunk, timeout=60)
        ]
    return out


def _merge_epochs(rows: list[dict], view: WindowedView) -> dict[tuple[str, int], dict]:
    """lambdalake's speed rows of (merchant, window, epoch) merged per (merchant, window), by each
    aggregate's merge (as serving does)."""
    merged: dict[tuple[str, int], dict] = {}
    for r in rows:
        key = (r["merchant_id"], r["window_start"])
        m = merged.setdefault(key, {})
        for agg in view.aggregates:
            if agg.fn == "avg":
                for part in ("_sum", "_count"):
                    m[agg.name + part] = m.get(agg.name + part, 0) + r[agg.name + part]
            elif agg.fn in ("count", "sum"):
                m[agg.name] = m.get(agg.name, 0) + r[agg.name]
            else:
                pick = min if agg.fn == "min" else max
                m[agg.name] = r[agg.name] if agg.name not in m else pick(m[agg.name], r[agg.name])
    for m in merged.values():
        for agg in view.aggregates:
            if agg.fn == "avg":
                m[agg.name] = m.pop(agg.name + "_sum") / m.pop(agg.name + "_count")
    return merged


def differences(
    want: tuple[dict[str, dict], dict[tuple[str, int], dict]],
    got_latest: list[dict],
    got_hourly: dict[tuple[str, int], dict],
    offers: list[str],
    merchants: list[str],
) -> list[str]:
    """How a side's rows for the sampled keys differ from the reference (empty when equal)."""
    latest, hourly = want
    problems = []
    by_offer = {r["offer_id"]: r for r in got_latest}
    for offer in offers:
        w, g = latest[offer], by_offer.get(offer)
        bad = [c for c in w if g is None or g.get(c) != w[c]]
        if bad:
            problems.append(f"offer_latest {offer}: {bad} want {[w[c] for c in bad]} got {g}")
    sampled = set(merchants)
    want_h = {k: v for k, v in hourly.items() if k[0] in sampled}
    got_h = {k: v for k, v in got_hourly.items() if k[0] in sampled}
    if set(want_h) != set(got_h):
        problems.append(
            f"hourly: {len(set(want_h) - set(got_h))} missing, {len(set(got_h) - set(want_h))} extra"
        )
    for key in set(want_h) & set(got_h):
        for c, w in want_h[key].items():
            if c in ("merchant_id", "window_start"):
                continue
            g = got_h[key][c]
            if not (abs(g - w) <= 1e-6 * max(1.0, abs(w)) if isinstance(w, float) else g == w):
                problems.append(f"hourly {key} {c}: want {w!r} got {g!r}")
    return problems[:10]


# --- the sides ---------------------------------------------------------------------------------


class Side:
    """One speed layer under test: how to start it, tell it has everything, and read its views."""

    name: str

    def start(self) -> subprocess.Popen[bytes]:
        raise NotImplementedError

    def processed_all(self, records: int) -> bool | None:
        """True when every record is processed and durable; None before any progress."""
        raise NotImplementedError

    def views(self, offers: list[str], merchants: list[str]) -> tuple[list[dict], dict]:
        raise NotImplementedError

    def visible(self, view: str, keys: list[str]) -> set[str]:
        raise NotImplementedError


#: The speed job as ``lambdalake speed run`` runs it, but with its Real-time query computing every
#: latest candidate and writing none: the floor of a path that reads and decodes the topic twice.
NO_LATEST_WRITES = (
    "import functools, sys\n"
    "import lambdalake.speed.job as job\n"
    "job.start_latest_query = functools.partial(job.start_latest_query, write=False)\n"
    "from lambdalake.cli import main\n"
    "sys.argv[0] = 'lambdalake'\n"
    "main()\n"
)


class Lambdalake(Side):
    name = "lambdalake"

    def __init__(
        self,
        settings: Settings,
        pipeline: Pipeline,
        log: Path,
        *,
        root: Path = PROJECT_ROOT,
        write_latest: bool = True,
    ) -> None:
        self.settings, self.pipeline, self.log, self.root = settings, pipeline, log, root
        self.write_latest = write_latest
        #: The Real-time path: its latest query reports its rows only as each of its batches ends
        #: (``speed.realtime_batch_s``), so its drain is told by the latest rows themselves.
        self.realtime = settings.speed.latest == "realtime" and write_latest
        #: The reference's latest rows of the sampled offers, which the Real-time path's drain waits for.
        self.expect: dict[str, dict] = {}
        #: The sampled offers whose latest row is not the reference's yet (None: not read yet).
        self.pending: set[str] | None = None
        self.status = speed_status_file(settings.storage_root, pipeline.name)
        self.session = connect(settings.cassandra)
        self._tables: dict[str, str] = {}

    @property
    def tables(self) -> dict[str, str]:
        """Each view's speed table, found once the job has made them."""
        if len(self._tables) == len(self.pipeline.views):
            return self._tables
        self.session.cluster.refresh_schema_metadata()
        ks = self.session.cluster.metadata.keyspaces.get(self.settings.cassandra.keyspace)
        have = set(ks.tables) if ks is not None else set()
        out = {}
        for v in self.pipeline.views:
            name = speed_table(self.pipeline, v)
            if name in have:
                self._tables[v.name] = name
            out[v.name] = name
        return out

    def start(self) -> subprocess.Popen[bytes]:
        command = ["-m", "lambdalake"] if self.write_latest else ["-c", NO_LATEST_WRITES]
        return subprocess.Popen(
            [sys.executable, *command, "speed", "run", self.pipeline.name],
            env={**os.environ, **self.settings.to_env(), "PYTHONPATH": str(self.root)},
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True, cwd=self.root,
        )  # fmt: skip

    def processed_all(self, records: int) -> bool | None:
        try:
            status = json.loads(read_text(self.status) or "")
            rows = [
                s["rows"] for name, s in status.items() if not (self.realtime and name.endswith("-latest"))
            ]
        except (OSError, ValueError, KeyError):
            return None
        if not rows or max(rows) == 0:
            return None
        if min(rows) < records:
            return False
        if not self.realtime:
            return True
        # Every sampled offer's row is the reference's: the Real-time query has written the backlog's
        # winners (those of the offers sampled, spread over the whole topic), whatever its status says.
        # An offer's row, once the reference's, stays so (the reference is its final winner): only the
        # others are read again. Reading all 500 every 0.1 s took about a core of Cassandra's, which
        # the side's drain then lacked (docs/benchmarks-log.md, 2026-12-05, fifth).
        if self.pending is None:
            self.pending = set(self.expect)
        table = f"{self.settings.cassandra.keyspace}.{self.tables['offer_latest']}"
        got = {
            r["offer_id"]: r for r in _rows(self.session, table, "offer_id", sorted(self.pending), first=True)
        }
        self.pending -= {
            offer
            for offer in self.pending
            if offer in got and all(got[offer].get(c) == v for c, v in self.expect[offer].items())
        }
        return not self.pending

    def views(self, offers: list[str], merchants: list[str]) -> tuple[list[dict], dict]:
        ks = self.settings.cassandra.keyspace
        latest = _rows(self.session, f"{ks}.{self.tables['offer_latest']}", "offer_id", offers, first=True)
        windowed = _rows(
            self.session, f"{ks}.{self.tables['merchant_offers_hourly']}", "merchant_id", merchants
        )
        view = next(v for v in self.pipeline.views if isinstance(v, WindowedView))
        return latest, _merge_epochs(windowed, view)

    def visible(self, view: str, keys: list[str]) -> set[str]:
        column = "offer_id" if view == "offer_latest" else "merchant_id"
        table = f"{self.settings.cassandra.keyspace}.{self.tables[view]}"
        return {r[column] for r in _rows(self.session, table, column, keys)}


class Quix(Side):
    def __init__(
        self, name: str, settings: Settings, topic: str, commit_interval: float, work: Path, log: Path
    ) -> None:
        self.name, self.settings, self.topic, self.log = name, settings, topic, log
        self.commit_interval = commit_interval
        self.keyspace = f"peer_{uuid.uuid4().hex[:8]}"
        self.group = f"peer-{uuid.uuid4().hex[:8]}"
        self.work = work
        self.session = connect(settings.cassandra)
        self.consumer = Consumer(
            {**settings.kafka.client_config(), "group.id": self.group, "enable.auto.commit": False}
        )

    def start(self) -> subprocess.Popen[bytes]:
        command = [
            str(peer_python()), str(PROJECT_ROOT / "bench" / "peer_quix.py"),
            "--broker", self.settings.kafka.bootstrap_servers, "--registry", self.settings.registry.url,
            "--topic", self.topic, "--group", self.group, "--keyspace", self.keyspace,
            "--cassandra-port", str(self.settings.cassandra.port),
            "--commit-interval", str(self.commit_interval), "--state-dir", str(self.work / "state"),
        ]  # fmt: skip
        return subprocess.Popen(
            command,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.work,
        )

    def processed_all(self, records: int) -> bool | None:
        topics = self.consumer.list_topics(timeout=10).topics
        names = [self.topic, *(t for t in topics if t.startswith(f"repartition__{self.group}--"))]
        parts = [TopicPartition(t, p) for t in names for p in topics[t].partitions]
        committed = self.consumer.committed(parts, timeout=10)
        if all(tp.offset < 0 for tp in committed):
            return None
        if len(names) < 2:
            return False
        ends = [self.consumer.get_watermark_offsets(tp, timeout=10)[1] for tp in parts]
        return all(tp.offset >= end for tp, end in zip(committed, ends, strict=True))

    def views(self, offers: list[str], merchants: list[str]) -> tuple[list[dict], dict]:
        latest = _rows(self.session, f"{self.keyspace}.offer_latest", "offer_id", offers)
        hourly = _rows(self.session, f"{self.keyspace}.merchant_offers_hourly", "merchant_id", merchants)
        return latest, {(r["merchant_id"], r["window_start"]): r for r in hourly}

    def visible(self, view: str, keys: list[str]) -> set[str]:
        column = "offer_id" if view == "offer_latest" else "merchant_id"
        return {r[column] for r in _rows(self.session, f"{self.keyspace}.{view}", column, keys)}


# --- one side, one round -----------------------------------------------------------------------


def one_run(
    side_name: str, base: Settings, records: list[dict], want: Any, args: argparse.Namespace, round_no: int
) -> dict[str, Any]:
    tag = f"{side_name[:4]}{round_no}{uuid.uuid4().hex[:5]}"
    settings = base.model_copy(
        update={
            "storage_root": f"{base.storage_root}/{tag}",
            "cassandra": base.cassandra.model_copy(update={"keyspace": f"peers_{tag}"}),
            "topic_prefix": f"peers-{tag}-",
        }
    )
    work = Path(settings.storage_root)
    work.mkdir(parents=True, exist_ok=True)
    if side_name == "lambdalake-store":
        settings = store_settings(settings, f"peers/{tag}")
    elif side_name == "lambdalake-secure":
        secured = secure_settings(base)
        cassandra = secured.cassandra.model_copy(update={"keyspace": settings.cassandra.keyspace})
        settings = secured.model_copy(
            update={"storage_root": settings.storage_root, "topic_prefix": settings.topic_prefix,
                    "cassandra": cassandra}
        )  # fmt: skip
        # As on a company's services: the admin deploys (topics, schemas, tables, grants), then the
        # producer sends as its own principal.
        deploy(settings, ["offers"], start_jobs=False)
    pipeline = configured_pipeline("offers", settings)
    producer = EventProducer(
        settings=settings.as_role("producer"), pipeline=pipeline, prepare=side_name != "lambdalake-secure"
    )
    for i in range(0, len(records), 10_000):
        producer.send_batch(records[i : i + 10_000])
    stats = producer.flush()
    assert stats.unacknowledged == 0 and stats.rejected == 0, stats
    log = work / "side.log"
    side: Side
    if side_name in ("lambdalake", "floor-beside-lambdalake", "lambdalake-store", "lambdalake-secure"):
        side = Lambdalake(settings, pipeline, log)
    elif side_name in ("lambdalake-realtime", "lambdalake-realtime-nowrite"):
        realtime = settings.model_copy(
            update={"speed": settings.speed.model_copy(update={"latest": "realtime"})}
        )
        side = Lambdalake(realtime, pipeline, log, write_latest=side_name == "lambdalake-realtime")
    elif side_name == "lambdalake-baseline":
        side = Lambdalake(settings, pipeline, log, root=Path(args.baseline))
    elif side_name == "lambdalake-realtime-baseline":
        realtime = settings.model_copy(
            update={"speed": settings.speed.model_copy(update={"latest": "realtime"})}
        )
        side = Lambdalake(realtime, pipeline, log, root=Path(args.baseline))
    else:
        interval = 5.0 if side_name == "quix-default" else args.tuned_commit
        side = Quix(side_name, settings, pipeline.topic.name, interval, work, log)
    sample = random.Random(round_no)
    offers = sample.sample(sorted(want[0]), SAMPLE)
    merchants = sample.sample(sorted({m for m, _ in want[1]}), min(SAMPLE, len({m for m, _ in want[1]})))
    if isinstance(side, Lambdalake):
        side.expect = {offer: want[0][offer] for offer in offers}
    t_start = time.perf_counter()
    machine_start = machine_cpu()
    job = side.start()
    rss = RssSampler(job.pid)
    first: float | None = None
    steady_from: float | None = None
    try:
        deadline = time.monotonic() + 900
        while True:
            done = side.processed_all(len(records))
            if done is not None and first is None:
                first = time.perf_counter()
            if done:
                break
            if job.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"{side_name} stopped or timed out; its log ends:\n{log.read_text()[-3000:]}"
                )
            time.sleep(0.1)
        t_done = time.perf_counter()
        # What bounds the drain: the side's own CPU and the whole machine's over the same time.
        drain_cpu_s = rss.cpu_seconds()
        machine_busy, machine_all = (b - a for a, b in zip(machine_start, machine_cpu(), strict=True))
        beside = floor_process(args.rate) if side_name == "floor-beside-lambdalake" else None
        if side_name == "lambdalake-realtime-nowrite":
            # A floor, not a speed layer: its latest views stay empty, so only the drain is measured.
            return drain_only(len(records), t_start, t_done, first, drain_cpu_s, machine_busy / machine_all)
        problems = differences(want, *side.views(offers, merchants), offers, merchants)
        if problems:
            raise SystemExit(f"{side_name} differs from the reference:\n" + "\n".join(problems))
        tables = {"latest": "offer_latest", "windowed": "merchant_offers_hourly"}
        # Steady state: the second half of the freshness run (the side caught up, Spark's one-shot
        # planning workers gone once a minute idle, a master dataset compaction round or more behind it).
        steady_from = time.monotonic() + args.seconds / 2
        fresh_t0, fresh_cpu0, fresh_machine0 = time.perf_counter(), rss.cpu_seconds(), machine_cpu()
        fresh = probe_freshness(
            producer,
            generate(
                "offers", int(args.rate * args.seconds), seed=12, mix=Mix(invalid=0, duplicates=0, late=0)
            ),
            rate=args.rate,
            probe_rate=args.probe_rate,
            # A new offer of a new merchant: visible only once this probe is processed.
            probe=lambda i, r: (
                f"probe-{tag}-{i}",
                {
                    **r,
                    "offer_id": f"probe-{tag}-{i}",
                    "merchant_id": f"probe-{tag}-{i}",
                    "updated_at": int(time.time() * 1000),
                },
            ),
            visible=lambda view, keys: side.visible(tables[view], keys),
            views=list(tables),
        )
        # What the freshness run's steady rate cost: the side's cores, and the machine's busy share
        # (the bench's own producer and probes, and the services, count in the machine's).
        busy, every = (b - a for a, b in zip(fresh_machine0, machine_cpu(), strict=True))
        fresh_cpu = {
            "side_cores": (rss.cpu_seconds() - fresh_cpu0) / (time.perf_counter() - fresh_t0),
            "machine_busy": busy / every,
        }
        floor_beside = floor_result(beside) if beside is not None else None
    finally:
        memory = rss.stop(steady_from)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGTERM)
        try:
            job.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    return {
        **drain_only(len(records), t_start, t_done, first, drain_cpu_s, machine_busy / machine_all),
        "freshness": fresh,
        "freshness_cpu": fresh_cpu,
        "rss": memory,
        "reference_checked": {"offers": len(offers), "merchants": len(merchants)},
        "floor_beside": floor_beside,
    }


def drain_only(
    events: int, t_start: float, t_done: float, first: float | None, cpu_s: float, busy: float
) -> dict[str, Any]:
    """A side's drain figures, in :func:`one_run`'s shape (alone: no freshness, no memory)."""
    return {
        "events": events,
        "seconds_from_start": t_done - t_start,
        "events_per_s_from_start": events / (t_done - t_start),
        "seconds_after_first_progress": t_done - (first or t_start),
        "freshness": {},
        "rss": None,
        "drain_cpu": {
            "side_cpu_s": cpu_s,
            "side_cores": cpu_s / (t_done - t_start),
            "side_cpu_ms_per_1k_events": 1e6 * cpu_s / events,
            "machine_busy": busy,
            "machine_cores": os.cpu_count(),
        },
        "floor_beside": None,
    }


def floor_process(rate: float) -> subprocess.Popen[str]:
    """The Kafka-to-Kafka Real-time query (:mod:`bench.realtime_floor`) started on the running bench
    services, in a process of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", "bench.realtime_floor", "--services-running", "--rate", str(rate)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=PROJECT_ROOT,
    )  # fmt: skip


def floor_result(process: subprocess.Popen[str]) -> dict[str, float]:
    out, _ = process.communicate(timeout=600)
    if process.returncode != 0:
        raise SystemExit(f"bench.realtime_floor exited with {process.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def floor(rate: float) -> dict[str, float]:
    """The Kafka-to-Kafka Real-time query's latency on the running bench services, alone."""
    return floor_result(floor_process(rate))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", type=float, default=1000, help="events/s during the freshness run")
    parser.add_argument(
        "--seconds", type=float, default=120, help="length of the freshness run (its second half: steady RSS)"
    )
    parser.add_argument("--probe-rate", type=float, default=5, help="probes/s during the freshness run")
    parser.add_argument("--tuned-commit", type=float, default=0.5, help="quix-streams' tuned commit interval")
    parser.add_argument(
        "--sides",
        default=",".join(SIDES),
        help=f"a comma-separated subset of {SIDES + OTHER_SIDES[:2]} to run",
    )
    parser.add_argument(
        "--baseline", help="a checkout of another revision: its speed job runs as side lambdalake-baseline"
    )
    parser.add_argument(
        "--floor", action="store_true",
        help="each round, a Kafka-to-Kafka Real-time query's latency at --rate first (bench.realtime_floor)",
    )  # fmt: skip
    parser.add_argument(
        "--warm-up", action="store_true",
        help="first a lambdalake side not counted (its drain, 5 s of freshness): the services and the page "
        "cache warm, so the first counted side does not start cold",
    )  # fmt: skip
    args = parser.parse_args()
    peer_python()
    base = bench_settings()
    records = list(generate("offers", args.events, seed=21, mix=Mix(invalid=0, duplicates=0.02, late=0)))
    want = reference(records)
    # --sides lambdalake-baseline,lambdalake puts the baseline first (the order rotates each round).
    # A side of the baseline named already (lambdalake-realtime-baseline) stands for it.
    named = any(s.endswith("-baseline") for s in args.sides.split(","))
    extra = ["lambdalake-baseline"] if args.baseline and not named else []
    sides = list(dict.fromkeys(args.sides.split(",") + extra))
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    floors: list[dict] = []
    drains: list[dict] = []
    # The store side's lake (bronze, checkpoints, status, coverage) on the bench's object store.
    on_store = store_settings(base, "peers") if "lambdalake-store" in sides else None
    store = running(on_store, only=["object-store"]) if on_store is not None else contextlib.nullcontext()
    secured = running(secure_settings(base)) if "lambdalake-secure" in sides else contextlib.nullcontext()
    with running(base), store, secured:
        if on_store is not None:
            use(on_store)  # this process's readers of the side's status file
        if args.warm_up:
            warm = one_run(
                "lambdalake", base, records, want, argparse.Namespace(**{**vars(args), "seconds": 5}), 0
            )
            print(f"warm-up lambdalake (not counted): {warm['events_per_s_from_start']:,.0f} ev/s from start",
                  flush=True)  # fmt: skip
        for round_no in range(args.rounds):
            if args.floor:
                floors.append(floor(args.rate))
                low = floors[-1]
                print(f"round {round_no + 1} Kafka-to-Kafka Real-time floor: p50 {low['p50_s'] * 1000:.1f} "
                      f"ms p99 {low['p99_s'] * 1000:.1f} ms", flush=True)  # fmt: skip
                if "lambdalake-realtime" in sides:
                    drains.append(realtime_drain.run(events=args.events))
                    for mode, d in drains[-1].items():
                        print(f"round {round_no + 1} the Real-time latest query alone, {mode}: "
                              f"{d['events_per_s']:,.0f} ev/s, {d['cpu_ms_per_1k_events']:,.0f} CPU ms "
                              f"per 1k events, machine {d['machine_busy']:.0%} busy", flush=True)  # fmt: skip
            order = sides[round_no % len(sides) :] + sides[: round_no % len(sides)]
            for name in order:
                result = one_run(name, base, records, want, args, round_no)
                runs[name].append(result)
                fresh = ", ".join(
                    f"{k} p50 {f['p50_s']:.2f} p99 {f['p99_s']:.2f}" for k, f in result["freshness"].items()
                )
                cpu = result["drain_cpu"]
                fresh += (f"; drain {cpu['side_cores']:.2f} cores, {cpu['side_cpu_ms_per_1k_events']:,.0f} "
                          f"CPU ms per 1k events, machine {cpu['machine_busy']:.0%} busy")  # fmt: skip
                if result.get("freshness_cpu"):
                    steady = result["freshness_cpu"]
                    fresh += (f"; at {args.rate:,.0f} ev/s {steady['side_cores']:.2f} cores, machine "
                              f"{steady['machine_busy']:.0%} busy")  # fmt: skip
                if result["floor_beside"]:
                    low = result["floor_beside"]
                    fresh += (
                        f"; floor beside p50 {low['p50_s'] * 1000:.1f} ms p99 {low['p99_s'] * 1000:.1f} ms"
                    )
                memory = result["rss"]
                print(
                    f"round {round_no + 1} {name}: {result['events_per_s_from_start']:,.0f} ev/s from "
                    f"start ({result['seconds_from_start']:.1f} s), "
                    + (
                        f"rss median {memory['median_mb']:,.0f} MB max {memory['max_mb']:,.0f} MB steady "
                        f"{memory['steady_mb']:,.0f} MB (PSS {memory['steady_pss_mb']:,.0f} MB), "
                        if memory
                        else ""
                    )
                    + fresh.lstrip("; "),
                    flush=True,
                )
    shutil.rmtree(base.storage_root, ignore_errors=True)
    # A run of some sides only (tuning one) must not overwrite the comparison of all three.
    name = "peers" if set(SIDES) <= set(sides) else "peers-" + "-".join(sides)
    path = write_result(
        name,
        {
            "events": args.events,
            "rate": args.rate,
            "seconds": args.seconds,
            "tuned_commit_interval_s": args.tuned_commit,
            "warm_up": args.warm_up,
            "peer": PEER_PACKAGES[0],
            "spark_conf": base.spark.conf,
            "runs": runs,
            "kafka_to_kafka_realtime_floor": floors,
            "realtime_latest_query_alone": drains,
        },
    )
    print(f"-> {path}")


if __name__ == "__main__":
    main()
