"""Small files under the storage root (status, run ids), on whatever filesystem the root names.

The storage root is a local folder on one machine and an object store (``s3://``, ``gs://``, ...) on a
cluster; these helpers go through pyarrow's filesystems so the same code works on both.
"""

from __future__ import annotations

import uuid

from pyarrow import fs as pafs


def write_bytes(uri: str, data: bytes) -> None:
    """Write ``data`` to ``uri`` whole, so a reader sees the old or the new content, never a part.

    On an object store one PUT does that (an object appears whole when its upload completes), and a
    move would be a copy plus a delete that can leave a temporary object behind. On a filesystem
    the data is written aside, then moved over the old file."""
    filesystem, path = pafs.FileSystem.from_uri(uri)
    if filesystem.type_name != "local":
        with filesystem.open_output_stream(path) as out:
            out.write(data)
        return
    filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
    aside = f"{path}.{uuid.uuid4().hex[:8]}.tmp"  # two writers of one file never share a temp file
    with filesystem.open_output_stream(aside) as out:
        out.write(data)
    filesystem.move(aside, path)


def read_bytes(uri: str) -> bytes | None:
    """The content of ``uri``, or None if there is no such file."""
    filesystem, path = pafs.FileSystem.from_uri(uri)
    if filesystem.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    with filesystem.open_input_stream(path) as stream:
        return stream.read()


def write_text(uri: str, text: str) -> None:
    """:func:`write_bytes` for text."""
    write_bytes(uri, text.encode())


def read_text(uri: str) -> str | None:
    """:func:`read_bytes` for text."""
    data = read_bytes(uri)
    return None if data is None else data.decode()


def delete_file(uri: str) -> None:
    """Delete the file at ``uri``."""
    filesystem, path = pafs.FileSystem.from_uri(uri)
    filesystem.delete_file(path)


def list_files(folder_uri: str, *, prefix: str = "", suffix: str = "") -> list[str]:
    """URIs of the files directly in ``folder_uri`` whose names match, sorted (none if no folder)."""
    filesystem, path = pafs.FileSystem.from_uri(folder_uri)
    infos = filesystem.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    base = folder_uri.rstrip("/")
    names = sorted(
        i.base_name for i in infos
        if i.type == pafs.FileType.File and i.base_name.startswith(prefix) and i.base_name.endswith(suffix)
    )  # fmt: skip
    return [f"{base}/{name}" for name in names]


def delete_folder(folder_uri: str) -> bool:
    """Delete ``folder_uri`` and everything under it; returns whether it existed."""
    filesystem, path = pafs.FileSystem.from_uri(folder_uri)
    if filesystem.get_file_info(path).type == pafs.FileType.NotFound:
        return False
    filesystem.delete_dir(path)
    return True
