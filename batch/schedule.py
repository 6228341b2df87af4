"""``lambdalake batch schedule``: runs each pipeline's batch when its cron expression comes due.

A pipeline is due when its most recent scheduled time (cron, UTC) is later than the last one this
scheduler handled (kept in ``<storage_root>/status/batch-schedule.json``, so a restarted scheduler
neither repeats a run nor skips one it missed while down: it runs a missed one once). Runs are
sequential, in one Spark session. SIGTERM stops the loop between runs (a run in progress finishes:
its publish is atomic anyway).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from croniter import croniter

from lambdalake.errors import LambdalakeError
from lambdalake.layout import schedule_state_file
from lambdalake.pipeline import Pipeline
from lambdalake.settings import Settings
from lambdalake.storage import read_text, write_text

log = logging.getLogger("lambdalake.batch")

#: Runs one pipeline's batch and returns its outcome (the scheduler's only side effect).
Runner = Callable[[Pipeline], str]


def last_due(pipeline: Pipeline, now: datetime) -> datetime:
    """The most recent time at or before ``now`` the pipeline's schedule names."""
    return croniter(pipeline.batch.schedule, now).get_prev(datetime)


class Scheduler:
    """Runs due pipelines through ``runner``.

    Args:
        settings: Where the schedule's state lives (the storage root).
        pipelines: The pipelines to schedule.
        runner: Runs one pipeline's batch, returning its outcome.
        clock: Seconds since the epoch. Default ``time.time``.
        first_run_now: A pipeline this scheduler never handled is due at once (default True: what a
            crontab line calling ``--once`` at the scheduled time wants). False waits for its next
            scheduled time (the long-running scheduler ``deploy`` starts: a fresh deployment does
            not rebuild at once).
    """

    def __init__(
        self,
        *,
        settings: Settings,
        pipelines: Sequence[Pipeline],
        runner: Runner,
        clock: Callable[[], float] = time.time,
        first_run_now: bool = True,
    ) -> None:
        self.first_run_now = first_run_now
        self.pipelines = list(pipelines)
        self.runner = runner
        self.clock = clock
        self.path = schedule_state_file(settings.storage_root)

    def _handled(self) -> dict[str, str]:
        return json.loads(read_text(self.path) or "{}")

    def due(self) -> list[tuple[Pipeline, datetime]]:
        """Pipelines whose latest scheduled time has not been handled yet (one the scheduler has
        never handled is due at once: its latest scheduled time was missed)."""
        now = datetime.fromtimestamp(self.clock(), tz=UTC)
        handled = self._handled()
        out = []
        for p in self.pipelines:
            slot = last_due(p, now)
            if p.name not in handled and not self.first_run_now:
                self._record(p.name, slot, "first seen: runs from its next scheduled time")
                continue
            if p.name not in handled or slot > datetime.fromisoformat(handled[p.name]):
                out.append((p, slot))
        return out

    def _record(self, name: str, slot: datetime, outcome: str) -> None:
        handled = self._handled()
        handled[name] = slot.isoformat()
        write_text(self.path, json.dumps(handled, indent=2))
        log.info("batch %s for %s: %s", name, slot.isoformat(), outcome)

    def run_due(self) -> dict[str, str]:
        """Run every due pipeline once; returns their outcomes. A failed run is logged and counts as
        handled (the next scheduled time tries again), so one broken pipeline does not stop others."""
        outcomes = {}
        for pipeline, slot in self.due():
            try:
                outcome = self.runner(pipeline)
            except LambdalakeError as exc:  # what a person must do comes with it
                outcome = f"failed: {exc.message}" + (f" (fix: {exc.fix})" if exc.fix else "")
            except Exception as exc:  # a run's failure must not end the scheduler
                log.exception("batch run of %s failed", pipeline.name)
                outcome = f"failed: {type(exc).__name__}: {exc}"
            self._record(pipeline.name, slot, outcome)
            outcomes[pipeline.name] = outcome
        return outcomes

    def run_forever(self, stop: threading.Event, *, poll_s: float = 30.0) -> None:
        """Run due pipelines until ``stop`` is set, waking at the next scheduled time (or ``poll_s``)."""
        while not stop.is_set():
            self.run_due()
            now = datetime.fromtimestamp(self.clock(), tz=UTC)
            upcoming = min(croniter(p.batch.schedule, now).get_next(datetime) for p in self.pipelines)
            stop.wait(max(1.0, min(poll_s, (upcoming - now).total_seconds())))
