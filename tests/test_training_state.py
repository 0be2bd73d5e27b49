"""The whole training state in a checkpoint, in one process: ``extra=`` (an LR scheduler, a
step counter, a user ``Stateful``) and ``rng=True``; a resumed run takes the uninterrupted
run's steps exactly (float64, dropout drawing from the restored generators). The same on
several ranks: tests/test_saving_distributed.py."""

from __future__ import annotations

import random

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fpipe
from fpipe import saving
from fpipe.optim import bind_grads
from fpipe.schedules import gpipe
from fpipe.stages import from_sequential

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Cursor:
    """A user ``Stateful``: where a data stream is."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def run(seed: int = 0):
    """A float64 model with dropout cut in 2 stages, AdamW with a decaying LR, a step
    counter and a cursor: the whole state of a training run."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.25), nn.Tanh(),
                          nn.Linear(16, 3)).double()
    s = from_sequential(model, [2, 2], stateful=False)
    optimizer = torch.optim.AdamW(optree.tree_leaves(s.params), lr=0.05)
    # LR from the step count (not chained from the optimiser's restored LR): a scheduler
    # started over would set another LR.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.6 ** step)
    return s, optimizer, {"scheduler": scheduler, "step": 0, "cursor": Cursor()}


def steps(s, optimizer, extra, n: int) -> list[torch.Tensor]:
    """``n`` steps, the batch chosen by the cursor, the step counted in ``extra``."""
    data = torch.randn(64, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    losses = []
    with fpipe.pipeline(s.stages, s.params, schedule=gpipe(chunks=2),
                        loss_fn=F.mse_loss) as pipe:
        for _ in range(n):
            at = extra["cursor"].position
            batch = data[at:at + 8]
            loss, grads = pipe.value_and_grad(batch[:, :6], batch[:, 6:])
            bind_grads(s.params, grads)
            optimizer.step()
            extra["scheduler"].step()
            extra["step"] += 1
            extra["cursor"].position = (at + 8) % 64
            losses.append(loss)
    return losses


def params(s) -> dict:
    return {k: v for p in s.params for k, v in p.items()}


def test_a_resumed_run_continues_exactly(tmp_path):
    s, optimizer, extra = run()
    torch.manual_seed(7)
    steps(s, optimizer, extra, 2)
    saving.save(tmp_path, s.params, optimizer=optimizer, extra=extra, rng=True)
    expected = steps(s, optimizer, extra, 3)  # without interruption

    resumed, resumed_optimizer, resumed_extra = run(seed=3)
    torch.manual_seed(8)  # other generators, all restored
    random.seed(8)
    saving.load(tmp_path, resumed.params, optimizer=resumed_optimizer, extra=resumed_extra,
                rng=True)
    assert resumed_extra["step"] == 2 and resumed_extra["cursor"].position == 16
    assert resumed_extra["scheduler"].get_last_lr() == pytest.approx([0.05 * 0.6 ** 2])
    losses = steps(resumed, resumed_optimizer, resumed_extra, 3)
    assert [loss.item() for loss in losses] == [loss.item() for loss in expected]
    for name, value in params(s).items():
        assert torch.equal(params(resumed)[name], value), name
    assert resumed_extra["step"] == extra["step"] == 5
    assert resumed_extra["scheduler"].state_dict() == extra["scheduler"].state_dict()

    # Each part matters: without the scheduler's state the LR starts over; without the
    # generators the dropout masks differ.
    for keep, rng in (({"step", "cursor"}, True), (set(extra), False)):
        other, other_optimizer, other_extra = run(seed=3)
        saving.load(tmp_path, other.params, optimizer=other_optimizer,
                    extra={k: v for k, v in other_extra.items() if k in keep}, rng=rng)
        other_extra["cursor"].position = 16
        steps(other, other_optimizer, other_extra, 3)
        assert not torch.allclose(params(other)["3.weight"], params(s)["3.weight"])


def test_the_plain_module_resumes_with_its_scheduler(tmp_path):
    s, optimizer, extra = run()
    steps(s, optimizer, extra, 2)
    saving.save(tmp_path, s.params, optimizer=optimizer, extra=extra)

    torch.manual_seed(4)
    plain = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.25), nn.Tanh(),
                          nn.Linear(16, 3)).double()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(plain_optimizer, lambda step: 0.6 ** step)
    plain_extra = {"scheduler": scheduler, "step": 0}
    saving.load_module(tmp_path, plain, plain_optimizer, extra=plain_extra)
    assert plain_extra["step"] == 2
    assert scheduler.state_dict() == extra["scheduler"].state_dict()
    assert plain_optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.6 ** 2)


