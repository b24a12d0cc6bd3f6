"""SAF / SGR (SGRAF): encoders, every similarity equation against numpy, masking, blockwise scoring."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vsekit.models.sgraf as sgraf_mod
from vsekit.models import create_model
from vsekit.models.temde import MaskedBatchNorm1d

torch.set_num_threads(1)

K, C, D, S, V = 5, 12, 8, 6, 40          # regions, feature width, joint dim, sim dim, vocab
COUNTS = torch.tensor([5, 3, 1, 4])
LENGTHS = torch.tensor([6, 2, 4, 1, 5])
MODELS = [(m, g) for m in ("saf", "sgr") for g in ("self-attention", "t-emde", "none")]


def _np(t):
    return t.detach().double().numpy()


def l2n(x, axis=-1):
    return x / (np.sqrt((x ** 2).sum(axis, keepdims=True)) + 1e-8)


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def lin(layer, x):
    return x @ _np(layer.weight).T + _np(layer.bias)


def bn_eval(bn: MaskedBatchNorm1d, x):
    return (x - _np(bn.running_mean)) / np.sqrt(_np(bn.running_var) + bn.eps) * _np(bn.weight) + _np(bn.bias)


def make(mode, global_module, seed=0):
    torch.manual_seed(seed)
    m = create_model(mode, img_shape=(K, C), vocab_size=V, embed_dim=D, word_dim=5, sim_dim=S,
                     global_module=global_module, temde_divisions=3, temde_centroids=4, temde_dim=2)
    rng = np.random.default_rng(seed)
    for mod in m.modules():       # non-trivial running statistics so eval-mode BN is really tested
        if isinstance(mod, MaskedBatchNorm1d):
            c = mod.num_features
            mod.running_mean.copy_(torch.from_numpy(rng.normal(0, 0.3, c)).float())
            mod.running_var.copy_(torch.from_numpy(rng.uniform(0.5, 2, c)).float())
    return m.eval()


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(len(COUNTS), K, C, generator=g)
    tokens = torch.randint(4, V, (len(LENGTHS), int(LENGTHS.max())), generator=g)
    return feats, tokens


def ref_pair(m, v, u, vg, ug):
    """numpy SAF / SGR score of one pair from its real regions v (k, d) and words u (l, d)."""
    s = v @ u.T
    s = np.where(s > 0, s, 0.1 * s)
    s = l2n(s, axis=1)                                   # l2norm over words
    alpha = softmax(9.0 * s, axis=0)                     # softmax over regions
    ctx = l2n(alpha.T @ v)                               # (l, d)
    nodes = l2n(lin(m.sim_loc_w, (ctx - u) ** 2))
    if m.global_module == "self-attention":
        nodes = np.vstack([l2n(lin(m.sim_glo_w, (vg - ug) ** 2)), nodes])
    elif m.global_module == "t-emde":
        nodes = np.vstack([np.maximum(lin(m.temde.fuse, np.concatenate([vg, ug])), 0), nodes])
    if m.mode == "sgr":
        for step in m.reasoning:
            e = softmax(lin(step.query, nodes) @ lin(step.key, nodes).T, axis=-1)
            nodes = np.maximum(lin(step.graph, e @ nodes), 0)
        out = nodes[0] if m.global_module != "none" else nodes.mean(0)
    else:
        a = 1 / (1 + np.exp(-bn_eval(m.saf_bn, lin(m.saf_w, nodes))[:, 0]))
        a = a / (a.sum() + 1e-8)
        out = l2n(a @ nodes)
    return 1 / (1 + np.exp(-lin(m.eval_w, out)[0]))


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("mode,global_module", MODELS)
def test_scores_match_numpy_reference_with_masking(mode, global_module):
    m = make(mode, global_module)
    feats, tokens = inputs()
    with torch.no_grad():
        img = m.encode_images(feats, COUNTS)
        cap = m.encode_captions(tokens, LENGTHS)
        scores = _np(m.score(img, cap))
    assert scores.shape == (len(COUNTS), len(LENGTHS))
    v, u, vg, ug = _np(img[0]), _np(cap[0]), _np(img[2]), _np(cap[2])
    for i, k in enumerate(COUNTS.tolist()):
        for j, n in enumerate(LENGTHS.tolist()):
            # float64: the 1e-8 the reference's l2norm adds to each norm sits elsewhere in vsekit's
            # helpers, up to ~3e-7 in a score where a norm is small; float64 rounding is far below it
            assert scores[i, j] == pytest.approx(ref_pair(m, v[i, :k], u[j, :n], vg[i], ug[j]), abs=1e-6)


@pytest.mark.usefixtures("float64")
def test_image_encoder_and_visual_self_attention_match_numpy():
    m = make("sgr", "self-attention", seed=1)
    feats, _ = inputs(1)
    with torch.no_grad():
        v, mask, vg = m.encode_images(feats, COUNTS)
    for i, k in enumerate(COUNTS.tolist()):
        x = _np(feats[i, :k])
        regions = l2n(lin(m.img_fc, x))
        assert np.allclose(_np(v[i, :k]), regions, atol=1e-9)
        assert np.all(_np(v[i, k:]) == 0) and _np(mask[i]).sum() == k
        att = m.v_att
        local = np.tanh(bn_eval(att.local_bn, lin(att.local, regions)))
        glob = np.tanh(bn_eval(att.glob_bn, lin(att.glob, regions.mean(0))))
        w = softmax(lin(att.common, local * glob)[:, 0])
        assert np.allclose(_np(vg[i]), l2n(w @ regions), atol=1e-9)


@pytest.mark.usefixtures("float64")
def test_text_encoder_averages_directions_and_text_self_attention():
    m = make("saf", "self-attention", seed=2)
    _, tokens = inputs(2)
    with torch.no_grad():
        u, mask, ug = m.encode_captions(tokens, LENGTHS)
        for j, n in enumerate(LENGTHS.tolist()):
            emb = m.embed(tokens[j:j + 1, :n])
            out, _ = m.gru(emb)                          # one unpadded caption: no packing needed
            half = out.shape[-1] // 2
            words = l2n(_np((out[0, :, :half] + out[0, :, half:]) / 2))
            assert np.allclose(_np(u[j, :n]), words, atol=1e-9)
            assert np.all(_np(u[j, n:]) == 0)
            att = m.t_att
            local = np.tanh(lin(att.local, words))
            glob = np.tanh(lin(att.glob, words.mean(0)))
            w = softmax(lin(att.common, local * glob)[:, 0])
            assert np.allclose(_np(ug[j]), l2n(w @ words), atol=1e-9)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("mode,global_module", MODELS)
def test_padding_and_missing_regions_never_change_a_score(mode, global_module):
    m = make(mode, global_module, seed=3)
    feats, tokens = inputs(3)
    with torch.no_grad():
        base = m.score(m.encode_images(feats, COUNTS), m.encode_captions(tokens, LENGTHS))
        junk_feats = feats.clone()
        for i, k in enumerate(COUNTS.tolist()):
            junk_feats[i, k:] = 100.0                     # missing regions hold garbage
        wide = torch.cat([junk_feats, torch.full((len(COUNTS), 3, C), -7.0)], dim=1)  # and more slots
        junk_tokens = torch.cat([tokens, torch.randint(4, V, (len(LENGTHS), 4))], dim=1)
        for j, n in enumerate(LENGTHS.tolist()):
            junk_tokens[j, n:] = torch.randint(4, V, (junk_tokens.shape[1] - n,))
        other = m.score(m.encode_images(wide, COUNTS), m.encode_captions(junk_tokens, LENGTHS))
    assert torch.allclose(base, other, atol=1e-9)


@pytest.mark.usefixtures("float64")
def test_padding_is_also_masked_from_batch_statistics_in_training():
    m = make("saf", "t-emde", seed=4)
    m.train()
    for mod in m.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    feats, tokens = inputs(4)
    junk = feats.clone()
    for i, k in enumerate(COUNTS.tolist()):
        junk[i, k:] = 55.0
    a = m.score(m.encode_images(feats, COUNTS), m.encode_captions(tokens, LENGTHS))
    b = m.score(m.encode_images(junk, COUNTS), m.encode_captions(tokens, LENGTHS))
    assert torch.allclose(a, b, atol=1e-9)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("mode,global_module", MODELS)
def test_blockwise_scores_equal_pair_by_pair(mode, global_module, monkeypatch):
    m = make(mode, global_module, seed=5)
    feats, tokens = inputs(5)
    with torch.no_grad():
        img = m.encode_images(feats, COUNTS)
        cap = m.encode_captions(tokens, LENGTHS)
        block = m.score(img, cap)
        for i in range(len(COUNTS)):
            for j in range(len(LENGTHS)):
                one = m.score(tuple(t[i:i + 1] for t in img), tuple(t[j:j + 1] for t in cap))
                assert one.shape == (1, 1)
                assert one.item() == pytest.approx(block[i, j].item(), abs=1e-10)
        monkeypatch.setattr(sgraf_mod, "SCORE_BLOCK_ELEMENTS", 1)   # one image per sub-block
        assert torch.allclose(m.score(img, cap), block, atol=1e-10)
        monkeypatch.setattr(sgraf_mod, "CAPTION_GROUP", 2)          # length groups, each trimmed
        assert len(set(LENGTHS.tolist())) > 2
        assert torch.allclose(m.score(img, cap), block, atol=1e-10)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("mode,global_module", MODELS)
def test_evaluation_path_equals_the_training_path(mode, global_module, monkeypatch):
    """``score`` without autograd takes ``_score_block_eval`` (Gram-matrix context norms, the graph
    masks as one bias, SGR's last step on the global row only); with autograd, ``_score_train``
    computes the equations with autograd's own operations. In eval mode both must give the same scores, for both
    context-norm forms (Gram when d > 2K, direct otherwise)."""
    m = make(mode, global_module, seed=9)
    feats, tokens = inputs(9)
    img = m.encode_images(feats, COUNTS)
    cap = m.encode_captions(tokens, LENGTHS)
    literal = m.score(img, cap).detach()
    assert literal.requires_grad is False and torch.is_grad_enabled()
    with torch.no_grad():
        fast = m.score(img, cap)
        assert torch.allclose(fast, literal, atol=1e-10)
        # K = 5 regions and D = 8 take the direct norm; padded to 12 > 2K, the Gram form
        v = torch.cat([img[0], torch.zeros(len(COUNTS), K, 12 - D)], dim=-1)
        u = torch.cat([cap[0], torch.zeros(len(LENGTHS), cap[0].shape[1], 12 - D)], dim=-1)
        m2 = make(mode, global_module, seed=9)
        m2.sim_loc_w = torch.nn.Linear(12, S)
        with torch.enable_grad():
            ref = m2.score((v, img[1], img[2]), (u, cap[1], cap[2])).detach()
        assert torch.allclose(m2.score((v, img[1], img[2]), (u, cap[1], cap[2])), ref, atol=1e-10)
        monkeypatch.setattr(sgraf_mod, "SCORE_BLOCK_ELEMENTS", 1)
        monkeypatch.setattr(sgraf_mod, "GLOBAL_BLOCK_ELEMENTS", 1)   # global nodes image by image
        assert torch.allclose(m.score(img, cap), literal, atol=1e-10)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("steps", [0, 1])
def test_evaluation_path_with_few_reasoning_steps(steps):
    torch.manual_seed(10)
    m = create_model("sgr", img_shape=(K, C), vocab_size=V, embed_dim=D, word_dim=5, sim_dim=S,
                     sgr_steps=steps).eval()
    feats, tokens = inputs(10)
    img, cap = m.encode_images(feats, COUNTS), m.encode_captions(tokens, LENGTHS)
    literal = m.score(img, cap).detach()
    with torch.no_grad():
        assert torch.allclose(m.score(img, cap), literal, atol=1e-10)


@pytest.mark.usefixtures("float64")
def test_short_row_softmax_matches_torch():
    x = torch.randn(7, 5, 13) * 4
    x[..., 9:] = torch.finfo(x.dtype).min + x[..., 9:]          # masked keys, as the graph's bias
    want = torch.softmax(x, dim=-1)
    got = sgraf_mod.softmax_short_rows(x.clone())
    assert torch.allclose(got, want, atol=1e-12)
    assert (got[..., 9:] == 0).all()
    assert torch.allclose(got.sum(-1), torch.ones(7, 5))


@pytest.mark.usefixtures("float64")
def test_sgraf_average_is_mean_of_saf_and_sgr():
    """SGRAF's score is the mean of SAF's and SGR's: what evaluation runs (``EnsembleScorer``, used by
    ``vsekit evaluate RUN_SAF RUN_SGR``), against the two models' own scores in eval mode, in float64."""
    from vsekit.train.scoring import EnsembleScorer

    saf, sgr = make("saf", "self-attention", seed=6), make("sgr", "self-attention", seed=7)
    feats, tokens = inputs(6)
    with torch.no_grad():
        saf.eval(), sgr.eval()
        enc = [(m.encode_images(feats, COUNTS), m.encode_captions(tokens, LENGTHS)) for m in (saf, sgr)]
        s1 = saf.score(*enc[0]).double()
        s2 = sgr.score(*enc[1]).double()
        saf.train(), sgr.train()
        avg = EnsembleScorer([saf, sgr], enc)(slice(0, 6), slice(0, len(LENGTHS))).double()
    assert saf.training and sgr.training   # the scorer leaves the models as it found them
    assert torch.allclose(avg, (s1 + s2) / 2, atol=1e-6)
    assert not torch.allclose(avg, s1) and not torch.allclose(avg, s2)


