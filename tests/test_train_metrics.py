"""Retrieval ranks and metrics on hand-built similarity matrices, the protocols, and blockwise scoring."""

import numpy as np
import pytest

from vsekit.train.evaluation import (
    average_metrics, evaluate_protocol, format_table, metrics_from_ranks, protocol_folds,
)

# three images with 4, 5 and 6 captions
CAP_IMG = np.array([0] * 4 + [1] * 5 + [2] * 6)


def brute_ranks(S, cap_img):
    """Independent reference: sort every query's candidates, ties placed against the query."""
    n_img, n_cap = S.shape
    i2t = []
    for i in range(n_img):
        gts = np.flatnonzero(cap_img == i)
        best = S[i, gts].max()
        others = [c for c in range(n_cap) if cap_img[c] != i]
        i2t.append(sum(S[i, c] >= best for c in others))
    t2i = []
    for c in range(n_cap):
        t2i.append(sum(S[j, c] >= S[cap_img[c], c] for j in range(n_img) if j != cap_img[c]))
    return np.array(i2t), np.array(t2i)


def hand_matrix():
    S = np.full((3, 15), -1.0)
    S[0, :4] = [0.1, 0.3, 0.9, 0.2]          # image 0: best caption 2 (0.9)
    S[0, 5], S[0, 10] = 0.95, 0.9            # one caption above, one tie → rank 2
    S[1, 4:9] = [0.8, 0.1, 0.0, 0.2, 0.3]    # image 1: best 0.8, nothing above → rank 0
    S[2, 9:] = [0.5, 0.4, 0.1, 0.0, 0.2, 0.3]  # image 2: best 0.5
    S[2, 0], S[2, 1], S[2, 2] = 0.6, 0.7, 0.5  # two above and a tie → rank 3
    return S


