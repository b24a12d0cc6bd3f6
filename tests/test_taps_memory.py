"""FNE taps pooled in float32 without a float32 copy of the whole map (issue 30): the values equal
the old ``out.float().mean()`` bit for bit, and the peak memory no longer holds that copy."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from vsekit.extract import taps  # noqa: E402
from vsekit.extract.taps import Layout, grid_pool, mean_f32, spatial_mean  # noqa: E402


def _map(n, c, h, w, dtype, channels_last=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, c, h, w, generator=g) * 3 + 1).to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk", [1, 7 * 4 * 9 * 9 * 4, 1 << 30])   # 1 row per chunk, 7 rows, one chunk
def test_pooled_values_equal_the_float32_copy(monkeypatch, dtype, chunk):
    monkeypatch.setattr(taps, "POOL_CHUNK_BYTES", chunk)
    for cl in (False, True):
        x = _map(20, 4, 9, 9, dtype, cl)
        ref = x.float().mean(dim=(2, 3))
        assert torch.equal(spatial_mean(x), ref) and spatial_mean(x).dtype == torch.float32
        assert torch.equal(spatial_mean(x, Layout("NCHW")), ref)
        assert torch.equal(grid_pool(x, Layout("NCHW"), 2),
                           torch.nn.functional.adaptive_avg_pool2d(x.float(), 2))
    nhwc = _map(20, 9, 9, 5, dtype)             # (B, H, W, C): timm's channels-last stages
    assert torch.equal(spatial_mean(nhwc, Layout("NHWC")), nhwc.float().mean(dim=(1, 2)))
    nlc = _map(20, 1, 17, 6, dtype)[:, 0]        # (B, 1 + 16 tokens, C)
    assert torch.equal(spatial_mean(nlc, Layout("NLC", 1)), nlc[:, 1:].float().mean(dim=1))
    assert torch.equal(mean_f32(nlc, (1,)), nlc.float().mean(dim=1))


def test_float32_maps_are_pooled_as_before_and_vectors_copied():
    x = _map(6, 3, 5, 5, torch.float32)
    assert torch.equal(spatial_mean(x), x.float().mean(dim=(2, 3)))
    v = torch.randn(4, 8, dtype=torch.bfloat16)
    out = spatial_mean(v, Layout("NC"))
    assert out.dtype == torch.float32 and torch.equal(out, v.float())


def test_tapper_in_bf16_autocast_equals_the_float32_copy_hooks():
    """Through real hooks under bf16 autocast: the stored taps equal out.float().mean of the outputs."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3))
    seen = {}
    net[2].register_forward_hook(lambda m, i, o: seen.__setitem__("ref", o.float().mean(dim=(2, 3))))
    with taps.Tapper(net, ["2"]) as t, torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        got = t.run(net, torch.randn(5, 3, 16, 16))[0]
    assert got.dtype == torch.float32 and torch.equal(got, seen["ref"])


@pytest.mark.slow
def test_peak_memory_holds_a_chunk_not_a_float32_copy():
    """In a fresh process: pooling a 31 MiB bf16 map the old way takes its 61 MiB float32 copy above
    the map itself; spatial_mean takes about one chunk (8 MiB here)."""
    spec = importlib.util.spec_from_file_location(
        "taps_memory", Path(__file__).resolve().parents[1] / "bench" / "taps_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    old = bench.peak_above(20, 64, 112, "bfloat16", "copy", chunk=8 << 20)
    new = bench.peak_above(20, 64, 112, "bfloat16", "chunked", chunk=8 << 20)
    fp32_copy = 2 * old["map_mib"]
    assert old["peak_above_mib"] > 0.9 * fp32_copy
    assert new["peak_above_mib"] < 0.35 * fp32_copy, (old, new)
