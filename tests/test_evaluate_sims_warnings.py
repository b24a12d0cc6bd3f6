"""`vsekit evaluate --sims` saves the protocol warnings it prints in its metrics JSON, under the
key plain `vsekit evaluate` uses (``warnings``)."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.storage import FeatureStore
from vsekit.train.evaluate_run import protocol_warnings


def test_sims_metrics_json_keeps_the_printed_warnings(tmp_path):
    n = 6
    with FeatureStore.building(tmp_path / "s.zarr", dataset="coco") as store:
        store.write_images([f"i{r}" for r in range(n)], [""] * n, ["test"] * n)
        store.write_captions([f"c{m}" for m in range(2 * n)], np.repeat(np.arange(n), 2))
    np.save(tmp_path / "clip.npy", np.random.default_rng(0).standard_normal((n, 2 * n)).astype(np.float32))
    r = CliRunner().invoke(main, ["evaluate", "--sims", str(tmp_path / "clip.npy"), "--store",
                                                  str(tmp_path / "s.zarr"), "--protocol", "coco-5k",
                                                  "--protocol", "all", "--no-progress"])
    assert r.exit_code == 0, r.output + r.stderr
    printed = [line.removeprefix("warning: ") for line in r.stderr.splitlines() if line.startswith("warning: ")]
    assert len(printed) == 1 and "--protocol coco-5k is defined on a 5000-image test split" in printed[0]
    doc = json.loads((tmp_path / "clip_metrics.json").read_text())
    assert doc["warnings"] == printed == protocol_warnings(["coco-5k", "all"], n, "test")
    assert set(doc["protocols"]) == {"coco-5k", "all"}
