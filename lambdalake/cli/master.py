"""``lambdalake master``: upkeep of a pipeline's master dataset."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from lambdalake.cli.common import DryRun, PipelineArg, console, out, pipeline_of
from lambdalake.errors import LambdalakeError
from lambdalake.settings import Settings, get_settings

if TYPE_CHECKING:
    from deltalake import DeltaTable

    from lambdalake.pipeline import Pipeline

app = typer.Typer(help="Upkeep of a pipeline's master dataset.", no_args_is_help=True)

#: Names the files this command stages: a killed run's are cleared by the next after an hour.
STAGING_PREFIX = "compact-cli-"


def _master_dataset(name: str, settings: Settings) -> tuple[Pipeline, str, DeltaTable]:
    """The pipeline, its master dataset's location and newest snapshot; refused when there is none."""
    from lambdalake.delta import open_table
    from lambdalake.layout import master_path

    p = pipeline_of(name, settings)
    path = master_path(settings.storage_root, p.name)
    table = open_table(path)
    if table is None:
        raise LambdalakeError(
            f"pipeline {p.name!r} has no master dataset at {path} yet",
            fix=f"run the speed job first (`lambdalake speed run {p.name}`)",
        )
    return p, path, table


@app.command("status")
def master_status(
    pipeline: PipelineArg,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """The master dataset's live files (how many, how large, how many a compaction round would
    rewrite now) and its last compaction round."""
    import json
    from datetime import UTC, datetime

    from lambdalake.compaction import CompactionPolicy, summary

    settings = get_settings()
    p, path, table = _master_dataset(pipeline, settings)
    found = summary(table, CompactionPolicy.of(settings.master))
    if as_json:
        out.print_json(json.dumps({"pipeline": p.name, "path": path, **found}))
        return
    last = found["last_round"]
    when = "never" if last is None else (
        f"{datetime.fromtimestamp(last['at_ms'] / 1000, UTC):%Y-%m-%d %H:%M:%S} UTC "
        f"(version {last['version']}, {last['files_replaced']:,} files replaced)"
    )  # fmt: skip
    rows = Table("pipeline", "version", "live files", "MB", "events", "under 1 MiB", "to rewrite now")
    events = "-" if found["records"] is None else f"{found['records']:,}"
    rows.add_row(
        p.name, str(found["version"]), f"{found['live_files']:,}", f"{found['bytes'] / 1e6:,.1f}", events,
        f"{found['small_files']:,}", f"{found['would_rewrite']:,}",
    )  # fmt: skip
    out.print(rows)
    out.print(f"last compaction round: {when}")


@app.command("compact")
def master_compact(
    pipeline: PipelineArg,
    vacuum: Annotated[
        bool,
        typer.Option(
            "--vacuum/--no-vacuum",
            help="Also delete the files compactions removed longer ago than "
            "LAMBDALAKE_MASTER__VACUUM_RETENTION_HOURS.",
        ),
    ] = True,
    dry_run: DryRun = False,
) -> None:
    """Rewrite the master dataset's small files into large ones now, as a running speed job does every
    LAMBDALAKE_MASTER__COMPACT_EVERY_COMMITS micro-batches. The rows stay as they are; safe beside
    running speed jobs, replays and batch runs (docs/layers.md, Speed layer)."""
    from lambdalake.compaction import Compaction, CompactionPolicy, plan
    from lambdalake.compaction import vacuum as vacuum_master
    from lambdalake.delta import open_table

    settings = get_settings()
    p, path, table = _master_dataset(pipeline, settings)
    policy = CompactionPolicy.of(settings.master)
    live = len(table.file_uris())
    groups = plan(table, policy)
    if dry_run:
        rows = Table("event date", "partition", "files", "MB")
        for g in groups:
            rows.add_row(
                g.date, str(g.partition), f"{len(g.files):,}", f"{sum(f.size for f in g.files) / 1e6:,.1f}"
            )
        out.print(rows)
        out.print(
            f"[dim]dry run: {live:,} live files; {sum(len(g.files) for g in groups):,} would be rewritten[/]"
        )
        return
    from lambdalake.master import MasterDataset

    MasterDataset(path, event_time=p.event.time).clear_staging(STAGING_PREFIX, older_than_s=3600)
    with console.status(f"compacting {sum(len(g.files) for g in groups):,} of {live:,} files of {p.name}..."):
        round_ = Compaction(path, policy=policy, staging_prefix=STAGING_PREFIX)
        replaced = round_.commit() if round_.write(groups=groups) else 0
    left = len(open_table(path).file_uris())
    out.print(f"[green]✔[/] {p.name}: {replaced:,} files rewritten; {live:,} live files before, {left:,} now")
    if vacuum:
        hours = settings.master.vacuum_retention_hours
        with console.status(f"deleting files removed more than {hours} hours ago..."):
            deleted = vacuum_master(path, retention_hours=hours)
        out.print(f"[green]✔[/] {deleted:,} files removed more than {hours} hours ago deleted")
