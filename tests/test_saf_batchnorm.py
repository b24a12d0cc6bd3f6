"""SAF's batch norm against the SGRAF reference's loop: one ``nn.BatchNorm1d(1)`` call per caption.

The reference (Paranioar/SGRAF, ``EncoderSimilarity.forward``) scores a batch caption by caption; its
``AttentionFiltration`` normalises that caption's (images x (1 + words)) logits with their own batch
statistics and updates the running estimates once per caption. The plain loop below does exactly that
with torch's own ``BatchNorm1d``; vsekit's batched computation must give the same scores, gradients
and running estimates in training, and the same scores in evaluation.

The comparisons are in float64: they check a formula, and float32 rounding differs between CPUs
(Intel, AMD) and thread counts by more than any fixed float32 tolerance allows. The tolerance (1e-7
relative) is far above float64 rounding: the reference loop's ``l1norm`` / ``l2norm`` add their 1e-8
to the norm where vsekit's shared helpers place it differently, a difference of order 1e-9.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vsekit.models.sgraf as sgraf_mod
from vsekit.models import create_model
from vsekit.models.sgraf import CaptionBatchNorm1d

torch.set_num_threads(1)

K, C, D, S, V = 5, 12, 8, 6, 40
COUNTS = torch.tensor([5, 3, 1, 4])
LENGTHS = torch.tensor([6, 2, 4, 1, 5])


def make(global_module: str, seed: int = 0):
    torch.manual_seed(seed)
    m = create_model("saf", img_shape=(K, C), vocab_size=V, embed_dim=D, word_dim=5, sim_dim=S,
                     global_module=global_module, temde_divisions=3, temde_centroids=4, temde_dim=2)
    for mod in m.modules():
        if isinstance(mod, nn.Dropout):
            mod.p = 0.0
    with torch.no_grad():       # a non-trivial affine map and running state to start from
        m.saf_bn.weight.fill_(1.7)
        m.saf_bn.bias.fill_(-0.3)
        m.saf_bn.running_mean.fill_(0.4)
        m.saf_bn.running_var.fill_(2.5)
    return m.double()


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(len(COUNTS), K, C, generator=g, dtype=torch.float64)
    tokens = torch.randint(4, V, (len(LENGTHS), int(LENGTHS.max())), generator=g)
    return feats, tokens


def local_nodes(m, v, v_mask, words):
    """The local similarity nodes (eq. 5-6) of one caption's words (n, d) with every image: (n_img, n, S)."""
    s = torch.nn.functional.leaky_relu(v @ words.t(), 0.1)                           # (n_img, K, n)
    s = sgraf_mod.l2norm(s, dim=-1) * m.lambda_softmax                                # over the words
    alpha = torch.softmax(s.masked_fill(~v_mask[..., None], float("-inf")), dim=1)   # over the real regions
    context = sgraf_mod.l2norm(torch.bmm(alpha.transpose(1, 2), v))                  # (n_img, n, d)
    return sgraf_mod.l2norm(m.sim_loc_w((context - words[None]) ** 2))


def reference_scores(m, img, cap, bn: nn.BatchNorm1d) -> torch.Tensor:
    """The reference's per-caption loop, with vsekit's similarity nodes and torch's BatchNorm1d."""
    v, v_mask, v_glo = img
    u, u_mask, u_glo = cap
    cols = []
    for j, n in enumerate(u_mask.sum(1).tolist()):
        nodes = local_nodes(m, v, v_mask, u[j, :n])                       # (n_img, n, S)
        glo = m.global_node(v_glo, u_glo[j:j + 1])
        if glo is not None:
            nodes = torch.cat([glo[:, 0, None, :], nodes], dim=1)
        logits = bn(m.saf_w(nodes).permute(0, 2, 1))                  # (n_img, 1, nodes): one call
        attn = torch.sigmoid(logits)
        attn = attn / (attn.abs().sum(-1, keepdim=True) + 1e-8)        # l1norm
        vec = torch.matmul(attn, nodes).squeeze(1)
        vec = vec / (vec.pow(2).sum(-1, keepdim=True).sqrt() + 1e-8)   # l2norm
        cols.append(torch.sigmoid(m.eval_w(vec)))
    return torch.cat(cols, dim=1)


def torch_bn_like(saf_bn) -> nn.BatchNorm1d:
    bn = nn.BatchNorm1d(1, eps=saf_bn.eps, momentum=saf_bn.momentum).double()
    with torch.no_grad():
        bn.weight.copy_(saf_bn.weight)
        bn.bias.copy_(saf_bn.bias)
        bn.running_mean.copy_(saf_bn.running_mean)
        bn.running_var.copy_(saf_bn.running_var)
    return bn


