"""``distinct`` and ``quantiles`` aggregates and ``where`` filters on a pipeline of the test's own (card
payments), against the real services: every merged answer within its sketch's stated bound of the
plain-Python reference (exact counts and sums of the filtered events), before and after a batch
publish, with copies near and far and late events; both layers' sketches of the same events answer
alike; a replay of the same records leaves the same answers."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from lambdalake.batch.job import BatchJob
from lambdalake.pipeline import Pipeline, WindowedView, configured_pipeline
from lambdalake.produce.producer import EventProducer
from lambdalake.serving import ServingClient
from lambdalake.settings import Settings
from lambdalake.speed.replay import Replayer, plan_replay
from tests import reference
from tests.conftest import isolated
from tests.helpers import run_speed_once
from tests.user_pipeline import SCHEMA_V1, payments, read_back

pytestmark = [pytest.mark.services, pytest.mark.slow]

PIPELINE = """name = "sketched"

[topic]
name = "{topic}"
partitions = 3

[schema]
subject = "{topic}-value"
versions = ["sketched/v1.avsc"]

[event]
key = "payment_id"
time = "paid_at"
identity = ["payment_id", "attempt"]

[layers]
epoch = "5 seconds"
dedup_delay = "3 seconds"
grace = "1 second"
speed_ttl = "1 day"

[[views]]
name = "settled_latest"
kind = "latest"
key = ["payment_id"]
version = "attempt"
where = "status = 'SETTLED'"

[[views]]
name = "account_5m"
kind = "windowed"
key = ["account_id"]
window = "5 minutes"
where = "status in ('AUTHORIZED', 'SETTLED') and amount > 0 and not (note is null)"
aggregates = [
  {{ name = "payments", fn = "count" }},
  {{ name = "total", fn = "sum", column = "amount" }},
  {{ name = "regions", fn = "distinct", column = "region" }},
  {{ name = "amounts", fn = "quantiles", column = "amount", q = [0.5, 0.9] }},
]

[[views]]
name = "region_5m"
kind = "windowed"
key = ["region"]
window = "5 minutes"
aggregates = [
  {{ name = "payments", fn = "count" }},
  {{ name = "payers", fn = "distinct", column = "payment_id", lg_k = 5 }},
  {{ name = "moments", fn = "distinct", column = "paid_at" }},
  {{ name = "attempts", fn = "distinct", column = "attempt" }},
  {{ name = "amounts", fn = "quantiles", column = "amount", k = 8 }},
  {{ name = "tries", fn = "quantiles", column = "attempt" }},
]
"""


def write_pipeline(settings: Settings, root: Path, topic: str) -> Settings:
    (root / "pipelines").mkdir(parents=True, exist_ok=True)
    (root / "schemas" / "sketched").mkdir(parents=True, exist_ok=True)
    (root / "schemas" / "sketched" / "v1.avsc").write_text(json.dumps(SCHEMA_V1))
    (root / "pipelines" / "sketched.toml").write_text(PIPELINE.format(topic=topic))
    return settings.model_copy(update={"pipelines_dir": root / "pipelines", "schemas_dir": root / "schemas"})


def send(producer: EventProducer, records: list[dict[str, Any]]) -> None:
    outcome = producer.send_batch(records)
    assert not outcome.refused, outcome.refused[:3]
    assert producer.flush().unacknowledged == 0


def merged(settings: Settings, pipeline: Pipeline, view: Any, keys: set[tuple]) -> list[dict]:
    return reference.merged_rows(ServingClient(settings=settings, meta_ttl_s=0), pipeline, view, keys)


def problems(settings: Settings, pipeline: Pipeline) -> list[str]:
    """Every merged answer against the reference over the first copy of each identity."""
    events = pd.DataFrame(read_back(settings, pipeline.topic.name))
    want = reference.batch_views(events, pipeline, reference.EVERYTHING)
    out = []
    for view in pipeline.views:
        assert want[view.name], view.name  # the filters keep some events of every view
        keys = {k[: len(view.key)] for k in want[view.name]} | reference.stored_keys(settings, pipeline, view)
        out += reference.compare(
            pipeline, view, want[view.name], merged(settings, pipeline, view, keys), epoch=False
        )
    return out


def answers(settings: Settings, pipeline: Pipeline, view: WindowedView) -> dict[tuple, dict]:
    """Each (key, window)'s merged sketch answers, with the epochs the speed layer gave."""
    client = ServingClient(settings=settings, meta_ttl_s=0)
    out = {}
    for key in ("eu", "us", "apac", "latam"):
        for w in client.query(pipeline.name, view.name, key).windows:
            sketches = {
                a.name: w.values[a.name] for a in view.aggregates if a.fn in ("distinct", "quantiles")
            }
            out[(key, w.window_start)] = {**sketches, "_speed": w.speed_epochs, "_batch": w.from_batch}
    return out


