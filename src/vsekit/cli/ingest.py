"""``vsekit ingest FORMAT ...``: turn a dataset on disk into a new store."""

from __future__ import annotations

import functools

import click

from .options import IMAGE_OPTION, STORAGE_OPTION, StorePath


@click.group("ingest")
def ingest() -> None:
    """Create a store from a dataset on disk (karpathy, coco, folder, precomp, butd, hdf5, webdataset,
    parquet, npz)."""


def _common(ingest_with):
    """The options of an ingest that makes a new store; the command returns the ingest's (store, report),
    said here with the sets --drop-features deleted and the split notes."""
    @functools.wraps(ingest_with)
    def command(store_path, overwrite, drop_features, **kwargs):
        dropped = _dropping(store_path, overwrite, drop_features)
        store, report = ingest_with(store_path=store_path, overwrite=overwrite, drop_features=drop_features, **kwargs)
        click.echo(report.summary())
        _said(dropped, store)

    f = IMAGE_OPTION(STORAGE_OPTION(command))
    f = click.option("--store", "store_path", required=True, type=StorePath(url_ok=True),
                     help="Store to create (a path, or an object-store URL s3://...).")(f)
    f = click.option("--overwrite", is_flag=True, help="Replace an existing store.")(f)
    f = DROP_FEATURES(f)
    f = click.option("--strict", is_flag=True, help="Turn skipped items into errors.")(f)
    return f


DROP_FEATURES = click.option(
    "--drop-features", is_flag=True,
    help="With --overwrite: also delete the old store's feature sets (refused by default; to change only "
         "the split, `vsekit split` keeps them).")


def _dropping(store_path: str, overwrite: bool, drop_features: bool) -> list[str]:
    """The feature sets an --overwrite --drop-features will delete (said after the ingest)."""
    from ..storage.store import feature_names_at

    return feature_names_at(store_path) if overwrite and drop_features else []


def _said(dropped: list[str], store=None) -> None:
    """The sets --drop-features deleted, and a note on a tiny val or test split (with how to re-split)."""
    from ..words import plural

    if dropped:
        click.echo(f"--drop-features: dropped {plural(len(dropped), 'feature set')}: {', '.join(dropped)}")
    if store is not None:
        from ..storage.splits import split_notes

        for note in split_notes(store):
            click.echo(note, err=True)


class ImageFolder(click.Path):
    """A folder of images, or a URL of images on object storage (read with --image-option, else
    --storage-option; listed once)."""

    def __init__(self, exists: bool = False):
        super().__init__(exists=exists, file_okay=False)

    def convert(self, value, param, ctx):
        from ..storage.objstore import is_object_url

        return value if is_object_url(str(value)) else super().convert(value, param, ctx)


_outside = click.option("--allow-outside-root", is_flag=True,
                        help="Read image paths that leave the image root (absolute, ../, symlinks out); "
                             "refused by default.")


@ingest.command("karpathy")
@click.argument("json_path", type=click.Path(exists=True, dir_okay=False))
@click.option("--image-root", type=ImageFolder(), default=None,
              help="Folder or URL (s3://, az://, gs://) the records' filepath/filename are relative to "
                   "(default: the JSON's folder).")
@click.option("--restval-as-train/--keep-restval", default=False, show_default=True,
              help="Put COCO's restval images into train (the common 113,287-image practice).")
@click.option("--no-check-files", is_flag=True, help="Do not check that every image file exists.")
@_outside
@_common
def karpathy(json_path, image_root, no_check_files, **options):
    """Ingest a Karpathy split file (dataset_coco.json, dataset_flickr30k.json, ...)."""
    from pathlib import Path

    from ..storage.sources.karpathy import ingest_karpathy

    return ingest_karpathy(json_path, image_root or str(Path(json_path).parent), check_files=not no_check_files,
                           **options)


@ingest.command("coco")
@click.argument("annotations", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--split-file", "split_file", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Split assignment: Karpathy dataset_coco.json, a JSON {image_id: split}, or "
                   "image_id<TAB>split lines.")
@click.option("--image-root", type=ImageFolder(), default=None,
              help="Folder or URL (s3://, az://, gs://) of the images (file_name, or <train2014|val2014>/file_name, "
                   "below it; default: the first annotation file's folder).")
