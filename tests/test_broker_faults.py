"""The embedded broker killed and restarted: the registry keeps one schema per id, the producer ends
cleanly, the speed job rides out restarts and never skips records the broker lost in silence.

Each test runs its own broker and registry (ports 29092/28081, a folder of its own), so killing them
does not disturb the session's services; Cassandra and Spark are the session's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lambdalake.errors import LambdalakeError
from lambdalake.infra.services import BrokerService, RegistryService, running
from lambdalake.pipeline import configured_pipeline
from lambdalake.produce.generator import Mix, generate
from lambdalake.produce.producer import EventProducer, ProducerFailed
from lambdalake.settings import PROJECT_ROOT, Settings
from tests.conftest import env_for, isolated, pipeline_named, port
from tests.helpers import (
    consume_all,
    kill_minus_nine,
    master_coordinates,
    run_speed_once,
    send_generated,
    stop_job,
    topic_ends,
)
from tests.reference import differences, topic_events

pytestmark = [pytest.mark.services, pytest.mark.slow]

OWN_PORTS = {"broker": port(29092), "registry": port(28081)}


@pytest.fixture
def own_kafka(services: Settings, tmp_path: Path, unique: str) -> Iterator[Settings]:
    """A broker and registry of the test's own beside the session's Cassandra."""
    settings = isolated(services, tmp_path, unique).model_copy(
        update={
            "kafka": services.kafka.model_copy(
                update={"bootstrap_servers": f"127.0.0.1:{OWN_PORTS['broker']}"}
            ),
            "registry": services.registry.model_copy(
                update={"url": f"http://127.0.0.1:{OWN_PORTS['registry']}"}
            ),
            "state_dir": tmp_path / "state",
        }
    )
    with running(settings, only=["broker", "registry"]):
        yield settings


def kill_broker(settings: Settings, *, restart: bool = True) -> None:
    broker = BrokerService(settings)
    kill_minus_nine(broker)
    if restart:
        broker.start()


def schema(n: int) -> str:
    fields = [{"name": "id", "type": "string"}, {"name": f"f{n}", "type": "long", "default": 0}]
    return json.dumps({"type": "record", "name": "R", "namespace": "t", "fields": fields})


def id_map(url: str, ids: range) -> dict[int, str | None]:
    out: dict[int, str | None] = {}
    for sid in ids:
        r = httpx.get(f"{url}/schemas/ids/{sid}", timeout=10)
        out[sid] = (
            json.dumps(json.loads(r.json()["schema"]), sort_keys=True) if r.status_code == 200 else None
        )
    return out


def test_registration_while_the_broker_is_down_never_reuses_an_id(own_kafka: Settings) -> None:
    url = own_kafka.registry.url
    post = lambda subject, s: httpx.post(  # noqa: E731
        f"{url}/subjects/{subject}/versions", json={"schema": s}, timeout=60
    )
    assert post("a-value", schema(1)).status_code == 200
    broker = BrokerService(own_kafka)
    assert broker.stop()
    failed = post("b-value", schema(2))
    assert failed.status_code >= 500 and "error_code" in failed.json(), failed.text
    broker.start()
    time.sleep(1)
    third = post("c-value", schema(3))
    assert third.status_code == 200, third.text
    again = post("b-value", schema(2))  # the client retries what failed
    assert again.status_code == 200, again.text
    before = id_map(url, range(1, 6))
    found = {sid: s for sid, s in before.items() if s is not None}
    # Every id names one schema, and each registered schema has one id.
    assert len(set(found.values())) == len(found)
    assert {third.json()["id"], again.json()["id"]} <= set(found)
    assert found[third.json()["id"]] == json.dumps(json.loads(schema(3)), sort_keys=True)
    assert found[again.json()["id"]] == json.dumps(json.loads(schema(2)), sort_keys=True)
    registry = RegistryService(own_kafka)
    assert registry.stop()
    registry.start()
    assert id_map(url, range(1, 6)) == before


def test_broker_killed_during_produce_ends_with_a_summary(own_kafka: Settings) -> None:
    """Measured before: the idempotent producer's fatal OUT_OF_ORDER_SEQUENCE_NUMBER after a broker
    kill -9 ended `produce` with a traceback and no summary."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lambdalake", "produce", "offers", "--generate", "15000", "--rate", "1000"],
        env=env_for(own_kafka),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=PROJECT_ROOT,
    )
    # The kill lands while records flow: once the broker holds some (a loaded machine can take
    # seconds to start the command at all).
    topic = configured_pipeline("offers", own_kafka).topic.name
    deadline = time.monotonic() + 120
    while not held_over(own_kafka, topic, 1000):
        assert proc.poll() is None and time.monotonic() < deadline, b"".join(proc.communicate()).decode()
        time.sleep(0.2)
    kill_broker(own_kafka)
    out, err = proc.communicate(timeout=300)
    text = (out + err).decode()
    assert "Traceback" not in text, text[-3000:]
    assert "acknowledged" in text and "not acknowledged" in text, text[-3000:]
    if proc.returncode != 0:
        assert proc.returncode == 1, text[-3000:]
        assert "not acknowledged" in text or "failed fatally" in text, text[-3000:]


