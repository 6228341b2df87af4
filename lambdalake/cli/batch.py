"""``lambdalake batch``: rebuild, restore and schedule a pipeline's batch views."""

from __future__ import annotations

import signal
import time
from typing import Annotated

import typer
from rich.table import Table

from lambdalake.batch.run import BatchRun
from lambdalake.cli.common import (
    PipelineArg,
    console,
    job_logging,
    out,
    timestamp_ms,
)
from lambdalake.errors import LambdalakeError
from lambdalake.pipeline import Pipeline
from lambdalake.settings import get_settings

app = typer.Typer(
    help="The batch layer: nightly rebuilds of the views from the master dataset.", no_args_is_help=True
)


@app.command("run")
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
    full: Annotated[
        bool,
        typer.Option(
            "--full", help="Rebuild every view from all of the master dataset, though a run could merge."
        ),
    ] = False,
) -> None:
    """Bring every view of the pipeline up to the horizon, write the Delta views and publish them to
    Cassandra as a new batch version (serving switches atomically). Incremental when it can: only
    what the master dataset added since the active batch is read, and merged into its views; full (everything
    rebuilt from the master dataset) with --full, on the first run, and after a view or the layers
    changed; the summary says which and why."""
    from lambdalake.control.batch import run_batch

    if horizon is not None and as_of is not None:
        raise LambdalakeError("give --horizon or --as-of, not both", fix="drop one of them")
    settings = get_settings().as_role("batch")
    t0 = time.monotonic()
    with console.status("starting Spark...") as status:
        result = run_batch(
            settings,
            pipeline,
            horizon=horizon,
            as_of_ms=timestamp_ms(as_of) if as_of else None,
            dry_run=dry_run,
            full=full,
            progress=lambda stage: status.update(f"{stage}..."),
        )
    table = Table(title=f"batch run {result.run_id} of {pipeline}: {result.outcome}", show_header=False)
    table.add_row("horizon", f"epoch {result.horizon} (ingest time < {result.horizon_end_ms} ms)")
    table.add_row("master dataset version", str(result.master_version))
    for name, value in run_kind_rows(result):
        table.add_row(name, value)
    table.add_row("events read", f"{result.events_read:,}")
    table.add_row("duplicates removed", f"{result.duplicates:,}")
    if result.kind == "full":
        table.add_row("after the horizon (left to speed)", f"{result.after_horizon:,}")
    for view, rows in result.rows.items():
        delta = result.delta_versions.get(view)
        written = result.rows_written.get(view)
        table.add_row(
            f"view {view}",
            f"{rows:,} rows"
            + (f", Delta version {delta}" if delta is not None else "")
            + (f", {written:,} written to Cassandra" if written is not None else ""),
        )
    table.add_row("batch version", str(result.batch_version if result.batch_version is not None else "-"))
    for stage, seconds in result.stages.items():
        table.add_row(f"[dim]{stage}[/]", f"[dim]{seconds:.1f}s[/]")
    table.add_row("total", f"{time.monotonic() - t0:.1f}s")
    out.print(table)


def run_kind_rows(run: BatchRun) -> list[tuple[str, str]]:
    """What kind of run it was and what it recomputed, as rows of a summary."""
    rows = [("kind", f"{run.kind}: {run.reason}" if run.reason else run.kind)]
    if run.kind == "incremental":
        new = f"epochs {run.new_epochs[0]}..{run.new_epochs[1]}" if run.new_epochs else "none"
        rows.append(("recomputed (new)", new))
        if run.changed_epochs or run.changed_by:
            rows.append(
                (
                    "recomputed (changed)",
                    f"epochs {run.changed_epochs} by master dataset commits {run.changed_by}",
                )
            )
    if run.publish:
        rows.append(("publish", run.publish))
    return rows


@app.command("restore")
def batch_restore(
    pipeline: PipelineArg,
    version: Annotated[
        int | None, typer.Option(help="Delta version of the views to publish (default: the newest).")
    ] = None,
) -> None:
    """Republish the Cassandra batch tables from a Delta version of the views, as a new batch version.
    An older version's horizon is older: the speed rows of the epochs in between are rebuilt from the
    master dataset first, so serving counts every event once."""
    from lambdalake.control.batch import restore

    settings = get_settings()
    with console.status("restoring from the Delta views..."):
        run = restore(settings, pipeline, version=version)
    console.print(
        f"[green]✔[/] {pipeline}: batch version {run.batch_version} active, from run {run.run_id} "
        f"(Delta versions {run.delta_versions}, horizon epoch {run.horizon})"
    )


@app.command("schedule")
def batch_schedule(
    pipeline: Annotated[
        list[str] | None, typer.Option("--pipeline", "-p", help="Only this pipeline; repeatable.")
    ] = None,
    once: Annotated[bool, typer.Option("--once", help="Run what is due now, then stop (for cron).")] = False,
) -> None:
    """Run each pipeline's batch when its [batch] schedule (cron, UTC) comes due; SIGTERM stops."""
    import threading

    from lambdalake.control.batch import schedule

    job_logging()
    settings = get_settings().as_role("batch")
    if once:
        outcomes = schedule(settings, pipeline)
        for name, outcome in outcomes.items():
            console.print(f"{name}: {outcome}")
        # cron (or whatever runs it) learns from the exit status that a due run failed.
        if any(outcome.startswith("failed") for outcome in outcomes.values()):
            raise typer.Exit(code=1)
        return
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def started(chosen: list[Pipeline]) -> None:
        names = ", ".join(f"{p.name} ({p.batch.schedule})" for p in chosen)
        console.print(f"scheduling {names}; SIGTERM stops")

    schedule(settings, pipeline, stop=stop, started=started)


# Commands kept in modules of their own register on ``app`` when imported.
