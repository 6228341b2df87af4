"""``lambdalake query`` and ``serve``, and the per-pipeline half of ``status``."""

from __future__ import annotations

import csv
import io
import json
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from lambdalake.cli.common import (
    PipelineArg,
    cell_text,
    console,
    out,
)
from lambdalake.json_form import json_value
from lambdalake.settings import get_settings

app = typer.Typer()

if TYPE_CHECKING:
    from lambdalake.serving.answers import Answer


class Format(StrEnum):
    table = "table"
    json = "json"
    csv = "csv"


@app.command()
def query(
    pipeline: PipelineArg,
    view: Annotated[str, typer.Argument(help="View name (see `lambdalake pipelines`).")],
    key: Annotated[
        str, typer.Option(help="The key; a composite key's values separated by commas, in key order.")
    ],
    start: Annotated[
        str | None,
        typer.Option("--from", help="Windows starting at or after this (ISO-8601 or epoch ms)."),
    ] = None,
    end: Annotated[
        str | None, typer.Option("--to", help="Windows starting before this (ISO-8601 or epoch ms).")
    ] = None,
    fmt: Annotated[Format, typer.Option("--format", help="Output format.")] = Format.table,
    q: Annotated[
        str | None,
        typer.Option("--q", help="Quantiles `quantiles` aggregates answer instead of their own (0.5,0.999)."),
    ] = None,
) -> None:
    """The merged answer for one key: the active batch version's row combined with the speed rows of
    later ingest epochs, with its provenance. Exits 1 when the key has no rows."""
    from lambdalake.serving import ServingClient
    from lambdalake.serving.client import quantile_list

    settings = get_settings().as_role("serving")
    wanted = quantile_list([q]) if q else None
    answer = ServingClient(settings=settings).query(
        pipeline, view, key, start=start, end=end, quantiles=wanted
    )
    if fmt is Format.json:
        out.print_json(json.dumps(answer.to_dict()))
    elif fmt is Format.csv:
        out.print(answer_csv(answer), end="", markup=False, highlight=False)
    else:
        print_answer(answer)
    if not answer.found:
        raise typer.Exit(1)


def answer_rows(answer: Answer) -> list[dict[str, Any]]:
    """One flat dict per row (a ``latest`` answer has one), provenance columns included, values in
    their JSON form (:mod:`lambdalake.json_form`)."""
    if answer.latest is not None:
        values = json_value(answer.latest.values)
        return [{**values, "_source": answer.latest.source, "_rank": answer.latest.rank}]
    return [
        {"window_start": json_value(w.window_start), **flat(json_value(w.values)),
         "_from_batch": w.from_batch, "_speed_epochs": " ".join(map(str, w.speed_epochs))}
        for w in answer.windows
    ]  # fmt: skip


def flat(values: dict[str, Any]) -> dict[str, Any]:
    """A sketch's answer as columns of their own (``vehicles.estimate``, ``speed.q0.95``)."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        if not isinstance(value, dict):
            out[name] = value
            continue
        for part, inner in value.items():
            if isinstance(inner, dict):
                out.update({f"{name}.q{q}": x for q, x in inner.items()})
            else:
                out[f"{name}.{part}"] = inner
    return out


def answer_csv(answer: Answer) -> str:
    rows = answer_rows(answer)
    buffer = io.StringIO()
    if rows:
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return buffer.getvalue()


def print_answer(answer: Answer) -> None:
    """A table for people: the view's aggregates (not their stored components) and, per window,
    which layers it came from."""
    key = ", ".join(f"{k}={v}" for k, v in answer.key.items())
    out.print(f"[bold]{answer.pipeline}/{answer.view}[/] {key}: {answer.provenance.summary}")
    if answer.latest is not None:
        table = Table("column", "value")
        for name, value in answer.latest.values.items():
            table.add_row(name, cell_text(value))
        table.add_row("[dim]from[/]", f"{answer.latest.source} (rank {answer.latest.rank})")
        out.print(table)
        return
    if not answer.windows:
        out.print("(no rows for this key)")
        return
    rows = [flat(w.values) for w in answer.windows]
    names = list(dict.fromkeys(n for values in rows for n in values if not _component(n, values)))
    table = Table("window (UTC)", *names, "from")
    for w, values in zip(answer.windows, rows, strict=True):
        layers = (["batch"] if w.from_batch else []) + (
            [f"speed {', '.join(map(str, w.speed_epochs))}"] if w.speed_epochs else []
        )
        table.add_row(
            w.window_start.strftime("%Y-%m-%d %H:%M"),
            *[cell_text(values.get(n)) for n in names],
            " + ".join(layers),
        )
    out.print(table)


def _component(name: str, values: dict[str, Any]) -> bool:
    """An average's stored sum or count (shown derived, as the average)."""
    return any(name.endswith(s) and name.removesuffix(s) in values for s in ("_sum", "_count"))


@app.command()
def serve(
    host: Annotated[
        str | None, typer.Option(help="Address to bind (default LAMBDALAKE_SERVING__HOST).")
    ] = None,
    port: Annotated[int | None, typer.Option(help="Port (default LAMBDALAKE_SERVING__PORT, 8080).")] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, help="Worker processes (default LAMBDALAKE_SERVING__WORKERS, 1).")
    ] = None,
) -> None:
    """Serve the merged query over HTTP until Ctrl-C/SIGTERM: /v1/pipelines/{p}/views/{v}/keys/{k},
    /health, /metrics, OpenAPI docs at /docs. LAMBDALAKE_SERVING__TOKEN requires a bearer token."""
    import uvicorn

    settings = get_settings().as_role("serving")
    host = host or settings.serving.host
    port = port or settings.serving.port
    workers = workers or settings.serving.workers
    auth = "bearer token required" if settings.serving.token else "no token configured: open to anyone"
    scheme, tls = settings.serving.scheme, settings.serving
    console.print(f"serving on {scheme}://{host}:{port} with {workers} worker(s) (docs at /docs; {auth})")
    # Each worker builds its app (and Cassandra session) from the environment's settings.
    uvicorn.run("lambdalake.api.http:create_app", factory=True, host=host, port=port, workers=workers,
                log_level="warning", access_log=False,
                ssl_certfile=tls.ssl_certfile and str(tls.ssl_certfile),
                ssl_keyfile=tls.ssl_keyfile and str(tls.ssl_keyfile))  # fmt: skip
