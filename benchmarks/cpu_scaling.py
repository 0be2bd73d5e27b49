"""Pipeline scaling on the CPU: a deep stack of equal blocks over K workers, one thread each.

    python benchmarks/cpu_scaling.py [--quick] [--json PATH] [--workers 1 2 4 8]

Torch's intra-op threads are set to 1, so a worker uses one core. naive-1 is plain
``torch.func`` on the whole batch on one thread; fpipe splits the same stack into K stages.
speedup = naive-1 time / fpipe time; bound = K*M/(M+K-1), the most a fill-drain pipeline can
gain; efficiency = speedup / bound. "K x naive-1 at once" runs K copies on K threads: what the
machine itself allows. "naive-1, M micro-batches in a loop" is the same work as a pipeline's,
micro-batched but on one thread: on a CPU small micro-batches re-read every weight, so it is
the baseline that isolates what pipelining itself gains.
"""

from __future__ import annotations

import os
import threading

import torch
from common import parser, report, seconds_per_call
from torch.func import grad_and_value

import fpipe
from fpipe.schedules import gpipe, one_f_one_b


def block(p, x):
    return x + torch.tanh(x @ p["w"]) @ p["v"]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+",
                   default=[k for k in (1, 2, 4, 8) if k <= (os.cpu_count() or 1)])
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    width, batch, layers = (256, 256, 8) if args.quick else (512, 512, 16)
    repeat = 3 if args.quick else 7
    params = [{"w": torch.randn(width, width) / width ** 0.5,
               "v": torch.randn(width, width) / width ** 0.5} for _ in range(layers)]
    x, target = torch.randn(batch, width), torch.randn(batch, width)

    def loss_fn(y, t):
        return torch.nn.functional.mse_loss(y, t)

    def whole(ps, xs=x, ts=target):
        h = xs
        for q in ps:
            h = block(q, h)
        return loss_fn(h, ts)

    naive = seconds_per_call(lambda: grad_and_value(whole)(params), repeat)
    rows = [{"K": 1, "M": 1, "what": "naive-1", "step_ms": naive * 1e3, "speedup": 1.0,
             "bound": 1.0, "efficiency": 1.0}]
    for k in args.workers:
        if k > 1:
            def copies(k=k):
                threads = [threading.Thread(target=grad_and_value(whole), args=(params,))
                           for _ in range(k)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            t = seconds_per_call(copies, repeat)
            rows.append({"K": k, "M": 1, "what": f"{k} x naive-1 at once", "step_ms": t * 1e3,
                         "speedup": k * naive / t, "bound": float(k), "efficiency": naive / t})
        per = layers // k

        def stage(ps, h):
            for q in ps:
                h = block(q, h)
            return h

        stage_params = [params[i * per:(i + 1) * per] for i in range(k)]
        for m in ([8] if args.quick else [8, 32]):
            if k == 1:
                def micro_batched(m=m):
                    for xm, tm in zip(x.tensor_split(m), target.tensor_split(m)):
                        grad_and_value(whole)(params, xm, tm)
                t = seconds_per_call(micro_batched, repeat)
                rows.append({"K": 1, "M": m, "what": f"naive-1, {m} micro-batches in a loop",
                             "step_ms": t * 1e3, "speedup": naive / t, "bound": 1.0,
                             "efficiency": naive / t})
            for schedule in (gpipe(chunks=m, remat="never"), one_f_one_b(chunks=m)):
                with fpipe.pipeline([stage] * k, stage_params, schedule=schedule,
                                    loss_fn=loss_fn) as pipe:
                    t = seconds_per_call(lambda: pipe.value_and_grad(x, target), repeat)
                bound = k * m / (m + k - 1)
                rows.append({"K": k, "M": m, "what": f"fpipe {schedule!r}", "step_ms": t * 1e3,
                             "speedup": naive / t, "bound": bound,
                             "efficiency": naive / t / bound})
    report(f"CPU pipeline scaling ({layers} blocks of width {width}, batch {batch}, "
           f"1 intra-op thread)", ["K", "M", "what", "step_ms", "speedup", "bound",
                                   "efficiency"], rows, args.json)


if __name__ == "__main__":
    main()
