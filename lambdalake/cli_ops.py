"""Repair and backfill commands: ``replay``, ``speed reset`` and ``offsets reset`` (registered on the
one ``lambdalake`` app; layers are imported inside each command)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from lambdalake.cli import PipelineArg, _pipeline, _timestamp_ms, app, console, out, speed_app, writer_lease
from lambdalake.errors import LambdalakeError
from lambdalake.settings import Settings, get_settings

offsets_app = typer.Typer(help="Move plain consumer groups' committed offsets.", no_args_is_help=True)
app.add_typer(offsets_app, name="offsets")

FromOffsets = Annotated[str | None, typer.Option("--from-offsets", help="Start per partition: 'P:O,...'.")]
FromTime = Annotated[
    str | None, typer.Option("--from-timestamp", help="Start at this ingest time (ISO-8601 or epoch ms).")
]
ToOffsets = Annotated[
    str | None, typer.Option("--to-offsets", help="End (exclusive) per partition: 'P:O,...'.")
]
ToTime = Annotated[
    str | None, typer.Option("--to-timestamp", help="End before this ingest time (ISO-8601 or epoch ms).")
]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print what would be touched; change nothing.")]


def _refuse_running_job(settings: Settings, pipeline: str, action: str) -> None:
    from infra.deploy import speed_process

    pid = speed_process(settings, pipeline).pid()
    if pid is not None:
        raise LambdalakeError(
            f"the speed job of {pipeline!r} runs (pid {pid}): {action} would race its state",
            fix=f"stop it first (`lambdalake undeploy --pipeline {pipeline}`), `lambdalake deploy` after",
        )


@app.command()
def replay(
    pipeline: PipelineArg,
    from_offsets: FromOffsets = None,
    from_timestamp: FromTime = None,
    to_offsets: ToOffsets = None,
    to_timestamp: ToTime = None,
    dry_run: DryRun = False,
    run_batch: Annotated[
        bool | None,
        typer.Option(help="Run the batch for touched epochs at or before the horizon (default: ask)."),
    ] = None,
) -> None:
    """Re-read a range of the topic (widened to whole ingest epochs), re-archive into bronze what it
    lacks and recompute every speed cell of the closed epochs after the batch horizon from bronze.
    Epochs at or before the horizon are left to the next batch run (offered at the end); epochs still
    open belong to the running speed job and are left alone. Running it twice changes nothing."""
    from lambdalake.kafka.offsets import parse_offsets
    from speed.replay import Replayer, plan_replay

    settings = get_settings()
    p = _pipeline(pipeline, settings)
    with console.status("planning the replay..."):
        plan = plan_replay(
            settings, p,
            from_offsets=parse_offsets(from_offsets, "--from-offsets") if from_offsets else None,
            from_ms=_timestamp_ms(from_timestamp) if from_timestamp else None,
            to_offsets=parse_offsets(to_offsets, "--to-offsets") if to_offsets else None,
            to_ms=_timestamp_ms(to_timestamp) if to_timestamp else None,
        )  # fmt: skip
    table = Table("partition", "asked", "read (whole epochs)", "records")
    for part, (start, end) in sorted(plan.ranges.items()):
        asked = plan.asked.get(part)
        table.add_row(
            str(part),
            f"{asked[0]}..{asked[1] - 1}" if asked else "-",
            f"{start}..{end - 1}",
            f"{end - start:,}",
        )
    out.print(table)
    if not plan.ranges:
        out.print("the range holds no records: nothing to replay")
        return
    if plan.widened:
        out.print("[yellow]the range was widened to whole ingest epochs on every partition[/] (a speed cell "
                  "holds an epoch's events of every partition)")  # fmt: skip
    out.print(f"epochs {plan.epochs[0]}..{plan.epochs[-1]}; batch horizon: {plan.horizon}")
    out.print(f"  recomputed from bronze (closed, after the horizon): {plan.speed_epochs or 'none'}")
    out.print(f"  left to the next batch run (at or before the horizon): {plan.batch_epochs or 'none'}")
    out.print(f"  left to the running speed job (not closed yet): {plan.open_epochs or 'none'}")
    if dry_run:
        out.print("[dim]dry run: nothing changed[/]")
        return
    from lambdalake.spark.session import spark_session

    with writer_lease(settings, p.name, "replay"):
        spark = spark_session(settings, f"lambdalake-replay-{p.name}", workload="replay")
        with console.status(f"replaying {plan.records:,} records..."):
            result = Replayer(settings=settings, pipeline=p, spark=spark).run(plan)
    rate = result.read / result.seconds if result.seconds else 0
    console.print(f"[green]✔[/] read {result.read:,} valid events in {result.seconds:.1f}s ({rate:,.0f}/s); "
                  f"{result.archived:,} were missing from bronze and are archived now")  # fmt: skip
    for view, rows in result.cells.items():
        emptied = result.emptied.get(view)
        note = f", {emptied:,} no event counts in any more emptied" if emptied else ""
        console.print(f"[green]✔[/] {view}: {rows:,} speed rows rewritten{note}")
    if plan.batch_epochs:
        question = (
            f"epochs {plan.batch_epochs} are the batch layer's: run `lambdalake batch run {p.name}` now?"
        )
        wanted = run_batch if run_batch is not None else typer.confirm(question, default=True)
        if wanted:
            from batch.job import BatchJob

            with writer_lease(settings, p.name, "batch run"), console.status("running the batch..."):
                run = BatchJob(settings=settings, pipeline=p, spark=spark).run()
            console.print(
                f"[green]✔[/] batch: {run.outcome}, horizon {run.horizon}, version {run.batch_version}"
            )
        else:
            console.print(
                f"run `lambdalake batch run {p.name}` to bring epochs {plan.batch_epochs} back to exact"
            )


@speed_app.command("reset")
def speed_reset(
    pipeline: PipelineArg,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Rebuild the speed layer after its checkpoint was lost or broken: truncate its tables, delete its
    checkpoints, recompute the closed epochs after the batch horizon from bronze (never from the
    topic, which compaction may have thinned), and start the next run at the oldest open epoch."""
    from speed.reset import reset_speed

    settings = get_settings()
    p = _pipeline(pipeline, settings)
    _refuse_running_job(settings, p.name, "a reset")
    if not yes:
        typer.confirm(f"truncate the speed tables of {p.name} and delete its checkpoints?", abort=True)
    from lambdalake.spark.session import spark_session

    with writer_lease(settings, p.name, "speed reset"):
        spark = spark_session(settings, f"lambdalake-speed-reset-{p.name}", workload="replay")
        with console.status("rebuilding the speed rows from bronze..."):
            result = reset_speed(settings, p, spark)
    console.print(
        f"[green]✔[/] horizon {result.horizon}; rebuilt epochs from bronze: {result.rebuilt_epochs or 'none'}"
    )
    for view, rows in result.cells.items():
        console.print(f"  {view}: {rows:,} rows")
    starts = ", ".join(f"p{k}@{v}" for k, v in sorted(result.starting_offsets.items()))
    console.print(f"the next run starts at epoch {result.first_open_epoch}: {starts}")
    console.print(f"start it with `lambdalake deploy --pipeline {p.name}` or `lambdalake speed run {p.name}`")


