"""Checkpoints through torch.distributed.checkpoint on several ranks (gloo over 127.0.0.1, see
tests/distributed_ranks.py): written by a 4-stage pipeline on 4 ranks, each rank its own stage,
read by a 2-stage cut of the model on 2 ranks and by the plain module in this process; data
parallel replicas write their equal tensors once."""

from __future__ import annotations

import pytest
import torch
from distributed_ranks import SAVING_BATCHES, saving_model, saving_schedule, spawn
from torch.distributed.checkpoint import FileSystemReader

from fpipe import saving

# torch.distributed.checkpoint on several ranks needs numpy (the [saving] extra).
pytestmark = pytest.mark.needs_extra
pytest.importorskip("numpy")

TIGHT = dict(rtol=1e-10, atol=1e-12)


def ranks(scenario: str, world: int) -> list:
    results, codes = spawn(scenario, world)
    for result in results:
        assert result is not None and "crash" not in result, result and result.get("crash")
    assert codes == [0] * world
    return results


def merged(results: list) -> dict:
    out: dict = {}
    for result in results:
        assert not set(out) & set(result["params"])  # each stage on one rank
        out.update(result["params"])
    return out


def test_saved_on_4_ranks_resumes_on_2_and_in_the_plain_module(tmp_path, monkeypatch):
    """The whole training state: parameters, AdamW, an LR scheduler, a step counter and each
    rank's generators, saved before the third of four steps; the two last steps resumed."""
    import random

    monkeypatch.setenv("FPIPE_SAVING_DIR", str(tmp_path))
    saved = ranks("save_on_4", 4)
    uninterrupted = merged(saved)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [".metadata", *[f"__{r}_0.distcp" for r in range(4)]]  # each rank's own

    loaded = ranks("load_on_2", 2)  # another cut, loaded, the last two steps
    resumed = merged(loaded)
    assert resumed.keys() == uninterrupted.keys() == saving_model(0).state_dict().keys()
    for name, value in uninterrupted.items():
        torch.testing.assert_close(resumed[name], value, **TIGHT)
    for rank, result in enumerate(loaded):
        assert result["step"] == saved[rank]["step"] == 4
        # Each rank's generators: those its rank number saved (a draw right after each).
        assert torch.equal(result["draws"][0], saved[rank]["draws"][0])
        assert result["draws"][1] == saved[rank]["draws"][1]
        kind, name, message = result["apart"]  # extra entries are replicated
        assert (kind, name) == ("error", "ValueError"), result["apart"]
        assert "extra['step'] differs between ranks (ranks [0]; ranks [1]" in message
    assert not (tmp_path / "apart").exists()

    # The plain module, its AdamW and scheduler, in one process: the last steps as the ranks
    # took them, and rank 0's generators.
    plain = saving_model(2)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.01)
    extra = {"scheduler": saving_schedule(optimizer), "step": 0}
    saving.load_module(tmp_path, plain, optimizer, extra=extra, rng=True)
    assert extra["step"] == 2
    assert torch.equal(torch.rand(3, dtype=torch.float64), saved[0]["draws"][0])
    assert random.random() == saved[0]["draws"][1]
    for x, target in SAVING_BATCHES[2:]:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(plain(x), target).backward()
        optimizer.step()
        extra["scheduler"].step()
    for name, value in uninterrupted.items():
        torch.testing.assert_close(plain.state_dict()[name], value, **TIGHT)


def test_replicas_write_their_tensors_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FPIPE_SAVING_DIR", str(tmp_path))
    ranks("save_replicas", 4)
    metadata = FileSystemReader(tmp_path).read_metadata()
    assert {"model.layer0.w", "model.layer1.w"} <= set(metadata.state_dict_metadata)
    written = sum(p.stat().st_size for p in tmp_path.glob("*.distcp"))
    one_copy = 2 * 64 * 64 * 8
    assert one_copy <= written < 1.5 * one_copy  # four ranks, two copies: written once
    params = [{"w": torch.zeros(64, 64, dtype=torch.float64)} for _ in range(2)]
    saving.load(tmp_path, params, names=[{"w": "layer0.w"}, {"w": "layer1.w"}])
    for stage, p in enumerate(params):
        g = torch.Generator().manual_seed(stage)
        assert torch.equal(p["w"], torch.randn(64, 64, generator=g, dtype=torch.float64))


