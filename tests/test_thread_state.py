"""The caller's thread-local state reaches every worker: ``with torch.autocast(...)`` around a
step casts in every stage, as if the step ran in the caller's thread."""

from __future__ import annotations

import threading
import warnings

import optree
import pytest
import torch
from models import block, mlp_params, mse, whole_batch

import fpipe
from fpipe._runtime import workers
from fpipe._runtime.instructions import span_name
from fpipe.schedules import gpipe, one_f_one_b, zero_bubble

BF16 = dict(rtol=2e-2, atol=2e-2)


def data(n=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)


@pytest.mark.parametrize("schedule", [gpipe(chunks=4), one_f_one_b(chunks=4, remat="always"),
                                      zero_bubble(chunks=4)])
def test_autocast_around_a_step_casts_in_every_stage(schedule):
    """Before: stage 1 ran in a worker without autocast and failed on stage 0's bfloat16
    output (``expected m1 and m2 to have the same dtype``)."""
    dtypes = {}

    def recording(s):
        def stage(p, x):
            h = x @ p["w"]  # what autocast casts
            dtypes[s, threading.current_thread().name] = h.dtype
            return torch.tanh(h + p["b"])
        return stage

    stages = [recording(s) for s in range(3)]
    params = mlp_params(3, dtype=torch.float32)
    x, target = data()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_loss, expected_grads = whole_batch(stages, params, x, target, mse)
    dtypes.clear()
    with fpipe.pipeline(stages, params, schedule=schedule, loss_fn=mse) as pipe:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, grads = pipe.value_and_grad(x, target)
            pipe(x)
        assert set(dtypes.values()) == {torch.bfloat16}
        assert len({name for _, name in dtypes}) == 3  # on three threads
        dtypes.clear()
        pipe(x)  # outside autocast, nothing is carried
        assert set(dtypes.values()) == {torch.float32}
    torch.testing.assert_close(loss, expected_loss, **BF16)
    for g, e in zip(optree.tree_leaves(grads), optree.tree_leaves(expected_grads)):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, e, **BF16)


def test_the_module_face_under_autocast():
    """``fpipe.GPipe``: the forward under autocast, ``backward()`` outside it, as torch's AMP
    recipe has it; the recomputes run under the forward's autocast state."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    reference = torch.nn.Sequential(*[torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                      torch.nn.Linear(8, 8)])
    reference.load_state_dict(layers.state_dict())
    model = fpipe.GPipe(layers, balance=[2, 1], chunks=4, checkpoint="always")
    x, target = data()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
        y_ref = reference(x)
    assert y.dtype == torch.bfloat16
    torch.nn.functional.mse_loss(y.float(), target).backward()
    torch.nn.functional.mse_loss(y_ref.float(), target).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **BF16)


def test_the_readme_bf16_snippet_runs_as_written():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    text = (root / "README.md").read_text()
    example = re.search(r"## Example\n\n```python\n(.*?)```", text, re.S).group(1)
    page = (root / "docs" / "api-overview.md").read_text()  # README's section until issue 27
    section = page[page.index("## Mixed precision"):page.index("## Optimizers")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    for code in blocks:
        exec(compile(code, "README.md", "exec"), namespace)


def test_a_training_step_under_no_grad_still_differentiates():
    """As ``torch.func.grad`` does: the caller's grad mode does not switch the step's own
    differentiation off (and a forward-only call keeps no graph either way)."""
    params = mlp_params(2)
    x, target = (t.double() for t in data())
    expected_loss, expected_grads = whole_batch([block] * 2, params, x, target, mse)
    with fpipe.pipeline([block] * 2, params, schedule=gpipe(chunks=4), loss_fn=mse) as pipe:
        with torch.no_grad():
            loss, grads = pipe.value_and_grad(x, target)
        with torch.enable_grad():
            assert not pipe(x).requires_grad
    torch.testing.assert_close(loss, expected_loss)
    for g, e in zip(optree.tree_leaves(grads), optree.tree_leaves(expected_grads)):
        torch.testing.assert_close(g, e)


def all_threads_config():
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        pytest.skip("this torch's profiler cannot record every thread")


@pytest.mark.parametrize("started", ["before the profiler", "inside it"])
def test_a_step_under_the_profiler(started):
    """A profiled step runs and gives the same result; with the profiler's
    ``profile_all_threads`` (README), every worker's ops and every action's span are recorded,
    whenever the workers' threads started. Three stages: the spans of stage 2 were named
    ``2F0``, which torch's profiler demangles to ``F0``."""
    def last(p, x):
        return torch.sigmoid(x @ p["w"] + p["b"])  # an op only the last stage's worker runs

    config = all_threads_config()
    params = mlp_params(3)
    x, target = (t.double() for t in data())
    with fpipe.pipeline([block, block, last], params, schedule=gpipe(chunks=4),
                        loss_fn=mse) as pipe:
        if started == "before the profiler":
            plain = pipe.value_and_grad(x, target)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning: every worker is recorded
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                        experimental_config=config) as prof:
                profiled = pipe.value_and_grad(x, target)[0]
        if started == "inside it":
            plain = pipe.value_and_grad(x, target)[0]
    assert torch.equal(plain, profiled)
    names = {event.name for event in prof.events()}
    assert {"aten::tanh", "aten::sigmoid"} <= names
    # Every action of the program, on whichever worker ran it, is a span named like it.
    program = pipe.program
    assert {span_name(action) for worker in program.workers for action in worker} <= names


@pytest.mark.parametrize("how", ["record=", "StepLog(bubble=True)"])
def test_a_recorded_step_under_the_profiler_has_every_actions_span(how):
    """A step that records its timeline (``record=``, or every step with
    ``StepLog(bubble=True)``) times each action for the recorder and still opens its
    ``fpipe::`` profiler span: both, not one instead of the other."""
    config = all_threads_config()
    params = mlp_params(3)
    x, target = (t.double() for t in data())
    recorder = fpipe.Recorder()
    with fpipe.pipeline([block] * 3, params, schedule=one_f_one_b(chunks=4),
                        loss_fn=mse) as pipe:
        if how != "record=":
            pipe.step_log = fpipe.StepLog(bubble=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    experimental_config=config) as prof:
            if how == "record=":
                pipe.value_and_grad(x, target, record=recorder)
            else:
                pipe.value_and_grad(x, target)
        assert pipe.last_step.bubble is not None  # the step was recorded
    program = pipe.program
    actions = sorted(span_name(a) for worker in program.workers for a in worker)
    spans = sorted(e.name for e in prof.events() if e.name.startswith("fpipe::"))
    assert spans == actions


def test_a_profiler_of_the_callers_thread_alone_is_said_once(monkeypatch):
    """Without ``profile_all_threads`` torch records only the caller's thread (one worker):
    a warning says how to see them all, once; a one-worker pipeline has nothing to say."""
    monkeypatch.setattr(workers, "_warned_profiler", [])
    params = mlp_params(2)
    x, target = (t.double() for t in data())
    with fpipe.pipeline([block], params[:1], schedule=gpipe(chunks=2), loss_fn=mse) as one, \
            fpipe.pipeline([block, block], params, schedule=gpipe(chunks=2),
                           loss_fn=mse) as two:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                one.value_and_grad(x, target)
            with pytest.warns(RuntimeWarning, match="profile_all_threads=True"):
                two.value_and_grad(x, target)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                two.value_and_grad(x, target)  # said once
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            monkeypatch.setattr(workers, "_warned_profiler", [])
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                        experimental_config=all_threads_config()):
                two.value_and_grad(x, target)
