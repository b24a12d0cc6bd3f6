"""Images on object storage (issue 46): webdataset shards and image folders on a local S3 server
(moto), ingested and extracted in place, with the same bits as the same files on disk; faults at the
server name the object and lose nothing."""

from __future__ import annotations

import json
import tarfile

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("obstore")
pytest.importorskip("moto")
wds = pytest.importorskip("webdataset")

from conftest import S3_TEST_SECRET  # noqa: E402
from test_formats_webdataset import write_shards  # noqa: E402

from vsekit.cli import main  # noqa: E402
from vsekit.storage import FeatureStore  # noqa: E402
from vsekit.storage.base import ImageError  # noqa: E402
from vsekit.storage.sources import remote, shards  # noqa: E402

EXTRACT = dict(model="test_resnet", kind="global", weights="none", input_size=32, resize=36, batch_size=8,
               block_rows=8, progress=False)


def upload(s3, folder, prefix):
    """Every file of ``folder`` to ``s3://bucket/prefix/``; their keys."""
    keys = []
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            key = f"{prefix}/{f.relative_to(folder).as_posix()}"
            s3.client.put_object(Bucket=s3.bucket, Key=key, Body=f.read_bytes())
            keys.append(key)
    return keys


@pytest.fixture()
def counted(monkeypatch):
    """remote.STATS of this test alone."""
    from collections import Counter

    monkeypatch.setattr(remote, "STATS", Counter())
    monkeypatch.setattr(remote, "IMAGE_OPTIONS", {})
    monkeypatch.setattr(remote, "_STORES", {})
    return remote


@pytest.fixture()
def shards_on_s3(s3, tmp_path, counted):
    """Three webdataset shards of 10 samples on disk and the same bytes on S3; both ingested."""
    truth = write_shards(tmp_path / "wds", n_shards=3, per_shard=10)
    upload(s3, tmp_path / "wds", "laion")
    disk, url = tmp_path / "disk.zarr", s3.url("wds.zarr")
    for src, store in ((str(tmp_path / "wds" / "shard-{0000..0002}.tar"), str(disk)),
                       (f"s3://{s3.bucket}/laion/shard-{{0000..0002}}.tar", url)):
        r = CliRunner().invoke(main, ["ingest", "webdataset", src, "--store", store, "--split", "train"])
        assert r.exit_code == 0, r.output
    return truth, disk, url


def test_webdataset_shards_on_s3_are_streamed_once_at_ingest_and_recorded_by_url(s3, shards_on_s3, tmp_path):
    truth, disk, url = shards_on_s3
    a, b = FeatureStore.open(disk), FeatureStore.open(url)
    assert b.attrs["image_root"] == f"s3://{s3.bucket}/laion"
    assert list(a.image_ids()) == list(b.image_ids()) == sorted(truth)
    assert list(a.image_paths()) == list(b.image_paths())   # the same member offsets
    assert list(a.caption_text()) == list(b.caption_text())
    sizes = {k: s3.client.head_object(Bucket=s3.bucket, Key=f"laion/{k}") for k in b.attrs["image_objects"]}
    assert {k: v[0] for k, v in b.attrs["image_objects"].items()} == {k: h["ContentLength"] for k, h in sizes.items()}
    assert {k: v[1] for k, v in b.attrs["image_objects"].items()} == {k: h["ETag"] for k, h in sizes.items()}
    shard_bytes = sum(h["ContentLength"] for h in sizes.values())
    assert remote.STATS["requests"] == 3 and remote.STATS["bytes"] == shard_bytes   # each shard once, whole
    assert S3_TEST_SECRET not in json.dumps(b.attrs)


def test_extracting_shards_on_s3_gives_the_bits_of_disk_with_one_ranged_get_per_batch(shards_on_s3, counted):
    from vsekit.extract import extract

    truth, disk, url = shards_on_s3
    ref = extract(str(disk), name="f", workers=0, **EXTRACT)
    counted.STATS.clear()
    got = extract(url, name="f", workers=0, **EXTRACT)
    assert got.failed == 0 and ref.failed == 0
    a, b = FeatureStore.open(disk).features("f"), FeatureStore.open(url).features("f")
    assert np.array_equal(a.data[:], b.data[:])
    # 30 images in batches of 8 cut at shard ends: each batch's members of one shard are one GET
    images = counted.STATS["requests"]
    assert 0 < images <= 6, counted.STATS


def test_decoding_workers_and_threads_read_the_shards_on_s3_as_disk(shards_on_s3):
    from vsekit.extract import extract

    _truth, disk, url = shards_on_s3
    extract(str(disk), name="f", workers=0, **EXTRACT)
    extract(url, name="w", workers=2, **EXTRACT)
    a, b = FeatureStore.open(disk).features("f"), FeatureStore.open(url).features("w")
    assert b.counts()["done"] == 30 and np.array_equal(a.data[:], b.data[:])


def test_fetch_coalesces_adjacent_members_and_checks_each_header(shards_on_s3, counted):
    truth, _disk, url = shards_on_s3
    store = FeatureStore.open(url)
    root = store.attrs["image_root"]
    paths = [remote.join(root, p) for p in store.image_paths()[:10]]   # the first shard's ten members
    counted.STATS.clear()
    got = remote.fetch(paths)
    assert counted.STATS["requests"] == 1
    from vsekit.extract.reader import decode

    for p, key in zip(paths, sorted(truth)[:10]):
        assert np.array_equal(np.asarray(decode(p, None, got[p])), truth[key][0])
    container, member, loc = shards.parse_ref(paths[3])
    offset, size = (int(x) for x in loc.split("+"))
    for wrong in (shards.tar_ref(container, member, offset + 512, size),   # a header that is not its own
                  shards.tar_ref(container, member, offset + 10**6, size)):   # past the shard's end
        err = remote.fetch([wrong])[wrong]
        assert isinstance(err, ImageError), err
        assert f"{container} " in f"{err} " or f"{container}:" in str(err)
        assert "changed" in str(err) and member in str(err)
