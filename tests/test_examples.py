"""The example scripts run, their losses go down, and the losses they print are those of the
same training written out in plain autograd (no fpipe): same seeds, same data, same optimiser.

A pipelined step draws one number from the caller's CPU generator (the step's seed), so the
references draw it too where the script draws its data from that generator afterwards."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import optree
import patience
import pytest
import torch
import torch.nn.functional as F
from models import EXAMPLES, forward, load_example


def step_seed():
    """What fpipe takes from the caller's CPU generator per step."""
    torch.empty((), dtype=torch.int64).random_()


def adam_step(optimizer, leaves, loss):
    grads = torch.autograd.grad(loss, leaves)
    for leaf, grad in zip(leaves, grads):
        leaf.grad = grad
    optimizer.step()
    return loss.item()


def plain_train_mlp(steps):
    example = load_example("train_mlp")
    torch.manual_seed(0)
    width, batch = 64, 256
    params = example.init(width, n_blocks=3, out=1)
    stages = [example.block] * 3 + [example.head]
    teacher = torch.randn(width, 1)
    leaves = [leaf.requires_grad_() for leaf in optree.tree_leaves(params)]
    optimizer = torch.optim.Adam(leaves, lr=0.05)
    losses = []
    for _ in range(steps):
        x = torch.randn(batch, width)
        target = torch.sin(x @ teacher)
        step_seed()
        losses.append(adam_step(optimizer, leaves, F.mse_loss(forward(stages, params, x),
                                                               target)))
    return losses


def plain_unet_skips(steps):
    example = load_example("unet_skips")
    torch.manual_seed(0)
    layer = example.layer
    params = [layer(1, 8), layer(8, 16),
              {"bottom": layer(16, 16), "merge": layer(32, 16)},
              {"merge": layer(24, 8), "out": layer(8, 1, k=1)}]
    stages = [example.encode_full, example.encode_half, example.decode_half,
              example.decode_full]
    leaves = [leaf.requires_grad_() for leaf in optree.tree_leaves(params)]
    optimizer = torch.optim.Adam(leaves, lr=3e-3)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        clean = example.blobs(32, data)
        noisy = clean + 0.3 * torch.randn(clean.shape, generator=data)
        losses.append(adam_step(optimizer, leaves,
                                F.mse_loss(forward(stages, params, noisy), clean)))
    return losses


def plain_custom_schedule(steps, n_stages=4):
    example = load_example("custom_schedule")
    torch.manual_seed(0)
    width, batch = 32, 64
    params = [{"w": torch.randn(width, width) / width ** 0.5, "b": torch.zeros(width)}
              for _ in range(n_stages)]
    teacher = torch.randn(width, width) / width ** 0.5
    torch.randn(batch, width, dtype=torch.float64)  # the script's float64 gradient check
    step_seed()
    leaves = [leaf.requires_grad_() for leaf in optree.tree_leaves(params)]
    optimizer = torch.optim.Adam(leaves, lr=0.01)
    losses = []
    for _ in range(steps):
        x = torch.randn(batch, width)
        step_seed()
        losses.append(adam_step(optimizer, leaves, F.mse_loss(
            forward([example.block] * n_stages, params, x), torch.tanh(x @ teacher))))
    return losses


