"""Where stages run: in-process, a local dask cluster (``local:N``, :mod:`.local`), the jobs of a batch
scheduler (``slurm:N``, ``sge:N``; ``pbs:N``, ``lsf:N``, ``htcondor:N`` the same way, tested on
stand-ins: :mod:`.jobqueue`, each scheduler's own words in :mod:`vsekit.schedulers`) or a running
scheduler (``tcp://HOST:PORT``, whose workers were started elsewhere: ``dask worker ...
--resources GPU=1`` for GPU workers). ``slurm-array:N`` / ``sge-array:N`` (a job array, no driver)
are parsed here and run by :mod:`vsekit.extract.array`.

``--cluster`` is parsed once, at the edge (:func:`parse_cluster` → :class:`ClusterSpec`, settings
included, :mod:`.spec`): the settings are the caller's (``vsekit run`` passes its pipeline's
``cluster:`` section), else the user's ``$VSEKIT_CLUSTER_CONFIG`` (JSON, read there only);
dask-jobqueue's own config fills the rest. The parsed spec is what every stage receives. Only this
package imports ``distributed`` (and ``dask_jobqueue``), and only when a cluster is asked for.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

from ..schedulers import SCHEDULERS
from . import jobqueue, local
from .spec import ARRAY_KINDS, CLUSTER_KEYS, SPEC_HELP, ClusterSpec, cluster_settings, parse_cluster

__all__ = ["ARRAY_KINDS", "CLUSTER_KEYS", "SPEC_HELP", "ClusterSpec", "cluster_client", "cluster_settings",
           "parse_cluster", "report_worker_deaths", "OBJECT_STORAGE_KINDS", "OBJECT_STORAGE_ARRAYS"]


# --- object storage ---------------------------------------------------------------------------------
#: the executors that serve a store on object storage: their tasks open the URL with the storage
#: options handed to them in memory, over dask's connection (storage/ref.py); pbs, lsf and htcondor
#: run on stand-ins of their schedulers (tests/test_jobqueue_standins.py).
OBJECT_STORAGE_KINDS = ("local", "tcp", *SCHEDULERS)
#: job arrays on object storage: extraction only (their tasks' leases and spec are objects there)
OBJECT_STORAGE_ARRAYS = tuple(ARRAY_KINDS)


def report_worker_deaths(client, since: float, say) -> int:
    """``say`` a line for each dask worker that died (left unexpectedly) since ``since`` (a
    ``time.time()``); returns how many."""
    try:
        events = client.get_events("all")
    except Exception:  # an old scheduler without the event log: nothing to say
        return 0
    dead = [e for t, e in events if t >= since and isinstance(e, dict)
            and e.get("action") == "remove-worker" and e.get("expected") is False]
    for e in dead:
        n = len(e.get("processing-tasks") or ())
        say(f"dask worker {e.get('worker', '?')} died during the run"
            + (f" with {n} task(s) in progress; they ran again elsewhere" if n else ""))
    return len(dead)


# --- the entry point --------------------------------------------------------------------------------
@contextlib.contextmanager
def cluster_client(spec: "ClusterSpec | str | None", *, resources: Mapping[str, float] | None = None,
                   device: str = "cpu", timeout: float = 30) -> Iterator[Any]:
    """Yield a ``distributed.Client`` for ``spec`` (a :class:`ClusterSpec`; the text of a library
    caller is parsed here, once), or ``None`` for in-process work.

    ``local:N`` and batch scheduler (``slurm:N``, ``sge:N``...) clusters are started here and shut down afterwards (``resources``
    and, on a CUDA ``device``, ``GPU=1`` are declared by every worker); ``tcp://`` joins an
    existing scheduler.
    """
    spec = parse_cluster(spec)
    if spec is None:
        yield None
        return
    from distributed import Client

    if spec.is_array:
        raise ValueError(f"--cluster {spec}: job arrays run `vsekit extract` only; use "
                         f"{ARRAY_KINDS[spec.kind]}:N here")
    if spec.kind == "tcp":
        try:
            client = Client(spec.address, timeout=timeout)
        except OSError as exc:
            raise ValueError(f"--cluster {spec.address}: cannot reach the dask scheduler ({exc})") from exc
        with client:
            yield client
        return
    starter = (local.start(spec.n, device, resources) if spec.kind == "local"
               else jobqueue.start(spec.kind, spec.n, device, resources, spec.settings))
    with starter as cluster, Client(cluster, timeout=timeout) as client:
        yield client