@offsets_app.command("reset")
def offsets_reset(
    group: Annotated[str, typer.Argument(help="The consumer group.")],
    topic: Annotated[str, typer.Argument(help="The topic.")],
    to_offsets: Annotated[str | None, typer.Option("--to-offsets", help="Per partition: 'P:O,...'.")] = None,
    to_timestamp: Annotated[
        str | None,
        typer.Option(
            "--to-timestamp", help="Every partition to its first record at or after (ISO-8601 or ms)."
        ),
    ] = None,
    dry_run: DryRun = False,
) -> None:
    """Move a plain consumer group's committed offsets by time or position, as Kafka's
    kafka-consumer-groups --reset-offsets does (stop the group's consumers first)."""
    from lambdalake.kafka.offsets import offset_consumer, offsets_at, parse_offsets, reset_group

    if (to_offsets is None) == (to_timestamp is None):
        raise LambdalakeError("give exactly one of --to-offsets and --to-timestamp", fix="see --help")
    settings = get_settings()
    if to_offsets is not None:
        targets = parse_offsets(to_offsets, "--to-offsets")
    else:
        with offset_consumer(settings) as consumer:
            targets = offsets_at(consumer, topic, _timestamp_ms(to_timestamp or ""))
    plan = reset_group(settings, group, topic, targets, dry_run=dry_run)
    table = Table("partition", "committed", "new")
    for r in plan:
        table.add_row(str(r.partition), "-" if r.current is None else str(r.current), str(r.target))
    out.print(table)
    out.print("[dim]dry run: nothing changed[/]" if dry_run else f"[green]✔[/] {group} moved on {topic}")
