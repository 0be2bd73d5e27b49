"""fpipe: pipeline-parallel training for PyTorch, in the functional style of ``torch.func``.

Stages are pure functions ``stage(params, x) -> y`` with explicit parameter pytrees, a schedule
is a value that compiles to a program of per-worker actions, and a driver interprets the
program::

    pipe = fpipe.pipeline(stages, params, schedule=fpipe.gpipe(chunks=8), loss_fn=loss_fn)
    loss, grads = pipe.value_and_grad(x, target)
"""

import logging

from fpipe import amp, optim, saving
from fpipe.errors import (
    BatchError,
    NonFiniteLossError,
    OversubscriptionWarning,
    PlacementError,
    StageError,
)
from fpipe.module import GPipe
from fpipe.pipeline import Pipeline, pipeline
from fpipe.recompute import is_checkpointing, is_recomputing
from fpipe.schedules import (
    Action,
    Op,
    Program,
    ScheduleError,
    dual_pipe_v,
    gpipe,
    interleaved_one_f_one_b,
    interleaved_zero_bubble,
    looped_bfs,
    one_f_one_b,
    v_half,
    v_min,
    validate,
    zero_bubble,
    zero_bubble_v,
)
from fpipe.timeline import Recorder, StepFigures, StepLog

__version__ = "0.1.0"

# Silent unless the application configures logging (see fpipe._runtime.log for what is logged).
logging.getLogger("fpipe").addHandler(logging.NullHandler())

__all__ = [
    "pipeline", "Pipeline", "GPipe", "is_recomputing", "is_checkpointing", "gpipe", "one_f_one_b",
    "interleaved_one_f_one_b", "looped_bfs", "zero_bubble", "zero_bubble_v",
    "interleaved_zero_bubble", "dual_pipe_v", "v_half", "v_min", "Program",
    "Action", "Op", "validate", "ScheduleError", "StageError", "BatchError", "PlacementError",
    "NonFiniteLossError", "OversubscriptionWarning", "amp", "optim", "saving", "Recorder",
    "StepFigures", "StepLog",
]