@pytest.mark.parametrize("global_module", ["self-attention", "none"])
def test_training_scores_gradients_and_running_stats_match_the_per_caption_loop(global_module):
    m = make(global_module).train()
    bn = torch_bn_like(m.saf_bn).train()
    feats, tokens = inputs()
    with torch.no_grad():
        img = m.encode_images(feats, COUNTS)
        cap = m.encode_captions(tokens, LENGTHS)
    img = tuple(t.clone().requires_grad_(t.is_floating_point()) for t in img)
    cap = tuple(t.clone().requires_grad_(t.is_floating_point()) for t in cap)

    ref = reference_scores(m, img, cap, bn)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    members = [img[0], cap[0]] + ([img[2], cap[2]] if global_module != "none" else [])
    ref_grads = torch.autograd.grad((ref * weights).sum(), members + [bn.weight, bn.bias, m.saf_w.weight])
    got = m.score(img, cap)
    got_grads = torch.autograd.grad((got * weights).sum(),
                                    members + [m.saf_bn.weight, m.saf_bn.bias, m.saf_w.weight])

    assert torch.allclose(got, ref, rtol=1e-7, atol=1e-9)
    for g, r in zip(got_grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-6, atol=1e-9)
    # running estimates: the five per-caption updates of torch's BN, in the captions' order
    assert torch.allclose(m.saf_bn.running_mean, bn.running_mean, rtol=1e-7, atol=1e-9)
    assert torch.allclose(m.saf_bn.running_var, bn.running_var, rtol=1e-7, atol=1e-9)
    assert not torch.allclose(bn.running_var, torch.tensor([2.5], dtype=torch.float64))


def test_evaluation_scores_match_the_loop_with_running_stats():
    m = make("self-attention", seed=3)
    m.train()
    feats, tokens = inputs(3)
    m.score(m.encode_images(feats, COUNTS), m.encode_captions(tokens, LENGTHS))   # move the stats
    m.eval()
    bn = torch_bn_like(m.saf_bn).eval()
    with torch.no_grad():
        img = m.encode_images(feats, COUNTS)
        cap = m.encode_captions(tokens, LENGTHS)
        assert torch.allclose(m.score(img, cap), reference_scores(m, img, cap, bn), rtol=1e-7, atol=1e-9)


def test_two_blocks_in_a_row_give_the_sequential_running_stats():
    """The closed form starts from the state the previous block left, as the loop's updates do."""
    saf_bn, bn = CaptionBatchNorm1d(1).double(), nn.BatchNorm1d(1).double()
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        x = torch.randn(3, 9, 4, 1, generator=g, dtype=torch.float64) * 2 + 1   # 3 images, 9 captions, 4 nodes
        mask = torch.ones(3, 9, 4, dtype=torch.bool)
        mask[:, 2, 1:] = False                                        # a one-node caption
        y = saf_bn(x, mask)
        for c in range(9):
            n = int(mask[0, c].sum())
            ref = bn(x[:, c, :n].permute(0, 2, 1)).permute(0, 2, 1)
            assert torch.allclose(y[:, c, :n], ref, rtol=1e-7, atol=1e-9)
            assert torch.all(y[:, c, n:] == 0)
    assert torch.allclose(saf_bn.running_mean, bn.running_mean, rtol=1e-7, atol=1e-9)
    assert torch.allclose(saf_bn.running_var, bn.running_var, rtol=1e-7, atol=1e-9)


def test_training_mode_without_autograd_scores_as_with_it(monkeypatch):
    """In training mode the per-caption statistics need every image, also under ``no_grad`` (whose
    evaluation path would otherwise split the block into image sub-blocks and caption groups)."""
    monkeypatch.setattr(sgraf_mod, "SCORE_BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(sgraf_mod, "CAPTION_GROUP", 2)
    m = make("self-attention", seed=5).train()
    feats, tokens = inputs(5)
    img, cap = m.encode_images(feats, COUNTS), m.encode_captions(tokens, LENGTHS)
    state = {k: v.clone() for k, v in m.saf_bn.state_dict().items()}
    with_grad = m.score(img, cap).detach()
    m.saf_bn.load_state_dict(state)
    with torch.no_grad():
        assert torch.allclose(m.score(img, cap), with_grad, rtol=1e-10, atol=1e-12)
