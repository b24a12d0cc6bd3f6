"""``vsekit report``: a static HTML page of one or more training runs."""

from __future__ import annotations

import click


@click.command("report")
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out", required=True, type=click.Path(file_okay=False),
              help="Folder to write index.html (and report.json) into.")
@click.option("--split", default="test", show_default=True, help="Split the retrieval examples come from.")
@click.option("--captions", "n_captions", default=8, show_default=True, help="Sampled caption queries.")
@click.option("--images", "n_images", default=6, show_default=True, help="Sampled image queries.")
@click.option("--attention", "n_attention", default=3, show_default=True,
              help="Caption-image pairs to show attention maps for.")
@click.option("--top-k", "k", default=5, show_default=True, help="Results shown per query.")
@click.option("--seed", default=0, show_default=True, help="Seed of the example sample.")
@click.option("--store", default=None, type=click.Path(file_okay=False),
              help="Store to read (default: the one in each run's config.json).")
@click.option("--device", default="auto", show_default=True,
              help="Device to score examples on: auto | cpu | cuda | cuda:N.")
@click.option("--block", default=256, show_default=True, help="Rows scored per block.")
@click.option("--thumb-size", default=96, show_default=True, help="Thumbnail side in pixels.")
@click.option("--title", default=None, help="Page title.")
def report(runs, out, split, n_captions, n_images, n_attention, k, seed, store, device, block, thumb_size,
           title) -> None:
    """Write a self-contained HTML report of RUNS (metrics, curves, retrieval examples, attention)."""
    from ..devices import resolve_device
    from ..report import report as make_report

    device = resolve_device(device)

    s = make_report(list(runs), out, split=split, n_captions=n_captions, n_images=n_images,
                    n_attention=n_attention, k=k, seed=seed, store=store, device=device, block=block,
                    thumb_size=thumb_size, title=title)
    for note in s.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(f"wrote {s.path} ({len(s.runs)} run(s), {s.n_caption_examples} caption and "
               f"{s.n_image_examples} image examples, {s.n_attention} attention maps) in {s.seconds:.1f}s")
    click.echo(f"open {s.path.resolve().as_uri()}")


def register(group: click.Group) -> None:
    group.add_command(report)
