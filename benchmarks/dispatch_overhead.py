"""Driver cost per action: many tiny stages, where the driver's own work dominates.

    python benchmarks/dispatch_overhead.py [--quick] [--json PATH] [--repeat N]

16 stages of Linear(64, 64) + tanh, batch 64, over M micro-batches (8 and 32; 8 only with
--quick), one intra-op thread (set here, before anything runs). Each fpipe row runs one
training step (loss and every gradient) and is compared with the reference rows that do the
same arithmetic without fpipe:

- *plain loop*: the 16 layers composed, one micro-batch after the other, differentiated as a
  whole per micro-batch, gradients summed over micro-batches: with ``torch.func`` (``vjp``, its
  backward without grad mode, then a sum) or ``torch.autograd`` (``loss.backward()``, which
  accumulates into ``.grad``). The floor of a pipeline's step on one thread.
- *minimal interpreter*: what a pipeline must do at the least, written as plainly as possible:
  one vjp per (stage, micro-batch) kept in a dict, GPipe's order, the same engine
  (``torch.func.vjp``, or a leaf per step and ``torch.autograd.backward``); on one thread, and
  with one thread per stage (*threaded*: values handed over through ``queue.SimpleQueue``).
- *fpipe*: ``fpipe.pipeline`` with the same order on one worker (``Program`` with every stage
  on worker 0), and GPipe with one worker per stage; ``autodiff="func"`` and ``"autograd"``.
- the module faces: the same layers as an ``nn.Sequential`` under ``fpipe.GPipe`` and, when it
  is installed, torchgpipe (``checkpoint="never"``).

Rows are timed interleaved: each round runs every row once, in a rotated order, so a busy
period of a shared machine hits them all alike; a row's figure is the median over rounds,
with the quartiles as its spread. *us/action* is (row - its reference) / actions, the
reference being the plain loop with the same engine (autograd for the module faces);
*x minimal* divides it by the minimal interpreter's with the same engine and threads.
*cpu ms* is the process's CPU time per step (all threads), which a busy machine disturbs
less than the wall time (on one worker the two agree on a quiet machine), and *cpu us/action*
the same difference as *us/action* in CPU time.
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
import warnings
from functools import partial

import torch

torch.set_num_threads(1)  # before any work: the figures are for one intra-op thread

from common import parser, report  # noqa: E402
from torch.func import vjp  # noqa: E402

import fpipe  # noqa: E402
from fpipe.schedules import Program, gpipe  # noqa: E402


def stage(p, x):
    return torch.tanh(x @ p["w"] + p["b"])


def loss_fn(y, t):
    return torch.nn.functional.mse_loss(y, t)


def one_worker(n_stages: int, chunks: int) -> Program:
    """GPipe's arithmetic with every stage on one worker: the driver without thread hand-offs."""
    forwards = [f"{s}F{m}" for s in range(n_stages) for m in range(chunks)]
    backwards = [f"{s}B{m}" for s in reversed(range(n_stages)) for m in range(chunks)]
    return Program([forwards + backwards], n_stages, chunks)


# -- the references ------------------------------------------------------------------------------


def plain_func(params, xs, ts):
    """The composed layers per micro-batch through torch.func.vjp, gradients summed."""
    def loss(ps, xm, tm):
        h = xm
        for p in ps:
            h = stage(p, h)
        return loss_fn(h, tm) * (len(xm) / n_samples(xs))

    total = None
    for xm, tm in zip(xs, ts):
        value, vjp_fn = vjp(loss, params, xm, tm)
        with torch.no_grad():
            grads = vjp_fn(torch.ones_like(value))[0]
            total = grads if total is None else [
                {k: a[k] + g[k] for k in a} for a, g in zip(total, grads)]
    return total


def plain_autograd(params, xs, ts):
    """The composed layers per micro-batch, ``loss.backward()`` accumulating into ``.grad``."""
    leaves = [{k: v.detach().requires_grad_() for k, v in p.items()} for p in params]
    for xm, tm in zip(xs, ts):
        h = xm
        for p in leaves:
            h = stage(p, h)
        (loss_fn(h, tm) * (len(xm) / n_samples(xs))).backward()
    return [{k: v.grad for k, v in p.items()} for p in leaves]


def n_samples(xs) -> int:
    return sum(len(x) for x in xs)


def minimal_func(params, xs, ts):
    """The least a pipeline does with torch.func: a vjp per (stage, micro-batch) in a dict."""
    n, vjps, total, cotangents = len(params), {}, [None] * len(params), {}
    for s in range(n):
        for m, xm in enumerate(xs):
            h = xm if s == 0 else vjps[s - 1, m][0]
            if s == n - 1:
                def fn(p, h, m=m):
                    return loss_fn(stage(p, h), ts[m]) * (len(ts[m]) / n_samples(xs))
            else:
                fn = stage
            vjps[s, m] = vjp(fn, params[s], h)
    with torch.no_grad():
        for s in reversed(range(n)):
            for m in range(len(xs)):
                out, vjp_fn = vjps.pop((s, m))
                g = torch.ones_like(out) if s == n - 1 else cotangents.pop(m)
                grads, x_grad = vjp_fn(g)
                total[s] = grads if total[s] is None else {
                    k: total[s][k] + grads[k] for k in grads}
                if s:
                    cotangents[m] = x_grad
    return total


