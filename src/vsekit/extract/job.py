"""One description of an extraction job: what to compute (:class:`ExtractOptions`, which makes the
:class:`~vsekit.extract.plan.Plan`) and how to run it (:class:`Execution`), and the two together with
where to write (:class:`Job`, what every executor hands its tasks).

Each field carries its command-line flag, default and help (``metadata``): ``vsekit extract`` builds
its Click options from these fields (``cli/extract.py``), ``extract()`` takes them as keyword
arguments, and ``storage/remake.py`` rebuilds the command of a set from the fields that enter its
settings (``attr``: the key in the set's attrs; ``when``: whether the flag applies). Adding an option
is adding a field here and using it where it acts. No setting travels through the environment.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .images import DECODERS
from .plan import KINDS, PRECISIONS, STORE_DTYPES, Plan
from .throughput import PIN_CHOICES, decode_workers, pin_memory


def option(default: Any, flag: str, help: str = "", *, choices: tuple | None = None, type: type | None = None,
           attr: str | None = None, when: Callable[[Mapping], bool] | None = None,
           render: Callable[[Any], list[str]] | None = None, secondary: str | None = None,
           metavar: str | None = None, show_default: bool = True) -> Any:
    """A dataclass field with what the CLI and ``remake`` need to know about it.

    ``secondary``: the off switch of a boolean (``--no-channels-last``, ``--no-progress``); ``render``: the arguments a value of the set's attrs
    gives in the remake command (default ``[flag, str(value)]``).
    """
    meta = {"flag": flag, "help": help, "choices": choices, "type": type, "attr": attr, "when": when,
            "render": render, "secondary": secondary, "metavar": metavar,
            "show_default": show_default}
    return field(default=default, metadata=meta)


def _own_preprocessing(a: Mapping) -> bool:
    return a.get("detector") == "butd-r101"   # BUTD refuses the preprocessing options


def _global(a: Mapping) -> bool:
    return a.get("kind") in ("global", "fne")


@dataclass(frozen=True)
class ExtractOptions:
    """What is extracted: the options that make the plan (and the set's settings hash) and the
    set's name. How the run goes (where, device, resume or start afresh) is :class:`Execution`."""

    model: str = option("vgg19", "--model",
                        "vgg16 (the FNE paper's) | vgg19 | resnet152 | inception_resnet_v2 | any timm model name.",
                        attr="model")
    kind: str = option("global", "--kind", "Feature kind: global | fne | grid | regions.", choices=KINDS,
                       attr="kind")
    weights: str = option("imagenet", "--weights", "imagenet | none | PATH to a checkpoint.", attr="weights")
    name: str | None = option(None, "--name", "Feature set name [default: MODEL_KIND].", show_default=False)
    seed: int = option(0, "--seed", "Seed of the random initialisation with --weights none.", type=int,
                       attr="seed", when=lambda a: a.get("weights") == "none")
    crops: int = option(1, "--crops", "Centre crop, 4 corners + centre, or those 5 and their mirrors (averaged).",
                        choices=(1, 5, 10), attr="crops", when=_global)
    keep_crops: bool = option(False, "--keep-crops", "Store every crop's features instead of their mean.",
                              attr="keep_crops", when=lambda a: _global(a) and bool(a.get("keep_crops")),
                              render=lambda v: ["--keep-crops"])
    resize: int | None = option(None, "--resize", "Resize size [default: from the weights].", type=int,
                                attr="resize", when=lambda a: not _own_preprocessing(a))
    resize_mode: str | None = option(None, "--resize-mode", "Resize the shorter side, or to a square "
                                     "[default: shorter; square for grid/regions].", choices=("shorter", "square"),
                                     attr="resize_mode", when=lambda a: not _own_preprocessing(a))
    input_size: int | None = option(None, "--input-size", "Crop (network input) size [default: from the weights; "
                                    "448 for grid/regions].", type=int, attr="crop_size",
                                    when=lambda a: not _own_preprocessing(a))
    interpolation: str | None = option(None, "--interpolation", "Resize filter [default: from the weights].",
                                       choices=("bilinear", "bicubic", "nearest", "lanczos"),
                                       attr="interpolation", when=lambda a: not _own_preprocessing(a))
    precision: str = option("fp32", "--precision", "Numeric precision of the forward pass (bf16/fp16: autocast; "
                            "see docs/gpus_clusters.md).", choices=PRECISIONS, attr="precision")
    decoder: str = option("pil", "--decoder", "How images are decoded and resized: pil (PIL's pixels) | turbo "
                          "(libjpeg-turbo with DCT scaling and torch's resize: faster, pixels differ by a few "
                          "levels; docs/extract.md).", choices=DECODERS, attr="decoder",
                          when=lambda a: a.get("decoder") not in (None, "pil"))
    dtype: str | None = option(None, "--dtype", "Stored dtype [default: float32 global/fne, float16 grid/regions].",
                               choices=STORE_DTYPES, attr="dtype")
    taps: str | None = option(None, "--taps", "FNE layers: comma-separated glob patterns (see --list-layers).",
                              attr="taps", when=lambda a: a.get("kind") == "fne" and bool(a.get("taps")),
                              render=lambda v: ["--taps", ",".join(t["name"] for t in v)])
    grid: int = option(7, "--grid", "Grid side G for --kind grid (14 keeps layer4 whole).", type=int,
                       attr="grid", when=lambda a: a.get("kind") == "grid")
    boxes: str | None = option(None, "--boxes", "Regions: a JSON file {image_id: [[x1,y1,x2,y2], ...]}, or "
                               "'detector' (= --detector coco-frcnn).", attr="boxes",
                               when=lambda a: a.get("kind") == "regions")
    max_regions: int = option(36, "--max-regions", "Regions kept per image (the stored K).", type=int,
                              attr="max_regions",
                              when=lambda a: a.get("kind") == "regions")
    min_regions: int | None = option(None, "--min-regions", "Floor of detector boxes per image [default: 10; "
                                     "butd-r101: = --max-regions].", type=int, attr="min_regions",
                                     when=lambda a: a.get("kind") == "regions")
    detector: str | None = option(None, "--detector", "Regions from a detector: butd-r101 (bottom-up-attention "
                                  "boxes and features) or coco-frcnn (COCO boxes, --model features). See "
                                  "docs/extract.md.", choices=("butd-r101", "coco-frcnn"), attr="detector",
                                  when=lambda a: a.get("kind") == "regions" and bool(a.get("detector")))
    detector_weights: str | None = option(None, "--detector-weights", "imagenet (coco-frcnn: torchvision's COCO "
                                          "weights) | none (random) | PATH [default: imagenet for coco-frcnn; "
                                          "butd-r101 needs PATH or none].", attr="detector_weights",
                                          when=lambda a: a.get("kind") == "regions" and bool(a.get("detector")))

    def plan(self) -> Plan:
        """Check every option and resolve the defaults (ValueError naming the bad option)."""
        from .plan import make_plan

        return make_plan(self.model, self.kind, weights=self.weights, seed=self.seed, crops=int(self.crops),
                         keep_crops=self.keep_crops, resize=self.resize, resize_mode=self.resize_mode,
                         input_size=self.input_size, interpolation=self.interpolation, taps=self.taps,
                         grid=self.grid, boxes=self.boxes, max_regions=self.max_regions,
                         min_regions=self.min_regions, precision=self.precision, store_dtype=self.dtype,
                         detector=self.detector, detector_weights=self.detector_weights,
                         decoder=self.decoder)


@dataclass(frozen=True)
class Execution:
    """How the blocks are computed, and how the run treats what the set holds already (resume,
    ``overwrite``, ``retry_failed``); nothing here changes the features beyond float rounding, so
    nothing here enters the settings hash (``block_rows`` is the set's layout, fixed at creation).
    Where the blocks run is the :class:`~vsekit.cluster.ClusterSpec` passed beside it."""

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
            raise ValueError("--batch-size must be >= 1 and --workers >= 0")
        if isinstance(self.workers, int) and self.workers < 0:
            raise ValueError("--batch-size must be >= 1 and --workers >= 0")
        decode_workers(self.workers, "cpu")   # a bad --workers is one Error: line naming it
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


def fields_of(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("flag")]


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
            if attrs.get(key) is None:
                continue
            args += m["render"](attrs[key]) if m["render"] else [m["flag"], str(attrs[key])]
    return args
