"""Make the platform match the pipeline definitions, idempotently: topics and their configs, schema
versions (checked for compatibility before anything changes), Cassandra keyspace and view tables
(adding columns), the speed jobs as managed background processes, and the batch scheduler.

Each step reports what it changed; a second deploy of the same definitions reports no changes. A
running job is restarted only when what it runs changed: the pipeline's files (definition, schemas,
expectations) or the settings it was started with. Jobs run as ``lambdalake speed run <pipeline>``,
the Spark driver in this machine's process and the executors on ``settings.spark.master`` (``local``
by default; ``spark://`` or ``k8s://`` by setting), with PID files and logs beside the services'.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lambdalake.errors import ConfigurationError, LambdalakeError
from lambdalake.infra.process import ManagedProcess
from lambdalake.pipeline import Pipeline
from lambdalake.settings import PROJECT_ROOT, Settings

Action = Literal["created", "updated", "started", "restarted", "stopped", "removed", "held", "unchanged"]

#: The process that runs every deployed pipeline's batch on its schedule.
SCHEDULER = "batch-schedule"
#: The serving API's process (``lambdalake serve``).
SERVING = "serving-api"


@dataclass(frozen=True)
class Change:
    """One thing deploy looked at: what it is, what happened, and a detail for people."""

    what: str
    action: Action
    detail: str = ""

    @property
    def changed(self) -> bool:
        return self.action != "unchanged"


def speed_process(settings: Settings, pipeline: str) -> ManagedProcess:
    return ManagedProcess(
        name=f"speed-{pipeline}", run_dir=settings.state_dir / "run", log_dir=settings.state_dir / "logs",
        marker=f"speed run {pipeline}", term_group=False,
    )  # fmt: skip


def scheduler_process(settings: Settings) -> ManagedProcess:
    return ManagedProcess(
        name=SCHEDULER, run_dir=settings.state_dir / "run", log_dir=settings.state_dir / "logs",
        marker="batch schedule",
    )  # fmt: skip


def serving_process(settings: Settings) -> ManagedProcess:
    return ManagedProcess(
        name=SERVING, run_dir=settings.state_dir / "run", log_dir=settings.state_dir / "logs",
        marker="lambdalake serve",
    )  # fmt: skip


def _record_file(settings: Settings, name: str) -> Path:
    return settings.state_dir / "deploy" / f"{name}.json"


def fingerprint(settings: Settings, pipeline: Pipeline) -> str:
    """What a pipeline's job runs: its files and the settings (a change restarts the job)."""
    digest = hashlib.sha256()
    files = [
        settings.pipelines_dir / f"{pipeline.name}.toml",
        *settings.pipelines_dir.glob(f"{pipeline.name}.*.json"),
    ]
    files += [settings.schemas_dir / v for v in pipeline.schema_.versions]
    for path in sorted(files):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    # The view versions it computes (a build adds one, a switch retires one): by internal name.
    digest.update(json.dumps([v.name for v in pipeline.views]).encode())
    digest.update(json.dumps(settings.to_env(), sort_keys=True).encode())
    return digest.hexdigest()[:16]


