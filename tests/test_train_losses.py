"""Similarities, hinge losses and the SEAM attention penalty against small numpy references."""

import numpy as np
import pytest
import torch

from vsekit.models.encoders import SelfAttention
from vsekit.models.losses import HingeLoss, cosine_sim, order_sim, similarity


def _rand(seed, *shape):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float64)


def np_order(img, cap):
    out = np.zeros((len(img), len(cap)))
    for i in range(len(img)):
        for c in range(len(cap)):
            out[i, c] = -np.sum(np.maximum(0.0, cap[c] - img[i]) ** 2)
    return out


def np_hinge(S, margin, max_violation, images=None):
    n = S.shape[0]
    images = np.arange(n) if images is None else np.asarray(images)
    total_cap = np.zeros(n)
    total_img = np.zeros(n)
    for i in range(n):
        for c in range(n):
            if images[i] == images[c]:
                continue
            a = max(0.0, margin + S[i, c] - S[i, i])   # image i, wrong caption c
            b = max(0.0, margin + S[i, c] - S[c, c])   # caption c, wrong image i
            if max_violation:
                total_cap[i] = max(total_cap[i], a)
                total_img[c] = max(total_img[c], b)
            else:
                total_cap[i] += a
                total_img[c] += b
    return total_cap.sum() + total_img.sum()


def test_cosine_and_order_similarity_match_numpy():
    img, cap = _rand(0, 5, 7), _rand(1, 6, 7)
    np.testing.assert_allclose(cosine_sim(torch.tensor(img), torch.tensor(cap)).numpy(), img @ cap.T)
    ref = np_order(img, cap)
    np.testing.assert_allclose(order_sim(torch.tensor(img), torch.tensor(cap)).numpy(), ref, rtol=1e-12)
    # the blocked path (tiny element budget) gives the same matrix
    np.testing.assert_allclose(order_sim(torch.tensor(img), torch.tensor(cap), max_elements=14).numpy(), ref)
    # hand case: caption above the image in every coordinate violates nothing
    assert order_sim(torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 2.0], [2.0, 0.0]])).tolist() == [[0.0, -1.0]]


def test_fused_order_kernel_matches_numpy_and_the_tensor_path():
    """Evaluation (no grad, float32) runs the fused numba kernel; training keeps autograd."""
    from vsekit.models import kernels

    if not kernels.available():
        pytest.skip("numba is not importable here")
    # sizes that leave partial tiles on both axes (tiles are 8 images x 64 captions)
    img, cap = np.abs(_rand(2, 13, 37)), np.abs(_rand(3, 70, 37))
    ref = np_order(img, cap)
    fused = kernels.order_violation(img.astype(np.float32), cap.astype(np.float32), threads=2)
    assert fused.dtype == np.float32 and fused.shape == (13, 70)
    np.testing.assert_allclose(fused, ref, rtol=1e-5, atol=1e-5)
    ti, tc = torch.tensor(img, dtype=torch.float32), torch.tensor(cap, dtype=torch.float32)
    with torch.no_grad():
        np.testing.assert_allclose(order_sim(ti, tc).numpy(), ref, rtol=1e-5, atol=1e-5)
    # with gradients the tensor path runs, and the gradient is the analytic one: -2 max(0, c - i)
    ti.requires_grad_(True)
    S = order_sim(ti, tc)
    np.testing.assert_allclose(S.detach().numpy(), ref, rtol=1e-5, atol=1e-5)
    S[0, 0].backward()
    np.testing.assert_allclose(ti.grad[0].numpy(), 2 * np.maximum(0.0, cap[0] - img[0]), rtol=1e-5)
    assert kernels.order_violation(np.zeros((0, 4), np.float32), np.zeros((3, 4), np.float32)).shape == (0, 3)
    with pytest.raises(ValueError, match="arrays"):
        kernels.order_violation(np.zeros((2, 4), np.float32), np.zeros((3, 5), np.float32))


