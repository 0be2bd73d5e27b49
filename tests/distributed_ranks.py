"""What each spawned rank runs in tests/test_distributed.py, and the harness that spawns them.

Ranks join a gloo group on 127.0.0.1 whose store the parent process hosts, so the store outlives
any rank. Each scenario returns plain data (tensors, numbers, error fields) that the parent
checks against the single-process driver and whole-batch ``torch.func``.

Ranks are forked from a server that has imported torch once (``forkserver``): a fresh
interpreter spends about 4.5 CPU seconds importing torch and the ``torch.func`` machinery, most
of what a small scenario costs, and the suite starts about a hundred ranks. A forked rank then
ends as an interpreter does (it waits for its non-daemon threads, then runs the ``atexit``
hooks) and with the parent's environment as it was at the spawn. ``fresh=True`` starts fresh
interpreters instead (``spawn``), for a scenario about the interpreter's own exit.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import pickle
import threading
import time
import traceback
from datetime import timedelta

import patience
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from models import block, mlp_params, mse

import fpipe
import fpipe.distributed as fdist
from fpipe.errors import where
from fpipe.schedules import Program
from fpipe.stages import skippable

# -- the harness ---------------------------------------------------------------------------------


#: What the fork server imports once for every forked rank (``torch._dynamo``: what the first
#: ``torch.func`` call of a process would load, 2 of its 4.5 CPU seconds). Not fpipe: the server
#: ignores the parent's sys.path (Python 3.11), so it could import another copy than the
#: parent's (scripts/mutants.py's mutated one); each rank imports it as the parent does.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed"]


def spawn(scenario: str, world: int, timeout: float = 60.0, backend: str = "gloo",
          bind_device: bool = False, fresh: bool = False) -> tuple[list, list[int]]:
    """Run ``scenario`` on ``world`` ranks; returns each rank's result (None if it sent none)
    and exit code. Every child is reaped, killed if it outlives ``timeout`` seconds of the
    load-scaled clock (tests/patience.py: healthy ranks on a busy machine are not killed).

    With ``backend="nccl"`` rank ``r`` uses ``cuda:r``; ``bind_device`` passes it as
    ``device_id`` too, which makes NCCL create communicators eagerly. ``fresh``: each rank a
    new interpreter, which exits as a script does (the module's docstring)."""
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=patience.limit(timeout)))
    context = mp.get_context("spawn" if fresh else "forkserver")
    if not fresh:
        context.set_forkserver_preload(PRELOAD)  # read when the server starts, once
    queue = context.SimpleQueue()
    environ = None if fresh else dict(os.environ)
    ranks = [context.Process(target=_main, args=(scenario, rank, world, store.port, queue,
                                                 backend, bind_device, environ),
                             daemon=True) for rank in range(world)]
    for process in ranks:
        process.start()
    patience.join(ranks, timeout)
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()
    results: list = [None] * world
    while not queue.empty():
        rank, payload = queue.get()
        results[rank] = pickle.loads(payload)
    return results, [process.exitcode for process in ranks]


def _main(scenario: str, rank: int, world: int, port: int, queue, backend: str,
          bind_device: bool, environ: dict | None) -> None:
    if environ is not None:  # forked: the server's environment is the one it started with
        os.environ.clear()
        os.environ.update(environ)
    torch.set_num_threads(1)
    # The first torch.func call of a process loads much of torch (seconds on a busy CI
    # machine); do it before the clock of any timeout starts.
    torch.func.vjp(torch.sin, torch.ones(1))[1](torch.ones(1))
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False,
                          timeout=timedelta(seconds=patience.limit(30)))
    options = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        if bind_device:
            options["device_id"] = torch.device("cuda", rank)
    global STORE
    STORE = store
    dist.init_process_group(backend, rank=rank, world_size=world, store=store, **options)
    try:
        result = _scenario(scenario)(rank, world)
    except BaseException:
        result = {"crash": traceback.format_exc()}
    queue.put((rank, pickle.dumps(result)))
    dist.destroy_process_group()  # every group, before the interpreter's teardown
    if environ is not None:  # forked: exit as the interpreter would, which os._exit skips
        threading._shutdown()  # waits for non-daemon threads (a leaked one hangs the rank)
        atexit._run_exitfuncs()