@click.option("--restval-as-train/--keep-restval", default=False, show_default=True,
              help="Put restval images into train.")
@click.option("--no-check-files", is_flag=True, help="Do not check that every image file exists.")
@_outside
@_common
def coco(annotations, split_file, image_root, no_check_files, **options):
    """Ingest official COCO captions_*.json files with a split assignment file."""
    from pathlib import Path

    from ..storage.sources.coco import ingest_coco

    return ingest_coco(list(annotations), split_file, image_root or str(Path(annotations[0]).parent),
                       check_files=not no_check_files, **options)


@ingest.command("folder")
@click.argument("image_dir", type=ImageFolder(exists=True))
@click.argument("captions", type=click.Path(exists=True, dir_okay=False))
@click.option("--ratios", "ratios", default="0.8,0.1,0.1", show_default=True,
              help="train,val,test ratios of the random split, used when the caption file has no split column.")
@click.option("--seed", default=0, show_default=True, help="Seed of the random split.")
@click.option("--no-check-files", is_flag=True, help="Do not check that every image file exists.")
@_outside
@_common
def folder(image_dir, captions, no_check_files, **options):
    """Ingest IMAGE_DIR with a CAPTIONS table of path<TAB>caption[<TAB>split] lines (.tsv or .csv)."""
    from ..storage.sources.folder import ingest_folder

    return ingest_folder(image_dir, captions, check_files=not no_check_files, **options)


@ingest.command("precomp")
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--prefixes", "splits", default=None,
              help="File prefixes to read, e.g. train,dev,test (default: every one present of "
                   "train, dev|val, test, restval).")
@click.option("--name", default="precomp", show_default=True, help="Name of the feature set.")
@click.option("--captions-per-image", default=5, show_default=True, type=click.IntRange(1),
              help="Captions per image in the files (the layouts assume a fixed number).")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default=None,
              help="Stored dtype (default: the file's for global features, float16 for regions).")
@STORAGE_OPTION
@click.option("--store", "store_path", required=True, type=StorePath(url_ok=True),
              help="A new store, or an existing one to add the feature set to (matched by image id).")
@click.option("--overwrite", is_flag=True,
              help="Replace the feature set NAME of an existing store, or the store itself when new.")
@click.option("--strict", is_flag=True, help="Turn skipped items into errors.")
def precomp(folder, splits, **options):
    """Ingest a VSE++ or SCAN/SGRAF precomp folder ({split}_ims.npy, {split}_caps.txt[, {split}_ids.txt]).

    With --store naming an existing store, only the feature set is added, matched by image id.
    """
    from ..storage.sources.precomp import ingest_precomp

    prefixes = [p.strip() for p in splits.split(",") if p.strip()] if splits else None
    click.echo(ingest_precomp(folder, prefixes=prefixes, **options)[1].summary())


