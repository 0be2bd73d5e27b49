"""Checkpoints through torch.distributed.checkpoint in one process: a pipeline's checkpoint
resumes training bitwise, loads into another cut and into the plain module (and the plain
module's into a pipeline), and a tied Hugging Face GPT-2 round-trips through save_pretrained.
The multi-rank cases (save on 4 ranks, load on 2, replicas written once) are in
tests/test_saving_distributed.py."""

from __future__ import annotations

import copy

import optree
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from models import load_example
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

import fpipe
from fpipe import saving
from fpipe.optim import bind_grads
from fpipe.schedules import gpipe
from fpipe.stages import from_modules, from_sequential

# The tests call dcp.save / dcp.load themselves, in one process, as a plain-module user does.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, 12),
                         nn.Tanh(), nn.Linear(12, 3)).double()


def batches(seed: int, steps: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g, dtype=torch.float64),
             torch.randn(8, 3, generator=g, dtype=torch.float64)) for _ in range(steps)]


def train(s, optimizer, state, steps, chunks=2):
    with fpipe.pipeline(s.stages, s.params, state=state, schedule=gpipe(chunks=chunks),
                        loss_fn=F.mse_loss) as pipe:
        for x, t in steps:
            _, grads, state = pipe.value_and_grad(x, t, state=state)
            bind_grads(s.params, grads)
            optimizer.step()
    return state


def adamw(leaves) -> torch.optim.AdamW:
    return torch.optim.AdamW(list(leaves), lr=1e-2, weight_decay=0.1)


def flat(*trees) -> dict:
    return {k: v for tree in trees for part in tree for k, v in part.items()}


def test_resume_is_bitwise_and_another_cut_goes_on_alike(tmp_path):
    s = from_sequential(model(), [2, 2, 2])
    optimizer = adamw(optree.tree_leaves(s.params))
    state = train(s, optimizer, s.state, batches(1, 2))
    saving.save(tmp_path, s.params, state, optimizer=optimizer)
    state = train(s, optimizer, state, batches(2, 2))  # without interruption

    same = from_sequential(model(seed=5), [2, 2, 2])  # other values, all overwritten
    resumed = adamw(optree.tree_leaves(same.params))
    params, same_state = saving.load(tmp_path, same.params, same.state, optimizer=resumed)
    assert params is same.params and same_state is same.state  # filled in place
    same_state = train(same, resumed, same_state, batches(2, 2))
    for name, value in flat(s.params, state).items():
        assert torch.equal(flat(same.params, same_state)[name], value), name
    for a, b in zip(optimizer.state_dict()["state"].values(),
                    resumed.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))

    other = from_sequential(model(seed=6), [1, 4, 1])
    other_optimizer = adamw(optree.tree_leaves(other.params))
    _, other_state = saving.load(tmp_path, other.params, other.state, optimizer=other_optimizer)
    other_state = train(other, other_optimizer, other_state, batches(2, 2))
    for name, value in flat(s.params, state).items():
        torch.testing.assert_close(flat(other.params, other_state)[name], value,
                                   rtol=1e-10, atol=1e-12)