#: This rank's store (the parent's), for scenarios that join a new default group.
STORE = None


def _scenario(name: str):
    """A scenario of this module by name, or ``"module:function"`` of another test module."""
    if ":" not in name:
        return SCENARIOS[name]
    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)


# -- models --------------------------------------------------------------------------------------


def data(n: int, *shape: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, *shape, generator=g, dtype=torch.float64),
            torch.randn(n, *shape, generator=g, dtype=torch.float64))


def embed(p, batch):
    """Dict in, dict out: a float tensor, integer ids and a Python value cross the boundary."""
    h = torch.tanh(batch["x"] @ p["w"]) + p["table"][batch["ids"]]
    return {"h": h, "ids": batch["ids"], "scale": 0.5}


def readout(p, value):
    return (value["h"] * value["scale"] + p["table"][value["ids"]]) @ p["w"]


def tree_params():
    g = torch.Generator().manual_seed(1)
    return [{"w": torch.randn(4, 4, generator=g, dtype=torch.float64),
             "table": torch.randn(5, 4, generator=g, dtype=torch.float64)} for _ in range(2)]


def tree_batch(n: int, length: int, seed: int):
    """Sequences of ``length`` tokens: the length may differ from step to step."""
    g = torch.Generator().manual_seed(seed)
    x = {"x": torch.randn(n, length, 4, generator=g, dtype=torch.float64),
         "ids": torch.randint(0, 5, (n, length), generator=g)}
    return x, torch.randn(n, length, 4, generator=g, dtype=torch.float64)


def interleaved_program() -> Program:
    """Four stages on two ranks, worker 0 holding stages 0 and 2; worker 0 runs micro-batch 1
    first, so rank 1 receives values in another order than it needs them."""
    return Program.parse("""
        worker 0: 0F1 0F0 2F0 2F1 2B0 2B1 0B0 0B1
        worker 1: 1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1
    """)


@skippable(stash=["enc"])
def skip_encode(p, x):
    h = block(p, x)
    return h, {"enc": h}


@skippable(pop=["enc"])
def skip_decode(p, x, skips):
    return block(p, x) + skips["enc"]


def cases(world: int) -> list[tuple]:
    """(name, stages, schedule, steps of (x, target)), the same on every rank and in the parent."""
    n_stages = world
    mlp = [block] * n_stages
    steps_uneven = [data(10, 8, seed=2)]
    steps_shapes = [data(7, 8, seed=3), data(12, 8, seed=4)]
    result = [
        ("gpipe-uneven", mlp, fdist_schedule("gpipe", 4), steps_uneven),
        ("1f1b-shapes", mlp, fdist_schedule("1f1b", 3), steps_shapes),
    ]
    if world == 2:
        result += [
            ("pytree-seqlen", [embed, readout], fdist_schedule("1f1b", 2),
             [tree_batch(6, 5, seed=5), tree_batch(5, 9, seed=6)]),
            ("interleaved", [block] * 4, interleaved_program(), [data(6, 8, seed=7)]),
            ("zero-bubble-v", [block] * 4, fdist_schedule("zbv", 3), [data(7, 8, seed=9)]),
            # DeepSeek's pairs: a forward waits on its rank for its backward's gradient
            ("dual-pipe-v", [block] * 4, fdist_schedule("dualpipev", 5), [data(7, 8, seed=11)]),
        ]
    else:
        result += [
            ("skip", [skip_encode, block, block, skip_decode], fdist_schedule("1f1b", 3),
             [data(9, 8, seed=8)]),
            ("zero-bubble", mlp, fdist_schedule("zb", 5), [data(10, 8, seed=10)]),
        ]
    return result


def fdist_schedule(name: str, chunks: int):
    from fpipe.schedules import dual_pipe_v, gpipe, one_f_one_b, zero_bubble, zero_bubble_v
    makes = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb": zero_bubble, "zbv": zero_bubble_v,
             "dualpipev": dual_pipe_v}
    return makes[name](chunks)


def full_params(name: str, n_stages: int) -> list:
    return tree_params() if name.startswith("pytree") else mlp_params(n_stages)


