"""The platform's commands: embedded services, status, settings, pipelines, topics, deploy."""

from __future__ import annotations

import json
import os
import time
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from lambdalake.cli.common import (
    OnlyOpt,
    PipelineArg,
    cell_text,
    console,
    out,
    pipeline_of,
)
from lambdalake.errors import LambdalakeError
from lambdalake.pipeline import Pipeline, list_pipelines
from lambdalake.settings import Settings, get_settings

app = typer.Typer()

#: The kinds of service a pipeline's status is read from (Kafka's offsets, the lake's progress,
#: Cassandra's versions): with no node of one answering, each reading would only wait and fail.
PIPELINE_READS = frozenset({"broker", "object-store", "cassandra"})

NodesOpt = Annotated[
    int | None,
    typer.Option(
        "--nodes", min=1, max=9,
        help="Nodes of each service: 3 starts three brokers, three Cassandra nodes (127.0.0.1-3) and a "
        "Spark standalone master with its workers. Recorded for the commands that follow; 1 goes back.",
    ),
]  # fmt: skip


SecureOpt = Annotated[
    bool,
    typer.Option(
        "--secure",
        help="Secure the embedded services: Cassandra asks for a login (a role created here, its "
        "password drawn at random) over TLS, with certificates of a CA made in the state folder. "
        "Recorded for the commands that follow (their settings find the CA and the login).",
    ),
]


@app.command()
def up(only: OnlyOpt = None, nodes: NodesOpt = None, secure: SecureOpt = False) -> None:
    """Start the embedded broker(s), schema registry, Cassandra node(s) and, with a ``spark://``
    master of this machine, the Spark standalone cluster (idempotent)."""
    from lambdalake.infra.services import select, start_all
    from lambdalake.settings import NODES_FILE

    settings = get_settings()
    if nodes is not None and nodes != settings.nodes:
        if os.environ.get("LAMBDALAKE_NODES"):
            raise LambdalakeError(
                f"LAMBDALAKE_NODES={settings.nodes} is set, and --nodes {nodes} asks for another count",
                fix="unset LAMBDALAKE_NODES, or leave out --nodes",
            )
        running = [s.name for s in select(settings, None) if s.embedded and s.proc.pid() is not None]
        if running:
            raise LambdalakeError(
                f"the services of {settings.nodes} node(s) run ({', '.join(running)}): --nodes {nodes} would "
                "start another set on the same addresses",
                fix=f"`lambdalake down` first (data is kept), then `lambdalake up --nodes {nodes}`",
            )
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        (settings.state_dir / NODES_FILE).write_text(f"{nodes}\n")
        get_settings.cache_clear()
        settings = get_settings()
    if secure and not settings.secure:
        from lambdalake import secure as secured

        running = [s.name for s in select(settings, None) if s.embedded and s.proc.pid() is not None]
        if running:
            raise LambdalakeError(
                f"the embedded services run open ({', '.join(running)}): --secure changes how they start",
                fix="`lambdalake down` first (data is kept), then `lambdalake up --secure`",
            )
        secured.ensure_principals(settings.state_dir)
        get_settings.cache_clear()
        settings = get_settings()
    services = select(settings, only)
    for service in services:
        if not service.embedded:
            console.print(f"[dim]{service.name}: configured at {service.address}, not local; not started[/]")

    def progress(service, spawned: bool, seconds: float) -> None:
        verb = f"started in {seconds:.1f}s" if spawned else "already running"
        console.print(f"[green]✔[/] {service.name:<15} {service.address:<22} {verb}")

    local = [s for s in services if s.embedded]
    with console.status(f"starting {len(local)} service node(s) ({', '.join(s.name for s in local)})..."):
        start_all(services, progress=progress)


@app.command()
def install() -> None:
    """Fetch the JARs (Apache Kafka and Apache Cassandra for the embedded services, Spark's Kafka
    connector and delta-spark for every Spark session) from Maven Central into the cache, and build the
    latest views' Real-time writer from its sources, once, without starting anything."""
    from lambdalake import jars

    settings = get_settings()
    # A Spark session's bundles first (spark, delta, writer): `make setup` builds the CDS archive
    # beside this, and its session waits for them (jars.fetch locks a bundle while it fetches).
    for bundle in ("spark", "delta", "writer", "kafka", "cassandra", "s3proxy", "s3a"):
        t0 = time.monotonic()
        verb = "building" if bundle == "writer" else "fetching"
        with console.status(f"{verb} {bundle} {jars.version(bundle)} with Maven..."):
            done = jars.cached(settings.cache_dir, bundle)
            folder = jars.fetch(settings.cache_dir, bundle)
        took = "cached" if done else f"fetched in {time.monotonic() - t0:.0f}s"
        console.print(f"[green]✔[/] {bundle} {jars.version(bundle)} in {folder} ({took})")


