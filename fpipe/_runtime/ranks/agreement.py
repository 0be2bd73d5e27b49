"""What the ranks of a distributed pipeline must agree on, compared once when it is built.

Ranks built differently do not fail where they differ: replicas whose parameters differ in
shape abort inside the backend's first gradient reduction, ranks given other schedules deadlock
or raise what looks like their stage's error. So every rank describes what must agree (its
:class:`Fingerprint`: the program, its placement and micro-batch count, the step's options,
and the trees, shapes and dtypes of the parameters and state of each stage it holds),
the descriptions travel in the gather every rank makes anyway when a pipeline is built
(:func:`fpipe._runtime.ranks.links.make_groups`), and :func:`check` compares them there, before any
group exists. Every rank compares the same list in the same order, so a mismatch is one
:class:`~fpipe.errors.PlacementError`, raised alike on every rank, naming the field, two ranks
and both values; nothing built differently reaches a collective.

Ranks of one pipeline must agree on every shared field; replicas of a worker (its
data-parallel group) on those and, stage by stage, on the parameters and state. The tie map
is compared by :mod:`fpipe._runtime.ranks.tie_groups`, alike on every rank too, before its groups
are made.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch

from fpipe._runtime.trees import leaf_names
from fpipe._runtime.values import frozen
from fpipe.errors import PlacementError
from fpipe.schedules.actions import Program

__all__ = ["Fingerprint", "fingerprint", "check"]

#: The longest value an error quotes; a longer one is cut, its difference kept in view.
_QUOTED = 240


class Fingerprint(NamedTuple):
    """What one rank built: where it sits (``ranks`` of its pipeline, its ``worker``, the
    ``replicas`` of its data-parallel group) and what must agree, as ``(field, value)``
    pairs: ``shared`` with every rank of its pipeline and replicas, ``held`` (per stage it
    holds) with its replicas."""

    ranks: tuple[int, ...]
    worker: int
    replicas: tuple[int, ...] | None
    shared: tuple[tuple[str, Any], ...]
    held: tuple[tuple[str, Any], ...]


def fingerprint(ranks: tuple[int, ...], worker: int, replicas: tuple[int, ...] | None,
                program: Program, options: Mapping[str, Any],
                params: Mapping[int, Any], state: Mapping[int, Any] | None) -> Fingerprint:
    """This rank's :class:`Fingerprint`. ``options``: the step's options that every rank must
    give alike (autodiff, grad_dtype, the data-parallel reductions), by name."""
    shared = (("stage count", program.n_stages), ("placement", program.placement),
              ("chunks", program.n_microbatches),
              *((f"worker {w}'s actions", " ".join(map(str, actions)))
                for w, actions in enumerate(program.workers)),
              *((name, _plain(value)) for name, value in sorted(options.items())),
              ("stateful", state is not None))
    held = tuple((f"stage {s}'s {what}", _tree(tree))
                 for s in sorted(params)
                 for what, tree in (("parameters", params[s]),
                                    ("state", None if state is None else state[s])))
    return Fingerprint(tuple(ranks), worker, None if replicas is None else tuple(replicas),
                       shared, held)


def check(everyone: Sequence[Fingerprint]) -> None:
    """Compare every rank's fingerprint (``everyone[r]`` is global rank ``r``'s) with the
    first rank of its pipeline's (shared fields) and of its data-parallel group's (shared and
    held); raise the first mismatch. Every rank runs this on the same list: all raise alike."""
    by_rank = dict(enumerate(everyone))
    for rank, mine in by_rank.items():
        first = mine.ranks[0]
        _compare(first, by_rank[first], rank, mine, "of one pipeline", held=False)
        if mine.replicas is not None:
            first = min(mine.replicas)
            _compare(first, by_rank[first], rank, mine, "replicas in one data_parallel group",
                     held=True)


def _compare(rank_a: int, a: Fingerprint, rank_b: int, b: Fingerprint, among: str, *,
             held: bool) -> None:
    if rank_a == rank_b:
        return
    fields = [*a.shared, *(a.held if held else ())]
    theirs = [*b.shared, *(b.held if held else ())]
    if held and a.worker != b.worker:
        fields, theirs = [("worker", a.worker)], [("worker", b.worker)]
    for (name, value), (other_name, other) in zip(fields, theirs):
        if name != other_name or value != other:
            _mismatch(name if name == other_name else "stages held", rank_a,
                      value if name == other_name else name, rank_b,
                      other if name == other_name else other_name, among)
    if len(fields) != len(theirs):
        _mismatch("stages held", rank_a, [n for n, _ in fields], rank_b,
                  [n for n, _ in theirs], among)


def _mismatch(field: str, rank_a: int, a: Any, rank_b: int, b: Any, among: str) -> None:
    raise PlacementError(
        f"rank {rank_a} and rank {rank_b} ({among}) built the pipeline with different "
        f"{field}: rank {rank_a} has {_quote(a, b)}, rank {rank_b} has {_quote(b, a)}; every "
        f"rank of a pipeline, and every replica, must be built alike (no step was run)")


def _quote(value: Any, other: Any) -> str:
    """``repr(value)``, cut to its part around where it starts to differ from ``other``."""
    text, against = repr(value), repr(other)
    if len(text) <= _QUOTED:
        return text
    start = next((i for i, (x, y) in enumerate(zip(text, against)) if x != y),
                 min(len(text), len(against)))
    begin = max(0, start - _QUOTED // 2)
    return f"{'...' if begin else ''}{text[begin:begin + _QUOTED]}..."


def _plain(value: Any) -> Any:
    """An option as a plain value that compares across processes (a dtype by its name)."""
    return str(value) if isinstance(value, torch.dtype) else value


def _tree(tree: Any) -> Any:
    """A tree's structure and, per leaf, its name, shape and dtype, and whether it is frozen
    (replicas must differentiate the same leaves: their gradient buckets must line up);
    non-tensor leaves by their type."""
    if tree is None:
        return None
    leaves = optree.tree_leaves(tree)
    return (str(optree.tree_structure(tree)),
            tuple((name, tuple(leaf.shape), str(leaf.dtype), *(("frozen",) * frozen(leaf)))
                  if isinstance(leaf, torch.Tensor) else (name, type(leaf).__name__)
                  for name, leaf in zip(leaf_names(tree), leaves)))