def test_bad_options_and_layouts_are_refused():
    with pytest.raises(ValueError, match="valid choices: self-attention, t-emde, none"):
        create_model("sgr", img_shape=(K, C), vocab_size=V, global_module="sketch")
    with pytest.raises(ValueError, match="reads regions features"):
        create_model("saf", img_shape=(7, 7, C), vocab_size=V)


def sgr_learning_run(seed: int, steps: int = 80) -> tuple[float, float]:
    """Text-to-image R@1 of a small SGR (T-EMDE global node) on 12 synthetic pairs, before and after
    ``steps`` Adam steps on the sum of hinges over all negatives (both directions). Region r of image
    i shows the prototype of word r of caption i, so matching pairs are learnable; chance is 1/12.

    The sum of hinges, not the hardest negative (VSE++): from scratch the hardest-negative hinge
    leaves SGR near chance for some seeds (of seeds 0-19, 2 end at R@1 = 1/6 and 3 at 5/12 on an AMD
    EPYC), and which seeds stall depends on the CPU's rounding (issue 25). ``seed`` sets the initial weights and the data."""
    torch.manual_seed(seed)
    m = create_model("sgr", img_shape=(K, C), vocab_size=V, embed_dim=16, word_dim=8, sim_dim=32,
                     global_module="t-emde", temde_divisions=4, temde_centroids=4, temde_dim=2, dropout=0.0)
    n = 12
    tokens = torch.randint(4, V, (n, 4))
    proto = torch.randn(V, C)
    feats = torch.cat([proto[tokens], torch.zeros(n, K - 4, C)], dim=1)   # region r shows word r
    counts = torch.full((n,), 4)
    lengths = torch.full((n,), 4)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)

    def r1():
        m.eval()
        with torch.no_grad():
            s = m.score(m.encode_images(feats, counts), m.encode_captions(tokens, lengths))
        m.train()
        return (s.argmax(0) == torch.arange(n)).float().mean().item()

    before = r1()
    for _ in range(steps):
        s = m.score(m.encode_images(feats, counts), m.encode_captions(tokens, lengths))
        pos = s.diagonal()
        loss = ((0.2 + s - pos[:, None]).clamp(min=0).fill_diagonal_(0).sum()
                + (0.2 + s - pos[None, :]).clamp(min=0).fill_diagonal_(0).sum())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return before, r1()


