"""``lambdalake replay``: re-read a range of a topic into the master dataset and the speed views."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from lambdalake.cli.common import DryRun, PipelineArg, console, out, timestamp_ms
from lambdalake.settings import get_settings

if TYPE_CHECKING:
    from lambdalake.speed.replay import ReplayPlan, ReplayResult

app = typer.Typer()

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
    """Re-read a range of the topic (widened to whole ingest epochs), re-archive into the master dataset what
    it lacks and recompute every speed cell of the closed epochs after the batch horizon from the master
    dataset. Epochs at or before the horizon are left to the next batch run (offered at the end); epochs still
    open belong to the running speed job and are left alone. Running it twice changes nothing."""
    from lambdalake.control import replay as control
    from lambdalake.kafka.offsets import parse_offsets

    settings = get_settings().as_role("speed")
    span = control.ReplayRange(
        from_offsets=parse_offsets(from_offsets, "--from-offsets") if from_offsets else None,
        from_ms=timestamp_ms(from_timestamp) if from_timestamp else None,
        to_offsets=parse_offsets(to_offsets, "--to-offsets") if to_offsets else None,
        to_ms=timestamp_ms(to_timestamp) if to_timestamp else None,
    )
    with console.status("planning the replay..."):
        plan = control.plan(settings, pipeline, span)
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
    out.print(
        f"  recomputed from the master dataset (closed, after the horizon): {plan.speed_epochs or 'none'}"
    )
    out.print(f"  left to the next batch run (at or before the horizon): {plan.batch_epochs or 'none'}")
    out.print(f"  left to the running speed job (not closed yet): {plan.open_epochs or 'none'}")
    if dry_run:
        out.print("[dim]dry run: nothing changed[/]")
        return

    def ask_for_batch(planned: ReplayPlan, result: ReplayResult) -> bool:
        status.stop()
        _print_result(result)
        question = (
            f"epochs {planned.batch_epochs} are the batch layer's: run `lambdalake batch run {pipeline}` now?"
        )
        wanted = run_batch if run_batch is not None else typer.confirm(question, default=True)
        if wanted:
            status.start()
        return wanted

    with console.status("starting Spark...") as status:
        outcome = control.replay(settings, pipeline, plan, run_batch=ask_for_batch, progress=status.update)
    if not plan.batch_epochs:
        _print_result(outcome.result)
    elif (run := outcome.batch) is not None:
        console.print(f"[green]✔[/] batch: {run.outcome}, horizon {run.horizon}, version {run.batch_version}")
    else:
        console.print(
            f"run `lambdalake batch run {pipeline}` to bring epochs {plan.batch_epochs} back to exact"
        )


def _print_result(result: ReplayResult) -> None:
    rate = result.read / result.seconds if result.seconds else 0
    console.print(f"[green]✔[/] read {result.read:,} valid events in {result.seconds:.1f}s ({rate:,.0f}/s); "
                  f"{result.archived:,} were missing from the master dataset and are "
                  "archived now")  # fmt: skip
    for view, rows in result.cells.items():
        emptied = result.emptied.get(view)
        note = f", {emptied:,} no event counts in any more emptied" if emptied else ""
        console.print(f"[green]✔[/] {view}: {rows:,} speed rows rewritten{note}")
