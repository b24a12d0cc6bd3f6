"""The CPU step's speed-ups of issue 47 (part 3) keep its values: the trainer's Adam is torch's fused
kernel, whose update equals torch's default Adam to float64 rounding, and ``step.clip_grad_norm``
is ``torch.nn.utils.clip_grad_norm_`` value for value while it skips the multiplication by 1 on the
CPU. (The caption GRU's one-product weight gradient: ``tests/test_gru_last.py``.)"""

from __future__ import annotations

import pytest
import torch

from vsekit.train import presets
from vsekit.train import step as step_mod

SHAPES = [(40, 30), (50, 7), (21,), (3, 4, 5)]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(params, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = scale * torch.randn(p.shape, generator=g)


def test_the_trainers_adam_is_fused_and_steps_as_torchs_default_adam(float64):
    fused, plain = _params(), _params()
    a = presets.make_optimizer("adam", fused, 1e-2, weight_decay=1e-3)
    b = torch.optim.Adam(plain, lr=1e-2, weight_decay=1e-3, foreach=False)
    assert a.param_groups[0]["fused"] is True
    for step in range(4):
        _grads(fused, 1.0, step)
        _grads(plain, 1.0, step)
        a.step()
        b.step()
    start = _params()
    for p, q, s in zip(fused, plain, start):
        assert (p - s).abs().max() > 1e-3          # not vacuous: four steps of lr 1e-2 moved the weights
        assert torch.allclose(p, q, rtol=1e-13, atol=1e-15), float((p - q).abs().max())
        assert torch.allclose(a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"], rtol=1e-13, atol=0)


@pytest.mark.parametrize("case", ["below", "above", "nan"])
def test_clip_is_torchs_clip_grad_norm_and_scales_only_when_the_factor_is_not_one(case, monkeypatch):
    mine, theirs = _params(), _params()
    for params in (mine, theirs):
        _grads(params, 1e-3 if case == "below" else 1.0, 1)   # a norm of ~0.04 or ~36, against a max of 2
        if case == "nan":
            params[1].grad[2, 3] = float("nan")
    mine.append(torch.nn.Parameter(torch.ones(3)))           # a parameter without a gradient is left alone
    before = [p.grad.clone() for p in mine[:-1]]
    scaled = []
    real = torch.nn.utils.clip_grads_with_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", lambda *a, **k: scaled.append(1) or real(*a, **k))
    step_mod.clip_grad_norm(mine, 2.0, torch.device("cpu"))
    torch.nn.utils.clip_grad_norm_(theirs, 2.0)
    for p, q, b in zip(mine, theirs, before):
        assert torch.equal(p.grad, q.grad) or (case == "nan" and p.grad.isnan().all() and q.grad.isnan().all())
        assert torch.equal(p.grad, b) == (case == "below")    # clipped above, NaN everywhere with a NaN
    assert mine[-1].grad is None
    assert scaled == ([] if case == "below" else [1])         # below the max: no pass over the gradients
