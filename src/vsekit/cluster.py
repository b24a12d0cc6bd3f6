"""Where stages run: in-process, a local dask cluster (``local:N``) or a running scheduler (``tcp://``).

Only this module imports ``distributed``, and only when a cluster is asked for.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping


def parse_cluster(spec: str | None) -> tuple[str, Any] | None:
    """``None``/``""`` → None; ``local:N`` → ("local", N); ``tcp://HOST:PORT`` → ("tcp", address)."""
    if not spec:
        return None
    if spec.startswith("local:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"--cluster {spec!r}: expected local:N with N >= 1 worker processes")
        return "local", n
    if spec.startswith("tcp://"):
        return "tcp", spec
    raise ValueError(f"--cluster {spec!r}: expected local:N or tcp://HOST:PORT")


@contextlib.contextmanager
def cluster_client(spec: str | None, *, resources: Mapping[str, float] | None = None,
                   timeout: float = 30) -> Iterator[Any]:
    """Yield a ``distributed.Client`` for ``spec``, or ``None`` for in-process work.

    ``local:N`` starts N single-threaded worker processes on 127.0.0.1 (with ``resources``, e.g.
    ``{"GPU": 1}``) and shuts them down afterwards; ``tcp://`` joins an existing scheduler.
    """
    parsed = parse_cluster(spec)
    if parsed is None:
        yield None
        return
    from distributed import Client, LocalCluster

    kind, arg = parsed
    if kind == "local":
        with LocalCluster(n_workers=arg, threads_per_worker=1, processes=True, host="127.0.0.1",
                          dashboard_address=None, resources=dict(resources or {})) as cluster:
            with Client(cluster, timeout=timeout) as client:
                yield client
    else:
        try:
            client = Client(arg, timeout=timeout)
        except OSError as exc:
            raise ValueError(f"--cluster {arg}: cannot reach the dask scheduler ({exc})") from exc
        with client:
            yield client
