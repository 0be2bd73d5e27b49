"""Pytrees as users have them: optree's, and every type registered with torch's pytree registry
(Hugging Face's ``ModelOutput``, dataclasses registered there), which is then a node whose
children are flattened, not one opaque leaf.

optree and torch keep separate registries. fpipe flattens user values in its own optree
namespace, and registers there, the first time it meets one, each type that torch knows and
optree does not, with torch's own flatten and unflatten functions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import torch.utils._pytree as torch_pytree

__all__ = ["NAMESPACE", "tree_flatten", "tree_flatten_with_path", "tree_map", "leaf_names",
           "stage_items"]

NAMESPACE = "fpipe"
_adopted: set[type] = set()
_lock = threading.Lock()


def tree_flatten(tree: Any) -> tuple[list, optree.PyTreeSpec]:
    """``optree.tree_flatten`` in fpipe's namespace: torch-registered types are nodes."""
    while True:
        leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
        if not _adopt(leaves):
            return leaves, spec


def tree_flatten_with_path(tree: Any) -> tuple[list, list, optree.PyTreeSpec]:
    while True:
        paths, leaves, spec = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
        if not _adopt(leaves):
            return paths, leaves, spec


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    leaves, spec = tree_flatten(tree)
    return optree.tree_unflatten(spec, [fn(leaf) for leaf in leaves])


def leaf_names(tree: Any, none_is_leaf: bool = False) -> list[str]:
    """The name of each leaf of one stage's parameter pytree, in leaf order: its path joined
    by dots (``"wte.weight"`` for a dict's key, ``"3.weight"`` under ``from_sequential``).

    Parameters are flattened with optree's default registry, as the faces flatten them, so
    the names line up with the flat leaves a step's gradients come in. ``fpipe.saving.names``
    spells names the same way; ties (``ties=``) are declared in these names. With
    ``none_is_leaf``, a ``None`` (a frozen leaf's gradient) is named too."""
    paths, _, _ = optree.tree_flatten_with_path(tree, none_is_leaf=none_is_leaf)
    return [".".join(str(key) for key in path) for path in paths]


def stage_items(trees: Sequence[Any] | Mapping[int, Any] | None) -> list[tuple[int, Any]]:
    """``(stage, pytree)`` pairs of one pytree per stage (a list, every stage) or of a
    ``{stage: pytree}`` dict (a distributed rank's stages), in stage order."""
    if trees is None:
        return []
    if isinstance(trees, Mapping):
        return sorted(trees.items())
    return list(enumerate(trees))


def _adopt(leaves: list) -> bool:
    """Register the torch-registered types among ``leaves`` with optree; whether there were
    any (the tree must then be flattened again, to flatten them too)."""
    nodes = torch_pytree.SUPPORTED_NODES
    new = {type(leaf) for leaf in leaves if type(leaf) in nodes} - _adopted
    if not new:
        return False
    with _lock:
        for cls in new - _adopted:
            node = nodes[cls]
            optree.register_pytree_node(cls, _flattener(node.flatten_fn),
                                        _unflattener(node.unflatten_fn), namespace=NAMESPACE)
            _adopted.add(cls)
    return True


def _flattener(flatten_fn: Callable) -> Callable:
    def flatten(node: Any) -> tuple:
        children, context = flatten_fn(node)
        return list(children), context
    return flatten


def _unflattener(unflatten_fn: Callable) -> Callable:
    def unflatten(context: Any, children: Any) -> Any:
        return unflatten_fn(list(children), context)
    return unflatten