@contextlib.contextmanager
def recording_p2p():
    """Log every point-to-point message this rank posts as ``(op, peer, group name)``, by
    wrapping the process groups' ``send`` and ``recv``, which fpipe posts its messages on
    (``dist.isend`` and ``dist.irecv`` end there too)."""
    log: list[tuple[str, int, str]] = []
    send, recv = dist.ProcessGroup.send, dist.ProcessGroup.recv

    def logged(op: str, post):
        def call(group, tensors, peer, tag):
            log.append((op, dist.get_global_rank(group, peer), group.group_name))
            return post(group, tensors, peer, tag)
        return call

    dist.ProcessGroup.send, dist.ProcessGroup.recv = logged("send", send), logged("recv", recv)
    try:
        yield log
    finally:
        dist.ProcessGroup.send, dist.ProcessGroup.recv = send, recv


# -- scenarios -----------------------------------------------------------------------------------


def parity(rank: int, world: int) -> dict:
    """Loss, gradients and inference outputs of every case, step by step."""
    out = {}
    for name, stages, schedule, steps in cases(world):
        held = fdist.my_stages(schedule, len(stages))
        full = full_params(name, len(stages))  # a real job would build only its own stages
        with recording_p2p() as log:
            pipe = fdist.pipeline(stages, {s: full[s] for s in held}, schedule=schedule,
                                  loss_fn=mse, timeout=20)
            first = pipe.program.placement[0]
            last = pipe.program.placement[-1]
            results = []
            recorder = fpipe.Recorder()
            for x, target in steps:
                loss, grads = pipe.value_and_grad(x if rank == first else None,
                                                  target if rank == last else None,
                                                  record=recorder)
                y = pipe(x if rank == first else None)
                results.append((loss, grads, y))
        out[name] = results
        out[f"{name}: p2p"] = log
        out[f"{name}: group"] = pipe.group.group_name
        out[f"{name}: recorded"] = [[str(span.action) for span in spans]
                                    for spans in recorder.timeline]
    return out


def _failing_stage(p, x):
    if (x["idx"] == 5).any():
        raise ValueError("sample 5 is cursed")
    return {"h": block(p, x["h"]), "idx": x["idx"]}


def _dying_stage(p, x):
    if (x["idx"] == 5).any():
        os._exit(3)
    return {"h": block(p, x["h"]), "idx": x["idx"]}


def _silent_stage(p, x):
    """Alive but silent: stalls far past the pipeline's 5 s timeout, then goes on."""
    if (x["idx"] == 5).any():
        time.sleep(12)
    return {"h": block(p, x["h"]), "idx": x["idx"]}


def _plain_stage(p, x):
    return {"h": block(p, x["h"]), "idx": x["idx"]}


def _head_loss(y, target):
    return mse(y["h"], target)


def _failure(rank: int, world: int, bad) -> dict:
    stages = [_plain_stage] * world
    stages[2] = bad
    schedule = fdist_schedule("1f1b", 4)
    full = mlp_params(world)
    pipe = fdist.pipeline(stages, {s: full[s] for s in fdist.my_stages(schedule, world)},
                          schedule=schedule, loss_fn=_head_loss, timeout=5)
    x, target = data(8, 8, seed=8)
    started = time.monotonic()
    try:
        pipe.value_and_grad({"h": x, "idx": torch.arange(8)} if rank == 0 else None,
                            target if rank == world - 1 else None)
    except Exception as exc:
        elapsed = time.monotonic() - started
        try:
            pipe.value_and_grad(None, None)
            again = None
        except Exception as second:
            again = type(second).__name__
        at = where(exc)
        return {"type": type(exc).__name__, "message": str(exc), "elapsed": elapsed,
                "rank": getattr(exc, "rank", None), "stage": getattr(exc, "stage", None),
                "microbatch": getattr(exc, "microbatch", None), "again": again,
                "where": None if at is None else tuple(at), "at": time.time()}
    return {"type": None}


def stage_raises(rank: int, world: int) -> dict:
    return _failure(rank, world, _failing_stage)


def rank_dies(rank: int, world: int) -> dict:
    return _failure(rank, world, _dying_stage)


def counting(p, state, x):
    """A stateful stage: counts the samples it saw and sums its inputs."""
    return block(p, x), {"seen": state["seen"] + x.shape[0], "total": state["total"] + x.sum(0)}


