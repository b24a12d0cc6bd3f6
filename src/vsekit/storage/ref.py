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

from .store import FeatureStore


class StoreRef:
    """A picklable handle on a store for tasks: ``open()`` it where the task runs."""

    __slots__ = ("path", "token", "_options")

    def __init__(self, path: str, options: dict[str, str] | None = None, token: str | None = None):
        self.path, self.token, self._options = str(path), token, dict(options or {})

    @classmethod
    def of(cls, store: FeatureStore) -> "StoreRef":
        """``store`` as its tasks reach it (object storage: with this process's options and lease token)."""
        return cls(store.sets.task_path(), store.sets.options(), store.lease_token)

    def open(self, mode: str = "r+") -> FeatureStore:
        """The store, opened here; on object storage it commits under the carried lease token."""
        store = FeatureStore.open(self.path, mode=mode, storage_options=self._options or None)
        store.lease_token = self.token
        return store

    def __repr__(self) -> str:   # never the options' values
        return f"StoreRef({self.path!r})"

    def __getstate__(self) -> tuple:
        return self.path, self.token, self._options

    def __setstate__(self, state: tuple) -> None:
        self.path, self.token, self._options = state

