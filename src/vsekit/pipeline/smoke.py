"""``vsekit run RECIPE --smoke``: any pipeline end to end on a few synthetic images, in minutes.

A smoke run is the recipe itself with its inputs and sizes swapped by the two mechanisms a user has
(``--set`` and ``--stage-option``): demo-data images and a random BUTD TSV as its data, random
weights and small inputs for extraction, 1 epoch with the family's small preset for training. Every
change is listed before anything runs (:attr:`Smoke.notes`); docs/pipelines.md, "Trying a recipe on
small data", lists them.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import numpy as np

from .spec import PipelineError, PipelineSpec

SMOKE_IMAGES = 40
SMOKE_DIR = "vsekit-smoke"
BUTD_BOXES, BUTD_CHANNELS = 36, 2048
#: the preset that shrinks a model family's sizes (the `demo` recipe's)
SMALL_PRESET = {"sman": "sman-demo", "saf": "sgraf-demo", "sgr": "sgraf-demo"}
FED = ("ingest karpathy", "ingest butd", "demo-data")


@dataclass
class Smoke:
    """What a smoke run changes: variables, stage options, and the lines that say so."""

    dir: Path
    images: int
    sets: dict[str, str] = field(default_factory=dict)
    options: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    butd: bool = False

    @property
    def data(self) -> Path:
        return self.dir / "data"

    def split_counts(self) -> dict[str, int]:
        """The demo data's splits (make_demo_data's fractions), for --dry-run's work estimates."""
        from ..storage.demo import demo_splits

        return demo_splits(self.images)


def _input_size(model: str, kind: str) -> tuple[int, int]:
    """(resize, input size) of a smoke extraction."""
    if kind == "grid":
        return 256, 224
    if kind == "regions":
        return 144, 128
    if model.startswith("vgg"):
        return 40, 32
    if "inception" in model:
        return 110, 96
    return 72, 64


def _train_model(values: dict[str, Any]) -> str | None:
    from ..train.config import PRESETS

    presets = list(values.get("preset") or ())
    return values.get("model") or next((PRESETS[p].get("model") for p in reversed(presets)
                                        if PRESETS.get(p, {}).get("model")), None)