def test_sketches_and_filters_match_the_reference_across_both_layers(
    services: Settings, spark, tmp_path: Path
) -> None:
    unique = os.urandom(4).hex()
    settings = write_pipeline(isolated(services, tmp_path, unique), tmp_path, f"sketched-{unique}")
    pipeline = configured_pipeline("sketched", settings)
    producer = EventProducer(settings=settings, pipeline=pipeline)
    first = payments(1500, seed=11)
    send(producer, first + random.Random(12).sample(first, 80))  # copies near: count once
    run_speed_once(settings, pipeline, spark)
    found = problems(settings, pipeline)
    assert found == [], found[:10]  # the speed layer alone
    region = pipeline.view("region_5m")
    speed_only = answers(settings, pipeline, region)
    assert any(v["payers"]["estimate"] > 32 for v in speed_only.values())  # lg_k 5: estimating, not listing
    assert any(v["amounts"]["count"] > 8 for v in speed_only.values())  # k 8: compacting

    # Replaying the same records rewrites the same cells: the answers do not move.
    Replayer(settings=settings, pipeline=pipeline, spark=spark).run(
        plan_replay(settings, pipeline, from_offsets=dict.fromkeys(range(3), 0))
    )
    replayed = answers(settings, pipeline, region)
    assert {k: v["payers"] for k, v in replayed.items()} == {k: v["payers"] for k, v in speed_only.items()}
    assert {k: v["tries"] for k, v in replayed.items()} == {k: v["tries"] for k, v in speed_only.items()}

    # The batch covers the closed epochs: its sketch of a cell answers as the speed layer's did.
    time.sleep(pipeline.layers.epoch_seconds + 2)
    run = BatchJob(settings=settings, pipeline=pipeline, spark=spark).run()
    assert run.outcome == "published", run
    from_batch = answers(settings, pipeline, region)
    compared = 0
    for cell, got in from_batch.items():
        if got["_speed"] or not got["_batch"]:
            continue
        was = speed_only[cell]
        for name in ("payers", "moments", "attempts"):
            assert got[name]["estimate"] == pytest.approx(was[name]["estimate"], rel=1e-9), (cell, name)
        assert got["tries"] == was["tries"], cell  # fewer values than k: exact in both
        assert got["amounts"]["count"] == was["amounts"]["count"], cell
        compared += 1
    assert compared >= 4, from_batch
    found = problems(settings, pipeline)
    assert found == [], found[:10]

    # Then late events into the batch's windows and new ones: merged from both layers.
    send(producer, payments(700, seed=13, start=20_000))
    run_speed_once(settings, pipeline, spark)
    after = answers(settings, pipeline, region)
    assert any(v["_speed"] and v["_batch"] for v in after.values())  # merged cells, not read alone
    found = problems(settings, pipeline)
    assert found == [], found[:10]
    asked_later(settings, pipeline)

    # Copies of archived events, far apart in ingest time (the speed layer counts them until the
    # next batch, README "Serving"): after it, they count nowhere.
    send(producer, random.Random(14).sample(first, 100))
    run_speed_once(settings, pipeline, spark)
    time.sleep(pipeline.layers.epoch_seconds + 2)
    run = BatchJob(settings=settings, pipeline=pipeline, spark=spark).run()
    assert run.outcome == "published", run
    found = problems(settings, pipeline)
    assert found == [], found[:10]


def asked_later(settings: Settings, pipeline: Pipeline) -> None:
    """Quantiles the definition does not list, asked at query time (``?q=``), from the same merged
    sketches: each within the rank error of the truth."""
    from lambdalake.serving.client import quantile_list

    view = pipeline.view("account_5m")
    events = pd.DataFrame(read_back(settings, pipeline.topic.name))
    want = reference.batch_views(events, pipeline, reference.EVERYTHING)[view.name]
    client = ServingClient(settings=settings, meta_ttl_s=0)
    asked = quantile_list(["0.001,0.999", "0.25"])
    checked = 0
    for key in sorted({k[0] for k in want})[:10]:
        for w in client.query(pipeline.name, view.name, key, quantiles=asked).windows:
            answer = w.values["amounts"]
            assert set(answer["quantiles"]) == {"0.001", "0.999", "0.25"}, answer
            truth = want[(key, round(w.window_start.timestamp() * 1000))]["amounts"]
            assert reference.sketch_problem(truth, answer, view.aggregates[3]) is None
            checked += 1
    assert checked >= 10


def test_quantiles_asked_at_query_time_are_numbers_between_0_and_1() -> None:
    from lambdalake.serving.client import BadQuery, quantile_list

    assert quantile_list(["0.5,0.95", "1"]) == [0.5, 0.95, 1.0]
    for bad in ("1.5", "-0.1", "nan", "p99", ""):
        with pytest.raises(BadQuery, match="between 0 and 1"):
            quantile_list([bad])
