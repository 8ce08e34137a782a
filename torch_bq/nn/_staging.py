"""Write a directory all at once: build it beside its destination, then rename it into place.

:class:`StagedDirectory` is how :func:`torch_bq.nn.convert_checkpoint` makes its
output atomic. Files are written into a fresh sibling directory
``.{name}.torch_bq-tmp-{random}`` (same filesystem, so the final rename cannot
turn into a copy); :meth:`StagedDirectory.commit` fsyncs every file, the
directory and its parent, and only then puts the new directory at the
destination:

* destination absent: one ``rename``;
* destination an existing directory: ``renameat2(RENAME_EXCHANGE)`` swaps the two
  in one step, so the path always names a complete directory, old or new; the old
  one (now under the temporary name) is deleted afterwards. Where the kernel or
  filesystem lacks the exchange, the old directory is first renamed aside and put
  back if the second rename fails.

Leaving the ``with`` block by an exception (or never committing) deletes the
temporary directory, so the destination is exactly as it was. A process killed
at any moment leaves the destination either untouched or complete; what it can
leave behind is one ``.{name}.torch_bq-tmp-*`` sibling, never anything under the
destination's own name.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import secrets
import shutil
from pathlib import Path
from typing import Optional

__all__ = ["StagedDirectory", "fsync_path"]

_TMP_MARK = ".torch_bq-tmp-"
_RENAME_EXCHANGE = 2  # linux/fs.h


def fsync_path(path: Path) -> None:
    """Flush ``path`` (a file or a directory) to stable storage.

    Directories cannot be opened for fsync on Windows (NTFS journals renames), so
    they are skipped there.
    """
    if os.name == "nt" and path.is_dir():
        return
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (``renameat2(RENAME_EXCHANGE)``).

    Returns ``False`` where the platform, kernel or filesystem cannot do it
    (nothing was changed then); raises ``OSError`` on any other failure.
    """
    libc = _libc()
    fn = getattr(libc, "renameat2", None) if libc is not None else None
    if fn is None:
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


class StagedDirectory:
    """A temporary sibling of ``dst`` that becomes ``dst`` on :meth:`commit`.

    Args:
        dst: the destination directory; its parent is created if missing. An
            existing ``dst`` must be a directory; it is replaced only by :meth:`commit`.

    Use as ``with StagedDirectory(dst) as stage: ...write under stage.path...; stage.commit()``.
    """

    def __init__(self, dst: Path) -> None:
        self.dst = Path(os.path.abspath(dst))
        self.path: Optional[Path] = None
        self.committed = False

    def __enter__(self) -> "StagedDirectory":
        parent = self.dst.parent
        parent.mkdir(parents=True, exist_ok=True)
        while self.path is None:
            candidate = parent / f".{self.dst.name}{_TMP_MARK}{secrets.token_hex(6)}"
            try:
                os.mkdir(candidate)  # honours the umask, unlike tempfile.mkdtemp's 0o700
            except FileExistsError:
                continue
            self.path = candidate
        return self

    def __exit__(self, *exc) -> None:
        if not self.committed and self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)

    def commit(self) -> None:
        """Flush everything written under :attr:`path`, then put it at ``dst`` in one step."""
        assert self.path is not None, "commit() outside the with block"
        for root, _, files in os.walk(self.path):
            for f in files:
                fsync_path(Path(root) / f)
        fsync_path(self.path)
        if os.path.lexists(self.dst):
            self._replace()
        else:
            os.rename(self.path, self.dst)
        self.committed = True
        fsync_path(self.dst.parent)

    def _replace(self) -> None:
        if not self.dst.is_dir() or self.dst.is_symlink():
            raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory", str(self.dst))
        if exchange(self.path, self.dst):
            old = self.path  # now holds the previous destination
        else:
            old = self.dst.parent / f".{self.dst.name}{_TMP_MARK}old-{secrets.token_hex(6)}"
            os.rename(self.dst, old)
            try:
                os.rename(self.path, self.dst)
            except BaseException:
                os.rename(old, self.dst)
                raise
        self.committed = True
        fsync_path(self.dst.parent)
        shutil.rmtree(old, ignore_errors=True)
