"""A stage differentiates only what it is given: a tensor requiring grad that it reaches
otherwise is refused at its first differentiated call.

A stage's vjp is taken with respect to its parameters and inputs. A tensor that requires grad
but reaches the stage another way (another stage's parameter kept in a plain list, a closure
over a model's weight, a submodule set with ``object.__setattr__``) is a leaf of the stage's
graph that the vjp does not ask for: its gradient would be dropped without a word, and the
model would train as if that use of the weight were a constant. Plain PyTorch would have added
that use's gradient into the weight's ``.grad``.

So the first differentiated call of a stage for each input signature walks the graph behind its
outputs, once, and refuses any leaf there that the call was not given. The walk stops at the
inputs' own graph (a user's input that requires grad, cut into micro-batches, is given), and a
frozen tensor never enters it (it does not require grad).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from fpipe.errors import StageError

__all__ = ["ungiven_leaves", "check_given", "closed_over"]

_LEAF = "AccumulateGrad"  # the node autograd puts after a leaf that requires grad


def ungiven_leaves(outputs: Iterable, given: Iterable) -> list[torch.Tensor]:
    """The leaves requiring grad in the graph behind ``outputs`` that are not in ``given``
    (tensors: a given leaf is not reported, a given non-leaf's graph is not entered)."""
    given = [t for t in given if isinstance(t, torch.Tensor)]
    mine = {id(t) for t in given}
    stops = {id(t.grad_fn) for t in given if t.grad_fn is not None}
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    while stack:
        node = stack.pop()
        if id(node) in seen or id(node) in stops:
            continue
        seen.add(id(node))
        if type(node).__name__ == _LEAF:
            leaf = node.variable
            if id(leaf) not in mine and not any(leaf is f for f in found):
                found.append(leaf)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions
                     if next_node is not None and id(next_node) not in seen)
    return found


def closed_over(outputs: Iterable, leaves: Iterable) -> bool:
    """Whether the graph behind ``outputs`` ends in ``leaves`` alone (the call's own, detached):
    every leaf requiring grad it reaches is one of them, and it enters no graph recorded before
    the call. A backward from such outputs may then leave its leaves unnamed
    (see :func:`fpipe._runtime.vjp.autograd_vjp`). Leaves with a history of their own are never
    closed over: :func:`ungiven_leaves` would stop at that history, where a backward goes on."""
    leaves = [t for t in leaves if isinstance(t, torch.Tensor)]
    return all(t.grad_fn is None for t in leaves) and not ungiven_leaves(outputs, leaves)


def check_given(outputs: Iterable, given: Iterable,
                name_of: Callable[[torch.Tensor], str | None] | None = None) -> None:
    """Raise :class:`StageError` if the graph behind ``outputs`` holds a leaf requiring grad
    that is not in ``given``, naming it (``name_of(tensor)``, where the stage can) and the
    remedies."""
    found = ungiven_leaves(outputs, given)
    if not found:
        return
    leaf = found[0]
    name = name_of(leaf) if name_of is not None else None
    what = (f"{type(leaf).__name__}{tuple(leaf.shape)} {str(leaf.dtype).replace('torch.', '')}"
            + (f", the model's {name}" if name else ""))
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    raise StageError(
        f"the stage uses a tensor that requires grad but is not among its parameters or "
        f"inputs: {what}{more}. Its gradient would be lost (a stage's vjp differentiates only "
        f"what it is given). Register it in the stage's module (as a submodule or "
        f"nn.Parameter, not kept in a list, a closure or through object.__setattr__), or, if "
        f"another stage holds it, give this stage its own reference and cut with "
        f"fpipe.stages.from_modules, which finds the tie (pass the Stages value itself to "
        f"fpipe.pipeline); for a constant, detach it or set requires_grad=False")