@app.command()
def down(only: OnlyOpt = None) -> None:
    """Stop the deployed jobs, then the embedded services, by their PID files (data is kept under the
    state folder; `up` then `deploy` resume where they stopped)."""
    from lambdalake.control.processes import deployed_pipelines, undeploy
    from lambdalake.infra.services import select, stop_all

    settings = get_settings()
    if not only and deployed_pipelines(settings):
        # Jobs first, while the services they flush to still run.
        with console.status("stopping the deployed jobs..."):
            changes = undeploy(settings, deployed_pipelines(settings))
        for c in changes:
            console.print(f"[green]✔[/] {c.what} {c.action}")
    services = select(settings, only)
    with console.status(f"stopping {', '.join(s.name for s in services)}..."):
        stopped = stop_all(services)
    for service in reversed(services):
        console.print(
            f"[green]✔[/] stopped {service.name}"
            if service in stopped
            else f"[dim]- {service.name} not running[/]"
        )


@app.command()
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    services_only: Annotated[bool, typer.Option("--services", help="Only the services.")] = False,
) -> None:
    """Show each service (address, health), then per pipeline: stream lag per partition, freshness
    of each speed view, DLQ records, the active batch version and horizon, and the last batch run.
    Exits 1 if any service is unhealthy."""
    from lambdalake.infra.services import all_services

    settings = get_settings()
    nodes = all_services(settings)
    statuses = [s.status() for s in nodes]
    healthy = all(s.healthy for s in statuses)
    # A node down leaves the others serving (a cluster of three): pipelines are shown while each
    # kind of service they are read from has a node that answers, each reading that fails reported
    # in its place. The registry and Spark are not read, so one of them restarting hides nothing.
    kinds = [(n.kind, s) for n, s in zip(nodes, statuses, strict=True)]
    answering = {kind for kind, s in kinds if s.healthy}
    silent = sorted({kind for kind, _ in kinds if kind in PIPELINE_READS} - answering)
    # Embedded nodes are started by `up`; external ones run elsewhere, at the settings' addresses.
    embedded = {kind: s.embedded for kind, s in kinds}
    fixes = {True: "start it: `lambdalake up`", False: "check that it runs at the settings' address"}
    unavailable = (
        "pipelines not read: "
        + "; ".join(f"no {kind} node answers ({fixes[embedded[kind]]})" for kind in silent)
        if silent and not services_only
        else None
    )
    pipelines = pipeline_statuses(settings) if not silent and not services_only else []
    if as_json:
        services = [s.to_dict() for s in statuses]
        shown: dict[str, Any] = {"services": services, "pipelines": pipelines}
        if unavailable:
            shown["pipelines_unavailable"] = unavailable
        out.print_json(json.dumps(services if services_only else shown))
    else:
        if settings.nodes > 1:
            out.print(
                f"[dim]{settings.nodes} nodes per service (`lambdalake up --nodes 1` goes back to one)[/]"
            )
        table = Table("service", "address", "mode", "pid", "health")
        for s in statuses:
            health = "[green]healthy[/]" if s.healthy else f"[red]{s.detail}[/]"
            table.add_row(
                s.name, s.address, "embedded" if s.embedded else "external", str(s.pid or "-"), health
            )
        out.print(table)
        if unavailable:
            out.print(f"[yellow]{unavailable}[/]")
        print_pipeline_statuses(pipelines)
    raise typer.Exit(0 if healthy else 1)


@app.command()
def config() -> None:
    """Print the effective settings (defaults + LAMBDALAKE_* overrides), secrets masked."""
    out.print_json(json.dumps(get_settings().safe_dump(), default=str))


@app.command()
def grants(
    pipeline: Annotated[
        list[str] | None, typer.Argument(help="Pipelines (default: every pipelines/*.toml).")
    ] = None,
) -> None:
    """Print what each role's principal needs, as the commands a company's administrators run:
    Kafka ACLs (kafka-acls.sh) and Cassandra grants (CQL). `deploy` grants them itself on the
    services of `up --secure`."""
    from lambdalake import grants as rights
    from lambdalake.secure import ROLES, username

    settings = get_settings()
    chosen = [pipeline_of(name, settings) for name in (pipeline or list_pipelines(settings.pipelines_dir))]
    principals = ", ".join(f"{role}={username(role)}" for role in ROLES)
    out.print(f"# principals: {principals}", markup=False, soft_wrap=True)
    for line in rights.describe(settings, chosen):
        out.print(line, markup=False, soft_wrap=True)


