"""Skip connections as the engine sees them: data, not declarations.

How a user declares a skip (``fpipe.stages.skippable`` on a function, torchgpipe's
``@skippable`` on a module) is the faces' business; :func:`fpipe.stages.skip.declared` reads
those declarations once and checks them, and the faces hand the engine this value made of them
(``Skips(*declared(stages))``). The engine routes by it and never imports the declaring layer,
nor that layer the engine, so a researcher's own way of declaring skips needs only to produce
a :class:`Skips`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class Skips:
    """Per stage, the names of the skips it pops (its inputs after ``x``, in this order) and
    stashes (its outputs after ``y``); per skip, ``(stashing stage, popping stage)``."""

    pops: tuple[tuple[str, ...], ...]
    stashes: tuple[tuple[str, ...], ...]
    routes: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "routes", MappingProxyType(dict(self.routes)))

    @classmethod
    def none(cls, n_stages: int) -> Skips:
        """``n_stages`` stages without skips."""
        return cls(((),) * n_stages, ((),) * n_stages)