def test_a_missing_entry_is_named_and_nothing_is_written(tmp_path):
    s, optimizer, extra = run()
    steps(s, optimizer, extra, 1)
    saving.save(tmp_path, s.params, optimizer=optimizer, extra={"step": 1})

    other, other_optimizer, other_extra = run(seed=3)
    before = {k: v.clone() for k, v in params(other).items()}
    scheduler = other_extra["scheduler"].state_dict()
    with pytest.raises(KeyError, match=r"no extra entry 'scheduler' \(it holds \['step'\]\)"):
        saving.load(tmp_path, other.params, optimizer=other_optimizer, extra=other_extra)
    with pytest.raises(KeyError, match="no random generator state for rank 0 .*without rng"):
        saving.load(tmp_path, other.params, optimizer=other_optimizer, rng=True)
    with pytest.raises(KeyError, match="'step' was saved with another structure"):
        saving.load(tmp_path, other.params, extra={"step": torch.zeros(2)})
    assert all(torch.equal(params(other)[k], v) for k, v in before.items())
    assert other_extra["scheduler"].state_dict() == scheduler and other_extra["step"] == 0
    assert not other_optimizer.state  # no moments loaded
    with pytest.raises(ValueError, match="extra's key 'a.b'"):
        saving.save(tmp_path / "dots", s.params, extra={"a.b": 1})
    assert not (tmp_path / "dots").exists()


class Refusing(Cursor):
    """A ``Stateful`` whose ``load_state_dict`` refuses what it is given."""

    def load_state_dict(self, state: dict) -> None:
        raise ValueError(f"cannot resume from position {state['position']}")


@pytest.mark.parametrize("first", [True, False], ids=["refusing-first", "refusing-last"])
@pytest.mark.parametrize("face", ["load", "load_module"])
def test_a_stateful_that_refuses_its_state_leaves_everything_as_it_was(tmp_path, face, first):
    """The user's ``load_state_dict`` is the one check fpipe cannot run ahead: it runs before
    the model's tensors are written, and the entries loaded before it are given back; the
    error raised is its own (position 5, what it was given), wherever it stands among the
    entries. Before, the model, the optimiser, the scheduler and the step were all loaded
    when it raised."""
    s, optimizer, extra = run()
    steps(s, optimizer, extra, 2)
    cursor, refused = Cursor(), Cursor()
    cursor.position, refused.position = 7, 5
    saved = {"scheduler": extra["scheduler"], "step": 2, "cursor": cursor, "z": refused}
    if face == "load":
        saving.save(tmp_path, s.params, optimizer=optimizer, extra=saved)
    else:
        module = nn.Linear(4, 4, dtype=torch.float64)
        module_optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        module_scheduler = torch.optim.lr_scheduler.StepLR(module_optimizer, 1, 0.5)
        module_optimizer.step()
        module_scheduler.step()
        saving.save(tmp_path, [dict(module.named_parameters())], optimizer=module_optimizer,
                    extra={**saved, "scheduler": module_scheduler})

    other, other_optimizer, other_extra = run(seed=3)
    other_cursor = Cursor()
    fresh = {"scheduler": other_extra["scheduler"], "step": 0, "cursor": other_cursor}
    fresh = {"z": Refusing(), **fresh} if first else {**fresh, "z": Refusing()}
    scheduler = fresh["scheduler"].state_dict()
    with pytest.raises(ValueError, match="^cannot resume from position 5$"):
        if face == "load":
            before = {k: v.clone() for k, v in params(other).items()}
            saving.load(tmp_path, other.params, optimizer=other_optimizer, extra=fresh)
        else:
            target = nn.Linear(4, 4, dtype=torch.float64)
            target_optimizer = torch.optim.SGD(target.parameters(), lr=0.1)
            fresh["scheduler"] = torch.optim.lr_scheduler.StepLR(target_optimizer, 1, 0.5)
            scheduler = fresh["scheduler"].state_dict()
            before = {k: v.clone() for k, v in target.state_dict().items()}
            saving.load_module(tmp_path, target, target_optimizer, extra=fresh)
    now = params(other) if face == "load" else target.state_dict()
    assert all(torch.equal(now[k], v) for k, v in before.items())
    assert fresh["scheduler"].state_dict() == scheduler
    assert fresh["step"] == 0 and other_cursor.position == 0
    assert not (other_optimizer if face == "load" else target_optimizer).state
