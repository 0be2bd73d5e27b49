"""README.md tells the truth: its example runs, and .ci/run calls the test command it gives."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_example_runs():
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Example\n\n```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in readme
    assert "python3 -m pytest -q" in ci
