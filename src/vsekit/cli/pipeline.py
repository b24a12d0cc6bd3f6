"""``vsekit run``: run a named pipeline from ``pipelines.yaml``."""

from __future__ import annotations

import click

from ..clusters import SPEC_HELP as CLUSTER_HELP
from ..devices import resolve_device
from .options import CLUSTER_TEXT, STORAGE_OPTION


def key_values(values: tuple[str, ...], option: str = "--set") -> dict[str, str]:
    """``KEY=VALUE`` items of a repeatable option as a dict; an item without ``=`` is refused."""
    out = {}
    for item in values:
        if "=" not in item:
            raise click.BadParameter(f"{item!r}: expected KEY=VALUE", param_hint=option)
        key, value = item.split("=", 1)
        out[key.strip()] = value
    return out


@click.command("run")
@click.argument("pipeline", required=False)
@click.option("--file", "file", type=click.Path(dir_okay=False), default=None,
              help="Your pipelines file (default: ./pipelines.yaml, else $VSEKIT_PIPELINES); its pipelines are "
                   "added to the recipes shipped with vsekit, and one named like a shipped recipe replaces it.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Set a ${KEY} variable of the pipeline (wins over the environment and the file's "
                   "variables); a name the pipeline does not use is refused.")
@click.option("-o", "--stage-option", "stage_options", multiple=True, metavar="STAGE.OPTION=VALUE",
              help="Set an option of a stage as if written in the file: STAGE is a stage id, a command "
                   "(extract: all its stages) or *; e.g. -o extract.weights=none (repeatable).")
@click.option("--from", "from_stage", metavar="STAGE", default=None,
              help="Rerun from this stage (id, command or 1-based number); earlier stages are not touched.")
@click.option("--force", is_flag=True, help="Rerun every stage, even those up to date.")
@click.option("--dry-run", is_flag=True, help="Print the plan (what runs, what is skipped and why) and stop.")
@click.option("--list", "list_", is_flag=True, help="List the pipelines in the file.")
@click.option("--smoke", is_flag=True,
              help="Run the pipeline end to end on a few synthetic images in vsekit-smoke/PIPELINE/, in minutes: "
                   "random weights, small inputs, 1 epoch (each change is printed first).")
@click.option("--cluster", default=None, type=CLUSTER_TEXT,
              help=f"Pass --cluster to every stage that accepts it: {CLUSTER_HELP} (slurm uses the "
                   f"file's `cluster:`).")
@click.option("--device", default=None, metavar="auto|cpu|cuda|cuda:N",
              help="Set ${DEVICE}, the device of every stage that has --device [default: auto].")
@STORAGE_OPTION
def run(pipeline, file, sets, stage_options, from_stage, force, dry_run, list_, smoke, cluster, device):
    """Run the named PIPELINE: skip stages that are up to date, rerun changed ones and those after them."""
    from ..pipeline import list_pipelines, load_pipelines
    from ..pipeline import run as run_pipeline

    pf = load_pipelines(file)
    if list_ or not pipeline:
        click.echo(list_pipelines(pf))
        if not list_:
            click.echo("run one with: vsekit run NAME [--dry-run]")
        return
    from ..clusters import parse_cluster   # looked up when called (tests count the parses through it)

    sets = key_values(sets)
    settings = cluster_settings_of(pf, pipeline)
    spec = parse_cluster(cluster, settings or None)   # --cluster: parsed once, with the pipeline's `cluster:`
    if device is not None:
        if spec is None or not spec.resolves_on_workers:   # slurm: the extraction's GPUs are on the nodes
            resolve_device(device)  # refuse a device this machine lacks now, in one line
        sets["DEVICE"] = device.strip().lower()
    cli = click.get_current_context().find_root().command
    counts = None
    if smoke:   # the recipe on synthetic data: its variables and stage options set (pipeline/smoke.py)
        from ..pipeline.smoke import make_smoke_data, plan_smoke

        plan = plan_smoke(pf.get(pipeline), cli)
        click.echo("\n".join(plan.notes))
        sets, stage_options, counts = {**plan.sets, **sets}, (*plan.options, *stage_options), plan.split_counts()
        if not dry_run:
            make_smoke_data(plan)
    result = run_pipeline(pipeline, cli=cli, file=file, sets=sets, from_stage=from_stage, force=force,
                          dry_run=dry_run, cluster=spec, cluster_settings=settings or None,
                          stage_options=stage_options)
    if dry_run:   # the work each stage implies (pipeline/costs.py)
        from ..pipeline.costs import work_lines

        click.echo("\n".join(work_lines(result.steps, counts)))


def cluster_settings_of(pf, name: str) -> dict:
    """The pipeline's `cluster:` section (the SLURM settings of its stages' --cluster slurm:N)."""
    return dict(pf.pipelines[name].cluster) if name in pf.pipelines else {}


COMMANDS = (run,)
