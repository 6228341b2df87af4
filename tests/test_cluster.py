"""Three of each on one machine: three KRaft brokers, three Cassandra nodes and a Spark standalone
master with two workers on loopback, and the faults a cluster survives.

The cluster is described by nothing but the settings a user points at their own clusters (a
bootstrap list, contact points, a ``spark://`` master; replication and consistency at their
defaults), and each fault is checked against a reference computed from what the topic holds.

The cluster is started once for the module, and so is one speed job (``offers`` with 10-second
epochs): each fault test produces its own events into its topic, injects its fault while the job
runs, and checks every view against the reference of everything the topic holds. A test finding the
job stopped starts it again, so each still runs alone. A Spark application on the standalone cluster
costs a driver, an executor JVM and its Python workers: one per fault was most of the module's time.

The job keeps its lake wholly on the embedded object store, as on real hosts, where the Spark
workers share no disk (each has a work folder of its own, and nothing is read from another's): the
churn soak, which kills the worker running its executor, runs on it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pyarrow.fs as pafs
import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from lambdalake.cassandra.session import connect
from lambdalake.infra.services import EmbeddedService, running
from lambdalake.pipeline import Pipeline, WindowedView
from lambdalake.produce.generator import Mix, generate
from lambdalake.produce.producer import EventProducer
from lambdalake.serving.client import ServingClient
from lambdalake.settings import QUICK_JIT, Settings
from tests.conftest import isolated, pipeline_named, port, run_cli
from tests.helpers import (
    HOSTS,
    kcat_count,
    kill_minus_nine,
    node,
    pipelines_folder,
    serving_app,
    stop_job,
    store_clients,
)
from tests.reference import differences, merged_differences, stored_keys, topic_events
from tests.test_restart_one import output, restart_alone
from tests.test_speed_faults import start_job, wait_equal, wait_for_log

pytestmark = [pytest.mark.services, pytest.mark.slow]

#: The object store's bucket of the second job's lake.
LAKE_BUCKET = "lake-cluster"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    state = tmp_path_factory.mktemp("cluster")
    settings = Settings(
        kafka={"bootstrap_servers": ",".join(f"{h}:{port(29092)}" for h in HOSTS), "heap": "384M",
               "jvm_options": QUICK_JIT},
        registry={"url": f"http://127.0.0.1:{port(28081)}"},
        cassandra={"contact_points": HOSTS, "port": port(29042), "storage_port": port(27000),
                   "keyspace": "lambdalake_cluster", "heap": "768M", "lease_ttl_s": 15,
                   "jvm_options": QUICK_JIT},
        spark={"master": f"spark://127.0.0.1:{port(27077)}"},
        speed={"trigger_s": 2},  # as the other tests' (tests/conftest.py): a trickle, not a core's worth
        state_dir=state,
        storage_root=str(state / "storage"),
        object_store={"endpoint": f"http://127.0.0.1:{port(29900)}"},
    )  # fmt: skip
    # The lake of the module's second job: the store `up` starts for an s3:// root.
    lake = settings.model_copy(update={"storage_root": f"s3://{LAKE_BUCKET}/cluster"})
    # This process's own readers of the lake (delta-rs, pyarrow) find the store.
    with running(settings), running(lake, only=["object-store"]), store_clients(lake):
        yield settings


@dataclass
class SharedJob:
    """The module's speed job of ``offers`` on the standalone cluster, and the pipeline it runs."""

    settings: Settings
    pipeline: Pipeline
    log: Path
    process: subprocess.Popen | None = None
    starts: int = 0
    checkpoints: str = field(init=False)

    def __post_init__(self) -> None:
        from lambdalake.layout import checkpoints_path

        self.checkpoints = checkpoints_path(self.settings.storage_root, self.pipeline.name)

    def first_batch_done(self) -> bool:
        """Whether a query of the job has committed its first micro-batch (on the disk or the store)."""
        filesystem, path = pafs.FileSystem.from_uri(self.checkpoints)
        found = filesystem.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
        return any(info.path.endswith("/commits/0") for info in found)

    def ensure(self) -> None:
        """Start the job unless it runs, and wait for its first micro-batch (it starts the executor and
        its Python workers)."""
        if self.process is not None and self.process.poll() is None:
            return
        self.process = start_job(self.settings, self.pipeline.name, self.log)
        self.starts += 1
        wait_for_log(self.log, "offers-main started", count=self.starts, timeout=300)
        deadline = time.monotonic() + 300
        while not self.first_batch_done():
            assert time.monotonic() < deadline and self.running(), self.log.read_text()[-3000:]
            time.sleep(0.5)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.process is not None:
            stop_job(self.process)
            self.process = None