class Deployer:
    """Deploys pipelines onto the services ``settings`` name.

    Args:
        settings: The platform's settings (services, Spark master, folders).
        apply_topic_configs: Set topic configs that differ from the definitions (never partitions).
        start_jobs: Start or restart the speed jobs and the batch scheduler (default True).
        settle_s: Seconds a started job must keep running to count as started (default 5).
    """

    def __init__(
        self,
        *,
        settings: Settings,
        apply_topic_configs: bool = True,
        start_jobs: bool = True,
        settle_s: float = 5.0,
    ) -> None:
        self.settings = settings
        self.apply_topic_configs = apply_topic_configs
        self.start_jobs = start_jobs
        self.settle_s = settle_s

    def check(self, pipelines: list[Pipeline]) -> None:
        """Refuse, before anything changes (a running job is stopped only for one that will start):
        a schema version the registry would refuse, layers the master dataset was not written with,
        a live topic stamped with the producer's time."""
        from confluent_kafka.schema_registry import Schema
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        from lambdalake.evolution import require_appliable
        from lambdalake.kafka.admin import require_log_append_time
        from lambdalake.master import bronze_of
        from lambdalake.registry import call, check_compatibility, client

        sr = client(self.settings)
        for p in pipelines:
            self._check_tables(p)
            bronze_of(self.settings, p).check_layers(p.layers, pipeline=p.name)
            if not self.apply_topic_configs:  # else the topic step sets it
                require_log_append_time(self.settings, p)
            subject = p.schema_.subject
            deployed = self._deployed_schema(p)
            if deployed is not None:  # a live pipeline: what its layers hold must survive the new schema
                require_appliable(p, deployed)
            for i, file in enumerate(p.schema_.versions, start=1):
                schema = Schema(p.schema_text(i), "AVRO")
                try:
                    call(self.settings, sr.lookup_schema, subject, schema)
                    continue  # registered already
                except SchemaRegistryError as exc:
                    if exc.http_status_code != 404:
                        raise
                try:
                    verdict = check_compatibility(self.settings, sr, subject, schema)
                except SchemaRegistryError as exc:
                    if exc.http_status_code == 404:
                        break  # a new subject: every version is checked as it registers
                    raise
                if not verdict.compatible:
                    reasons = "; ".join(verdict.reasons) or "no reason given"
                    raise ConfigurationError(
                        f"pipeline {p.name!r}: schema {file} is incompatible with subject {subject!r}: "
                        f"{reasons}. Nothing was deployed.",
                        fix="make the new version compatible (give new fields a default, keep field "
                        "types), or register it under a new subject",
                    )

    def _check_tables(self, p: Pipeline) -> None:
        """What the view step records and the table step creates, judged before either runs: a view
        version refused (a name too long), a column no Cassandra type holds, an existing column of
        another type. A refused deploy records nothing, so the corrected file deploys."""
        from lambdalake.cassandra.session import connect
        from lambdalake.cassandra.tables import require_columns_fit, speed_table_def
        from lambdalake.view_versions import deployed_pipeline

        _meta, registry, _planned = self._plan_views(p)
        deployed = deployed_pipeline(p, registry)
        session = connect(self.settings.cassandra)
        session.cluster.refresh_schema_metadata()
        for view in deployed.views:
            require_columns_fit(session, self.settings.cassandra.keyspace, speed_table_def(deployed, view))

    def deploy(self, pipelines: list[Pipeline]) -> list[Change]:
        """Deploy ``pipelines`` (each step idempotent); returns every change, unchanged ones too."""
        self.check(pipelines)
        changes: list[Change] = []
        for p in pipelines:
            changes += self._topics(p)
            deployed, view_changes = self._views(p)
            changes += view_changes
            changes += self.register_schemas(p)
            changes += self._tables(deployed)
            if self.settings.secure:
                changes.append(self._grants(p))
            if self.start_jobs:
                changes.append(self.ensure_speed_job(deployed))
        if self.start_jobs:
            changes.append(self._scheduler())
            changes.append(self._serving())
        return changes

    def _grants(self, p: Pipeline) -> Change:
        """On the secured embedded services, each role's rights on the pipeline (``lambdalake.grants``)."""
        from lambdalake import grants

        granted, rules = grants.apply(self.settings, p)
        what = f"{rules} rules for the producer, speed, batch and serving roles"
        return Change(f"grants {p.name}", "created" if granted else "unchanged", what)

    def _topics(self, p: Pipeline) -> list[Change]:
        from lambdalake.kafka.admin import ensure_pipeline_topics

        out = []
        for report in ensure_pipeline_topics(self.settings, p, apply=self.apply_topic_configs):
            notes = [f"set {k}={w} (was {was})" for k, w, was in report.fixed]
            notes += [f"drift {k}: definition says {w}, cluster has {a}" for k, w, a in report.drift]
            detail = "; ".join(notes)
            action: Action = {"created": "created", "updated": "updated"}.get(report.action, "unchanged")  # type: ignore[assignment]
            out.append(Change(f"topic {report.topic}", action, detail))
        return out

    def register_schemas(self, p: Pipeline) -> list[Change]:
        """Register the pipeline's schema versions, unless a windowed view's stored types widen with
        them: then not before its new version serves (``lambdalake.view_types``), so no value of the
        wider type reaches the version still serving."""
        from lambdalake.cassandra.active import read_meta
        from lambdalake.cassandra.session import connect
        from lambdalake.registry import client, register_pipeline
        from lambdalake.view_versions import retype_pending

        meta = read_meta(connect(self.settings.cassandra), self.settings.cassandra.keyspace, p.name)
        waiting = retype_pending(p, meta.registry)
        if waiting:
            why = f"new versions wait for {', '.join(waiting)} to switch (their stored types widen)"
            return [Change(f"schema {p.schema_.subject}", "held", why)]
        before = set(_registered_ids(self.settings, client(self.settings), p.schema_.subject))
        out = []
        for r in register_pipeline(self.settings, p):
            action: Action = "unchanged" if r.schema_id in before else "created"
            out.append(
                Change(f"schema {p.schema_.subject} v{r.version}", action, f"id {r.schema_id} ({r.file})")
            )
        return out

    def _plan_views(self, p: Pipeline):
        """The view registry as deployed, and as this deploy leaves it (``lambdalake.view_versions``)."""
        from lambdalake.cassandra.active import read_meta
        from lambdalake.cassandra.session import connect
        from lambdalake.view_versions import plan

        meta = read_meta(connect(self.settings.cassandra), self.settings.cassandra.keyspace, p.name)
        return meta, *plan(p, meta.registry)

    def _deployed_schema(self, p: Pipeline) -> dict | None:
        """The schema version registered last (None: none is)."""
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        from lambdalake.registry import call, client

        try:
            latest = call(self.settings, client(self.settings).get_latest_version, p.schema_.subject)
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:
                return None
            raise
        return json.loads(latest.schema.schema_str)

    def _views(self, p: Pipeline) -> tuple[Pipeline, list[Change]]:
        """Record the views' versions: a view changed, or added to a live pipeline, gets a version
        to build (the jobs compute it beside the active one; ``lambdalake.control.view_build`` builds and
        switches it); a removed one leaves serving at once. Returns the pipeline with the views
        its jobs compute, and the changes."""
        from lambdalake.cassandra.active import swap_until_applied
        from lambdalake.cassandra.session import connect
        from lambdalake.view_versions import deployed_pipeline

        session = connect(self.settings.cassandra)

        def decide() -> tuple[Any, Any, tuple[Any, list[Any]]]:
            meta, registry, planned = self._plan_views(p)
            unchanged = registry.to_text() == meta.registry.to_text()
            return meta, None if unchanged else registry, (registry, planned)

        registry, planned = swap_until_applied(session, self.settings.cassandra, p.name, decide)
        actions: dict[str, Action] = {"registered": "created", "added": "created", "changed": "updated",
                                      "removed": "removed", "reverted": "updated"}  # fmt: skip
        out = []
        for c in planned:
            detail = f"v{c.version} {c.detail}" if c.version is not None else c.detail
            out.append(Change(f"view {p.name}.{c.view}", actions[c.kind], detail))
        for state_name, state in sorted(registry.views.items()):
            if state.active is not None and not any(c.view == state_name for c in planned):
                out.append(Change(f"view {p.name}.{state_name}", "unchanged", f"v{state.active.version}"))
        return deployed_pipeline(p, registry), out

    def _tables(self, p: Pipeline) -> list[Change]:
        from lambdalake.cassandra.session import connect
        from lambdalake.cassandra.tables import create_keyspace, ensure_table, speed_table_def
        from lambdalake.lease import LEASES

        keyspace = self.settings.cassandra.keyspace
        session = connect(self.settings.cassandra)
        session.cluster.refresh_schema_metadata()
        existing = session.cluster.metadata.keyspaces.get(keyspace)
        tables = set(existing.tables) if existing is not None else set()
        out = []
        if existing is None:
            create_keyspace(session, self.settings.cassandra)
            out.append(Change(f"keyspace {keyspace}", "created"))
        # The platform's own tables too: the roles that use them (the jobs' leases) may not create them.
        for table in (LEASES, *(speed_table_def(p, view) for view in p.views)):
            added = ensure_table(session, keyspace, table)
            action: Action = "created" if table.name not in tables else ("updated" if added else "unchanged")
            out.append(
                Change(f"table {keyspace}.{table.name}", action, f"added {', '.join(added)}" if added else "")
            )
        return out

    def ensure_speed_job(self, p: Pipeline) -> Change:
        proc = speed_process(self.settings, p.name)
        wanted = fingerprint(self.settings, p)
        return self._ensure_process(
            proc, f"speed job {p.name}", wanted,
            # A predecessor stopped by SIGKILL (it did not stop in time) holds its lease until the
            # TTL ends: the new job waits that long for it.
            [sys.executable, "-m", "lambdalake", "speed", "run", p.name,
             "--lease-wait", str(self.settings.cassandra.lease_ttl_s + 5)],
        )  # fmt: skip

    def _scheduler(self) -> Change:
        """One scheduler for every pipeline deployed so far (its list is the deploy records')."""
        deployed = deployed_pipelines(self.settings)
        wanted = hashlib.sha256(json.dumps([deployed, self.settings.to_env()], sort_keys=True).encode())
        argv = [sys.executable, "-m", "lambdalake", "batch", "schedule"]
        for name in deployed:
            argv += ["--pipeline", name]
        return self._ensure_process(
            scheduler_process(self.settings), "batch scheduler", wanted.hexdigest()[:16], argv
        )

    def _serving(self) -> Change:
        """The HTTP API over every pipeline (it reads the definitions at start: restarted on changes)."""
        digest = hashlib.sha256(json.dumps([deployed_pipelines(self.settings), self.settings.to_env(),
                                            [fingerprint(self.settings, p) for p in self._deployed()]],
                                           sort_keys=True).encode())  # fmt: skip
        what = f"serving API {self.settings.serving.scheme}://{self.settings.serving.host}:{self.settings.serving.port}"
        argv = [sys.executable, "-m", "lambdalake", "serve"]
        return self._ensure_process(serving_process(self.settings), what, digest.hexdigest()[:16], argv)

    def _deployed(self) -> list[Pipeline]:
        from lambdalake.pipeline import configured_pipeline

        return [configured_pipeline(name, self.settings) for name in deployed_pipelines(self.settings)]

    def _ensure_process(self, proc: ManagedProcess, what: str, wanted: str, argv: list[str]) -> Change:
        record = _record_file(self.settings, proc.name.removeprefix("speed-"))
        previous = json.loads(record.read_text()) if record.exists() else {}
        pid = proc.pid()
        if pid is not None and previous.get("fingerprint") == wanted:
            return Change(what, "unchanged", f"pid {pid}, log {proc.log_file}")
        action: Action = "started"
        if pid is not None:
            proc.stop(timeout=90)
            action = "restarted"
        new_pid = proc.spawn(argv, env=self.settings.to_env(), cwd=PROJECT_ROOT)
        # A job that cannot start (settings, a broken definition, services down) exits within
        # seconds; one that survived this long runs, and its log says the rest.
        deadline = time.monotonic() + self.settle_s
        while time.monotonic() < deadline and proc.pid() is not None:
            time.sleep(0.25)
        if proc.pid() is None:
            raise LambdalakeError(
                f"{what} exited right after starting. Last lines of {proc.log_file}:\n{proc.log_tail()}",
                fix=f"read {proc.log_file}",
            )
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"fingerprint": wanted, "pid": new_pid, "argv": argv}))
        return Change(what, action, f"pid {new_pid}, log {proc.log_file}")


