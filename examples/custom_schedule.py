"""Write a new schedule in a few lines, check it, simulate it, draw it, and train with it.

    python examples/custom_schedule.py [--stages 4] [--chunks 8] [--steps 60] [--draw PATH]

The schedule: 1F1B with look-ahead. Plain 1F1B lets stage k run K-1-k forwards before its first
backward, just enough to keep every worker busy when sends are free. When a transfer takes
time, each backward waits for a round trip, and 1F1B stalls. Running ``lookahead`` more
forwards first hides that latency, at the price of ``lookahead`` more live activations per
worker. The script prints the program, the simulated trade for look-ahead 0..3 with a transfer
cost, a text picture, then trains a small MLP with the schedule, checking its first gradients
against ``torch.func`` on the whole batch.
"""

from __future__ import annotations

import argparse

import optree
import torch
from torch.func import grad_and_value
from tqdm import tqdm
from workers import fit

import fpipe
from fpipe.schedules import Action, Costs, Op, Program, render, simulate


def one_f_one_b_lookahead(chunks: int, lookahead: int):
    """A schedule is a function ``n_stages -> Program`` (or a value with a ``program`` method):
    per worker, its actions in order."""
    def program(n_stages: int) -> Program:
        workers = []
        for k in range(n_stages):
            warmup = min(n_stages - 1 - k + lookahead, chunks)
            actions = [Action(k, Op.FORWARD, m) for m in range(warmup)]
            for m in range(chunks - warmup):  # steady state: one forward, one backward
                actions += [Action(k, Op.FORWARD, warmup + m), Action(k, Op.BACKWARD, m)]
            actions += [Action(k, Op.BACKWARD, m) for m in range(chunks - warmup, chunks)]
            workers.append(actions)
        return Program(workers, n_stages, chunks)
    return program


def block(p, x):
    return x + torch.tanh(x @ p["w"] + p["b"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--lookahead", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--draw", metavar="PATH", help="also draw the timeline (PNG or SVG)")
    args = parser.parse_args()
    schedule = one_f_one_b_lookahead(args.chunks, args.lookahead)
    program = fpipe.validate(schedule(args.stages))
    print(f"1F1B with look-ahead {args.lookahead} on {args.stages} stages:\n{program}\n")

    costs = Costs(forward=1.0, backward=2.0, transfer=1.0)
    print("simulated, a transfer as long as a forward:\n lookahead  makespan  bubble  peak live")
    for lookahead in range(4):
        sim = simulate(one_f_one_b_lookahead(args.chunks, lookahead)(args.stages), costs)
        print(f"{lookahead:10d}  {sim.makespan:8.1f}  {sim.bubble:6.1%}  "
              f"{max(sim.peak_activations):9d}")
    print(f"\n{render(simulate(program, costs))}\n")
    if args.draw:
        from fpipe.schedules import draw
        draw(simulate(program, costs), args.draw)
        print(f"drew {args.draw}")

    torch.manual_seed(0)
    width, batch = 32, 64
    params = [{"w": torch.randn(width, width) / width ** 0.5, "b": torch.zeros(width)}
              for _ in range(args.stages)]
    teacher = torch.randn(width, width) / width ** 0.5

    def loss_fn(y, target):
        return torch.nn.functional.mse_loss(y, target)

    with fpipe.pipeline([block] * args.stages, params, schedule=fit(schedule, args.stages),
                        loss_fn=loss_fn) as pipe:
        x = torch.randn(batch, width, dtype=torch.float64)
        double = optree.tree_map(lambda t: t.double(), params)
        _, grads = pipe.value_and_grad(x, torch.sin(x), params=double)

        def whole(ps):
            h = x
            for p in ps:
                h = block(p, h)
            return loss_fn(h, torch.sin(x))

        expected, _ = grad_and_value(whole)(double)
        for got, want in zip(optree.tree_leaves(grads), optree.tree_leaves(expected)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        print("gradients equal torch.func's on the whole batch (float64)")

        optimizer = torch.optim.Adam(optree.tree_leaves(params), lr=0.01)
        first = None
        for _ in (bar := tqdm(range(args.steps), desc="training")):
            x = torch.randn(batch, width)
            loss, grads = pipe.value_and_grad(x, torch.tanh(x @ teacher))
            fpipe.optim.bind_grads(params, grads)
            optimizer.step()
            first = loss.item() if first is None else first
            bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
        print(f"loss {first:.4f} -> {loss.item():.4f}")


if __name__ == "__main__":
    main()