@pytest.mark.needs_extra
@pytest.mark.parametrize("script, steps, reference", [
    ("train_mlp", 40, plain_train_mlp),
    ("unet_skips", 15, plain_unet_skips),
    ("custom_schedule", 30, plain_custom_schedule),
])
def test_example_learns_as_plain_autograd_would(script, steps, reference):
    pytest.importorskip("tqdm")  # the examples' progress bars: the [examples] extra
    run = patience.run([sys.executable, str(EXAMPLES / f"{script}.py"), "--steps", str(steps)],
                       300, check=True, capture_output=True, text=True)
    first, last = map(float, re.search(r"loss (\S+) -> (\S+)", run.stdout).groups())
    assert last < 0.8 * first
    # At most a worker per core (examples/workers.py): no warning on a 2-core machine either.
    assert "OversubscriptionWarning" not in run.stderr, run.stderr[-2000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # these small convolutions run far slower on two busy cores
    try:
        losses = reference(steps)
    finally:
        torch.set_num_threads(threads)
    # The script prints 4 decimals; micro-batch sums round differently from whole-batch ones.
    assert first == pytest.approx(losses[0], abs=2e-4)
    assert last == pytest.approx(losses[-1], abs=2e-4, rel=2e-3)
    if script == "custom_schedule":
        assert "gradients equal torch.func's on the whole batch (float64)" in run.stdout
        assert "1F1B with look-ahead 1 on 4 stages" in run.stdout


def test_distributed_example_says_how_to_launch_it_and_that_command_trains(tmp_path):
    """Run with python instead of torchrun, the script names the torchrun command that runs it
    (not torch's "RANK expected" error); that command, run as printed, trains."""
    script = EXAMPLES / "train_distributed.py"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    run = patience.run([sys.executable, str(script), "--steps", "20"], 120, env=env,
                       capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 1 and "Traceback" not in run.stderr and "RANK" not in run.stderr
    command = f"torchrun --standalone --nproc-per-node=2 {script} --steps 20"
    assert f"launch it with torchrun:\n    {command}\n" in run.stderr
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    args = shlex.split(command)
    trained = patience.run([torchrun, *args[1:]], 180, env=env, capture_output=True, text=True,
                           cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-2000:]
    losses = [float(v) for v in re.findall(r"step +\d+  loss (\S+)", trained.stdout)]
    assert len(losses) == 3 and losses[-1] < 0.8 * losses[0]


@pytest.mark.needs_extra
def test_scale_out_example_trains_on_a_mesh_and_another_shape_resumes_it(tmp_path):
    """docs/scaling-out.md's two commands, as the page gives them: 4 ranks (2 replicas x 2
    pipeline workers, a tie across the workers, built on meta) train and save; 2 ranks (no
    data parallelism) resume from the checkpoint: their first evaluation is the saved job's
    last. (The page's test skips that block: this one runs it.)"""
    pytest.importorskip("tqdm")
    pytest.importorskip("numpy")  # DCP on several ranks
    page = (EXAMPLES.parent / "docs" / "scaling-out.md").read_text()
    block = page[page.index("```bash\n"):]
    commands = [line for line in block[:block.index("\n```")].splitlines()
                if line.startswith("torchrun ")]
    assert len(commands) == 2 and "--save ckpt" in commands[0] and "--resume ckpt" in commands[1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    torchrun = str(Path(sys.executable).with_name("torchrun"))

    def run(command: str) -> tuple[float, float]:
        args = [str(EXAMPLES.parent / a) if a.startswith("examples/") else a
                for a in command.split()[1:]]
        done = patience.run([torchrun, *args], 240, env=env, capture_output=True, text=True,
                            cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        start, end = re.search(r"evaluation loss (\S+) -> (\S+)", done.stdout).groups()
        return float(start), float(end)

    start, saved = run(commands[0])
    assert saved < 0.8 * start
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.distcp")) == [
        f"__{r}_0.distcp" for r in range(4)]
    resumed, end = run(commands[1])
    assert resumed == pytest.approx(saved, abs=2e-6)
    assert end < resumed


@pytest.mark.parametrize("cores", [1, 2, 3, 8])
def test_the_examples_run_a_worker_per_core_at_most_on_the_same_stages(cores, monkeypatch):
    """examples/workers.py: on fewer cores than stages, neighbouring stages share a worker,
    each stage's actions in its own order; with enough cores the schedule is left as it is."""
    from fpipe.schedules import one_f_one_b, validate

    workers = load_example("workers")
    monkeypatch.setattr(workers, "cores", lambda: cores)
    schedule = one_f_one_b(chunks=4)
    fitted = workers.fit(schedule, 4)
    if cores >= 4:
        assert fitted is schedule
        return
    program = validate(fitted)
    assert program.n_workers == cores
    assert list(program.placement) == sorted(program.placement)  # runs of neighbours
    alone = schedule.program(4)
    for stage in range(4):
        def mine(p, s=stage):
            return [(str(a.op), a.microbatch) for w in p.workers for a in w if a.stage == s]
        assert sorted(mine(program)) == sorted(mine(alone))


def test_scale_out_says_what_to_install_before_training_not_after(monkeypatch):
    """Its instructions install what ``--save`` needs (numpy, the [saving] extra); without
    numpy, ``--save`` stops before the first step with what to install."""
    example = load_example("scale_out")
    assert "pip install -e '.[examples,saving]'" in example.__doc__
    monkeypatch.setattr(example.importlib.util, "find_spec",
                        lambda name, *args: None if name == "numpy" else object())
    args = example.argparse.Namespace(save="ckpt", resume=None)
    with pytest.raises(SystemExit, match=r"--save and --resume need numpy.*\[saving\]"):
        example.check_checkpoints(args)
    example.check_checkpoints(example.argparse.Namespace(save=None, resume=None))
