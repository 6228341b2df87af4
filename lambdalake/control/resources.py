"""What a pipeline needs before its jobs run, made idempotently by deploy: its topics, its schema
versions, its view versions' record, its Cassandra tables and (on the secured embedded services) each
role's grants. Everything is checked before anything changes. Processes are
:mod:`lambdalake.control.processes`'."""

from __future__ import annotations

import json
from functools import cached_property
from typing import TYPE_CHECKING, Any

from lambdalake.control.changes import Action, Change
from lambdalake.errors import ConfigurationError
from lambdalake.pipeline import Pipeline
from lambdalake.settings import Settings

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.schema_registry import SchemaRegistryClient


class Resources:
    """Makes what pipelines need on the services ``settings`` name.

    Args:
        settings: The platform's settings (services, folders).
        apply_topic_configs: Set topic configs that differ from the definitions (never partitions).
    """

    def __init__(self, settings: Settings, *, apply_topic_configs: bool = True) -> None:
        self.settings = settings
        self.apply_topic_configs = apply_topic_configs

    # One client of each service for the whole deploy: its steps ask the same registry subjects and
    # topics again, and a client per step reconnected and re-fetched each time.
    @cached_property
    def registry(self) -> SchemaRegistryClient:
        from lambdalake.registry import client

        return client(self.settings)

    @cached_property
    def admin(self) -> AdminClient:
        """The Kafka admin client (raises, naming the fix, when no broker answers)."""
        from lambdalake.kafka.admin import require_broker

        return require_broker(self.settings)

    def check(self, pipelines: list[Pipeline]) -> None:
        """Refuse, before anything changes (a running job is stopped only for one that will start):
        a schema version the registry would refuse, layers the master dataset was not written with,
        a live topic stamped with the producer's time."""
        from confluent_kafka.schema_registry import Schema
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        from lambdalake.evolution import require_appliable
        from lambdalake.kafka.admin import require_log_append_time
        from lambdalake.master import master_of
        from lambdalake.registry import call, check_compatibility

        sr = self.registry
        for p in pipelines:
            self._check_tables(p)
            master_of(self.settings, p).check_layers(p.layers, pipeline=p.name)
            if not self.apply_topic_configs:  # else the topic step sets it
                require_log_append_time(self.settings, p, self.admin)
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

    def make(self, p: Pipeline) -> tuple[Pipeline, list[Change]]:
        """Make what ``p`` needs (each step idempotent): returns the pipeline with the view versions its
        jobs compute, and every change, unchanged ones too."""
        changes = self._topics(p)
        deployed, view_changes = self._views(p)
        changes += view_changes
        changes += self.register_schemas(p)
        changes += self._tables(deployed)
        if self.settings.secure:
            changes.append(self._grants(p))
        return deployed, changes

    def _grants(self, p: Pipeline) -> Change:
        """On the secured embedded services, each role's rights on the pipeline (``lambdalake.grants``)."""
        from lambdalake import grants

        granted, rules = grants.apply(self.settings, p)
        what = f"{rules} rules for the producer, speed, batch and serving roles"
        return Change(f"grants {p.name}", "created" if granted else "unchanged", what)

    def _topics(self, p: Pipeline) -> list[Change]:
        from lambdalake.kafka.admin import ensure_pipeline_topics

        out = []
        for report in ensure_pipeline_topics(
            self.settings, p, apply=self.apply_topic_configs, admin=self.admin
        ):
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
        from lambdalake.registry import register_pipeline
        from lambdalake.view_versions import retype_pending

        meta = read_meta(connect(self.settings.cassandra), self.settings.cassandra.keyspace, p.name)
        waiting = retype_pending(p, meta.registry)
        if waiting:
            why = f"new versions wait for {', '.join(waiting)} to switch (their stored types widen)"
            return [Change(f"schema {p.schema_.subject}", "held", why)]
        before = set(_registered_ids(self.settings, self.registry, p.schema_.subject))
        out = []
        for r in register_pipeline(self.settings, p, sr=self.registry):
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

        from lambdalake.registry import call

        try:
            latest = call(self.settings, self.registry.get_latest_version, p.schema_.subject)
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
