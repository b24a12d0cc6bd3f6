"""Data-parallel steps on real gloo process groups equal one process's step at the same global batch.

For every model family (VSE++ max and sum of hinges, Order, Order++, the PH/POE curriculum's sum then
max, SEAM, SMAN, SAF, SGR, SGR + T-EMDE), in float64 with dropout off: 2 and 3 ranks (spawned, one
group per rank count running every case; 3 ranks in the slow set) against one process, two Adam steps with clipping — a
global batch of 6 (split evenly) then 5 (an epoch's short last batch: split unevenly). The loss,
every gradient, every parameter and every buffer (batch-norm running statistics included) after
each step equal one process's to rounding, on every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import ddp_harness as H  # noqa: E402

NAMES = list(H.CASES)
BF16 = ["bf16:vse-max", "bf16:saf", "bf16:sgr"]   # float32 weights, bf16 autocast (--precision bf16)


@pytest.fixture(scope="module")
def reference():
    from vsekit.train.distributed import SINGLE

    torch.set_num_threads(1)
    return {name: H.run_case(name, SINGLE) for name in NAMES + BF16}


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)], ids=["2ranks", "3ranks"])
def ranks(request, tmp_path_factory):
    return request.param, H.spawn(request.param, str(tmp_path_factory.mktemp(f"ddp{request.param}")), NAMES + BF16)


def _close(a, b, what, atol=1e-12):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: one has no gradient"
        return
    assert a.shape == b.shape, what
    assert torch.allclose(a, b, rtol=1e-9, atol=atol), f"{what}: max diff {(a - b).abs().max().item():.3g}"


# Weights after an Adam step: a parameter whose gradient is zero up to rounding (a bias before a batch
# norm or a softmax, ~1e-17) moves by lr * g / eps (Adam's eps 1e-8, lr 1e-2): rounding noise of
# 1e-17 becomes ~1e-11, so the states are compared to 1e-9 absolute (the gradients to 1e-12).
STATE_ATOL = 1e-9


def test_every_family_matches_one_process(reference, ranks):
    world, results = ranks
    _match(reference, world, results)
    assert all(res[name]["buckets"] == 1 for res in results for name in NAMES)   # small models: one bucket


def test_bf16_autocast_over_ranks_matches_one_process_to_bf16_rounding(reference, ranks):
    """``--precision bf16`` on ranks: the gathered encodings and score blocks are bf16, the loss and
    the gradient sums float32; one process's loss (both steps) and first gradients to bf16's
    rounding (8 bits of mantissa: a rank's matrix products have other shapes than one process's).
    Each gradient is compared on the scale of the whole gradient: a bias before a batch norm has a
    gradient of zero up to rounding, whose relative error means nothing."""
    world, results = ranks
    for name in BF16:
        ref = reference[name]
        scale = torch.stack([g.norm() for g in ref["grads0"].values() if g is not None]).norm()
        for rank, res in enumerate(results):
            got = res[name]
            for step in range(2):
                where = f"{name} {world} ranks, rank {rank}, step {step + 1}"
                assert got[f"loss{step}"].dtype == torch.float32, where
                assert torch.allclose(got[f"loss{step}"], ref[f"loss{step}"], rtol=2e-2), where
            for k, g in ref["grads0"].items():
                h = got["grads0"][k]
                assert (g is None) == (h is None), (name, rank, k)
                if g is not None:
                    assert h.dtype == torch.float32, (name, k)
                    assert float((h - g).norm()) < 0.02 * float(scale), (name, rank, k, float((h - g).norm()), float(scale))


def test_gradients_reduced_bucket_by_bucket_during_backward_match_one_process(reference, tmp_path):
    """A bucket per parameter: each is all-reduced as soon as backward has produced it, in one
    order on every rank (the parameters' order, last first), whatever order the hooks fire in."""
    results = H.spawn(2, str(tmp_path), NAMES, bucket_mb=1e-9)
    _match(reference, 2, results)
    for name in NAMES:
        n_params = sum(1 for g in reference[name]["grads0"].values())
        assert all(res[name]["buckets"] == n_params > 1 for res in results), name


def _match(reference, world, results):
    for name in NAMES:
        ref = reference[name]
        for rank, res in enumerate(results):
            got = res[name]
            for step in range(2):
                where = f"{name} {world} ranks, rank {rank}, step {step + 1}"
                _close(got[f"loss{step}"], ref[f"loss{step}"], f"{where}: loss")
                assert set(got[f"grads{step}"]) == set(ref[f"grads{step}"])
                for k in ref[f"grads{step}"]:
                    _close(got[f"grads{step}"][k], ref[f"grads{step}"][k], f"{where}: gradient {k}")
                for k in ref[f"state{step}"]:
                    _close(got[f"state{step}"][k], ref[f"state{step}"][k], f"{where}: state {k}", STATE_ATOL)


def test_cases_move_buffers_and_weights(reference):
    """The comparison above is not vacuous: the steps change the weights, and SAF's, SGR's and
    T-EMDE's batch norms move their running statistics away from the initial 0 / 1."""
    for name in NAMES:
        ref = reference[name]
        assert ref["loss0"] > 0, name
        changed = [k for k in ref["state0"] if not torch.equal(ref["state0"][k], ref["state1"][k])]
        assert changed, name
    for name, key in (("saf", "saf_bn.running_mean"), ("sgr", "v_att.local_bn.running_mean"),
                      ("sgr-temde", "temde.image_coder.bn.running_mean")):
        assert ref is not None and reference[name]["state1"][key].abs().max() > 0, (name, key)


def test_unused_parameters_declared_exactly_where_a_step_leaves_a_gradient_out(reference):
    """DDP searches for parameters without a gradient (a graph traversal per step) only for a model
    that declares ``unused_parameters``: the declaration holds exactly for the families whose
    one-process step leaves some gradient None (SMAN's and SGR's biases before a softmax), so the
    others skip the search and the ranks above still match with it."""
    from vsekit.models import create_model

    for name in NAMES:
        unused = [k for k, g in reference[name]["grads0"].items() if g is None]
        assert H.build(name)[0].unused_parameters == bool(unused), (name, unused)
    assert {H.CASES[n][0] for n in NAMES if H.build(n)[0].unused_parameters} == {"sman", "sgr"}
    assert create_model("sman-sim", img_shape=(2, 2, 5), vocab_size=9).unused_parameters is False
