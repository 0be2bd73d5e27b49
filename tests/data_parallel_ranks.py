"""What each spawned rank runs in tests/test_data_parallel.py: pipelines of two workers, two
replicas of them on four ranks (rank ``r`` is worker ``r % 2`` of replica ``r // 2``), each
replica given its own shard of the global batch. Also the close() scenario on two ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from distributed_ranks import data, fdist_schedule
from models import block, mlp_params, mse
from torch.distributed.device_mesh import init_device_mesh

import fpipe.distributed as fdist
from fpipe.optim import global_norm

#: (schedule, chunks, stages, bucket_mb) of the mesh scenario: ZB-V puts stages 0 and 3 on
#: worker 0, so stage 3's gradients are reduced while stage 0's backwards still run; 1F1B's
#: buckets are small enough that each leaf is one.
MESH_CASES = (("gpipe", 2, 2, 25.0), ("1f1b", 2, 2, 500 / 2**20), ("zbv", 3, 4, 25.0))
#: The learning rate of the SGD step between the two steps of a case.
LR = 0.1


def mesh_steps() -> list:
    """Two global batches of 8 samples."""
    return [data(8, 8, seed=30), data(8, 8, seed=31)]


def shard(tree: torch.Tensor, replica: int, sizes: tuple[int, ...]) -> torch.Tensor:
    start = sum(sizes[:replica])
    return tree[start:start + sizes[replica]]


def _train(pipe, params: dict, steps: list, replica: int, sizes: tuple, worker: int,
           last: int) -> list:
    """Each step on this replica's shard, then SGD on the returned gradients."""
    out = []
    for x, target in steps:
        loss, grads = pipe.value_and_grad(
            shard(x, replica, sizes) if worker == 0 else None,
            shard(target, replica, sizes) if worker == last else None, params=params)
        out.append((loss, grads))
        params = {s: {k: v - LR * grads[s][k] for k, v in params[s].items()} for s in params}
    return out


def mesh(rank: int, world: int) -> dict:
    """Every case of :data:`MESH_CASES` on a ("dp", "pp") = (2, 2) DeviceMesh, even shards."""
    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica, worker = device_mesh.get_coordinate()
    out = {}
    for name, chunks, n_stages, bucket_mb in MESH_CASES:
        schedule = fdist_schedule(name, chunks)
        held = fdist.my_stages(schedule, n_stages, mesh=device_mesh)
        full = mlp_params(n_stages)
        with fdist.pipeline([block] * n_stages, {s: full[s] for s in held}, schedule=schedule,
                            loss_fn=mse, mesh=device_mesh, timeout=20,
                            bucket_mb=bucket_mb) as pipe:
            out[name] = _train(pipe, {s: full[s] for s in held}, mesh_steps(), replica,
                               (4, 4), worker, pipe.program.placement[-1])
            out[f"{name}: ranks"] = pipe.ranks
    return out


#: The accumulating scenario's calls: (global batch, its shards' sizes); the first call
#: accumulates, the second returns the sum. Uneven shards: each call's gradients are weighted
#: by the replica's share of that call's batch.
ACCUMULATED = ((30, (5, 3)), (31, (4, 4)))


def accumulating(rank: int, world: int) -> dict:
    """``accumulate=True`` on plain replicas (no FSDP) of a ("dp", "pp") = (2, 2) mesh, 1F1B
    and ZB-V: two calls, the first accumulating; each call's loss, the last one's gradients."""
    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica, worker = device_mesh.get_coordinate()
    out = {}
    for name, chunks, n_stages in (("1f1b", 2, 2), ("zbv", 3, 4)):
        schedule = fdist_schedule(name, chunks)
        held = fdist.my_stages(schedule, n_stages, mesh=device_mesh)
        full = mlp_params(n_stages)
        with fdist.pipeline([block] * n_stages, {s: full[s] for s in held}, schedule=schedule,
                            loss_fn=mse, mesh=device_mesh, timeout=20) as pipe:
            last = pipe.program.placement[-1]
            calls = []
            for call, (seed, sizes) in enumerate(ACCUMULATED):
                x, target = data(8, 8, seed=seed)
                calls.append(pipe.value_and_grad(
                    shard(x, replica, sizes) if worker == 0 else None,
                    shard(target, replica, sizes) if worker == last else None,
                    accumulate=call == 0))
            out[name] = calls
    return out


def uneven_steps() -> list:
    return [data(8, 8, seed=32)]


