"""Helpers of ``make demo`` (lambdalake/cli/demo.sh): the demo's pipeline files, waiting for the deployed
jobs, and picking an answer that shows both layers.

The demo runs the pipelines of ``pipelines/`` with 20-second ingest epochs (and a 5-second dedup
delay) instead of their one hour, so that a batch can cover closed epochs within the demo; they are
written under the demo's own folder, with its own topics (a prefix), keyspace and storage root.

    python -m lambdalake.cli.demo pipelines DIR | wait-archived | wait-epoch-closed | pick-merchant
"""

from __future__ import annotations

import re
import sys
import time

from rich.console import Console

from lambdalake.pipeline import configured_pipeline, list_pipelines
from lambdalake.settings import PROJECT_ROOT, get_settings

console = Console(stderr=True)
DEMO_LAYERS = {"epoch": "20 seconds", "dedup_delay": "5 seconds", "grace": "2 seconds"}


def write_pipelines(folder: str) -> None:
    """pipelines/*.toml with the demo's [layers], and their expectation files, into ``folder``."""
    from pathlib import Path

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for source in sorted((PROJECT_ROOT / "pipelines").glob("*")):
        text = source.read_text()
        if source.suffix == ".toml":
            text = re.sub(r'(?m)^epoch = "[^"]*"', f'epoch = "{DEMO_LAYERS["epoch"]}"', text)
            text = re.sub(
                r'(?m)^dedup_delay = "[^"]*"',
                f'dedup_delay = "{DEMO_LAYERS["dedup_delay"]}"\ngrace = "{DEMO_LAYERS["grace"]}"',
                text,
            )
        (out / source.name).write_text(text)


def wait_archived(timeout: float = 600) -> None:
    """Until every pipeline's speed job has archived everything on its topic."""
    from lambdalake.status import pipeline_status

    settings = get_settings()
    pipelines = [configured_pipeline(n, settings) for n in list_pipelines(settings.pipelines_dir)]
    deadline = time.monotonic() + timeout
    with console.status("waiting for the speed jobs to catch up...") as status:
        while True:
            lags = {p.name: pipeline_status(settings, p).lag for p in pipelines}
            status.update(f"waiting for the speed jobs to catch up: {lags} records to go")
            if all(lag == 0 for lag in lags.values()):
                break
            if time.monotonic() > deadline:
                sys.exit(
                    f"the speed jobs did not catch up within {timeout:.0f}s: {lags}; see .lambdalake/logs/"
                )
            time.sleep(1)
    time.sleep(2)  # the windowed queries write right after the archive pass
    console.print(f"[green]✔[/] the speed jobs have archived every record ({', '.join(lags)})")


def wait_epoch_closed() -> None:
    """Until the ingest epoch that is open now has ended and its grace has passed."""
    settings = get_settings()
    pipeline = configured_pipeline(list_pipelines(settings.pipelines_dir)[0], settings)
    epoch_ms, grace_ms = pipeline.layers.epoch_ms, pipeline.layers.grace_seconds * 1000
    now = time.time() * 1000
    epoch = int(now // epoch_ms)
    wait = ((epoch + 1) * epoch_ms + grace_ms + 500 - now) / 1000
    with console.status(f"waiting {wait:.0f}s for ingest epoch {epoch} to close..."):
        time.sleep(wait)
    console.print(f"[green]✔[/] epoch {epoch} is closed: a batch now covers it")


def pick_merchant() -> None:
    """Print the merchant whose hourly answer merges the most speed epochs into a batch row."""
    from lambdalake.serving import ServingClient

    settings = get_settings()
    client = ServingClient(settings=settings)
    best, score = "merchant-0000", -1
    for i in range(50):
        key = f"merchant-{i:04d}"
        answer = client.query("offers", "merchant_offers_hourly", key)
        mixed = sum(len(w.speed_epochs) for w in answer.windows if w.from_batch)
        if mixed > score:
            best, score = key, mixed
    print(best)


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "pipelines":
        write_pipelines(sys.argv[2])
    elif command == "wait-archived":
        wait_archived()
    elif command == "wait-epoch-closed":
        wait_epoch_closed()
    elif command == "pick-merchant":
        pick_merchant()
    else:
        sys.exit(__doc__)
