"""Which stored layout a keyspace holds (:data:`lambdalake.layout.LAYOUT_VERSION`), and the refusal
of any other.

lambdalake's own tables (the batch versions, their claims, the leases) are created with the layout
version in their comment, so the check reads only the driver's schema metadata: no query, no right
beyond those every role has. ``lambdalake migrate`` alone changes it. Code never reads two layouts.
"""

from __future__ import annotations

import threading

from cassandra.cluster import Session

from lambdalake.errors import ConfigurationError
from lambdalake.layout import (
    BATCH_CLAIMS_TABLE,
    BATCH_META_TABLE,
    LAYOUT_RELEASES,
    LAYOUT_VERSION,
    LEASES_TABLE,
    comment_layout,
)

#: lambdalake's own tables, each stamped with the layout it was written under.
PLATFORM_TABLES = (BATCH_META_TABLE, BATCH_CLAIMS_TABLE, LEASES_TABLE)

_checked: set[tuple[int, str]] = set()
_lock = threading.Lock()


def stored_layouts(session: Session, keyspace: str) -> dict[str, int]:
    """Per platform table ``keyspace`` holds, the layout version its comment names."""
    ks = session.cluster.metadata.keyspaces.get(keyspace)
    if ks is None:
        return {}
    return {
        name: comment_layout(ks.tables[name].options.get("comment"))
        for name in PLATFORM_TABLES
        if name in ks.tables
    }


def release(version: int) -> str:
    """The lambdalake release that wrote ``version``."""
    return LAYOUT_RELEASES.get(version, f"of stored layout {version}")


def require_current(session: Session, keyspace: str) -> None:
    """Refuse a keyspace whose platform tables hold another layout, naming the fix. Once per
    process and keyspace: a layout changes only by ``lambdalake migrate``, while nothing runs.

    Raises:
        ConfigurationError: An older layout (run ``lambdalake migrate``) or a newer one (this
            lambdalake is older than the one that wrote it).
    """
    key = (id(session.cluster), keyspace)
    if key in _checked:
        return
    with _lock:
        found = set(stored_layouts(session, keyspace).values())
        if found and min(found) < LAYOUT_VERSION:
            raise ConfigurationError(
                f"keyspace {keyspace!r} holds the stored layout of lambdalake {release(min(found))}; "
                f"this is lambdalake {release(LAYOUT_VERSION)}, which reads only its own",
                fix="stop the jobs (`lambdalake undeploy`), run `lambdalake migrate` once, then deploy "
                'again (docs/operations.md, "Upgrading")',
            )
        refuse_newer(keyspace, found)
        _checked.add(key)


def refuse_newer(keyspace: str, found: set[int]) -> None:
    """Raise :class:`ConfigurationError` when a layout in ``found`` is newer than this release's."""
    if found and max(found) > LAYOUT_VERSION:
        raise ConfigurationError(
            f"keyspace {keyspace!r} holds the stored layout of lambdalake {release(max(found))}, "
            f"newer than this lambdalake ({release(LAYOUT_VERSION)})",
            fix=f"run lambdalake {release(max(found))} or later",
        )


def forget(session: Session, keyspace: str) -> None:
    """Check the keyspace again next time (``migrate`` changed it)."""
    _checked.discard((id(session.cluster), keyspace))