def fresh_state(n_stages: int) -> list:
    return [{"seen": 0, "total": torch.zeros(8, dtype=torch.float64)} for _ in range(n_stages)]


def stateful_case():
    """(stages, schedule, steps) of the stateful scenario, the same on every rank."""
    from fpipe.schedules import one_f_one_b
    return [counting] * 2, one_f_one_b(chunks=3, remat="always"), [data(7, 8, seed=9),
                                                                   data(5, 8, seed=10)]


def stateful(rank: int, world: int) -> dict:
    """Two training steps and an inference call, the state threaded through by the caller."""
    stages, schedule, steps = stateful_case()
    held = fdist.my_stages(schedule, len(stages))
    full, state = mlp_params(len(stages)), fresh_state(len(stages))
    state = {s: state[s] for s in held}
    pipe = fdist.pipeline(stages, {s: full[s] for s in held}, schedule=schedule, loss_fn=mse,
                          state=state, timeout=20)
    results = []
    for x, target in steps:
        loss, grads, state = pipe.value_and_grad(x if rank == 0 else None,
                                                 target if rank == world - 1 else None,
                                                 state=state)
        results.append((loss, grads, state))
    y, state = pipe(steps[0][0] if rank == 0 else None, state=state)
    return {"steps": results, "y": y, "state": state}


def rank_stalls(rank: int, world: int) -> dict:
    return _failure(rank, world, _silent_stage)


def large_case():
    """(stages, schedule, steps) with activations far beyond NCCL's 4 MiB buffers: 1F1B on
    two ranks, 8 MiB per micro-batch, then 9 MiB ones of a longer sequence."""
    return [block, block], fdist_schedule("1f1b", 3), [data(96, 4096, 8, seed=11),
                                                       data(72, 6144, 8, seed=12)]


def local_steps(stages, schedule, steps) -> list:
    """(loss, grads) of each step in the single-process driver, for the parent to compare."""
    with fpipe.pipeline(stages, mlp_params(len(stages)), schedule=schedule,
                        loss_fn=mse) as local:
        return [local.value_and_grad(x, target) for x, target in steps]


def large(rank: int, world: int, device: str = "cpu") -> dict:
    """Loss and gradients of each step of :func:`large_case` on ``device``, back on the CPU."""
    stages, schedule, steps = large_case()
    held = fdist.my_stages(schedule, len(stages))
    full = mlp_params(len(stages))
    pipe = fdist.pipeline(stages, {s: {k: v.to(device) for k, v in full[s].items()}
                                   for s in held}, schedule=schedule, loss_fn=mse, timeout=60)
    out = []
    for x, target in steps:
        loss, grads = pipe.value_and_grad(x.to(device) if rank == 0 else None,
                                          target.to(device) if rank == world - 1 else None)
        out.append((loss.cpu(), {s: {k: v.cpu() for k, v in g.items()}
                                 for s, g in grads.items()}))
    return {"steps": out, "wire": str(pipe.wire)}


def large_cuda(rank: int, world: int) -> dict:
    return large(rank, world, f"cuda:{rank}")


def concurrent_case():
    return fdist_schedule("1f1b", 2), [data(4, 8, seed=13), data(6, 8, seed=14)]


def concurrent(rank: int, world: int) -> dict:
    """A call from a second thread while a first thread's step is held inside a stage is
    refused; the first call and the next one are unharmed. Then ranks called for different
    things (rank 1 for inference, rank 0 for training) stop with an error, not wrong values."""
    started, release = threading.Event(), threading.Event()

    def held_block(p, x):
        started.set()
        if not release.wait(30):
            raise TimeoutError("never released")
        return block(p, x)

    schedule, steps = concurrent_case()
    full = mlp_params(2)
    pipe = fdist.pipeline([held_block] * 2, {rank: full[rank]}, schedule=schedule,
                          loss_fn=mse, timeout=20)

    def args(x, target):
        return x if rank == 0 else None, target if rank == 1 else None

    first: dict = {}
    thread = threading.Thread(target=lambda: first.update(out=_outcome(
        lambda: pipe.value_and_grad(*args(*steps[0])))))
    thread.start()
    out = {"started": started.wait(20), "refused": _outcome(lambda: pipe(args(*steps[0])[0]))}
    release.set()
    thread.join(30)
    out["first"] = first.get("out")
    out["second"] = _outcome(lambda: pipe.value_and_grad(*args(*steps[1])))
    x = steps[0][0]
    out["mixed"] = _outcome(pipe.value_and_grad, x, None) if rank == 0 else _outcome(pipe, None)
    return out


