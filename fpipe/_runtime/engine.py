"""What every face does alike around a step: its options checked, a non-finite loss refused,
and for a step run in two calls (``vjp``) the outputs' cotangents split and the input's
gradients joined. ``fpipe.pipeline`` and ``fpipe.distributed.pipeline`` both call these, so the
two cannot drift."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import optree
import torch

from fpipe._runtime import microbatch
from fpipe._runtime.trees import tree_flatten
from fpipe.errors import NonFiniteLossError

__all__ = ["check_options", "check_stages", "check_training", "check_untransformed",
           "nonfinite_error", "returned_loss",
           "output_cotangent", "output_cotangents", "input_grads"]

NONFINITE = ("raise", "ignore")


def check_options(nonfinite: str, grad_dtype: torch.dtype | None) -> None:
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be 'raise' or 'ignore', got {nonfinite!r}")
    if grad_dtype is not None and not (isinstance(grad_dtype, torch.dtype)
                                       and grad_dtype.is_floating_point):
        raise TypeError(f"grad_dtype must be a floating-point torch.dtype, got {grad_dtype!r}")


def check_stages(stages: Sequence[Any]) -> None:
    """Every stage is a function ``stage(params, x)``; an ``nn.Module`` (whose parameters would
    be neither trained nor returned) is refused, pointing to the adapter that makes stages of
    modules."""
    if not stages:
        raise ValueError("a pipeline needs at least one stage; got an empty list of stages")
    for s, stage in enumerate(stages):
        module = getattr(stage, "_orig_mod", stage)  # what torch.compile(module) wraps
        if isinstance(module, torch.nn.Module) and not _takes_params(module):
            raise TypeError(
                f"stage {s} is an nn.Module ({type(module).__name__}); fpipe stages are "
                f"functions stage(params, x) -> y of explicit parameters, which fpipe "
                f"differentiates and returns gradients for. Make stages of modules with "
                f"fpipe.stages.from_modules([...]) (or from_sequential for an nn.Sequential) "
                f"and pass its .stages and .params; or use fpipe.GPipe, the nn.Module face")
        if not callable(stage):
            raise TypeError(f"stage {s} is a {type(stage).__name__}, not a callable "
                            f"stage(params, x) -> y")


def check_training() -> None:
    """A training step refused under ``torch.inference_mode()``, whose tensors take no part
    in autograd, before anything runs."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError("a training step cannot run under torch.inference_mode(): "
                           "tensors made there take no part in autograd; call pipe(x) "
                           "for a forward-only step")


# What each functorch transform is called by users, for the message.
_TRANSFORMS = {"Grad": "torch.func.grad / vjp / jacrev", "Jvp": "torch.func.jvp / jacfwd",
               "Vmap": "torch.func.vmap", "Functionalize": "torch.func.functionalize"}


def check_untransformed(entry: str, x: Any = None, **trees: Any) -> None:
    """Refuse a call made under a ``torch.func`` transform, or with a forward-mode dual tensor
    anywhere in what it was given: ``x`` (the input) and each of ``trees`` (``target=``,
    ``params=``, ``state=``, a vjp's ``cotangent=``), at any depth of a pytree.

    A pipeline runs its stages on worker threads (or other ranks) and takes their vjps
    itself: a transform of the caller's thread would see the pipeline's outputs as constants
    and return zeros, silently; a dual tensor's tangent would reach only what it touches
    directly (a dual target gives the loss a tangent that misses every stage), and is lost
    between ranks. So every entry point says so at once, naming what to call instead."""
    interpreter = _peek_interpreter() if _transforms_active() else None
    if interpreter is not None:
        kind = interpreter.key().name
        how = _TRANSFORMS.get(kind, f"a torch.func transform ({kind})")
    else:
        holder = _dual_holder({"input": x, **trees})
        if holder is None:
            return
        how = f"torch.autograd.forward_ad (a dual tensor in its {holder})"
    raise RuntimeError(
        f"{entry} was called under {how}. fpipe runs each stage's forward and vjp itself, on "
        f"its own worker threads or ranks, where the transform does not reach: it would see "
        f"the pipeline's result as a constant and give zeros. Call the pipeline's own "
        f"transforms instead: loss, grads = pipe.value_and_grad(x, target) for gradients of "
        f"a loss, y, vjp_fn = pipe.vjp(x) for a vjp (vjp_fn(cotangent) -> (param_grads, "
        f"x_grad)); for a batch of inputs pass the batch itself (dim 0 is the batch), not "
        f"vmap. fpipe.GPipe's gradients come from loss.backward()")


def _dual_holder(trees: dict[str, Any]) -> str | None:
    """The name of the first of ``trees`` holding a forward-mode dual tensor, if any (none
    can exist outside ``forward_ad.dual_level()``)."""
    if _forward_ad_level() < 0:
        return None
    for name, tree in trees.items():
        for leaf in tree_flatten(tree)[0]:
            if isinstance(leaf, torch.Tensor) and \
                    torch.autograd.forward_ad.unpack_dual(leaf).tangent is not None:
                return name
    return None


