"""Option types shared by every command, so one option name has one type everywhere (docs/cli.md)."""

from __future__ import annotations

import os

import click

SPLIT_NAMES = ("train", "val", "test", "restval")


#: what works on an object-store URL today; every other command refuses one, naming these
URL_COMMANDS = ("every `ingest`, `split`, `extract`, `tokenize`, `standardize`, `discretize` and `fne` (in-process, "
                "--cluster local:N, tcp://, slurm:N, sge:N, pbs:N, lsf:N and htcondor:N; extract also slurm-array:N "
                "and sge-array:N; "
                "tokenize also --workers N), `train`, `evaluate`, `embed`, `report`, `info` (with --verify and "
                "--repair) and `export` (reading)")


class Workers(click.ParamType):
    """``--workers``: a number of worker processes, or ``auto`` (the command picks from the cores)."""

    name = "workers"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value == "auto":
            return value
        text = str(value).strip().lower()
        if text == "auto":
            return "auto"
        try:
            n = int(text)
        except ValueError:
            self.fail(f"{value!r} is not a number of workers or 'auto'", param, ctx)
        if n < 0:
            self.fail(f"{value!r}: the number of workers cannot be negative", param, ctx)
        return n

    def get_metavar(self, param, ctx=None):   # click 8.2+ passes ctx
        return "N|auto"


WORKERS = Workers()


class StorePath(click.Path):
    """``--store``: a store's path, or with ``url_ok`` an object-store URL (``s3://``, ``gs://``,
    ``az://``, ``memory://``) as is. A URL the command cannot serve is refused in one line first,
    naming the commands that do, rather than reported as a missing folder or created as a folder
    named ``s3:`` (``tests/test_objstore_cli.py``). With ``exists``, a path with nothing there gets the
    store's own one line (``storage.base.not_a_store``), as from every command (``tests/test_one_message.py``)."""

    def __init__(self, exists: bool = False, url_ok: bool = False):
        super().__init__(exists=exists, file_okay=False)
        self.url_ok = url_ok

    def convert(self, value, param, ctx):
        from ..storage.base import StoreError, not_a_store
        from ..storage.objstore import is_object_url, public_url
        from ..storage.store import local_path

        if isinstance(value, str) and is_object_url(value):
            if self.url_ok:
                return value
            command = f"`{ctx.command_path}`" if ctx is not None else "this command"
            self.fail(f"{public_url(value)}: {command} does not serve stores on object storage yet; "
                      f"they are served by {URL_COMMANDS} (issue 35). Copy the store to a local path for "
                      f"this command", param, ctx)
        try:
            value = str(local_path(value)) if isinstance(value, str) else value
        except StoreError as exc:
            self.fail(str(exc).split(": ", 1)[1], param, ctx)
        if self.exists and not os.path.exists(value):
            raise click.ClickException(not_a_store(value))
        return super().convert(value, param, ctx)


class RunPath(click.Path):
    """A training run folder (``evaluate``, ``embed``, ``report``): one with no run in it gets the one line
    of every command (``storage.base.not_a_run``, ``tests/test_one_message.py``)."""

    def __init__(self):
        super().__init__(file_okay=False)

    def convert(self, value, param, ctx):
        from ..storage.base import not_a_run

        if not os.path.isfile(os.path.join(os.fspath(value), "config.json")):
            raise click.ClickException(not_a_run(value))
        return super().convert(value, param, ctx)


def _storage_options(ctx, param, values):
    from ..storage.objstore import DEFAULT_OPTIONS, parse_options

    try:
        DEFAULT_OPTIONS.update(parse_options(values))
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
    return None


#: ``--storage-option KEY=VALUE`` (repeatable): credentials, endpoint, region... of an object-store
#: ``--store``, over the standard environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...). The values
#: stay in memory: never written to the store, a log or a report.
STORAGE_OPTION = click.option(
    "--storage-option", "storage_option", multiple=True, metavar="KEY=VALUE", expose_value=False,
    callback=_storage_options,
    help="An option of an object-store --store (endpoint, region, access_key_id, ...; repeatable), over "
         "the standard environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...). Never recorded.")


def _image_options(ctx, param, values):
    from ..storage.objstore import parse_options
    from ..storage.sources.remote import use_options

    try:
        use_options(parse_options(values))
    except ValueError as exc:
        raise click.BadParameter(str(exc).replace("--storage-option", "--image-option"), ctx=ctx,
                                 param=param) from None
    return None


#: ``--image-option KEY=VALUE`` (repeatable): the options of images on object storage (an image root,
#: shards) where they differ from the store's --storage-option (another provider or account), and
#: ``read_requests``, ``max_retries``, ``timeout`` of the image reads. In memory only, as --storage-option.
IMAGE_OPTION = click.option(
    "--image-option", "image_option", multiple=True, metavar="KEY=VALUE", expose_value=False,
    callback=_image_options,
    help="An option of images on object storage (endpoint, access_key_id, ..., read_requests, max_retries, "
         "timeout; repeatable), where they differ from --storage-option's. Never recorded.")


def resolve_workers(value, cap: int = 4) -> int:
    """``auto`` → the cores this process may use, at most ``cap``; a number as is."""
    if value == "auto":
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:   # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
        return max(1, min(cap, cores))
    return int(value)


class SplitNames(click.ParamType):
    """``--split`` where a command reads several splits: names, comma-separated (``train`` or ``train,val``)."""

    name = "split"

    def convert(self, value, param, ctx):
        names = [s.strip() for s in str(value).split(",") if s.strip()]
        for s in names:
            if s not in SPLIT_NAMES:
                self.fail(f"unknown split {s!r}; valid choices: {', '.join(SPLIT_NAMES)} (comma-separated)", param, ctx)
        if not names:
            self.fail("no split given", param, ctx)
        return ",".join(names)

    def get_metavar(self, param, ctx=None):
        return "SPLIT[,SPLIT]"


SPLITS = SplitNames()


class ClusterType(click.ParamType):
    """``--cluster``: parsed here, once, into a :class:`vsekit.clusters.ClusterSpec` (SLURM settings from
    ``$VSEKIT_CLUSTER_CONFIG``); a spec already parsed (``vsekit run`` parses its pipeline's with the
    pipeline's ``cluster:`` settings) passes through unchanged."""

    name = "cluster"

    def __init__(self, parse: bool = True):
        self.parse = parse   # False: `vsekit run`, which parses it with its pipeline's `cluster:` settings

    def convert(self, value, param, ctx):
        from ..clusters import ClusterSpec, parse_cluster

        if value is None or isinstance(value, ClusterSpec) or not self.parse:
            return value
        try:
            return parse_cluster(value)
        except ValueError as exc:   # the library's own one-line message, as every other refusal
            raise click.ClickException(str(exc)) from None

    def get_metavar(self, param, ctx=None):
        return "SPEC"


CLUSTER = ClusterType()
CLUSTER_TEXT = ClusterType(parse=False)