def test_pipeline_and_plain_module_checkpoints_are_interchangeable(tmp_path):
    s = from_sequential(model(), [3, 3])
    optimizer = adamw(optree.tree_leaves(s.params))
    state = train(s, optimizer, s.state, batches(1, 2))
    saving.save(tmp_path / "pipe", s.params, state, optimizer=optimizer)

    # torch's own way: get_state_dict, dcp.load, set_state_dict.
    plain = model(seed=3)
    plain_optimizer = adamw(plain.parameters())
    model_sd, optim_sd = get_state_dict(plain, plain_optimizer, options=FLAT)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=tmp_path / "pipe", no_dist=True)
    set_state_dict(plain, plain_optimizer, model_state_dict=sd["model"],
                   optim_state_dict=sd["optim"], options=FLAT)
    assert plain.state_dict().keys() == flat(s.params, state).keys()
    for name, value in flat(s.params, state).items():
        assert torch.equal(plain.state_dict()[name], value), name
    # ... and fpipe's one line does the same.
    again = model(seed=4)
    again_optimizer = adamw(again.parameters())
    saving.load_module(tmp_path / "pipe", again, again_optimizer)
    for name, value in plain.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name

    # The plain module's checkpoint (torch's way) loads into a pipeline of another cut; one
    # more step of each computes the same (one micro-batch: BatchNorm sees the whole batch).
    model_sd, optim_sd = get_state_dict(plain, plain_optimizer, options=FLAT)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path / "plain",
             no_dist=True)
    two = from_sequential(model(seed=7), [4, 2])
    two_optimizer = adamw(optree.tree_leaves(two.params))
    _, two_state = saving.load(tmp_path / "plain", two.params, two.state,
                               optimizer=two_optimizer)
    (x, t), = batches(2, 1)
    two_state = train(two, two_optimizer, two_state, [(x, t)], chunks=1)
    plain.train()
    plain_optimizer.zero_grad()
    F.mse_loss(plain(x), t).backward()
    plain_optimizer.step()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(flat(two.params, two_state)[name], value,
                                   rtol=1e-10, atol=1e-12)


def test_stages_of_a_rank_with_local_names_mapped_to_the_model(tmp_path):
    """A ``{stage: pytree}`` of one rank; local names that collide across stages, told apart
    by ``names``; 0-dim and None leaves."""
    params = {1: {"w": torch.randn(3, dtype=torch.float64), "gain": torch.tensor(2.0),
                  "none": None},
              3: {"w": torch.randn(2, 3)}}
    names = {1: {"w": "body.weight", "gain": "body.gain"}, 3: {"w": "head.weight"}}
    saving.save(tmp_path, params, names=names)
    like = {0: {"weight": torch.zeros(3, dtype=torch.float64)},
            1: {"gain": torch.tensor(0.0), "weight": torch.zeros(2, 3)}}
    saving.load(tmp_path, like, names=[{"weight": "body.weight"},
                                       {"gain": "body.gain", "weight": "head.weight"}])
    assert torch.equal(like[0]["weight"], params[1]["w"])
    assert torch.equal(like[1]["gain"], params[1]["gain"])
    assert torch.equal(like[1]["weight"], params[3]["w"])


def test_errors_name_the_leaf_and_write_nothing(tmp_path):
    with pytest.raises(ValueError, match="stage 0 and stage 1 both hold a leaf named 'w'"):
        saving.save(tmp_path / "clash", [{"w": torch.zeros(2)}, {"w": torch.zeros(2)}])
    with pytest.raises(KeyError, match=r"names\[1\] has no entry for params\[1\]\['b'\]"):
        saving.save(tmp_path / "clash", [{"w": torch.zeros(2)}, {"b": torch.zeros(2)}],
                    names=[{"w": "a.w"}, {"w": "b.w"}])
    with pytest.raises(ValueError, match="both hold a leaf named 'x'"):
        saving.save(tmp_path / "clash", [{"w": torch.zeros(2)}, {"b": torch.zeros(2)}],
                    names=[{"w": "x"}, {"b": "x"}])
    stray = torch.zeros(4, requires_grad=True)
    with pytest.raises(ValueError, match=r"group 0 holds a tensor of shape \(4,\)"):
        saving.save(tmp_path / "clash", [{"w": torch.zeros(2)}],
                    optimizer=torch.optim.SGD([stray], lr=1.0))
    assert not (tmp_path / "clash").exists()

    saving.save(tmp_path / "ok", [{"w": torch.zeros(2)}, {"b": torch.zeros(3)}])
    with pytest.raises(KeyError, match=r"'c' \(stage 1\) is not in the checkpoint"):
        saving.load(tmp_path / "ok", [{"w": torch.ones(2)}, {"c": torch.ones(3)}])
    with pytest.raises(ValueError, match=r"'b' \(stage 0\) is \(3,\) torch.float32 in the "
                                         r"checkpoint but \(2,\) torch.float32 here"):
        saving.load(tmp_path / "ok", [{"b": torch.ones(2)}])
    with pytest.raises(ValueError, match="float32 in the checkpoint but .*float64 here"):
        saving.load(tmp_path / "ok", [{"b": torch.ones(3, dtype=torch.float64)}])
    leaf = torch.ones(2, requires_grad=True)
    with pytest.raises(KeyError, match="no optimizer state for 'w'"):
        saving.load(tmp_path / "ok", [{"w": leaf}], optimizer=torch.optim.SGD([leaf], lr=1.0))
    assert torch.equal(leaf, torch.ones(2))  # nothing read
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        saving.load(tmp_path / "nowhere", [{"w": leaf}])


