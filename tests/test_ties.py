"""Tied weights (``ties=``): a language-model-like pipeline whose first stage embeds tokens
with a matrix and whose last stage reuses the same matrix as its output head, each stage
holding its own copy. Held to the untied model over ONE shared tensor, differentiated by
``torch.func`` on the whole batch in float64."""

from __future__ import annotations

import optree
import pytest
import torch
import torch.nn.functional as F
from torch.func import grad_and_value

import fpipe
from fpipe.optim import bind_grads, sgd
from fpipe.schedules import gpipe, one_f_one_b, zero_bubble

TIGHT = dict(rtol=1e-10, atol=1e-12)
VOCAB, WIDTH = 7, 4
TIE = [[(0, "wte.weight"), (2, "head.weight")]]


def embed(p, ids):
    return p["wte.weight"][ids]


def block(p, h):
    return torch.tanh(h @ p["w"] + p["b"])


def head(p, h):
    return block(p, h) @ p["head.weight"].T


def mixer(p, h):
    """A middle stage that uses the tied matrix too (a third member)."""
    return block(p, h) + 0.3 * torch.softmax(h @ p["emb"].T, -1) @ p["emb"]


def ce(logits, target):
    return F.cross_entropy(logits, target)


def weights(seed: int = 0, dtype=torch.float64) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"E": torch.randn(VOCAB, WIDTH, generator=g, dtype=dtype),
            "mid": [{"w": torch.randn(WIDTH, WIDTH, generator=g, dtype=dtype) * 0.5,
                     "b": torch.randn(WIDTH, generator=g, dtype=dtype) * 0.1}
                    for _ in range(2)]}


def batch(n: int = 10, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (n,), generator=g),
            torch.randint(0, VOCAB, (n,), generator=g))


def untied(w: dict, three: bool = False) -> list:
    """Per stage, its copy of everything it uses: the embedding matrix cloned per member."""
    E, (m0, m1) = w["E"], w["mid"]
    middle = {**m0, "emb": E.clone()} if three else dict(m0)
    return [{"wte.weight": E.clone()}, middle, {**m1, "head.weight": E.clone()}]


def stages(three: bool = False) -> list:
    return [embed, mixer if three else block, head]


def reference(w: dict, x, target, three: bool = False) -> tuple:
    """Loss and gradients of the model over one shared matrix ``E``: whole batch, no pipeline."""
    def loss(w):
        E, (m0, m1) = w["E"], w["mid"]
        h = embed({"wte.weight": E}, x)
        h = mixer({**m0, "emb": E}, h) if three else block(m0, h)
        return ce(head({**m1, "head.weight": E}, h), target)
    grads, value = grad_and_value(loss)(w)
    return value, grads


def tied_grads(grads: list, three: bool = False) -> list:
    members = [grads[0]["wte.weight"], grads[2]["head.weight"]]
    return members + ([grads[1]["emb"]] if three else [])


SCHEDULES = {"gpipe": gpipe(4), "1f1b": one_f_one_b(4), "zero-bubble": zero_bubble(4)}


