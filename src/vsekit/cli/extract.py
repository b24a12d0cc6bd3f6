"""``vsekit extract``: a thin wrapper over :func:`vsekit.extract.run_job`.

Its options are the fields of :class:`vsekit.extract.job.ExtractOptions` and
:class:`~vsekit.extract.job.Execution` (flag, default, help), built here, passed through unchanged.
"""

from __future__ import annotations

import dataclasses

import click

from ..extract.job import Execution, ExtractOptions, fields_of
from ..clusters import SPEC_HELP
from .options import CLUSTER, IMAGE_OPTION, STORAGE_OPTION, WORKERS, StorePath

#: the Click types of fields whose values the CLI shares with other commands (docs/cli.md)
CLICK_TYPES = {"workers": WORKERS}


def click_option(f: dataclasses.Field):
    """The Click option of one field of the job description (see :func:`vsekit.extract.job.option`)."""
    m = f.metadata
    kw: dict = {"help": m["help"] or None}
    if m["metavar"]:
        kw["metavar"] = m["metavar"]
    if isinstance(f.default, bool):
        decls = [f"{m['flag']}/{m['secondary']}"] if m["secondary"] else [m["flag"]]
        return click.option(*decls, f.name, is_flag=True, default=f.default,
                            show_default=bool(m["secondary"]), **kw)
    if m["choices"]:
        kw["type"] = click.Choice(list(m["choices"]))   # Click >= 8.2 returns the choice itself (an int)
    elif f.name in CLICK_TYPES:
        kw["type"] = CLICK_TYPES[f.name]
    elif m["type"] is not None:
        kw["type"] = m["type"]
    show = m["show_default"] and f.default is not None
    return click.option(m["flag"], f.name, default=f.default, show_default=show, **kw)


def job_options(command):
    """Decorate ``command`` with the options of every field (in field order)."""
    for f in reversed([*fields_of(ExtractOptions), *fields_of(Execution)]):
        command = click_option(f)(command)
    return command


@click.command("extract")
@click.option("--store", "store", type=StorePath(url_ok=True), help="The vsekit store (.zarr, or s3://...).")
@STORAGE_OPTION
@IMAGE_OPTION
@click.option("--list-layers", is_flag=True, help="List the model's layers and widths, then exit.")
@job_options
@click.option("--cluster", "cluster", type=CLUSTER, default=None, help=f"Where the blocks run: {SPEC_HELP}.")
def extract_cmd(store, list_layers, cluster, **values):
    """Extract image features (global, FNE, grid or regions) into the store."""
    if list_layers:
        from ..extract import list_layers as _list

        rows = _list(values["model"], values["input_size"])
        click.echo(f"{'layer':40s} {'type':22s} {'shape':18s} {'width':>6s} {'layout':6s}  FNE default")
        for r in rows:
            click.echo(f"{r['name']:40s} {r['type']:22s} {str(tuple(r['shape'])):18s} {r['width']:6d}"
                       f" {r['layout']:6s}  {'*' if r['default_tap'] else ''}")
        return
    if not store:
        raise click.UsageError("--store is required (unless --list-layers)")
    from ..extract.job import EXECUTION_NAMES
    from ..extract.runner import run_job

    opts = ExtractOptions(**{k: v for k, v in values.items() if k not in EXECUTION_NAMES})
    run = Execution(**{k: v for k, v in values.items() if k in EXECUTION_NAMES})
    result = run_job(store, opts, run, cluster)   # --cluster: parsed once, by its type
    click.echo(result.summary())
    if getattr(result, "failed", 0):   # a split left without a usable image is said now, not at train time
        from ..storage.splits import split_notes
        from ..storage.store import FeatureStore

        for note in split_notes(FeatureStore.open(store), result.name):
            click.echo(note, err=True)


COMMANDS = (extract_cmd,)
