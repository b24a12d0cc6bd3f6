"""Region detectors through ``vsekit extract``: the options, the weights each detector gets (issue 14:
the backbone's ``--weights`` never decides the detector's), butd-r101 end to end with its label
arrays, and the report's box drawing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

torch = pytest.importorskip("torch")
tvd = pytest.importorskip("torchvision.models.detection")

from vsekit.cli import main  # noqa: E402
from vsekit.extract import butd, extract  # noqa: E402
from vsekit.extract import butd_select as sel  # noqa: E402
from vsekit.extract.regions import region_arrays  # noqa: E402
from vsekit.storage import FeatureStore  # noqa: E402

torch.set_num_threads(2)


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


def _store(tmp_path: Path, n: int = 2, size=(60, 80)) -> FeatureStore:
    rng = np.random.default_rng(0)
    root = tmp_path / "img"
    root.mkdir()
    for k in range(n):
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(root / f"{k}.png")
    store = FeatureStore.create(tmp_path / "s.zarr", dataset="t", image_root=root)
    store.write_images([f"i{k}" for k in range(n)], [f"{k}.png" for k in range(n)], ["train"] * n)
    return store


@pytest.fixture
def spy_frcnn(monkeypatch):
    """Records the ``weights`` torchvision's Faster R-CNN is asked for; builds it random (offline)."""
    real = tvd.fasterrcnn_resnet50_fpn
    calls = []

    def spy(*, weights=None, weights_backbone=None, **kw):
        calls.append(weights)
        return real(weights=None, weights_backbone=None, **kw)

    monkeypatch.setattr(tvd, "fasterrcnn_resnet50_fpn", spy)
    return calls


def _backbone_checkpoint(tmp_path: Path) -> Path:
    from vsekit.extract.backbones import build_model

    path = tmp_path / "backbone.pt"
    torch.save(build_model("test_resnet", "none", seed=3, device="cpu").state_dict(), path)
    return path


# --- issue 14: the detector's weights --------------------------------------------------------------
def test_boxes_detector_with_backbone_weights_path_asks_for_coco_weights(tmp_path, spy_frcnn):
    """``--boxes detector --weights PATH`` used to run a randomly initialised detector silently."""
    store = _store(tmp_path)
    ckpt = _backbone_checkpoint(tmp_path)
    res = extract(store, "test_resnet", "regions", weights=str(ckpt), boxes="detector", input_size=64,
                  max_regions=6, min_regions=3, workers=0, progress=False)
    assert res.done == 2, res.summary()
    assert spy_frcnn == [tvd.FasterRCNN_ResNet50_FPN_Weights.COCO_V1]
    attrs = store.features(res.name).attrs
    assert attrs["detector"] == "coco-frcnn" and attrs["detector_weights"] == "imagenet"
    assert attrs["weights"] == str(ckpt.resolve())


def test_detector_weights_none_is_random_and_recorded(tmp_path, spy_frcnn):
    store = _store(tmp_path)
    res = extract(store, "test_resnet", "regions", weights="none", detector="coco-frcnn",
                  detector_weights="none", input_size=64, max_regions=6, min_regions=3, workers=0,
                  progress=False)
    assert res.done == 2 and spy_frcnn == [None]
    attrs = store.features(res.name).attrs
    assert attrs["detector_weights"] == "none" and attrs["boxes"] == "detector"


def test_coco_weights_that_cannot_be_loaded_stop_the_run(tmp_path, monkeypatch):
    def offline(**kw):
        raise OSError("network is unreachable")

    monkeypatch.setattr(tvd, "fasterrcnn_resnet50_fpn", offline)
    store = _store(tmp_path)
    with pytest.raises(ValueError, match="cannot load torchvision's Faster R-CNN COCO weights"):
        extract(store, "test_resnet", "regions", weights="none", boxes="detector", input_size=64,
                workers=0, progress=False)


@pytest.mark.parametrize("args,message", [
    (["--detector", "butd-r101"], "--detector butd-r101 needs --detector-weights PATH"),
    (["--detector", "butd-r101", "--detector-weights", "imagenet"], "has no downloadable weights"),
    (["--detector", "butd-r101", "--detector-weights", "nope.pth"], "--detector-weights 'nope.pth': not"),
    (["--boxes", "BOXES", "--detector", "coco-frcnn"], "both give the boxes"),
    (["--boxes", "BOXES", "--detector-weights", "none"], "--detector-weights needs --detector"),
    (["--detector", "butd-r101", "--detector-weights", "none", "--input-size", "448"],
     "does its own preprocessing (BGR minus Caffe means, shorter side 600, longer <= 1000); drop --input-size"),
])
def test_detector_option_errors(tmp_path, args, message):
    store = _store(tmp_path)
    boxes = tmp_path / "b.json"
    boxes.write_text("{}")
    args = [str(boxes) if a == "BOXES" else a for a in args]
    r = CliRunner().invoke(main, ["extract", "--store", str(store.path), "--model", "test_resnet", "--weights",
                                  "none", "--kind", "regions", "--no-progress", *args])
    assert r.exit_code == 1, r.output
    assert "Error:" in r.output and message in r.output
    assert "Traceback" not in r.output and not store.feature_names()


