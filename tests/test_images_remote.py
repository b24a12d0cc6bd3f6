"""Images on object storage (issue 46): webdataset shards and image folders on a local S3 server
(moto), ingested and extracted in place, with the same bits as the same files on disk; faults at the
server name the object and lose nothing."""

from __future__ import annotations

import json
import re
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("obstore")
pytest.importorskip("moto")
wds = pytest.importorskip("webdataset")
pytestmark = pytest.mark.e2e   # ingests and extracts through the CLI

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
    on_s3 = f"s3://{s3.bucket}/laion/shard-{{0000..0002}}.tar"
    for src, store in ((str(tmp_path / "wds" / "shard-{0000..0002}.tar"), str(disk)), (on_s3, url),
                       (on_s3, str(tmp_path / "mixed.zarr"))):   # images on S3, the store on disk
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
    # two ingests from S3 (into a store on S3, and one on disk): each streams each shard once, whole
    assert remote.STATS["requests"] == 2 * 3 and remote.STATS["bytes"] == 2 * shard_bytes
    assert S3_TEST_SECRET not in json.dumps(b.attrs)
    from vsekit.report.images import load_thumbnail   # the report's thumbnails, fetched from S3

    assert b.image_file(0) == f"s3://{s3.bucket}/laion/{b.image_paths()[0]}"
    assert np.array_equal(np.asarray(load_thumbnail(b.image_file(0), 64)), truth[sorted(truth)[0]][0])
    proxy = FaultyProxy(s3.endpoint)   # the same ingest through a proxy: counted at the server
    r = CliRunner().invoke(main, ["ingest", "webdataset", f"s3://{s3.bucket}/laion/shard-{{0000..0002}}.tar",
                                  "--store", str(tmp_path / "proxied.zarr"), "--split", "train",
                                  "--image-option", f"endpoint={proxy.url}"])
    proxy.server.shutdown()
    assert r.exit_code == 0, r.output
    assert (proxy.gets, proxy.bytes) == (3, shard_bytes)


def test_extracting_shards_on_s3_gives_the_bits_of_disk_with_one_ranged_get_per_batch(s3, shards_on_s3, counted):
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
    proxy = FaultyProxy(s3.endpoint)   # once more, the images' GETs through a proxy: counted at the server
    counted.use_options({"endpoint": proxy.url})
    again = extract(url, name="g", workers=0, **EXTRACT)
    proxy.server.shutdown()
    assert again.failed == 0 and np.array_equal(a.data[:], FeatureStore.open(url).features("g").data[:])
    assert 0 < proxy.gets <= 6 and proxy.bytes <= 1.05 * sum(v[0] for v in FeatureStore.open(url).attrs["image_objects"].values())


def test_decoding_processes_read_the_shards_on_s3_as_disk_with_the_options_in_memory(s3, shards_on_s3, counted):
    from vsekit.extract import extract

    _truth, disk, url = shards_on_s3
    extract(str(disk), name="f", workers=0, **EXTRACT)
    proxy = FaultyProxy(s3.endpoint)   # reached only through --image-option endpoint=..., held in memory
    counted.use_options({"endpoint": proxy.url})
    got = extract(url, name="w", workers=2, **{**EXTRACT, "block_rows": 16})
    proxy.server.shutdown()
    a, b = FeatureStore.open(disk).features("f"), FeatureStore.open(url).features("w")
    assert b.counts()["done"] == 30 and np.array_equal(a.data[:], b.data[:])
    # decoded by two worker processes (a fork server's: obstore's runtime does not survive a fork), not threads
    assert got.decoding == {"decoders": 2, "processes": 2, "threads": 0}
    assert 0 < proxy.gets == got.image_reads["requests"]   # the workers' GETs reach the run's summary


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


def _extract_cli(store, *more):
    args = ["extract", "--store", str(store), "--model", "test_resnet", "--kind", "global", "--weights", "none",
            "--input-size", "32", "--resize", "36", "--batch-size", "8", "--block-rows", "8", "--workers", "0",
            "--name", "f", "--device", "cpu", *more]
    return CliRunner().invoke(main, args)


