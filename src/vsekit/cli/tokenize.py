"""``vsekit tokenize``: a thin wrapper over :func:`vsekit.tokenize.tokenize`."""

from __future__ import annotations

import click

from ..clusters import SPEC_HELP as CLUSTER_HELP
from .options import CLUSTER, STORAGE_OPTION, WORKERS, resolve_workers, StorePath


@click.command("tokenize")
@click.option("--store", "store", required=True, type=StorePath(exists=True, url_ok=True),
              help="The vsekit store whose captions to tokenize (a path, or s3://...).")
@STORAGE_OPTION
@click.option("--min-count", default=4, show_default=True, type=int,
              help="Keep words seen at least this many times in the vocabulary splits (VSE++/SCAN: 4).")
@click.option("--vocab-splits", default="train,val", show_default=True,
              help="Splits whose captions build the vocabulary (comma-separated); restval counts with "
                   "train; test is refused.")
@click.option("--strip-punct", is_flag=True, help="Drop punctuation tokens (kept by default, as in FNE).")
@click.option("--keep-case", is_flag=True, help="Do not lower-case the captions.")
@click.option("--no-bos-eos", is_flag=True, help="Do not wrap each caption in <start> ... <end>.")
@click.option("--max-len", type=int, default=None,
              help="Truncate each caption to this many ids (<start> and <end> included).")
@click.option("--workers", default="1", show_default=True, type=WORKERS,
              help="Worker processes for the counting pass (1 = in this process; auto: the cores, at most 4).")
@click.option("--cluster", default=None, type=CLUSTER,
              help=f"Run the counting pass on dask: {CLUSTER_HELP}.")
@click.option("--chunk-captions", default=16384, show_default=True, type=int,
              help="Captions per counting task (the unit of parallel work).")
def tokenize(store: str, keep_case: bool, no_bos_eos: bool, workers, **options) -> None:
    """Tokenize every caption, build the vocabulary, and write tokens/ids + tokens/offsets."""
    from ..tokenize import tokenize as run_tokenize

    click.echo(str(run_tokenize(store, lowercase=not keep_case, bos_eos=not no_bos_eos,
                                workers=resolve_workers(workers), **options)))


COMMANDS = (tokenize,)
