"""How a call of ``fpipe.GPipe`` runs on the functional core, as a torchgpipe call would run.

- **Program.** A ``Program`` with one worker per device (torchgpipe has one thread per device)
  whose forwards go in torchgpipe's clock order: at clock ``k`` micro-batch ``k - j`` on
  partition ``j``, partitions in order. So on a device holding several partitions, a failure
  stops the micro-batches torchgpipe's would stop.
- **Micro-batches.** torchgpipe cuts with ``torch.chunk``, which may give fewer micro-batches
  than ``chunks`` (a batch of 3 in 8 chunks is 3 micro-batches); the face runs a pipeline with
  that many, and checkpoints them as torchgpipe's would. The pipelines are built on first use,
  one per (micro-batches, checkpointing).
- **Autograd.** A training call is one autograd node around :meth:`fpipe.Pipeline.vjp`:
  forwards when the module is called, recomputes and backwards when autograd asks for the
  input's and parameters' gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch import nn

from fpipe.errors import StageError
from fpipe.pipeline import Pipeline
from fpipe.recompute import is_checkpointing, run_serial
from fpipe.schedules.actions import Action, B, F, Program
from fpipe.schedules.remat import apply_remat
from fpipe.stages.module_skip import route_module_skips
from fpipe.stages.sequential import StatefulModuleStage, tensor_names
from fpipe.stages.swap import Swap

__all__: list[str] = []


def check_input(input: Any) -> None:
    """A tensor or a tuple of tensors, as torchgpipe takes (a ``TypeError`` otherwise)."""
    values = input if isinstance(input, tuple) else (input,)
    if not values or not all(isinstance(value, torch.Tensor) for value in values):
        raise TypeError(f"GPipe takes a tensor or a tuple of tensors, got {_kind(input)}")


def microbatches(input: Any, chunks: int) -> int:
    """How many micro-batches ``torch.chunk`` cuts the input into (torchgpipe's count)."""
    first = input if isinstance(input, torch.Tensor) else input[0]
    n = first.shape[0] if first.dim() else 0
    if n == 0:
        return chunks  # the pipeline says what is wrong with the batch
    return math.ceil(n / math.ceil(n / chunks))


def remat_of(checkpoint: str, chunks: int, microbatches: int) -> str:
    """torchgpipe checkpoints the micro-batches before ``checkpoint_stop``: all of them for
    ``"always"``, all but the ``chunks``-th for ``"except_last"`` (so all of fewer)."""
    if checkpoint == "except_last" and microbatches < chunks:
        return "always"
    return checkpoint


def recomputes(remat: str, microbatches: int) -> bool:
    """Whether a step under ``remat`` recomputes any micro-batch (``"except_last"`` keeps the
    last one, so of one micro-batch it recomputes nothing)."""
    return remat == "always" or (remat == "except_last" and microbatches > 1)


def clock_program(n_microbatches: int, devices: Sequence[torch.device], remat: str) -> Program:
    """GPipe over one worker per distinct device, forwards in torchgpipe's clock order and
    backwards in its reverse (each stage's last micro-batch first, as torchgpipe's autograd
    graph runs them, so ``remat``'s ``"except_last"`` keeps the last micro-batch, the one
    torchgpipe does not checkpoint, and frees it before any recompute), then ``remat``."""
    worker_of: dict[torch.device, int] = {}
    workers = [worker_of.setdefault(d, len(worker_of)) for d in devices]
    k, m = len(devices), n_microbatches
    pairs = [(s, i) for i in range(m) for s in range(k)]
    forwards = sorted(pairs, key=lambda p: (p[0] + p[1], p[0]))
    backwards = forwards[::-1]
    lists: list[list[Action]] = [[] for _ in worker_of]
    for op, order in ((F, forwards), (B, backwards)):
        for s, i in order:
            lists[workers[s]].append(Action(s, op, i))
    return apply_remat(Program(lists, k, m), remat)


class Partition:
    """A partition's stage, ``(params, buffers, x) -> (y, new_buffers)``, holding its output
    to torchgpipe's rule: a tensor or a tuple of tensors.

    Its layers may write into its input in place (``nn.ReLU(inplace=True)`` first in a
    partition, torchvision's default) wherever torchgpipe lets them: where nothing reads the
    input afterwards. Each tensor of the input is handed over as an alias (see
    :func:`writable`), so the write lands without tripping fpipe's purity check or autograd's
    refusal of writes into a leaf; autograd's version counters still catch a backward that
    needed the overwritten value. Only a checkpointed forward is refused, at once: its
    recompute would start from the overwritten input."""

    def __init__(self, module: nn.Module, index: int, model: Any = None) -> None:
        self.stage = StatefulModuleStage(module, model)
        self.index = index
        self.name_of = self.stage.name_of  # names a weight the partition reaches unheld

    def __call__(self, params: Any, state: Any, x: Any) -> tuple[Any, Any]:
        if is_checkpointing():
            versions = [t._version for t in _tensors(x)]
            y, new_state = self.stage(params, state, x)
            if versions != [t._version for t in _tensors(x)]:
                raise StageError(
                    f"partition {self.index} wrote in place into its input (a layer such as "
                    f"nn.ReLU(inplace=True) first in the partition) in a checkpointed forward, "
                    f"whose recompute would start from the overwritten input: use "
                    f"checkpoint='never', or inplace=False for that layer")
        else:
            y, new_state = self.stage(params, state, optree.tree_map(writable, x))
        values = y if isinstance(y, tuple) else (y,)
        if not all(isinstance(value, torch.Tensor) for value in values):
            raise TypeError(f"partition {self.index} returned {_kind(y)}: a partition's output "
                            f"must be a tensor or a tuple of tensors")
        return y, new_state

    def __repr__(self) -> str:
        return f"Partition({self.index}, {self.stage.module!r})"


class _Alias(torch.autograd.Function):
    """The identity, returning a new tensor over the same storage: a non-leaf that a layer
    may write into in place, whose gradient flows back to the leaf unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def writable(x: Any) -> Any:
    """``x`` as a partition may write into it: under a graph, an alias autograd tracks (the
    version counter stays shared, so a saved tensor overwritten is still an error at the
    backward); without one, ``.data``, a view with a version counter of its own, so that
    fpipe's check of the caller's tensors does not see a write nothing will read back."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.requires_grad and torch.is_grad_enabled():
        return _Alias.apply(x)
    return x.data


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


class Pipelines:
    """The face's pipelines, one per (micro-batches, remat, the partitions' tensor names),
    built on first use: a model changed between calls (a bias set to ``None``, two weights
    tied, a buffer registered) gets a pipeline of its new structure, as a face built after the
    change would. Copied or pickled with the module, it starts empty (a pipeline holds threads
    and locks)."""

    def __init__(self) -> None:
        self.built: dict[tuple, Pipeline] = {}
        self.partitions: list[Partition] = []
        self.stages: list | None = None

    def get(self, partitions: nn.ModuleList, devices: list[torch.device], microbatches: int,
            remat: str, params: list, state: list) -> Pipeline:
        key = (microbatches, remat, tuple(map(tuple, params)), tuple(map(tuple, state)))
        if key not in self.built:
            if self.stages is None:
                model = tensor_names({f"partition {j}'s ": p for j, p in enumerate(partitions)})
                self.partitions = [Partition(p, j, model) for j, p in enumerate(partitions)]
                self.stages = route_module_skips(self.partitions, list(partitions), True)
            self.built[key] = Pipeline(self.stages, params, state=state, devices=devices,
                                       schedule=clock_program(microbatches, devices, remat))
        return self.built[key]

    def swaps(self, partitions: nn.ModuleList) -> list[Swap] | None:
        """The partitions' stages' swaps, once built for these very modules: the face reads
        its tensors through them, so that its check of their structure counts for the
        stages' calls in the same run (see :func:`fpipe.recompute.run`)."""
        swaps = [p.stage.swap for p in self.partitions]
        return swaps if [s.module for s in swaps] == list(partitions) and swaps else None

    def unread_by_recomputes(self) -> list[set[str]]:
        """Per partition, the buffers no recompute reads and no call writes where a
        recompute could see it: the running statistics of its plain normalisation layers
        (see :mod:`fpipe.stages.running`). Asked after :meth:`get`."""
        serial = run_serial()
        return [p.stage.running(serial).uncopied(True, serial) for p in self.partitions]

    def __deepcopy__(self, memo: dict) -> Pipelines:
        return Pipelines()

    def __reduce__(self) -> tuple:
        return (Pipelines, ())


class Run(torch.autograd.Function):
    """The pipeline as one autograd node, over the input's tensors and every parameter:
    ``Run.apply(run, tuple_input, n_inputs, *input_tensors, *param_leaves)``.

    ``run(input) -> (y, vjp_fn)`` runs the forwards; ``vjp_fn(cotangent)`` returns the
    parameters' gradients (a pytree whose leaves follow ``param_leaves``) and the input's,
    shaped like the input."""

    @staticmethod
    def forward(ctx: Any, run: Callable, tuple_input: bool, n_inputs: int,
                *tensors: torch.Tensor) -> Any:
        y, ctx.vjp_fn = run(tensors[:n_inputs] if tuple_input else tensors[0])
        ctx.tuple_input, ctx.tuple_output = tuple_input, isinstance(y, tuple)
        outputs = y if ctx.tuple_output else (y,)
        ctx.mark_non_differentiable(*(t for t in outputs if not t.is_floating_point()))
        return y

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        vjp_fn = getattr(ctx, "vjp_fn", None)
        if vjp_fn is None:
            raise RuntimeError(
                "fpipe.GPipe: this forward's backward has run already. A GPipe step's "
                "backward runs once (each stage's graph is freed as it goes), so "
                "backward(retain_graph=True) twice and torch.autograd.functional.jacobian "
                "over the module are not supported: run the forward again for each backward")
        if torch.is_grad_enabled():
            raise RuntimeError(
                "fpipe.GPipe: backward(create_graph=True) (a double backward, a Hessian) is "
                "not supported: the pipeline's backward runs outside autograd's graph. Take "
                "higher derivatives of the plain nn.Sequential instead")
        del ctx.vjp_fn
        param_grads, input_grads = vjp_fn(tuple(grads) if ctx.tuple_output else grads[0])
        input_grads = list(input_grads) if ctx.tuple_input else [input_grads]
        # One entry per parameter: None for a frozen or unused one, which then gets no .grad.
        return (None, None, None, *input_grads,
                *optree.tree_leaves(param_grads, none_is_leaf=True))


def _kind(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of ({', '.join(type(v).__name__ for v in value)})" if value else \
            "an empty tuple"
    return f"a {type(value).__name__}"
