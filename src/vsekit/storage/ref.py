"""A store as a task in another process opens it (a dask worker, a worker process of ``--workers``).

On a disk it is the store's absolute path. On object storage it is the URL, the URL's storage
options (credentials among them) and the lease token of the run whose sets the task writes: the
task opens the URL with those options and commits under that token (it never renews the lease;
:meth:`~vsekit.storage.store.FeatureStore.check_lease`). The options travel with the task in memory
(pickled over dask's connection or a process pipe): they are never written into a file, a job
script, an attribute or a log, and ``repr`` (which dask may log for a failed task) names none of
their values (``tests/test_objstore_cluster.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import zarr

from .base import StoreError
from .objstore import is_object_url
from .store import FeatureStore


class StoreRef:
    """A picklable handle on a store for tasks: ``open()`` it where the task runs."""

    __slots__ = ("path", "token", "_options")

    def __init__(self, path: str, options: dict[str, str] | None = None, token: str | None = None):
        self.path, self.token, self._options = str(path), token, dict(options or {})

    @classmethod
    def of(cls, store: FeatureStore) -> "StoreRef":
        """``store`` as its tasks reach it (object storage: with this process's options and lease token)."""
        if store.remote:
            return cls(store.path, dict(store.objects.options), store.lease_token)
        return cls(str(Path(store.path).resolve()))

    @property
    def remote(self) -> bool:
        return is_object_url(self.path)

    def open(self, mode: str = "r+") -> FeatureStore:
        """The store, opened here; on object storage it commits under the carried lease token."""
        if self.remote:
            store = FeatureStore.open(self.path, mode=mode, storage_options=self._options)
            store.lease_token = self.token
            return store
        return FeatureStore(zarr.open_group(self.path, mode=mode, zarr_format=3), self.path)

    def __repr__(self) -> str:   # never the options' values
        return f"StoreRef({self.path!r})"

    def __getstate__(self) -> tuple:
        return self.path, self.token, self._options

    def __setstate__(self, state: tuple) -> None:
        self.path, self.token, self._options = state


def check_object_storage(spec: Any, url: str, what: str, arrays: bool = False) -> Any:
    """Refuse ``spec`` for ``what`` (a stage) on the store at ``url`` on object storage, in one
    line, where its workers cannot reach that store; returns the parsed spec. ``arrays``: the stage
    serves ``slurm-array:N`` / ``sge-array:N`` there (extraction: extract/array.py)."""
    from ..clusters import OBJECT_STORAGE_ARRAYS, OBJECT_STORAGE_KINDS, parse_cluster

    spec = parse_cluster(spec)
    if spec is None:
        return None
    if url.startswith("memory://"):
        raise StoreError(f"--cluster {spec}: a memory:// store lives in this process only, where no worker "
                         f"process can reach it; run without --cluster")
    served = OBJECT_STORAGE_KINDS + (OBJECT_STORAGE_ARRAYS if arrays else ())
    if spec.kind not in served:
        kinds = " / ".join(("tcp://" if k == "tcp" else f"{k}:N") for k in served)
        raise StoreError(f"--cluster {spec}: {what} into a store on object storage ({url}) runs in-process or "
                         f"on --cluster {kinds} for now (issue 35); run it with one of those")
    return spec