def groups(rank: int, world: int) -> dict:
    """Explicit ``group=`` and ``data_parallel=`` groups, shards of 5 and 3 samples: a
    training step, a vjp step, the gradients left alone (``grad_reduce=None``), and a shard
    smaller than ``chunks`` refused on every replica; last, "replicas" pairing different workers
    refused."""
    pairs = ([0, 1], [2, 3], [0, 2], [1, 3], [0, 3], [1, 2])
    made = {tuple(r): dist.new_group(list(r)) for r in pairs}  # by every rank, in one order
    replica, worker = divmod(rank, 2)
    pp = made[(0, 1)] if replica == 0 else made[(2, 3)]
    dp = made[(0, 2)] if worker == 0 else made[(1, 3)]
    schedule, full, sizes = fdist_schedule("1f1b", 2), mlp_params(2), (5, 3)
    (x, target), = uneven_steps()
    first, last = worker == 0, worker == 1
    out = {"held": fdist.my_stages(schedule, 2, group=pp)}
    params = {worker: full[worker]}
    with fdist.pipeline([block, block], params, schedule=schedule, loss_fn=mse, group=pp,
                        data_parallel=dp, timeout=20) as pipe:
        out["ranks"] = pipe.ranks
        out["train"] = _train(pipe, params, [(x, target)], replica, sizes, worker, 1)
        xs, ts = shard(x, replica, sizes), shard(target, replica, sizes)
        try:
            pipe.value_and_grad(xs[:1] if first and replica == 1 else xs if first else None,
                                ts[:1] if last and replica == 1 else ts if last else None)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            out["short"] = (type(exc).__name__, str(exc))
        out["after"] = pipe.value_and_grad(xs if first else None, ts if last else None)[0]
    gpipe = fdist_schedule("gpipe", 2)
    with fdist.pipeline([block, block], params, schedule=gpipe, loss_fn=mse, group=pp,
                        data_parallel=dp, timeout=20) as pipe:
        y, vjp_fn = pipe.vjp(xs if first else None)
        # The cotangent of this shard's mean loss, as each replica's own loss would give it.
        cotangent = 2 * (y - ts) / ts.numel() if last else None
        out["vjp"] = vjp_fn(cotangent)
    with fdist.pipeline([block, block], params, schedule=schedule, loss_fn=mse, group=pp,
                        data_parallel=dp, grad_reduce=None, timeout=20) as pipe:
        out["alone"] = pipe.value_and_grad(xs if first else None, ts if last else None)
    crossed = made[(0, 3)] if rank in (0, 3) else made[(1, 2)]
    try:  # replicas paired worker 0 with worker 1: refused on every rank
        fdist.pipeline([block, block], params, schedule=schedule, loss_fn=mse, group=pp,
                       data_parallel=crossed, timeout=20)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out["crossed"] = (type(exc).__name__, str(exc))
    return out


def cursed(p, x):
    if (x == 99).any():
        raise ValueError("sample 99 is cursed")
    return block(p, x)


def replica_fails(rank: int, world: int) -> dict:
    """A stage raising in replica 1 only: every rank of both replicas stops with an error."""
    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica, worker = device_mesh.get_coordinate()
    schedule, full = fdist_schedule("1f1b", 2), mlp_params(2)
    x, target = data(4, 8, seed=34)
    if replica == 1:
        x[0, 0] = 99
    pipe = fdist.pipeline([cursed, block], {worker: full[worker]}, schedule=schedule,
                          loss_fn=mse, mesh=device_mesh, timeout=10)
    try:
        pipe.value_and_grad(x if worker == 0 else None, target if worker == 1 else None)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return {"error": (type(exc).__name__, str(exc))}
    return {"error": None}


def closing(rank: int, world: int) -> dict:
    """Three rounds of: a pipeline in a ``with`` block whose last call is forward-only, a
    call after it, the default group destroyed at once and joined again."""
    import distributed_ranks

    schedule, full = fdist_schedule("1f1b", 2), mlp_params(2)
    x, target = data(4, 8, seed=33)
    out = []
    for round_ in range(3):
        with fdist.pipeline([block, block], {rank: full[rank]}, schedule=schedule,
                            loss_fn=mse, timeout=20) as pipe:
            loss, _ = pipe.value_and_grad(x if rank == 0 else None,
                                          target if rank == 1 else None)
            pipe(x if rank == 0 else None)
        pipe.close()  # a second close does nothing
        try:
            pipe(x if rank == 0 else None)
            after = None
        except RuntimeError as exc:
            after = str(exc)
        out.append((loss, after, pipe.group is None and not pipe.driver.links))
        dist.destroy_process_group()
        store = dist.PrefixStore(f"round{round_}", distributed_ranks.STORE)
        dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
    return {"rounds": out}


