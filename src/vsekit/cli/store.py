"""``vsekit info`` and ``vsekit demo-data``."""

from __future__ import annotations

import click

from .options import STORAGE_OPTION, StorePath


def store_option(f):
    """``--store``, an existing store (a path or an object-store URL), with its ``--storage-option``."""
    return click.option("--store", "store", required=True, type=StorePath(exists=True, url_ok=True),
                        help="The vsekit store (a .zarr folder, or s3://...).")(STORAGE_OPTION(f))


@click.command("info")
@click.argument("store", type=StorePath(exists=True, url_ok=True))
@STORAGE_OPTION
@click.argument("name", required=False)
@click.option("--verify", is_flag=True,
              help="Re-read every finished block and compare it with its recorded checksum.")
@click.option("--repair", is_flag=True,
              help="With --verify: mark damaged blocks pending, so a rerun of the command that made "
                   "the set rewrites them.")
def info(store: str, name: str | None, verify: bool, repair: bool) -> None:
    """Print a store's tree, shapes, dtypes, chunks, provenance and done/failed/pending rows."""
    from ..storage.info import describe, verify_store
    from ..storage.store import FeatureStore

    if repair and not verify:
        raise click.UsageError("--repair needs --verify")
    if verify:
        text, ok = verify_store(FeatureStore.open(store, mode="r+" if repair else "r"), name, repair=repair)
        click.echo(text)
        if not ok:
            raise SystemExit(1)
        return
    click.echo(describe(FeatureStore.open(store), name))


@click.command("split")
@store_option
@click.option("--ratios", default=None,
              help="train,val,test ratios of a random split (as `ingest folder --ratios`, same --seed, same split).")
@click.option("--split-file", "split_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Split assignment file (Karpathy JSON, {id: split} or id<TAB>split); every image needs one.")
@click.option("--val", type=click.IntRange(min=0), default=None,
              help="Images in val, chosen at random (the rest is train; without --test, test keeps its images).")
@click.option("--test", type=click.IntRange(min=0), default=None,
              help="Images in test, chosen at random (the rest is train; without --val, val keeps its images).")
@click.option("--seed", default=0, show_default=True, help="Seed of the random split.")
@click.option("--dry-run", is_flag=True, help="Print the new split and what it makes stale, and change nothing.")
def split(store, **options):
    """Assign the store's images to train/val/test anew, keeping every feature set (no re-extraction).

    Sets made from a split's statistics (standardize's .z and what was derived from it) are marked
    stale when that split's images change, and the commands that remake them are printed."""
    from ..storage.splits import resplit

    click.echo(resplit(store, **options).summary())


@click.command("demo-data")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--images", default=400, show_default=True, help="Number of images.")
@click.option("--seed", default=0, show_default=True, help="Random seed; output is deterministic per seed.")
@click.option("--size", default=128, show_default=True, help="Image side in pixels.")
@click.option("--val", type=int, default=None, help="Images in the val split [default: 12.5%].")
@click.option("--test", type=int, default=None, help="Images in the test split [default: 12.5%].")
def demo_data(out_dir: str, images: int, **options) -> None:
    """Write a synthetic captioned dataset (JPEGs, Karpathy JSON, boxes.json) to OUT_DIR."""
    from ..storage.demo import make_demo_data

    click.echo(f"wrote {images} images and {make_demo_data(out_dir, images=images, **options)}")


COMMANDS = (info, split, demo_data)