try:  # functorch's interpreter stack: not None inside a transform
    from torch._C._functorch import peek_interpreter_stack as _peek_interpreter
except ImportError:  # pragma: no cover - torch without functorch's C++ layer
    def _peek_interpreter() -> Any:
        return None

# Whether a transform is active, read from the dispatch keys. Asked first because peeking at
# the interpreter stack creates functorch's state for the calling thread, which then lives as
# long as the thread, and every autograd node the thread runs copies it twice (at::
# ThreadLocalState): 2% more host work in every backward after the first call, the caller's
# own plain PyTorch's too (a pipeline stage of 20 small ops: 203 M instructions a hundred
# backwards without it, 207.6 M with it).
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: True)


def _forward_ad_level() -> int:
    return getattr(torch.autograd.forward_ad, "_current_level", -1)


def _takes_params(module: torch.nn.Module) -> bool:
    """A module without parameters or buffers whose forward takes ``(params, x)``: a pure
    stage written as a module."""
    if next(module.parameters(), None) is not None or next(module.buffers(), None) is not None:
        return False
    try:
        inspect.signature(module.forward).bind(None, None)
    except (TypeError, ValueError):
        return False
    return True


def nonfinite_error(losses: torch.Tensor) -> NonFiniteLossError | None:
    """The error for a step whose micro-batch losses (a 1-d tensor) are not all finite; one
    host synchronisation on CUDA."""
    finite = torch.isfinite(losses)
    if finite.all():  # the common case: one reduction, no list
        return None
    bad = (~finite).nonzero().flatten().tolist()
    return NonFiniteLossError(
        f"the loss is not finite on micro-batch(es) {bad} (values "
        f"{[losses[m].item() for m in bad]}); no gradient was returned. Build the pipeline with "
        f"nonfinite='ignore' to handle this yourself", bad)


class ReturnedLoss(torch.Tensor):
    """The loss a step returns: a plain tensor (no graph, ``.numpy()`` works) whose
    ``backward()`` says that the gradients were returned with it, instead of torch's "does not
    require grad". Tensors computed from it are of this type too, and say the same."""

    def backward(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "backward() on a loss fpipe returned: the pipeline has already computed the "
            "gradients and returned them (loss, grads = pipe.value_and_grad(x, target)); "
            "nothing is stored in .grad. Bind them to your tensors for a torch.optim "
            "optimiser with fpipe.optim.bind_grads(params, grads)")

    def __repr__(self, **kwargs: Any) -> str:
        return repr(self.as_subclass(torch.Tensor))


def returned_loss(loss: torch.Tensor) -> ReturnedLoss:
    return loss.as_subclass(ReturnedLoss)


def output_cotangent(out: Any, piece: Any, microbatch: int) -> list:
    """The cotangents of one micro-batch's differentiable output leaves, from its piece of the
    caller's cotangent (shaped like the output; ``None`` where a leaf gets no gradient).

    A leaf without a batch dimension (a 0-dim tensor) is taken from micro-batch 0 when the
    outputs are joined, so only micro-batch 0 receives its cotangent: given to every
    micro-batch, its gradient would count ``chunks`` times."""
    try:
        leaves = out.spec.flatten_up_to(piece)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the cotangent must have the structure of the output "
                         f"({out.spec}): {exc}") from None
    for i, given in enumerate(leaves):
        if given is not None and not isinstance(given, torch.Tensor) and \
                isinstance(out.leaves[i], torch.Tensor):
            raise ValueError(f"the cotangent must have the structure of the output "
                             f"({out.spec}); at a tensor of the output it has a "
                             f"{type(given).__name__}")
    cotangents = []
    for i in out.grad_index:
        leaf, given = out.leaves[i], leaves[i]
        if given is None or (microbatch > 0 and leaf.dim() == 0):
            given = torch.zeros_like(leaf)
        cotangents.append(given)
    return cotangents


def output_cotangents(outputs: list, cotangent: Any, chunks: int) -> list[list]:
    """Every micro-batch's output cotangents (:func:`output_cotangent`), from the caller's
    ``cotangent`` for the whole batch (on the last stage's device), split as the input was."""
    pieces = microbatch.split(cotangent, chunks, "cotangent")
    return [output_cotangent(out, piece, m) for m, (out, piece) in enumerate(zip(outputs,
                                                                                pieces))]


def input_grads(inputs: list, found: list) -> Any:
    """The input's gradient for the whole batch, shaped like the input: batched leaves joined
    along dim 0, a 0-dim tensor given to every micro-batch summed over them, ``None`` where
    a leaf carries no gradient."""
    columns: list[list] = [[None] * len(inputs) for _ in inputs[0].leaves]
    for m, (value, grads) in enumerate(zip(inputs, found)):
        for i, grad in zip(value.grad_index, grads):
            columns[i][m] = grad
    joined = []
    for leaf, column in zip(inputs[0].leaves, columns):
        if column[0] is None:
            joined.append(None)
        elif leaf.dim() == 0:
            joined.append(torch.stack(column).sum(0))
        else:
            joined.append(torch.cat(column))
    return optree.tree_unflatten(inputs[0].spec, joined)
