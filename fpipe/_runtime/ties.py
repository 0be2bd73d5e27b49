"""Tied weights: one tensor used by several stages (a language model's token embedding on the
first stage and the output head that reuses it on the last), held as one copy per stage.

The copies stay equal if every copy's gradient is the SUM of all the copies' gradients, which
is the gradient of the one shared tensor: an optimiser step applied alike to each copy then
leaves them equal. This module reads and checks a tie map (``ties=`` of both faces) and sums
gradients across the stages one process holds; :mod:`fpipe._runtime.ranks.tie_groups` adds the sum
across ranks.

A tie map is an iterable of ties, each an iterable of at least two ``(stage, name)`` pairs,
``name`` the leaf's dotted path in that stage's parameter pytree
(:func:`fpipe._runtime.trees.leaf_names`, as ``fpipe.saving.names`` spells it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch

from fpipe._runtime.trees import leaf_names
from fpipe._runtime.values import frozen

__all__ = ["Member", "parse", "describe", "slots", "check_local", "total", "assign",
           "targets", "TieSums"]


class Member(NamedTuple):
    """One copy of a tied tensor: the stage that holds it and its leaf's name there."""

    stage: int
    name: str


Ties = tuple[tuple[Member, ...], ...]


def describe(tie: Sequence[Member], index: int) -> str:
    """``tie 0 ((0, 'wte.weight'), (2, 'head.weight'))``, for error messages."""
    return f"tie {index} ({', '.join(f'({m.stage}, {m.name!r})' for m in tie)})"


def parse(ties: Iterable | None, n_stages: int) -> Ties:
    """The tie map as a tuple of ties of :class:`Member`, checked for what needs no tensor:
    every member a ``(stage, name)`` pair of an existing stage, at least two members per tie,
    and no leaf in two ties (or twice in one). ``None`` is no tie."""
    if ties is None:
        return ()
    if isinstance(ties, (str, bytes, Mapping)) or not isinstance(ties, Iterable):
        raise TypeError(f"ties must be an iterable of ties, each an iterable of (stage, name) "
                        f"pairs; got a {type(ties).__name__}")
    parsed: list[tuple[Member, ...]] = []
    seen: dict[Member, int] = {}
    for t, tie in enumerate(ties):
        if isinstance(tie, (str, bytes, Mapping)) or not isinstance(tie, Iterable):
            raise TypeError(f"tie {t} must be an iterable of (stage, name) pairs, got "
                            f"{tie!r}")
        tie = tuple(tie)
        if len(tie) == 2 and isinstance(tie[0], int) and isinstance(tie[1], str):
            raise TypeError(f"tie {t} is {tie!r}, one (stage, name) pair: ties is a list of "
                            f"ties, each a list of pairs (one tie: ties=[[{tie!r}, ...]])")
        members = tuple(_member(pair, t, n_stages) for pair in tie)
        if len(members) < 2:
            raise ValueError(f"{describe(members, t)} has {len(members)} member(s): a tie "
                             f"joins at least two (stage, name) pairs")
        for member in members:
            if member in seen:
                where = "twice" if seen[member] == t else f"also in tie {seen[member]}"
                raise ValueError(f"{describe(members, t)}: stage {member.stage}'s leaf "
                                 f"{member.name!r} is {where}; a leaf belongs to at most one "
                                 f"tie")
            seen[member] = t
        parsed.append(members)
    return tuple(parsed)


def _member(pair: Any, tie: int, n_stages: int) -> Member:
    if not isinstance(pair, (str, bytes)) and isinstance(pair, Iterable):
        pair = tuple(pair)
    if not isinstance(pair, tuple) or len(pair) != 2:
        raise TypeError(f"tie {tie}: each member must be a (stage, name) pair, got {pair!r}")
    stage, name = pair
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise TypeError(f"tie {tie}: the stage of member {pair!r} must be an int")
    if not isinstance(name, str):
        raise TypeError(f"tie {tie}: the name of member {pair!r} must be a str (the leaf's "
                        f"dotted path in its stage's parameters, e.g. 'wte.weight')")
    if not 0 <= stage < n_stages:
        raise ValueError(f"tie {tie}: member {pair!r} names stage {stage}, but the pipeline "
                         f"has stages 0 to {n_stages - 1}")
    return Member(stage, name)


