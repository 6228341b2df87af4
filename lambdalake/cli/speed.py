"""``lambdalake speed``: run, watch and reset a pipeline's streaming job."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer
from rich.table import Table

from lambdalake.cli.common import (
    LogLevel,
    PipelineArg,
    console,
    job_logging,
    out,
    pipeline_of,
)
from lambdalake.control.pipelines import deployed_pipeline
from lambdalake.lease import writer_lease
from lambdalake.object_store import wait_for_store
from lambdalake.settings import get_settings

app = typer.Typer(
    help="The speed layer: streaming jobs from Kafka to Delta and Cassandra.", no_args_is_help=True
)


@app.command("run")
def speed_run(
    pipeline: PipelineArg,
    master: Annotated[
        str | None, typer.Option(help="Spark master URL (default: LAMBDALAKE_SPARK__MASTER).")
    ] = None,
    trigger: Annotated[
        float | None,
        typer.Option(min=0, help="Seconds between micro-batches (0: back to back; default speed.trigger_s)."),
    ] = None,
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

    from lambdalake.speed.job import SpeedJob
    from lambdalake.speed.options import SpeedOptions
    from lambdalake.speed.supervisor import Supervisor

    job_logging(log_level.value)
    settings = get_settings().as_role("speed")
    if master:
        settings = settings.model_copy(update={"spark": settings.spark.model_copy(update={"master": master})})
    options = SpeedOptions(
        trigger_seconds=settings.speed.trigger_s if trigger is None else trigger,
        max_offsets_per_trigger=max_offsets_per_trigger,
        broker_wait_s=broker_wait,
        fail_on_data_loss=fail_on_data_loss,
    )
    wait_for_store(settings, patience_s=settings.object_store.patience_s)
    p = deployed_pipeline(settings, pipeline)
    with writer_lease(settings, p.name, "speed job", wait_s=lease_wait) as lease:
        job = SpeedJob(settings=settings, pipeline=p, options=options)
        if not once:
            Supervisor(job).run_until_stopped(lost=lease.lost)
            return
        t0 = time.monotonic()
        with console.status("processing what the topic holds..."):
            job.start()
            try:
                Supervisor(job).catch_up()
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


@app.command("status")
def speed_status(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Progress of every speed job under the storage root: rows, last batch, lag, events behind the
    watermark (left to the batch layer), and the resident memory of all the job's processes (driver,
    JVM, Python workers) at its last batch."""
    from lambdalake.layout import SPEED_STATUS_PREFIX, status_folder
    from lambdalake.storage import list_files, read_text

    settings = get_settings()
    files = list_files(status_folder(settings.storage_root), prefix=SPEED_STATUS_PREFIX, suffix=".json")
    queries = {name: stats for f in files for name, stats in json.loads(read_text(f) or "{}").items()}
    if as_json:
        out.print_json(json.dumps(queries))
        return
    if not queries:
        out.print(f"no speed job has reported under {settings.storage_root} yet")
        return
    table = Table(
        "query", "batches", "rows", "last batch", "lag", "duration", "behind watermark", "job RSS", "at"
    )
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
            f"{last['job_rss_mb']:,.0f} MB in {last['job_processes']}" if "job_rss_mb" in last else "-",
            str(last.get("at", "")),
        )
    out.print(table)


@app.command("show")
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
    v = pipeline_of(pipeline, settings).view(view)
    session = connect(settings.cassandra, keyspace=settings.cassandra.keyspace)
    where = f' WHERE "{v.key[0]}" = %s' if key else ""
    p = pipeline_of(pipeline, settings)
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


@app.command("reset")
def speed_reset(
    pipeline: PipelineArg,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Rebuild the speed layer after its checkpoint was lost or broken: truncate its tables, delete its
    checkpoints, recompute the closed epochs after the batch horizon from the master dataset (never from the
    topic, which compaction may have thinned), and start the next run at the oldest open epoch."""
    from lambdalake.control.speed import refuse_running_job, reset_speed

    settings = get_settings()
    pipeline_of(pipeline, settings)  # a pipeline that is not there is named before anything is asked
    refuse_running_job(settings, pipeline, "a reset")
    if not yes:
        typer.confirm(f"truncate the speed tables of {pipeline} and delete its checkpoints?", abort=True)
    with console.status("rebuilding the speed rows from the master dataset..."):
        result = reset_speed(settings, pipeline)
    console.print(
        f"[green]✔[/] horizon {result.horizon}; rebuilt epochs from the master dataset: "
        f"{result.rebuilt_epochs or 'none'}"
    )
    if result.gap_records:
        console.print(
            f"[green]✔[/] archived {result.archived:,} records the master dataset lacked before the new start"
        )
    for view, rows in result.cells.items():
        console.print(f"  {view}: {rows:,} rows")
    starts = ", ".join(f"p{k}@{v}" for k, v in sorted(result.starting_offsets.items()))
    console.print(f"the next run starts at epoch {result.first_open_epoch}: {starts}")
    console.print(
        f"start it with `lambdalake deploy --pipeline {pipeline}` or `lambdalake speed run {pipeline}`"
    )