def _autograd_forward(leaves, s, h, tm, weight, last):
    x = h.detach().requires_grad_() if s else h
    y = stage(leaves[s], x)
    return x, (loss_fn(y, tm) * weight if last else y)


def minimal_autograd(params, xs, ts):
    """The least a pipeline does with autograd: per step a leaf per parameter; per
    (stage, micro-batch) its input leaf and output in a dict; torch.autograd.backward."""
    n = len(params)
    leaves = [{k: v.detach().requires_grad_() for k, v in p.items()} for p in params]
    saved, grads = {}, {}
    for s in range(n):
        for m, xm in enumerate(xs):
            h = xm if s == 0 else saved[s - 1, m][1].detach()
            saved[s, m] = _autograd_forward(leaves, s, h, ts[m], len(xm) / n_samples(xs),
                                            s == n - 1)
    for s in reversed(range(n)):
        for m in range(len(xs)):
            x, y = saved.pop((s, m))
            torch.autograd.backward([y], [torch.ones_like(y) if s == n - 1 else grads.pop(m)])
            if s:
                grads[m] = x.grad
    return [{k: v.grad for k, v in p.items()} for p in leaves]


class MinimalThreaded:
    """The minimal autograd interpreter with one thread per stage (GPipe's order), values
    handed over through queues: the least a threaded pipeline pays for its hand-offs."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.jobs = [queue.SimpleQueue() for _ in range(n)]
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._serve, args=(s,), daemon=True)
                        for s in range(1, n)]
        for thread in self.threads:
            thread.start()

    def _serve(self, s: int) -> None:
        while True:
            job = self.jobs[s].get()
            if job is None:
                return
            job()
            job = None  # nothing of the step held while idle
            self.done.put(None)

    def close(self) -> None:
        """Stop the threads and wait for them: a daemon thread still freeing a step's tensors
        when the interpreter's teardown begins aborts the process ("terminate called without
        an active exception")."""
        for s in range(1, self.n):
            self.jobs[s].put(None)
        for thread in self.threads:
            thread.join()

    def __call__(self, params, xs, ts):
        n, chunks = self.n, len(xs)
        leaves = [{k: v.detach().requires_grad_() for k, v in p.items()} for p in params]
        acts = [queue.SimpleQueue() for _ in range(n)]  # into stage s
        cots = [queue.SimpleQueue() for _ in range(n)]  # out of stage s's output

        def worker(s: int) -> None:
            saved = []
            for m in range(chunks):
                h = xs[m] if s == 0 else acts[s].get()
                x, y = _autograd_forward(leaves, s, h, ts[m], len(xs[m]) / n_samples(xs),
                                         s == n - 1)
                saved.append((x, y))
                if s < n - 1:
                    acts[s + 1].put(y.detach())
            for m in range(chunks):
                x, y = saved[m]
                g = torch.ones_like(y) if s == n - 1 else cots[s].get()
                torch.autograd.backward([y], [g])
                saved[m] = None
                if s:
                    cots[s - 1].put(x.grad)

        for s in range(1, n):
            self.jobs[s].put(lambda s=s: worker(s))
        worker(0)
        for _ in range(n - 1):
            self.done.get()
        return [{k: v.grad for k, v in p.items()} for p in leaves]


# -- the run ------------------------------------------------------------------------------------


def module_faces(n_stages: int) -> list:
    """(name, wrap, worker threads): fpipe.GPipe runs a thread per partition, torchgpipe one
    per device, so one thread for its 16 CPU partitions."""
    faces = [("fpipe.GPipe (never)", lambda module, chunks: fpipe.GPipe(
        module, [1] * len(module), chunks=chunks, checkpoint="never"), n_stages)]
    try:
        import torchgpipe
    except ImportError:
        return faces
    faces.append(("torchgpipe (never)", lambda module, chunks: torchgpipe.GPipe(
        module, [1] * len(module), devices=["cpu"] * len(module), chunks=chunks,
        checkpoint="never"), 1))
    return faces


def layers(params: list) -> torch.nn.Sequential:
    """The benchmark's stages as an nn.Sequential of Linear + Tanh, with the same weights."""
    blocks = []
    for p in params:
        linear = torch.nn.Linear(*p["w"].shape)
        with torch.no_grad():
            linear.weight.copy_(p["w"].T)
            linear.bias.copy_(p["b"])
        blocks.append(torch.nn.Sequential(linear, torch.nn.Tanh()))
    return torch.nn.Sequential(*blocks)


