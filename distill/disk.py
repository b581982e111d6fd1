"""A write that failed because the disk is full, reported as such.

Writers report a full disk in different ways: Python's file objects raise OSError(ENOSPC),
safetensors raises SafetensorError("... No space left on device (os error 28)"), and torch's zip
writer (torch.save: optimizer, scheduler, RNG state) raises an opaque
RuntimeError("... unexpected pos 167232 vs 167120") with no errno anywhere. The last is recognised
by the free space left on the folder's filesystem.
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from common.errors import UserError


NEARLY_FULL_BYTES = 1 << 20
"""Free space below which a failed write is put down to a full disk: a write that ran out of room
leaves at most a partly filled block behind (the reserved blocks of ext4 are not counted free)."""
_ENOSPC_TEXT = os.strerror(errno.ENOSPC)  # "No space left on device", as Rust's io::Error prints it too


class DiskFullError(UserError):
    """A checkpoint or export could not be written for lack of disk space."""


@contextmanager
def reporting_full_disk(path: str | Path):
    """Raise DiskFullError naming `path` when the writes inside fail for lack of space; any other
    error passes through unchanged (it is a bug, and keeps its traceback)."""
    try:
        yield
    except Exception as error:
        if is_disk_full(error, Path(path)):
            raise DiskFullError(f"no space left on device while saving {path}; free some space and rerun "
                                f"(what was there before is intact)") from error
        raise


def is_disk_full(error: BaseException, path: Path) -> bool:
    """ENOSPC anywhere on the error's chain (cause or context), or the text of it, or, for errors that
    carry neither (torch's), next to no free space left where `path` is written."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if getattr(error, "errno", None) == errno.ENOSPC or _ENOSPC_TEXT in str(error):
            return True
        error = error.__cause__ or error.__context__
    return _free_bytes(path) < NEARLY_FULL_BYTES


def _free_bytes(path: Path) -> int:
    """Free bytes on the filesystem of `path`, or of its nearest existing parent folder."""
    for folder in (path, *path.parents):
        if folder.exists():
            return shutil.disk_usage(folder).free
    return NEARLY_FULL_BYTES  # nothing to measure: not evidence of a full disk
