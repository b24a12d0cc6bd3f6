"""Every registered embedding model: output shapes, normalisation, and padding never changes the output."""

import pytest
import torch

from vsekit.train import create_model
from vsekit.models.encoders import GRUTextEncoder, ImageEncoder, SeamTextEncoder

MODELS = ["vse", "order", "seam-e", "seam-c", "seam-g"]
SMALL = {"hops": 3, "att_units": 8, "filters": 5, "gru_dim": 12}
# formula and invariance checks: in float64, where rounding (a padded batch takes other GRU / matmul
# kernels than one caption alone) is far below the tolerances on any CPU and thread count
pytestmark = pytest.mark.usefixtures("float64")


def _model(name):
    torch.manual_seed(0)
    kw = {k: v for k, v in SMALL.items() if name.startswith("seam")}
    return create_model(name, img_shape=(10,), vocab_size=30, embed_dim=16, word_dim=8, **kw).eval()


def _captions():
    tokens = torch.tensor([[5, 6, 7, 8, 9], [4, 11, 0, 0, 0], [12, 0, 0, 0, 0]])
    return tokens, torch.tensor([5, 2, 1])


@pytest.mark.parametrize("name", MODELS)
def test_shapes_and_scores(name):
    model = _model(name)
    img = model.encode_images(torch.randn(4, 10))
    cap = model.encode_captions(*_captions())
    emb = cap[0] if isinstance(cap, tuple) else cap
    assert img.shape == (4, 16) and emb.shape == (3, 16)
    torch.testing.assert_close(img.norm(dim=1), torch.ones(4))
    torch.testing.assert_close(emb.norm(dim=1), torch.ones(3))
    assert model.score(img, cap).shape == (4, 3)
    if name != "vse":  # order embeddings live in the positive orthant
        assert (img >= 0).all() and (emb >= 0).all()


@pytest.mark.parametrize("name", MODELS)
def test_padding_never_changes_the_output(name):
    model = _model(name)
    tokens, lengths = _captions()
    wider = torch.cat([tokens, torch.zeros(3, 4, dtype=torch.long)], dim=1)
    # garbage beyond the true length must be ignored as well as pad tokens
    garbage = wider.clone()
    garbage[1, 2:] = 13
    garbage[2, 1:] = 14
    outs = [model.encode_captions(t, lengths) for t in (tokens, wider, garbage)]
    for out in outs[1:]:
        for a, b in zip(outs[0] if isinstance(outs[0], tuple) else (outs[0],), out if isinstance(out, tuple) else (out,)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # a caption alone gives the same encoding as in a batch
    alone = model.encode_captions(tokens[1:2, :2], lengths[1:2])
    first = outs[0][0] if isinstance(outs[0], tuple) else outs[0]
    torch.testing.assert_close((alone[0] if isinstance(alone, tuple) else alone)[0], first[1], rtol=1e-10, atol=1e-12)


def test_gru_uses_the_state_at_the_true_length():
    torch.manual_seed(0)
    enc = GRUTextEncoder(20, 4, 6)
    tokens = torch.tensor([[3, 4, 5, 0]])
    x = enc.embed(tokens[:, :3])
    _, h = enc.gru(x)
    ref = h[-1] / h[-1].norm(dim=1, keepdim=True)
    torch.testing.assert_close(enc(tokens, torch.tensor([3])), ref)


def test_image_encoder_is_linear_without_bias_and_abs():
    enc = ImageEncoder(5, 3, use_abs=True)
    assert enc.fc.bias is None
    x = torch.randn(2, 5)
    y = x @ enc.fc.weight.t()
    torch.testing.assert_close(enc(x), (y / y.norm(dim=1, keepdim=True)).abs())


def test_seam_c_has_three_attention_modules_and_keeps_length():
    enc = SeamTextEncoder("c", 20, 8, 16, hops=2, att_units=4, filters=5)
    assert len(enc.att) == 3 and enc.conv2.kernel_size == (2,) and enc.conv3.kernel_size == (3,)
    x = torch.randn(2, 7, 8)
    assert enc._conv(enc.conv2, x).shape == (2, 7, 5) and enc._conv(enc.conv3, x).shape == (2, 7, 5)
    with pytest.raises(ValueError, match="e, c, g"):
        SeamTextEncoder("x", 20, 8, 16, hops=2)


def test_unknown_model_lists_choices():
    with pytest.raises(ValueError, match="seam-e"):
        create_model("nope")
