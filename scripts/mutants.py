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
    python scripts/mutants.py --jobs 1   # one at a time (default: two at once)

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
from concurrent.futures import ThreadPoolExecutor
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
    # -- frozen and unused parameters, torch.func transforms (issue 29) -------------------------
    Mutant("a frozen nn.Parameter differentiated", "_runtime/values.py",
           "return not getattr(leaf, \"requires_grad\", True) and isinstance(leaf, "
           "torch.nn.Parameter)", "return False", ("tests/test_frozen.py",)),
    Mutant("an unused parameter's gradient made zeros", "_runtime/vjp.py",
           "return list(grads[:n]), zeros_for_none(grads[n:], inputs)",
           "return zeros_for_none(grads[:n], params), zeros_for_none(grads[n:], inputs)",
           ("tests/test_frozen.py",)),
    Mutant("a model's frozen parameters passed as trainable ones", "stages/materialize.py",
           "requires_grad=flags.get(name, True) and (", "requires_grad=True and (",
           ("tests/test_frozen.py",)),
    Mutant("a call under a torch.func transform let through", "_runtime/engine.py",
           "    if interpreter is not None:\n        kind", "    if False:\n        kind",
           ("tests/test_frozen.py",)),
    # -- the module bridges train as plain PyTorch (issue 34) ----------------------------------
    Mutant("a reassigned buffer dropped", "stages/sequential.py",
           "y = self.swap(merged, (x,), slots)", "y = self.swap(dict(merged), (x,), slots)",
           ("tests/test_module_idioms.py",), quick=True),
    Mutant("GPipe's recompute on the committed buffers under except_last",
           "_gpipe/run.py",
           'return remat == "always" or (remat == "except_last" and microbatches > 1)',
           'return remat == "always"', ("tests/test_module_idioms.py",), quick=True),
    Mutant("a stage's graph searched along first inputs only", "_runtime/given.py",
           "stack.extend(next_node for next_node, _ in node.next_functions",
           "stack.extend(next_node for next_node, _ in node.next_functions[:1]",
           ("tests/test_module_idioms.py",), quick=True),
    Mutant("a model parameter's gradient hooks ignored", "_runtime/sources.py",
           "hooks = [*_hooks(stage_sources[i] if stage_sources else None), *_hooks(leaf)]",
           "hooks = _hooks(leaf)", ("tests/test_module_idioms.py",)),
    Mutant("a model parameter frozen after the cut still trained", "_runtime/sources.py",
           "if source is None or source.requires_grad:", "if source is None or source.is_leaf:",
           ("tests/test_module_idioms.py",)),
    Mutant("a cut's ties not asked of the pipeline", "stages/sequential.py",
           "tuple(t for t in ties if any(s == i for s, _ in t))",
           "tuple(t for t in ties if all(s == i for s, _ in t))",
           ("tests/test_module_idioms.py",)),
    # -- the ones the issue planted ------------------------------------------------------------
    Mutant("a micro-batch's gradient dropped", "_runtime/step.py",
           "total[i], owned[i] = total[i] + grad, True",
           "total[i], owned[i] = total[i], True",
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
           "        if dtype is not None:\n            grads = [None if grad is None else",
           "        if False:\n            grads = [None if grad is None else",
           ("tests/test_amp.py",)),
    Mutant("every micro-batch draws the same dropout mask", "_runtime/rng.py",
           "_mix(seed, stage, microbatch, i)", "_mix(seed, stage, 0, i)",
           ("tests/test_rng.py", "tests/test_pipeline.py")),
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
           ("tests/test_thread_state.py",)),
    Mutant("in-place writes let through by the watch's whole-list check", "_runtime/autodiff.py",
           "        if list(map(_VERSION, self.tensors)) == self.versions:\n",
           "        if True:\n", ("tests/test_purity.py",)),
    Mutant("in-place writes not watched", "_runtime/autodiff.py",
           "            if tensor._version != version:", "            if False:",
           ("tests/test_purity.py",), quick=True),
    Mutant("the last stage's batch size not checked", "_runtime/adapters.py",
           "if mb.size is not None:  # the last stage keeps the micro-batch too",
           "if False:",
           ("tests/test_errors.py",)),
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
           "accumulated = [p.grad for p in made]",
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
           ("tests/test_costs.py",)),
    Mutant("a fitted pair's forward waits for its own inputs only", "schedules/costs.py",
           "for unit in (action, pairs.get(action)) if unit is not None",
           "for unit in (action,)", ("tests/test_costs.py",)),
    Mutant("a per-stage transfer charged at the receiving stage", "schedules/simulate.py",
           "start = max(start, spans[need].end + costs.carry(need.stage))",
           "start = max(start, spans[need].end + costs.carry(action.stage))",
           ("tests/test_simulate.py",)),
    Mutant("the forward-only rule checking only B", "schedules/validate.py",
           "if not training and action.op is not F:", "if not training and action.op is B:",
           ("tests/test_validate.py",), quick=True),
    Mutant("the builder's in-flight cap let one past", "schedules/builder.py",
           "room = self.caps[w] - sum(h[0] for h in holds.values()) - 1",
           "room = self.caps[w] - sum(h[0] for h in holds.values())",
           ("tests/test_built_schedules.py",)),
    Mutant("chart panels sized for the median action", "schedules/render.py",
           "typical = min(statistics.median(lengths) for lengths in by_op.values())",
           "typical = statistics.median([x for lengths in by_op.values() for x in lengths])",
           ("tests/test_render.py",)),
    Mutant("from_csv counts micro-batches from the largest index", "schedules/csv_format.py",
           "return max((len(mbs) for mbs in seen.values()), default=1)",
           "return 1 + max((p[2] for p in every), default=0)",
           ("tests/test_csv.py",)),
    Mutant("zero_bubble_v ignores the costs it is given", "schedules/zero_bubble.py",
           "        if self.costs is not None:\n            program = fastest_v(",
           "        if False:\n            program = fastest_v(",
           ("tests/test_zbv_latency.py",)),
    Mutant("zero_bubble_v without costs runs the unit-step order", "schedules/zero_bubble.py",
           "program = handcrafted_v(self.chunks, n_stages // 2)",
           "program = v_shape_order(self.chunks, n_stages // 2, cap=n_stages)",
           ("tests/test_zbv_latency.py",)),
    Mutant("fastest_v breaks ties towards the unit-step order", "schedules/zero_bubble.py",
           "return [hand_written, unit_order,", "return [unit_order, hand_written,",
           ("tests/test_zbv_latency.py",)),
    Mutant("colocate drops the overlapped pairs", "schedules/colocate.py",
           "actions.append(action if pair is None else pair)",
           "actions.extend((action,) if pair is None else pair.actions)",
           ("tests/test_dualpipe.py",)),
    Mutant("colocate splits a pair without a word", "schedules/colocate.py",
           "    _check_pairs(program, workers)\n", "",
           ("tests/test_dualpipe.py",)),
    Mutant("a pair's await compiled after its forward", "_runtime/instructions.py",
           "(KINDS[\"await\"], paired.stage, paired.microbatch), *own)",
           "*own, (KINDS[\"await\"], paired.stage, paired.microbatch))",
           ("tests/test_dualpipe.py",)),
    Mutant("a recorded step opens no profiler span", "_runtime/instructions.py",
           "        if not profiler._is_profiler_enabled:\n            return span",
           "        if True:\n            return span",
           ("tests/test_thread_state.py",)),
    Mutant("the strategies' shipped branch draws only GPipe and 1F1B", "schedules/_orders.py",
           "for name, family in FAMILIES.items():  # the most workers that fit",
           "for name, family in list(FAMILIES.items())[:2]:  # the most workers that fit",
           ("tests/test_strategies.py",)),
    Mutant("the strategies never overlap a pair", "schedules/_orders.py",
           "    if choice is False:\n        return order, set()",
           "    if True:\n        return order, set()",
           ("tests/test_strategies.py",)),
    Mutant("the strategies' sizes lean small", "schedules/_orders.py",
           "    if draw(st.integers(0, 3)):\n", "    if False:\n",
           ("tests/test_strategies.py",)),
    Mutant("a W moved into a wait shorter than it", "schedules/v_shape.py",
           "gap >= slack * self.costs.of(W, weight.stage) - 1e-12",
           "gap >= -1.0",
           ("tests/test_zbv_latency.py",)),
    Mutant("choose_schedule tries zero_bubble_v without its costs", "schedules/search.py",
           "return dataclasses.replace(schedule, costs=costs)", "return schedule",
           ("tests/test_search.py",)),
    Mutant("recomputes counted as useful work", "schedules/simulate.py",
           "bubble=1.0 - breakdown.useful if total > 0 else 0.0,",
           "bubble=breakdown.idle if total > 0 else 0.0,",
           ("tests/test_costs.py",)),
    Mutant("a pair to be recomputed keeps all its activations", "schedules/memory.py",
           'kept = memory.of("inputs" if pair in recomputed else "activations", stage)',
           'kept = memory.of("activations", stage)',
           ("tests/test_memory.py",)),
    Mutant("V-Half's squeeze lets a worker past the block's memory",
           "schedules/controllable_v.py", "            if peak(plan) <= cap:\n",
           "            if True:\n", ("tests/test_vschedules.py",)),
    Mutant("V-Min's free slots take the first stage's weight gradients first",
           "schedules/controllable_v.py", "for kind in (UP_W, DOWN_W) if waiting[kind])",
           "for kind in (DOWN_W, UP_W) if waiting[kind])", ("tests/test_vschedules.py",)),
    Mutant("choose_schedule ignores the budget", "schedules/search.py",
           "fitting = [t for t in trials if t.fits]", "fitting = list(trials)",
           ("tests/test_search.py::test_memory_decides_when_time_does_not",), quick=True),
    Mutant("list_schedule ignores the in-flight cap", "schedules/builder.py",
           "        if action.op is not F:\n            return True\n        w, m =",
           "        if True:\n            return True\n        w, m =",
           ("tests/test_built_schedules.py",)),
    Mutant("DualPipeV's main step without its first-stage backward", "schedules/dualpipe.py",
           "            self.pair(second, first)\n        for _ in range(k - 1 - w):  # 5",
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
           "flags(checkpointing=dropped, owned=_made(step, stage, state))",
           "flags(checkpointing=False, owned=_made(step, stage, state))",
           ("tests/test_module.py",)),
    Mutant("fewer micro-batches than chunks checkpointed as the last", "_gpipe/run.py",
           'if checkpoint == "except_last" and microbatches < chunks:', "if False:",
           ("tests/test_module.py",)),
    Mutant("a torchgpipe-style skip across stages kept inside its stage", "stages/module_skip.py",
           "                if i != j:  # popped where it was not stashed: fpipe carries it",
           "                if False:", ("tests/test_module_skips.py",)),
    # -- memory (issue 23) ----------------------------------------------------------------------
    Mutant("except_last keeps the last micro-batch through every recompute", "schedules/remat.py",
           "return kept.get(stage) != mb", "return mb != program.n_microbatches - 1",
           ("tests/test_schedules.py", "tests/test_step_memory.py")),
    Mutant("fpipe.GPipe's backwards in micro-batch order, not torchgpipe's", "_gpipe/run.py",
           "backwards = forwards[::-1]",
           "backwards = sorted(pairs, key=lambda p: (p[1] + k - 1 - p[0], -p[0]))",
           ("tests/test_module.py::test_checkpointing_and_recomputing_flags",
            "tests/test_torchgpipe_compat.py::test_gradients_are_bitwise_torchgpipes")),
    Mutant("stages sharing a GPU left on workers of their own", "_runtime/driver.py",
           '        if device.type == "cuda":\n            a = find(',
           '        if False:\n            a = find(', ("tests/test_gpu_workers.py",)),
    Mutant("a module stage's structure not read again after it changed", "stages/swap.py",
           "        return (all(map(is_, placed, self._children))",
           "        return True or (all(map(is_, placed, self._children))",
           ("tests/test_swap.py",)),
    Mutant("a module stage's replaced tables not seen", "stages/swap.py",
           "                and all(map(is_, map(getattr, self._owners, repeat(\"_parameters\")),",
           "                and True or all(map(is_, map(getattr, self._owners, "
           "repeat(\"_parameters\")),",
           ("tests/test_swap.py",)),
    Mutant("the caller's running statistics updated in place", "_runtime/instructions.py",
           "    return state is not None and state is not step.given_state[stage]",
           "    return state is not None", ("tests/test_state.py",)),
    Mutant("every buffer of a module stage updated in place when owned", "stages/sequential.py",
           "uncopied = running.uncopied(state_owned(), serial)",
           "uncopied = state.keys() if state_owned() else running.uncopied(False, serial)",
           ("tests/test_state.py",)),
    Mutant("a frozen parameter counted trainable by the per-type look", "_runtime/values.py",
           "if not any(issubclass(kind, torch.nn.Parameter) for kind in set(map(type, leaves))):",
           "if True:", ("tests/test_frozen.py",)),
    Mutant("every parameter leaf detached, frozen ones too", "_runtime/values.py",
           "        if all(map(_REQUIRES_GRAD, leaves)):", "        if True:",
           ("tests/test_frozen.py",)),
    Mutant("an integer parameter let through by the per-dtype look", "_runtime/placement.py",
           "all(dtype.is_floating_point or dtype.is_complex\n", "all(True\n",
           ("tests/test_errors.py", "tests/test_pipeline.py", "tests/test_validate.py")),
    Mutant("a non-tensor parameter leaf taken for a tensor", "_runtime/placement.py",
           "    return all(issubclass(kind, torch.Tensor) for kind in set(map(type, leaves)))",
           "    return True", ("tests/test_errors.py", "tests/test_pipeline.py",
                              "tests/test_validate.py")),
    # -- running statistics uncopied, recomputes on scratch (issue 37) -------------------------
    Mutant("a recompute writing the step's running statistics", "stages/running.py",
           "                scratch[name] = entry[1]", "                uncopied.add(name)",
           ("tests/test_running_stats.py",)),
    Mutant("a recompute of a layer in evaluation reading scratch statistics",
           "stages/running.py",
           "            if not m.training:\n                uncopied.update(names)\n"
           "                continue\n", "", ("tests/test_running_stats.py",)),
    Mutant("a training layer's statistics uncopied on the caller's state", "stages/running.py",
           "if owned or not m.training for name", "if True for name",
           ("tests/test_running_stats.py",)),
    Mutant("a hooked normalisation layer's statistics uncopied", "stages/running.py",
           "and not (m._forward_hooks or m._forward_pre_hooks or \"forward\" in m.__dict__)",
           "and not (\"forward\" in m.__dict__)", ("tests/test_running_stats.py",)),
    Mutant("a global forward hook ignored for running statistics", "stages/running.py",
           "if _module._global_forward_hooks or _module._global_forward_pre_hooks:",
           "if False:", ("tests/test_running_stats.py",)),
    Mutant("scratch statistics of another dtype reused", "stages/running.py",
           "if entry is not None and _alike(entry[1], given)", "if entry is not None",
           ("tests/test_running_stats.py",)),
    Mutant("a replaced normalisation layer judged by the layer it replaced",
           "stages/sequential.py", "if self.swap.reads != self._read:", "if False:",
           ("tests/test_running_stats.py",)),
    Mutant("GPipe's copies chosen by the layers before a replacement", "_gpipe/run.py",
           "p.stage.running(serial).uncopied(True, serial)",
           "p.stage._running.uncopied(True, serial)",
           ("tests/test_running_stats.py",)),
    # (The per-call class check also covers a subclass with its own forward from the start;
    # the same check at build only keeps the per-call loop short: no mutant of its own.)
    Mutant("a normalisation subclass's statistics uncopied", "stages/running.py",
           "                if type(m).forward in _KNOWN  # (not since made a subclass in "
           "place)\n", "                if True\n", ("tests/test_running_stats.py",)),
    Mutant("GPipe's buffers a recompute reads handed over uncopied", "module.py",
           "b if name in unread else b.clone()", "b", ("tests/test_running_stats.py",)),
    Mutant("a face's pipeline reused for a model whose structure changed", "_gpipe/run.py",
           "key = (microbatches, remat, tuple(map(tuple, params)), tuple(map(tuple, state)))",
           "key = (microbatches, remat)", ("tests/test_module.py",)),
    Mutant("a partition's tensor set to None read as if it were there", "stages/swap.py",
           "if values is None or any(map(is_, values, repeat(None))):",
           "if values is None:",
           ("tests/test_module.py",)),
    Mutant("a module stage's tables counted but not compared", "stages/swap.py",
           "                and list(map(len, chain(self._params, self._buffers))) == "
           "self._sizes\n",
           "                and True\n", ("tests/test_swap.py",)),
    Mutant("a module stage's renamed tensor swapped by its old name", "stages/swap.py",
           "        except KeyError:\n            self._read_once = False",
           "        except IndexError:\n            self._read_once = False",
           ("tests/test_swap.py",)),
    Mutant("a module stage's structure trusted from an earlier run", "stages/swap.py",
           "if serial is not None and serial == self._checked_in and self._read_once:",
           "if self._checked_in is not None and self._read_once:",
           ("tests/test_swap.py", "tests/test_running_stats.py")),
    Mutant("a training step's leaf made again from the leaf it took", "_runtime/step.py",
           "[p if p.requires_grad else p.detach().requires_grad_()\n",
           "[p.detach().requires_grad_() if True else None\n", ("tests/test_engines.py",)),
    Mutant("a caller's plain tensor made a leaf in place", "_runtime/step.py",
           "[p if p.requires_grad else p.detach().requires_grad_()\n",
           "[p.requires_grad_() if True else None\n", ("tests/test_engines.py",)),
    Mutant("a run nested in another given a serial of its own", "recompute.py",
           '    if getattr(_flag, "run", None) is not None:\n        yield\n        return\n',
           "", ("tests/test_running_stats.py",)),
    Mutant("a layer's hooks looked at in an earlier run trusted", "stages/running.py",
           "if serial is not None and self._plain_in[0] == serial:",
           "if serial is not None and self._plain_in[0] is not None:",
           ("tests/test_running_stats.py",)),
    Mutant("a None parameter given a tensor later not seen", "stages/swap.py",
           "                and all(map(is_, map(getitem, *self._empty), repeat(None))))",
           "                and True)", ("tests/test_module.py",)),
    Mutant("a stateful module stage's name given twice let through", "stages/sequential.py",
           "if len(merged) < len(tensors) + len(params):", "if False:",
           ("tests/test_stages_sequential.py", "tests/test_state.py", "tests/test_swap.py")),
    Mutant("a module stage given a wrong name raising a bare KeyError", "stages/swap.py",
           "        except KeyError:\n            given = None\n",
           "        except KeyError:\n            raise\n", ("tests/test_swap.py",)),
    Mutant("a module stage's own tensors not put back after its call", "stages/swap.py",
           "            deque(map(setitem, tables, keys, originals), maxlen=0)", "            pass",
           ("tests/test_swap.py",)),
    # -- the distributed channel ---------------------------------------------------------------
    Mutant("a value whose shapes changed sent as if they had not", "_runtime/ranks/p2p.py",
           "        if known is not None and _same(known.meta, meta):\n",
           "        if known is not None:\n",
           ("tests/test_distributed.py::test_training_with_a_new_sequence_length_every_step",)),
    # -- scaling out (issue 16) ----------------------------------------------------------------
    Mutant("replicas' gradients averaged equally, not by their shares of the batch",
           "_runtime/ranks/data_parallel.py", "flat = self.pack(grads, indices).mul_(self.share)",
           "flat = self.pack(grads, indices).mul_(1 / len(self.dp.ranks))",
           ("tests/test_data_parallel.py::"
            "test_explicit_groups_uneven_shards_vjp_and_gradients_left_alone",)),
    Mutant("replicas' state averaged equally, not by their shares of the batch",
           "_runtime/ranks/data_parallel.py", "bucket.mul_(share)",
           "bucket.mul_(1 / len(self.ranks))",
           ("tests/test_data_parallel.py::"
            "test_replicas_state_is_the_share_weighted_mean_the_first_replicas_or_their_own",)),
    Mutant("a tie's copies on several ranks not summed", "_runtime/ranks/tie_groups.py",
           "self._bucket(group, members, [t for t, s in enumerate(spans) if s == span])",
           "None",
           ("tests/test_ties.py::test_distributed_ties",)),
    Mutant("accumulated calls' gradients not weighted by the replica's share",
           "_runtime/ranks/accumulate.py",
           "self.add(sums, held, replica.share if replica is not None and replica.weighted "
           "else 1.0)", "self.add(sums, held, 1.0)",
           ("tests/test_data_parallel.py::test_accumulated_calls_on_plain_replicas_give_one_"
            "whole_batch_call_s_gradients",)),
    Mutant("accumulated gradients not added to plain replicas' last reduction",
           "_runtime/ranks/data_parallel.py",
           "carried = None if self.carry is None else self.carry[stage]", "carried = None",
           ("tests/test_data_parallel.py::test_accumulated_calls_on_plain_replicas_give_one_"
            "whole_batch_call_s_gradients",)),
    Mutant("a tie's copies frozen on one rank and trained on another not compared",
           "_runtime/ranks/tie_groups.py", '"frozen" if frozen(leaf) else "trained"',
           '"trained"', ("tests/test_ties.py::test_distributed_bad_ties_raise_on_every_rank",)),
    Mutant("replicas that freeze other leaves not compared at build",
           "_runtime/ranks/agreement.py", 'str(leaf.dtype), *(("frozen",) * frozen(leaf)))',
           "str(leaf.dtype))",
           ("tests/test_agreement.py::test_ranks_that_differ_are_refused_alike_at_build"
            "[mesh-4-180-cases0]",)),
    Mutant("a tied tensor left with its last owner's value, not its first's",
           "stages/materialize.py", "getattr(owner, attr).copy_(values[group[0]])", "pass",
           ("tests/test_meta_init.py",)),
    Mutant("meta-built submodules seeded by their place in the cut, not their model name",
           "stages/naming.py",
           'where.get(id(sub), f"stage {i}.{path}" if path else f"stage {i}")',
           'f"stage {i}.{path}"', ("tests/test_meta_init.py",)),
    Mutant("a checkpoint keyed by stage-local names though names are given", "saving.py",
           "name = local if table is None else table[local]", "name = local",
           ("tests/test_saving.py",), quick=True),
    Mutant("the target's size not told to the other ranks", "_runtime/ranks/header.py",
           "words[5] = _size(target, \"target\", errors) + 1", "words[5] = 0",
           ("tests/test_faces.py",)),
    Mutant("stage 0's rank computing before a header it holds a mismatched target for",
           "_runtime/ranks/header.py",
           "and not target_status and target_size in (0, self.n + 1))",
           "and not target_status)", ("tests/test_faces.py",)),
    Mutant("stage 0's rank sending before its header is agreed", "_runtime/ranks/p2p.py",
           "        if not self.open and self._agreed() is not None:\n"
           "            raise Aborted  # the driver raises the refusal; nothing was sent",
           "        if False:\n            raise Aborted  # the driver raises the refusal; "
           "nothing was sent", ("tests/test_faces.py",)),
    Mutant("a refused header stopping every rank", "_runtime/ranks/faults.py",
           "if self.broken is None and not getattr(exc, \"fpipe_agreed\", False):",
           "if self.broken is None:", ("tests/test_faces.py",)),
    Mutant("a rank waiting at the header not recorded as arrived", "_runtime/ranks/header.py",
           "        if not self.work.is_completed():\n", "        if False:\n",
           ("tests/test_culprit.py",)),
    Mutant("the loss posted after the first loss, not the last", "_runtime/ranks/loss.py",
           "return ends[-1] if ends else None", "return ends[0] if ends else None",
           ("tests/test_distributed.py",)),
    Mutant("a kept message sent as it was though its shapes changed", "_runtime/ranks/p2p.py",
           "known.message is not None and _same(known.meta, meta):",
           "known.message is not None:",
           ("tests/test_distributed.py::test_training_with_a_new_sequence_length_every_step",)),
    # -- a newcomer's first mistakes, each told what to do (issue 27) -------------------------
    Mutant("an uncalled schedule constructor not told to be called", "schedules/actions.py",
           'if hasattr(program, "program") and not isinstance(program, Program):', "if False:",
           ("tests/test_messages.py",)),
    Mutant("params given as a dict read as a list of its keys", "pipeline.py",
           "        if isinstance(params, Mapping):\n", "        if False:\n",
           ("tests/test_messages.py",)),
    Mutant("no note on stages of different dtypes", "_runtime/notes.py",
           "if not given or not held or given & held:", "if True:",
           ("tests/test_messages.py",)),
    Mutant("a distributed script without torchrun left to torch's error",
           "_runtime/ranks/launch.py",
           "    if missing:\n        command", "    if False:\n        command",
           ("tests/test_messages.py",)),
    # -- issue 28: slips that survived the suite, and the torchgpipe face's behaviours -----------
    Mutant("skip-gradient counts including leaves that carry no gradient",
           "_runtime/instructions.py",
           "return tuple(len(value.grad_index) for value in inputs)",
           "return tuple(len(value.leaves) for value in inputs)",
           ("tests/test_skip.py::test_a_popped_skip_beside_an_input_with_an_integer_leaf",)),
    Mutant("DeferredBatchNorm.convert dropping num_batches_tracked", "stages/batchnorm.py",
           '("running_mean", "running_var", "num_batches_tracked")',
           '("running_mean", "running_var")',
           ("tests/test_batchnorm.py",)),
    Mutant("balance_by_size measuring n // chunks samples", "stages/balance.py",
           "leaf[:math.ceil(leaf.shape[0] / chunks)]", "leaf[:leaf.shape[0] // chunks]",
           ("tests/test_balance.py",)),
    Mutant("fpipe.GPipe cutting min(n, chunks) micro-batches", "_gpipe/run.py",
           "return math.ceil(n / math.ceil(n / chunks))", "return min(n, chunks)",
           ("tests/test_torchgpipe_compat.py::test_micro_batches_are_the_ones_torch_chunk_cuts",)),
    Mutant("fpipe.GPipe building a graph under no_grad in training mode", "module.py",
           "or not self._needs_grad(input, params):",
           "or not (self.training or self._needs_grad(input, params)):",
           ("tests/test_torchgpipe_compat.py::test_no_grad_builds_no_graph_in_training_mode",)),
    Mutant("balance_by_time profiling in the module's mode", "stages/balance.py",
           "copy.deepcopy(module).to(device).train()", "copy.deepcopy(module).to(device)",
           ("tests/test_torchgpipe_compat.py::test_balance_by_time_profiles_in_training_mode",)),
    Mutant("profiler spans named by the bare action (2F0 demangled to F0)",
           "_runtime/instructions.py", 'return f"fpipe::{action}"', "return str(action)",
           ("tests/test_thread_state.py",)),
    Mutant("no warning when the profiler records the caller's thread alone",
           "_runtime/driver.py", "            warn_if_profiler_misses_workers(len(plan))\n", "",
           ("tests/test_thread_state.py",)),
    Mutant("a partition's input handed to its layers as is (in-place writes refused)",
           "_gpipe/run.py", "self.stage(params, state, optree.tree_map(writable, x))",
           "self.stage(params, state, x)",
           ("tests/test_torchgpipe_compat.py::"
            "test_a_partition_writing_its_input_runs_where_torchgpipe_runs_it",)),
    Mutant("an inference partition's input aliased with its version counter",
           "_gpipe/run.py", "    return x.data\n", "    return x\n",
           ("tests/test_torchgpipe_compat.py::"
            "test_a_partition_writing_its_input_runs_where_torchgpipe_runs_it",)),
    Mutant("a module stage's swap losing a buffer the module reassigned", "stages/swap.py",
           "                        tensors[name] = tensor\n", "                        pass\n",
           ("tests/test_swap.py",)),
    Mutant("a reentrant checkpoint's node not looked for", "_runtime/reentrant.py",
           "        if type(node).__name__ == _NODE:", "        if False:",
           ("tests/test_interop.py",)),
    Mutant("clip_grad_norm drops group=", "optim.py",
           "norm = global_norm(grads, ties=ties, group=group)",
           "norm = global_norm(grads, ties=ties)",
           ("tests/test_clipping.py",)),
    Mutant("optimiser state loaded whole into an FSDP2 pipeline",
           "_runtime/ranks/saved_optimizer.py",
           "        return torch.empty_like(param, dtype=empty.dtype)", "        return empty",
           ("tests/test_fsdp.py::test_fsdp_pipeline_trains_accumulates_saves_and_resumes_as_the_"
            "plain_module",)),
    Mutant("a sharded gradient's squares not summed over its shards", "optim.py",
           "            square = _summed(square, over)", "            pass",
           ("tests/test_fsdp.py::test_clipping_under_fsdp_by_the_whole_model_s_norm_a_tie_"
            "counted_once",)),
    Mutant("replicas' parameters not compared at build", "_runtime/ranks/agreement.py",
           "fields = [*a.shared, *(a.held if held else ())]",
           "fields = [*a.shared, *(b.held if held else ())]",
           ("tests/test_agreement.py::test_ranks_that_differ_are_refused_alike_at_build[mesh-4-180-cases0]",)),
    Mutant("a checkpoint's checksums not verified", "_runtime/ranks/intact.py",
           "        if value != saved[key]:  # type: ignore[index]",
           "        if False:",
           ("tests/test_saving_damage.py",)),
    Mutant("a checkpoint's objects read by a plain unpickler", "_runtime/ranks/entries.py",
           "data = torch.load(value, weights_only=True, map_location=\"cpu\")",
           "data = torch.load(value, weights_only=False, map_location=\"cpu\")",
           ("tests/test_saving_data.py",)),
    Mutant("DCP's .metadata read by a plain unpickler", "_runtime/ranks/metadata.py",
           "        raise _Refused(f\"{module}.{name}\")",
           "        return super().find_class(module, name)",
           ("tests/test_saving_data.py",)),
    Mutant("a group mismatch on one rank refused on that rank alone",
           "_runtime/ranks/saved_optimizer.py",
           "    agree(lambda: saved_groups.check_groups(optimizer, order, hyper))",
           "    saved_groups.check_groups(optimizer, order, hyper)",
           ("tests/test_saving_distributed.py::test_a_group_mismatch_on_one_rank_is_one_error_on_every_rank",)),
    Mutant("a non-tensor entry's checksum blind to its value", "_runtime/ranks/entries.py",
           "        inner = repr(value)", "        inner = \"\"",
           ("tests/test_saving_data.py",)),
    Mutant("a checkpoint read into the caller's tensors", "saving.py",
           "    request: dict[str, Any] = {_MODEL: {name: torch.empty_like(leaf)",
           "    request: dict[str, Any] = {_MODEL: {name: leaf",
           ("tests/test_saving_damage.py",)),
    Mutant("a late rank's failure published as the waiting rank's", "_runtime/ranks/faults.py",
           "record = (\"peer\", self.rank if culprit is None else culprit,",
           "record = (\"peer\", self.rank,",
           ("tests/test_culprit.py",)),
    # -- issue 34: accumulation, stateless cuts, dual tensors, where a loss failed ---------------
    Mutant("bind_grads keeps a stale .grad under a None gradient", "optim.py",
           "        for leaf, grad in zip(leaves, grad_leaves):\n            leaf.grad = grad\n",
           "        for leaf, grad in zip(leaves, grad_leaves):\n            if grad is not None:\n"
           "                leaf.grad = grad\n",
           ("tests/test_optim.py",)),
    Mutant("bind_grads(accumulate=True) binds the first gradient itself", "optim.py",
           "leaf.grad = grad.detach().clone()", "leaf.grad = grad",
           ("tests/test_optim.py",)),
    Mutant("value_and_grad(accumulate=True) keeps nothing", "pipeline.py",
           "self._accumulated = grads if accumulate else None", "self._accumulated = None",
           ("tests/test_optim.py",)),
    Mutant("a dual tensor in the target let through", "pipeline.py",
           'check_untransformed("Pipeline value_and_grad", target=target)',
           'check_untransformed("Pipeline value_and_grad")',
           ("tests/test_dual.py",)),
    Mutant("a model without buffers cut into stateful stages", "stages/sequential.py",
           "stateful = any(next(m.buffers(), None) is not None for m in modules)",
           "stateful = True",
           ("tests/test_stages_sequential.py",)),
    Mutant("stateful module stages built without state= let through", "stages/sequential.py",
           "        if takes is None or takes == stateful:", "        if True:",
           ("tests/test_stages_sequential.py",)),
    Mutant("an exception in loss_fn located in the last stage's forward",
           "_runtime/instructions.py",
           'loss = getattr(exc, "fpipe_loss", None)', "loss = None",
           ("tests/test_messages.py",)),
    # -- session 39: pricing by stage count, measured waits, saving agreed, Statefuls given back
    Mutant("choose_schedule prices every stage count with the first one's costs",
           "schedules/search.py", "        return priced\n",
           "        return {(m, count): next(c for (n, _), c in priced.items() if n == m)"
           " for m, _ in priced for count in counts}\n",
           ("tests/test_search.py",)),
    Mutant("a gap within the free gaps' spread read as a wait", "schedules/costs.py",
           "if wait is not None and gap > max(overhead, jitter) + tolerance]",
           "if wait is not None and gap > overhead + tolerance]",
           ("tests/test_costs.py",)),
    Mutant("save's local refusals raised on one rank alone", "saving.py",
           '    state_dict, saved = agreed(prepare, process_group, "save")',
           "    state_dict, saved = prepare()",
           ("tests/test_saving_distributed.py::test_a_save_refused_on_one_rank_is_one_error_on_every_rank",)),
    Mutant("a refused Stateful leaves the entries loaded before it",
           "_runtime/ranks/training_state.py",
           "            _give_back(extra, kept)  # type: ignore[arg-type]\n            raise",
           "            raise",
           ("tests/test_training_state.py",)),

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
    parser.add_argument("--jobs", type=int, default=2,
                        help="mutants run at once, each in its own scratch copy (default 2: "
                             "their test runs mostly wait on processes and threads)")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if (m.quick or not args.quick)
              and (args.only is None or args.only in m.name)]
    if args.list:
        for m in chosen:
            print(f"{'quick' if m.quick else 'full '}  {m.name}  ({', '.join(m.tests)})")
        return 0
    bad = 0
    print(f"{'result':<8} {'s':>6}  mutant")
    with ThreadPoolExecutor(max(args.jobs, 1)) as pool:  # results printed in list order
        for mutant, (result, spent) in zip(chosen, pool.map(
                lambda m: run(m, args.timeout), chosen)):
            bad += result != "caught"
            print(f"{result:<8} {spent:6.1f}  {mutant.name}", flush=True)
    print(f"{len(chosen) - bad} caught, {bad} missed or stale, of {len(chosen)} mutants")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
