"""One stage on one micro-batch: its forward, with or without a vjp, and its backward.

A :class:`StageCall` runs a stage's *core* (see :mod:`fpipe._runtime.adapters`) on flat leaves
(:mod:`fpipe._runtime.values`): the flavours of stage (state, skips, loss, compilation) were
adapted away before, so what remains here is differentiation and the purity checks.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any

import optree
import torch

from fpipe._runtime.adapters import Core, MicroBatch
from fpipe._runtime.given import check_given, closed_over
from fpipe._runtime.reentrant import check_no_reentrant_checkpoint
from fpipe._runtime.split_backward import split_vjp
from fpipe._runtime.values import (
    Value,
    check_output,
    describe,
    flatten,
    placed,
    tensors_of,
    tensors_only,
)
from fpipe._runtime.vjp import autograd_vjp, func_vjp
from fpipe.errors import StageError
from fpipe.recompute import state_owned

__all__ = ["StageCall", "Value", "flatten", "check_output", "describe", "ENGINES"]

# How a vjp is taken (see fpipe._runtime.vjp): torch.func's transform, or the same vjp through
# torch.autograd, which works with saved-tensor hooks and compiled functions.
ENGINES = {"func": func_vjp, "autograd": autograd_vjp}


class StageCall:
    """Runs one stage's core on flat leaves.

    Inputs are ``(x, *popped skips)`` and outputs ``[y, *stashed skips]``, each a
    :class:`Value`; ``inputs_named`` and ``outputs_named`` say what each is in errors.
    ``grad_input``: whether the inputs' gradients are wanted (not for the first stage of a
    loss step). ``engine`` is how the vjp is taken, one of :data:`ENGINES`.
    """

    def __init__(self, core: Core, param_spec: optree.PyTreeSpec, grad_input: bool,
                 engine: Callable = autograd_vjp,
                 inputs_named: tuple[str, ...] = ("its input x",),
                 outputs_named: tuple[str, ...] = ("output",),
                 name_of: Callable[[torch.Tensor], str | None] | None = None) -> None:
        self.core = core
        self.param_spec = param_spec
        self.grad_input = grad_input
        self.engine = engine
        self.inputs_named = inputs_named
        self.outputs_named = outputs_named
        # Whether forward_vjp can add parameter gradients into the step's leaves (autograd).
        self.accumulates = engine is autograd_vjp
        self.searched = False  # whether a vjp's graph was searched for a reentrant checkpoint
        # The input signatures whose graph was searched for tensors the stage was not given
        # (see fpipe._runtime.given); ``name_of`` names such a tensor where the stage can.
        self.checked: set[tuple] = set()
        # The input signatures whose graph ends in the call's own leaves (see given.py's
        # closed_over): their accumulating backwards leave the leaves unnamed (vjp.py).
        self.closed: set[tuple] = set()
        self.name_of = name_of

    def forward(self, params: list, inputs: tuple[Value, ...], state: Any,
                mb: MicroBatch, requiring: list | None = None) -> tuple[list[Value], Any]:
        """The outputs and the new state, with no graph kept: for inference and for forwards
        that will be recomputed.

        It runs on leaves that require grad where the vjp's would (``requiring``: the
        parameter leaves so, trainable ones requiring grad; the inputs' differentiable leaves
        where :attr:`grad_input`), under ``no_grad``: only grad mode differs from the
        recompute, and ATen chooses kernels by ``requires_grad`` (a batch-first attention's
        in-projection is one ``mm`` when the weight requires grad, a ``bmm`` over the sequence
        when not). So a dropped forward computes bit for bit what its recompute computes, and
        costs what it costs."""
        watch = _Watch(self, params, _watched(state), inputs)
        leaves = params if requiring is None else requiring
        trees = tuple(_requiring(value) if self.grad_input else value.tree()
                      for value in inputs)
        with torch.no_grad():
            outs, new_state = self.core(optree.tree_unflatten(self.param_spec, leaves), state,
                                        trees, mb)
        watch.check()
        return self._outputs(outs, mb.size), new_state

    def forward_vjp(self, params: list, inputs: tuple[Value, ...], state: Any,
                    mb: MicroBatch, split: bool = False, accumulate: list | None = None,
                    trainable: tuple[int, ...] | None = None) -> tuple[list[Value], Any, Any]:
        """The outputs, the new state, and the function mapping the outputs' cotangents to
        ``(param_grads, input_grads)``, lists of leaves in output and input order; with
        ``split``, a :class:`~fpipe._runtime.split_backward.SplitVJP` giving the two halves.
        ``trainable``: the indices of the parameters differentiated (``None``: all); the
        others are constants of the call, and ``param_grads`` has one entry per trainable
        leaf, ``None`` for a leaf the outputs do not depend on. With ``accumulate`` (only
        where :attr:`accumulates`: the step's leaves for the trainable ``params``), the
        backward adds the parameters' gradients into their ``.grad`` and gives ``None`` for
        them (see :mod:`fpipe._runtime.vjp`)."""
        index = [value.grad_index for value in inputs] if self.grad_input else [()] * len(inputs)
        side: list = []  # what leaves the transform beside the differentiated outputs
        given: list = []  # the leaves the core was called on, as the transform made them

        def flat(param_leaves: list, grad_leaves: list):
            param_leaves = placed(params, trainable, param_leaves)  # the frozen ones back
            trees, k = [], 0
            for value, where in zip(inputs, index):
                full = value.leaves
                if where:
                    full = list(full)
                    for i in where:
                        full[i] = grad_leaves[k]
                        k += 1
                trees.append(optree.tree_unflatten(value.spec, full))
            results, new_state = self.core(optree.tree_unflatten(self.param_spec, param_leaves),
                                           state, tuple(trees), mb)
            given.extend((*param_leaves, *grad_leaves))
            state_leaves, state_spec, state_kept = [], None, []  # a stateless stage's
            if new_state is not None:
                state_leaves, state_spec = _flat_state(new_state)
                # Tensors that carry no gradient leave the transform as aux, which unwraps them.
                state_kept = _tensor_indices(state_leaves)
            outs = self._outputs(results, mb.size)
            grads, kept = _split_outputs(outs)
            side.extend((outs, kept, state_leaves, state_spec, state_kept))
            aux = [outs[k].leaves[i] for k, i in kept] if kept else []
            if len(state_kept) == len(state_leaves):  # (every leaf a tensor: the usual case)
                aux += state_leaves
            elif state_kept:
                aux += [state_leaves[i] for i in state_kept]
            return grads, aux

        # Autograd itself refuses writes into the differentiated leaves: watch the others.
        watch = _Watch(self, params, _watched(state), inputs, index)
        signature = _signature(inputs)
        try:
            x = inputs[0]
            differentiated = x.leaves if len(inputs) == 1 and len(index[0]) == len(x.leaves) \
                else [value.leaves[i] for value, where in zip(inputs, index) for i in where]
            diff_params = params if trainable is None else [params[i] for i in trainable]
            if split:
                primals, vjp_fn, aux = split_vjp(flat, diff_params, differentiated, has_aux=True)
            elif accumulate is not None:
                primals, vjp_fn, aux = autograd_vjp(
                    flat, diff_params, differentiated, accumulate,
                    closed=signature in self.closed and _no_history(inputs, index))
            else:
                primals, vjp_fn, aux = self.engine(flat, diff_params, differentiated)
        except RuntimeError as exc:
            if "used in an in-place operation" not in str(exc):
                raise
            # Autograd refuses the write before it lands: the differentiated leaves are its.
            raise StageError("the stage writes in place into a tensor it was given (a "
                             "parameter or a floating-point input); stages must be pure: "
                             "compute a new tensor instead") from exc
        watch.check()
        outs, kept, state_leaves, state_spec, state_kept = side
        if not self.searched and (self.accumulates or split):  # once: see reentrant.py
            check_no_reentrant_checkpoint(out.leaves[i] for out in outs for i in out.grad_index)
            self.searched = True
        if signature not in self.checked:  # once per input signature: see given.py
            outputs = [leaf for out in outs for leaf in out.leaves]
            check_given((*outputs, *primals),
                        (*given, *params, *(leaf for value in inputs for leaf in value.leaves),
                         *(optree.tree_leaves(state) if state is not None else ())),
                        self.name_of)
            self.checked.add(signature)
            if accumulate is not None and _no_history(inputs, index) and \
                    closed_over(outputs, given):
                self.closed.add(signature)
        for (k, i), leaf in zip(kept, aux):
            outs[k].leaves[i] = leaf
        new_state = None
        if state_spec is not None:
            if len(state_kept) == len(state_leaves):
                state_leaves = aux[len(kept):]
            else:
                for i, leaf in zip(state_kept, aux[len(kept):]):
                    state_leaves[i] = leaf
            new_state = _state_of(state_spec, state_leaves)
        k = 0
        for out in outs:
            for i in out.grad_index:
                out.leaves[i] = primals[k]
                k += 1
        return outs, new_state, vjp_fn

    def _outputs(self, results: tuple, size: int | None) -> list[Value]:
        """The core's outputs flattened, each checked to keep the micro-batch's ``size``."""
        outs = [flatten(value) for value in results]
        if size is not None:
            for what, out in zip(self.outputs_named, outs):
                check_output(out, size, what)
        return outs


def _watched(state: Any) -> Any:
    """The state whose tensors a call must leave as they are: none where the step made it (see
    :func:`~fpipe.recompute.state_owned`), which no caller holds. A stage that writes its state
    in place is caught at its first micro-batch, whose state is the caller's (unless handed
    over: ``fpipe.GPipe``'s module stages, which copy what they write)."""
    return None if state_owned() else state


def _signature(inputs: tuple[Value, ...]) -> tuple:
    """The shapes and dtypes of a call's tensor inputs: a stage may take another path (and
    reach other tensors) for another shape, so each is searched once."""
    return tuple((leaf.shape, leaf.dtype) if isinstance(leaf, torch.Tensor) else None
                 for value in inputs for leaf in value.leaves)


def _flat_state(state: Any) -> tuple[list, Any]:
    """A new state's leaves and what rebuilds it: a flat dict of tensors (a module stage's
    buffers, hundreds a call in a model of many BatchNorms) by its keys, in its own order
    (``dict(zip(keys, leaves))``: no sort, no spec); anything else by optree."""
    if type(state) is dict:
        leaves = list(state.values())
        if tensors_only(leaves):
            return leaves, tuple(state)
    return optree.tree_flatten(state)


def _state_of(spec: Any, leaves: list) -> Any:
    """The state :func:`_flat_state` flattened, rebuilt from its (new) leaves."""
    return dict(zip(spec, leaves)) if type(spec) is tuple else optree.tree_unflatten(spec, leaves)


def _no_history(inputs: tuple[Value, ...], index: list) -> bool:
    """Whether no input leaf the call does not differentiate requires grad (one that does
    would lead a backward into the caller's graph, or into a leaf of the caller's): checked
    at every call, as a signature does not say it."""
    for value, where in zip(inputs, index):
        if len(where) < len(value.leaves):
            for i, leaf in enumerate(value.leaves):
                if i not in where and getattr(leaf, "requires_grad", False):
                    return False
    return True


def _tensor_indices(leaves: list) -> range | list[int]:
    """The indices of ``leaves`` that are tensors: all of them (a ``range``, found by a loop in
    C) for a stateful stage's buffers, hundreds a call in a model of many BatchNorms."""
    if tensors_only(leaves):
        return range(len(leaves))
    return [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]


def _requiring(value: Value) -> Any:
    """``value``'s tree with its differentiable leaves made to require grad (detached views,
    sharing data and version counters), as a vjp sees them."""
    if not value.grad_index:
        return value.tree()
    leaves = list(value.leaves)
    for i in value.grad_index:
        leaves[i] = leaves[i].detach().requires_grad_()
    return optree.tree_unflatten(value.spec, leaves)


def _split_outputs(outs: list[Value]) -> tuple[list, list]:
    """The differentiated leaves of ``outs``, and ``(output, leaf)`` of their other tensors."""
    if len(outs) == 1 and outs[0].leaves and len(outs[0].grad_index) == len(outs[0].leaves):
        return list(outs[0].leaves), []
    grads = [out.leaves[i] for out in outs for i in out.grad_index]
    if not grads:
        raise StageError("the stage returned no floating-point tensor, so no gradient can "
                         "flow back through it")
    kept = [(k, i) for k, out in enumerate(outs) for i, leaf in enumerate(out.leaves)
            if isinstance(leaf, torch.Tensor) and i not in out.grad_index]
    return grads, kept


_VERSION = attrgetter("_version")


class _Watch:
    """The version counters of every tensor a stage call is given (parameters, state, inputs):
    a stage that writes into one in place is caught right after that call, before the next
    call could change the caller's tensors again, and the error names the leaf."""

    __slots__ = ("call", "params", "state", "inputs", "tensors", "versions")

    def __init__(self, call: StageCall, params: list, state: Any, inputs: tuple[Value, ...],
                 differentiated: list | None = None) -> None:
        """``differentiated``: per input, the indices of leaves autograd differentiates (and
        so protects, with the parameters), when the call runs under a vjp."""
        self.call, self.params, self.state, self.inputs = call, params, state, inputs
        leaves = [] if differentiated is not None else list(params)
        if state is not None:
            leaves += optree.tree_leaves(state)
        for i, value in enumerate(inputs):
            skip = differentiated[i] if differentiated is not None else ()
            if not skip:
                leaves += value.leaves
            elif len(skip) < len(value.leaves):  # (else every leaf is differentiated)
                leaves += [leaf for j, leaf in enumerate(value.leaves) if j not in skip]
        tensors = tensors_of(leaves)
        try:  # (map: a loop in C, over hundreds of tensors a call in a model of many)
            versions = list(map(_VERSION, tensors))
        except RuntimeError:  # an inference tensor (torch.inference_mode) keeps no version
            tensors = [t for t in tensors if not t.is_inference()]
            versions = list(map(_VERSION, tensors))
        self.tensors, self.versions = tensors, versions

    def check(self) -> None:
        if list(map(_VERSION, self.tensors)) == self.versions:
            return
        for tensor, version in zip(self.tensors, self.versions):
            if tensor._version != version:
                raise StageError(f"the stage wrote in place into {self._name(tensor)}; stages "
                                 f"must be pure (compute a new tensor instead): the caller's "
                                 f"tensor was changed")

    def _name(self, tensor: torch.Tensor) -> str:
        trees = [("params", optree.tree_unflatten(self.call.param_spec, self.params)),
                 ("state", self.state),
                 *((what, value.tree())
                   for what, value in zip(self.call.inputs_named, self.inputs))]
        for what, tree in trees:
            paths, leaves, _ = optree.tree_flatten_with_path(tree)
            for path, leaf in zip(paths, leaves):
                if leaf is tensor:
                    return what + "".join(f"[{key!r}]" for key in path)
        return "a tensor it was given"
