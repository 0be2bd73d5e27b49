"""The two autodiff engines a stage's vjp is taken with, on flat lists of leaves.

Both have one signature: ``engine(fn, params, inputs)`` with ``fn(params, inputs) ->
(outputs, aux)`` over lists of tensors returns the detached outputs, ``vjp_fn`` and the
detached aux; ``vjp_fn(cotangents)`` returns ``(param_grads, input_grads)``, ``None`` for a
parameter and zeros for an input that does not reach the outputs, and may be called once.

- :func:`func_vjp` is ``torch.func.vjp(fn, params, inputs, has_aux=True)`` without its pytree
  layer, which costs more than a small stage's arithmetic: the same functorch calls
  (a grad level, leaves wrapped and made differentiable, outputs unwrapped) on the lists
  directly. It needs functorch's internal functions; where they are missing (another torch),
  it is ``torch.func.vjp`` itself (:func:`public_func_vjp`). Both give the same gradients,
  bit for bit (``tests/test_vjp.py``).
- :func:`autograd_vjp` takes the same vjp through ``torch.autograd``: leaves detached and made
  to require grad, the outputs' graph walked by autograd's engine. Given ``accumulate`` (the
  step's own leaves for the parameters, see :class:`~fpipe._runtime.step.GradSums`), the
  backward adds the parameters' gradients into those leaves' ``.grad`` inside the engine, as
  ``loss.backward()`` does, and ``vjp_fn`` returns ``None`` for them.

Backwards call autograd's engine through ``torch.autograd.graph._engine_run_backward``, the
function ``torch.autograd.grad`` ends in, once the cotangents are checked to fit the outputs
(same shapes, plain tensors); otherwise, or without that function, through
``torch.autograd.grad`` itself, whose checks then explain what does not fit.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter

import torch
from torch.func import vjp as _torch_func_vjp
from torch.torch_version import TorchVersion

__all__ = ["func_vjp", "public_func_vjp", "autograd_vjp", "run_backward", "resume_backward",
           "zeros_for_none"]

try:  # functorch's internals, as torch.func.vjp calls them (torch 2.3 to 2.13 at least)
    if TorchVersion(torch.__version__) < (2, 3):
        raise ImportError("functorch's internals are used from torch 2.3 on")
    from torch._C._functorch import (
        _grad_decrement_nesting,
        _grad_increment_nesting,
        _unwrap_for_grad,
        _wrap_for_grad,
        get_inplace_requires_grad_allowed,
        set_inplace_requires_grad_allowed,
    )
except ImportError:
    _grad_increment_nesting = None

try:
    from torch.autograd.graph import _engine_run_backward
except ImportError:
    _engine_run_backward = None

_HOOKS = ("torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor hooks. "
          "Please open an issue with your use case.")


def run_backward(outs: list, cotangents: list, inputs: list, accumulate: bool = False,
                 keep_graph: bool = False) -> tuple | None:
    """The gradients of ``inputs`` given the ``cotangents`` of ``outs`` (``None`` where an
    input is not reached), or with ``accumulate``, nothing: the gradients are added into the
    inputs' ``.grad``. The graph is freed, unless ``keep_graph``."""
    fit = _engine_run_backward is not None
    for o, c in zip(outs, cotangents):  # what torch.autograd.grad's checks would pass (the
        # engine checks dtypes and devices itself): plain tensors of the outputs' shapes
        if type(o) is not torch.Tensor or type(c) is not torch.Tensor or o.shape != c.shape:
            fit = False
            break
    if fit:
        grads = _engine_run_backward(tuple(outs), tuple(cotangents), keep_graph, False,
                                     tuple(inputs), True, accumulate_grad=accumulate)
        return None if accumulate else grads
    if accumulate:
        torch.autograd.backward(outs, cotangents, inputs=inputs, retain_graph=keep_graph)
        return None
    return torch.autograd.grad(outs, inputs, cotangents, allow_unused=True,
                               retain_graph=keep_graph)


def resume_backward(edges: list, inputs: list, grads: list) -> tuple:
    """``torch.autograd.grad(edges, inputs, grads, allow_unused=True)`` from graph edges
    (each a ``GradientEdge``) whose gradients were recorded in an earlier backward of the graph
    (so of the edges' shapes, on their devices: what ``grad``'s checks would pass), as a split
    backward's weight half resumes (:mod:`fpipe._runtime.split_backward`). It makes one such
    call per recorded node: through the engine's entry point, each costs about a third of
    ``grad``'s host time (30 against 80 us on the 2-core CPU)."""
    if _engine_run_backward is None:  # pragma: no cover - older torch
        return torch.autograd.grad(edges, inputs, grads, allow_unused=True)
    return _engine_run_backward(tuple(edges), tuple(grads), False, False, tuple(inputs), True,
                                accumulate_grad=False)


def zeros_for_none(grads: tuple | list, like: list) -> list:
    """``grads`` with zeros shaped like ``like``'s in place of ``None`` (an input no output
    reached still hands a cotangent on)."""
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, like)]


def _split_grads(grads: tuple | list | None, params: list, inputs: list) -> tuple[list, list]:
    """``(param_grads, input_grads)`` from one backward's gradients of ``params + inputs``
    (``None``: nothing reached): a parameter the outputs do not use keeps ``None`` (so it gets
    no ``.grad``, as in PyTorch), an input gets zeros (its cotangent goes on to the stage
    before)."""
    n = len(params)
    if grads is None:
        return [None] * n, [torch.zeros_like(x) for x in inputs]
    return list(grads[:n]), zeros_for_none(grads[n:], inputs)