@app.command()
def migrate() -> None:
    """Bring the keyspace's stored layout (and the pipelines' expectations files) to this release's,
    one step per release, while no job runs. Needed once after an upgrade that says so; a second
    run changes nothing."""
    from lambdalake.cassandra.stored_layout import release
    from lambdalake.control.migrate import migrate as run_migration
    from lambdalake.layout import LAYOUT_VERSION

    done = run_migration(get_settings())
    if done.found is None:
        out.print(f"keyspace {done.keyspace!r} holds nothing of lambdalake's yet: nothing to migrate")
        return
    for line in done.changes:
        out.print(f"[green]✔[/] {line}")
    if not done.changes:
        out.print(f"keyspace {done.keyspace!r} already holds lambdalake {release(LAYOUT_VERSION)}'s layout")


@app.command()
def pipelines() -> None:
    """List the pipeline definitions and their views."""
    settings = get_settings()
    table = Table("pipeline", "topic", "subject", "views")
    broken: list[tuple[str, LambdalakeError]] = []
    for name in list_pipelines(settings.pipelines_dir):
        try:
            p = pipeline_of(name, settings)
        except LambdalakeError as exc:
            # One broken file must not hide the others: list it, then say what is wrong with it.
            broken.append((name, exc))
            table.add_row(name, "[red]broken[/]", "-", "-")
            continue
        table.add_row(
            p.name, p.topic.name, p.schema_.subject, ", ".join(f"{v.name} ({v.kind})" for v in p.views)
        )
    out.print(table)
    for name, exc in broken:
        console.print(f"[red]✘ {name}:[/] {escape(exc.message)}")
        if exc.fix:
            console.print(f"  [yellow]fix:[/] {escape(exc.fix)}")
    if broken:
        raise typer.Exit(2)


ApplyOpt = Annotated[
    bool,
    typer.Option("--apply", help="Set topic configs that differ from the pipeline file (never partitions)."),
]


def _report_topics(settings: Settings, p: Pipeline, *, apply: bool) -> None:
    from lambdalake.kafka.admin import ensure_pipeline_topics

    drifted = False
    for report in ensure_pipeline_topics(settings, p, apply=apply):
        console.print(f"[green]✔[/] topic {report.topic}: {report.action}")
        for key, wanted, was in report.fixed:
            console.print(f"  [green]set[/] {key} = {wanted} (was {was})")
        for key, wanted, actual in report.drift:
            drifted = True
            console.print(f"  [yellow]drift[/] {key}: definition says {wanted}, cluster has {actual}")
    if drifted:
        console.print(
            "[yellow]drift is reported, not repaired: rerun with --apply to set the topic configs, "
            "or change the pipeline file (partitions are never changed: that would move keys)[/]"
        )


@app.command()
def topics(pipeline: PipelineArg, apply: ApplyOpt = False) -> None:
    """Create the pipeline's topic and dead-letter topic if missing; report (or --apply) config drift."""
    settings = get_settings()
    _report_topics(settings, pipeline_of(pipeline, settings), apply=apply)


@app.command()
def deploy(
    pipelines: Annotated[
        list[str] | None, typer.Argument(help="Pipelines to deploy (default: every pipelines/*.toml).")
    ] = None,
    pipeline: Annotated[
        list[str] | None, typer.Option("--pipeline", "-p", help="A pipeline to deploy; repeatable.")
    ] = None,
    apply: Annotated[
        bool, typer.Option(help="Set topic configs that differ from the definitions (never partitions).")
    ] = True,
    jobs: Annotated[
        bool,
        typer.Option(
            help="Start or restart the speed jobs and the batch scheduler "
            "(--no-jobs: topics, schemas and tables only)."
        ),
    ] = True,
) -> None:
    """Make the platform match the pipeline definitions, idempotently: topics and configs, schema
    versions (an incompatible one is refused before anything changes), Cassandra keyspace and view
    tables (adding new columns), the speed jobs as managed background processes (restarted when
    their definition or settings changed) and the batch scheduler. A view changed or added on a live
    pipeline is built beside the one serving answers, then switched to at once (its progress shown).
    A second run reports no changes."""
    from lambdalake.control.deploy import deploy as deploy_pipelines

    settings = get_settings()
    names = [*(pipelines or []), *(pipeline or [])] or None
    with console.status("deploying...") as shown:

        def progress(name: str, step: str) -> None:
            shown.update(f"building views of {name}: {step}")
            console.log(f"{name}: {step}")

        changes = deploy_pipelines(
            settings, names, apply_topic_configs=apply, start_jobs=jobs, progress=progress
        )
    _print_changes(changes)
    if not jobs and any(c.what.startswith("view ") and "building" in c.detail for c in changes):
        out.print("[yellow]view versions to build[/]: they are built by `lambdalake deploy` with the jobs")