def plan_smoke(pipeline: PipelineSpec, cli: click.Group, *, images: int = SMOKE_IMAGES,
               root: str | Path = SMOKE_DIR) -> Smoke:
    """The variables and stage options that make ``pipeline`` a smoke run (changes nothing on disk)."""
    from .resolve import resolve_pipeline
    from .spec import variables_of

    smoke = Smoke(Path(root) / pipeline.name, images)
    data = smoke.data.resolve()
    used = variables_of(pipeline)
    for var, value in {"COCO_ROOT": data, "F30K_ROOT": data, "BUTD_TSV": data / "butd.tsv",
                       "STORE_DIR": smoke.dir / "stores", "RUNS_DIR": smoke.dir / "runs",
                       "DEMO_DIR": smoke.dir / "demo", "DEMO_IMAGES": images, "WEIGHTS": "none"}.items():
        if var in used:
            smoke.sets[var] = str(value)
    stages = resolve_pipeline(pipeline, cli, sets=smoke.sets, tolerate_missing=True)
    for st in stages:
        cmd, sid = st.spec.command, st.id
        v = {k.replace("-", "_"): x for k, x in st.values.items()}   # canonical keys are --option names
        changes: dict[str, Any] = {}
        if cmd.startswith("ingest") and cmd not in FED:
            raise PipelineError(f"--smoke feeds synthetic data to `ingest karpathy` and `ingest butd` stages; "
                                f"{st.spec.label} is `{cmd}`: try this pipeline on small data of your own with "
                                f"--set / --stage-option instead")
        if cmd == "ingest karpathy":
            changes = {"json_path": data / "dataset_demo.json", "image_root": data}
        elif cmd == "ingest butd":
            smoke.butd = True
            changes = {"tsv": [str(data / "butd.tsv")]}
        elif cmd == "demo-data":   # a recipe's own val / test counts would not fit: the smoke's splits
            changes = {"images": images, **{k: n for k, n in smoke.split_counts().items() if v.get(k) is not None}}
        elif cmd == "extract":
            resize, size = _input_size(str(v.get("model") or ""), str(v.get("kind") or "global"))
            changes = {"weights": "none", "input_size": size, "workers": 0, "batch_size": 20,
                       "progress": False}
            if (v.get("kind") or "global") in ("global", "fne"):
                changes["resize"] = resize
        elif cmd == "train":
            presets = list(v.get("preset") or ())
            small = SMALL_PRESET.get(_train_model(v) or "", "demo")
            changes = {"epochs": 1, "batch_size": 16, "preset": [*presets, small] if small not in presets
                       else presets, "progress": False}
        elif cmd == "tokenize":
            changes = {"min_count": 1}
        shown = []
        for key, new in changes.items():
            if key == "progress":
                if v.get("progress") is not False:
                    smoke.options.append(f"{sid}.progress=false")
                continue
            old = v.get(key)
            if isinstance(new, Path):
                new = str(new)
            if old == new:
                continue
            text = "[" + ", ".join(str(x) for x in new) + "]" if isinstance(new, list) else str(new)
            smoke.options.append(f"{sid}.{key}={text}")
            if key not in ("json_path", "image_root", "tsv", "workers"):
                shown.append(f"{key} {_show(old)} → {text}")
        if shown:
            smoke.notes.append(f"  {sid}: {', '.join(shown)}")
    head = (f"--smoke: {pipeline.name} on {images} synthetic images ({smoke.data}), stores and runs in "
            f"{smoke.dir}; sizes shrunk, so its figures mean nothing:")
    smoke.notes[:0] = [head, "  variables: " + ", ".join(f"{k}={x}" for k, x in smoke.sets.items())]
    if any(s.spec.command == "extract" for s in stages):
        smoke.notes.append("  (each extraction keeps the recipe's model, crops, kind and layers)")
    return smoke


def _show(value: Any) -> str:
    if value is None:
        return "(default)"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(x) for x in value) + "]"
    return str(value)


def make_smoke_data(smoke: Smoke, echo=click.echo) -> None:
    """The demo images and Karpathy JSON (once), and the BUTD TSV when a stage reads one."""
    from ..storage.demo import make_demo_data

    js = smoke.data / "dataset_demo.json"
    if not js.is_file() or len(json.loads(js.read_text())["images"]) != smoke.images:
        make_demo_data(smoke.data, images=smoke.images, seed=0, size=64)
        echo(f"--smoke: wrote {smoke.images} synthetic images to {smoke.data}")
    if smoke.butd and not (smoke.data / "butd.tsv").is_file():
        write_butd_tsv(js, smoke.data / "butd.tsv")


def write_butd_tsv(karpathy_json: Path, out: Path, boxes: int = BUTD_BOXES, channels: int = BUTD_CHANNELS) -> None:
    """A bottom-up-attention TSV of random region features for every image of a Karpathy JSON."""
    from ..storage.sources.common import karpathy_image_id

    rng = np.random.default_rng(0)
    partial = out.with_name(out.name + ".partial")
    with open(partial, "w", encoding="ascii") as f:
        for rec in json.loads(Path(karpathy_json).read_text())["images"]:
            xy = rng.uniform(0, 48, size=(boxes, 2)).astype(np.float32)
            b = np.concatenate([xy, xy + 16], axis=1).astype(np.float32)
            feats = np.maximum(rng.normal(size=(boxes, channels)), 0).astype(np.float32)
            f.write("\t".join([karpathy_image_id(rec), "64", "64", str(boxes),
                               base64.b64encode(b.tobytes()).decode(),
                               base64.b64encode(feats.tobytes()).decode()]) + "\n")
    partial.rename(out)