def test_coco_detector_bad_state_dict_is_named(tmp_path):
    store = _store(tmp_path)
    bad = tmp_path / "frcnn.pt"
    torch.save({"fc.weight": torch.zeros(2)}, bad)
    with pytest.raises(ValueError, match="frcnn.pt: not a state dict of torchvision's fasterrcnn_resnet50_fpn"):
        extract(store, "test_resnet", "regions", weights="none", detector="coco-frcnn",
                detector_weights=str(bad), input_size=64, workers=0, progress=False)


# --- butd-r101 end to end ---------------------------------------------------------------------------
def test_butd_r101_through_the_cli(tmp_path, monkeypatch):
    # a small scale and few proposals keep it cheap; the network itself is the paper's
    monkeypatch.setattr(butd, "TARGET_SIZE", 96)
    monkeypatch.setattr(butd, "MAX_SIZE", 128)
    monkeypatch.setattr(sel, "RPN_POST_NMS", 6)
    store = _store(tmp_path, size=(90, 120))
    r = CliRunner().invoke(main, ["extract", "--store", str(store.path), "--kind", "regions", "--detector",
                                  "butd-r101", "--detector-weights", "none", "--max-regions", "5",
                                  "--min-regions", "2", "--workers", "0", "--no-progress"])
    assert r.exit_code == 0, r.output
    fs = FeatureStore.open(store.path).features("butd-r101_regions")
    a = fs.attrs
    assert (a["model"], a["detector"], a["detector_weights"]) == ("butd-r101", "butd-r101", "none")
    assert a["butd"]["class_nms"] == 0.3 and a["butd"]["conf_thresh"] == 0.2 and fs.shape == (2, 5, 2048)
    count = fs.array("count")[:]
    for name in ("labels", "label_scores", "attrs", "attr_scores", "boxes"):
        assert fs.has_array(name)
    labels, attrs, scores = fs.array("labels")[:], fs.array("attrs")[:], fs.array("label_scores")[:]
    boxes, data = fs.array("boxes")[:], fs.data[:].astype(np.float32)
    for row in range(2):
        k = int(count[row])
        assert 2 <= k <= 5
        assert (boxes[row, :k, 2] <= 120).all() and (boxes[row, :k, 3] <= 90).all() and (boxes[row, :k] >= 0).all()
        assert ((labels[row, :k] >= 0) & (labels[row, :k] < 1600)).all() and (attrs[row, :k] < 400).all()
        assert ((scores[row, :k] > 0) & (scores[row, :k] <= 1)).all()
        assert np.abs(data[row, :k]).sum(1).min() > 0 and not data[row, k:].any() and not boxes[row, k:].any()
    out = tmp_path / "png"
    r = CliRunner().invoke(main, ["report-boxes", str(store.path), "butd-r101_regions", "--rows", "0,1",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert (out / "butd-r101_regions_1.png").is_file()


# --- drawing ----------------------------------------------------------------------------------------
def test_regions_png_draws_the_boxes_and_labels(tmp_path):
    from vsekit.report.boxes import regions_png

    root = tmp_path / "img"
    root.mkdir()
    Image.new("RGB", (200, 100), (128, 128, 128)).save(root / "a.png")
    store = FeatureStore.create(tmp_path / "s.zarr", dataset="t", image_root=root)
    store.write_images(["a"], ["a.png"], ["train"])

    class P:  # the plan fields region_arrays reads
        max_regions, detector = 3, "butd-r101"

    fs = store.create_features("reg", (3, 4), np.float16, attrs={"kind": "regions"}, block_rows=1,
                               extra=region_arrays(P))
    boxes = np.zeros((1, 3, 4), np.float32)
    boxes[0, :2] = [[20, 40, 80, 90], [120, 10, 190, 60]]
    fs.write_block(0, np.ones((1, 3, 4), np.float16), boxes=boxes, count=np.array([2], np.int16),
                   labels=np.array([[1, 2, 0]], np.int16), attrs=np.array([[0, 3, 0]], np.int16))
    vocab = tmp_path / "objects_vocab.txt"
    vocab.write_text("cat,kitty\ndog\nhorse\n")
    out = regions_png(store, "reg", 0, tmp_path / "o.png", objects_vocab=vocab)
    got = np.asarray(Image.open(out).convert("RGB")).astype(int)
    assert got.shape == (100, 200, 3)
    grey = np.array([128, 128, 128])
    assert (got[90, 50] != grey).any() and (got[70, 20] != grey).any()   # bottom and left edges of box 0
    assert (got[35, 190] != grey).any()                                   # right edge of box 1
    assert (got[70, 50] == grey).all() and (got[95, 100] == grey).all()   # inside box 0, outside both
    assert (got[41:47, 22:60] != grey).any()                              # its caption ("attr 0 dog")
    from vsekit.report.boxes import box_captions

    assert box_captions(np.array([1, 2]), np.array([0, 3]), ["cat", "dog", "horse"], None) == \
        ["attr 0 dog", "attr 3 horse"]
    with pytest.raises(Exception, match="row 5 is outside"):
        regions_png(store, "reg", 5, tmp_path / "x.png")
