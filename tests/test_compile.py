"""``torch.compile``d stages give the gradients of uncompiled ones, with every schedule the
driver runs, and an uneven last micro-batch costs no recompile.

Most tests compile with the ``aot_eager`` backend, which captures the same graphs through
dynamo and AOTAutograd as the default one but skips code generation (minutes on 2 CPU cores
for the whole matrix); one test runs the default inductor backend.
"""

from __future__ import annotations

import pytest
import torch
from models import TIGHT, assert_trees_close, block, mlp_params, mse, whole_batch
from torch._dynamo.testing import CompileCounterWithBackend

import fpipe
from fpipe.schedules import Program, gpipe, one_f_one_b

SPLIT_BACKWARD = Program([["0F0", "0F1", "0F2", "0I2", "0I1", "0I0", "0W0", "0W1", "0W2"],
                          ["1F0", "1I0", "1F1", "1I1", "1F2", "1I2", "1W2", "1W1", "1W0"]],
                         n_stages=2, n_microbatches=3)


@pytest.fixture
def counter():
    """A fresh dynamo cache and a backend that counts the graphs it compiles."""
    torch._dynamo.reset()
    yield CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()


def batch(n: int = 10):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, 8, generator=g, dtype=torch.float64),
            torch.randn(n, 8, generator=g, dtype=torch.float64))


# Graphs: one per (grad mode, whether the input requires grad) the compiled stages meet. Stage
# 0's input never requires grad, stage 2's does in training; a forward that will be recomputed
# runs without grad.
@pytest.mark.parametrize("schedule, graphs", [(gpipe(chunks=4), 3),
                                              (gpipe(chunks=3, remat="never"), 2),
                                              (one_f_one_b(chunks=4, remat="always"), 3),
                                              (one_f_one_b(chunks=4, remat=frozenset({1})), 2),
                                              (SPLIT_BACKWARD, 1)], ids=str)
def test_compiled_stages_match_uncompiled(counter, schedule, graphs):
    n_stages = schedule.program(2).n_stages if isinstance(schedule, Program) else 3
    params = mlp_params(n_stages)
    compiled = torch.compile(block, backend=counter)
    stages = [compiled, block, compiled][:n_stages]  # compiling is each stage's choice
    x, target = batch()
    expected_loss, expected_grads = whole_batch([block] * n_stages, params, x, target, mse)
    compiles = []
    with fpipe.pipeline(stages, params, schedule=schedule, loss_fn=mse) as pipe:
        for _ in range(2):
            loss, grads = pipe.value_and_grad(x, target)
            torch.testing.assert_close(loss, expected_loss, **TIGHT)
            assert_trees_close(grads, expected_grads)
            compiles.append(counter.frame_count)
    # Really compiled (not silently run eagerly under torch.func), not once per micro-batch
    # size (3, 3, 2, 2), and nothing new in the second step. Two worker threads that meet the
    # same new graph at once may both compile it, hence at most twice the distinct graphs.
    assert graphs <= compiles[0] <= 2 * graphs
    assert compiles[1] == compiles[0]


def test_uneven_last_microbatch_needs_no_recompile(counter):
    """10 samples in 4 chunks are 3, 3, 2, 2: one graph per stage, not one per size (a
    micro-batch of 1 sample is specialised, and would cost one more)."""
    params = mlp_params(2)
    compiled = torch.compile(block, backend=counter)
    x, target = batch(10)
    with fpipe.pipeline([compiled, compiled], params, schedule=gpipe(chunks=4, remat="never"),
                        loss_fn=mse) as pipe:
        pipe.value_and_grad(x, target)
        pipe.value_and_grad(*batch(9))  # a smaller last batch of an epoch: 3, 2, 2, 2
    assert counter.frame_count == 2  # stage 0 (input without grad) and stage 1
    # What fpipe avoids: called on its own, the same function compiles again for a new size.
    torch._dynamo.reset()
    fresh = CompileCounterWithBackend("aot_eager")
    alone = torch.compile(block, backend=fresh)
    alone(params[0], x[:3].clone())
    alone(params[0], x[:2].clone())
    assert fresh.frame_count == 2


def test_compiled_module_stage_with_inductor_matches():
    """Stages from ``from_sequential`` compiled with the default (inductor) backend."""
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    s = fpipe.stages.from_sequential(model, [2, 1], stateful=False)
    stages = [torch.compile(s.stages[0]), s.stages[1]]
    x, target = torch.randn(6, 8), torch.randn(6, 4)
    with fpipe.pipeline(stages, s.params, schedule=one_f_one_b(chunks=3),
                        loss_fn=mse) as pipe:
        loss, grads = pipe.value_and_grad(x, target)
    model.zero_grad()
    expected = mse(model(x), target)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for part, part_grads in zip(s.params, grads):
        for name in part:
            torch.testing.assert_close(part_grads[name], model.get_parameter(name).grad)
    torch._dynamo.reset()


@pytest.mark.parametrize("wrap", ["autocast(compile(f))", "compile(autocast(f))",
                                  "functools.wraps(compile(f))"])
def test_a_wrapped_compiled_stage_runs_compiled(counter, wrap):
    """A compiled function inside a wrapper is still seen as compiled and differentiated so
    that it runs compiled (under torch.func.vjp it ran eagerly, silently: 0 graphs)."""
    import functools

    from fpipe import amp

    def stage(p, x):
        return torch.tanh(x @ p["w"])

    def wrapped(fn):
        @functools.wraps(fn)
        def call(p, x):
            return fn(p, x)
        return call

    stages = {"autocast(compile(f))": amp.autocast(torch.compile(stage, backend=counter)),
              "compile(autocast(f))": torch.compile(amp.autocast(stage), backend=counter),
              "functools.wraps(compile(f))": wrapped(torch.compile(stage, backend=counter))}
    reference = amp.autocast(stage) if "autocast" in wrap else stage
    params = mlp_params(2, dtype=torch.float32)
    x, target = (t.float() for t in batch(8))
    expected_loss, expected_grads = whole_batch([reference] * 2, params, x, target, mse)
    # No remat: every forward of the compiled stage runs under the vjp.
    with fpipe.pipeline([stages[wrap], reference], params,
                        schedule=gpipe(chunks=2, remat="never"), loss_fn=mse) as pipe:
        loss, grads = pipe.value_and_grad(x, target)
    assert counter.frame_count > 0
    tolerance = dict(rtol=2e-2, atol=2e-2) if "autocast" in wrap else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, expected_loss, **tolerance)
    assert_trees_close(grads, expected_grads, **tolerance)
