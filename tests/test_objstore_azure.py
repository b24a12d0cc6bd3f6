"""Stores on Azure Blob Storage (``az://``, issue 35) against Azurite, Microsoft's own local emulator
of the blob service: the conditional writes vsekit's commit protocol rests on (create-if-absent is
``If-None-Match: *``, compare-and-swap ``If-Match``; obstore maps both), the set lease, and an
extraction in one process and on ``--cluster local:2`` equal to one on disk, bit for bit, with one
commit record per block and damage found by ``info --verify``.

Azurite is a Node.js program: the fixture uses ``azurite-blob`` from the PATH, or installs the pinned
version with npm into a cache folder (about 40 s, once per machine). ``gs://`` has no such test: the
GCS emulator on PyPI (gcp-storage-emulator) answers an upload without an ETag, which obstore refuses.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from email.utils import formatdate
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("obstore")

from click.testing import CliRunner  # noqa: E402

from vsekit.cli import main  # noqa: E402
from vsekit.storage import leases, objstore  # noqa: E402
from vsekit.storage.objstore import LeaseHeld, LeaseLost, Objects, SetLease, honours_conditions  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

AZURITE_VERSION = "3.37.0"
#: Azurite's well-known development account (public, documented by Microsoft; not a secret)
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
FAST = ["--model", "test_resnet", "--weights", "none", "--kind", "fne", "--crops", "1", "--input-size", "48",
        "--resize", "56", "--batch-size", "4", "--block-rows", "8", "--workers", "0", "--no-progress"]


def _azurite_blob() -> str:
    """The ``azurite-blob`` executable: on the PATH, or npm-installed into a cache folder."""
    found = shutil.which("azurite-blob")
    if found:
        return found
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vsekit-tests" / f"azurite-{AZURITE_VERSION}"
    exe = cache / "node_modules" / ".bin" / "azurite-blob"
    if not exe.exists():
        if shutil.which("npm") is None or shutil.which("node") is None:
            pytest.skip("Azurite needs Node.js and npm (not on this machine)")
        out = subprocess.run(["npm", "install", "--prefix", str(cache), f"azurite@{AZURITE_VERSION}",
                              "--no-audit", "--no-fund"], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0 and exe.exists(), out.stderr[-2000:]
    return str(exe)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _create_container(endpoint: str, name: str) -> None:
    """Create a container, signed with the development account's Shared Key (a test set-up step:
    obstore reads and writes blobs but does not create containers)."""
    date, version, ctype = formatdate(usegmt=True), "2021-08-06", "application/octet-stream"
    to_sign = "\n".join(["PUT", "", "", "", "", ctype, "", "", "", "", "", "",
                         f"x-ms-date:{date}\nx-ms-version:{version}", f"/{ACCOUNT}/{ACCOUNT}/{name}\nrestype:container"])
    sig = base64.b64encode(hmac.new(base64.b64decode(ACCOUNT_KEY), to_sign.encode(), hashlib.sha256).digest())
    req = urllib.request.Request(f"{endpoint}/{ACCOUNT}/{name}?restype=container", method="PUT", data=b"",
                                 headers={"x-ms-date": date, "x-ms-version": version, "Content-Type": ctype,
                                          "Authorization": f"SharedKey {ACCOUNT}:{sig.decode()}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 201


@pytest.fixture(scope="module")
def azurite(tmp_path_factory):
    exe = _azurite_blob()
    port = _free_port()
    data = tmp_path_factory.mktemp("azurite")
    proc = subprocess.Popen([exe, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(data),
                             "--skipApiVersionCheck", "--silent"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.time() < deadline, "Azurite did not start"
            time.sleep(0.2)
    yield endpoint
    # killed, not terminated: its data is a temporary folder, and on SIGTERM Node took 10-19 s to stop
    proc.kill()
    proc.wait(timeout=30)


@pytest.fixture()
def az(azurite, monkeypatch):
    """A fresh container on Azurite and the environment that points obstore at it."""
    import types

    monkeypatch.setenv("AZURE_STORAGE_USE_EMULATOR", "true")
    monkeypatch.setenv("AZURITE_BLOB_STORAGE_URL", azurite)
    for var in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(objstore, "DEFAULT_OPTIONS", {})
    monkeypatch.setattr(objstore, "_PROBED", {})
    monkeypatch.setattr(objstore, "_CACHED", {})
    container = f"vsekit-{uuid.uuid4().hex[:12]}"
    _create_container(azurite, container)

    def keys(url: str) -> list[str]:
        return Objects(url).keys("")

    return types.SimpleNamespace(url=lambda name="x.zarr": f"az://{container}/{name}", keys=keys)


def test_conditional_writes_and_the_probe_hold_on_azure(az):
    objects = Objects(az.url("probe.zarr"))
    first = objects.create("a", b"1")
    assert first and objects.create("a", b"2") is None            # If-None-Match: * refused
    assert objects.get("a")[0] == b"1"                            # and nothing overwritten
    data, etag = objects.get("a")
    assert objects.swap("a", b"3", etag)                          # If-Match with the current ETag
    assert objects.swap("a", b"4", etag) is None                  # a stale ETag is refused
    assert objects.get("a")[0] == b"3"
    assert honours_conditions(objects)


def test_the_set_lease_on_azure_refuses_a_second_writer_and_a_paused_holder(az, monkeypatch):
    objects = Objects(az.url("lease.zarr"))
    held = SetLease(objects, "s", "test", ttl=0.6).acquire()
    held._stop.set()                                  # its renewals stop: as a paused process
    with pytest.raises(LeaseHeld):
        SetLease(objects, "s", "other", ttl=0.6).acquire()
    time.sleep(0.8)                                   # expired: another run takes it over
    monkeypatch.setattr(leases, "gone_here", lambda info: None)
    other = SetLease(objects, "s", "other", ttl=30).acquire()
    with pytest.raises(LeaseLost):                    # the paused holder wakes: it may not commit
        held.check()
    other.release()
    assert objects.get(objstore.lease_key("s")) is None


def _extract(url_or_path: str, *more: str):
    return CliRunner().invoke(main, ["extract", "--store", url_or_path, *FAST, *more])


def _records(objects: Objects, name: str) -> list[str]:
    """The live commit records of ``name`` (a repair voids a record in place, never deletes it)."""
    return [k for k in objects.keys(f".vsekit/commits/{name}/")
            if k.endswith(".json") and not objects.get_json(k)[0].get("void")]


def test_extraction_on_azure_equals_disk_in_process_and_on_local_2(az, demo_dir, tmp_path):
    import zarr
    from zarr.storage import ObjectStore

    disk = tmp_path / "disk.zarr"
    runner = CliRunner()
    assert runner.invoke(main, ["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store",
                                str(disk)]).exit_code == 0
    r = _extract(str(disk))
    assert r.exit_code == 0, r.output
    want = np.asarray(zarr.open_group(str(disk / "features" / "test_resnet_fne"), mode="r")["data"][:])

    for name, more in (("one.zarr", ()), ("two.zarr", ("--cluster", "local:2"))):
        url = az.url(name)
        r = runner.invoke(main, ["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", url])
        assert r.exit_code == 0, r.output
        r = _extract(url, *more)
        assert r.exit_code == 0 and "24 done, 0 failed, 0 pending" in r.output, r.output
        objects = Objects(url)
        # read back with plain zarr over the same object store layer: the same bits as on disk
        got = zarr.open_group(ObjectStore(objects.store, read_only=True), mode="r")["features/test_resnet_fne/data"][:]
        np.testing.assert_array_equal(np.asarray(got), want)
        assert len(_records(objects, "test_resnet_fne")) == 3            # one record per block
        assert objects.keys(".vsekit/leases/") == []                    # the lease was released
        r = runner.invoke(main, ["info", url, "test_resnet_fne", "--verify"])
        assert r.exit_code == 0 and "checksums verified, no damage found" in r.output, r.output

    # damage one chunk object on the server: --verify names its block, --repair and a rerun mend it
    url = az.url("one.zarr")
    objects = Objects(url)
    chunk = "features/test_resnet_fne/data/c/1/0"
    body, _ = objects.get(chunk)
    objects.put(chunk, body[:-1])
    r = runner.invoke(main, ["info", url, "test_resnet_fne", "--verify"])
    assert r.exit_code == 1 and "block 1: data chunk object" in r.output, r.output
    r = runner.invoke(main, ["info", url, "test_resnet_fne", "--verify", "--repair"])
    assert len(_records(objects, "test_resnet_fne")) == 2, r.output    # the damaged block's record dropped
    r = _extract(url)
    assert r.exit_code == 0 and "ran 1 block" in r.output, r.output
    got = zarr.open_group(ObjectStore(objects.store, read_only=True), mode="r")["features/test_resnet_fne/data"][:]
    np.testing.assert_array_equal(np.asarray(got), want)
    assert runner.invoke(main, ["info", url, "test_resnet_fne", "--verify"]).exit_code == 0


def test_wrong_credentials_and_a_missing_container_are_one_error_line_each_before_any_work(
        az, demo_dir, tmp_path, monkeypatch):
    """Azurite checks the Shared Key signature (moto checks no credentials): a wrong account key and
    a missing container are each one ``Error:`` line naming the URL and the cause, the key's value
    shown nowhere, nothing written and no local folder made."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    url = az.url("s.zarr")
    wrong = base64.b64encode(b"not-the-account-key").decode()
    missing = f"az://nosuch-{uuid.uuid4().hex[:8]}/s.zarr"
    cases = [(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", url,
               "--storage-option", f"account_key={wrong}"], url, "refused the credentials"),
             (["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", missing], missing,
              "the container does not exist"),
             (["info", missing], missing, "the container does not exist")]
    for args, shown, why in cases:
        r = runner.invoke(main, args)
        errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
        assert r.exit_code != 0 and len(errors) == 1, r.output
        assert errors[0].startswith(f"Error: {shown}: ") and why in errors[0], errors[0]
        assert wrong not in r.output
    assert az.keys(url) == []                      # the wrong key wrote nothing
    assert list(tmp_path.iterdir()) == []          # and no folder named az: was made here
