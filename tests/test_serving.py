"""The merged query end to end, for both pipelines: events spread across the horizon (duplicates on
both sides of it, late events ingested after a batch for windows the batch covers) give answers
equal to an independent reference over everything sent, before and after a second batch moves the
horizon. Then the HTTP API against a running server. (A publish killed half way: tests/test_batch.py
for a full run, tests/test_incremental_batch.py for an incremental one with every merged answer.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lambdalake.batch.job import BatchJob
from lambdalake.cassandra.active import active_batch
from lambdalake.cassandra.session import connect
from lambdalake.pipeline import LatestView, Pipeline
from lambdalake.produce.generator import Mix, generate
from lambdalake.produce.producer import EventProducer
from lambdalake.serving import ServingClient
from lambdalake.settings import PROJECT_ROOT, Settings
from lambdalake.speed.job import SpeedJob
from lambdalake.speed.supervisor import Supervisor
from tests.conftest import isolated, pipeline_named, run_cli
from tests.helpers import (
    assert_schemathesis_passes,
    pipelines_folder,
    run_speed_once,
    schemathesis_seed,
    serving_app,
)
from tests.reference import (
    EVERYTHING,
    batch_views,
    compare,
    merged_differences,
    merged_rows,
    stored_keys,
    topic_events,
)

pytestmark = [pytest.mark.services, pytest.mark.slow]

NAMES = ("offers", "telemetry")
#: How each wave makes its identities new: (late, fresh, edge) version or millisecond shifts.
#: Each wave's identities are its own: offers by a version offset, readings by their event time's
#: residue mod 8 (a reading moves at most 7 ms, inside its 8 ms block, so inside its minute).
WAVES = {"first": 0, "late": 3, "fresh": 5, "edge": 7}


def epoch_of(pipeline: Pipeline, ms: float) -> int:
    return int(ms // pipeline.layers.epoch_ms)


def sleep_until(ms: float) -> None:
    time.sleep(max(0.0, (ms - time.time() * 1000) / 1000))


def in_wave(kind: str, record: dict[str, Any], wave: str) -> dict[str, Any] | None:
    """``record`` as an event of ``wave``, with the same key and window: an identity no other wave
    has (generated readings of two waves may share a millisecond; offers a version). None for a
    record that is not a valid event."""
    c = WAVES[wave]
    try:
        if kind == "offers":
            return {**record, "version": int(record["version"]) + c * 1_000_000}
        t = int(record["event_time"])
        return {**record, "event_time": t - t % 8 + c}
    except (KeyError, TypeError, ValueError):
        return None


def distinct(kind: str, records: list[dict[str, Any]], wave: str) -> list[dict[str, Any]]:
    """``records`` with identities of ``wave`` (invalid records of the first wave stay as they are).

    Copies further apart than the dedup delay count twice in speed rows until the next batch, by
    design (README); this test is about the merge, so the waves never share an identity."""
    out = []
    for r in records:
        moved = in_wave(kind, r, wave)
        if moved is not None:
            out.append(moved)
        elif wave == "first":
            out.append(r)
    return out


def test_no_batch_yet_answers_come_from_speed_alone(services: Settings, spark, tmp_path: Path) -> None:
    unique = f"n{int(time.time() * 1000) % 10**8}"
    settings = isolated(services, tmp_path, unique)
    pipeline = pipeline_named(settings, "telemetry", topic=f"telemetry-{unique}")
    settings = settings.model_copy(update={"pipelines_dir": pipelines_folder(tmp_path, pipeline)})
    producer = EventProducer(settings=settings, pipeline=pipeline)
    for r in generate("telemetry", 300, seed=7, mix=Mix(duplicates=0.05, invalid=0, late=0)):
        producer.send(r)
    assert producer.flush().unacknowledged == 0
    run_speed_once(settings, pipeline, spark)
    client = ServingClient(settings=settings)
    events, _ = topic_events(settings, pipeline)
    want = batch_views(events, pipeline, EVERYTHING)
    for view in pipeline.views:
        keys = {k[: len(view.key)] for k in want[view.name]}
        assert (
            compare(pipeline, view, want[view.name], merged_rows(client, pipeline, view, keys), epoch=False)
            == []
        )
    answer = client.query("telemetry", pipeline.views[0].name, sorted(keys)[0][0])
    assert answer.provenance.batch_version is None and "speed layer only" in answer.provenance.summary


@pytest.fixture(scope="module")
def served(services: Settings, spark, tmp_path_factory: pytest.TempPathFactory) -> Any:
    unique = f"s{int(time.time() * 1000) % 10**8}"
    tmp = tmp_path_factory.mktemp("serving")
    base = isolated(services, tmp, unique)
    # The copies sent across an epoch's end are caught up and the batch run inside the next epoch:
    # with speed.latest = realtime a catch_up also waits for the Real-time batch that wrote what it
    # read (make test-realtime: 2 s), which three busy workers stretch past a 10-second epoch.
    epoch = "20 seconds" if services.speed.latest == "realtime" else "10 seconds"
    pipelines = {
        name: pipeline_named(
            base, name, topic=f"{name}-{unique}", epoch=epoch, dedup_delay="3 seconds", grace="1 second"
        )
        for name in NAMES
    }
    settings = base.model_copy(update={"pipelines_dir": pipelines_folder(tmp, *pipelines.values())})
    producers = {n: EventProducer(settings=settings, pipeline=p) for n, p in pipelines.items()}
    jobs = {n: SpeedJob(settings=settings, pipeline=p, spark=spark) for n, p in pipelines.items()}

    def send(records: dict[str, list[dict]]) -> None:
        for name, batch in records.items():
            for r in batch:
                producers[name].send(dict(r))
            assert producers[name].flush().unacknowledged == 0

    def catch_up() -> None:
        for job in jobs.values():
            Supervisor(job).catch_up()

    for job in jobs.values():
        job.start()
    mix = Mix(duplicates=0.05, invalid=0.01, late=0.05)
    first = {
        n: distinct(n, list(generate(n, 1500, seed=41 + i, mix=mix)), "first") for i, n in enumerate(NAMES)
    }
    send(first)
    catch_up()
    # Duplicates on both sides of the horizon: copies sent just before an epoch ends and again just
    # after (closer than the dedup delay), so the batch holds the first copy and speed skips the second.
    offers = pipelines["offers"]
    boundary = (epoch_of(offers, time.time() * 1000) + 1) * offers.layers.epoch_ms
    if boundary - time.time() * 1000 < 2500:
        boundary += offers.layers.epoch_ms
    edge = {
        n: distinct(n, list(generate(n, 200, seed=51 + i, mix=Mix(0, 0, 0))), "edge")
        for i, n in enumerate(NAMES)
    }
    sleep_until(boundary - 1200)
    send(edge)
    sleep_until(boundary + 300)
    send(edge)
    catch_up()
    sleep_until(boundary + 1500)  # the epoch before the boundary has closed (grace 1 s)
    as_of = int(time.time() * 1000)
    assert as_of < boundary + offers.layers.epoch_ms, "the machine was too slow for the epoch layout"
    runs = {
        n: BatchJob(settings=settings, pipeline=p, spark=spark).run(as_of_ms=as_of)
        for n, p in pipelines.items()
    }
    for run in runs.values():
        assert run.outcome == "published" and run.horizon == epoch_of(offers, boundary) - 1, run
    # Late events ingested after the batch, for windows the batch covers, and fresh ones.
    late = {n: distinct(n, first[n][:300], "late") for n in NAMES}
    fresh = {
        n: distinct(n, list(generate(n, 500, seed=61 + i, mix=mix)), "fresh") for i, n in enumerate(NAMES)
    }
    send(late)
    send(fresh)
    catch_up()
    yield {"settings": settings, "pipelines": pipelines, "jobs": jobs, "runs": runs, "send": send,
           "catch_up": catch_up, "tmp": tmp}  # fmt: skip
    for job in jobs.values():
        job.stop()


def test_merged_answers_equal_the_reference_across_the_horizon(served: Any, spark) -> None:
    settings, pipelines = served["settings"], served["pipelines"]
    client = ServingClient(settings=settings, meta_ttl_s=0)
    assert merged_differences(settings, client, pipelines) == []
    # The answers visibly combine both layers: windows with a batch row and speed rows of later epochs.
    offers = pipelines["offers"]
    hourly = next(v for v in offers.views if not isinstance(v, LatestView))
    answers = [client.query("offers", hourly.name, k[0]) for k in stored_keys(settings, offers, hourly)]
    mixed = [w for a in answers for w in a.windows if w.from_batch and w.speed_epochs]
    assert mixed, "no window merged a batch row with speed rows"
    horizon = served["runs"]["offers"].horizon
    assert all(e > horizon for w in mixed for e in w.speed_epochs)
    assert answers[0].provenance.batch_version == served["runs"]["offers"].batch_version
    assert answers[0].provenance.horizon == horizon

    # A second batch moves the horizon over the speed epochs: the answers stay equal.
    epoch_ms = offers.layers.epoch_ms
    sleep_until((time.time() * 1000 // epoch_ms + 1) * epoch_ms + 1500)
    for name, p in pipelines.items():
        run = BatchJob(settings=settings, pipeline=p, spark=spark).run()
        assert run.outcome == "published" and run.horizon > served["runs"][name].horizon, run
    assert merged_differences(settings, client, pipelines) == []
    moved = client.query("offers", hourly.name, answers[0].key[hourly.key[0]])
    assert moved.provenance.horizon > horizon


@pytest.fixture(scope="module")
def server(served: Any) -> Any:
    """``lambdalake serve``'s app on a free port, with a bearer token configured."""
    settings, token = served["settings"], "s3cret-token"
    with serving_app(settings, token=token, meta_ttl_s=0) as url:
        yield {"url": url, "token": token, "settings": settings}


