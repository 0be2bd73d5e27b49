"""From ``nn.Module``s to stages: state-carrying layers and adapters."""

from fpipe.stages.batchnorm import DeferredBatchNorm

__all__ = ["DeferredBatchNorm"]
