"""From ``nn.Module``s to stages: state-carrying layers, skip connections and adapters."""

from fpipe.stages.batchnorm import DeferredBatchNorm
from fpipe.stages.skip import SkipError, Skippable, skip_routes, skippable

__all__ = ["DeferredBatchNorm", "SkipError", "Skippable", "skip_routes", "skippable"]