def test_order_sim_falls_back_to_tensors_without_the_kernel(monkeypatch):
    """VSEKIT_NO_NUMBA (or numba failing to import) leaves evaluation on the blocked tensor path."""
    from vsekit.models import kernels

    monkeypatch.setenv("VSEKIT_NO_NUMBA", "1")
    monkeypatch.setattr(kernels, "_kernel", None)
    monkeypatch.setattr(kernels, "_failed", False)
    img, cap = np.abs(_rand(4, 5, 9)), np.abs(_rand(5, 7, 9))
    assert kernels.order_violation(img.astype(np.float32), cap.astype(np.float32)) is None
    assert not kernels.available()
    with torch.no_grad():
        got = order_sim(torch.tensor(img, dtype=torch.float32), torch.tensor(cap, dtype=torch.float32))
    np.testing.assert_allclose(got.numpy(), np_order(img, cap), rtol=1e-5, atol=1e-5)


def test_similarity_rejects_unknown_name():
    with pytest.raises(ValueError, match="cosine, order"):
        similarity("dot")


@pytest.mark.parametrize("max_violation", [False, True])
@pytest.mark.parametrize("margin", [0.2, 0.05])
def test_hinge_losses_match_numpy(max_violation, margin):
    S = _rand(2, 6, 6) * 0.3
    got = HingeLoss(margin, max_violation)(torch.tensor(S)).item()
    assert got == pytest.approx(np_hinge(S, margin, max_violation), rel=1e-12)
    assert got > 0


def test_hinge_ignores_pairs_of_the_same_image():
    S = _rand(3, 5, 5) * 0.3
    S[1, 2] = S[2, 1] = 2.0  # two captions of one image: the hardest "negatives" if not masked
    images = np.array([0, 1, 1, 2, 3])
    for mv in (False, True):
        got = HingeLoss(0.2, mv)(torch.tensor(S), torch.tensor(images)).item()
        assert got == pytest.approx(np_hinge(S, 0.2, mv, images), rel=1e-12)
        assert got != pytest.approx(np_hinge(S, 0.2, mv), rel=1e-6)


def test_hinge_is_zero_when_positives_win_by_the_margin():
    S = torch.full((4, 4), -1.0)
    S.fill_diagonal_(1.0)
    assert HingeLoss(0.2)(S).item() == 0.0


def test_attention_penalty_matches_numpy():
    torch.manual_seed(0)
    att = SelfAttention(6, 5, hops=3).double()
    h = torch.randn(2, 4, 6, dtype=torch.double)
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    m, penalty = att(h, mask)
    w1, w2 = att.w1.weight.detach().numpy(), att.w2.weight.detach().numpy()
    for b, n in enumerate([4, 2]):
        H = h[b, :n].numpy()
        logits = w2 @ np.tanh(w1 @ H.T)                     # hops x words
        A = np.exp(logits - logits.max(1, keepdims=True))
        A /= A.sum(1, keepdims=True)
        ref = np.sum((A @ A.T - np.eye(3)) ** 2)            # ||A A^T - I||_F^2
        assert penalty[b].item() == pytest.approx(ref, rel=1e-10)
        np.testing.assert_allclose(m[b].detach().numpy(), (A @ H).ravel(), rtol=1e-10)


def test_losses_and_similarities_are_registered_by_name(monkeypatch):
    """A new loss is one ``@register_loss`` in models/losses.py: the config accepts its name and the
    trainer builds it with ``create_loss``; an unknown name lists the valid ones; a name is taken once."""
    from vsekit.models import losses
    from vsekit.train.config import resolve_config

    S = torch.tensor([[0.9, 0.5], [0.1, 0.3]], dtype=torch.float64)
    built = losses.create_loss("hinge", margin=0.2, max_violation=True)
    assert isinstance(built, HingeLoss) and built(S).item() == HingeLoss(0.2, True)(S).item()
    assert losses.similarity("order") is order_sim and "order-norm" in losses.SIMILARITIES
    with pytest.raises(ValueError, match="unknown loss 'nope'; valid choices: hinge"):
        losses.create_loss("nope")
    with pytest.raises(ValueError, match="valid choices: hinge"):
        resolve_config("vse", loss="nope")
    with pytest.raises(ValueError, match="registered twice"):
        losses.register_loss("hinge")(HingeLoss)

    monkeypatch.setattr(losses, "_LOSSES", dict(losses._LOSSES))

    @losses.register_loss("diagonal")
    def diagonal(margin, max_violation):   # noqa: ARG001 (the keywords every loss is built with)
        return lambda scores, images=None: -scores.diagonal().sum()

    assert resolve_config("vse", loss="diagonal").loss == "diagonal"
    assert losses.create_loss("diagonal", margin=0.2, max_violation=False)(S).item() == pytest.approx(-1.2)