@pytest.mark.parametrize("store_on", ["disk", "s3"])
def test_a_deleted_and_a_rewritten_shard_fail_their_rows_by_url_and_member_and_retry_failed_fills_them(
        s3, shards_on_s3, tmp_path, store_on):
    from vsekit.extract import extract

    _truth, disk, on_s3 = shards_on_s3
    url = tmp_path / "mixed.zarr" if store_on == "disk" else on_s3   # its images on S3 either way
    extract(str(disk), name="f", workers=0, **EXTRACT)
    key = lambda i: f"laion/shard-{i:04d}.tar"   # noqa: E731
    s3.client.delete_object(Bucket=s3.bucket, Key=key(1))
    write_shards(tmp_path / "other", n_shards=3, per_shard=10, seed=7)   # same names, other pixels
    s3.client.put_object(Bucket=s3.bucket, Key=key(2), Body=(tmp_path / "other" / "shard-0002.tar").read_bytes())
    r = _extract_cli(url)
    assert r.exit_code != 0 or "failed" in r.output, r.output
    fs = FeatureStore.open(url).features("f")
    assert fs.counts() == {"done": 10, "failed": 20, "pending": 0}
    errors, paths = fs.errors(), FeatureStore.open(url).image_paths()
    for row in range(10, 20):
        member = paths[row].split("::")[1].split("@")[0]
        assert errors[row] == f"cannot read s3://{s3.bucket}/{key(1)} (member {member}): no such object"
    for row in range(20, 30):
        assert f"s3://{s3.bucket}/{key(2)}" in errors[row] and "changed since it was ingested" in errors[row]
    ref = FeatureStore.open(disk).features("f").data[:]
    assert np.array_equal(fs.data[:10], ref[:10])                                # the rest committed
    for i in (1, 2):   # the shards back as ingested: --retry-failed fills exactly the failed rows
        s3.client.put_object(Bucket=s3.bucket, Key=key(i), Body=(tmp_path / "wds" / f"shard-{i:04d}.tar").read_bytes())
    r = _extract_cli(url, "--retry-failed")
    assert r.exit_code == 0, r.output
    fs = FeatureStore.open(url).features("f")
    assert fs.counts()["done"] == 30, (r.output, fs.errors())
    assert np.array_equal(fs.data[:], ref)


def test_a_missing_image_bucket_is_one_error_line_before_any_block(s3, shards_on_s3):
    _truth, disk, _url = shards_on_s3
    store = FeatureStore.open(disk, mode="r+")
    store.root.attrs["image_root"] = f"s3://{s3.bucket}-gone/laion"   # as if ingested from a bucket since deleted
    r = _extract_cli(disk)
    assert r.exit_code != 0
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert lines == [f"Error: image root s3://{s3.bucket}-gone/laion: the bucket does not exist"], r.output
    assert "f" not in FeatureStore.open(disk).feature_names()


