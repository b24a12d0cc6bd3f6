"""``vsekit extract``: a thin wrapper over :func:`vsekit.extract.extract`."""

from __future__ import annotations

import click

from ..cluster import SPEC_HELP as CLUSTER_HELP


@click.command("extract")
@click.option("--store", "store", type=click.Path(file_okay=False), help="The vsekit store (.zarr).")
@click.option("--model", default="vgg19", show_default=True,
              help="vgg16 (the FNE paper's) | vgg19 | resnet152 | inception_resnet_v2 | any timm model name.")
@click.option("--kind", default="global", show_default=True, type=click.Choice(["global", "fne", "grid", "regions"]))
@click.option("--weights", default="imagenet", show_default=True, help="imagenet | none | PATH to a checkpoint.")
@click.option("--seed", default=0, show_default=True, help="Seed of the random initialisation with --weights none.")
@click.option("--name", default=None, help="Feature set name [default: MODEL_KIND].")
@click.option("--crops", default=1, show_default=True, type=click.Choice(["1", "5", "10"]),
              help="Centre crop, 4 corners + centre, or those 5 and their mirrors (averaged).")
@click.option("--keep-crops", is_flag=True, help="Store every crop's features instead of their mean.")
@click.option("--resize", type=int, default=None, help="Resize size [default: from the weights].")
@click.option("--resize-mode", type=click.Choice(["shorter", "square"]), default=None,
              help="Resize the shorter side, or to a square [default: shorter; square for grid/regions].")
@click.option("--input-size", type=int, default=None,
              help="Crop (network input) size [default: from the weights; 448 for grid/regions].")
@click.option("--interpolation", type=click.Choice(["bilinear", "bicubic", "nearest", "lanczos"]), default=None)
@click.option("--taps", default=None, help="FNE layers: comma-separated glob patterns (see --list-layers).")
@click.option("--list-layers", is_flag=True, help="List the model's layers and widths, then exit.")
@click.option("--grid", default=7, show_default=True, help="Grid side G for --kind grid (14 keeps layer4 whole).")
@click.option("--boxes", default=None,
              help="Regions: a JSON file {image_id: [[x1,y1,x2,y2], ...]}, or 'detector' (= --detector coco-frcnn).")
@click.option("--detector", type=click.Choice(["butd-r101", "coco-frcnn"]), default=None,
              help="Regions from a detector: butd-r101 (bottom-up-attention boxes and features) or "
                   "coco-frcnn (COCO boxes, --model features). See docs/extract.md.")
@click.option("--detector-weights", default=None,
              help="imagenet (coco-frcnn: torchvision's COCO weights) | none (random) | PATH "
                   "[default: imagenet for coco-frcnn; butd-r101 needs PATH or none].")
@click.option("--max-regions", default=36, show_default=True)
@click.option("--min-regions", type=int, default=None,
              help="Floor of detector boxes per image [default: 10; butd-r101: = --max-regions].")
@click.option("--batch-size", default=32, show_default=True, help="Images per forward pass.")
@click.option("--workers", default="auto", show_default=True,
              help="Decoding worker processes (0: in-process; auto: 2 on CPU, 6 per GPU, capped by the cores).")
@click.option("--pin-memory", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Page-locked batches and asynchronous host-to-GPU copies (auto: on with CUDA).")
@click.option("--channels-last/--no-channels-last", default=True, show_default=True,
              help="NHWC layout of the model and its inputs (faster convolutions on GPUs).")
@click.option("--device", default="auto", show_default=True,
              help="auto (CUDA when available, else CPU) | cpu | cuda | cuda:N.")
@click.option("--precision", default="fp32", show_default=True, type=click.Choice(["fp32", "bf16", "fp16"]))
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default=None,
              help="Stored dtype [default: float32 global/fne, float16 grid/regions].")
@click.option("--block-rows", type=int, default=None, help="Rows per block (unit of work and resume).")
@click.option("--cluster", default=None, metavar="SPEC", help=f"Where the blocks run: {CLUSTER_HELP}.")
@click.option("--strict", is_flag=True, help="Stop at the first bad image.")
@click.option("--overwrite", is_flag=True, help="Start afresh instead of resuming.")
@click.option("--retry-failed", is_flag=True,
              help="Try again the rows that failed on a missing or unreadable image file.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def extract_cmd(store, model, kind, weights, seed, name, crops, keep_crops, resize, resize_mode, input_size,
                interpolation, taps, list_layers, grid, boxes, detector, detector_weights, max_regions, min_regions,
                batch_size, workers,
                device, precision, dtype, block_rows, cluster, strict, overwrite, retry_failed, no_progress, pin_memory,
                channels_last):
    """Extract image features (global, FNE, grid or regions) into the store."""
    if list_layers:
        from ..extract import list_layers as _list

        rows = _list(model, input_size)
        click.echo(f"{'layer':40s} {'type':22s} {'shape':18s} {'width':>6s} {'layout':6s}  FNE default")
        for r in rows:
            click.echo(f"{r['name']:40s} {r['type']:22s} {str(tuple(r['shape'])):18s} {r['width']:6d}"
                       f" {r['layout']:6s}  {'*' if r['default_tap'] else ''}")
        return
    if not store:
        raise click.UsageError("--store is required (unless --list-layers)")
    from ..devices import resolve_device
    from ..extract import extract
    from ..extract.runner import Interrupted, exit_code_of, sigterm_interrupts
    from ..extract.throughput import apply, decode_workers

    from ..cluster import resolves_on_workers

    if not resolves_on_workers(cluster):   # slurm: each worker resolves it on its node
        device = resolve_device(device)
    apply(pin=pin_memory, channels_last=channels_last)
    workers = decode_workers(workers, device)  # in-process: one GPU
    restore = sigterm_interrupts()
    try:
        result = extract(store, model, kind, weights=weights, name=name, crops=int(crops), keep_crops=keep_crops,
                         resize=resize, resize_mode=resize_mode, input_size=input_size,
                         interpolation=interpolation, taps=taps, grid=grid, boxes=boxes,
                         max_regions=max_regions, min_regions=min_regions, seed=seed, batch_size=batch_size,
                         workers=workers, device=device, precision=precision, dtype=dtype,
                         block_rows=block_rows, cluster=cluster, strict=strict, overwrite=overwrite,
                         progress=not no_progress, retry_failed=retry_failed,
                         detector=detector, detector_weights=detector_weights)
    except Interrupted as exc:
        click.echo(str(exc), err=True)
        raise SystemExit(exc.exit_code) from None
    except KeyboardInterrupt as exc:   # before the extraction itself started (plan, lock, creating the set)
        click.echo("interrupted before the extraction started; nothing new was written (rerun the same "
                   "command to start again)", err=True)
        raise SystemExit(exit_code_of(exc)) from None
    finally:
        restore()
    click.echo(result.summary())


def register(group: click.Group) -> None:
    group.add_command(extract_cmd)