def _outcome(fn, *args) -> tuple:
    """``("ok", result)`` or ``("error", type name, message)``."""
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return ("error", type(exc).__name__, str(exc))


def options(rank: int, world: int) -> dict:
    """The options ``fpipe.pipeline`` has, on ranks: ``grad_dtype`` (float32 parameters,
    float64 sums) and ``nonfinite`` (a NaN target on micro-batch 1 refused on every rank, and
    the pipeline usable after it; returned as it is with ``"ignore"``)."""
    from fpipe.schedules import one_f_one_b
    schedule = one_f_one_b(chunks=3)
    held = fdist.my_stages(schedule, 2)
    params = {s: p for s, p in enumerate(mlp_params(2, dtype=torch.float32)) if s in held}
    x, target = data(6, 8, seed=13)
    x, target = x.float(), target.float()
    bad = target.clone()
    bad[2] = float("nan")
    pipe = fdist.pipeline([block, block], params, schedule=schedule, loss_fn=mse,
                          grad_dtype=torch.float64, timeout=20)
    first = rank == 0
    last = rank == world - 1
    loss, grads = pipe.value_and_grad(x if first else None, target if last else None)
    result = {"loss": loss, "grads": grads}
    try:
        pipe.value_and_grad(x if first else None, bad if last else None)
    except fpipe.NonFiniteLossError as exc:
        result["refused"] = exc.microbatches
    result["after"] = pipe.value_and_grad(x if first else None, target if last else None)[0]
    ignoring = fdist.pipeline([block, block], params, schedule=schedule, loss_fn=mse,
                              nonfinite="ignore", timeout=20)
    result["ignored"] = ignoring.value_and_grad(x if first else None, bad if last else None)[0]
    return result


def seqlen_case():
    """(schedule name, stages, steps) of the changing-shapes scenario: each step a new sequence
    length (longer, the same again, shorter, longer than ever) and batch size (uneven last
    micro-batches), as a language model trained on batches of varying length sees."""
    shapes = [(7, 5), (7, 9), (7, 9), (8, 3), (6, 12), (7, 4)]
    steps = [data(n, length, 8, seed=20 + i) for i, (n, length) in enumerate(shapes)]
    return [("1f1b", 2), ("zbv", 4)], steps


#: The learning rate of the changing-shapes scenario's SGD.
SEQLEN_LR = 0.1


def seqlen(rank: int, world: int) -> dict:
    """Train with SGD, one step per batch of :func:`seqlen_case`, under each of its schedules:
    each step's loss and gradients, and how many messages this rank sent in it."""
    schedules, steps = seqlen_case()
    out = {}
    for name, n_stages in schedules:
        schedule = fdist_schedule(name, 3)
        held = fdist.my_stages(schedule, n_stages)
        full = mlp_params(n_stages)
        params = {s: full[s] for s in held}
        with recording_p2p() as log:
            pipe = fdist.pipeline([block] * n_stages, params, schedule=schedule, loss_fn=mse,
                                  timeout=20)
            first, last = pipe.program.placement[0], pipe.program.placement[-1]
            results = []
            for x, target in steps:
                before = sum(op == "send" for op, *_ in log)
                loss, grads = pipe.value_and_grad(x if rank == first else None,
                                                  target if rank == last else None,
                                                  params=params)
                sends = sum(op == "send" for op, *_ in log) - before
                results.append((loss, grads, sends))
                params = {s: {k: v - SEQLEN_LR * grads[s][k] for k, v in params[s].items()}
                          for s in held}
        out[name] = results
    return out


def vjp_case():
    """(stages, schedule, x, cotangent, (x, target) of a later step) of the vjp scenario."""
    x, cotangent = data(7, 8, seed=15)
    return [block, block], fdist_schedule("gpipe", 3), x, cotangent, data(5, 8, seed=16)


