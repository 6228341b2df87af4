"""``lambdalake schemas``: register and check a pipeline's Avro schemas."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lambdalake.cli.common import (
    PipelineArg,
    console,
    pipeline_of,
)
from lambdalake.errors import LambdalakeError
from lambdalake.settings import get_settings

app = typer.Typer(help="Register and check a pipeline's Avro schemas.", no_args_is_help=True)


@app.command("register")
def schemas_register(pipeline: PipelineArg) -> None:
    """Register every schema version of the pipeline, oldest first (idempotent)."""
    from lambdalake.registry import register_pipeline

    settings = get_settings()
    p = pipeline_of(pipeline, settings)
    for r in register_pipeline(settings, p):
        console.print(f"[green]✔[/] {p.schema_.subject} v{r.version} = id {r.schema_id}  ({r.file})")


@app.command("check")
def schemas_check(
    pipeline: PipelineArg,
    schema_file: Annotated[Path, typer.Argument(help="Candidate .avsc file.", exists=True, dir_okay=False)],
) -> None:
    """Check a candidate schema against the subject's compatibility level without registering it."""
    from confluent_kafka.schema_registry import Schema
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    from lambdalake.registry import check_compatibility, client

    settings = get_settings()
    p = pipeline_of(pipeline, settings)
    sr = client(settings)
    try:
        verdict = check_compatibility(
            settings, sr, p.schema_.subject, Schema(schema_file.read_text(), "AVRO")
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
    if verdict.compatible:
        console.print(f"[green]✔ compatible[/] with {p.schema_.subject}")
        return
    console.print(f"[red]✘ incompatible[/] with {p.schema_.subject}:")
    for message in verdict.reasons:
        console.print(f"  - {message}")
    raise typer.Exit(1)
