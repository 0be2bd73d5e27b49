"""Every Python block of the schedule guides runs: docs/choosing-a-schedule.md as it is, in
order, in one namespace; docs/writing-a-schedule.md the same, after a prelude that defines
the model its snippets assume (``stages``, ``params``, ``loss_fn``, ``x``, ``target``)."""

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"

PRELUDE = """
import torch
import fpipe
from fpipe.schedules import *
from fpipe.schedules import validate

def stage(p, x):
    return torch.tanh(x @ p["w"])

stages = [stage] * 3
params = [{"w": torch.randn(8, 8, dtype=torch.float64) / 3} for _ in range(3)]
loss_fn = torch.nn.functional.mse_loss
x, target = torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64)
pipe = fpipe.pipeline(stages, params, schedule=one_f_one_b(4), loss_fn=loss_fn)
program = one_f_one_b(4).program(3)
costs_in_seconds = Costs(forward=1e-3)
"""


def blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)


@pytest.mark.parametrize("page, prelude", [("choosing-a-schedule.md", ""),
                                           ("writing-a-schedule.md", PRELUDE)])
def test_python_blocks_run(page, prelude, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    namespace: dict = {}
    exec(compile(prelude, "prelude", "exec"), namespace)
    found = blocks(page)
    assert found
    try:
        for number, code in enumerate(found):
            exec(compile(code, f"{page} block {number + 1}", "exec"), namespace)
        for name, value in list(namespace.items()):  # the hypothesis tests a page defines
            if name.startswith("test_") and callable(value):
                value()
    finally:
        for pipe in {id(v): v for v in namespace.values() if hasattr(v, "close")
                     and type(v).__name__ == "Pipeline"}.values():
            pipe.close()


def test_choosing_guide_claims():
    """The figures the guide's prose quotes from its blocks."""
    text = (DOCS / "choosing-a-schedule.md").read_text()
    assert "# memory-budget 0 0F5" in text
    from fpipe.schedules import Memory, ScheduleError, check_memory, gpipe

    memory = Memory(activations=100e6, inputs=10e6, parameters=500e6, optimizer=1e9)
    with pytest.raises(ScheduleError) as caught:
        check_memory(gpipe(8, remat="never").program(4), memory, budget=2.5e9)
    assert (caught.value.rule, caught.value.worker, str(caught.value.action)) == (
        "memory-budget", 0, "0F5")


def test_docs_stay_inside_the_repository():
    for page in DOCS.glob("*.md"):
        assert "/work/" not in page.read_text(), page.name
