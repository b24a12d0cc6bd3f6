"""The pixel budgets decide which rows fail, so they are extraction options recorded with the set
(issue 39): ``--max-decoded-pixels`` / ``--max-resized-pixels``, not the environment."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from vsekit.cli import main  # noqa: E402
from vsekit.extract import extract  # noqa: E402
from vsekit.storage import FeatureStore  # noqa: E402

OPTS = dict(model="test_resnet", kind="global", weights="none", input_size=32, resize=36, batch_size=4,
            block_rows=8, progress=False, device="cpu", workers=0)


def test_a_budget_is_an_option_recorded_in_the_settings(demo_store, monkeypatch):
    monkeypatch.setenv("VSEKIT_MAX_RESIZED_PIXELS", "100")   # no longer read: nothing fails by it
    plain = extract(demo_store, name="plain", **OPTS)
    assert plain.failed == 0 and plain.done == demo_store.n_images
    tight = extract(demo_store, name="tight", max_resized_pixels=100, **OPTS)   # 36x36 and up: all over
    assert tight.failed == demo_store.n_images
    assert all("over the resized pixel budget (100 pixels, --max-resized-pixels)" in why
               for why in tight.errors.values())
    store = FeatureStore.open(demo_store.path)
    a, b = store.features("plain").attrs, store.features("tight").attrs
    assert "max_resized_pixels" not in a and "max_decoded_pixels" not in a   # a default: recorded as before
    assert b["max_resized_pixels"] == 100 and a["config_hash"] != b["config_hash"]
    from vsekit.storage.remake import remake_command

    assert "--max-resized-pixels 100" in remake_command(store, "tight")
    assert "--max-resized-pixels" not in remake_command(store, "plain")


def test_a_set_made_without_the_option_resumes_with_its_default_and_refuses_another(demo_store):
    first = extract(demo_store, name="s", **OPTS)
    fs = FeatureStore.open(demo_store.path, mode="r+").features("s")
    fs.status[0:8] = 0   # one block pending again
    again = extract(demo_store, name="s", **OPTS)   # the same (default) settings: resumes
    assert again.blocks_run == 1 and again.done == first.done
    res = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), "--model", "test_resnet",
                                    "--weights", "none", "--input-size", "32", "--resize", "36", "--name", "s",
                                    "--device", "cpu", "--workers", "0", "--no-progress",
                                    "--max-decoded-pixels", "50"])
    assert res.exit_code == 1 and "Error:" in res.output and "max_decoded_pixels" in res.output, res.output


def test_a_budget_must_be_positive(demo_store):
    res = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), "--model", "test_resnet",
                                    "--weights", "none", "--max-resized-pixels", "0"])
    assert res.exit_code == 1 and res.output.strip().splitlines()[-1] == "Error: --max-resized-pixels 0: must be > 0"


def test_the_remake_command_follows_from_the_recorded_attrs(tmp_path):
    """A flag is quoted when its attr is recorded and applies: no rule copies the attrs' own
    conditions (a grid set has no --boxes, a regions set no --decoder); a set whose attrs record no
    decoder was made with pil, and its command says so (new sets default to torchvision)."""
    import json

    from vsekit.extract.job import extract_args
    from vsekit.extract.plan import make_plan

    common = dict(weights="none", input_size=32, resize=36)
    grid = extract_args("S", "g", make_plan("test_resnet", "grid", grid=1, **common).attrs())
    assert "--grid" in grid and "--boxes" not in grid and "--crops" not in grid
    assert grid[grid.index("--decoder") + 1] == "torchvision"
    old = extract_args("S", "o", make_plan("test_resnet", "grid", grid=1, decoder="pil", **common).attrs())
    assert "decoder" not in make_plan("test_resnet", "grid", grid=1, decoder="pil", **common).attrs()
    assert old[old.index("--decoder") + 1] == "pil"
    (tmp_path / "b.json").write_text(json.dumps({}))
    reg = extract_args("S", "r", make_plan("test_resnet", "regions", boxes=str(tmp_path / "b.json"),
                                           max_regions=5, **common).attrs())
    assert reg[reg.index("--max-regions") + 1] == "5" and "--boxes" in reg and "--grid" not in reg
    assert "--detector" not in reg and "--decoder" not in reg
    glob = extract_args("S", "x", make_plan("test_resnet", "global", decoder="turbo", max_decoded_pixels=7,
                                            **common).attrs())
    assert glob[glob.index("--decoder") + 1] == "turbo" and glob[glob.index("--max-decoded-pixels") + 1] == "7"
    assert "--grid" not in glob and "--max-regions" not in glob and "--max-resized-pixels" not in glob


def test_the_decoded_budget_holds_for_images_inside_shards(tmp_path):
    """An image read from a tar shard (ingest webdataset) is held to the same budget as a file."""
    import io
    import tarfile

    import numpy as np
    from PIL import Image

    from vsekit.extract.images import ImageError, load_ref_image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((30, 40, 3), np.uint8)).save(buf, format="PNG")   # 1200 px
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w") as tar:
        info = tarfile.TarInfo("a.png")
        info.size = len(buf.getvalue())
        tar.addfile(info, io.BytesIO(buf.getvalue()))
    with tarfile.open(shard) as tar:
        m = tar.getmember("a.png")
        ref = f"{shard}::a.png@{m.offset_data}+{m.size}"
    assert load_ref_image(ref).size == (40, 30)
    with pytest.raises(ImageError, match="40x30 is over the decoded pixel budget .*--max-decoded-pixels"):
        load_ref_image(ref, max_decoded=1000)