def test_hand_built_ranks_and_metrics():
    S = hand_matrix()
    i2t, t2i = ranks_from_matrix(S, CAP_IMG)
    assert i2t.tolist() == [2, 0, 3]
    # captions 0, 1 of image 0 are beaten by image 2 (0.6 > 0.1, 0.7 > 0.3); caption 2 ties (0.5 < 0.9: no)
    assert t2i[:4].tolist() == [1, 1, 0, 0]
    # caption 5 (image 1, score 0.1) loses to image 0 (0.95); caption 10 (image 2, 0.4) loses to image 0 (0.9)
    assert t2i[5] == 1 and t2i[10] == 1
    ref_i2t, ref_t2i = brute_ranks(S, CAP_IMG)
    assert i2t.tolist() == ref_i2t.tolist() and t2i.tolist() == ref_t2i.tolist()
    m = metrics_from_ranks(i2t, t2i)
    assert m["i2t_r1"] == pytest.approx(100 / 3)
    assert m["i2t_r5"] == m["i2t_r10"] == 100.0
    assert m["i2t_medr"] == 3.0                       # floor(median 2) + 1
    assert m["i2t_meanr"] == pytest.approx(5 / 3 + 1)
    assert m["i2t_mrr"] == pytest.approx((1 / 3 + 1 + 1 / 4) / 3)
    assert m["t2i_r1"] == pytest.approx(100 * np.mean(t2i < 1))
    assert m["rsum"] == pytest.approx(sum(m[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in (1, 5, 10)))


def test_median_rank_floors_an_even_median():
    m = metrics_from_ranks(np.array([0, 1, 2, 5]), np.array([0, 0, 3, 4]))
    assert m["i2t_medr"] == 2.0        # median 1.5 → floor 1 → 2
    assert m["t2i_medr"] == 2.0        # median 1.5


def test_ties_count_against_the_query():
    S = np.zeros((3, 15))  # a constant scorer must get the worst ranks, not perfect ones
    i2t, t2i = ranks_from_matrix(S, CAP_IMG)
    assert i2t.tolist() == [11, 10, 9]
    assert t2i.tolist() == [2] * 15
    m = metrics_from_ranks(i2t, t2i)
    assert m["i2t_r1"] == m["t2i_r1"] == m["i2t_r5"] == 0.0


@pytest.mark.parametrize("max_elements", [1, 7, 40, 1 << 20])
def test_blockwise_ranks_equal_the_reference(max_elements):
    rng = np.random.default_rng(0)
    cap_img = rng.permutation(np.repeat(np.arange(12), rng.integers(4, 7, size=12)))  # shuffled order
    S = np.round(rng.normal(size=(12, len(cap_img))), 1)  # rounding makes many ties
    got = ranks_from_matrix(S, cap_img, max_elements=max_elements)
    ref = brute_ranks(S, cap_img)
    assert got[0].tolist() == ref[0].tolist() and got[1].tolist() == ref[1].tolist()


def test_coco_1k_is_the_mean_of_five_folds_computed_separately():
    rng = np.random.default_rng(1)
    counts = rng.integers(4, 7, size=20)
    cap_img = np.repeat(np.arange(20), counts)
    S = rng.normal(size=(20, len(cap_img)))
    S[cap_img, np.arange(len(cap_img))] += 1.0
    scorer = lambda i, c: __import__("torch").as_tensor(S)[i][:, c]  # noqa: E731
    got = evaluate_protocol(scorer, 20, cap_img, "coco-1k")
    folds = []
    for f in range(5):
        imgs = np.arange(4 * f, 4 * f + 4)
        caps = np.flatnonzero(np.isin(cap_img, imgs))
        folds.append(metrics_from_ranks(*brute_ranks(S[np.ix_(imgs, caps)], cap_img[caps] - 4 * f)))
    for key in folds[0]:
        if key != "rsum":
            assert got[key] == pytest.approx(np.mean([f[key] for f in folds])), key
    recalls = [np.mean([f[f"{d}_r{k}"] for f in folds]) for d in ("i2t", "t2i") for k in (1, 5, 10)]
    assert got["rsum"] == pytest.approx(sum(recalls))
    assert len(got["folds"]) == 5
    whole = evaluate_protocol(scorer, 20, cap_img, "coco-5k")
    assert whole == metrics_from_ranks(*brute_ranks(S, cap_img))


def test_protocols_and_table():
    assert [len(f) for f in protocol_folds(5000, "coco-1k")] == [1000] * 5
    assert [len(f) for f in protocol_folds(1000, "1k")] == [1000]
    with pytest.raises(ValueError, match="coco-1k, coco-5k, 1k"):
        protocol_folds(10, "5k")
    m = average_metrics([metrics_from_ranks(np.array([0, 3]), np.array([1, 2]))])
    table = format_table([("run", "1k", m)])
    assert "R@1" in table and "Med r" in table and "rsum" in table and f"{m['rsum']:.1f}" in table


def test_cat_pads_per_word_encodings_of_different_batches():
    """Caption encodings of batches with different longest captions join into one padded tensor."""
    import torch

    from vsekit.train.scoring import cat, take

    a = (torch.ones(2, 3, 4), torch.tensor([[True, True, False], [True, True, True]]))
    b = (torch.full((1, 5, 4), 2.0), torch.tensor([[True, True, True, True, True]]))
    words, mask = cat([a, b])
    assert words.shape == (3, 5, 4) and mask.shape == (3, 5)
    assert torch.equal(words[:2, :3], a[0]) and torch.all(words[:2, 3:] == 0)
    assert torch.equal(words[2], b[0][0])
    assert mask.dtype == torch.bool and not mask[:2, 3:].any() and mask[2].all()
    assert torch.equal(take((words, mask), slice(2, 3))[1], b[1])


def ranks_from_matrix(sims, caption_image, **kw):
    """Ranks of an in-memory (n_images, n_captions) similarity matrix, through the evaluation's own
    blockwise ``compute_ranks`` (float64 scores)."""
    import numpy as np
    import torch

    from vsekit.train.evaluation import compute_ranks

    sims_t = torch.as_tensor(np.asarray(sims, dtype=np.float64))
    return compute_ranks(lambda i, c: sims_t[i][:, c], sims_t.shape[0], np.asarray(caption_image), **kw)