SGR_LEARNS_R1 = 0.5    # 6x chance (1/12); the worst seed of the 20-seed sweep reaches 0.75


def sgr_learns(seed: int) -> tuple[float, float]:
    """(R@1 after training, its bar): the bar is 0.5 and at least 0.3 above the untrained model's."""
    before, after = sgr_learning_run(seed)
    return after, max(SGR_LEARNS_R1, before + 0.3)


def test_sgr_learns_on_synthetic_pairs():
    """A few optimiser steps lift the matching pairs to the top. Holds for every seed, not one
    trajectory (issue 25: seed 8 with the hardest-negative hinge ended at R@1 = 5/12 on an AMD CPU):
    tests/test_learning_seeds.py runs seeds 0-19; the worst seed reaches R@1 = 11/12 with 1 and 2
    threads, and 0.75 with torch's AVX2 or scalar kernels (ATEN_CPU_CAPABILITY=avx2 / default) in
    place of AVX-512, against the bar of 0.5."""
    after, bar = sgr_learns(seed=8)
    assert after >= bar, (after, bar)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("mode", ["saf", "sgr"])
def test_paper_dims_above_128_images_with_a_sub_block_that_does_not_divide_the_chunk(mode, monkeypatch):
    """Issue 14: at joint 1024 / sim 256 the image chunk of the global nodes (128 images for a group of
    32 captions) is not a multiple of the cache-sized sub-block, and the last sub-block of a chunk ran
    past it (crash above 128 images). Scores must equal the literal per-pair path."""
    torch.manual_seed(0)
    n_img, n_cap, words, regions = 140, 32, 3, 4
    m = create_model(mode, img_shape=(regions, 16), vocab_size=20, embed_dim=1024, word_dim=8,
                     sim_dim=256).eval()
    # one sub-block = 10 images for 32 captions x 3 words x 1024 dims; the chunk is 128 images
    per_image = n_cap * words * 1024
    monkeypatch.setattr(sgraf_mod, "SCORE_BLOCK_ELEMENTS", 10 * per_image)
    chunk = sgraf_mod.GLOBAL_BLOCK_ELEMENTS // (n_cap * 1024)
    assert chunk == 128 and chunk % 10 != 0 and n_img > chunk
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(n_img, regions, 16, generator=g)
    tokens = torch.randint(1, 20, (n_cap, words), generator=g)
    lengths = torch.full((n_cap,), words)
    with torch.no_grad():
        img, cap = m.encode_images(feats), m.encode_captions(tokens, lengths)
        blockwise = m.score(img, cap)
    assert blockwise.shape == (n_img, n_cap)
    with torch.enable_grad():       # the literal training path, one pair at a time
        for i in list(range(0, n_img, 7)) + [127, 128, 129, n_img - 1]:
            for c in (0, 13, n_cap - 1):
                one = m.score(tuple(t[i:i + 1] for t in img), tuple(t[c:c + 1] for t in cap))
                assert float(one.detach()) == pytest.approx(float(blockwise[i, c]), rel=1e-9, abs=1e-10), (i, c)
