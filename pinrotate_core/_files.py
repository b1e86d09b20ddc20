"""Small local-file primitives shared by the keyring file and the run state: an exclusive lock
beside a file (``filelock``), and an atomic write (temporary file in the same folder, fsync,
rename over).

They raise ``OSError``; each caller translates it into its own error, naming its own setting.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold ``<path>.lock`` (0600) exclusively; the folder is created 0700 when missing."""
    # exist_ok: several processes may create the folder at once on first use.
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # thread_local=False: one lock object per call, so threads of one process exclude each other too.
    with FileLock(path.with_name(path.name + ".lock"), mode=0o600, thread_local=False):
        yield


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (mode 0600) so that readers see the old file or the new one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
