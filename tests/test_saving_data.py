"""Every entry of a checkpoint, tensor or not, is data, checksummed and checked: the step
counter, an LR scheduler's state, the optimiser's hyper-parameters and tensors, the random
generators and any ``extra=`` value. One byte changed in any of them, random bytes in DCP's
``.metadata``, or an entry that would run code when read is refused by ``load`` and
``load_module`` alike with a ``CheckpointError`` naming the entry and the file in one line,
before anything is written; an entry that would run code is refused at save too. Before,
such damage loaded silently, a damaged scheduler was refused with DCP's traceback text,
``.metadata`` noise raised ``UnicodeDecodeError``, and an ``extra=`` object's ``__reduce__``
ran during the load."""

from __future__ import annotations

import copy
import os
import pathlib
import random

import optree
import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_saving import assert_same_optimizer, grouped
from test_training_state import run, steps
from torch import nn

from fpipe import saving
from fpipe.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Touch:
    """An object whose unpickling creates ``path`` (code run by reading a checkpoint)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def entry(directory, key: str) -> tuple[str, int, int]:
    """(file, offset, length) of DCP key ``key`` in a checkpoint of one process."""
    for index, info in dcp.FileSystemReader(directory).read_metadata().storage_data.items():
        if index.fqn == key:
            return os.path.join(directory, info.relative_path), info.offset, info.length
    raise KeyError(key)


def replace_once(directory, key: str, old: bytes, new: bytes) -> str:
    """The bytes ``old`` in ``key``'s entry (once there) replaced by ``new``, as long."""
    path, offset, length = entry(directory, key)
    with open(path, "r+b") as file:
        file.seek(offset)
        data = file.read(length)
        assert data.count(old) == 1, (key, data)
        file.seek(offset + data.index(old))
        file.write(new)
    return path


def noise(directory, key: str) -> str:
    """64 random bytes in the middle of ``key``'s entry."""
    path, offset, length = entry(directory, key)
    with open(path, "r+b") as file:
        file.seek(offset + length // 2 - 32)
        file.write(random.Random(0).randbytes(64))
    return path


def step_3_to_9(directory):  # the pickled int 3 (BININT1) made 9: one byte
    return "extra.step", replace_once(directory, "extra.step", b"K\x03.", b"K\x09.")


def last_epoch_3_to_0(directory):
    key = "extra.scheduler.last_epoch"
    return key, replace_once(directory, key, b"K\x03.", b"K\x00.")


def optimizer_tensor(directory):
    key = "optim.state.3.weight.exp_avg"
    return key, noise(directory, key)


def extra_tensor(directory):
    return "extra.ema", noise(directory, "extra.ema")


def scheduler_noise(directory):
    key = "extra.scheduler._last_lr"
    return key, noise(directory, key)


def rng_noise(directory):
    key = "rng.rank0.python.version"
    return key, noise(directory, key)


DAMAGE = (step_3_to_9, last_epoch_3_to_0, optimizer_tensor, extra_tensor, scheduler_noise,
          rng_noise)


@pytest.fixture
def saved(tmp_path):
    """Three steps of a run with dropout, AdamW, a scheduler, a step counter, an ``ema``
    tensor and the generators: step 3, the scheduler's ``last_epoch`` 3."""
    s, optimizer, extra = run()
    steps(s, optimizer, extra, 3)
    extra["ema"] = torch.randn(64, dtype=torch.float64)
    saving.save(tmp_path / "ckpt", s.params, optimizer=optimizer, extra=extra, rng=True)
    return tmp_path / "ckpt"


def fresh_pipeline():
    s, optimizer, extra = run(seed=3)
    steps(s, optimizer, extra, 1)  # optimiser state and a scheduler step to keep
    return s.params, optimizer, {**extra, "ema": torch.zeros(64, dtype=torch.float64)}


def fresh_module():
    torch.manual_seed(4)
    plain = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.25), nn.Tanh(),
                          nn.Linear(16, 3)).double()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.6 ** step)
    return plain, optimizer, {"scheduler": scheduler, "step": 0,
                              "ema": torch.zeros(64, dtype=torch.float64)}


