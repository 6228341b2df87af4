"""The master dataset's data files: what the tasks that archive events write and read.

The Delta log around them (the driver's commits, :mod:`lambdalake.master`) needs delta-rs; these
need Arrow only, so the Python workers that archive events never import delta-rs (and carry its
memory in each worker).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow import fs as pafs

#: The master dataset's partition column, and the Hive value of a null one.
PARTITION = "event_date"
NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"


def write_event_files(events: pa.Table, *, path: str, event_time: str, name: str) -> list[str]:
    """Write ``events`` as one Parquet file per event date; return their paths relative to ``path``.

    Runs on executors. ``name`` must be unique to the records (e.g. their Kafka coordinates): a file
    that already exists under that name holds the same records (an earlier attempt of the same
    micro-batch) and is left as it is, so a committed file is never rewritten. Each file appears
    whole or not at all (written aside, then moved into place).
    """
    if events.num_rows == 0:
        return []
    filesystem, root = pafs.FileSystem.from_uri(path)
    root = root.rstrip("/")
    dates = pc.cast(pc.cast(events.column(event_time), pa.timestamp("us", tz="UTC")), pa.date32())
    filesystem.create_dir(f"{root}/_staging", recursive=True)
    written = []
    for date in pc.unique(dates).to_pylist():
        value = NULL_PARTITION if date is None else date.isoformat()
        relative = f"{PARTITION}={value}/{name}.parquet"
        target = f"{root}/{relative}"
        written.append(relative)
        if filesystem.get_file_info(target).type != pafs.FileType.NotFound:
            continue
        rows = events.filter(pc.is_null(dates) if date is None else pc.equal(dates, pa.scalar(date)))
        filesystem.create_dir(target.rsplit("/", 1)[0], recursive=True)
        # Named after the file (so the run id leads) to let the run's next start clear what a killed
        # attempt left half-written: see MasterDataset.clear_staging.
        staging = f"{root}/_staging/{name}.{value}.{uuid.uuid4().hex}.parquet"
        pq.write_table(rows, staging, filesystem=filesystem, compression="snappy")
        filesystem.move(staging, target)
    return written


def offsets_present(uris: Sequence[str], *, partition: int, start: int, end: int) -> pa.Array:
    """The offsets ``[start, end)`` of ``partition`` that the files ``uris`` hold (runs on executors;
    only the two coordinate columns are read)."""
    if not uris:
        return pa.array([], pa.int64())
    filesystem, _ = pafs.FileSystem.from_uri(uris[0])
    paths = [pafs.FileSystem.from_uri(u)[1] for u in uris]
    offset = pc.field("_offset")
    wanted = (pc.field("_partition") == partition) & (offset >= start) & (offset < end)
    import pyarrow.dataset as pads  # replay's tasks only

    found = pads.dataset(paths, format="parquet", filesystem=filesystem).to_table(
        columns=["_offset"], filter=wanted
    )
    return found.column("_offset").combine_chunks().cast(pa.int64())
