"""What every command module shares: the consoles, argument types, the pipeline lookup, the writer lease."""

from __future__ import annotations

import logging
import math
from enum import StrEnum
from typing import Annotated, Any

import typer
from rich.console import Console

from lambdalake.errors import LambdalakeError
from lambdalake.json_form import json_value
from lambdalake.pipeline import Pipeline, configured_pipeline
from lambdalake.settings import Settings


class LogLevel(StrEnum):
    """How much `speed run` logs."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


console = Console(stderr=True)
out = Console()

PipelineArg = Annotated[str, typer.Argument(help="Pipeline name: a file pipelines/<name>.toml.")]
OnlyOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--only",
        help="Only this service (broker, registry, cassandra, spark) or node (cassandra-2); repeatable.",
    ),
]


def _one_line(record: logging.LogRecord) -> bool:
    """A client library's record without its traceback (lambdalake's own records are left as they are)."""
    if not record.name.startswith("lambdalake"):
        record.exc_info = None
        record.exc_text = None
    return True


def job_logging(level: str = "INFO") -> None:
    """The log of a long-running command (a speed job, the batch scheduler): lambdalake's lines at
    ``level``, py4j's and the Cassandra driver's at ERROR and one line each. The driver logs a failed
    connection with its traceback, and users see no stack trace: the command's own error that follows
    names the service and the fix."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("lambdalake").setLevel(level)
    for noisy in ("py4j", "cassandra"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_one_line)


def pipeline_of(name: str, settings: Settings) -> Pipeline:
    return configured_pipeline(name, settings)


def timestamp_ms(text: str) -> int:
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


DryRun = Annotated[bool, typer.Option("--dry-run", help="Print what would be touched; change nothing.")]


def cell_text(value: Any) -> str:
    """A value as a table cell shows it: its JSON form (:mod:`lambdalake.json_form`), finite floats
    to six digits."""
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.6g}"
    value = json_value(value)
    return "" if value is None else str(value)
