"""One stage on one micro-batch: its forward, with or without a vjp, and its backward.

Parameters and values cross this module as flat lists of leaves (optree), so any pytree optree
knows works, not only the containers ``torch.func`` flattens itself. Only floating-point tensor
leaves are differentiated; integer tensors (token ids, masks) and Python values travel beside
them unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import torch

from fpipe._runtime.compiled import batch_dynamic, is_compiled
from fpipe._runtime.split_backward import split_vjp
from fpipe._runtime.vjp import autograd_vjp, func_vjp
from fpipe.errors import StageError

__all__ = ["Value", "StageCall", "flatten", "differentiable", "check_output", "describe"]


def differentiable(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())


@dataclass(slots=True)
class Value:
    """A pytree passed between stages, flattened once: its leaves, structure and which leaves
    carry gradients. A cotangent for it is a list aligned with ``grad_index``."""

    leaves: list
    spec: optree.PyTreeSpec
    grad_index: tuple[int, ...]

    def tree(self) -> Any:
        return optree.tree_unflatten(self.spec, self.leaves)


_TENSOR = optree.tree_structure(torch.empty(0))  # the structure of a lone tensor


def flatten(tree: Any) -> Value:
    if type(tree) is torch.Tensor:  # the common case, without a walk
        return Value([tree], _TENSOR, (0,) if differentiable(tree) else ())
    leaves, spec = optree.tree_flatten(tree)
    return Value(leaves, spec, tuple(i for i, leaf in enumerate(leaves) if differentiable(leaf)))


class StageCall:
    """Runs one stage, ``fn(params, x) -> y``, on flat leaves.

    A stateful stage is ``fn(params, state, x) -> (y, new_state)``: its state (buffers such as
    running statistics) is an input and an output, never differentiated. A stage that pops
    skips takes them as a last argument, a dict by name; one that stashes skips returns
    ``(y, {name: value})`` (inside the ``(…, new_state)`` pair when stateful). Outputs are then
    ``[y, *stashed values in the order of stashes]`` and inputs ``(x, *popped values)``.

    ``loss_fn`` is given for the last stage of a training program: its forward then returns the
    micro-batch's loss, scaled by the micro-batch's share of the mini-batch, so that the sum over
    micro-batches is the mean over the whole batch.
    """

    def __init__(self, fn: Callable, param_spec: optree.PyTreeSpec, grad_input: bool,
                 loss_fn: Callable | None = None, stateful: bool = False,
                 pops: tuple[str, ...] = (), stashes: tuple[str, ...] = (),
                 autodiff: str = "func") -> None:
        self.fn = fn
        self.param_spec = param_spec
        self.grad_input = grad_input
        self.loss_fn = loss_fn
        self.stateful = stateful
        self.pops = pops
        self.stashes = stashes
        # A compiled stage is differentiated by torch.autograd (see fpipe._runtime.compiled), and
        # so is every stage with autodiff="autograd": the same vjp, without functorch's per-op cost.
        self.compiled = is_compiled(fn)
        self._vjp = autograd_vjp if self.compiled or autodiff == "autograd" else func_vjp
        # Whether forward_vjp can add parameter gradients into the step's leaves (autograd).
        self.accumulates = self._vjp is autograd_vjp

    def forward(self, params: list, x: Value, state: Any = None, popped: tuple = (),
                target: Any = None, weight: float = 1.0, size: int | None = None
                ) -> tuple[Any, Any]:
        """The outputs (or the scaled loss) and the new state, with no graph kept: for
        inference and for forwards that will be recomputed. ``size`` is the micro-batch's,
        which every output must keep on dim 0."""
        watch = _Watch(self, params, state, x, popped)
        with torch.no_grad():
            y, stashed, new_state = self._apply(
                optree.tree_unflatten(self.param_spec, params), state, x.tree(),
                tuple(value.tree() for value in popped), target, weight, size)
        watch.check()
        if self.loss_fn is not None:
            return y, new_state
        return self._outputs(y, stashed, size), new_state

    def forward_vjp(self, params: list, x: Value, state: Any = None, popped: tuple = (),
                    target: Any = None, weight: float = 1.0, size: int | None = None,
                    split: bool = False, accumulate: list | None = None) -> tuple[Any, Any, Any]:
        """The outputs (or scaled loss), the new state, and the function mapping the outputs'
        cotangents to ``(param_grads, input_grads)``, lists of leaves in output and input
        order; with ``split``, a :class:`~fpipe._runtime.split_backward.SplitVJP` giving the two
        halves. With ``accumulate`` (only where :attr:`accumulates`: the step's leaves for
        ``params``), the backward adds the parameters' gradients into their ``.grad`` and gives
        ``None`` for them (see :mod:`fpipe._runtime.vjp`)."""
        inputs = (x, *popped)
        index = [value.grad_index for value in inputs] if self.grad_input else [()] * len(inputs)
        side: list = []  # what leaves the transform beside the differentiated outputs

        def flat(param_leaves: list, grad_leaves: list):
            trees, k = [], 0
            for value, where in zip(inputs, index):
                full = value.leaves
                if where:
                    full = list(full)
                    for i in where:
                        full[i] = grad_leaves[k]
                        k += 1
                trees.append(optree.tree_unflatten(value.spec, full))
            y, stashed, new_state = self._apply(
                optree.tree_unflatten(self.param_spec, param_leaves), state, trees[0],
                tuple(trees[1:]), target, weight, size)
            state_leaves, state_spec, state_kept = [], None, []  # a stateless stage's
            if new_state is not None:
                state_leaves, state_spec = optree.tree_flatten(new_state)
                # Tensors that carry no gradient leave the transform as aux, which unwraps them.
                state_kept = [i for i, leaf in enumerate(state_leaves)
                              if isinstance(leaf, torch.Tensor)]
            if self.loss_fn is not None:
                outs, kept, grads = None, [], [y]
            else:
                outs = self._outputs(y, stashed, size)
                grads, kept = _split_outputs(outs)
            side.extend((outs, kept, state_leaves, state_spec, state_kept))
            aux = [outs[k].leaves[i] for k, i in kept] if kept else []
            if state_kept:
                aux += [state_leaves[i] for i in state_kept]
            return grads, aux

        # Autograd itself refuses writes into the differentiated leaves: watch the others.
        watch = _Watch(self, params, state, x, popped, index)
        try:
            differentiated = x.leaves if len(inputs) == 1 and len(index[0]) == len(x.leaves) \
                else [value.leaves[i] for value, where in zip(inputs, index) for i in where]
            if split:
                primals, vjp_fn, aux = split_vjp(flat, params, differentiated, has_aux=True)
            elif accumulate is not None:
                primals, vjp_fn, aux = autograd_vjp(flat, params, differentiated, accumulate)
            else:
                primals, vjp_fn, aux = self._vjp(flat, params, differentiated)
        except RuntimeError as exc:
            if "used in an in-place operation" not in str(exc):
                raise
            # Autograd refuses the write before it lands: the differentiated leaves are its.
            raise StageError("the stage writes in place into a tensor it was given (a "
                             "parameter or a floating-point input); stages must be pure: "
                             "compute a new tensor instead") from exc
        watch.check()
        outs, kept, state_leaves, state_spec, state_kept = side
        for (k, i), leaf in zip(kept, aux):
            outs[k].leaves[i] = leaf
        new_state = None
        if state_spec is not None:
            for i, leaf in zip(state_kept, aux[len(kept):]):
                state_leaves[i] = leaf
            new_state = optree.tree_unflatten(state_spec, state_leaves)
        if outs is None:
            return primals[0], new_state, vjp_fn
        k = 0
        for out in outs:
            for i in out.grad_index:
                out.leaves[i] = primals[k]
                k += 1
        return outs, new_state, vjp_fn

    def _apply(self, params: Any, state: Any, x: Any, popped: tuple, target: Any,
               weight: float, size: int | None = None) -> tuple[Any, tuple, Any]:
        """Call the stage (and the loss): ``(y or loss, stashed values, new state)``."""
        if self.compiled:
            x, popped = batch_dynamic((x, popped))
        args = (params, state, x) if self.stateful else (params, x)
        if self.pops:
            args += (dict(zip(self.pops, popped)),)
        result, new_state = self.fn(*args), None
        if self.stateful:
            result, new_state = _pair(result, "a stateful stage must return (y, new_state)")
        stashed: tuple = ()
        if self.stashes:
            result, stash = _pair(result, "a stage that stashes skips must return "
                                          "(y, {name: value})")
            if not isinstance(stash, dict) or set(stash) != set(self.stashes):
                got = sorted(stash) if isinstance(stash, dict) else type(stash).__name__
                raise StageError(f"the stage must stash exactly {list(self.stashes)}, "
                                 f"got {got}")
            stashed = tuple(stash[name] for name in self.stashes)
        if self.loss_fn is not None:
            if size is not None:  # the last stage keeps the micro-batch too
                check_output(flatten(result), size, "output")
            result = self._loss(result, target, weight)
        return result, stashed, new_state

    def _outputs(self, y: Any, stashed: tuple, size: int | None) -> list[Value]:
        """``[y, *stashed]`` flattened, each checked to keep the micro-batch's ``size``."""
        outs = [flatten(y), *(flatten(value) for value in stashed)]
        if size is not None:
            check_output(outs[0], size, "output")
            for name, value in zip(self.stashes, outs[1:]):
                check_output(value, size, f"stashed skip {name!r}")
        return outs

    def _loss(self, y: Any, target: Any, weight: float) -> torch.Tensor:
        try:
            loss = self.loss_fn(y, target)
        except Exception as exc:
            if target is None and hasattr(exc, "add_note"):
                exc.add_note("fpipe: no target was given: value_and_grad(x) passes target=None "
                             "to loss_fn; call value_and_grad(x, target)")
            raise
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise StageError(f"loss_fn must return a scalar (0-dim) tensor, got {shape}")
        if not differentiable(loss):
            raise StageError(f"loss_fn must return a floating-point tensor, got {loss.dtype}")
        return loss * weight


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


