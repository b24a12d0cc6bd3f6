"""``vsekit ingest FORMAT ...``: turn a dataset on disk into a new store."""

from __future__ import annotations

import click


@click.group("ingest")
def ingest() -> None:
    """Create a store from a dataset on disk (karpathy, coco, folder, precomp, butd)."""


def _common(f):
    f = click.option("--store", "store_path", required=True, type=click.Path(), help="Store to create.")(f)
    f = click.option("--overwrite", is_flag=True, help="Replace an existing store.")(f)
    f = click.option("--strict", is_flag=True, help="Turn skipped items into errors.")(f)
    return f


@ingest.command("karpathy")
@click.argument("json_path", type=click.Path(exists=True, dir_okay=False))
@click.option("--image-root", type=click.Path(file_okay=False), default=None,
              help="Folder the records' filepath/filename are relative to (default: the JSON's folder).")
@click.option("--restval-as-train/--keep-restval", default=False, show_default=True,
              help="Put COCO's restval images into train (the common 113,287-image practice).")
@click.option("--no-check-files", is_flag=True, help="Do not check that every image file exists.")
@_common
def karpathy(json_path, image_root, restval_as_train, no_check_files, store_path, overwrite, strict):
    """Ingest a Karpathy split file (dataset_coco.json, dataset_flickr30k.json, ...)."""
    from pathlib import Path

    from ..storage.sources.karpathy import ingest_karpathy

    root = image_root or str(Path(json_path).parent)
    _, report = ingest_karpathy(json_path, root, store_path, restval_as_train=restval_as_train,
                                strict=strict, check_files=not no_check_files, overwrite=overwrite)
    click.echo(report.summary())


def register(group: click.Group) -> None:
    group.add_command(ingest)
