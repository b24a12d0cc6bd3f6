"""``extract --decoder``: the decoder is a setting of the set (issue 30). New sets default to
``torchvision`` (issue 47; ``turbo``, with DCT scaling, from issue 37 to 47); a set keeps the decoder
its settings record (``pil`` where they record none, ``turbo`` where they say so) when it is resumed,
rerun, overwritten or remade without ``--decoder``; ``pil`` makes the features the old decode path
made (PIL decode and resize, crops cut in numpy, CHW)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from vsekit.cli import main
from vsekit.extract import extract
from vsekit.extract.extractor import Extractor
from vsekit.extract.images import load_image, make_crops
from vsekit.extract.plan import make_plan
from vsekit.storage.base import ProvenanceError
from vsekit.storage.store import FeatureStore

KW = dict(weights="none", input_size=32, resize=40, crops=10, workers=0, batch_size=4, block_rows=8,
          progress=False)
CLI = ["--model", "test_resnet", "--weights", "none", "--input-size", "32", "--resize", "40", "--crops", "10",
       "--batch-size", "4", "--block-rows", "8", "--workers", "0", "--no-progress"]


def ten_crops(a: np.ndarray, crop: int) -> np.ndarray:
    """The 10-crop protocol cut from an HWC array with numpy slicing (NHWC)."""
    h, w = a.shape[:2]
    cx, cy = int(round((w - crop) / 2)), int(round((h - crop) / 2))
    out = [a[y:y + crop, x:x + crop] for x, y in ((0, 0), (w - crop, 0), (0, h - crop), (w - crop, h - crop), (cx, cy))]
    return np.stack(out + [c[:, ::-1] for c in out])


def pil_crops(path, resize: int, crop: int) -> np.ndarray:
    """Independent PIL reference: Image.open → RGB → shorter side to ``resize`` (bilinear) → crops."""
    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        size = (resize, int(resize * h / w)) if w <= h else (int(resize * w / h), resize)
        return ten_crops(np.asarray(im.resize(size, Image.Resampling.BILINEAR)), crop)


def torchvision_crops(path, resize: int, crop: int) -> np.ndarray:
    """Independent reference of the default decoder: torchvision's decode_jpeg → transforms.v2 resize (antialiased,
    bilinear, shorter side) → crops."""
    import warnings

    import torchvision.transforms.v2.functional as F
    from torchvision.io import decode_jpeg, read_file

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        img = F.resize(decode_jpeg(read_file(str(path))), [resize], antialias=True)
    return ten_crops(img.permute(1, 2, 0).numpy(), crop)


def features_of(store, plan, crops_of) -> np.ndarray:
    """Every image's crops (``crops_of(path)``) through the plan's model, in batches of 4 as the runs."""
    ex = Extractor(plan)
    crops = np.stack([crops_of(store.image_file(r)) for r in range(store.n_images)])
    return np.concatenate([ex.features(torch.from_numpy(crops[i:i + 4])) for i in range(0, len(crops), 4)])


def test_pil_gives_the_old_paths_features_and_keeps_the_hash(demo_store):
    """Reference: each image through load_image + make_crops (PIL, CHW), the extractor's model."""
    res = extract(demo_store, "test_resnet", "global", name="pil", decoder="pil", **KW)
    assert res.failed == 0
    fs = demo_store.features("pil")
    assert "decoder" not in fs.attrs           # a pil set's settings are what they were before decoders
    assert fs.attrs["decoding"]["decoder"] == "pil" and "pillow" in fs.attrs["decoding"]
    plan = make_plan("test_resnet", "global", weights="none", input_size=32, resize=40, crops=10, decoder="pil")
    assert plan.attrs() == {k: v for k, v in plan.attrs().items() if k != "decoder"}
    ex = Extractor(plan)
    rows = range(demo_store.n_images)
    crops = np.stack([make_crops(load_image(demo_store.image_file(r)), plan.resize, plan.crop_size,
                                 plan.crops, plan.resize_mode, plan.interpolation) for r in rows])
    want = np.concatenate([ex.features(torch.from_numpy(crops[i:i + 4])) for i in range(0, len(crops), 4)])
    np.testing.assert_array_equal(np.asarray(fs.data[:]), want)


