"""Split a pytree batch into micro-batches along dim 0, and join outputs back.

Tensor leaves with at least one dimension carry the batch on dim 0 and are split; every other
leaf (Python values, 0-dim tensors) is passed unchanged to every micro-batch. Splitting follows
``torch.tensor_split``: exactly ``chunks`` pieces whose sizes differ by at most one, so an uneven
batch (10 samples in 4 chunks -> 3, 3, 2, 2) never yields fewer micro-batches than asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import torch

from fpipe._runtime.trees import tree_flatten, tree_flatten_with_path
from fpipe.errors import BatchError

__all__ = ["batch_size", "check_size", "split", "join", "sizes"]


def _is_batched(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0


def _path(path: tuple) -> str:
    return "".join(f"[{key!r}]" for key in path) or "<root>"


def batch_size(tree: Any, what: str = "input") -> int:
    """The common dim-0 size of the batched leaves of ``tree``; an error names disagreeing ones."""
    paths, leaves, _ = tree_flatten_with_path(tree)
    found: dict[int, str] = {}
    for path, leaf in zip(paths, leaves):
        if _is_batched(leaf):
            found.setdefault(leaf.shape[0], _path(path))
    if not found:
        raise BatchError(
            f"the {what} has no tensor leaf with a batch dimension (dim 0) to split into "
            f"micro-batches"
        )
    if len(found) > 1:
        listed = ", ".join(f"{where} has {size}" for size, where in found.items())
        raise BatchError(f"the {what}'s tensor leaves disagree on the batch size (dim 0): {listed}")
    return next(iter(found))


def sizes(n: int, chunks: int) -> list[int]:
    """Micro-batch sizes for ``n`` samples in ``chunks`` pieces (``tensor_split`` layout)."""
    base, extra = divmod(n, chunks)
    return [base + 1 if i < extra else base for i in range(chunks)]


def check_size(n: int, chunks: int, what: str = "input") -> None:
    """A batch of ``n`` samples refused when some of ``chunks`` micro-batches would be empty
    (both faces raise this, for the whole batch or a data-parallel replica's shard)."""
    if n == 0:
        raise BatchError(f"the {what} batch is empty: its tensors have 0 samples on dim 0")
    if n < chunks:
        raise BatchError(
            f"the {what} batch has {n} samples, fewer than chunks={chunks}: every micro-batch "
            f"needs at least one sample (use chunks <= {n}, or a larger batch)"
        )


def split(tree: Any, chunks: int, what: str = "input") -> list[Any]:
    """``chunks`` micro-batches of ``tree``; a batch smaller than ``chunks`` is an error."""
    n = batch_size(tree, what)
    check_size(n, chunks, what)
    leaves, spec = tree_flatten(tree)
    pieces = [
        torch.tensor_split(leaf, chunks) if _is_batched(leaf) else None for leaf in leaves
    ]
    return [
        optree.tree_unflatten(
            spec, [leaf if piece is None else piece[i] for leaf, piece in zip(leaves, pieces)]
        )
        for i in range(chunks)
    ]


def join(microbatches: Sequence[Any]) -> Any:
    """Concatenate micro-batch outputs along dim 0; other leaves are taken from the first."""
    first_leaves, spec = tree_flatten(microbatches[0])
    columns = [tree_flatten(mb)[0] for mb in microbatches[1:]]
    joined = []
    for i, leaf in enumerate(first_leaves):
        if _is_batched(leaf):
            joined.append(torch.cat([leaf] + [column[i] for column in columns]))
        else:
            joined.append(leaf)
    return optree.tree_unflatten(spec, joined)
