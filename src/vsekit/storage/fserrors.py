"""Errors of the filesystem itself (full, over quota, read-only, no permission) as one clear message.

A disk that fills during a long extraction is a normal event on a shared cluster, not a bug: the
user needs the path that could not be written and the fact that a rerun resumes, not a traceback.
Every write of a row block is ordered so that an error part-way leaves the block pending (see
docs/reliability.md), so after freeing space the same command finishes the job.

:func:`naming` wraps a write and turns such an ``OSError`` into a :class:`FilesystemError` naming
the path (Python's ``OSError`` from a failed ``write()`` carries no file name); the CLI turns any
that escape unnamed into the same one-line message.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from typing import Callable, Iterator

#: errno values that mean "this filesystem will not take the write", as opposed to a bug.
FS_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}

_ADVICE = {
    errno.ENOSPC: "free some space and rerun the same command: what was written is kept and the run resumes",
    errno.EDQUOT: "free some space (or raise the quota) and rerun the same command: the run resumes",
    errno.EFBIG: "the file is over the filesystem's size limit",
    errno.EROFS: "the filesystem is mounted read-only; use a writable store",
    errno.EACCES: "no permission to write there; use a store you can write",
    errno.EPERM: "no permission to write there; use a store you can write",
}


class FilesystemError(Exception):
    """The filesystem refused a write (full, quota, read-only, permission); the message names the path.

    Not a subclass of ``StoreError`` only so that ``store.py`` can use this module without a circular
    import; the CLI reports both the same way."""


def is_fs_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in FS_ERRNOS


def fs_error(exc: OSError, path: str | os.PathLike | None = None) -> FilesystemError:
    """The one-line error for ``exc``, naming ``exc.filename`` or else ``path``."""
    where = exc.filename or path or "(path not reported by the system)"
    reason = exc.strerror or os.strerror(exc.errno or 0)
    advice = _ADVICE.get(exc.errno, "")
    return FilesystemError(f"cannot write {where}: {reason} [{errno.errorcode.get(exc.errno, exc.errno)}]"
                           + (f"; {advice}" if advice else ""))


@contextlib.contextmanager
def naming(path: str | os.PathLike | Callable[[], str | os.PathLike]) -> Iterator[None]:
    """Turn a filesystem error raised inside the block into a :class:`FilesystemError` naming ``path``
    (a callable: asked only then)."""
    try:
        yield
    except OSError as exc:
        if not is_fs_error(exc):
            raise
        raise fs_error(exc, path() if callable(path) else path) from None


def _names(where: Callable) -> Callable:
    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            with naming(lambda: where(self)):
                return method(self, *args, **kwargs)
        return wrapper
    return decorate


#: Decorator for FeatureSet writers: a filesystem error names the set's folder.
names_set_path = _names(lambda fs: fs.store.path / "features" / fs.name)
#: Decorator for FeatureStore writers: a filesystem error names the store.
names_store_path = _names(lambda store: store.path)


def user_error(exc: BaseException, store: str | os.PathLike | None = None) -> str | None:
    """The one-line message of a refusal the user can act on (a store error, a full or read-only
    filesystem, a bad value, a missing file), or None for a bug. The CLI and ``vsekit run`` word a
    stage's failure with it, so a stage fails with the same words whichever called it."""
    from ..suggest import improve_message
    from .base import StoreError

    if isinstance(exc, FilesystemError):
        _quiet_unretrieved_write_errors()
        return improve_message(str(exc))
    if isinstance(exc, (StoreError, ValueError, FileNotFoundError)):
        return improve_message(str(exc))
    if isinstance(exc, OSError) and is_fs_error(exc):   # a full, read-only or forbidden filesystem
        _quiet_unretrieved_write_errors()
        return str(fs_error(exc, f"in the store {store}" if store else None))
    return None


class _UnretrievedOSError:
    """Drops asyncio's "Future/Task exception was never retrieved" for an OSError: after one write of a
    zarr store fails (a full disk), zarr's other concurrent writes of the same call fail too and are
    never awaited, and asyncio prints each one's traceback when it is collected, after the one
    ``Error:`` line that already says what happened."""

    def filter(self, record) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not ("exception was never retrieved" in str(record.msg) and isinstance(exc, OSError))


def _quiet_unretrieved_write_errors() -> None:
    import logging

    logging.getLogger("asyncio").addFilter(_UnretrievedOSError())