def snapshot(tensors, optimizer, extra) -> tuple:
    return ([t.clone() for t in tensors], copy.deepcopy(optimizer.state_dict()),
            extra["scheduler"].state_dict(), extra["step"], extra["ema"].clone(),
            torch.get_rng_state(), random.getstate())


def assert_untouched(tensors, optimizer, extra, before) -> None:
    for leaf, was in zip(tensors, before[0]):
        assert torch.equal(leaf, was)
    assert_same_optimizer(before[1], optimizer.state_dict())
    assert optimizer.state_dict()["state"].keys() == before[1]["state"].keys()  # none added
    assert extra["scheduler"].state_dict() == before[2]
    assert extra["step"] == before[3] and torch.equal(extra["ema"], before[4])
    assert torch.equal(torch.get_rng_state(), before[5]) and random.getstate() == before[6]


def load_into(face: str, directory):
    """Load ``directory`` into a fresh pipeline or module; returns (error, untouched?)."""
    if face == "load":
        params, optimizer, extra = fresh_pipeline()
        tensors = optree.tree_leaves(params)
    else:
        module, optimizer, extra = fresh_module()
        tensors = list(module.state_dict().values())
    before = snapshot(tensors, optimizer, extra)
    with pytest.raises(CheckpointError) as caught:
        if face == "load":
            saving.load(directory, params, optimizer=optimizer, extra=extra, rng=True)
        else:
            saving.load_module(directory, module, optimizer, extra=extra, rng=True)
    assert_untouched(tensors, optimizer, extra, before)
    return caught.value


@pytest.mark.parametrize("face", ["load", "load_module"])
@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_a_damaged_entry_is_named_and_nothing_is_written(saved, damage, face):
    key, path = damage(saved)
    error = load_into(face, saved)
    message = str(error)
    assert f"{key!r}" in message and repr(path) in message, message
    assert "\n" not in message, message  # fpipe's words, DCP's text (if any) the cause only


