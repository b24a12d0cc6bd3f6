"""BUTD checkpoints saved by detectron2 <= 0.2, which kept the RPN's cell anchors as a buffer
(``proposal_generator.anchor_generator.cell_anchors.0``): accepted when the buffer holds the anchors
the detector computes (then dropped), refused with one clear error when it holds others."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vsekit.extract import butd, butd_model, butd_select as sel  # noqa: E402

KEY = "proposal_generator.anchor_generator.cell_anchors.0"
# py-faster-rcnn's generate_anchors(scales=(4, 8, 16, 32)), ratio 0.5 rows, by hand:
# ws = round(sqrt(256 / 0.5)) = 23, hs = round(23 * 0.5) = 12, centre 7.5, w = 23 s, h = 12 s
RATIO_HALF = [[7.5 - (23 * s - 1) / 2, 7.5 - (12 * s - 1) / 2, 7.5 + (23 * s - 1) / 2, 7.5 + (12 * s - 1) / 2]
              for s in (4, 8, 16, 32)]


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


def synthetic_checkpoint(anchors):
    """Every key of the table (stride-0 constant tensors: a small file) plus the anchor buffer."""
    state = {k: torch.full((1,), float(i + 1)).expand(shape)
             for i, (k, shape) in enumerate(butd_model.checkpoint_table().items())}
    state["module." + KEY] = anchors
    return state


def test_the_computed_anchors_are_generate_anchors():
    assert sel.base_anchors()[:4].tolist() == RATIO_HALF


def test_a_detectron2_0_2_file_with_the_same_anchors_loads(tmp_path):
    anchors = torch.tensor(sel.base_anchors(), dtype=torch.float32)
    path = tmp_path / "bua-caffe-frcn-r101_with_attributes-k36.pth"
    torch.save({"model": synthetic_checkpoint(anchors)}, path)
    m = butd_model.build_empty("cpu")
    butd.load_checkpoint(m, path)
    got = m.state_dict()
    assert KEY not in got and set(got) == set(butd_model.checkpoint_table())
    assert bool((got["roi_heads.box_predictor.attr_linear2.bias"] != 0).all())


@pytest.mark.parametrize("change", [
    lambda a: a[[1, 0, *range(2, 12)]],                 # another order (the RPN channels would mismatch)
    lambda a: a - 7.5,                                    # centred at 0 (detectron2's default generator)
    lambda a: a[:9],                                      # three scales only
])
def test_a_file_with_other_anchors_is_refused(tmp_path, change):
    anchors = change(torch.tensor(sel.base_anchors(), dtype=torch.float32))
    path = tmp_path / "other.pth"
    torch.save(synthetic_checkpoint(anchors), path)
    with pytest.raises(ValueError, match=rf"other.pth: its {KEY} .* is not the anchors this detector computes"):
        butd.load_checkpoint(butd_model.build_empty("meta"), path)