def vjp(rank: int, world: int) -> dict:
    """A step in two calls: ``pipe.vjp(x)``, then its ``vjp_fn``; what is refused around it;
    a whole step after it; and a schedule that cannot run in two calls."""
    stages, schedule, x, cotangent, (x2, target2) = vjp_case()
    full = mlp_params(2)
    pipe = fdist.pipeline(stages, {rank: full[rank]}, schedule=schedule, loss_fn=mse,
                          timeout=20)
    out = {}
    y, vjp_fn = pipe.vjp(x if rank == 0 else None)
    out["y"] = y
    out["refused"] = _outcome(pipe.value_and_grad, x2 if rank == 0 else None,
                              target2 if rank == 1 else None)
    out["grads"] = vjp_fn(cotangent if rank == 1 else None)
    out["again"] = _outcome(vjp_fn, cotangent if rank == 1 else None)
    out["after"] = pipe.value_and_grad(x2 if rank == 0 else None,
                                       target2 if rank == 1 else None)
    other = fdist.pipeline(stages, {rank: full[rank]}, schedule=fdist_schedule("1f1b", 3),
                           loss_fn=mse, timeout=20)
    out["1f1b"] = _outcome(other.vjp, x if rank == 0 else None)
    return out


def leaving(rank: int, world: int) -> dict:
    """Rank 1 leaves a ``with`` block on its own error, twice: while rank 0 runs another step,
    then while rank 0 closes. Rank 0 must learn it at once (the timeout, 300 s, is far longer
    than the test's), and a new pipeline works after."""
    schedule, full = fdist_schedule("1f1b", 2), mlp_params(2)
    x, target = data(4, 8, seed=33)
    args = (x if rank == 0 else None, target if rank == 1 else None)
    out = {}
    for round_, then in enumerate(("step", "close")):
        try:
            with fdist.pipeline([block, block], {rank: full[rank]}, schedule=schedule,
                                loss_fn=mse, timeout=300) as pipe:
                pipe.value_and_grad(*args)
                if rank == 1:
                    raise KeyError(f"rank 1 gives up in round {round_}")
                if then == "step":
                    pipe.value_and_grad(*args)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            out[then] = (type(exc).__name__, str(exc))
        else:
            out[then] = None
    with fdist.pipeline([block, block], {rank: full[rank]}, schedule=schedule, loss_fn=mse,
                        timeout=20) as pipe:
        out["after"] = pipe.value_and_grad(*args)[0]
    return out


SCENARIOS = {"parity": parity, "leaving": leaving, "stage_raises": stage_raises,
             "rank_dies": rank_dies,
             "rank_stalls": rank_stalls, "stateful": stateful, "large": large,
             "large_cuda": large_cuda, "concurrent": concurrent,
             "options": options, "seqlen": seqlen,
             "vjp": vjp}


# -- checkpoints through torch.distributed.checkpoint (tests/test_saving_distributed.py) ---------
# The checkpoint's directory comes from the parent in FPIPE_SAVING_DIR.

SAVING_BATCHES = [data(8, 6, seed=40 + i) for i in range(4)]


def saving_model(seed: int) -> torch.nn.Sequential:
    """Eight layers of a float64 MLP, from ``seed``: cut 4 ways or 2 ways alike."""
    torch.manual_seed(seed)
    layers: list = []
    for _ in range(4):
        layers += [torch.nn.Linear(6, 6), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers).double()