def slots(ties: Ties, params: Mapping[int, Any]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per tie, ``(stage, leaf index)`` of each member whose stage is in ``params`` (this
    process's stages): the member's position among its stage's flat parameter leaves. A name
    that is no leaf of its stage is an error listing the stage's names."""
    index = {s: {name: i for i, name in enumerate(leaf_names(tree))}
             for s, tree in params.items()}
    found = []
    for t, tie in enumerate(ties):
        held = []
        for member in tie:
            if member.stage not in index:
                continue
            names = index[member.stage]
            if member.name not in names:
                known = ", ".join(map(repr, list(names)[:12])) or "none"
                more = " ..." if len(names) > 12 else ""
                raise ValueError(f"{describe(tie, t)}: stage {member.stage} has no parameter "
                                 f"leaf {member.name!r}; its leaves are {known}{more}")
            held.append((member.stage, names[member.name]))
        found.append(tuple(held))
    return tuple(found)


def check_local(ties: Ties, places: tuple, params: Mapping[int, Any]) -> None:
    """The copies held here agree: equal shape, dtype and values (a copy that already differs
    from another when the pipeline is built is a bug the sums would carry on)."""
    leaves = {s: optree.tree_leaves(tree) for s, tree in params.items()}
    for t, (tie, held) in enumerate(zip(ties, places)):
        # slots() keeps the members of the stages held here, in tie order
        members = [(m, leaves[s][i]) for m, (s, i) in
                   zip([m for m in tie if m.stage in params], held)]
        if len(members) < 2:
            continue
        (first, a) = members[0]
        for member, b in members[1:]:
            what = (f"{describe(tie, t)}: stage {first.stage}'s {first.name!r} and stage "
                    f"{member.stage}'s {member.name!r}")
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(f"{what} differ: {tuple(a.shape)} {a.dtype} against "
                                 f"{tuple(b.shape)} {b.dtype}; tied leaves must have equal "
                                 f"shape and dtype")
            if frozen(a) != frozen(b):
                raise ValueError(f"{what}: one is frozen (an nn.Parameter with "
                                 f"requires_grad=False) and the other is not; a tied weight "
                                 f"is one tensor, trained or frozen as a whole")
            if not torch.equal(a, b.to(a.device)):
                raise ValueError(f"{what} hold different values; tied copies must start "
                                 f"equal (copy one into the other before building the "
                                 f"pipeline)")


def total(grads: Sequence[list | None], held: Sequence[tuple[int, int]],
          zeros: Any = None) -> torch.Tensor | None:
    """The sum of the held members' gradients, in member order, on the first member's device
    and in the widest of their dtypes; a ``None`` gradient (or stage) counts as zero. ``None``
    if no member has one, unless ``zeros()`` makes the zero to return instead."""
    found = [grads[s][i] for s, i in held if grads[s] is not None and grads[s][i] is not None]
    if not found:
        return None if zeros is None else zeros()
    dtype = found[0].dtype
    for grad in found[1:]:
        dtype = torch.promote_types(dtype, grad.dtype)
    device = found[0].device
    result = found[0].to(dtype)
    for grad in found[1:]:
        result = result + grad.to(device, dtype)
    return result


def assign(grads: list, held: Sequence[tuple[int, int]], value: torch.Tensor,
           targets: Sequence[tuple[torch.device, torch.dtype]]) -> None:
    """Give each held member its own copy of ``value``, on its parameter's device and in its
    gradient dtype (``targets``, per member): no two members share a tensor, so an optimiser
    that writes into one gradient leaves the others alone."""
    for (s, i), target in zip(held, targets):
        # (a stage without a backward here returns no gradients; a frozen tie has no target)
        if grads[s] is not None and target is not None:
            grads[s][i] = value.to(*target, copy=True)


def targets(places: tuple, params: Mapping[int, Any], grad_dtype: torch.dtype | None,
            ) -> tuple[tuple[tuple[torch.device, torch.dtype], ...], ...]:
    """Per tie, each held member's gradient device and dtype (``grad_dtype``, or the
    parameter's own dtype); ``None`` for a frozen member, which gets no gradient."""
    leaves = {s: optree.tree_leaves(tree) for s, tree in params.items()}
    return tuple(tuple(None if frozen(leaves[s][i]) else
                       (leaves[s][i].device, grad_dtype or leaves[s][i].dtype)
                       for s, i in held)
                 for held in places)


class TieSums:
    """The local face's ties: built once from the pipeline's parameters (checked), applied to
    each step's flat per-stage gradients (:meth:`__call__`) before they become pytrees."""

    def __init__(self, ties: Iterable | None, params: Sequence[Any],
                 grad_dtype: torch.dtype | None) -> None:
        self.ties = parse(ties, len(params))
        trees = dict(enumerate(params))
        self.places = slots(self.ties, trees)
        check_local(self.ties, self.places, trees)
        self.targets = targets(self.places, trees, grad_dtype)

    def __bool__(self) -> bool:
        return bool(self.ties)

    def __call__(self, grads: list) -> list:
        """Per stage, its flat gradient leaves with every tied leaf's replaced by the tie's
        sum (new lists: the step's own are left as they were)."""
        if not self.ties:
            return grads
        grads = [None if g is None else list(g) for g in grads]
        for held, where in zip(self.places, self.targets):
            value = total(grads, held)
            if value is not None:
                assign(grads, held, value, where)
        return grads
