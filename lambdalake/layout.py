"""Where lambdalake keeps what it stores: every path under the storage root and every Cassandra table
name is derived here, and nowhere else.

Under ``settings.storage_root`` (a local folder or an object-store URI)::

    master/<pipeline>/                the master dataset (Delta): every valid event, once
    views/<pipeline>/<view>/          a batch view (Delta), one table per view version
    identities/<pipeline>/            the batch's identity index (Delta)
    checkpoints/<pipeline>/           the speed job's streaming checkpoints (lambdalake.speed.checkpoints)
    status/speed-<pipeline>.json      the speed job's progress
    status/batch-<pipeline>.json      the last batch run's summary
    status/batch-schedule.json        the batch scheduler's last runs
    status/probe-<host>-<id>          written and deleted as a job starts: may it write? (never kept)
    reports/<pipeline>/<run>-quality.md   a batch run's quality report

In the Cassandra keyspace, the platform's own tables (:data:`BATCH_META_TABLE`,
:data:`BATCH_CLAIMS_TABLE`, :data:`LEASES_TABLE`), and per pipeline and view version (its internal
name)::

    <pipeline>__<view>__speed         a windowed view's speed rows
    <pipeline>__<view>__speed_latest  a latest view's speed candidates
    <pipeline>__<view>__b<generation> a generation of its batch versions

A change to any of these is a change of the stored layout: it comes with a new
:data:`LAYOUT_VERSION` and one migration step (``lambdalake migrate``,
:mod:`lambdalake.control.migrate`), never with code that reads both. The platform's own tables carry
the version they were written under in their comment (:func:`layout_comment`); every command refuses
a keyspace of another version (:mod:`lambdalake.cassandra.stored_layout`).
"""

from __future__ import annotations

import re


def _root(storage_root: str) -> str:
    return storage_root.rstrip("/")


def master_path(storage_root: str, pipeline: str) -> str:
    """The master dataset of a pipeline."""
    return f"{_root(storage_root)}/master/{pipeline}"


def views_path(storage_root: str, pipeline: str, view: str) -> str:
    """A batch view's Delta table (``view``: a version's internal name)."""
    return f"{_root(storage_root)}/views/{pipeline}/{view}"


def identities_path(storage_root: str, pipeline: str) -> str:
    """A pipeline's identity index (the batch layer's)."""
    return f"{_root(storage_root)}/identities/{pipeline}"


def checkpoints_path(storage_root: str, pipeline: str) -> str:
    """The folder of a pipeline's streaming checkpoints (one per query)."""
    return f"{_root(storage_root)}/checkpoints/{pipeline}"


def status_folder(storage_root: str) -> str:
    """The status files of every pipeline's jobs."""
    return f"{_root(storage_root)}/status"


#: The speed jobs' status files start with this, then the pipeline's name.
SPEED_STATUS_PREFIX = "speed-"


def speed_status_file(storage_root: str, pipeline: str) -> str:
    """Where a pipeline's speed job keeps its status (per streaming query)."""
    return f"{status_folder(storage_root)}/{SPEED_STATUS_PREFIX}{pipeline}.json"


def batch_status_file(storage_root: str, pipeline: str) -> str:
    """The last batch run's summary."""
    return f"{status_folder(storage_root)}/batch-{pipeline}.json"


def schedule_state_file(storage_root: str) -> str:
    """The batch scheduler's record of its last runs."""
    return f"{status_folder(storage_root)}/batch-schedule.json"


def probe_file(storage_root: str, token: str) -> str:
    """An empty file a job writes and deletes as it starts, to learn that the store lets it write
    (lambdalake.object_store). In the status folder, which every job writes anyway: on an object
    store, deleting it leaves at most that folder's own marker (pyarrow keeps a folder it empties)."""
    return f"{status_folder(storage_root)}/probe-{token}"


def quality_report(storage_root: str, pipeline: str, run_id: str) -> str:
    """A batch run's quality report."""
    return f"{_root(storage_root)}/reports/{pipeline}/{run_id}-quality.md"


# --- Cassandra tables ---------------------------------------------------------------------------

#: The version of the stored layout this code writes and reads.
LAYOUT_VERSION = 2
#: The release each layout version came with.
LAYOUT_RELEASES = {1: "0.1.0", 2: "0.2.0"}
_COMMENT = "lambdalake stored layout "


def layout_comment(version: int = LAYOUT_VERSION) -> str:
    """The comment of the platform's own tables, naming the layout they hold."""
    return f"{_COMMENT}{version}"


def comment_layout(comment: str | None) -> int:
    """The layout a platform table's comment names (1: none, as 0.1.0 wrote them)."""
    if comment and comment.startswith(_COMMENT) and comment[len(_COMMENT) :].isdigit():
        return int(comment[len(_COMMENT) :])
    return 1


#: Each pipeline's active batch version and view versions (lambdalake.cassandra.active).
BATCH_META_TABLE = "lambdalake_batch"
#: The batch versions publishes claimed.
BATCH_CLAIMS_TABLE = "lambdalake_batch_claims"
#: The one-writer leases (lambdalake.lease).
LEASES_TABLE = "lambdalake_leases"


def speed_table(pipeline: str, view: str, *, latest: bool) -> str:
    """The table of a view version's speed rows: named per pipeline, so two pipelines may each have
    a view called ``hourly``, and told apart from the batch table by its suffix; a ``latest`` view's
    candidates are under a suffix of their own."""
    return f"{pipeline}__{view}__speed_latest" if latest else f"{pipeline}__{view}__speed"


def batch_table(pipeline: str, view: str, generation: int) -> str:
    """The table of one generation of a view version's batch versions."""
    return f"{pipeline}__{view}__b{generation}"


def view_tables(pipeline: str, view: str) -> re.Pattern[str]:
    """Matches every table of one view version (its speed table and each batch generation's)."""
    return re.compile(rf"^{re.escape(pipeline)}__{re.escape(view)}__(speed|speed_latest|b\d+)$")


def batch_generation(pipeline: str, table: str) -> int | None:
    """The generation of a batch table of ``pipeline`` (None: ``table`` is not one)."""
    found = re.match(rf"^{re.escape(pipeline)}__[a-z0-9_]+__b(\d+)$", table)
    return int(found.group(1)) if found else None
