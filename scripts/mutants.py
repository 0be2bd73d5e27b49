"""Planted bugs: does the test suite catch realistic mistakes?

Each mutant is one small edit to the package (a text replaced in one file), the kind of slip a
change to fpipe could make, and the test files that should catch it. For each, the package is
copied to a scratch directory, the edit applied, and those tests run against the copy; the
mutant is *caught* when they fail (or time out), *missed* when they pass. A mutant whose text
is no longer in its file is reported *stale*: the list must follow the code.

    python scripts/mutants.py            # every mutant (before a release)
    python scripts/mutants.py --quick    # the quick subset (CI)
    python scripts/mutants.py --list     # names only
    python scripts/mutants.py --only "state averaged"   # those whose name holds this text

Exit status 0 only if every mutant run is caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # under fpipe/
    old: str
    new: str
    tests: tuple[str, ...]  # test files (or node ids) that should catch it
    quick: bool = False  # in the CI subset


MUTANTS = (
    # -- the ones the issue planted ------------------------------------------------------------
    Mutant("a micro-batch's gradient dropped", "_runtime/step.py",
           "self.totals[stage] = [acc + grad for acc, grad in zip(total, grads)]",
           "self.totals[stage] = list(total)",
           ("tests/test_pipeline.py",), quick=True),
    Mutant("equal instead of proportional micro-batch weights", "pipeline.py",
           "[size / n for size in sizes]", "[1 / len(sizes) for size in sizes]",
           ("tests/test_pipeline.py",), quick=True),
    Mutant("the deadlock check skipped", "schedules/validate.py",
           "    if len(order) < len(present):\n        _raise_deadlock(",
           "    if False:\n        _raise_deadlock(",
           ("tests/test_validate.py",), quick=True),
    Mutant("a recompute seeded with the wrong micro-batch", "_runtime/instructions.py",
           "random.scope(step.seed, stage, microbatch, True, step.seeded,",
           "random.scope(step.seed, stage, microbatch + 1, True, step.seeded,",
           ("tests/test_pipeline.py", "tests/test_rng.py")),
    Mutant("two 1F1B actions swapped", "schedules/one_f_one_b.py",
           "actions += [Action(stage, F, warmup + m), Action(stage, B, m)]",
           "actions += [Action(stage, B, m), Action(stage, F, warmup + m)]",
           ("tests/test_schedules.py",), quick=True),
    Mutant("BatchNorm statistics per micro-batch", "stages/batchnorm.py",
           "if int(self.tracked) >= self.chunks:", "if int(self.tracked) >= 1:",
           ("tests/test_batchnorm.py",)),
    Mutant("the grad_dtype cast after the sum", "_runtime/step.py",
           "        if dtype is not None:\n            grads = [grad.to(dtype) for grad in grads]",
           "        if False:\n            grads = [grad.to(dtype) for grad in grads]",
           ("tests/test_amp.py",)),
    Mutant("every micro-batch draws the same dropout mask", "_runtime/rng.py",
           "_mix(seed, stage, microbatch, i)", "_mix(seed, stage, 0, i)",
           ("tests/test_rng.py", "tests/test_pipeline.py"), quick=True),
    Mutant("a recompute given the state after its forward", "_runtime/instructions.py",
           "step.saved[stage, microbatch] = (inputs, state, drawing.drew)",
           "step.saved[stage, microbatch] = (inputs, step.state[stage], drawing.drew)",
           ("tests/test_state.py",), quick=True),
    # -- the correctness issue's own defects, back again ---------------------------------------
    Mutant("an unseeded draw trusted (random numbers learnt once)", "_runtime/rng.py",
           "                elif drew:\n                    unseeded = True",
           "                elif drew:\n                    pass",
           ("tests/test_rng.py",), quick=True),
    Mutant("a 0-dim input's gradient not summed over micro-batches", "_runtime/engine.py",
           "joined.append(torch.stack(column).sum(0))", "joined.append(column[0])",
           ("tests/test_vjp.py",), quick=True),
    Mutant("a 0-dim output's cotangent given to every micro-batch", "_runtime/engine.py",
           "if given is None or (microbatch > 0 and leaf.dim() == 0):",
           "if given is None:",
           ("tests/test_vjp.py",)),
    Mutant("the caller's autocast not carried into workers", "_runtime/interpreter.py",
           "_NOTHING if step.context is None else step.context.applied(step.training)",
           "_NOTHING",
           ("tests/test_thread_state.py",), quick=True),
    Mutant("in-place writes not watched", "_runtime/autodiff.py",
           "            if tensor._version != version:", "            if False:",
           ("tests/test_purity.py",), quick=True),
    Mutant("the last stage's batch size not checked", "_runtime/adapters.py",
           "if mb.size is not None:  # the last stage keeps the micro-batch too",
           "if False:",
           ("tests/test_errors.py",), quick=True),
    Mutant("the backward half waits on the caller's thread", "_runtime/driver.py",
           "inline=program.placement[-1])", "inline=0)",
           ("tests/test_concurrency.py",)),
    Mutant("a stage's own exception wrapped again", "_runtime/instructions.py",
           "    if isinstance(exc, StageError):\n        if exc.stage is None:",
           "    if not isinstance(exc, UnseededDraws):\n        exc = StageError(str(exc))\n"
           "        if exc.stage is None:",
           ("tests/test_faults.py", "tests/test_errors.py")),
    Mutant("the loss's seed cotangent outside the compute scope", "_runtime/instructions.py",
           "    vjp_fn, counts = step.vjps.pop((stage, microbatch))\n",
           "    vjp_fn, counts = step.vjps.pop((stage, microbatch))\n"
           "    if stage == job.last:\n"
           "        cotangent = step.ends.seed(microbatch, step.outputs[microbatch])\n",
           ("tests/test_stream_discipline.py",), quick=True),
    # -- more of the kind a refactor makes -----------------------------------------------------
    Mutant("skip cotangents sent back to the wrong stage", "_runtime/instructions.py",
           "job.channel.send(list(input_grads[end:end + count]), device, routes[name][0],",
           "job.channel.send(list(input_grads[end:end + count]), device, stage - 1,",
           ("tests/test_skip.py",)),
    Mutant("uneven micro-batches split evenly", "_runtime/microbatch.py",
           "return [base + 1 if i < extra else base for i in range(chunks)]",
           "return [base for i in range(chunks)]",
           ("tests/test_microbatch.py", "tests/test_pipeline.py")),
    Mutant("gradients accumulated inside autograd not read back", "_runtime/step.py",
           "accumulated = [torch.zeros_like(p) if p.grad is None else p.grad for p in made]",
           "accumulated = [torch.zeros_like(p) for p in made]",
           ("tests/test_engines.py",)),
    Mutant("a recompute's new state kept", "_runtime/instructions.py",
           "    inputs, state, drew = step.saved.pop((stage, microbatch))\n",
           "    inputs, state, drew = step.saved.pop((stage, microbatch))\n"
           "    step.state[stage] = state\n",
           ("tests/test_state.py",)),
    # -- the simulator, memory, choice and builder ------------------------------------------------
    Mutant("split-backward halves defaulted beside a given backward", "schedules/costs.py",
           "half = _map(lambda b: b / 2.0, self.backward)", "half = 1.0",
           ("tests/test_costs.py",), quick=True),
    Mutant("recomputes counted as useful work", "schedules/simulate.py",
           "bubble=1.0 - breakdown.useful if total > 0 else 0.0,",
           "bubble=breakdown.idle if total > 0 else 0.0,",
           ("tests/test_costs.py",), quick=True),
    Mutant("a pair to be recomputed keeps all its activations", "schedules/memory.py",
           'kept = memory.of("inputs" if pair in recomputed else "activations", stage)',
           'kept = memory.of("activations", stage)',
           ("tests/test_memory.py",), quick=True),
    Mutant("choose_schedule ignores the budget", "schedules/search.py",
           "fitting = [t for t in trials if t.fits]", "fitting = list(trials)",
           ("tests/test_search.py",), quick=True),
    Mutant("list_schedule ignores the in-flight cap", "schedules/builder.py",
           "choice = state.choose(w, free[w], rule, live[w] < caps[w], costs)",
           "choice = state.choose(w, free[w], rule, True, costs)",
           ("tests/test_built_schedules.py",), quick=True),
    Mutant("DualPipeV's main step without its first-stage backward", "schedules/dualpipe.py",
           "            self.add(second, F)\n            self.add(first, B)\n        for _ in "
           "range(k - 1 - w):  # 5",
           "            self.add(second, F)\n        for _ in range(k - 1 - w):  # 5",
           ("tests/test_built_schedules.py",)),
    # -- the torchgpipe face ----------------------------------------------------------------
    Mutant("a failed step's other workers run on", "_runtime/interpreter.py",
           "if step.error is not None:  # another worker failed: start nothing more",
           "if False:", ("tests/test_module.py",)),
    Mutant("forwards of one device's partitions stage by stage", "_gpipe/run.py",
           "key=lambda p: (p[0] + p[1], p[0]))", "key=lambda p: (p[0], p[1]))",
           ("tests/test_module.py",)),
    Mutant("dropped forwards not marked checkpointing", "_runtime/instructions.py",
           "checkpointing() if dropped else _NOTHING", "_NOTHING", ("tests/test_module.py",)),
    Mutant("fewer micro-batches than chunks checkpointed as the last", "_gpipe/run.py",
           'if checkpoint == "except_last" and microbatches < chunks:', "if False:",
           ("tests/test_module.py",)),
    Mutant("a torchgpipe-style skip across stages kept inside its stage", "stages/module_skip.py",
           "                if i != j:  # popped where it was not stashed: fpipe carries it",
           "                if False:", ("tests/test_module_skips.py",)),
    # -- the distributed channel ---------------------------------------------------------------
    Mutant("a value whose shapes changed sent as if they had not", "_runtime/p2p.py",
           "blob = b\"\" if known is not None and _same(known.meta, meta) else",
           "blob = b\"\" if known is not None else",
           ("tests/test_distributed.py::test_training_with_a_new_sequence_length_every_step",)),
    # -- scaling out (issue 16) ----------------------------------------------------------------
    Mutant("replicas' gradients averaged equally, not by their shares of the batch",
           "_runtime/data_parallel.py", "flat.mul_(self.share)",
           "flat.mul_(1 / len(self.dp.ranks))",
           ("tests/test_data_parallel.py::"
            "test_explicit_groups_uneven_shards_vjp_and_gradients_left_alone",), quick=True),
    Mutant("replicas' state averaged equally, not by their shares of the batch",
           "_runtime/data_parallel.py", "bucket.mul_(share)",
           "bucket.mul_(1 / len(self.ranks))",
           ("tests/test_data_parallel.py::"
            "test_replicas_state_is_the_share_weighted_mean_the_first_replicas_or_their_own",)),
    Mutant("a tie's copies on several ranks not summed", "_runtime/tie_groups.py",
           "self._bucket(group, members, [t for t, s in enumerate(spans) if s == span])",
           "None",
           ("tests/test_ties.py::test_distributed_ties",)),
    Mutant("a tie's value not drawn before the stages'", "stages/materialize.py",
           "        _initialise(owner, init, done)\n        values.append(",
           "        values.append(",
           ("tests/test_meta_init.py",)),
    Mutant("a checkpoint keyed by stage-local names though names are given", "saving.py",
           "name = local if table is None else table[local]", "name = local",
           ("tests/test_saving.py",), quick=True),
    Mutant("the target's size not told to the other ranks", "_runtime/rank_driver.py",
           "header[5] = _size(target, \"target\", errors) + 1", "header[5] = 0",
           ("tests/test_faces.py",)),
    Mutant("clip_grad_norm drops group=", "optim.py",
           "norm = global_norm(grads, ties=ties, group=group)",
           "norm = global_norm(grads, ties=ties)",
           ("tests/test_clipping.py",)),
    Mutant("replicas' parameters not compared at build", "_runtime/agreement.py",
           "fields = [*a.shared, *(a.held if held else ())]",
           "fields = [*a.shared, *(b.held if held else ())]",
           ("tests/test_agreement.py::test_a_mesh_whose_ranks_differ_is_refused_alike_at_build",)),
    Mutant("a checkpoint's checksums not verified", "_runtime/intact.py",
           "        if checksum(tensor) != saved[key]:",
           "        if False:",
           ("tests/test_saving_damage.py",)),
    Mutant("a checkpoint read into the caller's tensors", "saving.py",
           "    request: dict[str, Any] = {_MODEL: {name: torch.empty_like(leaf)",
           "    request: dict[str, Any] = {_MODEL: {name: leaf",
           ("tests/test_saving_damage.py",)),
    Mutant("a late rank's failure published as the waiting rank's", "_runtime/faults.py",
           "record = (\"peer\", self.rank if culprit is None else culprit,",
           "record = (\"peer\", self.rank,",
           ("tests/test_culprit.py",)),
)


def run(mutant: Mutant, timeout: float) -> tuple[str, float]:
    """``caught``, ``missed`` or ``stale``, and the seconds its tests took."""
    source = (ROOT / "fpipe" / mutant.file).read_text()
    if source.count(mutant.old) != 1:
        return "stale", 0.0
    with tempfile.TemporaryDirectory() as scratch:
        shutil.copytree(ROOT / "fpipe", Path(scratch) / "fpipe")
        (Path(scratch) / "fpipe" / mutant.file).write_text(source.replace(mutant.old, mutant.new))
        env = {**os.environ, "PYTHONPATH": scratch, "HYPOTHESIS_PROFILE": "ci"}
        # Run from the scratch directory: ``python -m`` puts the working directory first on
        # sys.path, which must hold the mutated package, not the real one.
        command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                   f"--rootdir={ROOT}", *(str(ROOT / test) for test in mutant.tests)]
        start = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=scratch, env=env, capture_output=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return "caught", time.perf_counter() - start  # a hang is a failure too
        spent = time.perf_counter() - start
    return ("missed" if done.returncode == 0 else "caught"), spent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the quick subset only (CI)")
    parser.add_argument("--list", action="store_true", help="print the mutants and stop")
    parser.add_argument("--only", metavar="TEXT",
                        help="only the mutants whose name contains TEXT")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds per mutant (a hang counts as caught)")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if (m.quick or not args.quick)
              and (args.only is None or args.only in m.name)]
    if args.list:
        for m in chosen:
            print(f"{'quick' if m.quick else 'full '}  {m.name}  ({', '.join(m.tests)})")
        return 0
    bad = 0
    print(f"{'result':<8} {'s':>6}  mutant")
    for mutant in chosen:
        result, spent = run(mutant, args.timeout)
        bad += result != "caught"
        print(f"{result:<8} {spent:6.1f}  {mutant.name}", flush=True)
    print(f"{len(chosen) - bad} caught, {bad} missed or stale, of {len(chosen)} mutants")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