def deployed_pipelines(settings: Settings) -> list[str]:
    """Pipelines whose speed jobs deploy started (and undeploy has not stopped)."""
    folder = settings.state_dir / "deploy"
    return sorted(p.stem for p in folder.glob("*.json") if p.stem not in (SCHEDULER, SERVING))


def deploy(
    settings: Settings,
    pipelines: list[str] | None = None,
    *,
    apply_topic_configs: bool = True,
    start_jobs: bool = True,
    progress: Callable[[str, str], None] = lambda _pipeline, _step: None,
) -> list[Change]:
    """Make the platform match the pipeline definitions, idempotently, and build the view versions a
    changed definition records (:mod:`lambdalake.control.view_build`), switching serving to them.

    Args:
        pipelines: the pipelines to deploy (default: every file of the pipelines folder); all are
            validated before anything changes.
        apply_topic_configs: set topic configs that differ from the definitions (never partitions).
        start_jobs: start or restart the speed jobs, the batch scheduler and the serving API, and
            build changed views (which needs the jobs); without it, topics, schemas and tables only.
        progress: told (pipeline, step) as a view build moves on.

    Returns:
        Every change, unchanged ones too; a second call reports none changed.
    """
    from lambdalake.pipeline import configured_pipeline, list_pipelines

    names = pipelines or list_pipelines(settings.pipelines_dir)
    chosen = [configured_pipeline(name, settings) for name in dict.fromkeys(names)]
    deployer = Deployer(settings=settings, apply_topic_configs=apply_topic_configs, start_jobs=start_jobs)
    changes = deployer.deploy(chosen)
    if start_jobs:  # a view version is built while the jobs run it
        from lambdalake.control.view_build import build_views

        for p in chosen:
            changes += build_views(settings, p, deployer, lambda step, name=p.name: progress(name, step))
    return changes