@ingest.command("butd")
@click.argument("tsv", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@STORAGE_OPTION
@click.option("--store", "store_path", required=True, type=StorePath(url_ok=True),
              help="An existing store to add the features to (matched by image id), or a new store.")
@click.option("--name", default="regions", show_default=True, help="Name of the feature set.")
@click.option("--max-boxes", default=100, show_default=True, type=click.IntRange(1),
              help="Largest num_boxes accepted; rows are padded to the largest found.")
@click.option("--split-file", "split_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="New store only: split assignment file (Karpathy JSON, {id: split} or id<TAB>split).")
@click.option("--split", "default_split", default="train", show_default=True,
              type=click.Choice(["train", "val", "test", "restval"]),
              help="New store only: the split of every image when no --split-file is given.")
@click.option("--dtype", type=click.Choice(["float16", "float32"]), default="float16", show_default=True,
              help="Stored dtype of the features.")
@click.option("--overwrite", is_flag=True,
              help="Replace the feature set NAME of an existing store, or the store itself when new.")
@click.option("--strict", is_flag=True, help="Turn skipped lines into errors.")
def butd(tsv, **options):
    """Ingest bottom-up-attention TSV files (image_id, image_w, image_h, num_boxes, boxes, features)."""
    from ..storage.sources.butd import ingest_butd

    click.echo(ingest_butd(list(tsv), **options)[1].summary())


def _split_options(f):
    f = click.option("--seed", default=0, show_default=True, help="Seed of the random split.")(f)
    f = click.option("--ratios", default="0.8,0.1,0.1", show_default=True,
                     help="train,val,test ratios of the random split (without --split-file/--split).")(f)
    f = click.option("--split", "split", default=None, type=click.Choice(["train", "val", "test", "restval"]),
                     help="Put every image in this split.")(f)
    f = click.option("--split-file", "split_file", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="Split assignment file (Karpathy JSON, {id: split} or id<TAB>split).")(f)
    return f


@ingest.command("webdataset")
@click.argument("shards", nargs=-1, required=True)
@_outside
@_split_options
@_common
def webdataset(shards, **options):
    """Ingest WebDataset tar SHARDS (img2dataset/open_clip: KEY.jpg + KEY.txt|json); brace patterns
    like shard-{0000..0009}.tar work. Images stay in the shards and are read in place."""
    from ..storage.sources.webdataset import ingest_webdataset

    return ingest_webdataset(list(shards), **options)


@ingest.command("parquet")
@click.argument("files", nargs=-1, required=True)
@click.option("--image-column", default=None, help="Image bytes, HF image struct, or path column (default: "
              "the first of jpg, png, webp, image, img, image_bytes, image_path, filepath, path, file_name, filename).")
@click.option("--caption-column", default=None,
              help="Caption column, a string or a list of strings (default: caption, captions, sentences, text, txt).")
@click.option("--id-column", default=None, help="Image id column (default: key, image_id, id, cocoid, img_id, "
              "imgid; else the image path without extension, else FILE:ROW).")
@click.option("--split-column", default=None, help="Split column (default: 'split' when present).")
@click.option("--image-root", type=click.Path(file_okay=False), default=None,
              help="Folder that image path columns are relative to (default: the first file's folder).")
@click.option("--no-check-files", is_flag=True, help="Do not check that image path files exist.")
@_outside
@_split_options
@_common
def parquet(files, no_check_files, **options):
    """Ingest parquet FILES (or folders of them): img2dataset's parquet output, HF datasets exports.
    Image bytes stay in the files and are read in place."""
    from ..storage.sources.parquet import ingest_parquet

    return ingest_parquet(list(files), check_files=not no_check_files, **options)


@ingest.command("npz")
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@STORAGE_OPTION
@click.option("--store", "store_path", required=True, type=StorePath(exists=True, url_ok=True),
              help="Existing store to add the region features to (matched by image id).")
@click.option("--name", default="regions", show_default=True, help="Name of the feature set.")
@click.option("--match", type=click.Choice(["exact", "number"]), default="exact", show_default=True,
              help="File stem = image id, or the stem's last number = the (numeric) image id "
                   "(COCO_val2014_000000391895.npz -> 391895).")
@click.option("--max-boxes", default=100, show_default=True, type=click.IntRange(1),
              help="Largest number of boxes accepted; rows are padded to the largest found.")
@click.option("--dtype", type=click.Choice(["float16", "float32"]), default="float16", show_default=True,
              help="Stored dtype of the features.")
@click.option("--overwrite", is_flag=True, help="Replace the feature set NAME.")
@click.option("--strict", is_flag=True, help="Turn skipped files into errors.")
def npz(folder, **options):
    """Ingest per-image .npz region features (x, bbox, num_bbox, image_h, image_w; bottom-up-attention.pytorch)."""
    from ..storage.sources.npz import ingest_npz

    click.echo(ingest_npz(folder, **options)[1].summary())


@ingest.command("hdf5")
@click.argument("h5_path", type=click.Path(exists=True, dir_okay=False))
@STORAGE_OPTION
@click.option("--store", "store_path", required=True, type=StorePath(url_ok=True), help="Store to create.")
@click.option("--overwrite", is_flag=True, help="Replace an existing store.")
@DROP_FEATURES
def hdf5(h5_path, store_path, overwrite, drop_features):
    """Rebuild a store from a `vsekit export hdf5` file."""
    from ..storage.interop import ingest_hdf5

    dropped = _dropping(store_path, overwrite, drop_features)
    store = ingest_hdf5(h5_path, store_path, overwrite=overwrite, drop_features=drop_features)
    _said(dropped)
    click.echo(f"ingested {store.n_images} images, {store.n_captions} captions, "
               f"{len(store.feature_names())} feature sets")


COMMANDS = (ingest,)