def held_over(settings: Settings, topic: str, n: int) -> bool:
    """Whether ``topic`` exists and holds more than ``n`` records."""
    try:
        return sum(hi - lo for lo, hi in topic_ends(settings, topic).values()) > n
    except LambdalakeError:  # not created yet
        return False


def restore_after_kill(settings: Settings, snapshot: Path) -> None:
    """kill -9 the broker and start it from an older copy of its data folder: each partition's log
    loses its tail, as when a disk or a machine is lost and a replica that lagged behind (or a
    backup) takes over: the loss an unclean leader election causes on a cluster. One Kafka node
    killed with -9 loses nothing (its log is in the OS's page cache), so the test makes the loss."""
    kill_broker(settings, restart=False)
    data = BrokerService(settings).data_dir
    shutil.rmtree(data)
    shutil.copytree(snapshot, data)
    BrokerService(settings).start()


def send(settings: Settings, pipeline, n: int, seed: int) -> None:
    producer = EventProducer(settings=settings, pipeline=pipeline, prepare=False)
    send_generated(producer, pipeline.name, n, seed=seed, mix=Mix(duplicates=0, invalid=0, late=0))


@pytest.mark.parametrize("refill", [False, True], ids=["log-end-behind", "offsets-reused"])
def test_offsets_lost_by_the_broker_are_never_skipped_silently(
    own_kafka: Settings, spark, tmp_path: Path, refill: bool
) -> None:
    pipeline = pipeline_named(own_kafka, "offers")
    EventProducer(settings=own_kafka, pipeline=pipeline)  # topics and schemas
    send(own_kafka, pipeline, 1000, seed=1)
    broker = BrokerService(own_kafka)
    assert broker.stop()  # a graceful stop saves everything: the snapshot to go back to
    snapshot = tmp_path / "broker-snapshot"
    shutil.copytree(broker.data_dir, snapshot)
    broker.start()
    send(own_kafka, pipeline, 600, seed=2)
    run_speed_once(own_kafka, pipeline, spark)
    assert len(master_coordinates(own_kafka, pipeline)) == 1600
    restore_after_kill(own_kafka, snapshot)
    if refill:
        send(own_kafka, pipeline, 1500, seed=3)  # new records take the lost offsets and more
    with pytest.raises(LambdalakeError) as stopped:
        run_speed_once(own_kafka, pipeline, spark)
    message = str(stopped.value)
    assert "DATA LOSS" in message and "offers-" in message and "offset" in message, message
    if not refill:
        assert "were lost by the broker" in message
    else:
        assert "has been replaced" in message
    assert len(master_coordinates(own_kafka, pipeline)) == 1600  # nothing was read past the loss
    # Told to go on, the job reads what comes after the checkpoint (new records at reused offsets
    # before it are named in a warning, not read: their coordinates are taken in the master dataset).
    if refill:
        archived: dict[int, int] = {}
        for p, o in master_coordinates(own_kafka, pipeline):
            archived[p] = max(archived.get(p, -1), o)
        run_speed_once(own_kafka, pipeline, spark, fail_on_data_loss=False)
        coords = master_coordinates(own_kafka, pipeline)
        assert len(coords) == len(set(coords))
        topic = {(m.partition(), m.offset()) for m in consume_all(own_kafka, pipeline.topic.name)}
        after = {(p, o) for p, o in topic if o > archived.get(p, -1)}
        assert after and after <= set(coords)


