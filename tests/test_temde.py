"""T-EMDE sketch coder and the masked batch norm, against small numpy references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vsekit.models.temde import MaskedBatchNorm1d, TEMDECoder, TEMDEGlobal

torch.set_num_threads(1)
# every test here checks a formula: in float64, where rounding is far below the tolerances on any CPU
# and thread count (float32 rounding is not)
pytestmark = pytest.mark.usefixtures("float64")


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def _randomise_bn(bn: MaskedBatchNorm1d, rng: np.random.Generator) -> None:
    c = bn.num_features
    with torch.no_grad():
        bn.running_mean.copy_(torch.from_numpy(rng.normal(size=c)).float())
        bn.running_var.copy_(torch.from_numpy(rng.uniform(0.5, 2.0, size=c)).float())
        bn.weight.copy_(torch.from_numpy(rng.uniform(0.5, 1.5, size=c)).float())
        bn.bias.copy_(torch.from_numpy(rng.normal(size=c)).float())


def test_masked_batchnorm_training_uses_real_members_only():
    torch.manual_seed(0)
    bn = MaskedBatchNorm1d(3)
    x = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    y = bn(x, mask)
    real = _np(x)[_np(mask).astype(bool)]                      # the 5 real rows
    mean, var = real.mean(0), real.var(0)
    expect = (_np(x) - mean) / np.sqrt(var + 1e-5)
    got = _np(y)
    assert np.allclose(got[_np(mask).astype(bool)], expect[_np(mask).astype(bool)], atol=1e-10)
    assert np.all(got[~_np(mask).astype(bool)] == 0)          # padding comes back as zeros
    # running estimates: momentum 0.1 from (0, 1), unbiased variance
    assert np.allclose(_np(bn.running_mean), 0.1 * mean, atol=1e-10)
    assert np.allclose(_np(bn.running_var), 0.9 + 0.1 * real.var(0, ddof=1), atol=1e-10)
    # garbage in the padded slots changes nothing
    x2 = x.clone()
    x2[~mask] = 1e3
    bn2 = MaskedBatchNorm1d(3)
    assert torch.allclose(bn2(x2, mask)[mask], y[mask], atol=1e-10)


def test_masked_batchnorm_eval_uses_running_stats():
    rng = np.random.default_rng(1)
    bn = MaskedBatchNorm1d(4)
    _randomise_bn(bn, rng)
    bn.eval()
    x = torch.randn(3, 4)
    expect = (_np(x) - _np(bn.running_mean)) / np.sqrt(_np(bn.running_var) + 1e-5) * _np(bn.weight) + _np(bn.bias)
    assert np.allclose(_np(bn(x)), expect, atol=1e-10)


def _ref_assignments(coder: TEMDECoder, x: np.ndarray) -> np.ndarray:
    """numpy: BN(W x) (eval statistics) -> (N, K, D) -> squared distances -> softmax(-d * tau)."""
    n, k, d = coder.divisions, coder.centroids, coder.dim
    z = x @ _np(coder.proj.weight).T + _np(coder.proj.bias)
    bn = coder.bn
    z = (z - _np(bn.running_mean)) / np.sqrt(_np(bn.running_var) + bn.eps) * _np(bn.weight) + _np(bn.bias)
    z = z.reshape(-1, n, k, d)
    dist = ((z - _np(coder.centers)) ** 2).sum(-1)
    logits = -dist * np.exp(_np(coder.log_temperature))
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture()
def coder():
    torch.manual_seed(2)
    c = TEMDECoder(6, divisions=3, centroids=4, dim=2)
    _randomise_bn(c.bn, np.random.default_rng(2))
    with torch.no_grad():
        c.log_temperature.fill_(0.3)
    return c.eval()


def test_assignments_match_numpy(coder):
    x = torch.randn(2, 5, 6)
    mask = torch.ones(2, 5, dtype=torch.bool)
    got = _np(coder.assignments(x, mask))
    expect = _ref_assignments(coder, _np(x).reshape(-1, 6)).reshape(got.shape)
    assert got.shape == (2, 5, 3, 4)
    assert np.allclose(got, expect, atol=1e-10)
    assert np.allclose(got.sum(-1), 1.0, atol=1e-10)          # a distribution over K per division


def test_sketch_is_sum_of_member_assignments_and_ignores_padding(coder):
    x = torch.randn(1, 4, 6)
    mask = torch.tensor([[True, True, True, False]])
    x[0, 3] = 50.0                                             # a padded member with garbage
    raw = _np(coder.raw_sketch(x, mask))[0]
    members = sum(_ref_assignments(coder, _np(x[0, i:i + 1]))[0] for i in range(3))
    assert np.allclose(raw, members, atol=1e-10)
    sketch = _np(coder(x, mask))[0]
    assert sketch.shape == (3 * 4,)
    expect = (members / np.linalg.norm(members, axis=-1, keepdims=True)).reshape(-1)
    assert np.allclose(sketch, expect, atol=1e-10)
    assert np.allclose(np.linalg.norm(sketch.reshape(3, 4), axis=-1), 1.0, atol=1e-10)
    # training mode: padded members are also left out of the batch statistics
    coder.train()
    short = coder.raw_sketch(x[:, :3], mask[:, :3])
    padded = coder.raw_sketch(x, mask)
    assert torch.allclose(short, padded, atol=1e-10)


def test_evaluation_sketch_codes_only_real_members(coder):
    """Without autograd the coder gathers the real members, codes them and sums them per item."""
    x = torch.randn(3, 4, 6)
    mask = torch.tensor([[True, False, True, False], [False, False, False, False], [True, True, True, True]])
    x[~mask] = 50.0                                            # garbage in every padded slot
    with torch.no_grad():
        raw = _np(coder.raw_sketch(x, mask))
        literal = coder.assignments(x, mask).sum(1)
    assert raw.shape == (3, 3, 4)
    for i in range(3):
        real = _np(x[i][mask[i]])
        expect = _ref_assignments(coder, real).sum(0) if len(real) else np.zeros((3, 4))
        assert np.allclose(raw[i], expect, atol=1e-10)
    assert np.allclose(raw, _np(literal), atol=1e-10)
    assert np.allclose(raw[1], 0.0)                            # an item with no members: empty sketch


def test_default_sketch_is_160_wide():
    c = TEMDECoder(16)
    assert c.sketch_dim == 160
    out = c.eval()(torch.randn(2, 3, 16), torch.ones(2, 3, dtype=torch.bool))
    assert out.shape == (2, 160)


def test_global_node_is_relu_of_linear_on_concatenated_sketches():
    torch.manual_seed(3)
    g = TEMDEGlobal(6, sim_dim=5, divisions=2, centroids=3, dim=2).eval()
    si, sc = torch.randn(3, 6), torch.randn(4, 6)
    got = _np(g.pair(si, sc))
    w, b = _np(g.fuse.weight), _np(g.fuse.bias)
    for i in range(3):
        for j in range(4):
            cat = np.concatenate([_np(si[i]), _np(sc[j])])
            assert np.allclose(got[i, j], np.maximum(w @ cat + b, 0), atol=1e-10)
