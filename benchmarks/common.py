"""Shared by the benchmarks: timing, the machine's description, the table and the JSON file,
and a harness that runs a function on several processes joined in a gloo group."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import queue
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run of well under a minute; a spawned rank's failure ends it "
                        "with that rank's error")
    p.add_argument("--json", metavar="PATH", help="write the results here as JSON")
    return p


def machine() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }


def seconds_per_call(fn: Callable[[], object], repeat: int, warmup: int = 2) -> float:
    """The median wall time of ``repeat`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def report(title: str, columns: list[str], rows: list[dict], path: str | None,
           notes: list[str] | None = None, tables: dict[str, list[dict]] | None = None) -> None:
    """Print the machine, ``rows`` as a table of ``columns`` and ``notes`` under it; with
    ``path``, write all of it as JSON. ``tables`` are further tables, printed after the
    first under their names (and written under "tables"), each with the columns of its rows."""
    info = machine()
    print(f"{title}\n{info['command']}\ntorch {info['torch']}, {info['cpus']} CPUs "
          f"({info['processor']}), cuda: {info['cuda']}")
    _table(columns, rows)
    for name, more in (tables or {}).items():
        print(f"\n{name}")
        _table(list(more[0]) if more else [], more)
    for note in notes or []:
        print(f"note: {note}")
    if path:
        result = {"title": title, "machine": info, "rows": rows}
        if tables:
            result["tables"] = tables
        if notes:
            result["notes"] = notes
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def _table(columns: list[str], rows: list[dict]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


# -- several processes ---------------------------------------------------------------------------


def spawn_ranks(target: Callable, world: int, *args: object, timeout: float = 600.0,
                strict: bool = False) -> list:
    """``target(rank, world, *args)`` on ``world`` processes, one intra-op thread each,
    joined in a gloo group on 127.0.0.1 whose store this process hosts. They are forked from a
    server that imported torch once (a fresh interpreter spends seconds of CPU on that, a
    quick run's ranks more than on their work), and exit without the teardown.

    Returns each rank's result in rank order: what ``target`` returned, ``{"error": text}`` if
    it raised or the rank exited without a result, or None for a rank that outlived
    ``timeout`` (seconds of a :class:`LoadClock`) or was stopped because another failed.
    ``target`` must be importable by the children (a module-level function or a partial of
    one; ``forkserver`` start method).

    Fail fast: once one rank fails (raises or exits), the others get two seconds to report
    (their errors may follow from it) and are then killed, since they could only wait for it
    until their own timeouts. With ``strict`` (the quick smoke runs), a failed or timed-out
    rank raises :class:`RankFailed` instead, with the failing rank's error: a rank that died
    without a result first, else the first error reported, then the others' last lines.
    """
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # read when the server starts, once per run
    results_queue = context.Queue()
    ranks = [context.Process(target=_rank_main,
                             args=(target, rank, world, store.port, results_queue, args),
                             daemon=True) for rank in range(world)]
    for process in ranks:
        process.start()
    results: list = [None] * world
    pending, died, raised = set(range(world)), [], []
    clock = LoadClock()  # a busy machine (the test suite beside other jobs) slows healthy ranks
    deadline = timeout
    stop = deadline
    # Read while the ranks run (a result larger than a pipe's buffer would block its sender).
    while pending and clock.now() < stop:
        # Who had exited before this read: a rank sends its result before it exits, so one that
        # had exited and is still unheard once the queue is drained sent nothing (one that
        # exits during the read may have sent its result just after the read gave up).
        exited = [r for r in sorted(pending) if ranks[r].exitcode is not None]
        try:
            rank, result = results_queue.get(timeout=0.2)
        except queue.Empty:
            for r in exited:
                results[r] = {"error": f"rank {r} exited with code {ranks[r].exitcode} "
                                       f"without a result"}
                pending.discard(r)
                died.append(r)
        else:
            results[rank] = result
            pending.discard(rank)
            if isinstance(result, dict) and "error" in result:
                raised.append(rank)
        if (died or raised) and stop == deadline:  # hear the others briefly, then stop them
            stop = min(deadline, clock.now() + 2.0)
    # A rank that died is the likely cause of its peers' errors (a connection closed by it).
    failed = died + raised
    for process in ranks:
        if not failed:
            process.join(max(deadline - clock.now(), 1.0))
        if process.is_alive():
            process.kill()
            process.join()
    if strict and not failed:  # all answered: one that then ended badly (an abort at exit) failed
        for r, process in enumerate(ranks):
            if process.exitcode not in (0, None) and r not in pending:
                results[r] = {"error": f"rank {r} sent its result, then exited with code "
                                       f"{process.exitcode}"}
                died.append(r)
        failed = died
    if strict and failed:
        first, *others = failed
        also = "".join(f"\nthen rank {r}: {results[r]['error'].strip().splitlines()[-1]}"
                       for r in others)
        raise RankFailed(f"rank {first} of {world} failed, and the others were stopped:\n"
                         f"{results[first]['error']}{also}")
    if strict and pending:
        raise RankFailed(f"ranks {sorted(pending)} of {world} did not finish within "
                         f"{timeout:g} s")
    return results


class LoadClock:
    """Seconds of a fair share of the machine, for the timeouts of spawned ranks: each
    wall-clock second counts ``1 / load``, the 1-minute load average per core (at least 1). A
    fixed wall-clock limit kills healthy ranks on a loaded machine; a hang, which loads
    nothing, is still found after about the stated time."""

    def __init__(self) -> None:
        self.elapsed, self.last = 0.0, time.monotonic()

    def now(self) -> float:
        wall = time.monotonic()
        try:
            load = max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
        except OSError:  # no load average on this platform: wall-clock time
            load = 1.0
        self.elapsed += (wall - self.last) / load
        self.last = wall
        return self.elapsed


#: What the fork server of :func:`spawn_ranks` imports (``torch._dynamo``: what a process's
#: first ``torch.func`` call would load, as much CPU as importing torch). Not fpipe: the server
#: ignores this process's sys.path (Python 3.11) and could find another copy.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed"]


class RankFailed(RuntimeError):
    """A spawned rank failed in a strict run; the message holds that rank's error."""


def _rank_main(target: Callable, rank: int, world: int, port: int, results_queue,
               args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    gc.freeze()  # what the imports made: a collection (the memory meters') skips it
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store,
                            timeout=timedelta(seconds=120))
    try:
        result = target(rank, world, *args)
    except Exception:  # noqa: BLE001 - reported to the parent, which makes it a row
        result = {"error": traceback.format_exc()}
    results_queue.put((rank, result))
    dist.destroy_process_group()
    _exit_at_once(results_queue)


def _exit_at_once(results_queue) -> None:
    """End a rank without the interpreter's teardown, once its result is sent.

    gloo's worker threads release a finished collective's tensors after the caller's ``wait()``
    returns, and that release needs the GIL: one still pending when the teardown begins aborts
    the process ("terminate called without an active exception"; pytorch#179291). fpipe's exit
    hook (``fpipe/_runtime/ranks/teardown.py``) gives them a moment, which a loaded machine can
    outlast; a rank whose work is done has nothing to tear down, so it skips the teardown."""
    results_queue.close()
    results_queue.join_thread()  # the result is in the pipe
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_jobs(rank: int, world: int, jobs: list, timeout: float = 60.0,
             strict: bool = False) -> list[dict]:
    """Run each ``job(rank, world, group)`` in turn on every rank of a spawned group, each with
    a fresh gloo group; a job that raises gives ``{"error": "Type: message"}`` and aborts its
    group, which wakes the ranks waiting on this one, so the next job starts clean. With
    ``strict`` (the quick smoke runs) a job that raises ends this rank with its exception,
    which :func:`spawn_ranks` reports at once, stopping the other ranks."""
    import torch.distributed as dist

    results = []
    for job in jobs:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        try:
            results.append(job(rank, world, group))
        except Exception as exc:  # noqa: BLE001 - a failing configuration is a row, not a crash
            if strict:
                raise
            results.append({"error": error_text(exc)})
            dist.distributed_c10d._abort_process_group(group)
        dist.barrier()
    return results


def error_text(exc: BaseException, limit: int = 240) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def timed_steps(step: Callable[[], object], group, repeat: int, warmup: int = 2) -> float:
    """The median wall time of ``step`` run by every rank of ``group`` at once: each step
    starts and ends with a barrier, so it lasts until the slowest rank is done."""
    import torch.distributed as dist

    times = []
    for i in range(warmup + repeat):
        dist.barrier(group=group)
        start = time.perf_counter()
        step()
        dist.barrier(group=group)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]