def test_http_api_answers_like_the_python_api(served: Any, server: Any) -> None:
    settings, pipelines = served["settings"], served["pipelines"]
    client = ServingClient(settings=settings, meta_ttl_s=0)
    auth = {"Authorization": f"Bearer {server['token']}"}
    with httpx.Client(base_url=server["url"], timeout=30) as http:
        for pipeline in pipelines.values():
            for view in pipeline.views:
                key = sorted(stored_keys(settings, pipeline, view))[0][0]
                url = f"/v1/pipelines/{pipeline.name}/views/{view.name}/keys/{key}"
                response = http.get(url, headers=auth)
                assert response.status_code == 200, response.text
                assert response.json() == client.query(pipeline.name, view.name, key).to_dict()
                # Auth: none, and a wrong token.
                assert http.get(url).status_code == 401
                assert http.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        hourly = "/v1/pipelines/offers/views/merchant_offers_hourly/keys"
        key = sorted(stored_keys(settings, pipelines["offers"], pipelines["offers"].views[1]))[0][0]
        # A time range: only windows starting inside it.
        whole = http.get(f"{hourly}/{key}", headers=auth).json()["windows"]
        first = whole[0]["window_start"]
        ranged = http.get(f"{hourly}/{key}", params={"from": first, "to": first}, headers=auth)
        assert ranged.status_code == 404  # an empty range: no rows
        one = http.get(f"{hourly}/{key}", params={"from": first}, headers=auth).json()["windows"]
        assert one == whole
        # Bad parameters and unknown names.
        assert http.get(f"{hourly}/{key}", params={"from": "yesterday"}, headers=auth).status_code == 422
        backwards = {"from": "2026-01-02T00:00:00Z", "to": "2026-01-01T00:00:00Z"}
        assert http.get(f"{hourly}/{key}", params=backwards, headers=auth).status_code == 400
        assert http.get("/v1/pipelines/nope/views/x/keys/k", headers=auth).status_code == 404
        assert http.get("/v1/pipelines/offers/views/nope/keys/k", headers=auth).status_code == 404
        missing = http.get(f"{hourly}/no-such-merchant", headers=auth)
        assert missing.status_code == 404 and "no rows" in missing.json()["detail"]
        # Health is open; OpenAPI is served; metrics need the token and parse.
        assert http.get("/health").json() == {"status": "ok"}
        spec = http.get("/openapi.json").json()
        assert "/v1/pipelines/{pipeline}/views/{view}/keys/{key}" in spec["paths"]
        assert http.get("/docs").status_code == 200
        assert http.get("/metrics").status_code == 401
        text = http.get("/metrics", headers=auth).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["lambdalake_request_seconds"].samples
    versions = {s.labels["pipeline"]: s.value for s in families["lambdalake_batch_active_version"].samples}
    assert set(versions) == set(NAMES) and all(v >= 1 for v in versions.values())
    lags = families["lambdalake_stream_lag_records"].samples
    assert {s.labels["pipeline"] for s in lags} == set(NAMES)
    assert all(s.value >= 0 for s in lags)
    assert {s.labels["pipeline"] for s in families["lambdalake_dlq_records"].samples} == set(NAMES)


