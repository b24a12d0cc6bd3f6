"""GPU throughput options, their logic checked on the CPU: decoding processes sized to the device,
pinned memory, channels-last, and bf16 autocast (close to fp32, not equal)."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")

from vsekit.cli import main  # noqa: E402
from vsekit.extract import throughput as tp  # noqa: E402
from vsekit.storage import FeatureStore  # noqa: E402


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


def test_decode_workers_sized_to_the_device():
    assert tp.decode_workers("auto", "cpu", cpus=2) == 1
    assert tp.decode_workers("auto", "cpu", cpus=16) == 2
    assert tp.decode_workers("auto", "cuda", cpus=16) == 6
    assert tp.decode_workers("auto", "cuda", n_gpus=4, cpus=16) == 15  # cores less the driver's
    assert tp.decode_workers("auto", "cuda:1", cpus=4) == 3
    assert tp.decode_workers("0", "cuda") == 0 and tp.decode_workers(3, "cpu") == 3
    for bad in ("x", "-1"):
        with pytest.raises(ValueError, match="--workers"):
            tp.decode_workers(bad, "cpu")


def test_pin_memory_choice():
    assert tp.pin_memory("auto", "cuda") and tp.pin_memory("auto", "cuda:1")
    assert not tp.pin_memory("auto", "cpu") and not tp.pin_memory("off", "cuda") and tp.pin_memory("on", "cpu")
    with pytest.raises(ValueError, match="auto, on, off"):
        tp.pin_memory("yes", "cpu")
    x = torch.arange(12, dtype=torch.uint8).reshape(3, 4)
    y = tp.to_device(x, torch.device("cpu"), pinned=True)  # pinning is for CUDA only
    assert torch.equal(y, x) and not y.is_pinned()


def _extract(store, *args):
    argv = ["extract", "--store", str(store.path), "--model", "test_resnet", "--weights", "none",
            "--input-size", "64", "--resize", "64", "--workers", "0", "--no-progress", "--batch-size", "8",
            *args]
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 0, res.output
    name = args[args.index("--name") + 1]
    return FeatureStore.open(store.path).features(name).data[:]


def test_bf16_autocast_on_cpu_is_close_to_fp32(demo_store, monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setenv("VSEKIT_CHANNELS_LAST", "1")
    monkeypatch.setenv("VSEKIT_PIN_MEMORY", "auto")
    fp32 = _extract(demo_store, "--name", "a", "--device", "cpu")
    bf16 = _extract(demo_store, "--name", "b", "--device", "cpu", "--precision", "bf16")
    assert not np.array_equal(fp32, bf16)  # autocast really ran in bf16
    rel = np.linalg.norm(bf16 - fp32, axis=1) / np.linalg.norm(fp32, axis=1)
    assert rel.max() < 0.05, rel.max()  # bf16 keeps 8 mantissa bits


def test_channels_last_off_gives_the_same_features(demo_store, monkeypatch):
    from vsekit.extract.extractor import _CACHE

    torch.set_num_threads(1)
    monkeypatch.setenv("VSEKIT_CHANNELS_LAST", "1")  # restored after the test (the CLI sets it)
    monkeypatch.setenv("VSEKIT_PIN_MEMORY", "auto")
    on = _extract(demo_store, "--name", "on", "--device", "cpu")
    model = next(iter(_CACHE.values())).model
    conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    off = _extract(demo_store, "--name", "off", "--device", "cpu", "--no-channels-last")
    model = next(iter(_CACHE.values())).model
    conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous() and not conv.weight.is_contiguous(memory_format=torch.channels_last)
    np.testing.assert_allclose(off, on, rtol=1e-4, atol=1e-5)


def test_workers_auto_and_bad_workers(demo_store):
    res = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), "--model", "test_resnet",
                                    "--weights", "none", "--workers", "many"])
    # one Error: line naming the option and the value (the --workers type every command shares, docs/cli.md)
    last = res.output.strip().splitlines()[-1]
    assert res.exit_code == 1 and last.startswith("Error: Invalid value for '--workers': 'many'"), res.output
