"""Files that survive a power loss whole or not at all. A rename reaches the disk in the folder's metadata, which a
filesystem may write before the renamed file's data: without fsyncs a crash can leave a file of the right name and
no bytes (ext4 and XFS both allow it for a file renamed to a new name, and for a renamed folder's contents). So a
file or folder is synced before it is renamed into place, and the folder holding it after."""

from __future__ import annotations

import errno
import os
import uuid
from contextlib import suppress
from pathlib import Path

TMP_SUFFIX = ".tmp"


def sync_folder(folder: Path) -> None:
    """So a rename in it (or an unlink) survives a power loss. Some filesystems (FUSE, CIFS, some network ones)
    refuse fsync on a folder: the rename is done, so that is no failure of the write."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def sync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: Path) -> None:
    """Every file under `root` and every folder, `root` included, on the disk: before a staged folder is renamed
    into place."""
    for folder, _subfolders, files in os.walk(root, topdown=False):
        for name in files:
            sync_file(Path(folder, name))
        sync_folder(Path(folder))


def replace_synced(staged: Path, target: Path) -> None:
    """A staged file or folder, synced, renamed to `target` (a folder's target must not exist, or be empty), the
    rename synced."""
    if staged.is_dir():
        sync_tree(staged)
    else:
        sync_file(staged)
    os.replace(staged, target)
    sync_folder(target.parent)


def staging_folder(parent: Path, prefix: str) -> Path:
    """A new folder in `parent` named `prefix` + a unique tail, made as mkdir makes one (0777 less the umask:
    tempfile.mkdtemp's 0700 keeps the other users of a shared cache out of what is renamed into place)."""
    while True:
        folder = parent / f"{prefix}{uuid.uuid4().hex[:8]}"
        try:
            folder.mkdir(0o777)
            return folder
        except FileExistsError:
            continue


def write_file(path: Path, data: bytes | str, lasting: bool = True) -> None:
    """`data` at `path`, whole or not at all, with the mode open() would give it (tempfile's are 0600): a crash
    leaves the old file or the new one. The temp file is removed if the write fails. `lasting`: the folder is synced
    too, so the rename itself survives a power loss (a cache's file can go without)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
    raw = data.encode() if isinstance(data, str) else data
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    if lasting:
        sync_folder(path.parent)
