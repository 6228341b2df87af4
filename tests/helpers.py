"""Independent helpers for tests: reading topics with other clients, reference validity checks.

The reference checks restate the pipelines' rules by hand instead of calling lambdalake's validator,
so a test compares the platform against something it did not compute itself.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Message, TopicPartition

from lambdalake.infra.process import port_open
from lambdalake.infra.services import EmbeddedService, all_services
from lambdalake.kafka.offsets import offset_consumer, watermarks
from lambdalake.layout import master_path
from lambdalake.master import MasterDataset
from lambdalake.pipeline import Pipeline, configured_pipeline
from lambdalake.settings import PROJECT_ROOT, Settings

CURRENCIES = {"EUR", "USD", "GBP", "INR", "JPY", "CHF"}


def kcat_count(settings: Settings, topic: str) -> int:
    """Records on ``topic`` counted by kcat, a Kafka client independent of librdkafka's Python binding."""
    out = subprocess.run(
        ["kcat", "-b", settings.kafka.bootstrap_servers, "-C", "-t", topic, "-e", "-q", "-f", "%p:%o\n"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, f"kcat failed on {topic}: {out.stderr[-2000:]}"
    return len([line for line in out.stdout.splitlines() if line])


def topic_ends(settings: Settings, topic: str) -> dict[int, tuple[int, int]]:
    """Each partition's (first offset, end offset), asked again while a broker just started elects
    the partitions' leaders (it answers NOT_LEADER_FOR_PARTITION until then)."""
    with offset_consumer(settings) as consumer:
        return watermarks(consumer, topic, timeout=10)


def consume_all(settings: Settings, topic: str) -> list[Message]:
    consumer = Consumer({**settings.kafka.client_config(), "group.id": "tests", "enable.auto.commit": False})
    try:
        ends = topic_ends(settings, topic)
        consumer.assign([TopicPartition(topic, p, lo) for p, (lo, _) in ends.items()])
        todo = sum(hi - lo for lo, hi in ends.values())
        out: list[Message] = []
        while len(out) < todo:
            msg = consumer.poll(10)
            assert msg is not None, f"timed out reading {topic}: {len(out)} of {todo}"
            assert msg.error() is None, msg.error()
            out.append(msg)
        return out
    finally:
        consumer.close()


def send_generated(producer: Any, kind: str, n: int, *, seed: int, mix: Any) -> None:
    """Send ``n`` generated events through ``producer`` and require every one acknowledged."""
    from lambdalake.produce.generator import generate

    for record in generate(kind, n, seed=seed, mix=mix):
        producer.send(record)
    assert producer.flush().unacknowledged == 0


def run_speed_once(settings: Settings, pipeline: Pipeline, spark: Any, **options: Any) -> None:
    """Run the pipeline's speed job in-process until it has processed what the topic holds."""
    from lambdalake.speed.job import SpeedJob
    from lambdalake.speed.options import SpeedOptions
    from lambdalake.speed.supervisor import Supervisor

    job = SpeedJob(settings=settings, pipeline=pipeline, spark=spark, options=SpeedOptions(**options))
    job.start()
    try:
        Supervisor(job).catch_up()
    finally:
        job.stop()


def stop_job(job: subprocess.Popen, timeout: float = 90) -> None:
    """SIGTERM a job started in its own session; SIGKILL its group if it has not stopped in time."""
    if job.poll() is None:
        job.send_signal(signal.SIGTERM)
        try:
            job.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)


def kill_publish_half_way(settings: Settings, pipeline: Pipeline, *args: str, env: dict[str, str]) -> None:
    """Start `lambdalake batch run <pipeline> *args` with one row per publish request (slow enough to
    be caught) and kill -9 it as soon as its first view's table holds a row of the new version (in a
    new generation's table after a full run, in the active one's after an incremental one)."""
    from lambdalake.cassandra.active import active_batch
    from lambdalake.cassandra.session import connect
    from lambdalake.cassandra.tables import batch_table_def

    session = connect(settings.cassandra)
    keyspace = settings.cassandra.keyspace
    before = active_batch(session, keyspace, pipeline.name)
    version = before.version if before is not None else 0
    job = subprocess.Popen(
        [sys.executable, "-m", "lambdalake", "batch", "run", pipeline.name, *args],
        env={**env, "LAMBDALAKE_CASSANDRA__PUBLISH_BATCH_ROWS": "1"}, cwd=PROJECT_ROOT,
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    generations = {version + 1, before.generation if before is not None else version + 1}
    targets = [batch_table_def(pipeline, pipeline.views[0], g).name for g in sorted(generations)]
    deadline = time.monotonic() + 300
    while True:
        assert job.poll() is None, job.stdout.read().decode()[-3000:]  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the publish never started"
        if any(_holds_version_above(session, f'"{keyspace}"."{t}"', version) for t in targets):
            break
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait(30)  # reaped: the next batch command takes the dead holder's lease at once


def _holds_version_above(session: Any, table: str, version: int) -> bool:
    try:
        return any(row[0] > version for row in session.execute(f'SELECT "_bv" FROM {table}'))
    except Exception:  # the table does not exist yet
        return False


def master_coordinates(settings: Settings, pipeline: Pipeline) -> list[tuple[int, int]]:
    """(partition, offset) of every row of the pipeline's master dataset ([] before its first commit)."""
    master = MasterDataset(master_path(settings.storage_root, pipeline.name), event_time=pipeline.event.time)
    try:
        table = master.read()
    except FileNotFoundError:
        return []
    return list(zip(table.column("_partition").to_pylist(), table.column("_offset").to_pylist(), strict=True))


def pipelines_folder(tmp_path: Path, *pipelines: Pipeline, schedule: str | None = None) -> Path:
    """A pipelines folder holding these pipelines' files as the tests changed them (their topics and
    ``[layers]``): what the CLI and the serving client read definitions from."""
    folder = tmp_path / "pipelines"
    folder.mkdir(exist_ok=True)
    for pipeline in pipelines:
        source = PROJECT_ROOT / "pipelines" / f"{pipeline.name}.toml"
        text = source.read_text()
        original = configured_pipeline(pipeline.name, Settings(pipelines_dir=source.parent))
        text = text.replace(
            f'[topic]\nname = "{original.topic.name}"', f'[topic]\nname = "{pipeline.topic.name}"'
        )
        layers = pipeline.layers
        text = text.replace(f'epoch = "{original.layers.epoch}"', f'epoch = "{layers.epoch}"')
        grace = f'\ngrace = "{layers.grace}"' if layers.grace else ""
        text = text.replace(
            f'dedup_delay = "{original.layers.dedup_delay}"', f'dedup_delay = "{layers.dedup_delay}"{grace}'
        )
        if schedule is not None:
            text = text.replace(f'schedule = "{original.batch.schedule}"', f'schedule = "{schedule}"')
        (folder / source.name).write_text(text)
        for extra in source.parent.glob(f"{pipeline.name}.*.json"):
            (folder / extra.name).write_text(extra.read_text())
    return folder


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _int(v: Any, bits: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(2 ** (bits - 1)) <= v < 2 ** (bits - 1)


def offer_is_valid(r: dict[str, Any], now_ms: int) -> bool:
    return (
        isinstance(r.get("offer_id"), str) and r["offer_id"].strip() != ""
        and isinstance(r.get("merchant_id"), str) and r["merchant_id"].strip() != ""
        and isinstance(r.get("title"), str)
        and _int(r.get("price_cents"), 64) and 0 <= r["price_cents"] <= 10_000_000_000
        and r.get("currency") in CURRENCIES
        and _int(r.get("stock"), 32) and r["stock"] >= 0
        and r.get("status") in ("active", "withdrawn")
        and _int(r.get("version"), 64) and r["version"] >= 1
        and _int(r.get("updated_at"), 64) and r["updated_at"] <= now_ms + 300_000
        and (r.get("promo_code") is None or isinstance(r["promo_code"], str))
    )  # fmt: skip


def reading_is_valid(r: dict[str, Any], now_ms: int) -> bool:
    def finite_in(name: str, lo: float, hi: float, hi_ok: bool = True) -> bool:
        v = r.get(name)
        return _num(v) and math.isfinite(v) and lo <= v and (v <= hi if hi_ok else v < hi)

    return (
        isinstance(r.get("vehicle_id"), str) and r["vehicle_id"].strip() != ""
        and _int(r.get("event_time"), 64) and r["event_time"] <= now_ms + 300_000
        and finite_in("speed_kmh", 0, 400) and finite_in("heading_deg", 0, 360, hi_ok=False)
        and finite_in("latitude", -90, 90) and finite_in("longitude", -180, 180)
        and finite_in("odometer_km", 0, math.inf)
        and r.get("engine_state") in ("off", "idle", "running")
        and (r.get("fuel_level_pct") is None or _num(r["fuel_level_pct"]))
    )  # fmt: skip


REFERENCE_VALID = {"offers": offer_is_valid, "telemetry": reading_is_valid}


def offers_with_field(
    settings: Settings,
    tmp_path: Path,
    *,
    name: str,
    topic: str,
    field: dict[str, Any],
    edit: Callable[[str], str] = lambda text: text,
) -> Settings:
    """Settings whose folders hold pipeline ``name``: the offers pipeline on ``topic`` (and its own
    subject), its one schema version offers' v2 plus ``field``, its file changed by ``edit``."""
    schemas = tmp_path / "schemas" / name
    schemas.mkdir(parents=True)
    v2 = json.loads((PROJECT_ROOT / "schemas" / "offers" / "v2.avsc").read_text())
    v2["fields"].append(field)
    (schemas / "v1.avsc").write_text(json.dumps(v2))
    text = (PROJECT_ROOT / "pipelines" / "offers.toml").read_text()
    text = text.replace('name = "offers"\n', f'name = "{name}"\n', 1)
    text = text.replace('[topic]\nname = "offers"', f'[topic]\nname = "{topic}"')
    text = text.replace('subject = "offers-value"', f'subject = "{topic}-value"')
    text = text.replace('versions = ["offers/v1.avsc", "offers/v2.avsc"]', f'versions = ["{name}/v1.avsc"]')
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    (pipelines / f"{name}.toml").write_text(edit(text))
    for extra in (PROJECT_ROOT / "pipelines").glob("offers.*.json"):
        (pipelines / extra.name.replace("offers.", f"{name}.")).write_text(extra.read_text())
    return settings.model_copy(update={"pipelines_dir": pipelines, "schemas_dir": tmp_path / "schemas"})


@contextlib.contextmanager
def serving_app(settings: Settings, *, token: str, meta_ttl_s: float | None = None) -> Iterator[str]:
    """The HTTP API of ``settings`` (with a bearer ``token``) served on a free port; yields its URL."""
    import threading

    import uvicorn
    from pydantic import SecretStr

    from lambdalake.api.http import make_app

    serving = {"token": SecretStr(token), **({"meta_ttl_s": meta_ttl_s} if meta_ttl_s is not None else {})}
    secured = settings.model_copy(update={"serving": settings.serving.model_copy(update=serving)})
    server = uvicorn.Server(uvicorn.Config(make_app(secured), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def schemathesis_seed() -> int:
    """``LAMBDALAKE_SCHEMATHESIS_SEED`` to replay a run, else a new seed each run (printed)."""
    import random

    seed = int(os.environ.get("LAMBDALAKE_SCHEMATHESIS_SEED") or random.randrange(2**32))
    print(f"schemathesis seed: {seed} (LAMBDALAKE_SCHEMATHESIS_SEED={seed} replays it)")
    return seed


def assert_schemathesis_passes(
    url: str, *, token: str, seed: int, config: Path | None = None, examples: int = 40
) -> None:
    """schemathesis (an OpenAPI fuzzer, a real client of the document) with every check against the
    API at ``url``: it must find nothing; a failure names the seed that replays it."""
    config = config or PROJECT_ROOT / "tests" / "schemathesis.toml"
    result = subprocess.run(
        [str(Path(sys.executable).parent / "schemathesis"), "--config-file", str(config), "run",
         f"{url}/openapi.json", "--checks", "all", "--header", f"Authorization: Bearer {token}",
         "--max-examples", str(examples), "--seed", str(seed)],
        capture_output=True, timeout=600, cwd=PROJECT_ROOT,
    )  # fmt: skip
    output = result.stdout.decode() + result.stderr.decode()
    assert result.returncode == 0, f"seed {seed}:\n{output[-6000:]}"
    assert "failed" not in output.split("SUMMARY")[-1], f"seed {seed}:\n{output[-3000:]}"


#: The loopback addresses of a three-node cluster on this machine (`up --nodes 3`).
HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


def node(settings: Settings, name: str) -> EmbeddedService:
    """The embedded service ``name`` (``broker-2``, ``cassandra-3``...) of ``settings``' services."""
    return next(s for s in all_services(settings) if s.name == name)


def kill_minus_nine(service: Any) -> None:
    """kill -9 an embedded service (``infra.services``) and wait until none of its ports listens (its
    sockets outlive the process for a moment, one after another: the broker's controller port was
    seen still open after its broker port had closed)."""
    pid = service.proc.pid()
    assert pid is not None, f"{service.name} is not running"
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while service.proc.pid() is not None or any(port_open(service.host, p) for p in service.ports()):
        assert time.monotonic() < deadline, f"the killed {service.name} still listens"
        time.sleep(0.05)


@contextlib.contextmanager
def store_clients(settings: Settings) -> Iterator[None]:
    """This process's S3 clients (delta-rs and pyarrow: the tests' own readers of the lake) pointed at
    ``settings``' object store for the block; the environment as it was after it."""
    from lambdalake.object_store import use

    saved = dict(os.environ)
    use(settings)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
