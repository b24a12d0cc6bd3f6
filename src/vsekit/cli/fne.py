"""``vsekit standardize``, ``vsekit discretize`` and ``vsekit fne``: thin wrappers over ``vsekit.fne``."""

from __future__ import annotations

import click

from .options import CLUSTER, SPLITS
from .store import store_option

from ..clusters import SPEC_HELP as CLUSTER_HELP
from ..fne import derived  # noqa: F401,E402 (registers how its sets are remade, for `vsekit info`)

_features = click.option("--features", required=True, help="Feature set to read.")
_split = click.option("--split", default="train", show_default=True, type=SPLITS,
                      help="Split whose done rows give mean and std (train, val, test, restval; "
                           "comma-separated for several).")
_stats_from = click.option("--stats-from", default=None, metavar="STORE::NAME",
                           help="Use the mean/std stored in another store's set instead of computing them.")
_thresholds = click.option("--thresholds", nargs=2, type=float, default=(-0.25, 0.15), show_default=True,
                           metavar="LO HI", help="z < LO -> -1, z > HI -> 1, otherwise 0.")
_pack = click.option("--pack", is_flag=True, help="Store 4 ternary features per byte (2 bits each).")
_cluster = click.option("--cluster", default=None, type=CLUSTER,
                        help=f"Run on a dask cluster instead of in-process threads: {CLUSTER_HELP}.")
_allow_standardized = click.option("--allow-standardized", is_flag=True,
                                   help="Standardize a set that standardize made already (refused by default).")
_overwrite = click.option("--overwrite", is_flag=True, help="Replace an existing output set made with other settings.")


@click.command("standardize")
@store_option
@_features
@_split
@_stats_from
@click.option("--name", default=None, help="Output set name [default: FEATURES.z].")
@_cluster
@_overwrite
@_allow_standardized
def standardize(store, features, **options):
    """Z-standardise a feature set with one split's per-feature mean and std -> FEATURES.z."""
    from ..fne import standardize as run

    click.echo(f"standardize: {run(store, features, **options).summary()}")


@click.command("discretize")
@store_option
@_features
@_thresholds
@_pack
@click.option("--name", default=None, help="Output set name [default: FEATURES.fne].")
@_cluster
@_overwrite
@click.option("--allow-raw", is_flag=True,
              help="Discretize a set that standardize did not make (its values must be z-scores already; "
                   "refused by default).")
def discretize(store, features, **options):
    """Map standardised features to {-1, 0, 1} (int8, or 2-bit packed) -> FEATURES.fne."""
    from ..fne import discretize as run

    click.echo(f"discretize: {run(store, features, **options).summary()}")


@click.command("fne")
@store_option
@_features
@_split
@_stats_from
@_thresholds
@_pack
@_cluster
@_overwrite
@_allow_standardized
def fne(store, features, **options):
    """Standardize and discretize in one pass -> FEATURES.z and FEATURES.z.fne."""
    from ..fne import fne as run

    z, q = run(store, features, **options)
    click.echo(f"standardize: {z.summary()}")
    click.echo(f"discretize: {q.summary()}")


COMMANDS = (standardize, discretize, fne)
