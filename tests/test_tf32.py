"""``--precision fp32`` is IEEE float32 on CUDA: TF32 is turned off for matmuls and cuDNN in every
process that extracts or trains, and the set's attrs / the run's config.json record it.

The flags are process-wide torch settings, so this is tested on CPU: each test turns TF32 on, runs
the real command in-process, and reads the flags afterwards.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")

from vsekit.cli import main  # noqa: E402
from vsekit.devices import exact_float32  # noqa: E402
from vsekit.storage import FeatureStore  # noqa: E402

torch.set_num_threads(1)
FAST = ["--model", "test_resnet", "--weights", "none", "--input-size", "48", "--resize", "56",
        "--batch-size", "4", "--block-rows", "4", "--no-progress", "--workers", "0"]


@pytest.fixture
def tf32_on():
    """TF32 allowed everywhere before the test (as a user's earlier code might leave it); restored after."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


def tf32_is_off() -> bool:
    return (torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
            and torch.get_float32_matmul_precision() == "highest")


def test_exact_float32_turns_tf32_off(tf32_on):
    assert not tf32_is_off()
    record = exact_float32()
    assert tf32_is_off()
    assert record == {"tf32": False, "float32_matmul_precision": "highest"}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_extract_runs_without_tf32_and_records_it(tf32_on, demo_store, precision):
    r = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), "--kind", "global", *FAST,
                                  "--precision", precision])
    assert r.exit_code == 0, r.output
    assert tf32_is_off()
    attrs = FeatureStore.open(demo_store.path).features("test_resnet_global").attrs
    assert attrs["tf32"] is False and attrs["float32_matmul_precision"] == "highest"
    assert attrs["precision"] == precision


def test_butd_detector_turns_tf32_off(tf32_on, monkeypatch):
    from vsekit.extract import butd, butd_model

    monkeypatch.setattr(butd_model, "build_empty", lambda device: torch.nn.Linear(1, 1))
    monkeypatch.setattr(butd_model, "init_random", lambda model, seed: model)
    butd.ButdDetector("none")
    assert tf32_is_off()


@pytest.fixture(scope="module")
def tiny_train_store(tmp_path_factory):
    from vsekit.storage.demo import make_demo_data
    from vsekit.storage.sources.karpathy import ingest_karpathy
    from vsekit.tokenize import tokenize
    from vsekit.train.demo import pixel_features

    d = tmp_path_factory.mktemp("tf32")
    make_demo_data(d, images=40, seed=0, size=16, val_fraction=0.25, test_fraction=0.125)
    store, _ = ingest_karpathy(d / "dataset_demo.json", d, d / "s.zarr")
    tokenize(store, min_count=1)
    pixel_features(store, block_rows=16)
    return str(d / "s.zarr")


def test_training_runs_without_tf32_and_records_it(tf32_on, tiny_train_store, tmp_path):
    from vsekit.train import train

    train(tiny_train_store, "pixels", "vse", tmp_path / "run", presets=["demo"], progress=False, epochs=1,
          embed_dim=8, word_dim=8, batch_size=16)
    assert tf32_is_off()
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["float32"] == {"tf32": False, "float32_matmul_precision": "highest"}
    # a resumed run in a process where TF32 was turned on again turns it off again
    torch.backends.cudnn.allow_tf32 = True
    train(tiny_train_store, "pixels", "vse", tmp_path / "run", resume=True, epochs=2, progress=False)
    assert tf32_is_off()
