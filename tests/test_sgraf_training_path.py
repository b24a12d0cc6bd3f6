"""SAF / SGR's training path (caption sub-blocks, length groups, ``_ResidualMap``, SGR's last step on
the global row) against a plain per-caption implementation written here from the equations: scores,
the gradients of every parameter and input, and SAF's running estimates, in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vsekit.models.sgraf as sgraf_mod
from vsekit.models import create_model

torch.set_num_threads(1)

K, C, D, S = 5, 12, 16, 6          # D > 2K: the Gram form of the context norms
COUNTS = [5, 3, 1, 4]
LENGTHS = [6, 2, 4, 1, 5, 2]


def norm(x, dim=-1):
    return x / x.pow(2).sum(dim, keepdim=True).sqrt()


def encodings(seed: int, d: int = D):
    """Random float64 encodings (members, mask, global) with padding, requiring grad."""
    g = torch.Generator().manual_seed(seed)
    v_mask = torch.arange(K)[None, :] < torch.tensor(COUNTS)[:, None]
    u_mask = torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]
    v = norm(torch.randn(len(COUNTS), K, d, generator=g, dtype=torch.float64)) * v_mask[..., None]
    u = norm(torch.randn(len(LENGTHS), max(LENGTHS), d, generator=g, dtype=torch.float64)) * u_mask[..., None]
    v_glo = norm(torch.randn(len(COUNTS), d, generator=g, dtype=torch.float64))
    u_glo = norm(torch.randn(len(LENGTHS), d, generator=g, dtype=torch.float64))
    leaves = [t.clone().requires_grad_() for t in (v, u, v_glo, u_glo)]
    return leaves, v_mask, u_mask


def plain_scores(m, v, v_mask, v_glo, u, u_lengths, u_glo, bn_state):
    """Caption by caption, image by image where it is clearest: eq. 5-9 as written."""
    cols = []
    mean, var = bn_state
    for j, n in enumerate(u_lengths):
        words = u[j, :n]                                               # (n, d)
        rows = []
        node_sets = []
        for i in range(v.shape[0]):
            regions = v[i, :COUNTS[i]]                                 # (k, d)
            s = F.leaky_relu(regions @ words.t(), 0.1)                 # (k, n)
            s = norm(s, dim=1) * m.lambda_softmax                      # over the words
            alpha = torch.softmax(s, dim=0)                            # over the regions
            context = norm(alpha.t() @ regions)                        # (n, d)
            local = norm(F.linear((context - words) ** 2, m.sim_loc_w.weight, m.sim_loc_w.bias))
            glo = norm(F.linear((v_glo[i] - u_glo[j]) ** 2, m.sim_glo_w.weight, m.sim_glo_w.bias))
            node_sets.append(torch.cat([glo[None], local]))             # (1 + n, S)
        nodes = torch.stack(node_sets)                                 # (n_img, 1 + n, S)
        if m.mode == "sgr":
            for step in m.reasoning:
                q, k = step.query(nodes), step.key(nodes)
                edges = torch.softmax(q @ k.transpose(1, 2), dim=-1)
                nodes = F.relu(step.graph(edges @ nodes))
            out = nodes[:, 0]
        else:
            logits = m.saf_w(nodes)                                    # (n_img, 1 + n, 1)
            mu, sig = logits.mean(), logits.var(unbiased=False)
            cnt = logits.numel()
            mean = (1 - m.saf_bn.momentum) * mean + m.saf_bn.momentum * mu.detach()
            var = (1 - m.saf_bn.momentum) * var + m.saf_bn.momentum * sig.detach() * cnt / (cnt - 1)
            y = (logits - mu) / torch.sqrt(sig + m.saf_bn.eps) * m.saf_bn.weight + m.saf_bn.bias
            a = torch.sigmoid(y)[..., 0]
            a = a / a.sum(-1, keepdim=True)
            out = norm((a[..., None] * nodes).sum(1))
        rows.append(torch.sigmoid(m.eval_w(out))[:, 0])
        cols.append(torch.stack(rows, 0)[0])
    return torch.stack(cols, 1), (mean, var)


@pytest.mark.parametrize("mode", ["saf", "sgr"])
@pytest.mark.parametrize("budget", [1 << 22, 1])   # one sub-block; one caption per sub-block
def test_training_path_matches_the_plain_per_caption_form(mode, budget, monkeypatch):
    monkeypatch.setattr(sgraf_mod, "SCORE_BLOCK_ELEMENTS", budget)
    torch.manual_seed(3)
    m = create_model(mode, img_shape=(K, C), vocab_size=30, embed_dim=D, word_dim=5, sim_dim=S).double().train()
    with torch.no_grad():
        for p in m.parameters():           # non-trivial biases everywhere
            p.add_(0.1 * torch.randn_like(p))
        if mode == "saf":
            m.saf_bn.running_mean.fill_(0.3)
            m.saf_bn.running_var.fill_(1.7)
    (v, u, v_glo, u_glo), v_mask, u_mask = encodings(seed=4)
    weights = torch.randn(len(COUNTS), len(LENGTHS), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    params = [p for n, p in m.named_parameters() if n.split(".")[0] in
              ("sim_loc_w", "sim_glo_w", "reasoning", "saf_w", "saf_bn", "eval_w")]
    inputs = [v, u, v_glo, u_glo]

    bn0 = (m.saf_bn.running_mean.clone(), m.saf_bn.running_var.clone()) if mode == "saf" else (0.0, 0.0)
    ref, (ref_mean, ref_var) = plain_scores(m, v, v_mask, v_glo, u, LENGTHS, u_glo, bn0)
    ref_grads = torch.autograd.grad((ref * weights).sum(), inputs + params, allow_unused=True)

    got = m.score((v, v_mask, v_glo), (u, u_mask, u_glo))
    got_grads = torch.autograd.grad((got * weights).sum(), inputs + params, allow_unused=True)

    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    for name, g, r in zip(["v", "u", "v_glo", "u_glo"] + [n for n, p in m.named_parameters() if any(p is q for q in params)],
                          got_grads, ref_grads):
        if g is None or r is None:         # b_k cancels in the softmax: no gradient (or rounding only)
            assert float((g if r is None else r).abs().max()) < 1e-12 if (g is not None or r is not None) else True, name
            continue
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11, msg=name)
    if mode == "saf":   # one running-estimate update per caption, in the captions' order
        torch.testing.assert_close(m.saf_bn.running_mean, ref_mean, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(m.saf_bn.running_var, ref_var, rtol=1e-10, atol=1e-12)


def test_sub_blocks_follow_the_budget_and_lengths():
    groups = sgraf_mod.length_groups([6, 2, 4, 1, 5, 2], per_word=10, budget=80)
    assert groups == [([3, 1, 5], 2), ([2], 4), ([4], 5), ([0], 6)]
    assert sgraf_mod.length_groups([3, 3], per_word=10, budget=1) == [([0], 3), ([1], 3)]
