"""Resolve extraction options into a plan: preprocessing, taps and their columns, the stored layout.

Config flows one way: defaults from the weights' own preprocessing config → the kind's defaults →
the caller's overrides → a frozen ``Plan`` whose ``attrs`` are the feature set's provenance.
Layer widths come from a forward pass on the meta device, so planning costs no memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .backbones import get_backbone, weights_kind
from .fields import option
from .images import (CROP_CHOICES, DECODERS, DEFAULT_DECODER, INTERPOLATIONS, RESIZE_MODES, UNRECORDED_DECODER,
                     hash_settings)
from .regions import DETECTORS, resolve_detector
from .taps import probe, select_taps, spatial_tap, tap_columns

KINDS = ("global", "fne", "grid", "regions")
PRECISIONS = ("fp32", "bf16", "fp16")
STORE_DTYPES = ("float32", "float16")
SPATIAL_SIZE = 448  # SMAN: ResNet-152 res5c at 448x448 input (14x14), pooled to 7x7


def _own_preprocessing(a: Mapping) -> bool:
    return a.get("detector") == "butd-r101"   # BUTD refuses the preprocessing options


def _positive(value) -> str | None:
    return None if int(value) > 0 else "must be > 0"


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
                        choices=CROP_CHOICES, attr="crops", when=_global)
    keep_crops: bool = option(False, "--keep-crops", "Store every crop's features instead of their mean.",
                              attr="keep_crops", when=lambda a: _global(a) and bool(a.get("keep_crops")),
                              render=lambda v: ["--keep-crops"])
    resize: int | None = option(None, "--resize", "Resize size [default: from the weights].", type=int,
                                attr="resize", when=lambda a: not _own_preprocessing(a))
    resize_mode: str | None = option(None, "--resize-mode", "Resize the shorter side, or to a square "
                                     "[default: shorter; square for grid/regions].", choices=RESIZE_MODES,
                                     attr="resize_mode", when=lambda a: not _own_preprocessing(a))
    input_size: int | None = option(None, "--input-size", "Crop (network input) size [default: from the weights; "
                                    "448 for grid/regions].", type=int, attr="crop_size",
                                    when=lambda a: not _own_preprocessing(a))
    interpolation: str | None = option(None, "--interpolation", "Resize filter [default: from the weights].",
                                       choices=tuple(INTERPOLATIONS),
                                       attr="interpolation", when=lambda a: not _own_preprocessing(a))
    precision: str = option("fp32", "--precision", "Numeric precision of the forward pass (bf16/fp16: autocast; "
                            "see docs/gpus_clusters.md).", choices=PRECISIONS, attr="precision")
    decoder: str | None = option(None, "--decoder", "How images are decoded and resized: torchvision (full-size "
                                 "libjpeg-turbo decode, torch's resize; within 1e-3 of pil's features) | pil "
                                 "(PIL's pixels, exact; slower) | turbo (torchvision plus DCT scaling of JPEGs twice "
                                 "the resize: faster, features up to ~8e-2 off; docs/extract.md) | nvjpeg (JPEGs decoded "
                                 "on the GPU, batched; --device cuda) [default: the set's own when it exists, "
                                 "else torchvision; regions: pil].", choices=DECODERS, attr="decoder",
                                 when=lambda a: a.get("kind") != "regions",
                                 unrecorded=UNRECORDED_DECODER, show_default=False)
    dtype: str | None = option(None, "--dtype", "Stored dtype [default: float32 global/fne, float16 grid/regions].",
                               choices=STORE_DTYPES, attr="dtype")
    taps: str | None = option(None, "--taps", "FNE layers: comma-separated glob patterns (see --list-layers).",
                              attr="taps", when=lambda a: a.get("kind") == "fne" and bool(a.get("taps")),
                              render=lambda v: ["--taps", ",".join(t["name"] for t in v)])
    grid: int = option(7, "--grid", "Grid side G for --kind grid (14 keeps layer4 whole).", type=int,
                       attr="grid")
    boxes: str | None = option(None, "--boxes", "Regions: a JSON file {image_id: [[x1,y1,x2,y2], ...]}, or "
                               "'detector' (= --detector coco-frcnn).", attr="boxes")
    max_regions: int = option(36, "--max-regions", "Regions kept per image (the stored K).", type=int,
                              attr="max_regions")
    min_regions: int | None = option(None, "--min-regions", "Floor of detector boxes per image [default: 10; "
                                     "butd-r101: = --max-regions].", type=int, attr="min_regions")
    detector: str | None = option(None, "--detector", "Regions from a detector: butd-r101 (bottom-up-attention "
                                  "boxes and features) or coco-frcnn (COCO boxes, --model features). See "
                                  "docs/extract.md.", choices=DETECTORS, attr="detector")
    detector_weights: str | None = option(None, "--detector-weights", "imagenet (coco-frcnn: torchvision's COCO "
                                          "weights) | none (random) | PATH [default: imagenet for coco-frcnn; "
                                          "butd-r101 needs PATH or none].", attr="detector_weights")

    max_decoded_pixels: int | None = option(None, "--max-decoded-pixels", "Fail an image whose decoded size is "
                                            "over this many 8-bit pixels, read from its header [default: PIL's "
                                            "decompression-bomb limit, about 89.5 million].", type=int,
                                            attr="max_decoded_pixels", setting=True, check=_positive,
                                            show_default=False)
    max_resized_pixels: int | None = option(None, "--max-resized-pixels", "Fail an image whose resized size would "
                                            "be over this many pixels (a very thin image) [default: 16000000].",
                                            type=int, attr="max_resized_pixels", setting=True, check=_positive,
                                            show_default=False)

    def plan(self) -> "Plan":
        """Check every option and resolve the defaults (ValueError naming the bad option)."""
        return plan_of(self)


@dataclass(frozen=True)
class Plan:
    model: str
    kind: str
    weights: str
    seed: int
    crops: int
    keep_crops: bool
    resize: int
    resize_mode: str
    crop_size: int
    mean: tuple
    std: tuple
    interpolation: str
    precision: str
    taps: tuple                 # ({"name", "width", "start", "stop"}, ...) for global/fne
    tap_calls: int              # hook calls in one forward pass (to stop after the last tap)
    grid: int = 0
    channels: int = 0
    boxes: str | None = None    # "detector" or a JSON file (regions)
    max_regions: int = 0
    min_regions: int = 0
    detector: str | None = None           # regions.DETECTORS (regions with boxes="detector")
    detector_weights: str | None = None   # imagenet | none | absolute path
    store_dtype: str = "float32"
    extra: dict = field(default_factory=dict)
    weights_sha256: str | None = None   # --weights PATH: its content digest (part of the config hash)
    detector_sha256: str | None = None  # --detector-weights PATH: its content digest (idem)
    decoder: str = UNRECORDED_DECODER   # images.DECODERS: how images are decoded and resized (a plan
    #                                     written before decoders existed, e.g. a job array's spec: pil)
    settings: dict = field(default_factory=dict)   # the ExtractOptions fields marked setting=True, as given

    def setting(self, name: str) -> Any:
        """The value of a ``setting=True`` option (None: its default)."""
        return self.settings.get(name)

    @property
    def row_shape(self) -> tuple[int, ...]:
        if self.kind == "grid":
            return (self.grid, self.grid, self.channels)
        if self.kind == "regions":
            return (self.max_regions, self.channels)
        width = self.taps[-1]["stop"]
        return (self.crops, width) if self.keep_crops else (width,)

    @property
    def tap_names(self) -> list[str]:
        return [t["name"] for t in self.taps]

    def attrs(self) -> dict[str, Any]:
        a = {"kind": self.kind, "model": self.model, "weights": self.weights, "seed": self.seed,
             "crops": self.crops, "keep_crops": self.keep_crops, "resize": self.resize,
             "resize_mode": self.resize_mode, "crop_size": self.crop_size, "mean": list(self.mean),
             "std": list(self.std), "interpolation": self.interpolation, "precision": self.precision,
             "taps": [dict(t) for t in self.taps], "dtype": self.store_dtype,
             **hash_settings(self.decoder)}   # nothing for "pil": sets made before decoders keep their hash
        a.update({k: v for k, v in self.settings.items() if v is not None})   # only when set: older sets keep their hash
        if self.weights_sha256:
            a["weights_sha256"] = self.weights_sha256
        if self.kind == "grid":
            a["grid"] = self.grid
        if self.kind == "regions":
            a.update(boxes=self.boxes, max_regions=self.max_regions, min_regions=self.min_regions,
                     detector=self.detector, detector_weights=self.detector_weights, **self.extra)
            if self.detector_sha256:
                a["detector_sha256"] = self.detector_sha256
        return a

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        d = dict(d)
        d["taps"] = tuple(d["taps"])
        d["mean"], d["std"] = tuple(d["mean"]), tuple(d["std"])
        return cls(**d)


def make_plan(model: str, kind: str = "global", **options: Any) -> Plan:
    """The plan of ``ExtractOptions(model=model, kind=kind, **options)`` (the library's shorthand)."""
    return ExtractOptions(model=model, kind=kind, **options).plan()


def plan_of(o: ExtractOptions) -> Plan:
    """Check every option of ``o`` and resolve the defaults; raises ValueError naming the bad option.

    Every value is read from ``o``: the defaults live in :class:`ExtractOptions` only. The options
    marked ``setting=True`` go to ``Plan.settings`` as given (checked by their ``check``). A
    checkpoint given as a path (``--weights``, ``--detector-weights``) enters the settings by its
    content digest, so the same path holding another file is another setting (a resume is refused).
    """
    settings = {}
    for f in dataclasses.fields(o):   # what Click checks on the command line, for every caller
        m, value = f.metadata, getattr(o, f.name)
        if value is not None and m["choices"] and str(value) not in map(str, m["choices"]):
            raise ValueError(f"{m['flag']} {value!r}; valid choices: {', '.join(map(str, m['choices']))}")
        why = value is not None and m["check"] and m["check"](value)
        if why:
            raise ValueError(f"{m['flag']} {value!r}: {why}")
        if m["setting"]:
            settings[f.name] = value
    plan = dataclasses.replace(_plan_of(o), settings=settings)
    if plan.detector_weights and plan.detector_weights not in ("imagenet", "none"):
        from ..digest import file_digest

        plan = dataclasses.replace(plan, detector_sha256=file_digest(plan.detector_weights))
    return plan


def _plan_of(o: ExtractOptions) -> Plan:
    from .backbones import build_model

    boxes, max_regions, min_regions, store_dtype, decoder = o.boxes, o.max_regions, o.min_regions, o.dtype, o.decoder
    detector, detector_weights, seed, crops = o.detector, o.detector_weights, int(o.seed), int(o.crops)
    if decoder is None:   # a new set's default; run_job gives an existing set its own first (runner.own_decoder)
        decoder = UNRECORDED_DECODER if o.kind == "regions" else DEFAULT_DECODER
    if o.kind == "regions":
        if decoder != UNRECORDED_DECODER:
            raise ValueError(f"--decoder {decoder} applies to --kind global, fne and grid (regions decode with PIL)")
        boxes, detector, detector_weights = resolve_detector(boxes, detector, detector_weights)
        if detector == "butd-r101":
            from .butd import butd_plan
            return Plan(**butd_plan(detector_weights=detector_weights, seed=seed, max_regions=max_regions,
                                    min_regions=min_regions, precision=o.precision, store_dtype=store_dtype,
                                    unused={"--resize": o.resize, "--resize-mode": o.resize_mode, "--input-size": o.input_size,
                                            "--interpolation": o.interpolation, "--taps": o.taps,
                                            "--crops": None if crops == 1 else crops, "--keep-crops": o.keep_crops or None}))
    elif detector or detector_weights:
        raise ValueError("--detector / --detector-weights apply to --kind regions only")
    min_regions = 10 if min_regions is None else min_regions
    wkind = weights_kind(o.weights)
    weights_attr = str(Path(o.weights).resolve()) if wkind == "path" else wkind
    spec = get_backbone(o.model)
    meta = build_model(o.model, "none", device="meta")
    pre = spec.preprocess(meta)
    spatial = o.kind in ("grid", "regions")
    if spatial and (crops != 1 or o.keep_crops):
        raise ValueError(f"--kind {o.kind} uses the whole image: --crops must be 1 (got {crops})")
    if spatial:
        crop_size = int(o.input_size or spatial_size(meta, pre.crop_size))
        rsz, rmode = int(o.resize or crop_size), o.resize_mode or "square"
    else:
        crop_size = int(o.input_size or pre.crop_size)
        rsz = int(o.resize or round(crop_size * pre.resize / pre.crop_size))
        rmode = o.resize_mode or "shorter"
    if crop_size < 8 or rsz < crop_size:
        raise ValueError(f"--input-size {crop_size} / --resize {rsz}: need 8 <= input size <= resize")
    store_dtype = store_dtype or ("float16" if spatial else "float32")
    kw = dict(model=o.model, kind=o.kind, weights=weights_attr, seed=int(seed), crops=int(crops),
              keep_crops=bool(o.keep_crops), resize=rsz, resize_mode=rmode, crop_size=crop_size,
              mean=pre.mean, std=pre.std, interpolation=o.interpolation or pre.interpolation,
              precision=o.precision, store_dtype=store_dtype, decoder=decoder)
    if wkind == "path":
        from ..digest import file_digest

        kw["weights_sha256"] = file_digest(o.weights)
    if spatial:
        conv = spec.conv_tap(meta)
        tap, side, calls = spatial_tap(o.model, meta, conv, crop_size)
        if o.kind == "grid" and not 1 <= o.grid <= side:
            raise ValueError(f"--grid {o.grid}: {o.model} {conv} is {side}x{side} at input "
                             f"{crop_size}; choose 1..{side} or a larger --input-size")
        regions = {}   # the Plan's defaults (no boxes, 0 regions, no detector) for a grid
        if o.kind == "regions":
            if not boxes:
                raise ValueError("--kind regions needs --boxes detector or --boxes FILE (JSON: image id → boxes)")
            if boxes != "detector" and not Path(boxes).is_file():
                raise ValueError(f"--boxes {boxes!r}: not 'detector' nor an existing JSON file")
            if max_regions < 1 or min_regions < 0:
                raise ValueError("--max-regions must be >= 1 and --min-regions >= 0")
            regions = dict(boxes=boxes if boxes == "detector" else str(Path(boxes).resolve()),
                           max_regions=int(max_regions), min_regions=int(min_regions), detector=detector,
                           detector_weights=detector_weights)
        return Plan(**kw, **regions, taps=(tap,), tap_calls=calls, grid=int(o.grid) if o.kind == "grid" else 0,
                    channels=tap["width"])
    if o.kind == "global":
        if o.taps:
            raise ValueError("--taps applies to --kind fne only")
        names = [spec.global_tap(meta)]
    else:
        names = select_taps(meta, o.taps, crop_size) if o.taps else spec.fne_taps(meta)
    cols, calls, _ = tap_columns(o.model, meta, names, crop_size)
    return Plan(**kw, taps=tuple(cols), tap_calls=calls)


def spatial_size(meta, native: int) -> int:
    """Default input of grid / regions: SPATIAL_SIZE (448, SMAN) if the model runs at it, else its
    native crop size (ViT / Swin built for one input size, e.g. 224 → a 14×14 or 7×7 map)."""
    try:
        probe(meta, SPATIAL_SIZE, [])
    except ValueError:
        return int(native)
    return SPATIAL_SIZE