def produce_through_faults(
    settings: Settings, pipeline, n: int, rate: float, stop: threading.Event
) -> list[str]:
    """Produce ``n`` events at about ``rate``/s; a producer that fails fatally (the broker lost its
    sequence numbers) is replaced, as a real application would."""
    problems: list[str] = []
    producer = None
    t0 = time.monotonic()
    for i, record in enumerate(generate(pipeline.name, n, seed=9, mix=Mix(duplicates=0.03, late=0.03))):
        if stop.is_set():
            break
        try:
            if producer is None:
                producer = EventProducer(settings=settings, pipeline=pipeline, prepare=False)
            producer.send(record)
        except (ProducerFailed, LambdalakeError) as exc:
            problems.append(repr(exc))
            producer = None
            time.sleep(0.5)
        if i % 200 == 0:
            ahead = i / rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
    if producer is not None:
        stats = producer.flush(60)
        if stats.fatal:
            problems.append(stats.fatal)
    return problems


def test_broker_kill_minus_nine_three_times_while_the_speed_job_runs(
    own_kafka: Settings, tmp_path: Path
) -> None:
    """Afterwards either every record the topic holds is in the master dataset once and the views equal a
    reference computed from the topic, or the job stopped with the data-loss error naming offsets."""
    pipeline = pipeline_named(own_kafka, "offers")
    EventProducer(settings=own_kafka, pipeline=pipeline)
    time.sleep(1.5)  # the topic itself survives the first kill
    log = tmp_path / "speed.log"
    job = subprocess.Popen(
        [sys.executable, "-m", "lambdalake", "speed", "run", "offers", "--broker-wait", "120"],
        env=env_for(own_kafka),
        stdout=open(log, "ab"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=PROJECT_ROOT,
    )
    stop = threading.Event()
    result: list[list[str]] = []
    producer = threading.Thread(
        target=lambda: result.append(produce_through_faults(own_kafka, pipeline, 40_000, 1000, stop))
    )
    try:
        deadline = time.monotonic() + 180
        while "offers-main started" not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline and job.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        producer.start()
        for _ in range(3):
            time.sleep(6)
            kill_broker(own_kafka)
            time.sleep(1)
        producer.join(300)
        assert not producer.is_alive() and result, "the producer thread died"
        outcome = wait_for_outcome(own_kafka, pipeline, job, timeout=300)
    finally:
        stop.set()
        stop_job(job)
    print(f"outcome: {outcome}; producer: {result[0][:5]}")
    text = log.read_text(errors="replace")
    if outcome == "stopped":
        # The job's own last word names the loss and the offsets (Spark may log task failures before).
        assert job.returncode == 2, text[-3000:]
        assert "error: query offers-main stopped: DATA LOSS" in text and "offset" in text, text[-3000:]
    else:
        assert outcome == "equal", outcome


def wait_for_outcome(settings: Settings, pipeline, job: subprocess.Popen, timeout: float) -> str:
    """'equal' once the master dataset holds every record of the topic once and the views equal the reference;
    'stopped' if the job ended first; else the last differences."""
    events, _ = topic_events(settings, pipeline)
    want = set(zip(events["_partition"], events["_offset"], strict=True))
    deadline = time.monotonic() + timeout
    problems: list[str] = ["not checked"]
    while time.monotonic() < deadline:
        if job.poll() is not None:
            return "stopped"
        try:
            coords = master_coordinates(settings, pipeline)
            problems = differences(settings, pipeline, events)
        except Exception as exc:  # the job has not written yet
            coords, problems = [], [repr(exc)]
        if len(coords) != len(set(coords)) or set(coords) != want:
            problems.append(
                f"the master dataset: {len(coords)} rows, {len(set(coords))} distinct, want {len(want)}"
            )
        if not problems:
            return "equal"
        time.sleep(5)
    return "; ".join(problems[:5])