def saving_schedule(optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """An LR from the step count: a scheduler started over would set another LR."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)


def saving_train(rank: int, balance: list[int], seed: int, steps: range, *,
                 save_at: int | None = None, load: bool = False) -> dict:
    """This rank's stage of ``from_sequential(saving_model(seed), balance)`` trained with AdamW
    and an LR scheduler on ``SAVING_BATCHES[steps]``, the whole training state (scheduler,
    step, generators) saved before step ``save_at`` or loaded first; returns its parameters
    by the model's names, the step counter, and what the generators drew right after the
    save or load."""
    import random

    from fpipe import saving
    from fpipe.optim import bind_grads
    from fpipe.stages import from_sequential

    s = from_sequential(saving_model(seed), balance, stateful=False)
    schedule = fdist_schedule("gpipe", 2)
    params = {st: s.params[st] for st in fdist.my_stages(schedule, len(balance), rank)}
    optimizer = torch.optim.AdamW([t for p in params.values() for t in p.values()], lr=0.01)
    extra = {"scheduler": saving_schedule(optimizer), "step": 0}
    directory = os.environ["FPIPE_SAVING_DIR"]
    out: dict = {}

    def draws() -> tuple:
        return torch.rand(3, dtype=torch.float64), random.random()

    if load:
        torch.manual_seed(100 + rank)  # other generators, restored by the load
        saving.load(directory, params, optimizer=optimizer, extra=extra, rng=True)
        out["draws"] = draws()
    pipe = fdist.pipeline(s.stages, params, schedule=schedule, loss_fn=mse, timeout=20)
    first, last = pipe.program.placement[0], pipe.program.placement[-1]
    for i in steps:
        if i == save_at:
            saving.save(directory, params, optimizer=optimizer, extra=extra, rng=True)
            out["draws"] = draws()
        x, target = SAVING_BATCHES[i]
        _, grads = pipe.value_and_grad(x if rank == first else None,
                                       target if rank == last else None)
        bind_grads(params, grads)
        optimizer.step()
        extra["scheduler"].step()
        extra["step"] += 1
    pipe.close()
    if load:  # an extra entry that differs between ranks: refused on every rank
        out["apart"] = _outcome(lambda: saving.save(os.path.join(directory, "apart"),
                                                    params, extra={"step": rank}))
    out["step"] = extra["step"]
    out["params"] = {name: t.clone() for p in params.values() for name, t in p.items()}
    return out


def save_on_4(rank: int, world: int) -> dict:
    """Four stages, one a rank: four steps, the checkpoint written before the third."""
    return saving_train(rank, [2, 2, 2, 2], seed=0, steps=range(4), save_at=2)


def load_on_2(rank: int, world: int) -> dict:
    """Another cut (3 + 5 layers) of another initialisation: loads, then the last two steps."""
    return saving_train(rank, [3, 5], seed=1, steps=range(2, 4), load=True)


def save_replicas(rank: int, world: int) -> dict:
    """Two stages, each held by two ranks (data-parallel replicas, equal values)."""
    from fpipe import saving

    stage = rank % 2
    g = torch.Generator().manual_seed(stage)
    params = {stage: {"w": torch.randn(64, 64, generator=g, dtype=torch.float64)}}
    saving.save(os.environ["FPIPE_SAVING_DIR"], params, names={stage: {"w": f"layer{stage}.w"}})
    return {}


SCENARIOS.update({"save_on_4": save_on_4, "load_on_2": load_on_2,
                  "save_replicas": save_replicas})

# -- tied weights (tests/test_ties.py) -----------------------------------------------------------

TIE_VOCAB, TIE_WIDTH, TIE_LR = 7, 4, 0.5


def tied_embed(p, ids):
    return block(p, p["wte.weight"][ids])


def tied_head(p, h):
    return block(p, h) @ p["head.weight"].T


def tied_ce(logits, target):
    return torch.nn.functional.cross_entropy(logits, target)


def tied_case(n_stages: int) -> tuple:
    """(stages, untied params, tie map, schedule, steps of (ids, target)): the matrix ``E`` of
    the first stage's embedding reused by the last stage's head, a copy on each (and with two
    stages, their biases tied too)."""
    from fpipe.schedules import zero_bubble_v
    g = torch.Generator().manual_seed(11)
    E = torch.randn(TIE_VOCAB, TIE_WIDTH, generator=g, dtype=torch.float64)
    params = mlp_params(n_stages, TIE_WIDTH, seed=12)
    params[0]["wte.weight"] = E.clone()
    params[-1]["head.weight"] = E.clone()
    stages = [tied_embed, *[block] * (n_stages - 2), tied_head]
    tie = [[(0, "wte.weight"), (n_stages - 1, "head.weight")]]
    if n_stages == 2:  # a second tie over the same ranks: both reduced in one call
        params[1]["b"] = params[0]["b"].clone()
        tie.append([(1, "b"), (0, "b")])
    schedule = fdist_schedule("1f1b", 3) if n_stages == 2 else zero_bubble_v(3)
    steps = [(torch.randint(0, TIE_VOCAB, (9,), generator=g),
              torch.randint(0, TIE_VOCAB, (9,), generator=g)) for _ in range(2)]
    return stages, params, tie, schedule, steps


def ties(rank: int, world: int) -> dict:
    """Tied embedding and head: across the two ranks (2 stages, 1F1B), on one rank (4 stages
    of a V schedule: stages 0 and 3 on rank 0); two steps with an SGD step between; a vjp
    step; and bad tie maps, refused on every rank."""
    out = {}
    for n_stages in (2, 4):
        stages, full, tie, schedule, steps = tied_case(n_stages)
        mine = {s: full[s] for s in fdist.my_stages(schedule, n_stages)}
        pipe = fdist.pipeline(stages, mine, schedule=schedule, loss_fn=tied_ce, timeout=20,
                              ties=tie)
        results, params = [], mine
        for x, target in steps:
            loss, grads = pipe.value_and_grad(x if rank == 0 else None,
                                              target if rank == pipe.program.placement[-1]
                                              else None, params=params)
            results.append((loss, grads))
            params = fpipe.optim.sgd(params, grads, TIE_LR)
        out[n_stages] = results
    stages, full, tie, _, ((x, _), _) = tied_case(2)
    cotangent = torch.randn(9, TIE_VOCAB, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(13))
    pipe = fdist.pipeline(stages, {rank: full[rank]}, schedule=fdist_schedule("gpipe", 3),
                          timeout=20, ties=tie)
    _, vjp_fn = pipe.vjp(x if rank == 0 else None)
    out["vjp"] = vjp_fn(cotangent if rank == 1 else None)[0]

    def build(params, tie_map) -> None:
        fdist.pipeline(stages, {rank: params}, schedule=fdist_schedule("1f1b", 3),
                              loss_fn=tied_ce, timeout=20, ties=tie_map)
    renamed = dict(full[rank])
    if rank == 1:
        renamed["head.w"] = renamed.pop("head.weight")
    narrow = dict(full[rank])
    if rank == 1:
        narrow["head.weight"] = narrow["head.weight"][:, :3].clone()
    out["renamed"] = _outcome(build, renamed, tie)
    out["narrow"] = _outcome(build, narrow, tie)
    out["maps"] = _outcome(build, full[rank], tie if rank == 0 else None)
    apart = dict(full[rank])
    if rank == 1:  # one element off: a copy that does not start equal
        apart["head.weight"] = apart["head.weight"].clone()
        apart["head.weight"][2, 1] += 1e-12
    out["apart"] = _outcome(build, apart, tie)
    frozen = dict(full[rank])
    if rank == 1:  # the head's copy frozen, the embedding's trained: no step may run
        frozen["head.weight"] = torch.nn.Parameter(frozen["head.weight"], requires_grad=False)
    out["frozen"] = _outcome(build, frozen, tie)
    return out


SCENARIOS["ties"] = ties


def logged(rank: int, world: int) -> dict:
    """What ``logging.getLogger("fpipe")`` hears on each rank: the pipeline built, each step
    with its figures, a step that failed; and each step's figures (``pipe.last_step``)."""
    import logging

    records: list = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append((record.levelname, record.getMessage()))

    logger = logging.getLogger("fpipe")
    logger.addHandler(Keep())
    logger.setLevel(logging.DEBUG)
    x, target = data(8, 8, seed=50)
    with fdist.pipeline([block, block], {rank: mlp_params(2)[rank]},
                        schedule=fdist_schedule("1f1b", 2), loss_fn=mse, timeout=20) as pipe:
        pipe.value_and_grad(x if rank == 0 else None, target if rank == 1 else None,
                            tokens=64 if rank == 1 else None)
        trained = pipe.last_step
        pipe.step_log = fpipe.StepLog(bubble=True)
        pipe(x if rank == 0 else None)
        forward = pipe.last_step
        _outcome(pipe.value_and_grad, x if rank == 0 else None, target[:3] if rank else None)
        failed = pipe.last_step
        recorder = fpipe.Recorder()  # a recorded step: its bubble against its timeline
        pipe.value_and_grad(x if rank == 0 else None, target if rank == 1 else None,
                            record=recorder)
    figures = [(f.what, f.seconds, f.samples, f.samples_per_second, f.tokens, f.bubble)
               for f in (trained, forward, failed, pipe.last_step)]
    return {"records": records, "figures": figures, "timeline": recorder.timeline}


SCENARIOS["logged"] = logged