@app.command()
def undeploy(
    pipeline: Annotated[
        list[str] | None, typer.Option("--pipeline", "-p", help="Only this pipeline; repeatable.")
    ] = None,
) -> None:
    """Stop the deployed speed jobs (and the batch scheduler once no pipeline is left). Topics,
    tables, the master dataset and checkpoints are kept: `deploy` resumes where the jobs stopped."""
    from lambdalake.control.processes import deployed_pipelines
    from lambdalake.control.processes import undeploy as stop

    settings = get_settings()
    with console.status("stopping jobs..."):
        changes = stop(settings, pipeline or deployed_pipelines(settings))
    _print_changes(changes)


def _print_changes(changes) -> None:
    table = Table("what", "change", "detail")
    for c in changes:
        style = "green" if c.changed else "dim"
        table.add_row(c.what, f"[{style}]{c.action}[/]", escape(c.detail))
    out.print(table)
    changed = [c for c in changes if c.changed]
    out.print(f"{len(changed)} change(s)" if changed else "[green]no changes[/]")


def pipeline_statuses(settings: Settings) -> list[dict[str, Any]]:
    """Every valid pipeline's status as dicts (a broken pipeline file is listed with its error)."""
    from lambdalake.pipeline import configured_pipeline
    from lambdalake.status import pipeline_status

    found = []
    for name in list_pipelines(settings.pipelines_dir):
        try:
            found.append(pipeline_status(settings, configured_pipeline(name, settings)).to_dict())
        except LambdalakeError as exc:
            found.append({"pipeline": name, "problems": [exc.message]})
    return found


def print_pipeline_statuses(statuses: list[dict[str, Any]]) -> None:
    for s in statuses:
        out.print(f"\n[bold]{s['pipeline']}[/]" + (f" (topic {s['topic']})" if s.get("topic") else ""))
        for problem in s.get("problems", []):
            out.print(f"  [red]![/] {problem}")
        if "partitions" not in s:
            continue
        lags = ", ".join(f"p{p['partition']}: {p['lag']:,}" for p in s["partitions"]) or "-"
        out.print(f"  stream lag (records not archived yet): {lags}")
        if s["dlq_records"] is not None:
            out.print(f"  dead-letter records: {s['dlq_records']:,}")
        table = Table("speed view", "version", "query", "last micro-batch", "ago", "lag then")
        for v in s["views"]:
            ago = f"{v['seconds_since']:.0f}s" if v["seconds_since"] is not None else "-"
            versions = s.get("view_versions", {}).get(v["view"], {})
            shown = f"v{versions['active']}" if versions.get("active") else "-"
            if versions.get("building"):
                shown += f" (v{versions['building']} building)"
            at = v["last_batch_at"] or "never"
            table.add_row(v["view"], shown, v["query"], at, ago, cell_text(v["lag"]))
        out.print(table)
        if s["batch_version"] is None:
            out.print("  batch: none published yet (answers come from the speed layer alone)")
        else:
            out.print(f"  batch: version {s['batch_version']} active, horizon epoch {s['horizon']}")
        last = s.get("last_batch")
        if last:
            out.print(
                f"  last batch run {last.get('run_id')}: {last.get('outcome')}"
                f" (horizon {last.get('horizon')}, {sum((last.get('stages') or {}).values()):.0f}s)"
            )
            kind = last.get("kind", "full")
            out.print(f"    {kind}: {last.get('reason') or '-'}")
            if kind == "incremental":
                new = last.get("new_epochs") or []
                out.print(f"    recomputed epochs {new[0]}..{new[1]} (new)" if new else "    no new epoch")
                if last.get("changed_by"):
                    out.print(
                        f"    recomputed epochs {last.get('changed_epochs')} changed by master dataset "
                        f"commits {last.get('changed_by')}"
                    )
            written = last.get("rows_written") or {}
            if written:
                rows = ", ".join(f"{view} {n:,}" for view, n in written.items())
                out.print(f"    rows written to Cassandra ({last.get('publish')}): {rows}")
            if last.get("cassandra_down"):
                down = ", ".join(last["cassandra_down"])
                out.print(
                    f"    [yellow]published with Cassandra node(s) {down} down[/]: each takes the new "
                    "tables from the others when it returns"
                )
