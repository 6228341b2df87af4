"""What a batch run is and where its views live: shared by the job that makes a run and the
publish and restore that write one to Cassandra (none of them imports another for it)."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Commit metadata of a run's Delta views and identity index: the run that wrote them.
RUN_ID = "lambdalake.run_id"
#: ... and the master dataset's Delta version it read.
MASTER_VERSION = "lambdalake.master_version"


@dataclass
class BatchRun:
    """What one run did: the summary table and the status file show it."""

    pipeline: str
    run_id: str
    #: ``full`` (every view rebuilt from all of the master dataset) or ``incremental`` (merged into a base).
    kind: str = "full"
    #: Why a run is full, or which version an incremental run merged into.
    reason: str = ""
    #: The epochs an incremental run recomputed: those after the base's horizon (first, last), and
    #: older ones master dataset commits changed (``changed_by``: their versions).
    new_epochs: list[int] = field(default_factory=list)
    changed_epochs: list[int] = field(default_factory=list)
    changed_by: list[int] = field(default_factory=list)
    horizon: int | None = None
    horizon_end_ms: int | None = None
    master_version: int | None = None
    boundaries: dict[str, int] = field(default_factory=dict)
    events_read: int = 0
    duplicates: int = 0
    after_horizon: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    delta_versions: dict[str, int] = field(default_factory=dict)
    batch_version: int | None = None
    #: How the publish wrote: every row in a new generation, or the changed cells into the base's.
    publish: str | None = None
    rows_written: dict[str, int] = field(default_factory=dict)
    #: The Cassandra nodes that were down while the publish created and wrote its tables.
    cassandra_down: list[str] = field(default_factory=list)
    outcome: str = "running"
    quality_report: str | None = None
    stages: dict[str, float] = field(default_factory=dict)
