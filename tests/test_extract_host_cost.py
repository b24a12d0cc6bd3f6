"""What the driving process and the decoding worker do per batch, checked against plain torch / numpy
(issue 37): normalising in place gives the out-of-place formula's values bit for bit and never
touches the caller's tensor; a worker collates its batch straight into shared memory; the reader's
faster image-root check still refuses a file swapped for a symlink pointing out of the root."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from vsekit.extract.extractor import Extractor  # noqa: E402
from vsekit.extract.job import split_options  # noqa: E402
from vsekit.extract.reader import Item, RowDataset, collate  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _bare_extractor(channels_last: bool) -> Extractor:
    ex = Extractor.__new__(Extractor)   # only what _normalise reads: no model is built
    ex.device, ex.pinned = torch.device("cpu"), False
    ex.layout = torch.channels_last if channels_last else torch.contiguous_format
    ex.mean = torch.tensor(MEAN).view(1, 3, 1, 1) * 255.0
    ex.std = torch.tensor(STD).view(1, 3, 1, 1) * 255.0
    ex._inputs = None
    return ex


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("layout", ["nhwc-view", "nchw", "float-nchw"])
def test_normalise_in_place_equals_the_out_of_place_formula(channels_last, layout):
    rng = np.random.default_rng(0)
    hwc = torch.from_numpy(rng.integers(0, 256, (6, 9, 11, 3), dtype=np.uint8))
    x = {"nhwc-view": hwc.permute(0, 3, 1, 2), "nchw": hwc.permute(0, 3, 1, 2).contiguous(),
         "float-nchw": hwc.permute(0, 3, 1, 2).contiguous().float()}[layout]
    before = x.clone()
    ex = _bare_extractor(channels_last)
    got = ex._normalise(x)
    # the old expression: per-element IEEE subtract and divide, so equal bit for bit on any CPU
    want = (x.float() - ex.mean) / ex.std
    assert torch.equal(got, want)
    # and within float32 rounding of the float64 formula
    ref = (x.double() - torch.tensor(MEAN, dtype=torch.float64).view(1, 3, 1, 1) * 255) / \
        (torch.tensor(STD, dtype=torch.float64).view(1, 3, 1, 1) * 255)
    assert torch.allclose(got.double(), ref, rtol=1e-6, atol=1e-6)
    assert got.is_contiguous(memory_format=ex.layout)
    assert torch.equal(x, before)   # the caller's tensor (a float one included) is not normalised in place


def _collate_in_worker(items):
    batch = collate(items)
    return batch, bool(batch.crops is not None and batch.crops.is_shared())


class _Crops:
    def __init__(self, arrays, bad=()):
        self.arrays, self.bad = arrays, set(bad)

    def __len__(self):
        return len(self.arrays)

    def __getitem__(self, i):
        if i in self.bad:
            return Item(i, None, "bad image")
        return Item(i, self.arrays[i])


def test_a_worker_collates_its_batch_into_shared_memory_with_the_ok_items_in_order():
    from torch.utils.data import DataLoader

    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 256, (2, 8, 8, 3), dtype=np.uint8) for _ in range(5)]
    loader = DataLoader(_Crops(arrays, bad={1}), batch_size=5, num_workers=1, collate_fn=_collate_in_worker)
    (batch, shared_in_worker), = list(loader)
    assert shared_in_worker   # allocated in shared memory there: no second copy when it is sent
    assert np.array_equal(batch.crops.numpy(), np.stack([arrays[i] for i in (0, 2, 3, 4)]))
    assert [it.error for it in batch] == [None, "bad image", None, None, None]
    # in the driving process (no worker) a plain tensor, same values
    local = collate([_Crops(arrays)[i] for i in range(5)])
    assert not local.crops.is_shared() and np.array_equal(local.crops.numpy(), np.stack(arrays))


def test_reader_refuses_a_file_swapped_for_a_symlink_out_of_the_root(tmp_path):
    from PIL import Image

    root = tmp_path / "img"
    root.mkdir()
    sibling = tmp_path / "img2"   # a folder whose name starts with the root's: still outside it
    sibling.mkdir()
    Image.new("RGB", (40, 40), (10, 20, 30)).save(root / "in.jpg")
    Image.new("RGB", (40, 40), (10, 20, 30)).save(sibling / "out.jpg")
    (root / "link.jpg").symlink_to(sibling / "out.jpg")
    (root / "inner_link.jpg").symlink_to(root / "in.jpg")
    plan = split_options("test_resnet", "global", dict(crops=1, weights="none", input_size=32, resize=36))[0].plan()
    paths = [root / "in.jpg", root / "link.jpg", root / "inner_link.jpg", root / ".." / "img2" / "out.jpg"]
    ds = RowDataset(plan, range(4), paths, root=root)
    items = [ds[i] for i in range(4)]
    assert items[0].error is None and items[2].error is None
    assert items[0].crops.shape == (1, 32, 32, 3)
    for it in (items[1], items[3]):
        assert it.crops is None and "outside the image root" in it.error and str(sibling / "out.jpg") in it.error


def test_the_kept_input_buffer_gives_each_batch_its_own_values():
    rng = np.random.default_rng(2)
    ex = _bare_extractor(True)
    a, b, c = (torch.from_numpy(rng.integers(0, 256, (n, 5, 7, 3), dtype=np.uint8)).permute(0, 3, 1, 2)
               for n in (4, 4, 3))
    want = [(t.float() - ex.mean) / ex.std for t in (a, b, c)]
    got_a = ex._normalise(a).clone()
    got_b = ex._normalise(b)
    assert torch.equal(got_a, want[0]) and torch.equal(got_b, want[1])
    assert torch.equal(ex._normalise(c), want[2])   # a smaller last batch: its own shape


class _Numbered:
    """Item i: crops filled with the value i (mod 251), so a batch overwritten by a later one shows."""

    def __init__(self, n, shape=(2, 8, 8, 3)):
        self.n, self.shape = n, shape

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return Item(i, np.full(self.shape, i % 251, dtype=np.uint8))


@pytest.mark.parametrize("workers,prefetch", [(1, 1), (1, 2), (2, 2)])
def test_ring_buffers_are_reused_and_never_overwrite_a_batch_the_driver_still_reads(workers, prefetch):
    """A real DataLoader whose driver reads each batch slowly (the workers run ahead as far as the
    loader lets them): every batch still holds its own values at the end of its processing, each
    worker's buffers are mapped here at most prefetch + 1 times (reuse, not a segment per batch), and
    the last batch (smaller) fits an earlier buffer."""
    import os
    import time

    from vsekit.extract.reader import iter_batches

    n, size = 61, 4
    batches = [list(range(s, min(s + size, n))) for s in range(0, n, size)]
    seen_storages = set()
    for b, items in zip(batches, iter_batches(_Numbered(n), batches, workers, prefetch=prefetch)):
        crops = items.crops.numpy()
        first = crops.copy()
        time.sleep(0.02)   # the workers decode ahead meanwhile
        want = np.stack([np.full((2, 8, 8, 3), i % 251, dtype=np.uint8) for i in b])
        assert np.array_equal(first, want) and np.array_equal(items.crops.numpy(), want)
        assert items.intact()
        # the shared segment (its inode: an address can be reused by a fresh mapping)
        seen_storages.add(os.fstat(items.crops.untyped_storage()._share_fd_cpu_()[0]).st_ino)
    assert len(seen_storages) <= workers * (prefetch + 1) < len(batches)   # 16 segments without the ring


def test_a_batch_whose_ring_buffer_was_written_again_is_refused_and_nothing_of_it_is_kept():
    from types import SimpleNamespace

    from vsekit.extract import reader
    from vsekit.extract.rows import run_items
    from vsekit.extract.writer import BlockBuffer
    from vsekit.storage.store import Block, StoreError

    ring = reader.BufferRing(2)
    data = _Numbered(8)
    first = reader.Batch([data[i] for i in range(4)])
    first.crops, first.stamp = ring.take((4, 2, 8, 8, 3))
    first.crops.numpy()[:] = np.stack([it.crops for it in first])
    assert first.intact()
    ring.take((4, 2, 8, 8, 3))          # the other buffer
    assert first.intact()
    ring.take((3, 2, 8, 8, 3))          # first's buffer again (a smaller batch fits it)
    assert not first.intact()

    class _Features:   # the extractor's features: the crops' mean per image
        def features(self, x):
            return x.reshape(len(x), -1).float().mean(1, keepdim=True).numpy()

    plan = SimpleNamespace(detector=None, kind="global", row_shape=(1,), store_dtype=np.float32, max_regions=0)
    buf = BlockBuffer.empty(plan, Block(0, 0, 4))
    with pytest.raises(StoreError, match="rows 0-3: a decoding worker reused the batch's shared buffer"):
        run_items(_Features(), plan, first, buf, strict=False)
    assert buf.filled == 0 and not buf.status.any()