@pytest.mark.parametrize("face", ["load", "load_module"])
def test_random_bytes_in_the_metadata_are_a_checkpoint_error_naming_it(saved, face):
    path = os.path.join(saved, ".metadata")
    size = os.path.getsize(path)
    with open(path, "r+b") as file:
        file.seek(size // 3)
        file.write(random.Random(1).randbytes(256))
    error = load_into(face, saved)
    assert repr(path) in str(error) and "\n" not in str(error), error


def test_the_undamaged_checkpoint_loads(saved):
    """The fixture's checkpoint, undamaged, loads through both faces (the tests above then
    fail for the damage alone)."""
    params, optimizer, extra = fresh_pipeline()
    saving.load(saved, params, optimizer=optimizer, extra=extra, rng=True)
    assert extra["step"] == 3 and extra["scheduler"].last_epoch == 3
    module, optimizer, extra = fresh_module()
    saving.load_module(saved, module, optimizer, extra=extra, rng=True)
    assert extra["step"] == 3 and extra["scheduler"].last_epoch == 3


def plain_dcp_checkpoint(directory, value) -> None:
    """A checkpoint as anyone can write it with DCP: a model and ``extra.step`` = ``value``."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    dcp.save({"model": model.state_dict(), "extra": {"step": value}}, checkpoint_id=directory,
             no_dist=True)


@pytest.mark.parametrize("face", ["load", "load_module"])
def test_an_entry_that_would_run_code_is_refused_and_not_run(tmp_path, face):
    touched = tmp_path / "touched"
    plain_dcp_checkpoint(tmp_path / "ckpt", Touch(str(touched)))
    module = nn.Linear(3, 2).double()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    extra = {"step": 0}
    with pytest.raises(CheckpointError, match=r"'extra\.step' in the checkpoint's file .* is "
                                              r"not data: reading it would call getattr"):
        if face == "load":
            saving.load(tmp_path / "ckpt", [dict(module.named_parameters())], extra=extra)
        else:
            saving.load_module(tmp_path / "ckpt", module, extra=extra)
    assert not touched.exists()
    assert extra == {"step": 0}
    assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items())


def test_an_entry_that_would_run_code_is_refused_at_save(tmp_path):
    touched = tmp_path / "touched"
    s, optimizer, extra = run()
    with pytest.raises(TypeError, match=r"extra\.step is a Touch, not data: .*weights_only"):
        saving.save(tmp_path / "ckpt", s.params, optimizer=optimizer,
                    extra={"step": Touch(str(touched))})
    assert not (tmp_path / "ckpt").exists() and not touched.exists()
    # Data of every kind torch's weights-only unpickler reads back is saved and loaded as it was.
    plain = {"counts": {"a": 1, "b": [2.5, None, True]}, "shape": torch.Size([2, 3]),
             "dtype": torch.float64, "name": "run-7", "raw": b"\x00\x01", "pair": (1, "x")}
    saving.save(tmp_path / "data", s.params, extra={"plain": plain})
    got = {"plain": {"counts": {"a": 0, "b": None}, **dict.fromkeys(plain.keys() - {"counts"})}}
    saving.load(tmp_path / "data", s.params, extra=got)
    assert got["plain"] == plain and type(got["plain"]["pair"]) is tuple


@pytest.mark.parametrize("face", ["load", "load_module"])
def test_load_module_refuses_what_load_refuses_conflicting_learning_rates(tmp_path, face):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).double()
    optimizer = grouped(plain.parameters())
    plain(torch.randn(4, 6, dtype=torch.float64)).square().sum().backward()
    optimizer.step()
    saving.save(tmp_path, [dict(plain.named_parameters())], optimizer=optimizer)
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).double()
    single = torch.optim.AdamW(other.parameters(), lr=1e-2, weight_decay=0.1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match=r"group 0 holds '0.weight' and '0.bias', saved with "
                                         r"lr=0.01 and 0.03: put them in groups of their own"):
        if face == "load":
            saving.load(tmp_path, [dict(other.named_parameters())], optimizer=single)
        else:
            saving.load_module(tmp_path, other, single)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())
    assert not single.state


@pytest.mark.parametrize("face", ["load", "load_module"])
def test_a_metadata_file_that_would_run_code_is_refused_and_not_run(saved, face):
    """DCP's ``.metadata`` is a pickle too: fpipe reads it admitting DCP's own metadata
    types alone."""
    import pickle

    touched = saved.parent / "touched"
    path = os.path.join(saved, ".metadata")
    with open(path, "wb") as file:
        pickle.dump(Touch(str(touched)), file)
    error = load_into(face, saved)
    assert not touched.exists()
    assert str(error).startswith(f"the checkpoint's metadata {path!r} is not data: reading "
                                 f"it would call pathlib.Path.touch"), error


def test_a_checkpoint_whose_sums_are_of_tensors_alone_still_loads(tmp_path):
    """fpipe's earlier checkpoints summed their tensors only: their tensors are checked,
    their objects read as data."""
    from fpipe._runtime.ranks.intact import checksum

    torch.manual_seed(0)
    weight = torch.randn(64, 64, dtype=torch.float64)
    dcp.save({"model": {"w": weight}, "extra": {"step": 3},
              "fpipe_checksums": {"model.w": checksum(weight)}}, checkpoint_id=tmp_path,
             no_dist=True)
    params, extra = [{"w": torch.zeros(64, 64, dtype=torch.float64)}], {"step": 0}
    saving.load(tmp_path, params, extra=extra)
    assert torch.equal(params[0]["w"], weight) and extra == {"step": 3}
    noise(tmp_path, "model.w")
    with pytest.raises(CheckpointError, match="'model.w' in the checkpoint's file .* checksum"):
        saving.load(tmp_path, params, extra=extra)


class Position:
    """A user type, data once given to ``torch.serialization.safe_globals``."""

    def __init__(self, at: int) -> None:
        self.at = at


def test_a_type_given_to_torch_s_safe_globals_is_data_and_only_then(tmp_path):
    s, _, _ = run()
    with torch.serialization.safe_globals([Position]):
        saving.save(tmp_path, s.params, extra={"position": Position(5)})
        got = {"position": None}
        saving.load(tmp_path, s.params, extra=got)
    assert type(got["position"]) is Position and got["position"].at == 5
    got = {"position": None}
    with pytest.raises(CheckpointError, match=r"'extra.position' in the checkpoint's file .* "
                                              r"is not data: reading it would call "
                                              r"test_saving_data.Position"):
        saving.load(tmp_path, s.params, extra=got)
    assert got == {"position": None}
