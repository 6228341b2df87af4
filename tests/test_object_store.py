"""The embedded object store (s3proxy, started by `lambdalake up` for an ``s3://`` storage root) and
the clients that write the lake on it: pyarrow's S3 filesystem (small files) and delta-rs.

What the lake relies on, checked against the real server: a PUT with ``If-None-Match: *`` of an
object that exists is refused (delta-rs commits a version only if its log entry is new), small
files are written with one PUT and leave nothing beside them, and a Delta table written there reads
back. Then a pipeline with its whole lake on the store (Spark's checkpoints and views through S3A,
the master dataset through delta-rs), and its speed job killed with -9 at the two moments exactness
rests on there, and the store down for a minute. tests/test_secure.py runs a pipeline's whole life on
the store with the services secured.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from email.utils import formatdate
from pathlib import Path

import httpx
import pyarrow as pa
import pytest
from pydantic import SecretStr

from lambdalake.infra.services import all_services, running
from lambdalake.object_store import client_env
from lambdalake.procs import process_tree
from lambdalake.produce.producer import EventProducer
from lambdalake.settings import Settings
from lambdalake.storage import list_files, read_text, write_text
from tests.conftest import PROJECT_ROOT, env_for, port, run_cli
from tests.helpers import pipelines_folder, stop_job, store_clients

pytestmark = [pytest.mark.services]

BUCKET = "lake-test"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    state = tmp_path_factory.mktemp("object-store")
    settings = Settings(
        state_dir=state,
        storage_root=f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}",
        object_store={"endpoint": f"http://127.0.0.1:{port(19900)}", "secret_key": "store-test-secret"},
    )
    with running(settings, only=["object-store"]), store_clients(settings):
        yield settings


def signed_put(settings: Settings, key: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    """A PUT of ``/BUCKET/key`` signed with AWS signature version 2 (which s3proxy takes): a client
    of its own, so the check does not depend on what pyarrow or delta-rs send."""
    store = settings.object_store
    date = formatdate(usegmt=True)
    resource = f"/{BUCKET}/{key}"
    to_sign = f"PUT\n\napplication/octet-stream\n{date}\n{resource}"
    digest = hmac.new(store.secret_key.get_secret_value().encode(), to_sign.encode(), hashlib.sha1).digest()
    auth = f"AWS {store.access_key}:{base64.b64encode(digest).decode()}"
    return httpx.put(
        f"{store.endpoint}{resource}",
        content=body,
        headers={"Date": date, "Authorization": auth, "Content-Type": "application/octet-stream", **headers},
        timeout=10,
    )


def test_up_starts_the_store_for_an_s3_root_and_status_shows_it(store: Settings) -> None:
    assert [s.name for s in all_services(store)][-1] == "object-store"
    status = run_cli(store, "status", "--services", "--json")
    found = next(s for s in json.loads(status.stdout) if s["name"] == "object-store")
    assert found["healthy"] and found["pid"], found
    # The secret key is in the store's own config (its owner's only), never in `config`'s output.
    assert "store-test-secret" not in run_cli(store, "config").stdout.decode()
    conf = store.state_dir / "object-store" / "s3proxy.conf"
    assert conf.stat().st_mode & 0o077 == 0


def test_a_put_if_none_match_of_an_object_that_exists_is_refused(store: Settings) -> None:
    key = f"conditional/{uuid.uuid4().hex}.json"
    first = signed_put(store, key, b"first", {"If-None-Match": "*"})
    assert first.status_code == 200, first.text
    second = signed_put(store, key, b"second", {"If-None-Match": "*"})
    assert second.status_code == 412, (second.status_code, second.text)
    assert read_text(f"s3://{BUCKET}/{key}") == "first"
    other_key = store.object_store.model_copy(update={"secret_key": SecretStr("not-the-key")})
    wrong = store.model_copy(update={"object_store": other_key})
    assert signed_put(wrong, f"{key}.x", b"x", {}).status_code == 403


def test_small_files_are_written_with_one_put_and_leave_nothing_beside_them(store: Settings) -> None:
    folder = f"{store.storage_root}/status"
    for i in range(3):
        write_text(f"{folder}/speed-p.json", json.dumps({"batch": i}))
    assert json.loads(read_text(f"{folder}/speed-p.json") or "null") == {"batch": 2}
    assert list_files(folder) == [f"{folder}/speed-p.json"]  # no .tmp object: nothing was moved


def test_a_delta_table_written_by_delta_rs_on_the_store_reads_back(store: Settings) -> None:
    from deltalake import DeltaTable, write_deltalake

    path = f"{store.storage_root}/master/t"
    for batch in range(3):
        write_deltalake(path, pa.table({"offset": [batch * 10 + i for i in range(10)]}), mode="append")
    table = DeltaTable(path)
    assert table.version() == 2
    assert sorted(table.to_pyarrow_table().column("offset").to_pylist()) == list(range(30))
    # Its files are under the bucket's folder of the embedded store, on this machine's disk.
    data = Path(store.state_dir / "object-store" / "data" / BUCKET)
    assert list(data.rglob("_delta_log/00000000000000000002.json"))


def test_the_clients_are_told_the_store_only_for_an_s3_root(store: Settings) -> None:
    env = client_env(store)
    assert env["AWS_ENDPOINT_URL"] == store.object_store.endpoint and env["AWS_ALLOW_HTTP"] == "true"
    assert client_env(store.model_copy(update={"storage_root": "/tmp/lake"})) == {}


@pytest.mark.parametrize(
    ("change", "said", "setting"),
    [
        ({"storage_root": "s3://no-such-bucket/lake"}, "bucket 'no-such-bucket'", "LAMBDALAKE_STORAGE_ROOT"),
        ({"secret": "not-the-key"}, "did not accept the key 'lambdalake'", "__SECRET_KEY"),
        ({"endpoint": f"http://127.0.0.1:{port(19903)}"}, "did not answer", "__ENDPOINT"),
    ],
    ids=["missing-bucket", "wrong-key", "store-down"],
)
def test_a_missing_bucket_a_wrong_key_or_a_silent_store_is_one_clear_error_naming_the_setting(
    store: Settings, tmp_path: Path, change: dict[str, str], said: str, setting: str
) -> None:
    """Against the real store: a command reading the lake (`master status`) ends with exit 2 and one
    error naming the store and the setting to fix; no trace, nothing written."""
    object_store = store.object_store.model_copy(
        update={
            "endpoint": change.get("endpoint", store.object_store.endpoint),
            "secret_key": SecretStr(change.get("secret", store.object_store.secret_key.get_secret_value())),
        }
    )
    settings = store.model_copy(
        update={
            "storage_root": change.get("storage_root", f"{store.storage_root}/refused"),
            "object_store": object_store,
            "state_dir": tmp_path / "state",
        }
    )
    before = sorted((store.state_dir / "object-store" / "data").rglob("*"))
    done = run_cli(settings, "master", "status", "offers")
    text = " ".join((done.stdout + done.stderr).decode().split())
    assert done.returncode == 2, text[-2000:]
    assert said in text and setting in text and "Traceback" not in text, text[-2000:]
    assert "not-the-key" not in text
    assert sorted((store.state_dir / "object-store" / "data").rglob("*")) == before


def aws_client(endpoint: str, service: str, key: tuple[str, str]):
    """A boto3 client of ``service`` at ``endpoint`` signing with ``key`` (id, secret)."""
    import boto3

    return boto3.client(service, endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id=key[0], aws_secret_access_key=key[1])  # fmt: skip


@pytest.fixture
def iam_store() -> Iterator[tuple[str, dict[str, tuple[str, str]]]]:
    """moto's S3 server with IAM enforced (s3proxy holds one identity with every right, so a key
    that may read but not write cannot be made there): its endpoint, and the keys of ``admin``
    (every right; it made the bucket ``lake``) and ``reader`` (s3:GetObject and s3:ListBucket only)."""
    moto_port = port(19904)
    endpoint = f"http://127.0.0.1:{moto_port}"
    # The first three requests need no signature (they make the admin); every later one is checked
    # against the policies of the key that signed it, as IAM does.
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-p", str(moto_port)],
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            # A connection, not a request: a request would spend one of the three.
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", moto_port), 1):
                break
            assert time.monotonic() < deadline and server.poll() is None, "moto's server did not start"
            time.sleep(0.3)

        def user(iam, name: str, actions: list[str]) -> tuple[str, str]:
            iam.create_user(UserName=name)
            statement = {"Effect": "Allow", "Action": actions, "Resource": "*"}
            policy = json.dumps({"Version": "2012-10-17", "Statement": [statement]})
            iam.put_user_policy(UserName=name, PolicyName=f"{name}-rights", PolicyDocument=policy)
            made = iam.create_access_key(UserName=name)["AccessKey"]
            return made["AccessKeyId"], made["SecretAccessKey"]

        admin = user(aws_client(endpoint, "iam", ("setup", "setup")), "admin", ["iam:*", "s3:*"])
        reader = user(aws_client(endpoint, "iam", admin), "reader", ["s3:GetObject", "s3:ListBucket"])
        aws_client(endpoint, "s3", admin).create_bucket(Bucket="lake")
        yield endpoint, {"admin": admin, "reader": reader}
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize("command", [("batch", "run"), ("speed", "run", "--once")], ids=["batch", "speed"])
def test_a_key_without_write_rights_is_one_clear_error_naming_the_grants_and_nothing_is_written(
    store: Settings,
    iam_store: tuple[str, dict[str, tuple[str, str]]],
    tmp_path: Path,
    command: tuple[str, ...],
) -> None:
    """Against an S3 server that enforces IAM policies: a job started with a key that may read and
    list the bucket but not write it stops before it writes anything, exit 2, with one error naming
    the key, the grants to ask for and the settings; no trace, no secret, the bucket still empty."""
    endpoint, keys = iam_store
    access, secret = keys["reader"]
    settings = store.model_copy(
        update={
            "storage_root": "s3://lake/refused",
            "object_store": store.object_store.model_copy(
                update={"endpoint": endpoint, "access_key": access, "secret_key": SecretStr(secret)}
            ),
            "state_dir": tmp_path / "state",
        }
    )
    done = run_cli(settings, *command, "offers")
    text = " ".join((done.stdout + done.stderr).decode().split())
    assert done.returncode == 2, text[-2000:]
    assert f"denied the key '{access}'" in text and "s3:PutObject" in text, text[-2000:]
    assert "LAMBDALAKE_OBJECT_STORE__ACCESS_KEY" in text and "Traceback" not in text, text[-2000:]
    assert secret not in text
    assert aws_client(endpoint, "s3", keys["admin"]).list_objects_v2(Bucket="lake")["KeyCount"] == 0


def _appears(pattern: Callable[[], list[Path]], timeout: float, job: subprocess.Popen) -> Path:
    """Poll (every 20 ms) until a file matching ``pattern`` appears that was not there at the call;
    returns it."""
    before = set(pattern())
    deadline = time.monotonic() + timeout
    while True:
        new = sorted(set(pattern()) - before)
        if new:
            return new[0]
        assert time.monotonic() < deadline and job.poll() is None, "no new file: the job stopped or stalled"
        time.sleep(0.02)


@pytest.mark.slow
def test_kill_minus_nine_mid_batch_and_between_the_master_commit_and_spark_s_loses_and_doubles_nothing(
    services: Settings, store: Settings, tmp_path: Path, unique: str
) -> None:
    """The speed job with its lake on the store, killed with -9 twice while a producer sends: once as
    soon as Spark has written a micro-batch's offsets to its checkpoint (the batch planned, nothing
    of it committed), once as soon as a master dataset commit lands on the store (before Spark
    records the batch as done: the next start runs it again). Each restart finds its place; the
    master dataset holds every record of the topic exactly once and the views equal the reference."""
    from tests.conftest import isolated, pipeline_named
    from tests.test_speed_faults import produce_steadily, start_job, wait_equal, wait_for_log

    base = isolated(services, tmp_path, unique).model_copy(
        update={"storage_root": f"{store.storage_root}/{unique}", "object_store": store.object_store}
    )
    pipeline = pipeline_named(base, "offers", topic=f"offers-{unique}")
    settings = base.model_copy(update={"pipelines_dir": pipelines_folder(tmp_path, pipeline)})
    EventProducer(settings=settings, pipeline=pipeline)  # topics and schemas exist before the job
    lake = store.state_dir / "object-store" / "data" / BUCKET / store.storage_root.rsplit("/", 1)[1] / unique
    offsets = lambda: list((lake / "checkpoints" / "offers").glob("*/offsets/[0-9]*"))  # noqa: E731
    commits = lambda: list((lake / "master" / "offers" / "_delta_log").glob("*.json"))  # noqa: E731
    log = tmp_path / "speed.log"
    producer = produce_steadily(settings, pipeline, 20_000, rate=400, seed=9)
    job = start_job(settings, "offers", log)
    try:
        for starts, (what, files) in enumerate((("offsets", offsets), ("master commit", commits)), 1):
            wait_for_log(log, "offers-main started", count=starts, timeout=300)
            found = _appears(files, 120, job)
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)
            print(f"killed at {what}: {found.name}")
            job = start_job(settings, "offers", log)
        producer.join(300)
        assert not producer.is_alive() and not producer.errors, producer.errors  # type: ignore[attr-defined]
        problems = wait_equal(settings, pipeline, timeout=300)
        assert problems == [], problems[:10]
    finally:
        stop_job(job)
    assert log.read_text().count("offers-main started") == 3, log.read_text()[-3000:]


@pytest.mark.slow
def java_children(pid: int) -> list[int]:
    """The JVMs among ``pid``'s descendants (a command's Spark driver)."""
    found = []
    for child in process_tree(pid):
        with contextlib.suppress(OSError):  # ended meanwhile
            if child != pid and Path(f"/proc/{child}/comm").read_text().strip() == "java":
                found.append(child)
    return found


def test_the_store_down_for_a_minute_the_speed_job_and_a_batch_under_way_wait_and_go_on(
    services: Settings, tmp_path: Path, unique: str
) -> None:
    """A store of this test's own stopped for a minute while a producer sends, the speed job runs and
    a batch run is under way (its Spark driver started): the job waits (its queries restart from their
    checkpoints) and goes on without a hand, and the batch waits and runs again, then publishes. Once
    the store is back, the master dataset holds every record of the topic once, the speed views equal
    the reference, and the batches' merged answers are exact."""
    from lambdalake.cassandra.active import active_batch
    from lambdalake.cassandra.session import connect
    from lambdalake.infra.services import ObjectStoreService
    from lambdalake.serving.client import ServingClient
    from tests.conftest import isolated, pipeline_named
    from tests.reference import merged_differences
    from tests.test_speed_faults import produce_steadily, start_job, wait_equal, wait_for_log

    own = Settings(
        state_dir=tmp_path / "state",
        storage_root=f"s3://{BUCKET}/down",
        object_store={"endpoint": f"http://127.0.0.1:{port(19902)}", "secret_key": "store-down-secret"},
    )
    store = ObjectStoreService(own)
    # This process's readers of the master dataset (the reference's side) read this store.
    with running(own, only=["object-store"]), store_clients(own):
        base = isolated(services, tmp_path, unique).model_copy(
            update={"storage_root": f"{own.storage_root}/{unique}", "object_store": own.object_store}
        )
        pipeline = pipeline_named(
            base, "offers", topic=f"offers-{unique}", epoch="10 seconds", grace="1 second"
        )
        pipelines = pipelines_folder(tmp_path, pipeline)
        # The second batch may find many times the rows of the first (run during the outage).
        suite = json.loads((pipelines / "offers.expectations.json").read_text())
        (pipelines / "offers.expectations.json").write_text(
            json.dumps({**suite, "row_count_tolerance": 1000})
        )
        settings = base.model_copy(update={"pipelines_dir": pipelines})
        EventProducer(settings=settings, pipeline=pipeline)  # topics and schemas exist before the job
        log = tmp_path / "speed.log"
        producer = produce_steadily(settings, pipeline, 9_000, rate=60, seed=23)  # about 150 s
        job = start_job(settings, "offers", log)
        try:
            wait_for_log(log, "offers-main started", count=1, timeout=300)
            # Some micro-batches land on the store first: the batch has epochs to cover.
            lake = own.state_dir / "object-store" / "data" / BUCKET / "down" / unique
            deadline = time.monotonic() + 300
            while len(list((lake / "master" / "offers" / "_delta_log").glob("*.json"))) < 3:
                assert time.monotonic() < deadline and job.poll() is None, log.read_text()[-3000:]
                time.sleep(1)
            batch = subprocess.Popen(
                [sys.executable, "-m", "lambdalake", "batch", "run", pipeline.name],
                env=env_for(settings), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=PROJECT_ROOT,
            )  # fmt: skip
            deadline = time.monotonic() + 300
            while not java_children(batch.pid):  # the run's Spark driver
                assert time.monotonic() < deadline and batch.poll() is None, (
                    "the batch's driver never started"
                )
                time.sleep(0.5)
            time.sleep(5)
            assert batch.poll() is None, batch.communicate()[0].decode()[-3000:]  # under way
            assert store.stop()
            down = time.monotonic()
            time.sleep(60)
            assert job.poll() is None, log.read_text()[-3000:]  # the job waited: it did not exit
            store.start()
            print(f"the store was down {time.monotonic() - down:.0f} s")
            out, _ = batch.communicate(timeout=600)
            text = out.decode(errors="replace")
            # It waited and went on: its own run again, or its clients' retries, outlasted the outage.
            assert batch.returncode == 0 and "published" in text, text[-3000:]
            print(
                "the batch ran again"
                if "stopped answering half way" in text
                else "the batch's clients waited"
            )
            session = connect(settings.cassandra)
            assert active_batch(session, settings.cassandra.keyspace, pipeline.name) is not None
            producer.join(300)
            assert not producer.is_alive() and not producer.errors, producer.errors  # type: ignore[attr-defined]
            problems = wait_equal(settings, pipeline, timeout=420)
            assert problems == [], problems[:10]
            assert job.poll() is None, log.read_text()[-3000:]
        finally:
            stop_job(job)
        time.sleep(12)  # the last events' ingest epochs close
        again = run_cli(settings, "batch", "run", pipeline.name)
        assert again.returncode == 0, (again.stdout + again.stderr).decode()[-3000:]
        assert merged_differences(settings, ServingClient(settings=settings), {pipeline.name: pipeline}) == []
        # The whole lake is on the store (Spark's checkpoints and views through S3A, the master
        # dataset through delta-rs), nothing of it on the local disk.
        held = {p.relative_to(lake).parts[0] for p in lake.rglob("*") if p.is_file()}
        assert {"master", "checkpoints", "views", "status"} <= held, held
        assert not (tmp_path / "storage").exists()