def test_serving_imports_no_pyspark() -> None:
    code = "import sys, lambdalake.api.http; assert 'pyspark' not in sys.modules, 'pyspark imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr.decode()


def test_http_api_without_a_token_is_open(served: Any) -> None:
    from fastapi.testclient import TestClient

    from lambdalake.api.http import make_app

    settings, offers = served["settings"], served["pipelines"]["offers"]
    key = sorted(stored_keys(settings, offers, offers.views[0]))[0][0]
    with TestClient(make_app(settings)) as http:
        response = http.get(f"/v1/pipelines/offers/views/{offers.views[0].name}/keys/{key}")
        assert response.status_code == 200, response.text
        assert response.json()["latest"]["values"]["offer_id"] == key
        assert http.get("/metrics").status_code == 200


def test_status_shows_each_pipeline(served: Any) -> None:
    settings = served["settings"]
    result = run_cli(settings, "status", "--json")
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    pipelines = {p["pipeline"]: p for p in json.loads(result.stdout)["pipelines"]}
    assert set(pipelines) == set(NAMES)
    session = connect(settings.cassandra)
    for name, status in pipelines.items():
        active = active_batch(session, settings.cassandra.keyspace, name)
        assert active is not None and status["batch_version"] == active.version
        assert status["horizon"] == active.horizon
        assert status["lag"] == 0 and len(status["partitions"]) == served["pipelines"][name].topic.partitions
        assert status["dlq_records"] > 0  # the generator's invalid share
        assert {v["view"] for v in status["views"]} == {v.name for v in served["pipelines"][name].views}
        assert all(v["last_batch_at"] for v in status["views"])
        assert status["last_batch"]["run_id"]