def unclosed(rank: int, world: int) -> dict:
    """A pipeline never closed, kept alive by a reference cycle past the script's end: the
    exit hook drops its groups while the interpreter still runs."""
    from fpipe._runtime.ranks import teardown

    schedule, full = fdist_schedule("1f1b", 2), mlp_params(2)
    full[1]["b"] = full[0]["b"].clone()
    x, target = data(4, 8, seed=33)
    pipe = fdist.pipeline([block, block], {rank: full[rank]}, schedule=schedule, loss_fn=mse,
                          timeout=20, ties=[[(0, "b"), (1, "b")]])
    pipe.value_and_grad(x if rank == 0 else None, target if rank == 1 else None)
    pipe.cycle = pipe
    before = pipe._calls in teardown.OPEN and pipe.group is not None
    teardown._before_teardown()  # what the interpreter's exit runs
    return {"before": before, "after": (pipe.group, pipe.driver.links, pipe._results)}


#: The tie of :func:`mesh_ties`: the two stages' weight matrices are one tensor.
MESH_TIES = [[(0, "w"), (1, "w")]]


def tied_params() -> list:
    params = mlp_params(2)
    params[1]["w"] = params[0]["w"].clone()
    return params


def mesh_ties(rank: int, world: int, device: str = "cpu") -> dict:
    """A tie across the two workers of each replica on a (2, 2) mesh: the tie's sum runs over
    each replica's pipeline ranks after the data-parallel mean; then the global norm of the
    gradients, a tie counted once, summed over the pipeline's ranks. Results come back on
    the CPU."""
    device_mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "pp"))
    replica, worker = device_mesh.get_coordinate()
    here = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    schedule, full = fdist_schedule("1f1b", 2), tied_params()
    held = fdist.my_stages(schedule, 2, mesh=device_mesh)
    params = {s: {k: v.to(here) for k, v in full[s].items()} for s in held}
    steps = [(x.to(here), t.to(here)) for x, t in mesh_steps()]
    with fdist.pipeline([block, block], params, schedule=schedule, loss_fn=mse,
                        mesh=device_mesh, timeout=20, ties=MESH_TIES) as pipe:
        trained = _train(pipe, params, steps, replica, (4, 4), worker, 1)
        x, target = steps[0]
        _, grads = pipe.value_and_grad(shard(x, replica, (4, 4)) if worker == 0 else None,
                                       shard(target, replica, (4, 4)) if worker == 1 else None)
        norm = global_norm(grads, ties=MESH_TIES, group=device_mesh.get_group("pp"))
    cpu = torch.device("cpu")
    return {"steps": [(loss.to(cpu), {s: {k: v.to(cpu) for k, v in g.items()}
                                       for s, g in step.items()}) for loss, step in trained],
            "norm": norm.to(cpu)}


def mesh_ties_cuda(rank: int, world: int) -> dict:
    """:func:`mesh_ties` on four GPUs over NCCL: the tie groups, the data-parallel buckets,
    fpipe's gather of objects and the norm's all-reduce on CUDA tensors."""
    return mesh_ties(rank, world, "cuda")


def absent(rank: int, world: int) -> dict:
    """Ranks 0 and 1 build a pipeline on their own group; rank 2 never builds one: building
    is collective over the world, so 0 and 1 raise a PeerError after their timeout instead
    of waiting for the group's own (tens of minutes)."""
    import time

    pair = dist.new_group([0, 1])
    if rank == 2:
        time.sleep(8)
        return {"absent": True}
    start = time.monotonic()
    try:
        fdist.pipeline([block, block], {rank: mlp_params(2)[rank]},
                       schedule=fdist_schedule("1f1b", 2), loss_fn=mse, group=pair, timeout=3)
    except Exception as exc:  # noqa: BLE001 - the test reads what was raised
        return {"error": type(exc).__name__, "message": str(exc),
                "waited": time.monotonic() - start}
    return {"error": None}


#: The BatchNorm scenario's shards (uneven) and micro-batches.
BN_SHARDS, BN_CHUNKS = (5, 3), 2