def trained_pipeline(seed: int = 0):
    """A 2-stage pipeline of ``model()`` and its AdamW after two steps: something to save."""
    s = from_sequential(model(seed), [3, 3])
    optimizer = adamw(optree.tree_leaves(s.params))
    return s, optimizer, train(s, optimizer, s.state, batches(1, 2))


def assert_same_checkpoint(s, state, optimizer, like, like_state, like_optimizer):
    for name, value in flat(s.params, state).items():
        assert torch.equal(flat(like.params, like_state)[name], value), name
    assert_same_optimizer(optimizer.state_dict(), like_optimizer.state_dict())


def assert_same_optimizer(saved: dict, loaded: dict) -> None:
    """Two optimisers' ``state_dict()``: the same groups, and every state tensor bitwise."""
    assert saved["param_groups"] == loaded["param_groups"]
    for i, values in saved["state"].items():
        assert all(torch.equal(v, loaded["state"][i][k]) for k, v in values.items())


def test_any_dcp_storage_writer_and_reader(tmp_path):
    """A ``FileSystemWriter`` with options of its own writes, a ``FileSystemReader`` reads,
    exactly; with the storage objects ``directory`` may be ``None``."""
    s, optimizer, state = trained_pipeline()
    writer = dcp.FileSystemWriter(tmp_path / "ckpt", thread_count=2,
                                  single_file_per_rank=False)
    saving.save(None, s.params, state, optimizer=optimizer, storage_writer=writer)
    assert len(list((tmp_path / "ckpt").glob("*.distcp"))) > 1  # a file per tensor

    like = from_sequential(model(seed=9), [2, 4])
    like_optimizer = adamw(optree.tree_leaves(like.params))
    _, like_state = saving.load(None, like.params, like.state, optimizer=like_optimizer,
                                storage_reader=dcp.FileSystemReader(tmp_path / "ckpt"))
    assert_same_checkpoint(s, state, optimizer, like, like_state, like_optimizer)

    # A reader given with a directory is reset to it, as dcp.load does.
    plain = model(seed=8)
    saving.load_module(tmp_path / "ckpt", plain,
                       storage_reader=dcp.FileSystemReader(tmp_path / "nowhere"))
    for name, value in flat(s.params, state).items():
        assert torch.equal(plain.state_dict()[name], value), name

    with pytest.raises(FileNotFoundError, match="no checkpoint in '.*nowhere'"):
        saving.load(None, like.params, like.state,
                    storage_reader=dcp.FileSystemReader(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="no checkpoint in '.*nowhere'"):
        saving.load_module(None, plain,
                           storage_reader=dcp.FileSystemReader(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="no checkpoint location.*storage_writer="):
        saving.save(None, s.params, state)
    with pytest.raises(ValueError, match="no checkpoint location.*storage_reader="):
        saving.load(None, like.params, like.state)
    with pytest.raises(ValueError, match="no checkpoint location.*storage_reader="):
        saving.load_module(None, plain)


def test_fsspec_storage_round_trip():
    """DCP's fsspec writer and reader, on fsspec's in-memory filesystem (fsspec comes with
    torch)."""
    pytest.importorskip("fsspec")
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    s, optimizer, state = trained_pipeline()
    where = "memory://fpipe-test/ckpt"
    saving.save(None, s.params, state, optimizer=optimizer, storage_writer=FsspecWriter(where))
    like = from_sequential(model(seed=9), [1, 5])
    like_optimizer = adamw(optree.tree_leaves(like.params))
    _, like_state = saving.load(where, like.params, like.state, optimizer=like_optimizer,
                                storage_reader=FsspecReader(where))
    assert_same_checkpoint(s, state, optimizer, like, like_state, like_optimizer)
    with pytest.raises(FileNotFoundError, match="no checkpoint in 'memory://fpipe-test/no'"):
        saving.load(None, like.params, storage_reader=FsspecReader("memory://fpipe-test/no"))


def plain_steps(plain, optimizer, steps):
    plain.train()
    for x, t in steps:
        optimizer.zero_grad()
        F.mse_loss(plain(x), t).backward()
        optimizer.step()


def by_name(s, optimizer) -> dict:
    """Each parameter's optimiser state and group, by model name (one leaf per name here)."""
    name_of = {id(leaf): name for p in s.params for name, leaf in p.items()}
    return {name_of[id(p)]: (optimizer.state[p], group)
            for group in optimizer.param_groups for p in group["params"]}


def test_a_checkpoint_in_torch_s_nested_optimizer_layout_resumes_a_pipeline(tmp_path):
    """torch's default ``get_state_dict`` layout (the optimiser's groups as lists of names)
    loads into a pipeline: AdamW's state bitwise, and the next step as the plain model's."""
    plain = model()
    plain_optimizer = adamw(plain.parameters())
    plain_steps(plain, plain_optimizer, batches(1, 2))
    model_sd, optim_sd = get_state_dict(plain, plain_optimizer)  # default: nested
    assert optim_sd["param_groups"][0]["params"][0] == "0.weight"
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path, no_dist=True)
    saved_model = {k: v.clone() for k, v in plain.state_dict().items()}
    saved_optimizer = copy.deepcopy(plain_optimizer.state_dict())

    s = from_sequential(model(seed=3), [2, 4])
    optimizer = torch.optim.AdamW(optree.tree_leaves(s.params), lr=0.5, weight_decay=0.0)
    _, state = saving.load(tmp_path, s.params, s.state, optimizer=optimizer)
    loaded = by_name(s, optimizer)
    for name, p in plain.named_parameters():
        values, group = loaded[name]
        assert (group["lr"], group["weight_decay"]) == (1e-2, 0.1)  # the saved ones
        assert all(torch.equal(values[k], plain_optimizer.state[p][k])
                   for k in ("step", "exp_avg", "exp_avg_sq")), name

    step = batches(2, 1)
    state = train(s, optimizer, state, step, chunks=1)
    plain_steps(plain, plain_optimizer, step)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(flat(s.params, state)[name], value, rtol=1e-10, atol=1e-12)

    # The plain module reads it too (with torch's nested options), over a step of its own.
    again = model(seed=4)
    again_optimizer = torch.optim.AdamW(again.parameters(), lr=0.5)
    plain_steps(again, again_optimizer, batches(5, 1))
    saving.load_module(tmp_path, again, again_optimizer)
    for name, value in saved_model.items():
        assert torch.equal(again.state_dict()[name], value), name
    assert_same_optimizer(saved_optimizer, again_optimizer.state_dict())


def grouped(parameters, lr=1e-2):
    """AdamW with two groups: weight decay on the weights, none (and another lr) on the
    biases and BatchNorm's."""
    parameters = list(parameters)
    weights = [p for p in parameters if p.dim() > 1]
    rest = [p for p in parameters if p.dim() <= 1]
    return torch.optim.AdamW([{"params": weights}, {"params": rest, "lr": 3e-2,
                                                      "weight_decay": 0.0}],
                             lr=lr, weight_decay=0.1)


@pytest.mark.parametrize("layout", ["flat", "nested"])
def test_each_parameter_gets_its_own_group_s_hyper_parameters(tmp_path, layout):
    plain = model()
    plain_optimizer = grouped(plain.parameters())
    plain_steps(plain, plain_optimizer, batches(1, 2))
    options = FLAT if layout == "flat" else StateDictOptions()
    model_sd, optim_sd = get_state_dict(plain, plain_optimizer, options=options)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path, no_dist=True)

    # Groups as saved, but in another order and with other values: each takes its own.
    s = from_sequential(model(seed=3), [3, 3])
    leaves = optree.tree_leaves(s.params)
    optimizer = torch.optim.AdamW([{"params": [p for p in leaves if p.dim() <= 1]},
                                   {"params": [p for p in leaves if p.dim() > 1]}], lr=0.5)
    _, state = saving.load(tmp_path, s.params, s.state, optimizer=optimizer)
    for name, (_, group) in by_name(s, optimizer).items():
        expected = (1e-2, 0.1) if dict(plain.named_parameters())[name].dim() > 1 else (3e-2, 0.0)
        assert (group["lr"], group["weight_decay"]) == expected, name
    step = batches(2, 1)
    state = train(s, optimizer, state, step, chunks=1)
    plain_steps(plain, plain_optimizer, step)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(flat(s.params, state)[name], value, rtol=1e-10, atol=1e-12)

    # One group for all of them would keep one lr of two: refused, naming them, nothing read.
    one = from_sequential(model(seed=3), [3, 3])
    single = adamw(optree.tree_leaves(one.params))
    with pytest.raises(ValueError, match=r"group 0 holds '0.bias' and '0.weight', saved with "
                                         r"lr=0.03 and 0.01: put them in groups of their own"):
        saving.load(tmp_path, one.params, one.state, optimizer=single)
    assert torch.equal(one.params[0]["0.weight"], model(seed=3)[0].weight)
    assert not single.state