class FaultyProxy:
    """An HTTP proxy in front of the S3 server that answers the first ``fail`` GETs of a shard (an
    object whose key has ``kind`` in it) with 503 and holds the next ``stall`` ones for ``hold`` seconds
    before answering (a stalled response); with ``deny``, every request with 403 InvalidAccessKeyId,
    as S3 answers a wrong key."""

    def __init__(self, upstream: str, fail: int = 0, stall: int = 0, hold: float = 0.0, kind: str = ".tar",
                 deny: bool = False):
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlparse

        self.fail, self.stall, self.hold, self.gets, lock = fail, stall, hold, 0, threading.Lock()
        self.bytes = 0   # the body bytes of the shards' GETs it answered (what reached the client)
        up = urlparse(upstream)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if deny:
                    error = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InvalidAccessKeyId</Code><Message>"
                             b"The AWS Access Key Id you provided does not exist in our records.</Message></Error>")
                    self.send_response(403)
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                if self.command == "GET" and kind in self.path:
                    with lock:
                        proxy.gets += 1
                        n = proxy.gets
                    if n <= proxy.fail:
                        self.send_response(503)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    if n <= proxy.fail + proxy.stall:
                        time.sleep(proxy.hold)
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=30)
                conn.request(self.command, self.path, body or None, dict(self.headers))
                got = conn.getresponse()
                data = got.read()
                if self.command == "GET" and kind in self.path and got.status < 300:
                    with lock:
                        proxy.bytes += len(data)
                self.send_response(got.status)
                for k, v in got.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                head = self.command == "HEAD"   # no body: the object's own length
                self.send_header("Content-Length", got.getheader("Content-Length", "0") if head else str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _forward

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                # a client that hung up first (a stalled response it timed out on, a refusal it had read
                # enough of) is not the test's error; socketserver would print its traceback into the
                # captured output of a CliRunner run in progress. Anything else is printed as usual.
                if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def test_503s_and_a_stalled_response_are_retried_counted_and_give_the_bits_of_disk(s3, shards_on_s3, tmp_path,
                                                                                    counted):
    from vsekit.extract import extract

    _truth, disk, _url = shards_on_s3
    ref = extract(str(disk), name="f", workers=0, **EXTRACT)
    proxy = FaultyProxy(s3.endpoint, fail=2, stall=1, hold=3.0)
    counted.use_options({"endpoint": proxy.url, "timeout": "1s", "max_retries": "4"})
    counted.STATS.clear()
    got = extract(str(tmp_path / "mixed.zarr"), name="f", workers=0, **EXTRACT)
    proxy.server.shutdown()
    assert ref.failed == got.failed == 0
    a, b = FeatureStore.open(disk).features("f"), FeatureStore.open(tmp_path / "mixed.zarr").features("f")
    assert np.array_equal(a.data[:], b.data[:])
    assert counted.STATS["retries"] == 3   # two 503s and one timed-out response
    assert got.image_reads["retries"] == 3 and "3 transient failures retried" in got.summary()
    assert got.image_reads["requests"] == counted.STATS["requests"] > 0
    assert proxy.gets >= counted.STATS["requests"] + 3


def test_a_folder_and_a_karpathy_image_root_on_s3_are_listed_once_and_extract_as_disk(s3, demo_dir, tmp_path,
                                                                                      counted):
    from vsekit.extract import extract

    upload(s3, demo_dir / "images", "demo/images")
    root = f"s3://{s3.bucket}/demo/images"
    rels = sorted(p.relative_to(demo_dir / "images").as_posix() for p in (demo_dir / "images").rglob("*.*"))
    table = tmp_path / "captions.tsv"
    table.write_text("".join(f"{r}\ta picture of {r}\n" for r in rels) + "missing.jpg\tgone\n")
    stores = {}
    for where, root_arg in (("disk", str(demo_dir / "images")), ("s3", root)):
        counted.STATS.clear()
        stores[where] = tmp_path / f"{where}.zarr"
        r = CliRunner().invoke(main, ["ingest", "folder", root_arg, str(table), "--store", str(stores[where])])
        assert r.exit_code == 0, r.output
        assert "missing.jpg is missing" in r.output
    assert counted.STATS["requests"] == 0   # listed (one LIST request), not an object fetched or probed
    assert FeatureStore.open(stores["s3"]).attrs["image_root"] == root
    refs = [extract(str(stores[w]), name="f", workers=0, **EXTRACT) for w in ("disk", "s3")]
    assert refs[0].failed == refs[1].failed == 0
    assert counted.STATS["requests"] == FeatureStore.open(stores["s3"]).n_images   # a loose image: one GET
    a, b = (FeatureStore.open(stores[w]).features("f").data[:] for w in ("disk", "s3"))
    assert np.array_equal(a, b)
    r = CliRunner().invoke(main, ["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--image-root",
                                  f"s3://{s3.bucket}/demo", "--store", str(tmp_path / "k.zarr")])
    assert r.exit_code == 0, r.output
    k = FeatureStore.open(tmp_path / "k.zarr")
    assert k.attrs["image_root"] == f"s3://{s3.bucket}/demo" and k.n_images == len(rels)


def test_wrong_credentials_for_the_images_are_one_error_line_naming_the_image_root(s3, shards_on_s3, tmp_path):
    _truth, disk, _url = shards_on_s3
    mixed = tmp_path / "mixed.zarr"   # the store on disk; its images behind a server refusing the key
    proxy = FaultyProxy(s3.endpoint, deny=True)
    bad = ["--image-option", f"endpoint={proxy.url}", "--image-option", "access_key_id=wrong-key"]
    r = _extract_cli(mixed, *bad)
    ingest = CliRunner().invoke(main, ["ingest", "webdataset", f"s3://{s3.bucket}/laion/shard-0000.tar", "--store",
                                       str(tmp_path / "again.zarr"), *bad])
    proxy.server.shutdown()
    why = "the access key is not known to the provider (wrong credentials)"
    for got in (r, ingest):
        assert got.exit_code != 0
        assert [ln for ln in got.output.splitlines() if ln.strip()] == [
            f"Error: image root s3://{s3.bucket}/laion: {why}"], got.output
    assert "f" not in FeatureStore.open(mixed).feature_names() and not (tmp_path / "again.zarr").exists()


def test_parquet_files_on_s3_by_glob_are_read_once_at_ingest_and_extract_as_disk(s3, tmp_path, counted):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from test_formats_parquet import _jpeg

    from vsekit.extract import extract

    rng = np.random.default_rng(3)
    (tmp_path / "hf").mkdir()
    for f in range(2):   # img2dataset's layout: bytes in a binary column, several row groups a file
        jpgs = [_jpeg(rng, 24) for _ in range(9)]
        jpgs[2] = None   # a failed download
        table = pa.table({"key": [f"{f}{i:03d}" for i in range(9)], "caption": [f"c {f} {i}" for i in range(9)],
                          "jpg": pa.array(jpgs, type=pa.binary())})
        pq.write_table(table, tmp_path / "hf" / f"part-{f}.parquet", row_group_size=4)
    (tmp_path / "hf" / "notes.txt").write_text("not a parquet file")
    upload(s3, tmp_path / "hf", "hf")
    sizes = {f.name: f.stat().st_size for f in (tmp_path / "hf").glob("*.parquet")}
    proxy = FaultyProxy(s3.endpoint, kind=".parquet")
    stores = {"disk": tmp_path / "disk.zarr", "s3": tmp_path / "s3.zarr"}
    for where, src, more in (("disk", str(tmp_path / "hf" / "part-{0..1}.parquet"), []),
                             ("s3", f"s3://{s3.bucket}/hf/*.parquet", ["--image-option", f"endpoint={proxy.url}"])):
        r = CliRunner().invoke(main, ["ingest", "parquet", src, "--store", str(stores[where]), "--split", "test",
                                      *more])
        assert r.exit_code == 0, r.output
    assert (proxy.gets, proxy.bytes) == (2, sum(sizes.values()))   # each file read once, whole, at ingest
    a, b = FeatureStore.open(stores["disk"]), FeatureStore.open(stores["s3"])
    assert b.attrs["image_root"] == f"s3://{s3.bucket}/hf" and sorted(b.attrs["image_objects"]) == sorted(sizes)
    assert list(a.image_ids()) == list(b.image_ids()) and len(a.image_ids()) == 16
    assert list(a.image_paths()) == list(b.image_paths()) and list(a.caption_text()) == list(b.caption_text())
    from vsekit.report.images import load_thumbnail   # the report's thumbnails, from a parquet cell on S3

    for row in (0, 9):
        assert np.array_equal(np.asarray(load_thumbnail(b.image_file(row), 64)),
                              np.asarray(load_thumbnail(a.image_file(row), 64)))
    proxy.gets = proxy.bytes = 0
    for where in ("disk", "s3"):
        got = extract(str(stores[where]), name="f", workers=0, **EXTRACT)
        assert got.failed == 0, got.errors
    proxy.server.shutdown()
    assert np.array_equal(a.features("f").data[:], FeatureStore.open(stores["s3"]).features("f").data[:])
    # by ranged GETs: each file's footer (pyarrow reads the last 64 KiB: here the whole file), then the image
    # column of each of its 3 row groups once; a GET beyond those only as a retry the run counted (a
    # loaded machine's timeout or reset: the server saw it, the run's summary says it)
    retried = got.image_reads.get("retries", 0)
    assert 2 * (1 + 3) <= proxy.gets <= 2 * (1 + 3) + retried, (proxy.gets, got.image_reads)
    assert proxy.bytes <= (2 + retried) * sum(sizes.values()), (proxy.bytes, got.image_reads)


def test_digits_in_a_url_are_not_a_status():
    """A 503 from a bucket whose name holds "416" is retried, not taken for a range past the end (an
    intermittent failure of the 503 test above, whose buckets are random hex)."""
    from vsekit.storage.sources import remote

    said = remote._without_urls(RuntimeError("Generic S3 error: GET http://127.0.0.1:41650/vsekit-416d5d/laion/a.tar "
                                             "failed: HTTP status server error (503 Service Unavailable)"))
    assert not re.search(r"\b416\b", said) and remote._TRANSIENT.search(said)
    assert re.search(r"\b416\b", remote._without_urls(RuntimeError("status 416 Range Not Satisfiable")))


def test_a_decoding_process_fetches_its_next_batch_before_it_is_asked_and_each_batch_once():
    """docs/store.md: each decoding process fetches its next batch (every W-th of the loader's) while
    it decodes the current one; nothing is fetched twice, nothing past its last batch."""
    import threading
    from types import SimpleNamespace

    from vsekit.extract.reader import RowDataset

    ds = object.__new__(RowDataset)   # the fetch-ahead alone: its fetch recorded, no image read
    ds.options, ds.batches, ds._ahead, ds._at = {}, [[0, 1], [2, 3], [4, 5], [6, 7], [8]], None, None
    asked, lock = [], threading.Lock()

    def fetch(indices):
        with lock:
            asked.append(list(indices))
        return {i: f"bytes of {i}" for i in indices}

    ds.fetch = fetch
    worker = SimpleNamespace(id=0, num_workers=2)   # this process is handed batches 0, 2 and 4
    assert ds._fetched([0, 1], worker) == {0: "bytes of 0", 1: "bytes of 1"}
    deadline = time.monotonic() + 30   # a bound, not a timing claim
    while [4, 5] not in asked and time.monotonic() < deadline:
        time.sleep(0.01)
    assert asked == [[0, 1], [4, 5]]   # batch 2 fetched before it was asked
    assert ds._fetched([4, 5], worker) == {4: "bytes of 4", 5: "bytes of 5"}
    assert ds._fetched([8], worker) == {8: "bytes of 8"}
    assert ds._ahead is None and asked == [[0, 1], [4, 5], [8]]   # each once, none past the last
    assert ds._fetched([2, 3], worker) == {2: "bytes of 2", 3: "bytes of 3"}   # out of turn: fetched when asked


def test_a_parquet_file_on_s3_whose_images_are_paths_is_refused_naming_it(s3, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "hf").mkdir()
    pq.write_table(pa.table({"caption": ["a cat"], "image": ["images/a.jpg"]}), tmp_path / "hf" / "part-0.parquet")
    upload(s3, tmp_path / "hf", "hf")
    store = tmp_path / "s3.zarr"
    r = CliRunner().invoke(main, ["ingest", "parquet", f"s3://{s3.bucket}/hf/*.parquet", "--store", str(store)])
    assert r.exit_code != 0
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "part-0.parquet" in lines[0], r.output
    assert "holds paths" in lines[0] and not store.exists()
