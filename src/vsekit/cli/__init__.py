"""The ``vsekit`` command line: one thin Click command per stage.

Each area registers its commands in its own module here (``cli/extract.py``...), so the stage
packages themselves never import Click. Heavy libraries (torch, dask) are imported inside commands,
so ``vsekit --help`` stays fast.
"""

from __future__ import annotations

import importlib
import logging
import sys

import click

from ..storage.fserrors import FilesystemError, fs_error, is_fs_error
from ..storage.store import StoreError
from ..version import __version__

# Modules under vsekit.cli that define commands; each exposes ``register(group)``.
COMMAND_MODULES = ("store", "ingest", "export", "extract", "fne", "tokenize", "train", "pipeline", "report", "embed")


class VsekitGroup(click.Group):
    """A group that turns the library's expected errors into clean messages and exit code 1."""

    def invoke(self, ctx: click.Context):
        from ..interrupts import Interrupted, handling

        try:
            with handling():   # Ctrl-C / SIGTERM: locks released, what was kept said, exit 130 / 143
                return self._invoke(ctx)
        except Interrupted as exc:
            click.echo(str(exc) or "interrupted", err=True)
            raise SystemExit(exc.exit_code) from None

    def _invoke(self, ctx: click.Context):
        argv = [*getattr(ctx, "_protected_args", []), *ctx.args]   # the subcommand's, before click consumes them
        try:
            return super().invoke(ctx)
        except (StoreError, FilesystemError, ValueError, FileNotFoundError) as exc:
            if isinstance(exc, click.ClickException):
                raise
            if isinstance(exc, FilesystemError):
                _quiet_unretrieved_write_errors()
            raise click.ClickException(str(exc)) from exc
        except OSError as exc:   # a full, read-only or forbidden filesystem: one line naming the path
            if not is_fs_error(exc):
                raise
            _quiet_unretrieved_write_errors()
            raise click.ClickException(str(fs_error(exc, _store_arg(argv)))) from exc


class _UnretrievedOSError(logging.Filter):
    """Drops asyncio's "Future/Task exception was never retrieved" for an OSError: after one write of a
    zarr store fails (a full disk), zarr's other concurrent writes of the same call fail too and are
    never awaited, and asyncio prints each one's traceback when it is collected, after the one
    ``Error:`` line that already says what happened."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not ("exception was never retrieved" in str(record.msg) and isinstance(exc, OSError))


def _quiet_unretrieved_write_errors() -> None:
    logging.getLogger("asyncio").addFilter(_UnretrievedOSError())


def _store_arg(argv: list[str]) -> str | None:
    """The ``--store`` of a command line, to name where a write failed when the system did not say."""
    for i, arg in enumerate(argv):
        if arg == "--store" and i + 1 < len(argv):
            return f"in the store {argv[i + 1]}"
        if arg.startswith("--store="):
            return f"in the store {arg.split('=', 1)[1]}"
    return None


@click.group(cls=VsekitGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vsekit")
def main() -> None:
    """vsekit: image-text retrieval inputs, training and evaluation over Zarr stores."""
    from ..allocator import tune_allocator

    tune_allocator()   # keep numeric temporaries' memory for reuse (VSEKIT_MALLOC_TUNING=0: off)


for _name in COMMAND_MODULES:
    try:
        _mod = importlib.import_module(f"{__name__}.{_name}")
    except ModuleNotFoundError as _exc:  # an area not built yet
        if _exc.name != f"{__name__}.{_name}":
            raise
        continue
    _mod.register(main)


def run() -> None:  # pragma: no cover - console entry point helper
    sys.exit(main())
