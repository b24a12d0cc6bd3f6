"""``encoders.gru_last`` (the caption GRU of VSE++ / Order on the CPU, issue 47) is torch's packed
GRU: in float64 the final hidden states and every gradient (input and weights) equal torch's to
rounding (backward sums a state's two gradients in another order), for captions of uneven lengths
(a length 0 counts as 1); under bf16 autocast it multiplies in bf16 and keeps a float32 state, as
torch's GRU does."""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pack_padded_sequence

from vsekit.models.encoders import gru_last


def _torch_gru(gru, x, lengths):
    _, h = gru(pack_padded_sequence(x, lengths.clamp(min=1), batch_first=True, enforce_sorted=False))
    return h[-1]


def test_equals_torch_packed_gru(float64):
    torch.manual_seed(0)
    gru = torch.nn.GRU(7, 9, batch_first=True)
    lengths = torch.tensor([5, 2, 0, 5, 3, 1, 4])
    x = torch.randn(len(lengths), 5, 7, requires_grad=True)
    got, want = gru_last(gru, x, lengths), _torch_gru(gru, x, lengths)
    assert got.shape == (len(lengths), 9) and torch.allclose(got, want, rtol=1e-12, atol=1e-15)
    assert not torch.allclose(got[0], got[3])      # not vacuous: the states differ with their inputs
    w = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad((got * w).sum(), [x, *gru.parameters()]),
                    torch.autograd.grad((want * w).sum(), [x, *gru.parameters()])):
        assert b.abs().max() > 0 and torch.allclose(a, b, rtol=1e-12, atol=1e-15)


def test_under_bf16_autocast_as_torch_gru():
    """torch's GRU under CPU bf16 autocast multiplies in bf16 and keeps a float32 state: so does this."""
    torch.manual_seed(0)
    gru = torch.nn.GRU(7, 9, batch_first=True)
    lengths, x = torch.tensor([3, 1, 2]), torch.randn(3, 3, 7)
    plain = gru_last(gru, x, lengths)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = gru_last(gru, x, lengths), _torch_gru(gru, x, lengths)
    assert got.dtype == want.dtype == torch.float32
    # the same bf16 products, summed in the same order: equal; both differ from float32 by bf16's rounding
    assert torch.equal(got, want) and (got - plain).abs().max() > 1e-4