def interleaved(rows: dict, rounds: int, warmup: int = 2) -> dict:
    """Per row, the wall and process CPU seconds of each call, rows interleaved per round."""
    names = list(rows)
    for _ in range(warmup):
        for name in names:
            rows[name]()
    wall = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            c0, t0 = time.process_time(), time.perf_counter()
            rows[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return {name: (wall[name], cpu[name]) for name in names}


def quartiles(values: list) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return q1, q2, q3


def measure(chunks: int, params: list, x, target, threaded: MinimalThreaded,
            rounds: int) -> list[dict]:
    """Every row at ``chunks`` micro-batches, timed interleaved."""
    n_stages = len(params)
    xs, ts = x.tensor_split(chunks), target.tensor_split(chunks)
    actions = 2 * n_stages * chunks
    calls = {
        "plain loop, func": (partial(plain_func, params, xs, ts), "func", 1),
        "plain loop, autograd": (partial(plain_autograd, params, xs, ts), "autograd", 1),
        "minimal interpreter, func": (partial(minimal_func, params, xs, ts), "func", 1),
        "minimal interpreter, autograd": (partial(minimal_autograd, params, xs, ts),
                                          "autograd", 1),
        "minimal threaded, autograd": (partial(threaded, params, xs, ts), "autograd",
                                       n_stages),
    }
    pipes = []
    with warnings.catch_warnings():
        # 16 worker threads on fewer cores: the warning is what these rows measure.
        warnings.simplefilter("ignore")
        for name, schedule, workers in (("1 worker", one_worker(n_stages, chunks), 1),
                                        ("GPipe", gpipe(chunks=chunks, remat="never"),
                                         n_stages)):
            for autodiff in ("func", "autograd"):
                pipe = fpipe.pipeline([stage] * n_stages, params, schedule=schedule,
                                      loss_fn=loss_fn, autodiff=autodiff)
                pipes.append(pipe)
                calls[f"fpipe {name}, {autodiff}"] = (
                    partial(pipe.value_and_grad, x, target), autodiff, workers)
        for name, wrap, threads in module_faces(n_stages):
            model = wrap(layers(params), chunks)
            calls[name] = (partial(_module_step, model, x, target), "autograd", threads)
    times = interleaved({name: fn for name, (fn, _, _) in calls.items()}, rounds)
    for pipe in pipes:
        pipe.close()
    wall = {name: quartiles(w) for name, (w, _) in times.items()}
    cpu = {name: statistics.median(c) for name, (_, c) in times.items()}

    def per_action(figures: dict, name: str, engine: str) -> float:
        return (figures[name] - figures[f"plain loop, {engine}"]) / actions * 1e6

    rows = []
    for name, (_, engine, workers) in calls.items():
        q1, med, q3 = wall[name]
        minimal = None
        if workers == 1 or engine == "autograd":
            minimal = f"minimal {'interpreter' if workers == 1 else 'threaded'}, {engine}"
        over = per_action({n: w[1] for n, w in wall.items()}, name, engine)
        reference = name.startswith(("plain", "minimal"))
        rows.append({
            "row": name, "M": chunks, "workers": workers, "actions": actions,
            "step ms": med * 1e3, "spread ms": f"{q1 * 1e3:.3g}-{q3 * 1e3:.3g}",
            "us/action": None if name.startswith("plain") else over,
            "x minimal": None if minimal is None or reference else
            over / per_action({n: w[1] for n, w in wall.items()}, minimal, engine),
            "cpu ms": cpu[name] * 1e3,
            "cpu us/action": None if name.startswith("plain") else
            per_action(cpu, name, engine)})
    return rows


def _module_step(model, x, target) -> None:
    loss_fn(model(x), target).backward()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=None, help="rounds (default 30; quick 5)")
    args = p.parse_args()
    torch.manual_seed(0)
    n_stages, width, batch = 16, 64, 64
    params = [{"w": torch.randn(width, width) * 0.1, "b": torch.zeros(width)}
              for _ in range(n_stages)]
    x, target = torch.randn(batch, width), torch.randn(batch, width)
    rounds = args.repeat or (5 if args.quick else 30)
    threaded = MinimalThreaded(n_stages)
    rows = [row for chunks in ([8] if args.quick else [8, 32])
            for row in measure(chunks, params, x, target, threaded, rounds)]
    threaded.close()
    report("fpipe driver overhead per action (16 x Linear(64,64), batch 64, 1 intra-op thread)",
           ["row", "M", "workers", "actions", "step ms", "spread ms", "us/action", "x minimal",
            "cpu ms", "cpu us/action"], rows, args.json,
           [f"{rounds} interleaved rounds; step ms is the median, spread its quartiles; "
            f"torch threads: {torch.get_num_threads()}"])


if __name__ == "__main__":
    main()
