"""A synthetic captioned dataset: coloured shapes on varied backgrounds, in Karpathy JSON format.

Every image holds 1-3 shapes (circle, square, triangle, diamond) in one of eight colours, at a named
position and size, on a background of one of several tints with noise. Its five captions describe
what is drawn in five different wordings, so a retrieval model can really learn to match them. A
``boxes.json`` file gives every shape's bounding box in pixels (for region features); each image
record of the JSON also carries its ``background`` and ``shapes`` (shape, colour, position, size,
box, in drawing order) so that tests can check captions against what was drawn. Output is a pure
function of ``(images, seed, size)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {
    "red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (240, 220, 30),
    "purple": (140, 40, 170), "orange": (250, 140, 20), "white": (250, 250, 250), "black": (15, 15, 15),
}
BACKGROUNDS = {
    "grey": (128, 128, 128), "sand": (210, 190, 140), "sky": (150, 200, 240), "grass": (120, 170, 90),
    "dark": (50, 50, 60), "pink": (240, 180, 200),
}
SHAPES = ("circle", "square", "triangle", "diamond")
# (name, centre x, centre y) as fractions of the image side
POSITIONS = {
    "top left": (0.25, 0.25), "top right": (0.75, 0.25), "bottom left": (0.25, 0.75),
    "bottom right": (0.75, 0.75), "centre": (0.5, 0.5), "top": (0.5, 0.22), "bottom": (0.5, 0.78),
    "left": (0.22, 0.5), "right": (0.78, 0.5),
}
SIZES = {"small": 0.12, "large": 0.22}


@dataclass(frozen=True)
class ShapeSpec:
    shape: str
    colour: str
    position: str
    size: str

    def phrase(self, style: int) -> str:
        a = "an" if self.size[0] in "aeiou" else "a"
        pos = self.position if self.position != "centre" else "the centre"
        if style == 0:
            return f"{a} {self.size} {self.colour} {self.shape} at the {self.position}"
        if style == 1:
            return f"{a} {self.colour} {self.shape} in {pos if pos == 'the centre' else 'the ' + pos}"
        if style == 2:
            return f"{self.size} {self.colour} {self.shape}"
        if style == 3:
            return f"the {self.colour} {self.shape} is {self.size} and sits {'in ' + pos if pos == 'the centre' else 'at the ' + pos}"
        return f"{a} {self.shape} coloured {self.colour} near the {self.position}"


def _captions(shapes: list[ShapeSpec], background: str) -> list[str]:
    n = len(shapes)
    count = {1: "one shape", 2: "two shapes", 3: "three shapes"}[n]
    joined = lambda style, sep=" and ": sep.join(s.phrase(style) for s in shapes)  # noqa: E731
    return [
        f"{joined(0)} on a {background} background",
        f"a picture of {joined(1)}",
        f"{count} on {background}: {joined(2, ', ')}",
        f"{joined(3, '; ')}.",
        f"there is {joined(4)} over a {background} backdrop",
    ]


def _draw(draw: ImageDraw.ImageDraw, spec: ShapeSpec, side: int, rng: np.random.Generator) -> list[float]:
    cx, cy = POSITIONS[spec.position]
    jitter = rng.uniform(-0.04, 0.04, size=2)
    cx, cy = (cx + jitter[0]) * side, (cy + jitter[1]) * side
    r = SIZES[spec.size] * side * rng.uniform(0.9, 1.1)
    colour = COLOURS[spec.colour]
    box = [cx - r, cy - r, cx + r, cy + r]
    if spec.shape == "circle":
        draw.ellipse(box, fill=colour)
    elif spec.shape == "square":
        draw.rectangle(box, fill=colour)
    elif spec.shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    else:
        draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=colour)
    x1, y1, x2, y2 = (max(0.0, min(float(side), v)) for v in box)
    return [round(x1, 2), round(y1, 2), round(x2, 2), round(y2, 2)]


def demo_splits(images: int, val: int | None = None, test: int | None = None, *,
                val_fraction: float = 0.125, test_fraction: float = 0.125) -> dict[str, int]:
    """Images per split of the demo data: ``val`` / ``test`` as given, else their fractions (at least 1)."""
    n_val = max(1, int(round(images * val_fraction))) if val is None else val
    n_test = max(1, int(round(images * test_fraction))) if test is None else test
    if images < 3 or min(n_val, n_test) < 1 or n_val + n_test >= images:
        raise ValueError(f"--images {images} cannot hold a train split and --val {n_val} / --test {n_test} "
                         f"(--images must be at least 3, one per split)")
    return {"train": images - n_val - n_test, "val": n_val, "test": n_test}


def make_demo_data(out_dir: str | Path, images: int = 400, seed: int = 0, size: int = 128,
                   val_fraction: float = 0.125, test_fraction: float = 0.125,
                   val: int | None = None, test: int | None = None) -> Path:
    """Write ``out_dir/images/*.jpg``, ``dataset_demo.json`` (Karpathy format) and ``boxes.json``;
    ``val`` / ``test`` images (else their fractions) per split. Returns the JSON file's path."""
    counts = demo_splits(images, val, test, val_fraction=val_fraction, test_fraction=test_fraction)
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n_train, n_val, n_test = counts["train"], counts["val"], counts["test"]
    splits = ["train"] * n_train + ["val"] * n_val + ["test"] * n_test
    records, boxes = [], {}
    positions = list(POSITIONS)
    sentid = 0
    for i in range(images):
        n_shapes = int(rng.choice([1, 2, 3], p=[0.4, 0.4, 0.2]))
        chosen_pos = rng.choice(len(positions), size=n_shapes, replace=False)
        specs = [ShapeSpec(shape=str(rng.choice(SHAPES)), colour=str(rng.choice(list(COLOURS))),
                           position=positions[p], size=str(rng.choice(list(SIZES))))
                 for p in chosen_pos]
        bg_name = str(rng.choice(list(BACKGROUNDS)))
        bg = np.asarray(BACKGROUNDS[bg_name], dtype=np.float32)
        noise = rng.normal(0, 12, size=(size, size, 3)).astype(np.float32)
        pixels = np.clip(bg + noise, 0, 255).astype(np.uint8)
        img = Image.fromarray(pixels, "RGB")
        draw = ImageDraw.Draw(img)
        image_boxes = [_draw(draw, spec, size, rng) for spec in specs]
        filename = f"demo_{i:06d}.jpg"
        img.save(out / "images" / filename, quality=92)
        captions = _captions(specs, bg_name)
        sentences = []
        for text in captions:
            sentences.append({"raw": text, "tokens": text.lower().replace(",", " ").replace(".", " ").split(),
                              "imgid": i, "sentid": sentid})
            sentid += 1
        records.append({"filepath": "images", "filename": filename, "imgid": i, "split": splits[i],
                        "sentids": [s["sentid"] for s in sentences], "sentences": sentences,
                        "cocoid": 100000 + i, "background": bg_name,
                        "shapes": [{"shape": sp.shape, "colour": sp.colour, "position": sp.position,
                                    "size": sp.size, "box": bx} for sp, bx in zip(specs, image_boxes)]})
        boxes[str(100000 + i)] = image_boxes
    path = out / "dataset_demo.json"
    path.write_text(json.dumps({"dataset": "demo", "images": records}))
    (out / "boxes.json").write_text(json.dumps(boxes))
    return path
