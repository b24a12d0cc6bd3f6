"""Smaller findings of issue 23 (finding 10): set names the store uses itself, Karpathy sentences
of the wrong type, and a decoded pixel budget that counts bytes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from vsekit.cli import main
from vsekit.storage import FeatureStore


@pytest.mark.parametrize("name", [".r18", ".x.partial-0123abcd.y"])
def test_set_names_with_a_leading_dot_are_refused(demo_store, name):
    pytest.importorskip("torch")
    r = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), "--model", "test_resnet",
                                  "--weights", "none", "--input-size", "32", "--resize", "36", "--workers", "0",
                                  "--no-progress", "--name", name])
    assert r.exit_code == 1 and r.output.startswith("Error: invalid feature set name"), r.output
    assert "leading '.'" in r.output
    store = FeatureStore.open(demo_store.path)
    assert not (store.path / "features" / name).exists() and store.feature_names() == []


@pytest.mark.parametrize("sentences,why", [(["a cat"], "sentences[0]: must be an object"),
                                           ([{"raw": "a dog"}, {"raw": 3}], "sentences[1]: field 'raw' must be a string")])
def test_karpathy_sentences_of_the_wrong_type_name_the_image(tmp_path, sentences, why):
    (tmp_path / "a.jpg").write_bytes(b"x")
    good = {"filename": "a.jpg", "split": "train", "sentences": [{"raw": "a cat"}], "imgid": 0}
    p = tmp_path / "k.json"
    p.write_text(json.dumps({"images": [good, {**good, "imgid": 1, "sentences": sentences}]}))
    r = CliRunner().invoke(main, ["ingest", "karpathy", str(p), "--store", str(tmp_path / "s.zarr")])
    assert r.exit_code == 1 and f"Error: {p}: images[1].{why}" in r.output, r.output
    assert not (tmp_path / "s.zarr").exists()


def test_decoded_budget_counts_bytes_so_a_16_bit_image_counts_double(tmp_path, monkeypatch):
    from vsekit.extract.images import ImageError, load_image

    a = (np.arange(100 * 100, dtype=np.uint32).reshape(100, 100) * 6).astype(np.uint16)
    Image.fromarray(a).save(tmp_path / "wide.png")                       # 16-bit grayscale
    Image.fromarray((a // 257).astype(np.uint8)).save(tmp_path / "narrow.png")
    assert Image.open(tmp_path / "wide.png").mode.startswith("I;16")
    # 10,000 pixels fit in 15,000, 20,000 bytes do not
    assert load_image(tmp_path / "narrow.png", max_decoded=15000).size == (100, 100)
    with pytest.raises(ImageError, match=r"100x100 x 2 bytes per sample \(I;16.*\) is over the decoded pixel budget"):
        load_image(tmp_path / "wide.png", max_decoded=15000)
    rgb = np.asarray(load_image(tmp_path / "wide.png", max_decoded=20000))
    np.testing.assert_array_equal(rgb[..., 0], np.rint(a / 257.0).astype(np.uint8))
