"""The ``lambdalake`` command line: one module per command group, joined here (the composition root;
layers are imported inside each command)."""

from __future__ import annotations

import contextlib
import os
import sys

import typer
from rich.markup import escape

from lambdalake.cli import batch, master, offsets, platform, produce, replay, schemas, serving, speed
from lambdalake.cli.common import console
from lambdalake.errors import LambdalakeError

app = typer.Typer(
    name="lambdalake",
    help="A Kafka-backed lambda-architecture data platform: embedded services, schemas, producers and "
    "pipeline jobs. Configuration comes from LAMBDALAKE_* environment variables (docs/production.md).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for module in (platform, produce, replay, serving):
    app.add_typer(module.app)
app.add_typer(schemas.app, name="schemas")
app.add_typer(speed.app, name="speed")
app.add_typer(batch.app, name="batch")
app.add_typer(offsets.app, name="offsets")
app.add_typer(master.app, name="master")


def main() -> None:
    try:
        _point_clients_at_the_store()
        app()
    except LambdalakeError as exc:
        # User text (file contents, record values) may hold rich markup: print it escaped.
        console.print(f"[red]error:[/] {escape(exc.message)}")
        if exc.fix:
            console.print(f"[yellow]fix:[/] {escape(exc.fix)}")
        sys.exit(2)
    except Exception as exc:
        from lambdalake.grants import refused

        # A right the login lacks (the fix is a grant, not a bug report), or the object store's
        # refusal or silence (a bucket, a key, its address).
        known = refused(exc) or _store_failure(exc)
        if known is not None:
            console.print(f"[red]error:[/] {escape(known.message)}")
            console.print(f"[yellow]fix:[/] {escape(known.fix or '')}")
            sys.exit(2)
        # A failure nobody foresaw: say what it was and how to see more, not a bare traceback.
        if os.environ.get("LAMBDALAKE_DEBUG"):
            raise
        console.print(f"[red]error:[/] unexpected {type(exc).__name__}: {escape(str(exc))}")
        console.print("[yellow]fix:[/] rerun with LAMBDALAKE_DEBUG=1 for the full trace, and report it")
        sys.exit(1)


def _store_failure(exc: BaseException) -> LambdalakeError | None:
    from lambdalake.object_store import explain
    from lambdalake.settings import get_settings

    try:
        return explain(exc, get_settings())
    except LambdalakeError:  # invalid settings: the error stands as it is
        return None


def _point_clients_at_the_store() -> None:
    """An ``s3://`` storage root: this process's S3 clients (pyarrow, delta-rs) and the processes it
    starts are told the store's endpoint and keys."""
    from lambdalake.object_store import use
    from lambdalake.settings import get_settings

    # Invalid settings: the command that reads them says which and how to fix it.
    with contextlib.suppress(LambdalakeError):
        use(get_settings())
