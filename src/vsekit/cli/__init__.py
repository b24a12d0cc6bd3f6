"""The ``vsekit`` command line: one thin Click command per stage.

Each area registers its commands in its own module here (``cli/extract.py``...), so the stage
packages themselves never import Click. Heavy libraries (torch, dask) are imported inside commands,
so ``vsekit --help`` stays fast.
"""

from __future__ import annotations

import sys

import click

from ..storage.fserrors import user_error
from ..version import __version__


#: the exit code of every user error: a wrong option or value (Click's usage errors, 2 by Click's own
#: default) as well as a refused input; docs/cli.md "Exit codes"
USER_ERROR = 1


class VsekitGroup(click.Group):
    """A group that turns the library's expected errors into clean messages and exit code 1."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:   # `vsekit --bogus`, `vsekit trian`
            exc.exit_code = USER_ERROR
            raise

    def invoke(self, ctx: click.Context):
        from ..interrupts import Interrupted, handling
        from ..storage.objstore import reset_options

        reset_options()   # this command's --storage-option values only, never an earlier command's
        argv = [*getattr(ctx, "_protected_args", []), *ctx.args]   # the subcommand's, before click consumes them
        try:
            with handling():   # Ctrl-C / SIGTERM: locks released, what was kept said, exit 130 / 143
                return super().invoke(ctx)
        except Interrupted as exc:
            click.echo(str(exc) or "interrupted", err=True)
            raise SystemExit(exc.exit_code) from None
        except click.UsageError as exc:   # a subcommand's wrong option or value
            exc = _ranked(exc)
            exc.exit_code = USER_ERROR
            raise exc from None
        except click.ClickException:
            raise
        except Exception as exc:   # the library's refusals: one line (vsekit run words them the same)
            message = user_error(exc, _store_arg(argv))
            if message is None:
                raise
            raise click.ClickException(message) from exc


class _RankedNoSuchOption(click.NoSuchOption):
    """Click lists "did you mean" options alphabetically (``--modle``: ``--decoder`` before ``--model``);
    this keeps difflib's order, the closest first."""

    def format_message(self) -> str:
        if not self.possibilities:
            return self.message
        if len(self.possibilities) == 1:
            return f"{self.message} Did you mean {self.possibilities[0]!r}?"
        return f"{self.message} (Did you mean one of: {', '.join(repr(p) for p in self.possibilities)}?)"


def _ranked(exc: click.UsageError) -> click.UsageError:
    if type(exc) is not click.NoSuchOption or not exc.possibilities:
        return exc
    ranked = _RankedNoSuchOption(exc.option_name, exc.message, ctx=exc.ctx)
    ranked.possibilities = list(exc.possibilities)   # get_close_matches' order: best first
    return ranked


def _store_arg(argv: list[str]) -> str | None:
    """The ``--store`` of a command line, to name where a write failed when the system did not say."""
    for i, arg in enumerate(argv):
        if arg == "--store" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--store="):
            return arg.split("=", 1)[1]
    return None


@click.group(cls=VsekitGroup, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(__version__, prog_name="vsekit")
def main() -> None:
    """vsekit: image-text retrieval inputs, training and evaluation over Zarr stores."""
    from ..allocator import tune_allocator

    tune_allocator()   # keep numeric temporaries' memory for reuse (VSEKIT_MALLOC_TUNING=0: off)


# The modules under vsekit.cli that define commands, imported by name (so the import graph, and
# tests/test_imports.py, sees every edge); each lists its ``COMMANDS``.
from . import embed, export, extract, fne, ingest, pipeline, report, store, tokenize, train  # noqa: E402

COMMAND_MODULES = (store, ingest, export, extract, fne, tokenize, train, pipeline, report, embed)
for _mod in COMMAND_MODULES:
    for _command in _mod.COMMANDS:
        main.add_command(_command)


def run() -> None:  # pragma: no cover - console entry point helper
    sys.exit(main())