def test_http_errors_name_the_problem_and_never_answer_500(served: Any) -> None:
    """Times out of range: 422; an empty `from`: absent; a view published by no batch yet: its speed
    rows alone; Cassandra unreachable: 503 with Retry-After, and /health hides the driver's text."""
    from fastapi.testclient import TestClient

    from lambdalake.api.http import make_app
    from lambdalake.cassandra.tables import deploy_speed_tables
    from lambdalake.pipeline import configured_pipeline

    settings, offers = served["settings"], served["pipelines"]["offers"]
    hourly = offers.views[1]
    key = sorted(stored_keys(settings, offers, hourly))[0][0]
    url = f"/v1/pipelines/offers/views/{hourly.name}/keys/{key}"
    with TestClient(make_app(settings)) as http:
        whole = http.get(url)
        assert whole.status_code == 200
        assert http.get(url, params={"from": "", "to": ""}).json() == whole.json()
        for far in ("99999999999999999999", "-99999999999999999999"):
            answer = http.get(url, params={"from": far})
            assert answer.status_code == 422 and "outside the times" in answer.json()["detail"], answer.text

    # A view added to the definition after the last publish.
    folder = served["tmp"] / "pipelines-with-a-new-view"
    folder.mkdir(exist_ok=True)
    for file in settings.pipelines_dir.iterdir():
        (folder / file.name).write_text(file.read_text())
    daily = (
        '\n[[views]]\nname = "merchant_offers_daily"\nkind = "windowed"\nkey = ["merchant_id"]\n'
        'window = "1 day"\naggregates = [{ name = "updates", fn = "count" }]\n'
    )
    (folder / "offers.toml").write_text((folder / "offers.toml").read_text() + daily)
    grown = settings.model_copy(update={"pipelines_dir": folder})
    deploy_speed_tables(connect(grown.cassandra), grown.cassandra, configured_pipeline("offers", grown))
    with TestClient(make_app(grown)) as http:
        answer = http.get(f"/v1/pipelines/offers/views/merchant_offers_daily/keys/{key}")
        assert answer.status_code == 404, answer.text  # no speed rows for it yet, and no error
        assert answer.json()["provenance"]["batch_version"] is None

    down = settings.model_copy(update={"cassandra": settings.cassandra.model_copy(update={"port": 1})})
    with TestClient(make_app(down)) as http:
        health = http.get("/health")
        assert health.status_code == 503 and health.headers["Retry-After"]
        assert health.json() == {"status": "unavailable", "detail": "Cassandra is unreachable"}
        answer = http.get(url)
        assert answer.status_code == 503 and answer.headers["Retry-After"], answer.text


