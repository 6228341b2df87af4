"""``lambdalake offsets``: move plain consumer groups' committed offsets."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from lambdalake.cli.common import (
    DryRun,
    out,
    timestamp_ms,
)
from lambdalake.errors import LambdalakeError
from lambdalake.settings import get_settings

app = typer.Typer(help="Move plain consumer groups' committed offsets.", no_args_is_help=True)


@app.command("reset")
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
            targets = offsets_at(consumer, topic, timestamp_ms(to_timestamp or ""))
    plan = reset_group(settings, group, topic, targets, dry_run=dry_run)
    table = Table("partition", "committed", "new")
    for r in plan:
        table.add_row(str(r.partition), "-" if r.current is None else str(r.current), str(r.target))
    out.print(table)
    out.print("[dim]dry run: nothing changed[/]" if dry_run else f"[green]✔[/] {group} moved on {topic}")