def test_a_damaged_tensor_on_one_rank_loads_nothing_on_any(tmp_path, monkeypatch):
    """Rank 1's tensor overwritten in its file: rank 1 finds its checksum wrong after the
    read, and rank 0, whose tensor is intact, writes nothing either (the ranks agree before
    any writes); both raise CheckpointError naming the file. Before, rank 0 loaded its part."""
    import os

    monkeypatch.setenv("FPIPE_SAVING_DIR", str(tmp_path))
    ranks("damage_ranks:save_two", 2)
    storage = FileSystemReader(str(tmp_path)).read_metadata().storage_data
    (index, info), = [(i, s) for i, s in storage.items() if i.fqn == "model.layer1.w"]
    path = os.path.join(tmp_path, info.relative_path)
    with open(path, "r+b") as file:
        file.seek(info.offset + info.length // 2)
        file.write(bytes(range(64)))
    for rank, result in enumerate(ranks("damage_ranks:load_two", 2)):
        assert result["untouched"], rank
        kind, message = result["error"]
        assert kind == "CheckpointError", result
        assert info.relative_path in message, message
        if rank == 0:
            assert "rank 1 could not load the checkpoint, so no rank did" in message


def _damage_entry(directory, key: str, old: bytes, new: bytes) -> str:
    storage = FileSystemReader(str(directory)).read_metadata().storage_data
    (info,) = [s for i, s in storage.items() if i.fqn == key]
    path = directory / info.relative_path
    with open(path, "r+b") as file:
        file.seek(info.offset)
        data = file.read(info.length)
        assert data.count(old) == 1, key
        file.seek(info.offset + data.index(old))
        file.write(new)
    return info.relative_path


def test_the_saved_groups_resume_on_2_ranks(tmp_path, monkeypatch):
    """The checkpoint the two tests below damage or mismatch, loaded as saved."""
    monkeypatch.setenv("FPIPE_SAVING_DIR", str(tmp_path))
    ranks("damage_ranks:save_grouped", 2)
    for result in ranks("damage_ranks:load_grouped", 2):
        assert result["error"] is None and not result["untouched"], result
        assert (result["step"], result["last_epoch"]) == (3, 3)


@pytest.mark.parametrize(("key", "old", "new"), [("extra.step", b"K\x03.", b"K\x09."),
                                                 ("extra.scheduler.last_epoch", b"K\x03.",
                                                  b"K\x00.")])
def test_a_changed_step_or_scheduler_value_loads_nothing_on_any_rank(tmp_path, monkeypatch,
                                                                      key, old, new):
    """One byte of a replicated non-tensor entry changed (step 3 to 9, last_epoch 3 to 0):
    before, both ranks loaded it without a word."""
    monkeypatch.setenv("FPIPE_SAVING_DIR", str(tmp_path))
    ranks("damage_ranks:save_grouped", 2)
    file = _damage_entry(tmp_path, key, old, new)
    results = ranks("damage_ranks:load_grouped", 2)
    for result in results:
        kind, message = result["error"]
        assert kind == "CheckpointError", result
        assert f"{key!r}" in message and file in message, message
        assert result["untouched"] and result["optimizer_state"] == 0, result
        assert (result["step"], result["last_epoch"]) == (0, 0), result
    assert results[0]["error"] == results[1]["error"]  # raised alike


def test_a_group_mismatch_on_one_rank_is_one_error_on_every_rank(tmp_path, monkeypatch):
    """Saved with decay / no-decay groups, loaded into one group: only rank 1 holds a bias.
    Every rank raises the same CheckpointError naming the group and the rank, and nothing is
    written. Before, rank 1 raised ValueError and rank 0 died in gloo ("Connection closed by
    peer"), or would have waited forever."""
    monkeypatch.setenv("FPIPE_SAVING_DIR", str(tmp_path))
    monkeypatch.setenv("FPIPE_ONE_GROUP", "1")
    ranks("damage_ranks:save_grouped", 2)
    results = ranks("damage_ranks:load_grouped", 2)
    for result in results:
        kind, message = result["error"]
        assert kind == "CheckpointError", result
        assert message.startswith("rank 1 could not load the checkpoint, so no rank did: "
                                  "ValueError: the optimizer's parameter group 0 holds "
                                  "'layer1.w' and 'layer1.b', saved with initial_lr=0.01 and "
                                  "0.03"), message
        assert result["untouched"] and result["optimizer_state"] == 0, result
        assert (result["step"], result["last_epoch"]) == (0, 0), result
    assert results[0]["error"] == results[1]["error"]


@pytest.mark.parametrize("refusal, said", [
    ("names", "KeyError: names[1] has no entry for params[1]['b']"),
    ("extra", "TypeError: extra.hook is a function")])
def test_a_save_refused_on_one_rank_is_one_error_on_every_rank(tmp_path, monkeypatch, refusal,
                                                               said):
    """A bad ``names=`` (or a value of ``extra`` that is not data) on rank 1 only: both ranks
    raise the same CheckpointError naming rank 1, and nothing is written. Before, rank 1
    raised its KeyError alone while rank 0 went on to the check of ``extra`` across ranks,
    and failed there on the closed connection."""
    monkeypatch.setenv("FPIPE_SAVING_DIR", str(tmp_path))
    monkeypatch.setenv("FPIPE_SAVE_REFUSAL", refusal)
    results = ranks("damage_ranks:save_misnamed", 2)
    for result in results:
        kind, message = result["error"]
        assert kind == "CheckpointError", result
        assert message.startswith(f"rank 1 could not save the checkpoint, so no rank did: "
                                  f"{said}"), message
        assert result["written"] == [], result
    assert results[0]["error"] == results[1]["error"]