def public_func_vjp(fn: Callable, params: list, inputs: list) -> tuple:
    """``torch.func.vjp`` itself, with the engines' signature."""
    params = _constants(params)
    outs, vjp_fn, aux = _torch_func_vjp(fn, params, inputs, has_aux=True)
    return outs, lambda cotangents: tuple(vjp_fn(list(cotangents))), aux


def _func_vjp(fn: Callable, params: list, inputs: list) -> tuple:
    """What ``torch.func.vjp(fn, params, inputs, has_aux=True)`` runs, on the lists."""
    params = _constants(params)
    with torch.autograd.graph.disable_saved_tensors_hooks(_HOOKS):
        level = _grad_increment_nesting()
        try:
            with torch.enable_grad():
                allowed = get_inplace_requires_grad_allowed()
                set_inplace_requires_grad_allowed(True)
                try:
                    params = [_wrap_for_grad(p, level).requires_grad_() for p in params]
                    inputs = [_wrap_for_grad(x, level).requires_grad_() for x in inputs]
                finally:
                    set_inplace_requires_grad_allowed(allowed)
                outs, aux = fn(params, inputs)
                aux = [_unwrap_for_grad(a, level) for a in aux]
                results = [_unwrap_for_grad(o, level) for o in outs]
        finally:
            _grad_decrement_nesting()
    diff = params + inputs
    n = len(params)

    def vjp_fn(cotangents: list) -> tuple[list, list]:
        pairs = [(o, c) for o, c in zip(outs, cotangents) if o.requires_grad]
        grads = None
        if pairs:
            with torch._dynamo.compiled_autograd._disable(), _inference_mode_off():
                grads = run_backward([o for o, _ in pairs], [c for _, c in pairs], diff)
        return _split_grads(grads, diff[:n], diff[n:])

    return results, vjp_fn, aux


_REQUIRES_GRAD = attrgetter("requires_grad")

func_vjp = public_func_vjp if _grad_increment_nesting is None else _func_vjp


def _constants(params: list) -> list:
    """A training step's parameters are its own leaves, requiring grad (see
    ``fpipe._runtime.values.param_leaves``): the transform is given them detached, so that
    no graph is recorded around it as well."""
    return [p.detach() if p.requires_grad else p for p in params]


class _inference_mode_off:
    """Autograd runs outside inference mode; grad mode is left as it is (as torch.func's
    vjp function does, which may run after the caller entered inference mode)."""

    __slots__ = ("state",)

    def __enter__(self) -> None:
        self.state = None
        if torch.is_inference_mode_enabled():
            self.state = torch.inference_mode(False)
            grad, forward_grad = torch.is_grad_enabled(), torch._C._is_fwd_grad_enabled()
            self.state.__enter__()
            torch._C._set_grad_enabled(grad)
            torch._C._set_fwd_grad_enabled(forward_grad)

    def __exit__(self, *exc: object) -> None:
        if self.state is not None:
            self.state.__exit__(*exc)


def autograd_vjp(fn: Callable, params: list, inputs: list,
                 accumulate: list | None = None, closed: bool = False) -> tuple:
    """The vjp through ``torch.autograd``; with ``accumulate`` (leaves that require grad, in
    place of ``params``), parameter gradients are added into their ``.grad``.

    ``closed`` (with ``accumulate``): the caller knows the graph ends in ``accumulate`` and the
    inputs alone (:func:`fpipe._runtime.given.closed_over`), so the backward adds into every
    leaf it reaches without naming them: named, autograd first walks the whole graph to mark
    what leads to them (its ``exec_info``), a hash map entry and allocations per node, every
    backward (16.7 M of 2,474 M instructions a step of benchmarks/instructions.py's model)."""
    params = accumulate if accumulate is not None else \
        [p.detach().requires_grad_() for p in params]
    inputs = [x.detach().requires_grad_() for x in inputs]
    if torch.is_grad_enabled():  # as in every training step
        outs, aux = fn(params, inputs)
    else:
        with torch.enable_grad():
            outs, aux = fn(params, inputs)
    diff = params + inputs

    def vjp_fn(cotangents: list) -> tuple[list | None, list]:
        outs_, cotangents_ = outs, cotangents
        for o in outs:
            if not o.requires_grad:  # only outputs that depend on a leaf take part
                pairs = [(o, c) for o, c in zip(outs, cotangents) if o.requires_grad]
                outs_, cotangents_ = [o for o, _ in pairs], [c for _, c in pairs]
                break
        if not outs_ or not diff:  # nothing to differentiate (a stage without parameters
            # and inputs without gradient, or outputs that depend on none of them)
            param_grads, input_grads = _split_grads(None, params, inputs)
            return None if accumulate is not None else param_grads, input_grads
        if accumulate is None:
            return _split_grads(run_backward(outs_, cotangents_, diff), params, inputs)
        run_backward(outs_, cotangents_, () if closed else diff, accumulate=True)
        grads = []
        for x in inputs:
            grad = x.grad
            grads.append(torch.zeros_like(x) if grad is None else grad)
        return None, grads

    detached = [o.detach() for o in outs]
    return detached, vjp_fn, _detached(aux) if aux else aux


def _detached(values: list) -> list:
    """``values`` out of the graph: a tensor that requires grad detached, the rest as they are
    (a stateful stage's running statistics, hundreds a call in a model of many BatchNorms)."""
    try:  # (none requires grad, the usual case: one loop in C)
        if not any(map(_REQUIRES_GRAD, values)):
            return values
    except AttributeError:  # a value that is not a tensor
        pass
    return [v.detach() if isinstance(v, torch.Tensor) and v.requires_grad else v
            for v in values]
