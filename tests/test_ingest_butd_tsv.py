"""BUTD ingest through the CLI: the feature width is the majority's, so one damaged first line (an
interrupted write) is skipped instead of making every good line a skip. Paper sizes: 36 x 2048."""

import base64

import numpy as np
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.storage.store import FeatureStore


def _b64(a) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode()


def test_a_damaged_first_line_does_not_set_the_width(tmp_path):
    rng = np.random.default_rng(0)
    good = [(f"img{i}", rng.uniform(0, 400, (36, 4)), rng.normal(size=(36, 2048))) for i in range(3)]
    tsv = tmp_path / "butd.tsv"
    with open(tsv, "w") as f:
        # an interrupted line: its features end early but still decode (36 boxes x 5 floats)
        f.write(f"img9\t640\t480\t36\t{_b64(good[0][1])}\t{_b64(rng.normal(size=(36, 5)))}\n")
        for image_id, boxes, feats in good:
            f.write(f"{image_id}\t640\t480\t36\t{_b64(boxes)}\t{_b64(feats)}\n")
    res = CliRunner().invoke(main, ["ingest", "butd", str(tsv), "--store", str(tmp_path / "b.zarr"),
                                    "--dtype", "float32"])
    assert res.exit_code == 0, res.output
    assert f"{tsv}:1" in res.output and "most lines have 2048" in res.output
    fs = FeatureStore.open(tmp_path / "b.zarr").features("regions")
    assert fs.shape == (3, 36, 2048)
    np.testing.assert_array_equal(fs.data[:], np.stack([g[2] for g in good]).astype(np.float32))
    assert list(FeatureStore.open(tmp_path / "b.zarr").image_ids()) == ["img0", "img1", "img2"]