def test_the_openapi_document_is_true_to_the_api(served: Any, server: Any, tmp_path: Path) -> None:
    """schemathesis (an OpenAPI fuzzer, a real client of the document) runs every operation of
    /openapi.json against the served data with a token, with every check, and finds nothing: once
    with generated keys, once with a key that holds rows (so answers with data are checked too)."""
    settings, offers = served["settings"], served["pipelines"]["offers"]
    merchant = sorted(stored_keys(settings, offers, offers.views[1]))[0][0]
    base = (PROJECT_ROOT / "tests" / "schemathesis.toml").read_text()
    with_data = tmp_path / "schemathesis.toml"
    with_data.write_text(f'[parameters]\n"path.key" = "{merchant}"\n\n{base}')
    seed = schemathesis_seed()
    for config in (PROJECT_ROOT / "tests" / "schemathesis.toml", with_data):
        assert_schemathesis_passes(server["url"], token=server["token"], seed=seed, config=config)


def test_curl_of_each_documented_error_gives_the_documented_body(served: Any, server: Any) -> None:
    from lambdalake.serving.contract import ErrorBody, NotFoundBody

    settings, offers = served["settings"], served["pipelines"]["offers"]
    merchant = sorted(stored_keys(settings, offers, offers.views[1]))[0][0]
    path = f"{server['url']}/v1/pipelines/offers/views/merchant_offers_hourly/keys"
    auth = ["-H", f"Authorization: Bearer {server['token']}"]
    cases = {
        400: ([*auth, f"{path}/{merchant}?from=2026-01-02T00:00:00Z&to=2026-01-01T00:00:00Z"], ErrorBody),
        401: ([f"{path}/{merchant}"], ErrorBody),
        404: ([*auth, f"{path}/no-such-merchant"], NotFoundBody),
        422: ([*auth, f"{path}/{merchant}?from=yesterday"], ErrorBody),
    }
    for status, (args, model) in cases.items():
        answer = subprocess.run(
            ["curl", "-s", "-w", "\\n%{http_code}", *args], capture_output=True, timeout=30
        )
        body, _, code = answer.stdout.decode().rpartition("\n")
        assert int(code) == status, (status, body)
        model.model_validate_json(body)  # raises if the body is not the documented one
    metrics = subprocess.run(
        ["curl", "-s", "-i", *auth, f"{server['url']}/metrics"], capture_output=True, timeout=30
    )
    assert b"content-type: text/plain" in metrics.stdout.lower()