def shared_job(cluster: Settings, folder: Path, *, on_store: bool) -> SharedJob:
    """A job of ``offers`` on a topic of its own, its lake under ``folder`` or on the module's store."""
    unique = uuid.uuid4().hex[:8]
    base = isolated(cluster, folder, unique)
    if on_store:
        base = base.model_copy(update={"storage_root": f"s3://{LAKE_BUCKET}/cluster/{unique}"})
    pipeline = pipeline_named(base, "offers", topic=f"offers-{unique}", epoch="10 seconds", grace="1 second")
    pipelines = pipelines_folder(folder, pipeline)
    # The module's tests add to one topic: a batch may find several times the rows of the last one.
    suite = json.loads((pipelines / "offers.expectations.json").read_text())
    (pipelines / "offers.expectations.json").write_text(json.dumps({**suite, "row_count_tolerance": 1000}))
    settings = base.model_copy(update={"pipelines_dir": pipelines})
    EventProducer(settings=settings, pipeline=pipeline)  # topics and schemas before the job
    return SharedJob(settings=settings, pipeline=pipeline, log=folder / "speed.log")


@pytest.fixture(scope="module")
def offers(cluster: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedJob]:
    """The module's job (the churn soak's), its lake wholly on the object store as on real hosts,
    where the Spark workers share no disk; a micro-batch every 5 s: the soak holds a core for ten
    minutes, beside the suite's other workers (a micro-batch costs about a CPU-second however few its
    records: 2 s apart, the job took 0.2 of a core; docs/benchmarks-log.md)."""
    settings = cluster.model_copy(update={"speed": cluster.speed.model_copy(update={"trigger_s": 5})})
    job = shared_job(settings, tmp_path_factory.mktemp("offers"), on_store=True)
    try:
        yield job
    finally:
        job.stop()


def produce(settings: Settings, pipeline, n: int, rate: float, seed: int) -> threading.Thread:
    """Send ``n`` generated events at about ``rate``/s in a thread; ``thread.stats`` holds the
    producer's counts (acknowledged, failed) once it ends."""
    result: dict = {}

    def run() -> None:
        producer = EventProducer(settings=settings, pipeline=pipeline, prepare=False)
        t0 = time.monotonic()
        try:
            for i, record in enumerate(generate(pipeline.name, n, seed=seed, mix=Mix(duplicates=0.03))):
                if stop.is_set():
                    break
                producer.send(record)
                if i % 250 == 0 and (ahead := i / rate - (time.monotonic() - t0)) > 0:
                    time.sleep(ahead)
        finally:
            result["stats"] = producer.flush(timeout=300)

    stop = threading.Event()
    thread = threading.Thread(target=run, daemon=True)
    thread.result = result  # type: ignore[attr-defined]
    thread.stop = stop  # type: ignore[attr-defined]  # set: no more sends (a failed test's cleanup)
    thread.start()
    return thread