def bn_modules() -> list:
    """Two stages, each a 1x1 convolution then a (deferred) BatchNorm, in float64: stage 1's
    statistics depend on stage 0's output, so both ranks of a replica carry state."""
    from torch import nn

    from fpipe.stages import DeferredBatchNorm

    with torch.random.fork_rng():
        torch.manual_seed(7)
        parts = [nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3)),
                 nn.Sequential(nn.Conv2d(3, 2, 1), nn.BatchNorm2d(2), nn.Flatten())]
    return [DeferredBatchNorm.convert(p.double(), BN_CHUNKS) for p in parts]


def bn_steps() -> list:
    """Three global batches of 8 samples: two training steps, then an inference call."""
    out = []
    for seed in (40, 41, 42):
        g = torch.Generator().manual_seed(seed)
        out.append((torch.randn(8, 2, 2, 2, generator=g, dtype=torch.float64),
                    torch.randn(8, 8, generator=g, dtype=torch.float64)))
    return out


def bn_state(rank: int, world: int) -> dict:
    """A (2, 2) mesh, shards of 5 and 3 samples: per ``state_reduce`` ("mean", "broadcast",
    None), two training steps threading the returned state (``value_and_grad`` then ``vjp``;
    with "mean", then a stateful inference call); each call's new state of this rank's stage
    comes back, and what the pipeline's reduction makes of a state of odd leaves."""
    from fpipe.stages import from_modules

    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica, worker = device_mesh.get_coordinate()
    schedule = fdist_schedule("gpipe", BN_CHUNKS)  # for vjp
    built = from_modules(bn_modules(), stateful=True)
    steps = bn_steps()
    out = {}
    for how in ("mean", "broadcast", None):
        state = {worker: built.state[worker]}
        with fdist.pipeline(built.stages, {worker: built.params[worker]}, schedule=schedule,
                            loss_fn=mse, mesh=device_mesh, state=state, timeout=20,
                            state_reduce=how) as pipe:
            x, target = (shard(t, replica, BN_SHARDS) for t in steps[0])
            _, _, state = pipe.value_and_grad(x if worker == 0 else None,
                                              target if worker == 1 else None, state=state)
            states = [plain(state[worker])]
            x, target = (shard(t, replica, BN_SHARDS) for t in steps[1])
            y, vjp_fn, state = pipe.vjp(x if worker == 0 else None, state=state)
            vjp_fn(2 * (y - target) / target.numel() if worker == 1 else None)
            states.append(plain(state[worker]))
            if how == "mean":
                _, state = pipe(shard(steps[2][0], replica, BN_SHARDS) if worker == 0 else None,
                                state=state)
                states.append(plain(state[worker]))
            # Odd leaves, each replica's own: a bool and an int tensor, a Python int, None, a
            # 0-dim float32; the share is what the pipeline gives this replica.
            odd = {"flag": torch.tensor([replica == 1, True]), "ids": torch.tensor([replica, 7]),
                   "n": replica, "none": None, "x": torch.tensor(replica + 1.0)}
            odd = pipe.data_parallel.agree_state({worker: odd}, BN_SHARDS[replica] / 8,
                                                 pipe.driver.faults)[worker]
        out[how] = states
        out[f"{how} odd"] = {k: v if v is None or isinstance(v, int) else (str(v.dtype), v.tolist())
                             for k, v in odd.items()}
    out["gone"] = _replica_gone(built, device_mesh, schedule)
    return out


def _replica_gone(built, device_mesh, schedule) -> tuple | None:
    """Replica 0 reduces its state, replica 1 never comes: replica 0's wait ends within the
    pipeline's timeout, as ``(error type, message, seconds waited)``."""
    import time

    replica, worker = device_mesh.get_coordinate()
    pipe = fdist.pipeline(built.stages, {worker: built.params[worker]}, schedule=schedule,
                          loss_fn=mse, mesh=device_mesh, state={worker: built.state[worker]},
                          timeout=3)
    if replica == 1:
        time.sleep(6)
        return None
    start = time.monotonic()
    try:
        pipe.data_parallel.agree_state({worker: built.state[worker]}, 0.5, pipe.driver.faults)
    except Exception as exc:  # noqa: BLE001 - the test reads what was raised
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None


def plain(state: dict) -> dict:
    """``{name: (dtype name, values as lists)}``: far smaller pickled than tensors, so four
    ranks' results fit the harness's pipe (exact: Python floats are float64)."""
    return {k: (str(v.dtype).removeprefix("torch."), v.tolist()) for k, v in state.items()}
