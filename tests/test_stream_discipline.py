"""The stream discipline, shown on the CPU: every tensor op a worker runs is inside a scope.

On CUDA a worker's kernels must go to streams that fpipe orders with events: the device's
compute stream (``transport.compute(device)``) or, for values crossing devices, the copy
streams (``transport.send`` / ``transport.receive``). An op outside both runs on the worker
thread's default stream, which nothing orders against those streams: a race that a CPU test
cannot show and a GPU shows only sometimes. The discipline itself can be checked anywhere,
so this test checks it on the CPU, where every CUDA path of fpipe is the identity.

What is checked, precisely: every aten op dispatched while a worker job runs, that is inside
:meth:`fpipe._runtime.interpreter.Interpreter.run`, on whichever thread runs the job (worker 0 runs
on the caller's thread). Each such op must run inside a compute scope or a copy. Ops the caller runs
before and after the step (moving and splitting the batch, joining outputs, stacking losses,
cloning gradients) are not worker ops: they run on the caller's current stream, which
``Transport.begin_step`` / ``end_step`` order against the step's streams.

How it is installed without touching the driver: ``fpipe._runtime.driver.Transport`` (which the
``LocalDriver`` builds) is replaced by :class:`ScopedTransport`, which marks, per thread,
when code is inside ``compute`` or a copy; and ``Interpreter.run`` is wrapped so that every job
pushes an :class:`OpLog` dispatch mode for its whole duration. The checks also demand ops
inside scopes (a stage's ``tanh`` per forward), so they cannot pass by seeing nothing.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from models import block, mlp_params, mse
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fpipe
import fpipe._runtime.driver
import fpipe._runtime.instructions
from fpipe._runtime.stream import Transport
from fpipe.schedules import gpipe, one_f_one_b, zero_bubble

FPIPE = Path(fpipe.__file__).resolve().parent

_scope = threading.local()  # .kind: None, "compute" or "copy", per thread


@contextlib.contextmanager
def _in_scope(kind: str, inner: contextlib.AbstractContextManager) -> Iterator[None]:
    """Mark this thread as inside ``kind`` for the duration of ``inner`` (nesting restores)."""
    outer = getattr(_scope, "kind", None)
    _scope.kind = kind
    try:
        with inner:
            yield
    finally:
        _scope.kind = outer


class ScopedTransport(Transport):
    """A Transport that also tells, per thread, whether code runs in a compute scope or a copy
    (on the CPU its streams are absent and every method is otherwise the base's)."""

    def compute(self, device: torch.device) -> contextlib.AbstractContextManager:
        return _in_scope("compute", super().compute(device))

    def send(self, leaves: list, src: torch.device, dst: torch.device) -> tuple:
        with _in_scope("copy", contextlib.nullcontext()):
            return super().send(leaves, src, dst)

    def receive(self, leaves: list, event, device: torch.device) -> list:
        with _in_scope("copy", contextlib.nullcontext()):
            return super().receive(leaves, event, device)


@dataclass(frozen=True)
class Op:
    name: str
    scope: str | None  # None: outside every scope
    where: str  # file:function of the innermost fpipe (or test) frame that ran it
    thread: str


class OpLog(TorchDispatchMode):
    """Records every op dispatched on this thread while pushed, with its scope. One instance
    per job: a mode object must not be entered on several threads at once."""

    def __init__(self, ops: list[Op]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(Op(str(func), getattr(_scope, "kind", None), _where(),
                           threading.current_thread().name))
        return func(*args, **(kwargs or {}))


def _where() -> str:
    """Where the op was called from: the innermost frame outside torch, as
    ``fpipe/_runtime/step.py:add``, followed by the innermost fpipe frame when that differs
    (an op from a stage or a test: ``test.py:stray < fpipe/_runtime/instructions.py:_run``)."""
    frames = []
    frame = sys._getframe(2)  # past this function and __torch_dispatch__
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if FPIPE in path.parents and not frame.f_code.co_name.startswith("<"):  # not <listcomp>
            frames.append(f"fpipe/{path.relative_to(FPIPE).as_posix()}:{frame.f_code.co_name}")
            break
        if (not frames and "torch" not in path.parts and path.name != "contextlib.py"
                and FPIPE not in path.parents):
            frames.append(f"{path.name}:{frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(frames) or "?"


@pytest.fixture
def ops(monkeypatch) -> list[Op]:
    """Installs the scoped transport and an op log in every worker job; yields the log."""
    log: list[Op] = []
    run = fpipe._runtime.driver.Interpreter.run

    def logged_run(self, *args, **kwargs):
        with OpLog(log):
            return run(self, *args, **kwargs)

    monkeypatch.setattr(fpipe._runtime.driver, "Transport", ScopedTransport)
    monkeypatch.setattr(fpipe._runtime.driver.Interpreter, "run", logged_run)
    return log


def check_discipline(log: list[Op], forwards: int) -> None:
    """Every worker op inside a scope, and at least ``forwards`` stage forwards seen inside
    compute scopes (so the check cannot pass by seeing nothing)."""
    inside = [op for op in log if op.scope == "compute"]
    tanhs = sum(op.name == "aten.tanh.default" for op in inside)
    assert tanhs >= forwards, f"saw {tanhs} stage forwards in compute scopes, expected " \
                              f"{forwards}: is the op log installed in the workers?"
    outside = sorted({(op.name, op.where) for op in log if op.scope is None})
    assert not outside, "worker ops outside transport.compute / send / receive:\n" + \
        "\n".join(f"  {name} at {where}" for name, where in outside)


TRAINING = [
    pytest.param(2, gpipe(chunks=3, remat="always"), None, id="gpipe-remat-always-2"),
    pytest.param(4, gpipe(chunks=4), None, id="gpipe-except-last-4"),
    pytest.param(3, one_f_one_b(chunks=4), None, id="1f1b-3"),
    pytest.param(3, zero_bubble(chunks=4), None, id="zero-bubble-3"),
    pytest.param(3, gpipe(chunks=2), torch.float64, id="gpipe-grad-dtype-3"),
    pytest.param(2, zero_bubble(chunks=3), torch.float64, id="zero-bubble-grad-dtype-2"),
]


@pytest.mark.parametrize("n_stages, schedule, grad_dtype", TRAINING)
def test_training_ops_run_in_scopes(ops, n_stages, schedule, grad_dtype):
    dtype = torch.float32 if grad_dtype is not None else torch.float64
    params = mlp_params(n_stages, dtype=dtype)
    x = torch.randn(8, 8, dtype=dtype)
    with fpipe.pipeline([block] * n_stages, params, schedule=schedule, loss_fn=mse,
                        grad_dtype=grad_dtype) as pipe:
        _, grads = pipe.value_and_grad(x, x)
    if grad_dtype is not None:
        assert all(g.dtype == grad_dtype for tree in grads for g in tree.values())
    check_discipline(ops, n_stages * schedule.chunks)


def test_inference_ops_run_in_scopes(ops):
    with fpipe.pipeline([block] * 3, mlp_params(3), schedule=gpipe(chunks=3),
                        loss_fn=mse) as pipe:
        pipe(torch.randn(6, 8, dtype=torch.float64))
    check_discipline(ops, 3 * 3)


def gpipe_module(chunks: int) -> fpipe.GPipe:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh()).double()
    return fpipe.GPipe(layers, balance=[2, 2], devices=["cpu", "cpu"], chunks=chunks)


def test_gpipe_module_backward_runs_in_scopes(ops):
    """The module face: forwards in ``Pipeline.vjp``, the rest in its vjp function, called by
    autograd from ``loss.backward()``."""
    model = gpipe_module(chunks=3)
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    F.mse_loss(model(x), torch.zeros(6, 8, dtype=torch.float64)).backward()
    assert x.grad is not None
    check_discipline(ops, 2 * 3)


def test_gpipe_module_forward_runs_in_scopes(ops):
    model = gpipe_module(chunks=3)
    model(torch.randn(6, 8, dtype=torch.float64, requires_grad=True))
    check_discipline(ops, 2 * 3)


def test_an_op_outside_every_scope_is_flagged(ops, monkeypatch):
    """The check itself: an op a worker runs between actions (here where the driver counts a
    recompute's input gradients, outside its compute scope) must be reported."""
    real = fpipe._runtime.instructions._grad_counts

    def stray(*args):
        torch.zeros(()).add_(1)
        return real(*args)

    monkeypatch.setattr(fpipe._runtime.instructions, "_grad_counts", stray)
    with fpipe.pipeline([block] * 2, mlp_params(2), schedule=gpipe(chunks=2, remat="always"),
                        loss_fn=mse) as pipe:
        x = torch.randn(4, 8, dtype=torch.float64)
        pipe.value_and_grad(x, x)
    flagged = (r"aten\.add_\.Tensor at test_stream_discipline\.py:stray"
               r" < fpipe/_runtime/instructions\.py:_recompute")
    with pytest.raises(AssertionError, match=flagged):
        check_discipline(ops, 2 * 2)


def test_ops_of_the_caller_are_not_checked(ops):
    """Ops outside a worker job (the caller's, before and after a step) are not logged."""
    with fpipe.pipeline([block] * 2, mlp_params(2), schedule=gpipe(chunks=2)) as pipe:
        pipe(torch.randn(4, 8, dtype=torch.float64))
        n = len(ops)
        torch.ones(3).add_(1)
    assert n > 0 and len(ops) == n


# -- Transport.send's streams, with fake CUDA streams ------------------------------------------

class FakeStream:
    """Stands for a CUDA stream: logs what waits on what, and is made current per thread."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait", self.name, other.name))

    def __repr__(self) -> str:
        return self.name


class FakeEvent:
    def __init__(self) -> None:
        self.stream = None

    def record(self, stream: FakeStream) -> None:
        self.stream = stream


@pytest.fixture
def fake_cuda(monkeypatch):
    """A transport over fake streams for cuda:0 and cuda:1 (on the CPU), and the log of
    waits and copies, each copy with the streams current on every device as it ran."""
    log: list = []
    current: dict[torch.device, FakeStream] = {}
    transport = Transport([])
    cuda = [torch.device("cuda", i) for i in range(2)]
    transport.compute_streams = {d: FakeStream(f"compute:{d.index}", log) for d in cuda}
    transport.copy_streams = {d: FakeStream(f"copy:{d.index}", log) for d in cuda}
    device_of = {s: d for streams in (transport.compute_streams, transport.copy_streams)
                 for d, s in streams.items()}

    @contextlib.contextmanager
    def stream(s: FakeStream):
        device = device_of[s]
        outer = current.get(device)
        current[device] = s
        try:
            yield
        finally:
            current[device] = outer

    def copy(leaf, dst, reader, blocking):
        log.append(("copy", dst.type if dst.type == "cpu" else f"cuda:{dst.index}",
                    dict(current), reader, blocking))
        return leaf

    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: current.get(d, "default"))
    monkeypatch.setattr(fpipe._runtime.stream, "_copy", copy)
    return transport, log


def test_a_gpu_to_gpu_copy_runs_on_both_copy_streams(fake_cuda):
    transport, log = fake_cuda
    zero, one = torch.device("cuda", 0), torch.device("cuda", 1)
    _, event = transport.send([torch.zeros(2)], zero, one)
    (_, waiter, producer), (_, dst, streams, reader, blocking) = log
    assert (waiter, producer) == ("copy:0", "compute:0")  # the copy waits for the producer
    assert streams == {zero: transport.copy_streams[zero], one: transport.copy_streams[one]}
    assert reader is transport.copy_streams[zero] and not blocking  # record_stream(copy:0)
    assert event.stream is transport.copy_streams[one]  # where the consumer must wait
    assert dst == "cuda:1"


def test_a_gpu_to_cpu_copy_blocks(fake_cuda):
    transport, log = fake_cuda
    zero = torch.device("cuda", 0)
    _, event = transport.send([torch.zeros(2)], zero, torch.device("cpu"))
    (_, waiter, producer), (_, dst, streams, _, blocking) = log
    assert (waiter, producer) == ("copy:0", "compute:0")
    assert streams == {zero: transport.copy_streams[zero]} and blocking and event is None


def test_a_cpu_to_gpu_copy_runs_on_the_destination_copy_stream(fake_cuda):
    transport, log = fake_cuda
    one = torch.device("cuda", 1)
    _, event = transport.send([torch.zeros(2)], torch.device("cpu"), one)
    ((_, dst, streams, reader, blocking),) = log
    assert streams == {one: transport.copy_streams[one]} and reader is None and not blocking
    assert event.stream is transport.copy_streams[one]


def test_a_value_on_its_own_device_is_not_copied(fake_cuda):
    transport, log = fake_cuda
    leaves = [torch.zeros(2)]
    moved, event = transport.send(leaves, torch.device("cuda", 0), torch.device("cuda", 0))
    assert moved is leaves and event is None and not log


# -- The recorder's CUDA events, with fake events ----------------------------------------------

class FakeTimingEvent:
    """Stands for a CUDA timing event: its place in one global order of records stands for
    the moment it executes (fake streams run what they are given in order)."""

    def __init__(self, enable_timing: bool = False, order: list | None = None) -> None:
        self.order, self.stream, self.waited = order, None, False

    def record(self, stream: str) -> None:
        self.stream = stream
        self.order.append(self)

    def synchronize(self) -> None:
        self.waited = True

    def elapsed_time(self, later: FakeTimingEvent) -> float:
        return float(self.order.index(later) - self.order.index(self)) * 1e3


@pytest.fixture
def fake_events(monkeypatch):
    """Fake timing events, with the current stream per thread (``thread.stream``)."""
    order: list = []
    current = threading.local()
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False:
                        FakeTimingEvent(enable_timing, order))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: getattr(current, "stream", "caller"))
    return order, current


def test_the_recorder_origin_is_waited_for_before_any_span(fake_events):
    order, current = fake_events
    zero = torch.device("cuda", 0)
    action = fpipe.schedules.Action(0, fpipe.schedules.Op.FORWARD, 0)
    clock = fpipe.Recorder().clock((0,), 1, [zero])
    origin = clock.origins[zero]
    assert origin.stream == "caller" and origin.waited and order == [origin]
    current.stream = "compute:0"
    with clock.span(action, zero):
        pass
    assert [e.stream for e in order] == ["caller", "compute:0", "compute:0"]
    clock.finish()
    ((span,),) = clock.recorder.timeline
    assert 0 < span.start <= span.end


def test_spans_of_workers_sharing_a_device_do_not_overlap(fake_events):
    """Two workers' actions on one device: each action's kernels lie between its own start
    and end events in the stream's order, so the spans are disjoint."""
    order, current = fake_events
    zero = torch.device("cuda", 0)
    clock = fpipe.Recorder().clock((0, 1), 2, [zero, zero])
    kernels: dict = {}

    def worker(stage: int) -> None:
        current.stream = "compute:0"
        for m in range(20):
            with clock.span(fpipe.schedules.Action(stage, fpipe.schedules.Op.FORWARD, m), zero):
                for _ in range(3):  # kernels enqueued by the action, other threads between
                    kernel = torch.cuda.Event()
                    kernel.record("compute:0")
                    kernels[kernel] = (stage, m)
                    threading.Event().wait(1e-4)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    clock.finish()
    spans = sorted((span for spans in clock.recorder.timeline for span in spans),
                   key=lambda span: span.start)
    assert len(spans) == 40
    for span, after in zip(spans, spans[1:]):
        assert span.end <= after.start, f"{span.action} overlaps {after.action}"
    for span in spans:  # its own kernels, and only those, lie inside it
        inside = {kernels[e] for e in order[int(span.start) + 1:int(span.end)]}
        assert inside == {(span.action.stage, span.action.microbatch)}
