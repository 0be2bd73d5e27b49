"""The run-time core needs only torch and optree; the package ships its type hints."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_import_needs_only_torch_and_optree():
    # Optional packages made unimportable: fpipe and all its modules still import.
    code = ("import sys\n"
            "for name in ('transformers', 'safetensors', 'matplotlib', 'hypothesis', 'pytest'):\n"
            "    sys.modules[name] = None\n"
            "import fpipe, fpipe.amp, fpipe.optim, fpipe.saving, fpipe.stages, "
            "fpipe.distributed\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_typed_package_and_extras():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    assert (ROOT / "fpipe" / "py.typed").exists()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["dependencies"] == ["torch>=2.3", "optree>=0.11"]
    assert {"test", "plot", "hf"} <= project["project"]["optional-dependencies"].keys()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["fpipe"]
