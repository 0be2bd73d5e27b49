"""Workers run concurrently, each on its own thread, without timing anything."""

from __future__ import annotations

import threading

import pytest
import torch
from models import OnBackward, block, fpipe_workers, mlp_params, mse

import fpipe
from fpipe.schedules import gpipe, one_f_one_b


@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
def test_next_stage_runs_while_the_previous_one_is_busy(make):
    """Stage 0 on micro-batch 1 blocks until stage 1 has run micro-batch 0: a driver that ran
    the workers one after the other would never get there (the wait would time out).

    The first step learns that the stages draw no random numbers (their first calls run
    seeded, holding the CPU generator alone, see fpipe._runtime.rng); from then on they share it."""
    started_next = threading.Event()
    threads = {}
    learnt = []

    def stage0(p, x):
        threads[0] = threading.get_ident()
        if x[0, 0] == 1.0 and learnt:  # micro-batch 1, after the first step
            assert started_next.wait(timeout=30), "stage 1 never ran while stage 0 was busy"
        return block(p, x)

    def stage1(p, x):
        threads[1] = threading.get_ident()
        started_next.set()
        return block(p, x)

    x = torch.tensor([0.0, 1.0], dtype=torch.float64)[:, None].repeat(1, 8)
    with fpipe.pipeline([stage0, stage1], mlp_params(2), schedule=make(chunks=2),
                        loss_fn=mse) as pipe:
        pipe.value_and_grad(x, torch.zeros_like(x))
        learnt.append(True)
        started_next.clear()
        pipe.value_and_grad(x, torch.zeros_like(x))
    assert started_next.is_set()
    assert threads[0] != threads[1]


def test_threads_are_started_once_and_stopped_by_close():
    before = fpipe_workers()
    pipe = fpipe.pipeline([block] * 4, mlp_params(4), schedule=gpipe(chunks=4), loss_fn=mse)
    assert not fpipe_workers() - before  # nothing starts before the first step
    x = torch.randn(8, 8, dtype=torch.float64)
    started = None
    for _ in range(5):
        pipe.value_and_grad(x, x)
        pipe(x)
        new = fpipe_workers() - before
        assert len(new) == 3  # the caller's thread is worker 0
        assert started is None or new == started  # the same threads, step after step
        started = new
    pipe.close()
    assert not any(t.is_alive() for t in started)
    pipe(x)  # usable again after close
    assert len(fpipe_workers() - before - started) == 3
    pipe.close()
    assert not fpipe_workers() - before


def test_one_worker_starts_no_thread():
    before = fpipe_workers()
    with fpipe.pipeline([block], mlp_params(1), schedule=gpipe(chunks=4), loss_fn=mse) as pipe:
        pipe.value_and_grad(torch.randn(8, 8, dtype=torch.float64),
                            torch.randn(8, 8, dtype=torch.float64))
        assert not fpipe_workers() - before


def test_garbage_collected_pipeline_stops_its_threads():
    import gc
    before = fpipe_workers()
    pipe = fpipe.pipeline([block] * 3, mlp_params(3), schedule=gpipe(chunks=2), loss_fn=mse)
    pipe(torch.randn(4, 8, dtype=torch.float64))
    started = fpipe_workers() - before
    assert len(started) == 2
    del pipe
    gc.collect()
    assert not any(t.is_alive() for t in started)


def test_one_pipeline_called_from_two_threads_gives_each_its_own_results():
    """A training loop and an evaluation thread on one pipeline: the calls are served one
    after the other, each gets exactly what it would get alone, and nothing hangs."""
    params = mlp_params(3)
    xs = [torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
          for i in range(4)]
    with fpipe.pipeline([block] * 3, params, schedule=one_f_one_b(chunks=4),
                        loss_fn=mse) as pipe:
        alone = {i: (pipe.value_and_grad(x, x), pipe(x)) for i, x in enumerate(xs)}
        failures = []

        def hammer(i):
            try:
                for _ in range(15):
                    (loss, grads), y = pipe.value_and_grad(xs[i], xs[i]), pipe(xs[i])
                    (loss0, grads0), y0 = alone[i]
                    assert torch.equal(loss, loss0) and torch.equal(y, y0)
                    for g, g0 in zip(grads, grads0):
                        assert torch.equal(g["w"], g0["w"]) and torch.equal(g["b"], g0["b"])
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a call hung"
        assert not failures, failures[0]


def test_a_stage_calling_its_own_pipeline_is_refused_not_left_waiting():
    pipes = []

    def calls_back(p, x):
        pipes[0](x)
        return block(p, x)

    with fpipe.pipeline([block, calls_back], mlp_params(2), schedule=gpipe(chunks=2)) as pipe:
        pipes.append(pipe)
        with pytest.raises(RuntimeError, match="would wait for itself"):
            pipe(torch.randn(4, 8, dtype=torch.float64))


def test_the_backward_half_runs_the_last_stage_in_the_calling_thread():
    """``fpipe.GPipe``'s backward runs on autograd's thread for the output's device; every vjp
    on that device needs that thread, so the last stage's worker must run there rather than
    wait for it (on CUDA the wait would be for itself: a hang)."""
    seen = {}

    def last(p, x):
        return OnBackward.apply(block(p, x),
                                lambda grad: seen.update(backward=threading.get_ident()))

    with fpipe.pipeline([block, last], mlp_params(2), schedule=gpipe(chunks=2),
                        autodiff="autograd") as pipe:
        y, vjp_fn = pipe.vjp(torch.randn(4, 8, dtype=torch.float64))
        caller = {}

        def backward():
            caller["id"] = threading.get_ident()
            vjp_fn(torch.ones_like(y))

        thread = threading.Thread(target=backward)
        thread.start()
        thread.join(timeout=60)
    assert seen["backward"] == caller["id"]


def test_more_workers_than_cores_is_said_once_where_the_pipeline_is_built(monkeypatch):
    import warnings

    from fpipe.schedules import colocate

    monkeypatch.setattr("fpipe._runtime.workers.cores", lambda: 2)
    with pytest.warns(fpipe.OversubscriptionWarning, match="3 worker threads.*2 CPU cores") \
            as caught:
        pipe = fpipe.pipeline([block] * 3, mlp_params(3), schedule=gpipe(2), loss_fn=mse)
    assert caught[0].filename == __file__  # this line, not fpipe's
    x = torch.randn(4, 8, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at each step
        pipe.value_and_grad(x, x)
        pipe.close()
        # Two workers for three stages fit the cores: nothing to say.
        fpipe.pipeline([block] * 3, mlp_params(3), loss_fn=mse,
                       schedule=colocate(gpipe(2).program(3), [0, 0, 1])).close()
