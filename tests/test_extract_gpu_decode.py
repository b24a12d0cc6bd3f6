"""``--decoder nvjpeg`` (issue 47 part 1): the workers hand over JPEG bytes, the driving process
decodes a batch of them with one ``decode_jpeg(list, device=...)`` call, orients, resizes and crops on
the device. On the CPU that path decodes with libjpeg-turbo, so it must give exactly the
``torchvision`` decoder's crops and features (the GPU's nvjpeg is held to ``gpu_decode.TOLERANCE``
by scripts/gpu_check.py). Without CUDA the decoder is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

torch = pytest.importorskip("torch")
pytest.importorskip("torchvision")

from vsekit.cli import main  # noqa: E402
from vsekit.extract import extract, gpu_decode  # noqa: E402
from vsekit.extract.images import ImageError, decode_crops  # noqa: E402
from vsekit.extract.plan import make_plan  # noqa: E402
from vsekit.extract.reader import Batch, Item, RowDataset, collate  # noqa: E402
from vsekit.storage import FeatureStore  # noqa: E402

pytestmark = pytest.mark.e2e


def photo(w, h, seed):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    return np.clip(np.stack([x * 200 / w, y * 150 / h + 40, (x + y) * 0.3], -1) + rng.normal(0, 12, (h, w, 3)),
                   0, 255).astype(np.uint8)


@pytest.fixture()
def folder(tmp_path):
    """JPEGs of several kinds and sizes, EXIF rotations, a gray one, a PNG, a CMYK JPEG, a truncated
    JPEG (PIL reads it, decode_jpeg refuses it) and a file that is no image."""
    root = tmp_path / "img"
    root.mkdir()
    files = []
    for i, (w, h) in enumerate(((64, 48), (50, 70), (90, 80))):
        Image.fromarray(photo(w, h, i)).save(root / f"p{i}.jpg", quality=90)
        files.append(f"p{i}.jpg")
    for o in (3, 6, 8):
        exif = Image.Exif()
        exif[0x0112] = o
        Image.fromarray(photo(60, 44, o)).save(root / f"o{o}.jpg", quality=90, exif=exif)
        files.append(f"o{o}.jpg")
    Image.fromarray(photo(56, 56, 9)[..., 0]).save(root / "gray.jpg", quality=90)
    Image.fromarray(photo(52, 60, 10)).save(root / "p.png")
    Image.fromarray(photo(52, 60, 11)).convert("CMYK").save(root / "cmyk.jpg", quality=95)
    data = (root / "p0.jpg").read_bytes()
    (root / "trunc.jpg").write_bytes(data[: len(data) * 3 // 4])
    (root / "text.jpg").write_text("not an image")
    files += ["gray.jpg", "p.png", "cmyk.jpg", "trunc.jpg", "text.jpg"]
    return root, files


def test_the_batched_path_gives_the_torchvision_decoders_crops_on_the_cpu(folder):
    """Reference: ``decode_crops(decoder="torchvision")`` file by file; the workers' side
    (RowDataset → collate) and the driving side (``batch_crops``) as a run does them."""
    root, files = folder
    plan = make_plan("test_resnet", "global", weights="none", input_size=32, resize=40, crops=10, decoder="nvjpeg")
    ds = RowDataset(plan, range(len(files)), [root / f for f in files])
    items = collate([ds[i] for i in range(len(files))])
    by_name = dict(zip(files, items))
    assert all(by_name[f].encoded is not None for f in files if f.startswith(("p", "o", "gray", "trunc"))
               and f.endswith(".jpg")), "every RGB/gray JPEG goes to the batched decode"
    assert by_name["p.png"].encoded is None and by_name["cmyk.jpg"].encoded is None   # decoded by the worker
    assert by_name["text.jpg"].error and "not an image file PIL can read" in by_name["text.jpg"].error
    ok = [it for it in items if it.error is None]
    x, kept, failed = gpu_decode.batch_crops(items, ok, plan, "cpu")
    reasons = {it.row: why for it, why in failed}
    assert sorted([it.row for it in kept] + list(reasons)) == [it.row for it in ok]
    got = dict(zip([it.row for it in kept], x))
    for it in ok:
        try:
            want = decode_crops(root / files[it.row], 40, 32, 10, decoder="torchvision")
        except ImageError as exc:   # the truncated JPEG: PIL's message, as under torchvision
            assert reasons[it.row] == str(exc), files[it.row]
            continue
        assert np.array_equal(got[it.row].numpy(), want), files[it.row]
    assert [files[r] for r in reasons] == ["trunc.jpg"]


def test_a_batch_with_a_jpeg_the_decode_refuses_decodes_the_others(folder, monkeypatch):
    """One corrupt JPEG fails the batched call: each JPEG is then decoded alone, and one that fails
    alone too is decoded on the CPU, where PIL gives the row its reason (or its pixels)."""
    import torchvision.io

    root, _ = folder
    plan = make_plan("test_resnet", "global", weights="none", input_size=32, resize=40, crops=1, decoder="nvjpeg")
    ds = RowDataset(plan, [0, 1, 2], [root / "p1.jpg", root / "trunc.jpg", root / "p2.jpg"])
    items = Batch([ds[i] for i in range(3)])
    assert all(it.encoded is not None for it in items)
    real, calls = torchvision.io.decode_jpeg, []

    def refuses_p2(data, **kw):   # the batch, and p2 alone: refused
        calls.append(len(data) if isinstance(data, list) else 1)
        if isinstance(data, list) or len(data) == items[2].encoded.data.size:
            raise RuntimeError("nvjpeg: bad data")
        return real(data, **kw)

    monkeypatch.setattr(torchvision.io, "decode_jpeg", refuses_p2)
    x, kept, failed = gpu_decode.batch_crops(items, list(items), plan, "cpu")
    assert calls[:4] == [3, 1, 1, 1]   # the batch, then each alone (then the CPU decodes of the two refused)
    assert [it.row for it in kept] == [0, 2] and len(failed) == 1 and failed[0][0].row == 1
    assert "trunc.jpg: image file is truncated" in failed[0][1]
    for k, name in ((0, "p1.jpg"), (1, "p2.jpg")):   # p2: through PIL on the CPU, the same pixels
        assert np.array_equal(x[k].numpy(), decode_crops(root / name, 40, 32, 1, decoder="torchvision")), name


def test_an_extraction_with_nvjpeg_on_the_cpu_equals_torchvisions(folder, tmp_path, monkeypatch):
    """The whole run (decoding workers, the batched decode in the driving process, the model): the
    same features as the torchvision decoder, the same failed rows. CUDA's check is lifted for it."""
    root, files = folder
    store = FeatureStore.create(tmp_path / "s.zarr", dataset="t", image_root=root)
    store.write_images([f.split(".")[0] + f[-3:] for f in files], files, ["train"] * len(files))
    kw = dict(weights="none", input_size=32, resize=40, crops=10, batch_size=4, block_rows=8, progress=False)
    monkeypatch.setattr(gpu_decode, "check_device", lambda device: None)
    a = extract(store, "test_resnet", "global", name="tv", decoder="torchvision", workers=0, **kw)
    b = extract(store, "test_resnet", "global", name="nv", decoder="nvjpeg", workers=1, **kw)
    assert a.failed == b.failed and sorted(a.errors) == sorted(b.errors)
    fa, fb = (FeatureStore.open(store.path).features(n) for n in ("tv", "nv"))
    assert fb.attrs["decoder"] == "nvjpeg" and "nvjpeg" in fb.attrs["decoding"]["decode"]
    np.testing.assert_array_equal(np.asarray(fb.status[:]), np.asarray(fa.status[:]))
    np.testing.assert_array_equal(np.asarray(fb.data[:]), np.asarray(fa.data[:]))


def test_nvjpeg_without_cuda_is_refused_in_one_line(demo_store):
    r = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), "--model", "test_resnet",
                                  "--weights", "none", "--input-size", "32", "--decoder", "nvjpeg",
                                  "--device", "cpu", "--workers", "0", "--no-progress"])
    assert r.exit_code == 1 and r.output.count("Error:") == 1, r.output
    assert "--decoder nvjpeg decodes on the GPU and needs --device cuda (this run's device is cpu)" in r.output
    assert FeatureStore.open(demo_store.path).feature_names() == []   # nothing made