def test_a_new_set_without_decoder_has_torchvisions_pixels(demo_store):
    """Reference: torchvision's decode_jpeg + transforms.v2 resize, numpy crops, the plan's model."""
    res = extract(demo_store, "test_resnet", "global", name="new", **KW)
    assert res.failed == 0
    fs = demo_store.features("new")
    assert fs.attrs["decoder"] == "torchvision" and fs.attrs["decoding"]["decoder"] == "torchvision"
    assert fs.attrs["decoding"]["draft"] is False
    plan = make_plan("test_resnet", "global", weights="none", input_size=32, resize=40, crops=10)
    assert plan.decoder == "torchvision" and plan.attrs()["decoder"] == "torchvision"
    want = features_of(demo_store, plan, lambda p: torchvision_crops(p, 40, 32))
    np.testing.assert_array_equal(np.asarray(fs.data[:]), want)
    # and they are not PIL's pixels (the demo images are resized: a difference shows)
    pil = features_of(demo_store, make_plan("test_resnet", "global", weights="none", input_size=32, resize=40,
                                            crops=10, decoder="pil"), lambda p: pil_crops(p, 40, 32))
    assert not np.array_equal(want, pil)


def test_a_pil_set_keeps_pil_pixels_resumed_overwritten_or_remade_without_decoder(demo_store, capsys):
    """A set made with pil (as every set made before turbo became the default: no decoder in its
    settings) keeps PIL's pixels whenever it is made again without --decoder; reference: PIL
    directly (Image.open, resize, numpy crops)."""
    from vsekit.storage.remake import remake_command

    extract(demo_store, "test_resnet", "global", name="old", decoder="pil", **KW)
    store = FeatureStore.open(demo_store.path, mode="r+")
    fs = store.features("old")
    assert "decoder" not in fs.attrs
    hash0 = fs.attrs["config_hash"]
    plan = make_plan("test_resnet", "global", weights="none", input_size=32, resize=40, crops=10, decoder="pil")
    want = features_of(demo_store, plan, lambda p: pil_crops(p, 40, 32))
    np.testing.assert_array_equal(np.asarray(fs.data[:]), want)

    def pending_again():
        fs = FeatureStore.open(demo_store.path, mode="r+").features("old")
        fs.data[8:16] = np.zeros((8, fs.data.shape[1]), np.float32)
        fs.status[8:16] = np.zeros(8, np.uint8)

    def same_set():
        fs = FeatureStore.open(demo_store.path).features("old")
        assert "decoder" not in fs.attrs and fs.attrs["config_hash"] == hash0
        assert fs.attrs["decoding"]["decoder"] == "pil"
        np.testing.assert_array_equal(np.asarray(fs.data[:]), want)

    pending_again()   # resumed through the library
    assert extract(demo_store, "test_resnet", "global", name="old", **KW).blocks_run == 1
    same_set()
    pending_again()   # resumed through the command line
    r = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), *CLI, "--name", "old"])
    assert r.exit_code == 0 and "ran 1 block," in r.output, r.output
    same_set()
    capsys.readouterr()
    extract(demo_store, "test_resnet", "global", name="old", overwrite=True, **KW)   # made again afresh
    assert "'old' is made again with its own decoder pil" in capsys.readouterr().err
    same_set()
    cmd = remake_command(FeatureStore.open(demo_store.path), "old")   # exact whatever the default
    assert "--decoder pil" in cmd
    r = CliRunner().invoke(main, cmd.split()[1:] + ["--overwrite", "--no-progress", "--workers", "0"])
    assert r.exit_code == 0 and "ran 3 blocks" in r.output, r.output
    same_set()


def test_a_decoder_other_than_the_sets_is_refused_or_replaces_it_with_overwrite(demo_store):
    extract(demo_store, "test_resnet", "global", name="p", decoder="pil", **KW)
    extract(demo_store, "test_resnet", "global", name="t", **KW)   # torchvision, the default
    with pytest.raises(ProvenanceError, match=r"decoder \(none\) → torchvision"):
        extract(demo_store, "test_resnet", "global", name="p", decoder="torchvision", **KW)
    # the other way the settings lose a key, which the store's diff does not name (storage/store.py)
    with pytest.raises(ProvenanceError, match=r"feature set 't' already exists .* with different settings"):
        extract(demo_store, "test_resnet", "global", name="t", decoder="pil", **KW)
    r = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), *CLI, "--name", "p",
                                  "--decoder", "torchvision"])
    assert r.exit_code == 1 and r.output.count("Error:") == 1 and "decoder (none) → torchvision" in r.output, r.output
    assert "decoder" not in FeatureStore.open(demo_store.path).features("p").attrs   # nothing changed
    extract(demo_store, "test_resnet", "global", name="p", decoder="torchvision", overwrite=True, **KW)
    a, b = (FeatureStore.open(demo_store.path).features(n) for n in ("p", "t"))
    assert a.attrs["decoder"] == "torchvision" and a.attrs["config_hash"] == b.attrs["config_hash"]
    np.testing.assert_array_equal(np.asarray(a.data[:]), np.asarray(b.data[:]))


