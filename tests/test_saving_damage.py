"""A damaged checkpoint loads all or nothing: a shard cut short, deleted, overwritten with
random bytes (in a tensor's data, or 4 KiB anywhere), or the metadata gone: ``load`` and
``load_module`` raise an error deriving from ``Exception`` that names the file, and the model
and optimiser they were given are untouched. Before, a truncated or deleted shard overwrote
some tensors before DCP's ``CheckpointException`` (a ``BaseException``), and random bytes in a
tensor loaded with no error."""

from __future__ import annotations

import copy
import os
import random

import optree
import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_saving import adamw, assert_same_optimizer, batches, model, train, trained_pipeline

from fpipe import saving
from fpipe.errors import CheckpointError
from fpipe.stages import from_sequential

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _entry(directory, key: str):
    """(file, offset, length) of ``key`` in a checkpoint of one process."""
    for index, info in dcp.FileSystemReader(directory).read_metadata().storage_data.items():
        if index.fqn == key:
            return os.path.join(directory, info.relative_path), info.offset, info.length
    raise KeyError(key)


def _shard(directory) -> str:
    return _entry(directory, "model.0.weight")[0]


def truncated(directory) -> str:
    path = _shard(directory)
    os.truncate(path, os.path.getsize(path) // 2)
    return path


def deleted(directory) -> str:
    path = _shard(directory)
    os.remove(path)
    return path


def _overwrite(path: str, offset: int, length: int) -> None:
    noise = random.Random(0).randbytes(length)
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(noise)


def tensor_bytes(directory) -> str:
    """64 bytes in the middle of a weight's entry."""
    path, offset, length = _entry(directory, "model.3.weight")
    _overwrite(path, offset + length // 2, 64)
    return path


def random_4k(directory) -> str:
    path = _shard(directory)
    _overwrite(path, os.path.getsize(path) // 3, 4096)
    return path


def metadata_gone(directory) -> str:
    path = os.path.join(directory, ".metadata")
    os.remove(path)
    return os.fspath(directory)


DAMAGE = (truncated, deleted, tensor_bytes, random_4k, metadata_gone)


def _snapshot(params, optimizer) -> tuple:
    return ([t.clone() for t in optree.tree_leaves(params)],
            copy.deepcopy(optimizer.state_dict()))


def _untouched(params, optimizer, before) -> None:
    for leaf, was in zip(optree.tree_leaves(params), before[0]):
        assert torch.equal(leaf, was)
    assert_same_optimizer(before[1], optimizer.state_dict())


@pytest.fixture
def saved(tmp_path):
    s, optimizer, state = trained_pipeline()
    saving.save(tmp_path / "ckpt", s.params, state, optimizer=optimizer, names=s.names)
    return tmp_path / "ckpt"


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_a_damaged_checkpoint_loads_nothing_into_a_pipeline(saved, damage):
    named = damage(saved)
    like = from_sequential(model(seed=9), [2, 4])
    optimizer = adamw(optree.tree_leaves(like.params))
    state = train(like, optimizer, like.state, batches(2, 1))  # optimiser state to keep
    before = _snapshot((like.params, state), optimizer)
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the type is checked below
        saving.load(saved, like.params, state, optimizer=optimizer, names=like.names)
    assert isinstance(caught.value, (CheckpointError, FileNotFoundError)), caught.value
    assert os.path.basename(named) in str(caught.value), caught.value
    if damage is tensor_bytes:  # read without error by DCP: the checksum finds it
        assert "its checksum differs" in str(caught.value)
    _untouched((like.params, state), optimizer, before)


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_a_damaged_checkpoint_loads_nothing_into_a_module(saved, damage):
    named = damage(saved)
    plain = model(seed=9)
    optimizer = adamw(plain.parameters())
    before = _snapshot(plain.state_dict(), optimizer)
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the type is checked below
        saving.load_module(saved, plain, optimizer)
    assert isinstance(caught.value, (CheckpointError, FileNotFoundError)), caught.value
    assert os.path.basename(named) in str(caught.value), caught.value
    _untouched(plain.state_dict(), optimizer, before)


def test_the_checksum_is_of_the_bytes_on_any_layout():
    from fpipe._runtime.ranks.intact import checksum

    x = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    assert checksum(x) == checksum(x.t().contiguous().t().contiguous())
    assert checksum(x) != checksum(x + 1e-300)
    assert checksum(x.t()) == checksum(x.t().contiguous())
    assert checksum(torch.zeros(0)) == 0
