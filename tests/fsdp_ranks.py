"""What each spawned rank runs in tests/test_fsdp.py, and the plain single-process run it is
checked against: a GPT-like model with its LM head tied to the token embedding, in float64,
trained on a ("dp", "pp") = (2, 2) mesh with FSDP2-sharded stages, AdamW and an LR scheduler,
each step's gradients accumulated over two calls; then saved, and resumed on two ranks without
FSDP (ranks 0 and 1 resume one schedule's checkpoint, ranks 2 and 3 the other's) and with FSDP2
on the mesh and on another (its dimensions swapped); and a replicated pipeline's checkpoint
resumed with FSDP2."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fpipe.distributed as fdist
from fpipe import saving
from fpipe.optim import bind_grads
from fpipe.schedules import interleaved_one_f_one_b, one_f_one_b
from fpipe.stages import from_modules

VOCAB, LENGTH, WIDTH, BATCH = 16, 6, 8, 8
#: case -> (its schedule, number of stages): 1F1B with one stage per worker, interleaved 1F1B
#: with two (the tie then joins stage 0 on worker 0 and stage 3 on worker 1 either way).
CASES = {"1f1b": (lambda: one_f_one_b(chunks=2), 2),
         "interleaved": (lambda: interleaved_one_f_one_b(chunks=2), 4)}
#: Steps before the checkpoint, and after it (the resumed run's).
STEPS, MORE = 5, 2
#: The environment variable that names the directory of the checkpoints.
DIRECTORY = "FPIPE_TEST_FSDP_DIR"


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (part.view(b, t, 2, c // 2).transpose(1, 2) for part in self.qkv(x).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2, self.attn = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH), Attention()
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                 nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(LENGTH, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2's

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return Head(self)(self.blocks[1](self.blocks[0](Embed(self)(ids))))


class Embed(nn.Module):
    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.tok, self.pos = gpt.tok, gpt.pos

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1]))


class Head(nn.Module):
    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.norm, self.head = gpt.norm, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


def model() -> GPT:
    torch.manual_seed(0)
    return GPT().double()


def cut(gpt: GPT, n_stages: int) -> list[nn.Module]:
    if n_stages == 2:
        return [nn.Sequential(Embed(gpt), gpt.blocks[0]), nn.Sequential(gpt.blocks[1], Head(gpt))]
    return [Embed(gpt), gpt.blocks[0], gpt.blocks[1], Head(gpt)]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The two global batches whose gradients a step accumulates."""
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g),
             torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)) for _ in range(2)]


def optimiser(params: list) -> tuple[torch.optim.Optimizer, object]:
    optimizer = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def plain(steps: int) -> tuple[list[float], dict[str, torch.Tensor], GPT, object, object]:
    """The plain module trained alone: each call's loss, the parameters after ``steps``,
    and the module, optimiser and scheduler."""
    gpt = model()
    optimizer, scheduler = optimiser(list(gpt.parameters()))
    losses = plain_steps(gpt, optimizer, scheduler, range(steps))
    return losses, {k: v.detach().clone() for k, v in gpt.state_dict().items()}, gpt, \
        optimizer, scheduler


def plain_steps(gpt: GPT, optimizer, scheduler, steps: range) -> list[float]:
    losses = []
    for step in steps:
        optimizer.zero_grad()
        for ids, target in batches(step):
            loss = loss_fn(gpt(ids), target)
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        scheduler.step()
    return losses


# -- the ranks -----------------------------------------------------------------------------------


@contextlib.contextmanager
def counting_reduce_scatters():
    """Count reduce-scatters (fpipe's gradient shards): ``reduce_scatter_single`` in torch
    2.13, ``reduce_scatter_tensor`` before."""
    count = [0]
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else \
        "reduce_scatter_tensor"
    original = getattr(dist, name)

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    setattr(dist, name, counted)
    try:
        yield count
    finally:
        setattr(dist, name, original)


