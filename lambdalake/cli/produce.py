"""``lambdalake produce``: validated events from a file, stdin or the generator."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lambdalake.errors import LambdalakeError
from lambdalake.grants import refused
from lambdalake.settings import get_settings

if TYPE_CHECKING:
    from typing import TextIO

    from lambdalake.pipeline import Pipeline
    from lambdalake.produce.generator import Mix
    from lambdalake.produce.producer import EventProducer, ProduceStats


from lambdalake.cli.common import (
    PipelineArg,
    console,
    pipeline_of,
)

app = typer.Typer()


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
        typer.Option(
            "--file",
            "-f",
            allow_dash=True,
            help="Records to produce: JSON lines ('-' for stdin), CSV or Parquet (see --format).",
        ),
    ] = None,
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format", help="json, csv or parquet (default: by the file's extension; JSON lines else)."
        ),
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
    from lambdalake.produce.producer import EventProducer

    if (file is None) == (generate is None):
        raise LambdalakeError(
            "give exactly one of --file or --generate", fix="e.g. `lambdalake produce offers --generate 1000`"
        )
    settings = get_settings().as_role("producer")
    p = pipeline_of(pipeline, settings)
    with console.status("connecting, creating topics, registering schemas..."):
        producer = EventProducer(settings=settings, pipeline=p, schema_version=schema_version)
    mix = Mix(duplicates=duplicates, invalid=invalid, late=late)
    records, kind, total = _input(p, file, fmt, generate, seed=seed, mix=mix)
    saved = open(save, "w") if save else None  # noqa: SIM115
    try:
        stats, count, elapsed, failure = _send(
            producer, records, file, kind, rate, saved, total, p.topic.name
        )
    finally:
        if saved:
            saved.close()
    _produce_summary(stats, count, elapsed)
    if stats.fatal and failure is None:
        failure = f"the Kafka producer failed fatally: {stats.fatal}"
    right = refused(failure, settings) if failure else None
    if right is not None:  # the principal lacks a right: nothing was acknowledged, a grant is the fix
        raise right
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


def _input(
    p: Pipeline, file: Path | None, fmt: str | None, generate: int | None, *, seed: int, mix: Mix
) -> tuple[Iterator[dict] | None, str, int | None]:
    """What to produce: generated records (an iterator, ``json``, their number), or a file's
    format (None: ``_units`` reads the file)."""
    from lambdalake.produce.generator import generate as generate_records
    from lambdalake.produce.reader import format_of

    if generate is not None:
        if p.generator is not None:
            return generate_records(p.generator.kind, generate, seed=seed, mix=mix), "json", generate
        # A pipeline of the user's own: records drawn from its schema and rules.
        from lambdalake.produce.schema_stream import SchemaStream

        return iter(SchemaStream(generate, seed=seed, mix=mix, clock=time.time, pipeline=p)), "json", generate
    assert file is not None
    if str(file) != "-" and not Path(file).is_file():
        raise LambdalakeError(
            f"input file {file} does not exist or is not a file",
            fix="check the path given to --file (or use '-' to read standard input)",
        )
    if fmt not in (None, "json", "csv", "parquet"):
        raise LambdalakeError(f"unknown --format {fmt!r}", fix="use json, csv or parquet")
    kind = format_of(file, fmt)  # type: ignore[arg-type]
    if kind != "json" and str(file) == "-":
        raise LambdalakeError("standard input is read as JSON lines", fix="give a file for CSV or Parquet")
    return None, kind, None


def _send(
    producer: EventProducer,
    records: Iterator[dict] | None,
    file: Path | None,
    kind: str,
    rate: float | None,
    saved: TextIO | None,
    total: int | None,
    topic: str,
) -> tuple[ProduceStats, int, float, str | None]:
    """Send every record (at ``rate`` per second at most), showing progress; Ctrl-C flushes what is
    in flight. Returns the producer's stats, the records sent, the seconds taken and a failure."""
    from lambdalake.produce.producer import ProducerFailed

    t0 = time.monotonic()
    count = 0
    progress = Progress(
        TextColumn(f"[bold]{topic}[/]"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[rate]:>9,.0f} ev/s"), TimeElapsedColumn(),
        console=console, transient=True, disable=not console.is_terminal,
    )  # fmt: skip
    failure: str | None = None
    shown = 0
    with _interruptible() as stop, progress:
        task = progress.add_task("produce", total=total, rate=0.0)
        try:
            for n in _units(producer, records, file, kind, rate, saved):
                count += n
                if rate:
                    ahead = count / rate - (time.monotonic() - t0)
                    if ahead > 0:
                        producer.poll(ahead)
                if count - shown >= 5000:
                    shown = count
                    progress.update(task, completed=count, rate=count / max(time.monotonic() - t0, 1e-9))
                if stop[0]:
                    console.print("[yellow]interrupted: flushing what is in flight...[/]")
                    break
        except ProducerFailed as exc:
            failure = f"the Kafka producer failed fatally: {exc}"
        except OSError as exc:
            failure = f"reading the input failed: {exc}"
        stats = producer.flush()
    return stats, count, time.monotonic() - t0, failure


def _units(
    producer: EventProducer,
    records: Iterator[dict] | None,
    file: Path | None,
    kind: str,
    rate: float | None,
    saved: TextIO | None,
) -> Iterator[int]:
    """Sends the input in units (a record, a line or a chunk), yielding each unit's record count.

    Files go in chunks through the columnar path (:meth:`EventProducer.send_json_lines`,
    :meth:`EventProducer.send_batch`); generated records, and JSON lines at a ``rate``, one by one.
    """
    from lambdalake.produce.reader import line_chunks, table_batches

    if records is not None:
        for item in records:
            if saved:
                saved.write(json.dumps(item) + "\n")
            producer.send(item)
            yield 1
        return
    assert file is not None
    if kind != "json":
        rows = max(1, int(rate // 10)) if rate else 65_536
        for batch in table_batches(file, kind, rows=rows):  # type: ignore[arg-type]
            producer.send_batch(batch)
            yield batch.num_rows
        return
    with sys.stdin.buffer if str(file) == "-" else open(file, "rb") as stream:
        if rate:
            for line in stream:
                if line.strip():
                    producer.send_json_line(line)
                    yield 1
            return
        for chunk in line_chunks(stream):
            producer.send_json_lines(chunk)
            yield len(chunk)


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
