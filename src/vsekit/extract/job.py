"""One description of an extraction job: what to compute (:class:`ExtractOptions`, which makes the
:class:`~vsekit.extract.plan.Plan`), how to run it (:class:`Execution`), and the two together with
where to write (:class:`Job`, what every executor hands its tasks). Each field is an option
(:func:`.fields.option`: the CLI flag, ``extract()``'s keyword and the remake command follow from it;
docs/architecture.md, "A new extract option"). No setting travels through the environment.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from ..storage.remake import register as register_remake
from .fields import fields_of, option
from .plan import ExtractOptions, Plan  # noqa: F401 (ExtractOptions: what is computed, beside the Plan it makes)
from .throughput import PIN_CHOICES, decode_workers, pin_memory


@dataclass(frozen=True)
class Execution:
    """How the blocks are computed, and how the run treats what the set holds already (resume,
    ``overwrite``, ``retry_failed``); nothing here changes the features beyond float rounding, so
    nothing here enters the settings hash (``block_rows`` is the set's layout, fixed at creation).
    Where the blocks run is the :class:`~vsekit.clusters.ClusterSpec` passed beside it."""

    device: str = option("auto", "--device", "auto (CUDA when available, else CPU) | cpu | cuda | cuda:N.")
    batch_size: int = option(32, "--batch-size", "Images per forward pass.", type=int)
    workers: Any = option("auto", "--workers", "Decoding worker processes (0: in-process; auto: 2 on CPU, 6 per "
                          "GPU, capped by the cores).")
    pin_memory: str = option("auto", "--pin-memory", "Page-locked batches and asynchronous host-to-GPU copies "
                             "(auto: on with CUDA).", choices=PIN_CHOICES)
    channels_last: bool = option(True, "--channels-last", "NHWC layout of the model and its inputs (faster "
                                 "convolutions on GPUs).", secondary="--no-channels-last")
    prefetch: int = option(2, "--prefetch", "Batches each decoding worker prepares ahead (more: smoother "
                           "feeding of a fast GPU, more memory).", type=int)
    strict: bool = option(False, "--strict", "Stop at the first bad image.")
    block_rows: int | None = option(None, "--block-rows", "Rows per block (unit of work and resume).", type=int,
                                    attr="block_rows", when=lambda a: bool(a.get("block_rows")),
                                    show_default=False)
    progress: bool = option(True, "--progress", "Show a progress bar.", secondary="--no-progress")
    overwrite: bool = option(False, "--overwrite", "Start afresh instead of resuming.")
    retry_failed: bool = option(False, "--retry-failed",
                                "Try again the rows that failed on a missing or unreadable image file.")

    def checked(self) -> "Execution":
        if int(self.batch_size) < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        decode_workers(self.workers, "cpu")   # a bad --workers (negative too) is one Error: line naming it
        if int(self.prefetch) < 1:
            raise ValueError(f"--prefetch must be >= 1, got {self.prefetch}")
        pin_memory(self.pin_memory, "cpu")   # a bad choice is one Error: line naming --pin-memory
        return self

    def rows_per_block(self) -> int:
        return self.block_rows or max(self.batch_size, min(256, 8 * self.batch_size))

    def replace(self, **changes: Any) -> "Execution":
        return dataclasses.replace(self, **changes)


SITES = ("in-process", "dask", "array")


@dataclass(frozen=True)
class Site:
    """Where a task runs: ``kind`` (in-process | dask | array) and ``cpus``, the cores that are the
    task's (a local:N or slurm:N worker's share, an array task's ``--cpus-per-task``; None: the
    cores this process may use)."""

    kind: str = "in-process"
    cpus: int | None = None

    def __post_init__(self):
        if self.kind not in SITES:
            raise ValueError(f"site {self.kind!r}; valid: {', '.join(SITES)}")


@dataclass(frozen=True)
class Job:
    """What a task needs to compute and commit blocks of one set: the store, the set, its plan, how
    to run (the whole Execution as asked, resolved by the task on its ``site``) and the run's lock
    token."""

    store: str
    name: str                       # the set to open (a staged name while --overwrite builds it)
    plan: Plan
    run: Execution
    lock_name: str | None = None    # the set's writer lock (its public name)
    lock_token: str | None = None   # the token of the run holding it (None: not checked)
    site: Site = Site()             # where its tasks run (``run`` is resolved there: .site.resolve)
    # an object-store URL's options (credentials among them): handed to the tasks in memory, never shown
    storage_options: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # the options of images on object storage (--image-option, else --storage-option), handed so too
    image_options: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)


OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(ExtractOptions))
EXECUTION_NAMES = frozenset(f.name for f in dataclasses.fields(Execution))


def split_options(model: str, kind: str, values: Mapping[str, Any]) -> tuple[ExtractOptions, Execution]:
    """``extract()``'s keyword arguments (less ``cluster``) as the two dataclasses; an unknown one is
    a TypeError."""
    unknown = set(values) - OPTION_NAMES - EXECUTION_NAMES
    if unknown:
        raise TypeError(f"extract() got unknown option(s) {', '.join(sorted(unknown))}; valid: "
                        f"{', '.join(sorted(OPTION_NAMES | EXECUTION_NAMES))}")
    opts = ExtractOptions(model=model, kind=kind, **{k: v for k, v in values.items() if k in OPTION_NAMES})
    run = Execution(**{k: v for k, v in values.items() if k in EXECUTION_NAMES})
    return opts, run


def remake_args(attrs: Mapping[str, Any]) -> list[str]:
    """The flags of every field recorded in a set's attrs (``attr``) that applies to it (``when``)."""
    args: list[str] = []
    for cls in (ExtractOptions, Execution):
        for f in fields_of(cls):
            m = f.metadata
            key = m.get("attr")
            if key is None or f.name in ("model", "kind", "weights"):
                continue
            if m["when"] is not None and not m["when"](attrs):
                continue
            value = attrs.get(key, m["unrecorded"])
            if value is None:
                continue
            args += m["render"](value) if m["render"] else [m["flag"], str(value)]
    return args


def extract_args(store_path: str, name: str, attrs: Mapping[str, Any]) -> list[str]:
    """``vsekit extract ...`` with every option that enters the set's config hash: the fields of the
    extraction job that name an attr (:func:`remake_args`)."""
    a = attrs
    return ["vsekit", "extract", "--store", str(store_path), "--model", str(a.get("model")), "--kind",
            str(a.get("kind")), "--weights", str(a.get("weights")), "--name", name, *remake_args(a)]


def _extracted(attrs: Mapping[str, Any]) -> bool:
    return "crop_size" in attrs and not attrs.get("parent")   # made by `vsekit extract`


register_remake("extract", _extracted, extract_args)