@pytest.mark.parametrize("autodiff", ["autograd", "func"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_member_gets_the_shared_gradient(name, autodiff):
    w, (x, target) = weights(), batch()
    pipe = fpipe.pipeline(stages(), untied(w), schedule=SCHEDULES[name], loss_fn=ce,
                          autodiff=autodiff, ties=TIE)
    loss, grads = pipe.value_and_grad(x, target)
    want_loss, want = reference(w, x, target)
    torch.testing.assert_close(loss, want_loss, **TIGHT)
    for member in tied_grads(grads):
        torch.testing.assert_close(member, want["E"], **TIGHT)
    for s, mid in ((1, 0), (2, 1)):
        for key in ("w", "b"):
            torch.testing.assert_close(grads[s][key], want["mid"][mid][key], **TIGHT)


def test_without_ties_each_copy_has_its_own_gradient():
    """The test above can fail: untied, the copies' gradients are the two parts of the sum."""
    w, (x, target) = weights(), batch()
    pipe = fpipe.pipeline(stages(), untied(w), schedule=gpipe(4), loss_fn=ce)
    _, grads = pipe.value_and_grad(x, target)
    _, want = reference(w, x, target)
    a, b = tied_grads(grads)
    assert not torch.allclose(a, want["E"])
    torch.testing.assert_close(a + b, want["E"], **TIGHT)


@pytest.mark.parametrize("autodiff", ["autograd", "func"])
def test_grad_dtype(autodiff):
    """float64 gradients for float32 copies: the sum is taken and returned in float64."""
    w, (x, target) = weights(), batch()
    low = optree.tree_map(lambda t: t.float(), w)
    pipe = fpipe.pipeline(stages(), untied(low), schedule=zero_bubble(4), loss_fn=ce,
                          autodiff=autodiff, grad_dtype=torch.float64, ties=TIE)
    _, grads = pipe.value_and_grad(x, target)
    a, b = tied_grads(grads)
    assert a.dtype == b.dtype == torch.float64
    assert torch.equal(a, b)
    torch.testing.assert_close(a, reference(w, x, target)[1]["E"], rtol=1e-5, atol=1e-6)
    # float64 parameters with grad_dtype take the other summing path; still exact.
    pipe = fpipe.pipeline(stages(), untied(w), schedule=one_f_one_b(4), loss_fn=ce,
                          autodiff=autodiff, grad_dtype=torch.float64, ties=TIE)
    for member in tied_grads(pipe.value_and_grad(x, target)[1]):
        torch.testing.assert_close(member, reference(w, x, target)[1]["E"], **TIGHT)


def test_a_tie_across_three_stages():
    w, (x, target) = weights(), batch()
    tie = [[(0, "wte.weight"), (1, "emb"), (2, "head.weight")]]
    pipe = fpipe.pipeline(stages(three=True), untied(w, three=True), schedule=one_f_one_b(3),
                          loss_fn=ce, ties=tie)
    _, grads = pipe.value_and_grad(x, target)
    want = reference(w, x, target, three=True)[1]["E"]
    members = tied_grads(grads, three=True)
    for member in members:
        torch.testing.assert_close(member, want, **TIGHT)
    # each member its own tensor: an optimiser writing into one leaves the others alone
    assert len({m.data_ptr() for m in members}) == 3


def test_a_member_that_its_stage_does_not_use():
    """A tied leaf its stage never reads has a zero gradient of its own, and gets the sum."""
    w, (x, target) = weights(), batch()
    params = untied(w)
    params[1]["spare"] = w["E"].clone()
    tie = [[(0, "wte.weight"), (1, "spare"), (2, "head.weight")]]
    pipe = fpipe.pipeline(stages(), params, schedule=gpipe(2), loss_fn=ce, ties=tie)
    _, grads = pipe.value_and_grad(x, target)
    want = reference(w, x, target)[1]["E"]
    for member in (*tied_grads(grads), grads[1]["spare"]):
        torch.testing.assert_close(member, want, **TIGHT)


def test_training_keeps_the_copies_equal():
    """Steps with fpipe.optim.sgd (params=) and with torch.optim via bind_grads: the copies
    stay bitwise equal and follow the one-tensor model's training."""
    w, steps = weights(), [batch(10, seed=s) for s in range(3)]
    ref = optree.tree_map(torch.clone, w)
    params = untied(w)
    pipe = fpipe.pipeline(stages(), params, schedule=one_f_one_b(4), loss_fn=ce, ties=TIE)
    for x, target in steps:
        _, grads = pipe.value_and_grad(x, target, params=params)
        params = sgd(params, grads, lr=0.5)
        ref = sgd(ref, reference(ref, x, target)[1], lr=0.5)
        assert torch.equal(params[0]["wte.weight"], params[2]["head.weight"])
        torch.testing.assert_close(params[0]["wte.weight"], ref["E"], **TIGHT)

    params = [optree.tree_map(lambda t: t.clone().requires_grad_(), p) for p in untied(w)]
    leaves = optree.tree_leaves(params)
    optimizer = torch.optim.SGD(leaves, lr=0.1, momentum=0.9, weight_decay=0.01)
    ref = {"E": w["E"].clone().requires_grad_(),
           "mid": [optree.tree_map(lambda t: t.clone().requires_grad_(), m) for m in w["mid"]]}
    ref_optimizer = torch.optim.SGD(optree.tree_leaves(ref), lr=0.1, momentum=0.9,
                                    weight_decay=0.01)
    for x, target in steps:
        _, grads = pipe.value_and_grad(x, target, params=params)
        bind_grads(params, grads)
        optimizer.step()
        bind_grads(ref, reference(optree.tree_map(torch.Tensor.detach, ref), x, target)[1])
        ref_optimizer.step()
        with torch.no_grad():
            assert torch.equal(params[0]["wte.weight"], params[2]["head.weight"])
            torch.testing.assert_close(params[0]["wte.weight"], ref["E"], **TIGHT)


def test_vjp_grads_are_summed():
    w, (x, _) = weights(), batch()
    pipe = fpipe.pipeline(stages(), untied(w), schedule=gpipe(3), ties=TIE)
    y, vjp_fn = pipe.vjp(x)
    cotangent = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(5))
    grads, _ = vjp_fn(cotangent)

    def out(E):
        return head({**w["mid"][1], "head.weight": E}, block(w["mid"][0], E[x]))
    _, ref_vjp = torch.func.vjp(out, w["E"])
    want, = ref_vjp(cotangent)
    for member in tied_grads(grads):
        torch.testing.assert_close(member, want, **TIGHT)


def bad(ties, params=None, match=None, error=ValueError):
    with pytest.raises(error, match=match):
        fpipe.pipeline(stages(), params or untied(weights()), schedule=gpipe(2), loss_fn=ce,
                       ties=ties)


def test_bad_tie_maps():
    bad(3, match="ties must be an iterable", error=TypeError)
    bad("wte.weight", match="ties must be an iterable", error=TypeError)
    bad([0, 2], match="tie 0 must be an iterable", error=TypeError)
    bad([(0, "wte.weight"), (2, "head.weight")], match=r"tie 0 is \(0, 'wte.weight'\), one "
        r"\(stage, name\) pair: ties is a list of ties", error=TypeError)
    bad([[(0, "wte.weight", 1), (2, "head.weight")]], match=r"tie 0: each member must be a "
        r"\(stage, name\) pair", error=TypeError)
    bad([[("0", "wte.weight"), (2, "head.weight")]], match="stage of member", error=TypeError)
    bad([[(0, 1), (2, "head.weight")]], match="name of member", error=TypeError)
    bad([[(0, "wte.weight")]], match=r"tie 0 \(\(0, 'wte.weight'\)\) has 1 member")
    bad([[(0, "wte.weight"), (3, "head.weight")]], match="names stage 3, but the pipeline has "
        "stages 0 to 2")
    bad([[(0, "wte.weight"), (0, "wte.weight")]], match="stage 0's leaf 'wte.weight' is twice")
    bad([[(0, "wte.weight"), (2, "head.weight")], [(2, "head.weight"), (1, "w")]],
        match=r"tie 1 .*stage 2's leaf 'head.weight' is also in tie 0")
    bad([[(0, "wte.weight"), (2, "head.weigth")]],
        match=r"tie 0 .*: stage 2 has no parameter leaf 'head.weigth'; its leaves are 'b', "
              r"'head.weight', 'w'")


def test_tied_copies_must_agree():
    w = weights()
    params = untied(w)
    params[2]["head.weight"] = params[2]["head.weight"][:, :3].clone()
    bad(TIE, params, match=r"stage 0's 'wte.weight' and stage 2's 'head.weight' differ: "
        r"\(7, 4\) torch.float64 against \(7, 3\) torch.float64; tied leaves must have equal "
        r"shape and dtype")
    params = untied(w)
    params[2]["head.weight"] = params[2]["head.weight"].float()
    bad(TIE, params, match="differ: .* torch.float64 against .* torch.float32")
    params = untied(w)
    params[2]["head.weight"] = params[2]["head.weight"] + 1e-12
    bad(TIE, params, match=r"tie 0 .*: stage 0's 'wte.weight' and stage 2's 'head.weight' "
        r"hold different values")


def test_no_ties_changes_nothing():
    w, (x, target) = weights(), batch()
    for ties in (None, []):
        pipe = fpipe.pipeline(stages(), untied(w), schedule=gpipe(2), loss_fn=ce, ties=ties)
        _, grads = pipe.value_and_grad(x, target)
        assert not torch.equal(grads[0]["wte.weight"], grads[2]["head.weight"])


# -- fpipe.distributed ---------------------------------------------------------------------------


def shared_reference(stage_fns, params, ties, steps, lr):
    """Per step, the loss and gradients of the model in which each tie's leaves are ONE
    tensor (its first member's), whole batch, then an SGD step on it:
    ``[(loss, per tie its gradient, grads of the other leaves)]``."""
    def loss(shared, ps, x, target):
        ps = [dict(p) for p in ps]
        for tie, value in zip(ties, shared):
            for s, name in tie:
                ps[s][name] = value
        h = x
        for fn, p in zip(stage_fns, ps):
            h = fn(p, h)
        return ce(h, target)

    shared, found = [params[s][name] for (s, name), *_ in ties], []
    for x, target in steps:
        (tied, grads), value = grad_and_value(loss, argnums=(0, 1))(shared, params, x, target)
        found.append((value, tied, grads))
        shared = sgd(shared, tied, lr)
        params = sgd(params, grads, lr)
    return found


@pytest.fixture(scope="module")
def distributed():
    from distributed_ranks import spawn
    results, codes = spawn("ties", 2, timeout=120)
    assert codes == [0, 0], results
    for result in results:
        assert "crash" not in result, result["crash"]
    return results


@pytest.mark.parametrize("n_stages", [2, 4], ids=["across-ranks", "same-rank"])
def test_distributed_ties(distributed, n_stages):
    from distributed_ranks import TIE_LR, tied_case
    stages, full, tie, schedule, steps = tied_case(n_stages)
    want = shared_reference(stages, full, tie, steps, TIE_LR)
    tied = {(s, name) for members in tie for s, name in members}
    for step, (loss, shared, grads) in enumerate(want):
        found = {}
        for rank in (0, 1):
            got_loss, got = distributed[rank][n_stages][step]
            torch.testing.assert_close(got_loss, loss, **TIGHT)
            found.update(got)
        assert sorted(found) == list(range(n_stages))
        for s in range(n_stages):
            for key in set(found[s]) - {name for stage, name in tied if stage == s}:
                torch.testing.assert_close(found[s][key], grads[s][key], **TIGHT)
        for members, value in zip(tie, shared):
            for s, name in members:  # every copy: the shared gradient, the very same bits
                torch.testing.assert_close(found[s][name], value, **TIGHT)
                assert torch.equal(found[s][name], found[members[0][0]][members[0][1]])


def test_distributed_vjp_ties(distributed):
    from distributed_ranks import tied_case
    stages, full, tie, _, ((x, _), _) = tied_case(2)
    cotangent = torch.randn(9, VOCAB, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(13))

    def out(E):
        return stages[1]({**full[1], "head.weight": E}, stages[0]({**full[0],
                                                                    "wte.weight": E}, x))
    want, = torch.func.vjp(out, full[0]["wte.weight"])[1](cotangent)
    torch.testing.assert_close(distributed[0]["vjp"][0]["wte.weight"], want, **TIGHT)
    torch.testing.assert_close(distributed[1]["vjp"][1]["head.weight"], want, **TIGHT)


def test_distributed_bad_ties_raise_on_every_rank(distributed):
    for rank in (0, 1):
        kind, name, message = distributed[rank]["renamed"]
        assert (kind, name) == ("error", "ValueError")
        assert message.startswith("rank 1: tie 0 ((0, 'wte.weight'), (1, 'head.weight')): "
                                  "stage 1 has no parameter leaf 'head.weight'")
        kind, name, message = distributed[rank]["narrow"]
        assert (kind, name) == ("error", "PlacementError")
        assert "stage 0's 'wte.weight' (rank 0) is trained, (7, 4) torch.float64" in message
        assert "stage 1's 'head.weight' (rank 1) trained, (7, 3) torch.float64" in message
        kind, name, message = distributed[rank]["maps"]
        assert (kind, name) == ("error", "ValueError")
        assert "rank 0 and rank 1 were given different tie maps" in message
        kind, name, message = distributed[rank]["apart"]
        assert (kind, name) == ("error", "ValueError")
        assert message.startswith("tie 0 ((0, 'wte.weight'), (1, 'head.weight')): its copies "
                                  "on ranks [0, 1] hold different values")
    said = {distributed[rank]["frozen"] for rank in (0, 1)}
    assert len(said) == 1  # one error, alike on both ranks
    kind, name, message = said.pop()
    assert (kind, name) == ("error", "PlacementError")
    assert message.startswith("tie 0 ((0, 'wte.weight'), (1, 'head.weight')): stage 0's "
                              "'wte.weight' (rank 0) is trained, (7, 4) torch.float64 with "
                              "torch.float64 gradients, stage 1's 'head.weight' (rank 1) "
                              "frozen, (7, 4) torch.float64")
    assert "trained or frozen alike" in message and "no step was run" in message
