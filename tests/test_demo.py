"""The synthetic demo dataset: deterministic per seed, and its captions describe what is drawn."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from vsekit.cli import main
from vsekit.storage.demo import make_demo_data

# The generator's palette, written out here independently of the module.
RGB = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (240, 220, 30),
       "purple": (140, 40, 170), "orange": (250, 140, 20), "white": (250, 250, 250), "black": (15, 15, 15)}


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


def _inside(box, x, y, margin=3):
    return box[0] - margin <= x <= box[2] + margin and box[1] - margin <= y <= box[3] + margin


def test_deterministic_per_seed(tmp_path):
    a = make_demo_data(tmp_path / "a", images=6, seed=5, size=32)
    b = make_demo_data(tmp_path / "b", images=6, seed=5, size=32)
    c = make_demo_data(tmp_path / "c", images=6, seed=6, size=32)
    assert a.read_text() == b.read_text()
    assert (tmp_path / "a" / "boxes.json").read_text() == (tmp_path / "b" / "boxes.json").read_text()
    for i in range(6):
        name = f"images/demo_{i:06d}.jpg"
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert a.read_text() != c.read_text()


def test_captions_describe_the_drawn_shapes(demo_dir):
    doc = json.loads((demo_dir / "dataset_demo.json").read_text())
    boxes = json.loads((demo_dir / "boxes.json").read_text())
    records = doc["images"]
    assert len(records) == 24
    assert [r["split"] for r in records].count("val") == 3 and [r["split"] for r in records].count("test") == 3
    checked = 0
    for rec in records:
        shapes, caps = rec["shapes"], [s["raw"] for s in rec["sentences"]]
        assert 1 <= len(shapes) <= 3 and len(caps) == 5 and len(set(caps)) == 5
        assert boxes[str(rec["cocoid"])] == [s["box"] for s in shapes]
        assert len({s["position"] for s in shapes}) == len(shapes)
        count_word = {1: "one shape", 2: "two shapes", 3: "three shapes"}[len(shapes)]
        assert caps[2].startswith(f"{count_word} on {rec['background']}")
        assert rec["background"] in caps[0] and rec["background"] in caps[4]
        for s in shapes:
            assert f"{s['size']} {s['colour']} {s['shape']}" in caps[0] and s["position"] in caps[0]
            assert f"{s['colour']} {s['shape']}" in caps[1]
            assert f"the {s['colour']} {s['shape']} is {s['size']}" in caps[3]
            assert f"{s['shape']} coloured {s['colour']} near the {s['position']}" in caps[4]
            # words of shapes that are not drawn do not appear
        for word in {"circle", "square", "triangle", "diamond"} - {s["shape"] for s in shapes}:
            assert all(word not in c for c in caps)
        # the pixels at each visible shape's centre have the shape's colour
        img = np.asarray(Image.open(demo_dir / rec["filepath"] / rec["filename"]).convert("RGB"), dtype=float)
        for k, s in enumerate(shapes):
            x, y = (s["box"][0] + s["box"][2]) / 2, (s["box"][1] + s["box"][3]) / 2
            if any(_inside(later["box"], x, y) for later in shapes[k + 1:]):
                continue  # covered by a shape drawn later
            patch = img[int(y) - 1:int(y) + 2, int(x) - 1:int(x) + 2].reshape(-1, 3).mean(0)
            assert np.abs(patch - RGB[s["colour"]]).max() < 45, (rec["filename"], s, patch)
            checked += 1
    assert checked >= 24


def test_cli_demo_data(tmp_path):
    r = CliRunner().invoke(main, ["demo-data", str(tmp_path / "d"), "--images", "5", "--seed", "2", "--size", "32"])
    assert r.exit_code == 0, r.output
    assert len(list((tmp_path / "d" / "images").glob("*.jpg"))) == 5
    assert Image.open(tmp_path / "d" / "images" / "demo_000000.jpg").size == (32, 32)
    r = CliRunner().invoke(main, ["demo-data", str(tmp_path / "e"), "--images", "2"])
    assert r.exit_code == 1 and "--images must be at least 3" in r.output
