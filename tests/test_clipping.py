"""Clipping a distributed pipeline's gradients by the whole model's norm: ``group=`` sums the
ranks' squares (a rank's own norm would clip each rank by another factor), tie maps written
with lists count a tie once, and the pipeline's ``clip_grad_norm`` needs neither. Checked
against ``torch.nn.utils.clip_grad_norm_`` on the whole model's gradients."""

from __future__ import annotations

import pytest
import torch
from clipping_ranks import GRADS, MAX_NORM
from distributed_ranks import data, spawn
from models import block, mlp_params, mse, whole_batch

TIGHT = dict(rtol=1e-12, atol=1e-14)


def _torch_clipped(leaves: list, max_norm: float) -> tuple[list, torch.Tensor]:
    leaves = [leaf.clone() for leaf in leaves]
    params = [torch.nn.Parameter(torch.zeros_like(leaf)) for leaf in leaves]
    for p, leaf in zip(params, leaves):
        p.grad = leaf
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return [p.grad for p in params], total


def test_clip_grad_norm_over_a_group_of_ranks_and_the_pipeline_s_own():
    results, codes = spawn("clipping_ranks:clipping", 2, timeout=120)
    assert codes == [0, 0], results
    assert all("crash" not in r for r in results), results
    names = ("w", "b")
    whole = [GRADS[r][k] for r in range(2) for k in sorted(names)]
    clipped, norm = _torch_clipped(whole, MAX_NORM)
    untied = [GRADS[0]["b"], GRADS[0]["w"], GRADS[1]["b"]]  # w counted once
    _, tied_norm = _torch_clipped(untied, MAX_NORM)
    x, target = data(4, 8, seed=50)
    _, grads = whole_batch([block, block], mlp_params(2), x, target, mse)
    pipe_clipped, pipe_norm = _torch_clipped(
        [grads[s][k] for s in range(2) for k in sorted(grads[s])], 0.1)
    for rank, result in enumerate(results):
        mine, got = result["group"]
        torch.testing.assert_close(got, norm, **TIGHT)  # the whole model's, on every rank
        for i, k in enumerate(sorted(names)):
            torch.testing.assert_close(mine[rank][k], clipped[2 * rank + i], **TIGHT)
        _, got = result["tied lists"]
        torch.testing.assert_close(got, tied_norm, **TIGHT)
        alone = torch.cat([GRADS[rank]["b"], GRADS[rank]["w"]]).norm()
        torch.testing.assert_close(result["alone"], alone, **TIGHT)
        assert not torch.allclose(alone, norm)  # what a rank's own norm would have clipped by
        mine, got = result["pipeline"]
        torch.testing.assert_close(got, pipe_norm, rtol=1e-10, atol=1e-12)
        for i, k in enumerate(sorted(mine[rank])):
            torch.testing.assert_close(mine[rank][k], pipe_clipped[2 * rank + i],
                                       rtol=1e-10, atol=1e-12)


def test_the_pipeline_takes_the_stages_value_and_its_ties():
    """``fdist.pipeline(s, ...)`` with the ``Stages`` of a tied model and no ``ties=``: the
    tie found by ``from_modules`` is the pipeline's, so each copy's gradient is the sum of
    both (before, forgetting ``ties=s.ties`` let the copies drift apart)."""
    results, codes = spawn("clipping_ranks:stages_value", 2, timeout=120)
    assert codes == [0, 0], results
    assert all("crash" not in r for r in results), results
    (a_stage, a_name), (b_stage, b_name) = results[0]["found"][0]
    assert results[0]["ties"] == results[1]["ties"] == ((tuple(results[0]["found"][0][0]),
                                                         tuple(results[0]["found"][0][1])),)
    first = results[a_stage]["grads"][a_stage][a_name]
    second = results[b_stage]["grads"][b_stage][b_name]
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_load_into_refuses_tied_copies_that_differ():
    from test_saving import Body, TiedLM

    from fpipe.stages import from_modules, load_into

    lm = TiedLM(0)
    s = from_modules([Body(lm), lm.head], root=lm, stateful=False)
    (a_stage, a_name), (b_stage, b_name) = s.ties[0]
    params = [{k: v.detach() + 1.0 for k, v in p.items()} for p in s.params]
    params[b_stage][b_name] = params[b_stage][b_name] + 1e-3  # drifted apart
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    with pytest.raises(ValueError, match=f"stage {a_stage}'s '.*' and stage {b_stage}'s "
                                         f"'.*' are copies of one tensor of the model"):
        load_into(lm, params, names=s.names)
    for k, v in lm.state_dict().items():
        assert torch.equal(v, before[k]), k  # nothing written
    params[b_stage][b_name] = params[a_stage][a_name].clone()
    load_into(lm, params, names=s.names)
    assert torch.equal(lm.head.weight, params[a_stage][a_name])
    assert torch.equal(lm.hidden.weight, params[0]["hidden.weight"])
