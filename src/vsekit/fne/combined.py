"""``fne``: standardize then discretize in one write pass (FNE, Garcia-Gasulla et al. 2018, §3).

The source is read twice in all — once for the statistics, once to write both ``<name>.z`` and
``<name>.z.fne`` — and the results are identical to running the two stages one after the other
(the discretisation sees the same float32 values the ``.z`` set stores).
"""

from __future__ import annotations

import os
from typing import Sequence

from ..storage.store import FeatureStore
from . import derived, passes
from . import discretize as disc
from . import standardize as stdz


def output_names(features: str) -> tuple[str, str]:
    """The two sets ``fne`` writes from ``features``: ``<features>.z`` and ``<features>.z.fne``."""
    z = stdz.output_name(features)
    return z, disc.output_name(z)


def fne(store: FeatureStore | str | os.PathLike, features: str, *, split: str = "train",
        stats_from: str | None = None, thresholds: Sequence[float] = disc.DEFAULT_THRESHOLDS,
        pack: bool = False, cluster: "ClusterSpec | str | None" = None, overwrite: bool = False,
        allow_standardized: bool = False) -> tuple[derived.Result, derived.Result]:
    """Write ``<features>.z`` and ``<features>.z.fne``; returns both stages' results."""
    from ..clusters import cluster_client

    store = passes.open_store(store)
    disc.check_thresholds(thresholds)
    cluster = store.sets.check_cluster(cluster, "fne")   # on object storage: clusters that reach it
    with store.writer(*output_names(features), stage="vsekit fne", multi=bool(cluster)), cluster_client(cluster) as client:
        pin = derived.Pin.of(store.features(features), "fne")
        parent, zset, zfn, info = stdz.prepare(store, features, split=split, stats_from=stats_from,
                                               overwrite=overwrite, client=client, pin=pin,
                                               allow_standardized=allow_standardized)
        try:   # a .z set being remade (staged) makes its .fne set afresh too
            qset, qfn = disc.prepare(store, zset.target, thresholds=thresholds, pack_bits=pack,
                                     name=output_names(features)[1], overwrite=overwrite or zset.staged, parent=zset)
        except BaseException as exc:
            derived.drop(store, zset, exc)
            raise
        # the scan checked the values
        (zset, qset), written = passes.write_chain(store, parent, [(zset, zfn), (qset, qfn)], client, pin,
                                                    check=False)
    blocks = len(zset.blocks())
    z = derived.Result(zset.name, parent.name, zset.n_rows, zset.counts()["failed"], written[0], blocks,
                       {"split": None if stats_from else split, "stats_from": stats_from, **info})
    q = derived.Result(qset.name, zset.name, qset.n_rows, qset.counts()["failed"], written[1],
                       blocks, {"thresholds": f"{qfn.lo} {qfn.hi}", "packed": qfn.packed})
    return z, q
