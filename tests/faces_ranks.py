"""The scenarios of tests/test_faces.py, written once for both faces: :func:`run` takes a
``build`` (the pipeline's constructor) and an ``args`` (what this caller passes as ``x`` and
``target``), so the parent runs them through ``fpipe.pipeline`` and the ranks through
``fpipe.distributed.pipeline``; each outcome is ``("ok", result)`` or ``("error", type,
message)``."""

from __future__ import annotations

import torch
from distributed_ranks import _outcome, data
from models import block, mlp_params, mse
from torch import nn

import fpipe.distributed as fdist
from fpipe.schedules import one_f_one_b, zero_bubble_v


def cursed(p, x):
    """A stage that raises on a batch holding a sample of value 99."""
    if (x == 99).any():
        raise ValueError("sample 99 is cursed")
    return block(p, x)


def run(build, args, params_of) -> dict:
    """Every scenario, in an order where the ones that stop a distributed pipeline come last.
    ``params_of(list)`` turns one pytree per stage into what ``build`` takes."""
    full, x, target = mlp_params(2), *data(4, 8, seed=40)
    out = {}
    with build([block, block], params_of(full), loss_fn=mse) as pipe:
        out["ok"] = _outcome(lambda: pipe.value_and_grad(*args(x, target)))
        out["call"] = _outcome(lambda: pipe(args(x, None)[0]))
        bad = params_of([{"w": p["w"]} for p in full])
        out["structure"] = _outcome(lambda: pipe.value_and_grad(*args(x, target), params=bad))
        out["small"] = _outcome(lambda: pipe.value_and_grad(*args(x[:1], target[:1])))
        nan = target.clone()
        nan[3] = float("nan")
        out["nonfinite"] = _outcome(lambda: pipe.value_and_grad(*args(x, nan)))
        with torch.inference_mode():
            out["inference mode"] = _outcome(lambda: pipe.value_and_grad(*args(x, target)))
        out["after"] = _outcome(lambda: pipe.value_and_grad(*args(x, target)))
    with build([block, block], params_of(full)) as pipe:
        out["no loss"] = _outcome(lambda: pipe.value_and_grad(*args(x, target)))
    single = params_of(mlp_params(2, dtype=torch.float32))
    with build([block, block], single, loss_fn=mse, grad_dtype=torch.float64) as pipe:
        out["grad_dtype"] = _outcome(lambda: pipe.value_and_grad(*args(x.float(),
                                                                      target.float())))
    out["no stages"] = _outcome(lambda: build([], params_of([]), loss_fn=mse))
    with build([block, block], params_of(full), loss_fn=mse) as pipe:
        out["target"] = _outcome(lambda: pipe.value_and_grad(*args(x, target[:3])))
        out["target after"] = _outcome(lambda: pipe.value_and_grad(*args(x, target)))
        out["no input"] = _outcome(lambda: pipe.value_and_grad(None, args(x, target)[1]))
        out["no input after"] = _outcome(lambda: pipe.value_and_grad(*args(x, target)))
        ragged = {"a": x, "b": x[:3]}  # refused before any stage sees it
        out["ragged input"] = _outcome(lambda: pipe.value_and_grad(*args(ragged, target)))
        out["unbatched target"] = _outcome(lambda: pipe.value_and_grad(*args(x, {"t": 3.0})))
        out["bad batch after"] = _outcome(lambda: pipe.value_and_grad(*args(x, target)))
    out.update(idioms(build, args, params_of, x, target))
    cursed_x = x.clone()
    cursed_x[2, 0] = 99
    with build([cursed, block], params_of(full), loss_fn=mse) as pipe:
        out["raises"] = _outcome(lambda: pipe.value_and_grad(*args(cursed_x, target)))
    return out


def idioms(build, args, params_of, x, target) -> dict:
    """A model cut by from_sequential: a gradient hook registered on the model's parameter
    after the cut, then the other layer frozen in the model after a step; and a cut with a
    tie given without it."""
    from fpipe.stages import from_modules, from_sequential

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 8))).double()
    s = from_sequential(model, [1, 1], stateful=False)
    mask = (torch.arange(64).reshape(8, 8) % 3 != 0).double()
    model[0].weight.register_hook(lambda g: g * mask)
    out = {}
    with build(s.stages, params_of(s.params), loss_fn=mse) as pipe:
        out["hooked"] = _outcome(lambda: pipe.value_and_grad(*args(x, target)))
        model[1].requires_grad_(False)
        out["frozen later"] = _outcome(lambda: pipe.value_and_grad(*args(x, target)))
    shared = nn.Linear(8, 8).double()
    tied = from_modules([shared, nn.Sequential(nn.Tanh(), shared)], stateful=False)
    out["forgotten tie"] = _outcome(lambda: build(tied.stages, params_of(tied.params),
                                                  loss_fn=mse))
    return out


def faces(rank: int, world: int) -> dict:
    """:func:`run` on two ranks, worker ``w`` holding stage ``w``."""
    schedule = one_f_one_b(chunks=2)

    def build(stages, params, **options):
        return fdist.pipeline(stages, params, schedule=schedule, timeout=20, **options)

    def args(x, target):
        return x if rank == 0 else None, target if rank == 1 else None

    return run(build, args, lambda trees: {s: t for s, t in enumerate(trees) if s == rank})


def v_target(rank: int, world: int) -> dict:
    """A V-shaped pipeline (rank 0 holds stage 0 and the last stage, so the input and the
    target): targets whose batch differs from the input's, then a good step."""
    schedule = zero_bubble_v(chunks=2)
    held = fdist.my_stages(schedule, 4)
    full, (x, target) = mlp_params(4), data(8, 8, seed=41)
    out = {}
    with fdist.pipeline([block] * 4, {s: full[s] for s in held}, schedule=schedule,
                        loss_fn=mse, timeout=20) as pipe:
        for name, given in (("one", target[:1]), ("six", target[:6]), ("good", target)):
            out[name] = _outcome(lambda given=given: pipe.value_and_grad(
                x if rank == 0 else None, given if rank == 0 else None)[0])
    return out