def test_the_cluster_replicates_by_three_and_refuses_a_factor_it_cannot_hold(
    cluster: Settings, tmp_path: Path, unique: str
) -> None:
    status = run_cli(cluster, "status", "--services", "--json")
    assert status.returncode == 0, status.stdout.decode() + status.stderr.decode()
    names = {s["name"] for s in json.loads(status.stdout)}
    assert names == {"broker-1", "broker-2", "broker-3", "registry", "cassandra-1", "cassandra-2",
                     "cassandra-3", "spark-master", "spark-worker-1", "spark-worker-2"}  # fmt: skip
    settings = isolated(cluster, tmp_path, unique).model_copy(update={"topic_prefix": f"{unique}-"})
    pipeline = pipeline_named(settings, "offers")
    topics = run_cli(settings, "topics", "offers", "--apply")
    assert topics.returncode == 0, topics.stdout.decode() + topics.stderr.decode()
    admin = AdminClient(settings.kafka.client_config())
    meta = admin.list_topics(timeout=10).topics
    for topic in (pipeline.topic.name, pipeline.topic.dlq, "_schemas"):
        assert {len(p.replicas) for p in meta[topic].partitions.values()} == {3}, topic
        config = next(iter(admin.describe_configs([ConfigResource("topic", topic)]).values())).result()
        assert config["min.insync.replicas"].value == "2", topic
    session = connect(settings.cassandra)
    from lambdalake.cassandra.session import refresh_metadata
    from lambdalake.cassandra.tables import create_keyspace

    create_keyspace(session, settings.cassandra)
    refresh_metadata(session, settings.cassandra.keyspace)
    replication = session.cluster.metadata.keyspaces[settings.cassandra.keyspace].replication_strategy
    assert "NetworkTopologyStrategy" in type(replication).__name__ and "datacenter1': '3'" in str(
        replication.export_for_schema()
    ), replication.export_for_schema()
    # Above the nodes there are: refused with the fix, before anything is created.
    four = settings.model_copy(update={
        "kafka": settings.kafka.model_copy(update={"replication_factor": 4}), "topic_prefix": f"{unique}-4-",
    })  # fmt: skip
    refused = run_cli(four, "topics", "offers")
    output = refused.stdout.decode() + refused.stderr.decode()
    assert refused.returncode != 0 and "replication factor 4" in output and "3 broker(s)" in output, output
    assert f"{unique}-4-offers" not in admin.list_topics(timeout=10).topics
    wide = settings.cassandra.model_copy(
        update={
            "keyspace": f"w_{unique}",
            "replication": {"class": "NetworkTopologyStrategy", "datacenter1": 4},
        }
    )
    refused = run_cli(settings.model_copy(update={"cassandra": wide}), "deploy", "--pipeline", "offers")
    output = refused.stdout.decode() + refused.stderr.decode()
    assert refused.returncode != 0 and "replication factor 4" in output and "3 Cassandra" in output, output