def held_bytes(params: dict, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds of parameters, gradients and optimiser state (a DTensor's local
    shard only)."""
    def size(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = 0
    for p in optree.tree_leaves(params):
        total += size(p) + (0 if p.grad is None else size(p.grad))
        total += sum(size(v) for v in optimizer.state[p].values() if torch.is_tensor(v))
    return total


def _train(pipe, optimizer, scheduler, steps: range, shard: tuple, ends: tuple) -> list:
    """Each step: two calls, the first accumulating, then the optimiser and the scheduler."""
    losses = []
    first, last = ends
    for step in steps:
        for call, (ids, target) in enumerate(batches(step)):
            rows = slice(*shard)
            loss, grads = pipe.value_and_grad(ids[rows] if first else None,
                                              target[rows] if last else None,
                                              accumulate=call == 0)
            losses.append(loss.item())
            assert (grads is None) == (call == 0)
        bind_grads(pipe.params, grads)
        optimizer.step()
        scheduler.step()
    return losses


def _full(params: dict, names: dict) -> dict:
    """Every held leaf whole, by the model's name (a collective over the replicas)."""
    out = {}
    for stage, tree in sorted(params.items()):
        for local, leaf in zip(saving.names(tree), optree.tree_leaves(tree)):
            whole = leaf.full_tensor() if hasattr(leaf, "full_tensor") else leaf
            out[names[stage][local]] = whole.detach().clone()
    return out


def _case(mesh, name: str, directory: Path, shard: str | None, steps: int,
          save_as: str | None = None) -> dict:
    make, n_stages = CASES[name]
    schedule = make()
    gpt = model()
    s = from_modules(cut(gpt, n_stages), stateful=False, root=gpt)
    held = fdist.my_stages(schedule, n_stages, mesh=mesh)
    replica, worker = mesh.get_coordinate()
    with counting_reduce_scatters() as count, fdist.pipeline(
            s.stages, {h: s.params[h] for h in held}, schedule=schedule, loss_fn=loss_fn,
            mesh=mesh, ties=s.ties, shard=shard, timeout=60) as pipe:
        optimizer, scheduler = optimiser(optree.tree_leaves(pipe.params))
        placement = pipe.program.placement
        losses = _train(pipe, optimizer, scheduler, range(steps),
                        (replica * BATCH // 2, (replica + 1) * BATCH // 2),
                        (worker == placement[0], worker == placement[-1]))
        out = {"losses": losses, "bytes": held_bytes(pipe.params, optimizer),
               "reduce_scatters": count[0], "held": held}
        if save_as is None:
            return out
        out["params"] = _full(pipe.params, s.names)
        saving.save(directory / save_as, pipe.params, optimizer=optimizer, names=s.names,
                    extra={"scheduler": scheduler})
    return out


def _resume_sharded(mesh, name: str, directory: Path, saved: str) -> dict:
    """The checkpoint ``saved`` loaded into a pipeline of ``name`` built with FSDP2 on the
    (2, 2) mesh, the optimiser built on its ``DTensor`` parameters: where its state lands
    (each tensor's type), then :data:`MORE` steps, each accumulated over two calls."""
    from torch.distributed.tensor import DTensor
    make, n_stages = CASES[name]
    schedule = make()
    torch.manual_seed(1)  # another start: everything comes from the checkpoint
    fresh = GPT().double()
    s = from_modules(cut(fresh, n_stages), stateful=False, root=fresh)
    held = fdist.my_stages(schedule, n_stages, mesh=mesh)
    replica, worker = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    with fdist.pipeline(s.stages, {h: s.params[h] for h in held}, schedule=schedule,
                        loss_fn=loss_fn, mesh=mesh, ties=s.ties, shard="fsdp",
                        timeout=60) as pipe:
        optimizer, scheduler = optimiser(optree.tree_leaves(pipe.params))
        saving.load(directory / saved, pipe.params, optimizer=optimizer, names=s.names,
                    ties=s.ties, extra={"scheduler": scheduler})
        kinds = {(key, type(p).__name__ == type(value).__name__)
                 for p in optree.tree_leaves(pipe.params)
                 for key, value in optimizer.state[p].items() if key != "step"}
        placement = pipe.program.placement
        losses = _train(pipe, optimizer, scheduler, range(STEPS, STEPS + MORE),
                        (replica * BATCH // 2, (replica + 1) * BATCH // 2),
                        (worker == placement[0], worker == placement[-1]))
        return {"losses": losses, "params": _full(pipe.params, s.names), "kinds": kinds,
                "sharded": all(isinstance(p, DTensor) for p in optree.tree_leaves(pipe.params))}


def _resume(mesh, name: str, directory: Path) -> dict:
    """The checkpoint of ``name`` on this rank's two pipeline ranks, no FSDP, no replicas:
    :data:`MORE` steps more, each on the whole global batch."""
    make, n_stages = CASES[name]
    schedule = make()
    group = mesh.get_group("pp")
    torch.manual_seed(1)  # another start: everything comes from the checkpoint
    fresh = GPT().double()
    s = from_modules(cut(fresh, n_stages), stateful=False, root=fresh)
    held = fdist.my_stages(schedule, n_stages, group=group)
    params = {h: s.params[h] for h in held}
    optimizer, scheduler = optimiser(optree.tree_leaves(params))
    saving.load(directory / name, params, optimizer=optimizer, names=s.names,
                process_group=group, ties=s.ties, extra={"scheduler": scheduler})
    worker = dist.get_process_group_ranks(group).index(dist.get_rank())
    with fdist.pipeline(s.stages, params, schedule=schedule, loss_fn=loss_fn, group=group,
                        ties=s.ties, timeout=60) as pipe:
        placement = pipe.program.placement
        losses = _train(pipe, optimizer, scheduler, range(STEPS, STEPS + MORE), (0, BATCH),
                        (worker == placement[0], worker == placement[-1]))
        return {"losses": losses, "params": _full(params, s.names)}


def train_save_resume(rank: int, world: int) -> dict:
    """Both cases under FSDP2 (saved), each once replicated (its memory), then resumed."""
    directory = Path(os.environ[DIRECTORY])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    out = {}
    for name in CASES:
        out[name] = _case(mesh, name, directory, "fsdp", STEPS, save_as=name)
        out[f"{name} replicated"] = _case(mesh, name, directory, None, 1)
    # a replicated (plain) pipeline's checkpoint, to resume under FSDP2
    out["1f1b plain"] = _case(mesh, "1f1b", directory, None, STEPS, save_as="1f1b plain")
    for name in CASES:  # every rank builds the same pipelines (a tie map is the job's)
        out[f"{name} resumed"] = _resume(mesh, name, directory)
        out[f"{name} resumed sharded"] = _resume_sharded(mesh, name, directory, name)
    out["1f1b plain resumed sharded"] = _resume_sharded(mesh, "1f1b", directory, "1f1b plain")
    # another mesh: its dimensions swapped, so each rank holds other stages and shards
    swapped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    out["1f1b resumed on another mesh"] = _resume_sharded(swapped, "1f1b", directory, "1f1b")
    # the uninterrupted run the 1F1B resumes are compared with to 1e-12
    out["1f1b uninterrupted"] = _case(mesh, "1f1b", directory, "fsdp", STEPS + MORE,
                                      save_as="1f1b uninterrupted")
    # Too large for the harness's queue (which is read once every rank has ended): a file.
    torch.save(out, directory / f"rank{rank}.pt")
    return {"saved": True}


#: The clipping scenario's threshold: below the first step's norm, so every gradient is scaled.
MAX_NORM = 0.05


def clipped(rank: int, world: int) -> dict:
    """One step of the tied GPT under FSDP2 on a (2, 2) mesh (1F1B), its gradients clipped
    by the whole model's norm (``pipe.clip_grad_norm``): the norm and every clipped gradient
    whole, by the model's name; and ``fpipe.optim.global_norm`` of them after."""
    from fpipe.optim import global_norm
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    make, n_stages = CASES["1f1b"]
    schedule = make()
    gpt = model()
    s = from_modules(cut(gpt, n_stages), stateful=False, root=gpt)
    held = fdist.my_stages(schedule, n_stages, mesh=mesh)
    replica, worker = mesh.get_coordinate()
    ids, target = batches(0)[0]
    rows = slice(replica * BATCH // 2, (replica + 1) * BATCH // 2)
    with fdist.pipeline(s.stages, {h: s.params[h] for h in held}, schedule=schedule,
                        loss_fn=loss_fn, mesh=mesh, ties=s.ties, shard="fsdp",
                        timeout=60) as pipe:
        _, grads = pipe.value_and_grad(ids[rows] if worker == 0 else None,
                                       target[rows] if worker == 1 else None)
        grads, norm = pipe.clip_grad_norm(grads, MAX_NORM)
        after = global_norm(grads, ties=pipe.ties, group=pipe.group)
        return {"norm": norm, "after": after, "grads": _full(grads, s.names)}


def plain_clipped() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`clipped` in the plain module: ``torch.nn.utils.clip_grad_norm_`` (the tied
    weight one parameter) after one whole-batch backward."""
    gpt = model()
    ids, target = batches(0)[0]
    loss_fn(gpt(ids), target).backward()
    norm = torch.nn.utils.clip_grad_norm_(gpt.parameters(), MAX_NORM)
    return norm, {name: p.grad for name, p in gpt.named_parameters(remove_duplicate=False)}