def _pair(result: Any, message: str) -> tuple[Any, Any]:
    if not isinstance(result, tuple) or len(result) != 2:
        raise StageError(f"{message}, got {type(result).__name__}")
    return result


class _Watch:
    """The version counters of every tensor a stage call is given (parameters, state, inputs):
    a stage that writes into one in place is caught right after that call, before the next
    call could change the caller's tensors again, and the error names the leaf."""

    __slots__ = ("call", "params", "state", "x", "popped", "tensors", "versions")

    def __init__(self, call: StageCall, params: list, state: Any, x: Value,
                 popped: tuple, differentiated: list | None = None) -> None:
        """``differentiated``: per input, the indices of leaves autograd differentiates (and
        so protects, with the parameters), when the call runs under a vjp."""
        self.call, self.params, self.state, self.x, self.popped = call, params, state, x, popped
        leaves = [] if differentiated is not None else list(params)
        if state is not None:
            leaves += optree.tree_leaves(state)
        for i, value in enumerate((x, *popped) if popped else (x,)):
            skip = differentiated[i] if differentiated is not None else ()
            if not skip:
                leaves += value.leaves
            elif len(skip) < len(value.leaves):  # (else every leaf is differentiated)
                leaves += [leaf for j, leaf in enumerate(value.leaves) if j not in skip]
        # Inference tensors (made under torch.inference_mode) keep no version counter.
        self.tensors = tensors = [leaf for leaf in leaves
                                  if isinstance(leaf, torch.Tensor) and not leaf.is_inference()]
        self.versions = [t._version for t in tensors] if tensors else tensors

    def check(self) -> None:
        for tensor, version in zip(self.tensors, self.versions):
            if tensor._version != version:
                raise StageError(f"the stage wrote in place into {self._name(tensor)}; stages "
                                 f"must be pure (compute a new tensor instead): the caller's "
                                 f"tensor was changed")

    def _name(self, tensor: torch.Tensor) -> str:
        trees = [("params", optree.tree_unflatten(self.call.param_spec, self.params)),
                 ("state", self.state), ("its input x", self.x.tree()),
                 *((f"skip {name!r}", value.tree())
                   for name, value in zip(self.call.pops, self.popped))]
        for what, tree in trees:
            paths, leaves, _ = optree.tree_flatten_with_path(tree)
            for path, leaf in zip(paths, leaves):
                if leaf is tensor:
                    return what + "".join(f"[{key!r}]" for key in path)
        return "a tensor it was given"


def check_output(out: Value, size: int, what: str) -> None:
    """A stage's ``what`` carries a tensor, and every tensor keeps the micro-batch's ``size``
    on dim 0 (0-dim tensors excepted)."""
    seen = False
    for leaf in out.leaves:
        if isinstance(leaf, torch.Tensor):
            seen = True
            if leaf.dim() > 0 and leaf.shape[0] != size:
                raise StageError(f"the stage's {what} {describe(out.tree())} does not keep "
                                 f"the micro-batch size {size} on dim 0 of every tensor")
    if not seen:
        raise StageError(f"the stage returned no tensor in its {what} (got {out.tree()!r}); it "
                         f"must be a tensor or a pytree with tensor leaves")


def describe(tree: Any) -> str:
    """Shapes and dtypes of a pytree's tensor leaves, for error messages."""
    def one(leaf: Any) -> str:
        if isinstance(leaf, torch.Tensor):
            return f"Tensor{tuple(leaf.shape)} {str(leaf.dtype).replace('torch.', '')}"
        return repr(leaf)
    return str(optree.tree_map(one, tree, none_is_leaf=True))