@pytest.mark.needs_extra
def test_tied_hf_gpt2_loads_and_round_trips_through_save_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    example = load_example("hf_gpt2")

    def tied(seed):
        torch.manual_seed(seed)
        config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2,
                                         n_head=2, tie_word_embeddings=True, bos_token_id=0,
                                         eos_token_id=0)
        return transformers.GPT2LMHeadModel(config)

    source = tied(0)
    modules = example.cut(source, blocks_per_stage=1)  # embeddings, block, block, head
    s = from_modules(modules, root=source, stateful=False)
    assert s.names[0]["wte.weight"] == "transformer.wte.weight"
    assert s.names[-1]["lm_head.weight"] == "lm_head.weight"
    assert s.ties == (((0, "wte.weight"), (3, "lm_head.weight")),)
    saving.save(tmp_path / "ckpt", s.params, names=s.names)

    target = tied(1)
    saving.load_module(tmp_path / "ckpt", target)
    expected = source.state_dict()
    assert target.state_dict().keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(target.state_dict()[name], value), name
    assert target.lm_head.weight is target.transformer.wte.weight  # still tied

    # The plain state_dict way, as nn.Module users write it, finds every name too.
    plain = tied(2)
    sd = {"model": plain.state_dict()}
    dcp.load(sd, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    plain.load_state_dict(sd["model"])
    target.save_pretrained(tmp_path / "hf")
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    for name, value in expected.items():
        assert torch.equal(back.state_dict()[name], value), name
        assert torch.equal(plain.state_dict()[name], value), name


class TiedLM(nn.Module):
    """Embedding, a hidden layer, and a head that is the embedding (one tensor, two names)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wte, self.hidden = nn.Embedding(13, 6), nn.Linear(6, 6)
        self.head = nn.Linear(6, 13, bias=False)
        self.head.weight = self.wte.weight
        self.double()

    def forward(self, ids):
        return self.head(torch.tanh(self.hidden(self.wte(ids))))


class Body(nn.Module):
    def __init__(self, lm: TiedLM) -> None:
        super().__init__()
        self.wte, self.hidden = lm.wte, lm.hidden

    def forward(self, ids):
        return torch.tanh(self.hidden(self.wte(ids)))


def lm_loss(logits, t):
    return F.cross_entropy(logits.flatten(0, 1), t.flatten())


def test_a_plain_tied_model_s_optimizer_state_resumes_both_copies(tmp_path):
    """The plain model's AdamW holds the tied weight once (``wte.weight``); loaded with
    ``ties=``, the pipeline's copy under ``head.weight`` takes that state too, and the next
    steps of the pipeline and of the plain model agree."""
    g = torch.Generator().manual_seed(5)
    data = [(torch.randint(0, 13, (4, 5), generator=g), torch.randint(0, 13, (4, 5), generator=g))
            for _ in range(3)]
    plain = TiedLM(seed=0)
    plain_optimizer = adamw(plain.parameters())
    for ids, t in data[:2]:
        plain_optimizer.zero_grad()
        lm_loss(plain(ids), t).backward()
        plain_optimizer.step()
    model_sd, optim_sd = get_state_dict(plain, plain_optimizer, options=FLAT)
    assert not any(k.startswith("state.head.weight") for k in optim_sd)  # held once
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path / "plain",
             no_dist=True)

    other = TiedLM(seed=1)
    s = from_modules([Body(other), other.head], root=other, stateful=False)
    assert s.ties == (((0, "wte.weight"), (1, "weight")),)
    optimizer = adamw(optree.tree_leaves(s.params))
    with pytest.raises(KeyError, match="no optimizer state for 'head.weight'"):
        saving.load(tmp_path / "plain", s.params, optimizer=optimizer, names=s.names)
    saving.load(tmp_path / "plain", s.params, optimizer=optimizer, names=s.names, ties=s.ties)
    first, last = optimizer.state[s.params[0]["wte.weight"]], optimizer.state[s.params[1]["weight"]]
    assert torch.equal(first["exp_avg"], last["exp_avg"])
    assert first["exp_avg"] is not last["exp_avg"]  # each copy updates its own

    ids, t = data[2]
    with fpipe.pipeline(s.stages, s.params, schedule=gpipe(chunks=2), loss_fn=lm_loss,
                        ties=s.ties) as pipe:
        _, grads = pipe.value_and_grad(ids, t)
    bind_grads(s.params, grads)
    optimizer.step()
    plain_optimizer.zero_grad()
    lm_loss(plain(ids), t).backward()
    plain_optimizer.step()
    for stage, local in s.ties[0]:
        torch.testing.assert_close(s.params[stage][local], plain.wte.weight.detach(),
                                   rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s.params[0]["hidden.weight"], plain.hidden.weight.detach(),
                               rtol=1e-10, atol=1e-12)


def test_several_ranks_without_numpy_is_told_what_to_install(tmp_path, monkeypatch):
    """torch.distributed.checkpoint exchanges its plans through torch's object collectives,
    which need numpy: on several ranks without it, a clear ImportError before any write."""
    find_spec = saving.importlib.util.find_spec
    monkeypatch.setattr(saving.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(saving.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(saving.importlib.util, "find_spec",
                        lambda name, *args: None if name == "numpy" else find_spec(name, *args))
    said = r"several ranks needs numpy.*pip install -e '\.\[saving\]'"
    with pytest.raises(ImportError, match=said):
        saving.save(tmp_path / "ckpt", [{"w": torch.ones(2)}])
    assert not (tmp_path / "ckpt").exists()
