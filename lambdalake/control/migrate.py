"""``lambdalake migrate``: bring what a keyspace and its pipelines' files store to this release's
layout (:data:`lambdalake.layout.LAYOUT_VERSION`), one step per layout version, while no job runs.

Each step is the only code that knows the layout before it: the rest of lambdalake reads its own
layout alone and refuses any other (:mod:`lambdalake.cassandra.stored_layout`). A step is written so
that running it again after an interruption finishes it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cassandra.cluster import Session

from lambdalake.cassandra.session import connect, execute_ddl, refresh_metadata
from lambdalake.cassandra.stored_layout import PLATFORM_TABLES, forget, refuse_newer, release, stored_layouts
from lambdalake.errors import ConfigurationError
from lambdalake.layout import BATCH_META_TABLE, LAYOUT_VERSION, LEASES_TABLE, layout_comment
from lambdalake.settings import Settings


@dataclass
class Migration:
    """What ``migrate`` found and did."""

    keyspace: str
    #: The layout found (None: the keyspace holds nothing of lambdalake's).
    found: int | None
    #: One line per change made, in order.
    changes: list[str] = field(default_factory=list)


def migrate(settings: Settings) -> Migration:
    """Run every step from the keyspace's layout to this release's.

    Raises:
        ConfigurationError: A job holds a writer lease (stop the jobs first), or the keyspace holds a
            layout newer than this release's.
    """
    keyspace = settings.cassandra.keyspace
    session = connect(settings.cassandra)
    found = stored_layouts(session, keyspace)
    done = Migration(keyspace=keyspace, found=min(found.values()) if found else None)
    if not found:
        return done
    refuse_newer(keyspace, set(found.values()))
    if min(found.values()) == LAYOUT_VERSION:
        return done
    _require_no_writer(session, keyspace)
    for version in range(min(found.values()), LAYOUT_VERSION):
        done.changes += [f"{release(version)} -> {release(version + 1)}: {line}"
                         for line in STEPS[version](settings, session)]  # fmt: skip
    forget(session, keyspace)
    return done


def _require_no_writer(session: Session, keyspace: str) -> None:
    """Refuse while any writer lease is held: a job running through the step would write the old
    layout into the new."""
    ks = session.cluster.metadata.keyspaces[keyspace]
    if LEASES_TABLE not in ks.tables:
        return
    rows = list(session.execute(f'SELECT pipeline, lease, holder, host FROM "{keyspace}"."{LEASES_TABLE}"'))
    held = [f"{r.pipeline}/{r.lease} by {r.holder} on {r.host}" for r in rows if r.holder]
    if held:
        raise ConfigurationError(
            f"writers are running: {', '.join(held[:5])}",
            fix="stop them (`lambdalake undeploy`, or wait for a killed one's lease to end), then migrate",
        )


def _from_0_1(settings: Settings, session: Session) -> list[str]:
    """0.1.0 to 0.2.0: the master dataset has one name. The batch versions' ``bronze_version``
    column becomes ``master_version`` (Cassandra renames no regular column: added, copied, dropped);
    the expectations files' ``bronze`` key becomes ``master``; the platform tables are stamped.
    The batch views' Delta commits keep the key they were written with: the next batch run after
    the step rebuilds in full (an incremental one needs its base's ``lambdalake.master_version``),
    and ``batch restore`` takes only a version written since."""
    keyspace = settings.cassandra.keyspace
    table = f'"{keyspace}"."{BATCH_META_TABLE}"'
    changes: list[str] = []
    ks = session.cluster.metadata.keyspaces[keyspace]
    meta = ks.tables.get(BATCH_META_TABLE)
    if meta is not None and "bronze_version" in meta.columns:
        if "master_version" not in meta.columns:
            execute_ddl(session, f"ALTER TABLE {table} ADD master_version bigint")
        rows = list(session.execute(f"SELECT pipeline, bronze_version FROM {table}"))
        for row in rows:
            if row.bronze_version is not None:
                session.execute(
                    f"UPDATE {table} SET master_version = %s WHERE pipeline = %s",
                    [row.bronze_version, row.pipeline],
                )
        execute_ddl(session, f"ALTER TABLE {table} DROP bronze_version")
        changes.append(f"{BATCH_META_TABLE}.bronze_version -> master_version ({len(rows)} pipeline(s))")
    for path in sorted(Path(settings.pipelines_dir).glob("*.expectations.json")):
        suite = json.loads(path.read_text())
        if isinstance(suite, dict) and "bronze" in suite:
            renamed = {("master" if k == "bronze" else k): v for k, v in suite.items()}
            path.write_text(json.dumps(renamed, indent=2) + "\n")
            changes.append(f"{path}: key bronze -> master")
    changes += _stamp(session, keyspace, 2)
    return changes


def _stamp(session: Session, keyspace: str, version: int) -> list[str]:
    """Write ``version`` into every platform table's comment (the step's last act: an interrupted
    step is found at its old version and run again)."""
    ks = session.cluster.metadata.keyspaces[keyspace]
    stamped = []
    for name in PLATFORM_TABLES:
        if name in ks.tables:
            execute_ddl(
                session, f'ALTER TABLE "{keyspace}"."{name}" WITH comment = \'{layout_comment(version)}\''
            )
            refresh_metadata(session, keyspace, name)
            stamped.append(name)
    return [f"stamped layout {version}: {', '.join(stamped)}"]


#: Per layout version, the step to the next one.
STEPS: dict[int, Callable[[Settings, Session], list[str]]] = {1: _from_0_1}