def undeploy(settings: Settings, pipelines: list[str]) -> list[Change]:
    """Stop the speed jobs of ``pipelines`` (SIGTERM: they finish the micro-batch in flight) and the
    scheduler when no deployed pipeline is left (else restart it without them). Data is kept."""
    changes = []
    for name in pipelines:
        record = _record_file(settings, name)
        stopped = speed_process(settings, name).stop(timeout=120)
        record.unlink(missing_ok=True)
        changes.append(Change(f"speed job {name}", "stopped" if stopped else "unchanged"))
    remaining = deployed_pipelines(settings)
    scheduler = scheduler_process(settings)
    serving = serving_process(settings)
    if not remaining:
        for proc, what in ((scheduler, "batch scheduler"), (serving, "serving API")):
            if proc.stop(timeout=60):
                changes.append(Change(what, "stopped"))
            _record_file(settings, proc.name).unlink(missing_ok=True)
    else:
        if scheduler.pid() is not None:
            changes.append(Deployer(settings=settings)._scheduler())
        if serving.pid() is not None:
            changes.append(Deployer(settings=settings)._serving())
    return changes


def _registered_ids(settings: Settings, sr, subject: str) -> list[int]:
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    from lambdalake.registry import call

    try:
        versions = call(settings, sr.get_versions, subject)
    except SchemaRegistryError as exc:
        if exc.http_status_code == 404:
            return []
        raise
    return [call(settings, sr.get_version, subject, v).schema_id for v in versions]
