"""``torch.utils.checkpoint(..., use_reentrant=True)`` inside a stage, refused at its first call.

The reentrant checkpoint (torch's behaviour where ``use_reentrant`` is left out, and Hugging
Face's with ``gradient_checkpointing_kwargs={"use_reentrant": True}``) is an autograd Function
whose backward reruns the function and calls ``torch.autograd.backward`` from inside the
engine. That cannot work under a vjp: torch refuses it once inputs are named (as every vjp
names the stage's leaves), and the parameters the function closes over are not inputs of its
node, so their gradients would not flow back through the graph. torch says so only in the
backward, after the forwards ran; a stage's first vjp is searched for the Function's node so
that the step stops at its first forward, naming the fix. ``use_reentrant=False`` works (it
recomputes through saved-tensor hooks, inside the stage's own graph).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fpipe.errors import StageError

__all__ = ["check_no_reentrant_checkpoint"]

_NODE = "CheckpointFunctionBackward"  # torch.utils.checkpoint.CheckpointFunction's node

REFUSED = ("the stage calls torch.utils.checkpoint with use_reentrant=True (torch's default "
           "where the argument is left out), whose backward cannot run under a vjp: its "
           "parameters' gradients would be lost, and torch refuses it in the backward. Pass "
           "use_reentrant=False (Hugging Face: model.gradient_checkpointing_enable("
           "gradient_checkpointing_kwargs={'use_reentrant': False}))")


def check_no_reentrant_checkpoint(outputs: Iterable[torch.Tensor]) -> None:
    """Raise :class:`StageError` if the graph behind ``outputs`` holds a reentrant checkpoint.
    The walk stops at the stage's leaves (its inputs and parameters are detached leaves)."""
    seen: set[int] = set()
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == _NODE:
            raise StageError(REFUSED)
        stack.extend(next_node for next_node, _ in node.next_functions
                     if next_node is not None and id(next_node) not in seen)
