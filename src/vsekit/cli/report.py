"""``vsekit report``: a static HTML page of one or more training runs."""

from __future__ import annotations

import click

from ..devices import resolve_device
from .options import IMAGE_OPTION, STORAGE_OPTION, RunPath, StorePath


@click.command("report")
@click.argument("runs", nargs=-1, required=True, type=RunPath())
@click.option("--out", "out", required=True, type=click.Path(file_okay=False),
              help="Folder to write index.html (and report.json) into.")
@click.option("--split", default="test", show_default=True, type=click.Choice(["train", "val", "test", "restval"]),
              help="Split the retrieval examples come from.")
@click.option("--caption-queries", "n_captions", default=8, show_default=True, type=click.IntRange(min=0),
              help="Sampled caption queries.")
@click.option("--image-queries", "n_images", default=6, show_default=True, type=click.IntRange(min=0),
              help="Sampled image queries.")
@click.option("--attention", "n_attention", default=3, show_default=True, type=click.IntRange(min=0),
              help="Caption-image pairs to show attention maps for.")
@click.option("--top-k", "k", default=5, show_default=True, type=click.IntRange(min=1), help="Results shown per query.")
@click.option("--seed", default=0, show_default=True, help="Seed of the example sample.")
@click.option("--store", default=None, type=StorePath(url_ok=True),
              help="Store to read, a path or s3://... (default: the one in each run's config.json).")
@STORAGE_OPTION
@IMAGE_OPTION
@click.option("--device", default="auto", show_default=True,
              help="Device to score examples on: auto | cpu | cuda | cuda:N.")
@click.option("--block", default=256, show_default=True, type=click.IntRange(min=1), help="Rows scored per block.")
@click.option("--thumb-size", default=96, show_default=True, type=click.IntRange(min=8), help="Thumbnail side in pixels.")
@click.option("--title", default=None, help="Page title.")
def report(runs, out, device, **options) -> None:
    """Write a self-contained HTML report of RUNS (metrics, curves, retrieval examples, attention)."""
    from ..report import report as make_report

    s = make_report(list(runs), out, device=resolve_device(device), **options)
    for note in s.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(f"wrote {s.path} ({len(s.runs)} run(s), {s.n_caption_examples} caption and "
               f"{s.n_image_examples} image examples, {s.n_attention} attention maps) in {s.seconds:.1f}s")
    click.echo(f"open {s.path.resolve().as_uri()}")


@click.command("report-boxes")
@click.argument("store", type=StorePath(exists=True, url_ok=True))
@click.argument("name")
@STORAGE_OPTION
@IMAGE_OPTION
@click.option("--rows", default="0", show_default=True, help="Comma-separated image rows.")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="Folder for the PNGs.")
@click.option("--objects-vocab", type=click.Path(exists=True, dir_okay=False), default=None,
              help="BUTD objects_vocab.txt (labels are shown as indices without it).")
@click.option("--attributes-vocab", type=click.Path(exists=True, dir_okay=False), default=None,
              help="BUTD attributes_vocab.txt.")
@click.option("--max-boxes", type=int, default=None, help="Draw at most this many boxes per image.")
def report_boxes(store, name, rows, out, **options) -> None:
    """Draw the region boxes (and detector labels) of feature set NAME over their images."""
    from ..report.boxes import regions_png

    try:
        picked = [int(r) for r in rows.split(",") if r.strip()]
    except ValueError:
        raise click.BadParameter(f"{rows!r} is not a comma-separated list of rows", param_hint="--rows")
    for r in picked:
        click.echo(f"wrote {regions_png(store, name, r, f'{out}/{name}_{r}.png', **options)}")


COMMANDS = (report, report_boxes)