def test_a_replay_of_a_range_while_a_broker_is_down(cluster: Settings, tmp_path: Path, unique: str) -> None:
    """After losing an epoch of the master dataset and the windowed speed rows, `lambdalake replay` reads its
    range from the two brokers left (each partition has replicas there), archives what the master dataset
    lacks once and recomputes every cell of the closed epochs. Placed before the tests of the module's speed
    job, which took a share of the cores while idling beside it."""
    from deltalake import DeltaTable

    from lambdalake.layout import master_path
    from lambdalake.views import speed_table
    from tests.helpers import master_coordinates, pipelines_folder

    base = isolated(cluster, tmp_path, unique)
    pipeline = pipeline_named(base, "offers", topic=f"offers-{unique}", epoch="10 seconds", grace="1 second")
    settings = base.model_copy(update={"pipelines_dir": pipelines_folder(tmp_path, pipeline)})
    producer = EventProducer(settings=settings, pipeline=pipeline)
    t0 = time.monotonic()
    for i, record in enumerate(generate("offers", 4000, seed=36, mix=Mix(duplicates=0.05, late=0.05))):
        producer.send(record)
        if i % 1000 == 999:  # over several ingest epochs
            time.sleep(max(0.0, (i + 1) / 250 - (time.monotonic() - t0)))
    assert producer.flush().unacknowledged == 0
    time.sleep(12)  # the events' ingest epochs close
    once = run_cli(settings, "speed", "run", "offers", "--once")
    assert once.returncode == 0, (once.stdout + once.stderr).decode()[-3000:]
    events, _ = topic_events(settings, pipeline)
    want = sorted(zip(events["_partition"], events["_offset"], strict=True))
    assert sorted(master_coordinates(settings, pipeline)) == want
    epochs = sorted(set(events["_ts"] // pipeline.layers.epoch_ms))
    assert len(epochs) >= 2, epochs
    # Lost: an epoch of the master dataset, and every windowed speed row.
    DeltaTable(master_path(settings.storage_root, pipeline.name)).delete(f"_epoch = {epochs[0]}")
    windowed = pipeline.model_copy(
        update={"views": [v for v in pipeline.views if isinstance(v, WindowedView)]}
    )
    session = connect(settings.cassandra)
    for view in windowed.views:
        session.execute(f'TRUNCATE "{settings.cassandra.keyspace}"."{speed_table(pipeline, view)}"')
    assert len(master_coordinates(settings, pipeline)) < len(want)
    victim = node(settings, "broker-2")
    kill_minus_nine(victim)
    try:
        window = [
            "--from-timestamp",
            str(int(events["_ts"].min())),
            "--to-timestamp",
            str(int(events["_ts"].max()) + 1),
        ]
        result = run_cli(settings, "replay", "offers", *window, "--no-run-batch")
        assert result.returncode == 0, (result.stdout + result.stderr).decode()[-3000:]
        assert sorted(master_coordinates(settings, pipeline)) == want
        assert differences(settings, windowed, events) == []
    finally:
        victim.start()


@dataclass
class Answers:
    """What ``hammer``'s clients were answered."""

    count: int = 0
    server_errors: list[tuple[int, str]] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    #: (when, status) of every answer that was not a 200.
    others: list[tuple[float, int]] = field(default_factory=list)

    def longest_stretch(self, code: int) -> float:
        """The longest stretch of ``code`` answers: from the first to the last of a run of them
        with less than a second between one and the next."""
        times = sorted(t for t, c in self.others if c == code)
        longest, start = 0.0, None
        for i, t in enumerate(times):
            if start is None or t - times[i - 1] > 1.0:
                start = t
            longest = max(longest, t - start)
        return round(longest, 1)


@contextlib.contextmanager
def hammer(url: str, paths: list[str], *, clients: int, pause_s: float = 0.1) -> Iterator[Answers]:
    """``clients`` threads querying ``paths`` in turn over HTTP until the block ends, each pausing
    ``pause_s`` between its queries (a client's think time: without it 20 threads took the cores
    the services and the other test workers need); every 5xx (with its body) and every latency kept."""
    answers = Answers()
    stop = threading.Event()

    def client(offset: int) -> None:
        with httpx.Client(headers={"Authorization": "Bearer t"}, timeout=30) as http:
            i = offset
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    response = http.get(url + paths[i % len(paths)])
                    code, body = response.status_code, response.text[:300]
                except httpx.HTTPError as exc:  # a reset connection is a server error too
                    code, body = 599, repr(exc)
                answers.latencies.append(time.perf_counter() - t0)
                answers.count += 1
                if code != 200:
                    answers.others.append((time.monotonic(), code))
                if code >= 500:
                    answers.server_errors.append((code, body))
                i += 1
                stop.wait(pause_s)

    threads = [threading.Thread(target=client, args=(i * 7,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    try:
        yield answers
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)


def _in_sync(settings: Settings, topics: list[str], timeout: float = 180) -> None:
    """Wait until every partition of ``topics`` has all its replicas in sync again."""
    admin = AdminClient(settings.kafka.client_config())
    deadline = time.monotonic() + timeout
    while True:
        meta = admin.list_topics(timeout=10).topics
        behind = [
            f"{t}/{p.id}"
            for t in topics
            for p in meta[t].partitions.values()
            if len(p.isrs) < len(p.replicas)
        ]
        if not behind:
            return
        assert time.monotonic() < deadline, f"replicas not back in sync: {behind}"
        time.sleep(1)


class BatchRuns:
    """`lambdalake batch run` of one pipeline, again and again in a thread (``pause_s`` between a run's
    end and the next one's start) until :meth:`stop`; what each took, and each failure's output."""

    def __init__(self, settings: Settings, pipeline: str, pause_s: float) -> None:
        self.settings, self.pipeline, self.pause_s = settings, pipeline, pause_s
        self.took: list[float] = []
        self.failures: list[str] = []
        #: ``last_batch`` of `status --json` after each run that passed.
        self.last: list[dict] = []
        self._stop = threading.Event()
        self._wake = threading.Event()  # ends a pause early
        self._running = threading.Lock()  # held through each run
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self._runs()
        except Exception as exc:  # recorded, so the test fails on it (a thread's error is only a warning)
            self.failures.append(f"the batch runner stopped: {exc!r}")

    def _runs(self) -> None:
        while not self._stop.is_set():
            with self._running:
                t0 = time.monotonic()
                result = run_cli(self.settings, "batch", "run", self.pipeline)
                if result.returncode != 0:
                    self.failures.append((result.stdout + result.stderr).decode()[-3000:])
                else:
                    mine = self._status()
                    if mine is None:
                        return
                    self.last.append(mine["last_batch"] or {})
                    self.took.append(time.monotonic() - t0)
            self._wake.wait(self.pause_s)
            self._wake.clear()

    def _status(self) -> dict | None:
        """The pipeline's entry in `status --json`, or None with a failure recorded. A node of a kind
        it is read from may be restarting as the run ends (status names the kind then): asked again."""
        for _ in range(6):
            shown = run_cli(self.settings, "status", "--json").stdout
            mine = [p for p in json.loads(shown)["pipelines"] if p["pipeline"] == self.pipeline]
            if mine:
                return mine[0]
            time.sleep(5)
        self.failures.append(f"`status --json` after a published run, six times in 30 s: {shown.decode()}")
        return None

    def between_runs(self, action: Callable[[], None], *, wake: bool = True) -> int:
        """Do ``action`` once the run under way (if any) has ended, then (``wake``) start the next run
        at once; returns how many runs had passed before it."""
        with self._running:
            action()
            seen = len(self.last)
        if wake:
            self._wake.set()
        return seen

    def start(self) -> None:
        """Start the runs (again: nothing). A wake from before (between_runs, ahead of the first run)
        is dropped: the first run starts now anyway, and the wake would start a second one after it."""
        if self._thread.ident is None:
            self._wake.clear()
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join(1200)

    def wait_for_one_without(self, host: str, seen: int, timeout: float = 1200) -> None:
        """Wait until a run after the first ``seen`` publishes while ``host`` is down, and check that
        it says so (in `status`, as JSON and as text)."""
        deadline = time.monotonic() + timeout
        while not any(host in last.get("cassandra_down", []) for last in self.last[seen:]):
            assert not self.failures, self.failures[0]
            assert time.monotonic() < deadline, f"no batch published while {host} was down"
            time.sleep(2)
        last = next(last for last in self.last[seen:] if host in last.get("cassandra_down", []))
        assert last["cassandra_down"] == [host], last
        shown = run_cli(self.settings, "status").stdout.decode()
        assert f"published with Cassandra node(s) {host} down" in shown, shown


#: The churn soak's length in seconds, and its seed (random when unset; the report names it, so a
#: run can be repeated). `make soak` and `bench.churn` run it for 30 minutes.
CHURN_S = float(os.environ.get("LAMBDALAKE_CHURN_S", "600"))
#: How long a kill that waits for a batch to publish without the node may take: the run under way
#: ends, the next starts at once (BatchRuns.between_runs) and runs 1.5-2.5 minutes on the cluster.
PUBLISH_WAIT_S = 300
CHURN_SEED = int(os.environ.get("LAMBDALAKE_CHURN_SEED") or random.randrange(1 << 30))


def test_a_churn_soak_answers_every_query_without_a_server_error_and_exactly(offers: SharedJob) -> None:
    """CHURN_S seconds of churn on the three-node cluster: a producer at a steady rate (acks=all,
    idempotent), the speed job, a batch run every few minutes and 20 HTTP clients querying every
    key of every view. Meanwhile: first a Cassandra node killed with -9 as the batch runs begin,
    returning after the first one published without it (the batch says so in `status`); then, in a
    random order that has each at least once, a partition leader killed with -9 and restarted, a
    Cassandra node killed with -9 and restarted, the Spark worker running the job's executor killed
    with -9 (the master gives the application a new one on the other worker), the brokers
    restarted in turn as an operator rolls them (`down --only`, `up --only`), and the registry and
    the Spark master restarted alone so (issue 77: one node of each kind, its needs outside the
    selection probed; the master takes back its workers and the job). A leader, a Cassandra node
    or a Spark worker killed with -9 comes back with `up --only` (the node killed before a publish
    is started by the test itself once the publish has run without it).

    No query is answered 5xx (a quorum of each service is up all through). Afterwards every
    acknowledged record is in the topic once (kcat), and every rejected one in the dead-letter topic;
    each Cassandra node read alone at ONE holds the speed views exactly (hinted handoff replayed
    what a killed node missed); and every key's merged answer equals the reference of the topic.
    The report (queries, 503s, p99 latency with and without churn, kills, records) is printed and
    written to LAMBDALAKE_CHURN_REPORT when set (``bench.churn``)."""
    offers.ensure()
    settings, pipeline = offers.settings, offers.pipeline
    rng = random.Random(CHURN_SEED)
    topic = pipeline.topic.name
    before, dlq_before = kcat_count(settings, topic), kcat_count(settings, pipeline.topic.dlq)
    rate = 40.0
    sender = produce(settings, pipeline, int(rate * (CHURN_S + 90)), rate=rate, seed=CHURN_SEED % 1000)
    try:
        churn(offers, sender, rng, before, dlq_before)
    finally:  # a failure here leaves no producer sending into the module's next tests
        sender.stop.set()  # type: ignore[attr-defined]
        sender.join(300)


def churn(
    offers: SharedJob, sender: threading.Thread, rng: random.Random, before: int, dlq_before: int
) -> None:
    """The soak's churn and its checks, while ``sender`` produces."""
    settings, pipeline = offers.settings, offers.pipeline
    topic = pipeline.topic.name
    topics = [topic, pipeline.topic.dlq, "_schemas"]
    deadline = time.monotonic() + 300
    while len(stored_keys(settings, pipeline, pipeline.views[-1])) < 10:  # keys to query, every view
        assert time.monotonic() < deadline, "the speed job wrote no rows"
        time.sleep(2)
    paths = [
        f"/v1/pipelines/{pipeline.name}/views/{view.name}/keys/{','.join(map(str, key))}"
        for view in pipeline.views
        for key in sorted(stored_keys(settings, pipeline, view))[:20]
    ]
    kills: list[str] = []
    # A run on the cluster takes 1.5-3 minutes here (about 40 CPU-seconds): one starts every six
    # minutes or so, two in the ten minutes, and one more for each further kill that waits for a
    # publish (it ends the pause at once: between_runs).
    batches = BatchRuns(settings, pipeline.name, pause_s=300)
    apps_before = executor_apps(settings)
    # The speed job's application (the oldest running) has its executor on a worker.
    state = node(settings, "spark-worker-1").cluster_state()
    assert isinstance(state, dict) and state["activeapps"], state
    speed_app = min(state["activeapps"], key=lambda a: a["starttime"])["id"]
    assert speed_app in apps_before, (state, apps_before)

    def kill_and_restart(victim: EmbeddedService, pause: float) -> None:
        """kill -9, then `up --only` it, as an operator brings a crashed node back while the rest run."""
        kill_minus_nine(victim)
        try:
            time.sleep(pause)
            up = run_cli(settings, "up", "--only", victim.name, timeout=300)
            assert up.returncode == 0 and "started in" in output(up), output(up)
        finally:  # the module's next tests need the node, whatever failed here
            victim.start()
        if victim.kind == "broker":
            _in_sync(settings, topics)

    def kill_a_leader() -> None:
        meta = AdminClient(settings.kafka.client_config()).list_topics(topic, timeout=10)
        partition = rng.choice(sorted(meta.topics[topic].partitions.values(), key=lambda p: p.id))
        victim = node(settings, f"broker-{partition.leader}")
        kills.append(f"{victim.name} (a partition leader)")
        kill_and_restart(victim, 8)

    def kill_cassandra() -> None:
        victim = node(settings, rng.choice(["cassandra-1", "cassandra-2", "cassandra-3"]))
        kills.append(victim.name)
        kill_and_restart(victim, 12)

    def kill_cassandra_while_a_batch_publishes() -> None:
        victim = node(settings, rng.choice(["cassandra-2", "cassandra-3"]))
        kills.append(f"{victim.name} (returning after a publish without it)")
        # Killed between two runs, so the next one runs, and publishes, without it from its start
        # (a run the kill met half way may have looked before it and publish as if all were up).
        seen = batches.between_runs(lambda: kill_minus_nine(victim))
        batches.start()  # the soak's first action: its first run is the one without the node
        try:
            batches.wait_for_one_without(victim.host, seen)
        finally:  # the module's next tests need the node, whatever failed here
            victim.start()

    def kill_the_busy_spark_worker() -> None:
        workers = [node(settings, "spark-worker-1"), node(settings, "spark-worker-2")]
        apps = workers[0].cluster_state()
        assert isinstance(apps, dict) and apps["activeapps"], apps
        # The speed job's application: the oldest (a batch run beside it is an application too).
        app = min(apps["activeapps"], key=lambda a: a["starttime"])["id"]
        busy = [w for w in workers if list((settings.state_dir / w.name / "work").glob(f"{app}/*/stderr"))]
        victim = busy[-1] if busy else rng.choice(workers)  # the newest executor's, when both had one
        kills.append(victim.name + (" (running the executor)" if busy else ""))
        kill_and_restart(victim, 5)

    def roll_the_brokers() -> None:
        for i in (1, 2, 3):  # `down --only` and `up --only` of each in turn (issue 77), its needs running
            restart_alone(settings, f"broker-{i}")
            _in_sync(settings, topics)
        kills.append("brokers rolled")

    def restart_the_registry_and_the_master_alone() -> None:
        """`down --only` / `up --only` of the registry, then of the Spark master between two batch
        runs (a run starting while no master answers would fail to register, as it would anywhere):
        the master takes back its workers and the running speed job (recovery)."""
        restart_alone(settings, "registry")
        batches.between_runs(lambda: restart_alone(settings, "spark-master"), wake=False)
        deadline = time.monotonic() + 120
        while speed_app not in active_apps(settings):
            assert time.monotonic() < deadline, node(settings, "spark-master").cluster_state()
            time.sleep(2)
        kills.append("registry and Spark master restarted alone")

    actions: list[Callable[[], None]] = [
        kill_a_leader,
        kill_cassandra,
        kill_cassandra_while_a_batch_publishes,
        kill_the_busy_spark_worker,
        roll_the_brokers,
        restart_the_registry_and_the_master_alone,
    ]
    # 20 clients, each waiting a second between its queries (~20 queries/s): the soak shares the
    # machine's two cores with the cluster and the suite's other workers.
    with serving_app(settings, token="t") as url, hammer(url, paths, clients=20, pause_s=1.0) as answers:
        time.sleep(30)  # queries without churn first: the latency to compare with
        quiet = len(answers.latencies)
        t0 = time.monotonic()
        # The batch runs go one after another beside the churn (a batch here takes minutes). The
        # first is the one that publishes with a Cassandra node down, from its start: so no run is
        # waited for before the kill; then every other action in a random order.
        order = [actions.index(kill_cassandra_while_a_batch_publishes)]
        order += rng.sample([i for i in range(len(actions)) if i not in order], len(actions) - 1)
        try:
            # A round of every action at least, then more while time is left: the churn stops at
            # the first action's end past CHURN_S (finishing the round overshot it by up to 5 minutes).
            for done in itertools.count(1):
                action = actions[order.pop(0)]
                late = done > 1 and CHURN_S - (time.monotonic() - t0) < PUBLISH_WAIT_S
                if late and action is kill_cassandra_while_a_batch_publishes:
                    # It waits for a batch to run and publish (minutes): begun this late, it would run
                    # the churn that much past its length. The first action was one of it already.
                    action = kill_cassandra
                action()
                if done >= len(actions) and time.monotonic() - t0 >= CHURN_S:
                    break
                # Each restart costs its node's start-up (a Cassandra node 10-15 CPU-seconds, a roll
                # three brokers'): 20-40 s apart, a ten-minute churn still runs every action.
                time.sleep(rng.uniform(20, 40))
                order = order or rng.sample(range(len(actions)), len(actions))
        finally:  # the module's next tests want the cluster to themselves
            batches.stop()
        churned = time.monotonic() - t0
    sender.join(900)
    stats = sender.result["stats"]  # type: ignore[attr-defined]
    assert stats.unacknowledged == 0 and stats.acked > 0, stats
    in_topic = kcat_count(settings, topic) - before
    assert offers.running(), offers.log.read_text()[-3000:]
    assert wait_equal(settings, pipeline, timeout=600) == [], offers.log.read_text()[-3000:]
    events, _ = topic_events(settings, pipeline)
    deadline = time.monotonic() + 180
    alone = {h: ["not read"] for h in HOSTS}
    while any(alone.values()) and time.monotonic() < deadline:
        alone = {h: differences(settings, pipeline, events, host=h) for h in HOSTS}
        time.sleep(5)
    problems = merged_differences(settings, ServingClient(settings=settings), {pipeline.name: pipeline})
    report = {
        "seed": CHURN_SEED,
        "churn_s": round(churned),
        "queries": answers.count,
        "server_errors": len(answers.server_errors),
        "503": sum(1 for code, _ in answers.server_errors if code == 503),
        "longest_503_stretch_s": answers.longest_stretch(503),
        # What each kind of 503 said (its cause), to tell a replica's lag from a quorum lost.
        "503_causes": sorted({body[:200] for code, body in answers.server_errors if code == 503})[:5],
        "p99_quiet_ms": round(percentile(answers.latencies[:quiet], 99) * 1000, 1),
        "p99_churn_ms": round(percentile(answers.latencies[quiet:], 99) * 1000, 1),
        "kills": kills,
        "batch_runs_s": [round(b) for b in batches.took],
        "records_acknowledged": stats.acked,
        "records_in_topic": in_topic,
        "merged_differences": len(problems),
        "nodes_alone_differing": sorted(h for h, p in alone.items() if p),
    }
    print(json.dumps(report, indent=2))
    # Beside the cluster's state (pytest keeps its last runs' folders), and where bench.churn asks.
    (settings.state_dir / "churn-report.json").write_text(json.dumps(report, indent=2))
    if os.environ.get("LAMBDALAKE_CHURN_REPORT"):
        Path(os.environ["LAMBDALAKE_CHURN_REPORT"]).write_text(json.dumps(report, indent=2))
    assert batches.failures == [], batches.failures[:1]
    assert batches.took, report
    # Each batch run is an application of its own whose tasks ran in a worker's executors, outside
    # the driver (so its reads, decoders and writes serialise, as on any cluster).
    assert len(executor_apps(settings) - apps_before) >= len(batches.took), report
    assert in_topic == stats.acked, report
    assert kcat_count(settings, pipeline.topic.dlq) == dlq_before + stats.dlq_acked, report
    assert answers.count > 100 and quiet > 0, report  # the clients queried, before and during churn
    # Never a 500 nor a reset connection. A 503 (it names its cause) is counted in the report: none
    # is wanted while a quorum is up, and a run met one in 13,725 queries (docs/benchmarks-log.md).
    assert [e for e in answers.server_errors if e[0] != 503] == [], answers.server_errors[:5]
    assert len(answers.server_errors) <= max(3, answers.count // 1000), answers.server_errors[:5]
    assert not any(alone.values()), {h: p[:5] for h, p in alone.items()}
    assert problems == [], problems[:10]
    assert len(kills) >= len(actions), kills


def active_apps(settings: Settings) -> set[str]:
    """The ids of the applications the standalone master counts running (none while it is down)."""
    state = node(settings, "spark-master").cluster_state()
    return {app["id"] for app in state["activeapps"]} if isinstance(state, dict) else set()


def executor_apps(settings: Settings) -> set[str]:
    """The Spark applications that ran an executor on one of the module's standalone workers."""
    return {
        path.parent.parent.name
        for worker in ("spark-worker-1", "spark-worker-2")
        for path in (settings.state_dir / worker / "work").glob("app-*/*/stderr")
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))] if ordered else float("nan")


def test_fewer_than_a_quorum_of_cassandra_nodes_answers_503_naming_the_consistency_level(
    offers: SharedJob,
) -> None:
    """Two replicas of three down: a QUORUM read cannot be met, and serving says so (503, the level
    and the replicas that answered), never a partial or stale answer; once they are back, it answers.
    Last in the module: it stops the speed job."""
    offers.ensure()
    settings, pipeline = offers.settings, offers.pipeline
    producer = EventProducer(settings=settings, pipeline=pipeline, prepare=False)
    for record in generate("offers", 300, seed=37, mix=Mix()):
        producer.send(record)
    assert producer.flush().unacknowledged == 0
    assert wait_equal(settings, pipeline, timeout=300) == [], offers.log.read_text()[-3000:]
    offers.stop()  # a writer would only fail its QUORUM writes meanwhile
    key = sorted(stored_keys(settings, pipeline, pipeline.views[0]))[0][0]
    down = [node(settings, "cassandra-2"), node(settings, "cassandra-3")]
    with serving_app(settings, token="t", meta_ttl_s=0) as url:
        path = f"{url}/v1/pipelines/{pipeline.name}/views/offer_latest/keys/{key}"
        headers = {"Authorization": "Bearer t"}
        assert httpx.get(path, headers=headers, timeout=30).status_code == 200
        try:
            for victim in down:
                kill_minus_nine(victim)
            answer = httpx.get(path, headers=headers, timeout=60)
            assert answer.status_code == 503, answer.text
            assert "consistency QUORUM" in answer.json()["detail"], answer.text
            assert "Retry-After" in answer.headers
        finally:
            for victim in down:
                victim.start()
        deadline = time.monotonic() + 60
        while (status := httpx.get(path, headers=headers, timeout=30).status_code) != 200:
            assert time.monotonic() < deadline, status
            time.sleep(1)
