"""From ``nn.Module``s to stages: adapters, balancing, state-carrying layers and skips.

    s = from_sequential(model, balance=balance_by_time(model, sample, partitions=4))
    pipe = fpipe.pipeline(s.stages, s.params, state=s.state, schedule=..., loss_fn=...)
"""

from fpipe.stages.balance import balance_by_size, balance_by_time, partition
from fpipe.stages.batchnorm import DeferredBatchNorm
from fpipe.stages.module_skip import Namespace, SkippableModule, pop, stash, verify_skippables
from fpipe.stages.sequential import (
    ModuleStage,
    Stages,
    StatefulModuleStage,
    from_modules,
    from_sequential,
    load_into,
)
from fpipe.stages.skip import SkipError, Skippable, skip_routes, skippable

__all__ = ["Stages", "ModuleStage", "StatefulModuleStage", "from_sequential", "from_modules",
           "load_into", "partition", "balance_by_time", "balance_by_size", "DeferredBatchNorm",
           "SkipError", "Skippable", "skip_routes", "skippable", "stash", "pop", "Namespace",
           "SkippableModule", "verify_skippables"]
