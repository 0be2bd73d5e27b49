"""What the stages' tensors are called in the model, and which of them are one tensor (ties).

A stage's parameters are keyed by their names in the stage's own module (``"head.weight"`` in
an adapter ``Head``); checkpoints and users speak the model's names (``"lm_head.weight"``).
:func:`model_names` maps one to the other by module identity: the submodule that owns a leaf
is looked up in the model, so the answer does not depend on which tensor the leaf happens to
share (a tied ``lm_head.weight`` is still ``lm_head.weight``, not ``transformer.wte.weight``).

:func:`find_ties` turns a parameter that several stages hold into a tie (each stage trains its
own copy; the pipelines sum the copies' gradients): ``((stage, local_name), ...)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["model_names", "module_names", "find_ties", "Tie"]

Tie = tuple[tuple[int, str], ...]


def model_names(modules: Sequence[nn.Module], root: nn.Module | None) -> list[dict[str, str]]:
    """Per stage, each parameter's and buffer's local name -> its name in ``root``.

    Without ``root`` the local names are the names (identity): right for ``from_sequential``,
    whose partitions keep the Sequential's layer names. A leaf whose owning module is not a
    submodule of ``root`` is an error naming it.
    """
    if root is None:
        return [{name: name for name in _leaf_names(m)} for m in modules]
    if not isinstance(root, nn.Module):
        raise TypeError(f"root is a {type(root).__name__}, not an nn.Module (the whole model)")
    where: dict[int, str] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        where.setdefault(id(module), name)
    result = []
    for i, module in enumerate(modules):
        names = {}
        for local in _leaf_names(module):
            path, _, attr = local.rpartition(".")
            owner = module.get_submodule(path)
            if id(owner) not in where:
                raise ValueError(f"stage {i}'s {local!r} belongs to a {type(owner).__name__} "
                                 f"that is not a submodule of root ({type(root).__name__}): "
                                 f"it has no name in the model; keep the tensors an adapter "
                                 f"holds in the model's own modules")
            prefix = where[id(owner)]
            names[local] = f"{prefix}.{attr}" if prefix else attr
        result.append(names)
    return result


def module_names(modules: Sequence[nn.Module], root: nn.Module | None) -> list[dict[int, str]]:
    """Per stage, ``id(submodule)`` -> the name its initialiser is seeded by
    (:mod:`fpipe.stages.seeding`): its qualified name in ``root`` (the first, if it has
    several; ``""`` for ``root`` itself), so the same in any cut; a submodule that is not part
    of ``root`` (an adapter, or every submodule when there is no root) is
    ``"stage {i}.{path}"``, which depends on the cut.
    """
    where: dict[int, str] = {}
    if root is not None:
        for name, module in root.named_modules(remove_duplicate=False):
            where.setdefault(id(module), name)
    result = []
    for i, module in enumerate(modules):
        names = {}
        for path, sub in module.named_modules():
            names[id(sub)] = where.get(id(sub), f"stage {i}.{path}" if path else f"stage {i}")
        result.append(names)
    return result


def find_ties(modules: Sequence[nn.Module]) -> tuple[Tie, ...]:
    """The parameters held by more than one stage, as ties in the pipelines' ``ties=`` format.

    A tensor shared within one stage is left alone (``functional_call`` passes it once and
    fills every name). A buffer shared by two stages is an error: state is not a gradient
    that can be summed, and two stages would each update their own copy.
    """
    holders: dict[int, list[tuple[int, str, str]]] = {}
    for i, module in enumerate(modules):
        for kind, named in (("parameter", module.named_parameters()),
                            ("buffer", module.named_buffers())):
            for name, t in named:
                members = holders.setdefault(id(t), [])
                if not any(s == i for s, _, _ in members):
                    members.append((i, name, kind))
    ties = []
    for members in holders.values():
        if len(members) < 2:
            continue
        if any(kind == "buffer" for _, _, kind in members):
            listed = ", ".join(f"{name!r} ({kind}) of stage {s}" for s, name, kind in members)
            raise ValueError(f"{listed} are the same tensor: stages cannot share a buffer "
                             f"(state cannot be tied, each stage would update its own copy); "
                             f"keep the layers that share it in one stage")
        ties.append(tuple((s, name) for s, name, _ in members))
    return tuple(ties)


def _leaf_names(module: nn.Module) -> list[str]:
    return [name for name, _ in (*module.named_parameters(), *module.named_buffers())]
