"""``vsekit info`` and ``vsekit demo-data``."""

from __future__ import annotations

import click


@click.command("info")
@click.argument("store", type=click.Path(exists=True, file_okay=False))
@click.argument("name", required=False)
def info(store: str, name: str | None) -> None:
    """Print a store's tree, shapes, dtypes, chunks, provenance and done/failed/pending rows."""
    from ..storage.info import describe
    from ..storage.store import FeatureStore

    click.echo(describe(FeatureStore.open(store), name))


@click.command("demo-data")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--images", default=400, show_default=True, help="Number of images.")
@click.option("--seed", default=0, show_default=True, help="Random seed; output is deterministic per seed.")
@click.option("--size", default=128, show_default=True, help="Image side in pixels.")
def demo_data(out_dir: str, images: int, seed: int, size: int) -> None:
    """Write a synthetic captioned dataset (JPEGs, Karpathy JSON, boxes.json) to OUT_DIR."""
    from ..storage.demo import make_demo_data

    path = make_demo_data(out_dir, images=images, seed=seed, size=size)
    click.echo(f"wrote {images} images and {path}")


def register(group: click.Group) -> None:
    group.add_command(info)
    group.add_command(demo_data)
