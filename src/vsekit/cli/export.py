"""``vsekit export vsepp|scan|hdf5|vocab``: write a store's contents in other tools' formats."""

from __future__ import annotations

from pathlib import Path

import click

from .store import store_option


@click.group("export")
def export() -> None:
    """Write a store to the VSE++ / SCAN precomp layouts, HDF5, or a vocabulary JSON."""


def _precomp_options(f):
    f = click.option("--vocab-name", default=None,
                     help="Also write the vocabulary as NAME_vocab.json (SCAN) and NAME_vocab.pkl (VSE++), "
                          "e.g. coco_precomp.")(f)
    f = click.option("--restval-into-train", is_flag=True, help="Write restval images into train_* "
                     "(VSE++/SCAN's 113,287-image COCO train set).")(f)
    f = click.option("--testall/--no-testall", default=None,
                     help="testall_* = the whole test split and test_* = its first 1,000 images, as in "
                          "coco_precomp (default: on for a COCO store with over 1,000 test images).")(f)
    f = click.option("--dtype", type=click.Choice(["float32", "float16", "int8"]), default=None,
                     help="dtype of the .npy files (default: the feature set's).")(f)
    f = click.option("--captions-per-image", default=5, show_default=True, type=click.IntRange(1),
                     help="Captions written per image (the layouts assume a fixed number).")(f)
    f = click.option("--splits", default=None,
                     help="Store splits to write, e.g. train,val,test (default: every split present).")(f)
    f = click.option("--out", required=True, type=click.Path(file_okay=False), help="Output folder.")(f)
    f = click.option("--features", required=True, help="Feature set to export.")(f)
    f = click.option("--drop-failed", is_flag=True,
                     help="Leave the images whose features failed, and their captions, out of every file "
                          "(listed in dropped_failed.tsv); without it a set with failed rows is refused.")(f)
    f = OVERWRITE(f)
    f = store_option(f)
    return f


OVERWRITE = click.option("--overwrite", is_flag=True,
                         help="Replace an existing --out (whole: no file of the old one is kept).")


def _run_precomp(layout, store, features, out, splits, **options):
    from ..storage.interop import export_precomp
    from ..words import plural

    split_list = [s.strip() for s in splits.split(",") if s.strip()] if splits else None
    summary = export_precomp(store, features, out, layout=layout, splits=split_list, **options)
    for prefix, c in summary["splits"].items():
        click.echo(f"{out}/{prefix}_ims.npy: {c['images']} images, {prefix}_caps.txt: {c['captions']} captions")
    if summary.get("dropped"):
        d = summary["dropped"]
        click.echo(f"--drop-failed: left out {plural(d['images'], 'failed image')} and their "
                   f"{plural(d['captions'], 'caption')} (listed in {out}/{d['file']})")
    for path in summary.get("vocab", []):
        click.echo(f"wrote {path}")
    for warning in summary["warnings"]:
        click.echo(f"warning: {warning}", err=True)


def _precomp_command(layout: str, doc: str) -> None:
    """``vsekit export LAYOUT``: the precomp files of VSE++ (``vsepp``) or SCAN / SGRAF (``scan``)."""
    @export.command(layout, help=doc)
    @_precomp_options
    def command(**options):
        _run_precomp(layout, **options)


_precomp_command("vsepp", "VSE++ precomp files: {split}_ims.npy (N, D), {split}_caps.txt, {split}_ids.txt.")
_precomp_command("scan", "SCAN / SGRAF precomp files: {split}_ims.npy (N, K, C), {split}_caps.txt, "
                         "{split}_ids.txt.")


@export.command("hdf5")
@store_option
@click.option("--features", multiple=True, help="Feature set(s) to include (default: all).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output .h5 file.")
@click.option("--level", default=4, show_default=True, type=click.IntRange(0, 9), help="gzip level.")
@OVERWRITE
def hdf5(store, features, out, level, overwrite):
    """One HDF5 file: a dataset per store array, provenance as attributes, chunked and compressed."""
    from ..storage.interop import export_hdf5

    summary = export_hdf5(store, out, features=list(features) or None, level=level, overwrite=overwrite)
    click.echo(f"wrote {summary['out']} (feature sets: {', '.join(summary['features']) or 'none'})")


@export.command("vocab")
@store_option
@click.option("--out", required=True, type=click.Path(dir_okay=False),
              help="Output vocab.json, or a .pkl for VSE++'s pickled Vocabulary.")
@OVERWRITE
def vocab(store, out, overwrite):
    """The store's tokenizer vocabulary as JSON (SCAN) or, for a .pkl --out, VSE++'s pickle."""
    from ..storage.interop import refuse_existing, vsepp_vocab_pickle
    from ..tokenize import Vocabulary, export_vocab_json

    refuse_existing(Path(out), overwrite)
    vocab = Vocabulary.from_store(store)   # refuses a store without tokens, naming it
    if str(out).lower().endswith(".pkl"):
        Path(out).write_bytes(vsepp_vocab_pickle(vocab.itos))
    else:
        export_vocab_json(store, out)
    click.echo(f"wrote {out}")


COMMANDS = (export,)
