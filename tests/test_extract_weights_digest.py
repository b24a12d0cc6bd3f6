"""`vsekit extract --weights PATH` records the file's content digest: another file at the same path is
refused on a rerun instead of being mixed into the feature set."""

import hashlib

import pytest
import torch
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.digest import file_digest
from vsekit.storage.store import FeatureStore

torch.set_num_threads(1)


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


def _weights(path, seed):
    import timm

    torch.manual_seed(seed)
    torch.save(timm.create_model("resnet18", pretrained=False).state_dict(), path)


def test_file_digest_is_the_sha256_of_the_content(tmp_path):
    p = tmp_path / "w.bin"
    p.write_bytes(b"abc" * 1_000_000)  # several read chunks
    assert file_digest(p) == "sha256:" + hashlib.sha256(b"abc" * 1_000_000).hexdigest()


def test_rerun_with_another_file_at_the_same_weights_path_is_refused(demo_store, tmp_path):
    w = tmp_path / "w.pth"
    _weights(w, 0)
    args = ["extract", "--store", str(demo_store.path), "--model", "resnet18", "--weights", str(w),
            "--input-size", "32", "--resize", "32", "--workers", "0", "--name", "r18", "--no-progress"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    fs = FeatureStore.open(demo_store.path).features("r18")
    assert fs.attrs["weights_sha256"] == "sha256:" + hashlib.sha256(w.read_bytes()).hexdigest()
    again = CliRunner().invoke(main, args)          # same file: a rerun is fine
    assert again.exit_code == 0, again.output
    _weights(w, 1)                                  # another file, same path
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1 and "Error:" in res.output, res.output
    assert "Traceback" not in res.output
    assert FeatureStore.open(demo_store.path).features("r18").attrs["weights_sha256"] == fs.attrs["weights_sha256"]
