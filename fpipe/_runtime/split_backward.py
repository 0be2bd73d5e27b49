"""One stage's backward in two halves: input gradients now, weight gradients later.

Zero-bubble schedules run a stage's input-gradient backward (``I``) as soon as the cotangent
arrives, because the previous stage is waiting for it, and defer the weight-gradient backward
(``W``), which nobody waits for, to fill idle time. ``torch.func.vjp`` returns both in one
call, so fpipe splits the autograd graph of the stage's single forward instead:

- ``I`` runs the backward through the nodes that lead to the stage's inputs only, keeps the
  graph, and records the gradient arriving at each such node that also feeds a branch leading
  only to parameters (a matmul's weight operand, a bias);
- ``W`` resumes from those recorded gradients into the parameter branches.

The forward runs once, and each node's arithmetic runs once across the two halves (a recorded
node runs twice, each time only for its own operands); what the split adds is host work: a walk
of the graph after the forward and one autograd call per recorded node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import Node
from torch.torch_version import TorchVersion

if TorchVersion(torch.__version__) >= (2, 4):
    from torch.autograd.graph import GradientEdge, get_gradient_edge
else:  # autograd cannot resume from a graph node: both halves run at I
    GradientEdge = get_gradient_edge = None

from fpipe._runtime.vjp import resume_backward, run_backward, zeros_for_none

__all__ = ["split_vjp", "SplitVJP"]


def split_vjp(fn: Callable, params: list, inputs: list, has_aux: bool = False) -> tuple:
    """Like ``torch.func.vjp(fn, params, inputs, has_aux=...)``, with the backward split.

    ``params`` and ``inputs`` are lists of tensors; ``fn(params, inputs)`` returns a list of
    tensors (and aux). Returns the detached outputs, a :class:`SplitVJP` and the detached aux.
    """
    params = [p.detach().requires_grad_() for p in params]
    inputs = [x.detach().requires_grad_() for x in inputs]
    with torch.enable_grad():
        result = fn(params, inputs)
    outs, aux = result if has_aux else (result, None)
    backward = SplitVJP(list(outs), params, inputs)
    detached = [out.detach() for out in outs]
    if not has_aux:
        return detached, backward
    aux = [a.detach() if isinstance(a, torch.Tensor) else a for a in aux]
    return detached, backward, aux


class SplitVJP:
    """The two halves of one vjp: call :meth:`input_grads` once, then :meth:`weight_grads`."""

    def __init__(self, outs: list, params: list, inputs: list) -> None:
        self._differentiable = [out.requires_grad for out in outs]
        self.outs = [out for out in outs if out.requires_grad]
        self.params = params
        self.inputs = inputs
        self._cotangents: list | None = None
        self._fused: list | None = None  # both halves, when they could not be split
        self._graph: _Graph | None = None
        self._recorded: dict[Node, tuple] = {}

    def input_grads(self, cotangents: list) -> list:
        """The gradients of the inputs (zeros where an input does not reach the outputs)."""
        cotangents = [c for c, keep in zip(cotangents, self._differentiable) if keep]
        self._cotangents = cotangents
        if not self.inputs:
            return []
        if not self.outs:  # no output depends on anything differentiated
            return [torch.zeros_like(x) for x in self.inputs]
        graph = None if GradientEdge is None else _Graph(self.outs, self.inputs, self.params)
        if graph is None or graph.entangled:
            # A parameter branch also reachable through another input-path node: resuming from
            # one recorded node would run the other again. Compute both halves now instead
            # (so too on torch < 2.4).
            grads = torch.autograd.grad(self.outs, self.inputs + self.params, cotangents,
                                        allow_unused=True)
            self._fused = list(grads[len(self.inputs):])
            return zeros_for_none(grads[:len(self.inputs)], self.inputs)
        self._graph = graph
        handles = [node.register_prehook(self._recorder(node)) for node in graph.recorded]
        try:
            grads = run_backward(self.outs, cotangents, self.inputs, keep_graph=True)
        finally:
            for handle in handles:
                handle.remove()
        return zeros_for_none(grads, self.inputs)

    def weight_grads(self) -> list:
        """The gradients of the parameters, from what :meth:`input_grads` recorded (``None``
        for a parameter the outputs do not use)."""
        if self._cotangents is None:
            raise RuntimeError("weight_grads() needs input_grads() first")
        cotangents, self._cotangents = self._cotangents, None
        if self._fused is not None:
            return self._fused
        if not self.params or not self.outs:  # a stage without parameters, or constant outputs
            return [None] * len(self.params)
        if not self.inputs:  # nothing was split off: the whole backward runs here
            return list(torch.autograd.grad(self.outs, self.params, cotangents,
                                            allow_unused=True))
        graph = self._graph
        # Gradients flowing into the parameter branches: from outputs that do not depend on
        # the inputs, and from each recorded node, run again for its branch operands only.
        arriving: dict[tuple[Node, int], torch.Tensor] = {}
        for out, cotangent in zip(self.outs, cotangents):
            edge = get_gradient_edge(out)
            if graph.is_branch(edge.node):
                _add(arriving, (edge.node, edge.output_nr), cotangent)
        for node in graph.recorded:
            given = [(GradientEdge(node, i), g)
                     for i, g in enumerate(self._recorded.pop(node)) if g is not None]
            branches = graph.branches(node)
            grads = resume_backward([e for e, _ in given], branches, [g for _, g in given])
            for branch, grad in zip(branches, grads):
                if grad is not None:
                    _add(arriving, (branch.node, branch.output_nr), grad)
        if not arriving:
            return [None] * len(self.params)
        edges = list(arriving)
        return list(resume_backward([GradientEdge(*e) for e in edges], self.params,
                                    [arriving[e] for e in edges]))

    def _recorder(self, node: Node) -> Callable:
        def record(grad_outputs: tuple) -> None:
            self._recorded[node] = grad_outputs
        return record


_INPUT, _PARAM = 1, 2


class _Graph:
    """Which nodes of a forward's graph lead to the inputs, which only to the parameters, and
    where the two meet."""

    def __init__(self, outs: list, inputs: list, params: list) -> None:
        kind = {id(x): _INPUT for x in inputs}
        kind.update((id(p), _PARAM) for p in params)
        # Per node, which of the inputs (bit 1) and parameters (bit 2) it leads to, by an
        # iterative post-order walk (deep stages would overflow Python's recursion limit).
        self.leads_to = leads_to = {}
        for out in outs:
            stack = [(out.grad_fn or get_gradient_edge(out).node, False)]
            while stack:
                node, expanded = stack.pop()
                if expanded:
                    found = 0
                    for child, _ in node.next_functions:
                        if child is not None:
                            found |= leads_to[child]
                    leads_to[node] = found
                elif node not in leads_to:
                    leaf = getattr(node, "variable", None)  # a gradient accumulator
                    leads_to[node] = 0 if leaf is None else kind.get(id(leaf), 0)
                    if leaf is None:
                        stack.append((node, True))
                        stack.extend((child, False) for child, _ in node.next_functions
                                     if child is not None and child not in leads_to)
        self.recorded = [node for node, found in leads_to.items() if found & _INPUT
                         and any(self.is_branch(child) for child, _ in node.next_functions)]
        # How many recorded nodes reach each branch node through branch nodes only.
        reached_by: dict[Node, int] = {}
        for node in self.recorded:
            seen: set[Node] = set()
            stack = [child for child, _ in node.next_functions if self.is_branch(child)]
            while stack:
                branch = stack.pop()
                if branch in seen:
                    continue
                seen.add(branch)
                reached_by[branch] = reached_by.get(branch, 0) + 1
                stack.extend(c for c, _ in branch.next_functions if self.is_branch(c))
        self.entangled = any(reached_by[edge.node] > 1
                             for node in self.recorded for edge in self.branches(node))

    def is_branch(self, node: Node | None) -> bool:
        """Whether ``node`` leads to parameters and not to inputs."""
        return node is not None and self.leads_to.get(node) == _PARAM

    def branches(self, node: Node) -> list:
        return [GradientEdge(child, nr) for child, nr in node.next_functions
                if self.is_branch(child)]


def _add(totals: dict, key: Any, grad: torch.Tensor) -> None:
    totals[key] = grad if key not in totals else totals[key] + grad
