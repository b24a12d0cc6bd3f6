"""``vsekit embed RUN --split S --out DIR``: a trained run's joint-space embeddings (``vsekit.train.embed``)."""

from __future__ import annotations

import click

from ..devices import resolve_device
from .options import STORAGE_OPTION, RunPath, StorePath


@click.command("embed")
@click.argument("run", type=RunPath())
@click.option("--split", default="test", show_default=True, type=click.Choice(["train", "val", "test", "restval"]),
              help="Split to embed.")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Folder for images.npy, captions.npy, their .parquet ids and embed.json.")
@click.option("--store", default=None, type=StorePath(exists=True, url_ok=True),
              help="Embed this store instead of the run's (same vocabulary).")
@STORAGE_OPTION
@click.option("--features", default=None, help="Feature set instead of the run's.")
@click.option("--checkpoint", type=click.Choice(["best", "last"]), default="best", show_default=True,
              help="Checkpoint of the run: the best validation rsum, or the last epoch.")
@click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda | cuda:N.")
@click.option("--batch-size", default=256, show_default=True, type=click.IntRange(1),
              help="Images or captions encoded per batch.")
def embed_cmd(run, out, device, **options):
    """Write the images' and captions' embeddings (with ids) of SPLIT, ready for faiss."""
    from ..train.embed import embed

    doc = embed(run, out, device=resolve_device(device), **options)
    click.echo(f"wrote {doc['n_images']} image and {doc['n_captions']} caption embeddings of dimension "
               f"{doc['dim']} to {out} ({doc['similarity']}: {doc['search']})")


COMMANDS = (embed_cmd,)