def test_a_turbo_set_keeps_dct_scaling_when_resumed_without_decoder(demo_store):
    """A set made while turbo was the default (DCT scaling) is resumed with turbo, not the new default:
    its resumed rows are turbo's (reference: decode_crops with turbo, which differ from a full decode
    here: the 64-px demo images are over twice the resize of 24)."""
    kw = dict(KW, resize=24, input_size=20)
    extract(demo_store, "test_resnet", "global", name="old", decoder="turbo", **kw)
    fs = FeatureStore.open(demo_store.path, mode="r+").features("old")
    want, hash0 = np.asarray(fs.data[:]), fs.attrs["config_hash"]
    plan = make_plan("test_resnet", "global", weights="none", input_size=20, resize=24, crops=10, decoder="turbo")
    from vsekit.extract.images import decode_crops

    turbo = features_of(demo_store, plan, lambda p: decode_crops(p, 24, 20, 10, decoder="turbo"))
    full = features_of(demo_store, plan, lambda p: decode_crops(p, 24, 20, 10, decoder="torchvision"))
    np.testing.assert_array_equal(want, turbo)
    assert not np.array_equal(turbo, full)
    fs.data[8:16] = np.zeros((8, fs.data.shape[1]), np.float32)
    fs.status[8:16] = np.zeros(8, np.uint8)
    assert extract(demo_store, "test_resnet", "global", name="old", **kw).blocks_run == 1   # no --decoder
    fs = FeatureStore.open(demo_store.path).features("old")
    assert fs.attrs["decoder"] == "turbo" and fs.attrs["config_hash"] == hash0
    np.testing.assert_array_equal(np.asarray(fs.data[:]), turbo)


def test_turbo_is_another_setting_close_to_pil(demo_store):
    extract(demo_store, "test_resnet", "global", name="pil", decoder="pil", **KW)
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
    plan = make_plan("test_resnet", "regions", boxes=str(demo_dir / "boxes.json"), weights="none")
    assert plan.decoder == "pil" and "decoder" not in plan.attrs()   # regions decode with PIL by default
    with pytest.raises(ValueError, match="--decoder turbo applies to --kind global, fne and grid"):
        extract(demo_store, "test_resnet", "regions", boxes=str(demo_dir / "boxes.json"), decoder="turbo",
                weights="none", progress=False)


def test_vsekit_run_keeps_a_pil_sets_decoder_and_makes_new_sets_torchvision(demo_store, tmp_path):
    """A pipeline's extract stage (no decoder in the recipe) over a set made with pil: the stage
    (run, or rerun after a changed option) keeps pil's pixels; a new set of the same recipe is torchvision."""
    import textwrap

    extract(demo_store, "test_resnet", "global", name="old", decoder="pil", **KW)
    want = np.asarray(FeatureStore.open(demo_store.path).features("old").data[:])

    def recipe(name, batch):
        path = tmp_path / "pipelines.yaml"
        path.write_text(textwrap.dedent(f"""
            pipelines:
              t:
                stages:
                  - stage: extract
                    store: {demo_store.path}
                    model: test_resnet
                    weights: none
                    input_size: 32
                    resize: 40
                    crops: 10
                    batch_size: {batch}
                    block_rows: 8
                    name: {name}
                    workers: 0
                    no_progress: true
        """))
        r = CliRunner().invoke(main, ["run", "t", "--file", str(path)])
        assert r.exit_code == 0, r.output
        return FeatureStore.open(demo_store.path).features(name), r.output

    for batch in (4, 8):   # the second run: another fingerprint, so the stage runs again (--overwrite)
        fs, out = recipe("old", batch)
        assert ("ran 3 blocks" in out and "made again with its own decoder pil" in out) == (batch == 8), out
        assert "decoder" not in fs.attrs and fs.attrs["decoding"]["decoder"] == "pil"
        np.testing.assert_allclose(np.asarray(fs.data[:], np.float64), want.astype(np.float64), rtol=1e-5, atol=1e-6)
    fs, _ = recipe("new", 4)
    assert fs.attrs["decoder"] == "torchvision"
    plan = make_plan("test_resnet", "global", weights="none", input_size=32, resize=40, crops=10)
    np.testing.assert_array_equal(np.asarray(fs.data[:]), features_of(demo_store, plan,
                                                                      lambda p: torchvision_crops(p, 40, 32)))
