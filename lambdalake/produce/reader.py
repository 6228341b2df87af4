"""Input files read in chunks for columnar producing: JSON lines, CSV and Parquet."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Literal

import pyarrow as pa

Format = Literal["json", "csv", "parquet"]

#: Bytes of JSON lines read per chunk: large enough for columnar work to pay, small enough that
#: the first records go out at once.
CHUNK_BYTES = 4 << 20


def format_of(path: Path, given: Format | None) -> Format:
    """``given``, else the format the file name says (``.csv``, ``.parquet``/``.pq``; JSON lines
    otherwise, stdin included)."""
    if given is not None:
        return given
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "csv"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    return "json"


def line_chunks(stream: BinaryIO, *, chunk_bytes: int = CHUNK_BYTES) -> Iterator[list[bytes]]:
    """The non-blank lines of ``stream``, each with its line ending as iterating the file gives it,
    in chunks of about ``chunk_bytes``. A pipe's chunk is whatever complete lines have arrived."""
    read = getattr(stream, "read1", stream.read)
    rest = b""
    while True:
        data = read(chunk_bytes)
        if not data:
            break
        data = rest + data
        cut = data.rfind(b"\n") + 1
        rest = data[cut:]
        if cut:
            parts = data[:cut].split(b"\n")
            lines = [p + b"\n" for p in parts[:-1] if p.strip()]
            if lines:
                yield lines
    if rest.strip():
        yield [rest]


def table_batches(path: Path, fmt: Format, *, rows: int = 65_536) -> Iterator[pa.RecordBatch]:
    """CSV (header row; types inferred by pyarrow, empty cells as nulls) or Parquet as record batches."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        yield from pq.ParquetFile(path).iter_batches(batch_size=rows)
        return
    import pyarrow.csv as pacsv

    reader = pacsv.open_csv(path, read_options=pacsv.ReadOptions(block_size=1 << 22))
    for batch in reader:
        for start in range(0, batch.num_rows, rows):
            yield batch.slice(start, rows)
