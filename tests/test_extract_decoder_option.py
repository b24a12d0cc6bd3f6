"""``extract --decoder``: the decoder is a setting of the set (issue 30), and the default one makes the
features the old decode path made (PIL decode and resize, crops cut in numpy, CHW)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.extract import extract
from vsekit.extract.extractor import Extractor
from vsekit.extract.images import load_image, make_crops
from vsekit.extract.plan import make_plan
from vsekit.storage.base import ProvenanceError
from vsekit.storage.store import FeatureStore

KW = dict(weights="none", input_size=32, resize=40, crops=10, workers=0, batch_size=4, block_rows=8,
          progress=False)


def test_default_decoder_gives_the_old_paths_features_and_keeps_the_hash(demo_store):
    """Reference: each image through load_image + make_crops (PIL, CHW), the extractor's model."""
    res = extract(demo_store, "test_resnet", "global", name="pil", **KW)
    assert res.failed == 0
    fs = demo_store.features("pil")
    assert "decoder" not in fs.attrs           # a default set's settings are what they were
    assert fs.attrs["decoding"]["decoder"] == "pil" and "pillow" in fs.attrs["decoding"]
    plan = make_plan("test_resnet", "global", weights="none", input_size=32, resize=40, crops=10)
    assert plan.attrs() == {k: v for k, v in plan.attrs().items() if k != "decoder"}
    ex = Extractor(plan)
    rows = range(demo_store.n_images)
    crops = np.stack([make_crops(load_image(demo_store.image_file(r)), plan.resize, plan.crop_size,
                                 plan.crops, plan.resize_mode, plan.interpolation) for r in rows])
    want = np.concatenate([ex.features(torch.from_numpy(crops[i:i + 4])) for i in range(0, len(crops), 4)])
    np.testing.assert_array_equal(np.asarray(fs.data[:]), want)


def test_turbo_is_another_setting_close_to_pil(demo_store):
    extract(demo_store, "test_resnet", "global", name="pil", **KW)
    extract(demo_store, "test_resnet", "global", name="turbo", decoder="turbo", **KW)
    a, b = demo_store.features("pil"), demo_store.features("turbo")
    assert b.attrs["decoder"] == "turbo" and b.attrs["config_hash"] != a.attrs["config_hash"]
    x, y = np.asarray(a.data[:], np.float64), np.asarray(b.data[:], np.float64)
    cos = (x * y).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)
    assert cos.min() > 0.99 and not np.array_equal(x, y)
    # the same name with the other decoder is refused, and the message names the difference
    with pytest.raises(ProvenanceError, match=r"decoder \(none\) → turbo"):
        extract(demo_store, "test_resnet", "global", name="pil", decoder="turbo", **KW)


def test_decoder_on_the_command_line_and_in_the_remake_command(demo_store):
    from vsekit.storage.remake import remake_command

    r = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), "--model", "test_resnet",
                                  "--weights", "none", "--input-size", "32", "--resize", "40",
                                  "--decoder", "turbo", "--name", "t", "--workers", "0", "--no-progress"])
    assert r.exit_code == 0, r.output
    cmd = remake_command(FeatureStore.open(demo_store.path), "t")
    assert "--decoder turbo" in cmd
    r = CliRunner().invoke(main, cmd.split()[1:] + ["--no-progress", "--workers", "0"])
    assert r.exit_code == 0 and "ran 0 blocks" in r.output, r.output
    bad = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), "--decoder", "jpeg"])
    assert bad.exit_code == 1 and "--decoder" in bad.output


def test_decoder_other_than_pil_is_refused_for_regions(demo_store, demo_dir):
    with pytest.raises(ValueError, match="--decoder turbo applies to --kind global, fne and grid"):
        extract(demo_store, "test_resnet", "regions", boxes=str(demo_dir / "boxes.json"), decoder="turbo",
                weights="none", progress=False)
