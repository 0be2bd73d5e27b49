"""The run-time core needs only torch and optree; the package ships its type hints, its
licence and one version."""

import json
import re
import sys
from pathlib import Path

import patience
import pytest

ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTION = "torch-fpipe"  # what pip installs; the import name stays fpipe


def test_import_needs_only_torch_and_optree():
    # Optional packages made unimportable: fpipe and all its modules still import.
    code = ("import sys\n"
            "for name in ('transformers', 'safetensors', 'matplotlib', 'hypothesis', 'pytest'):\n"
            "    sys.modules[name] = None\n"
            "import fpipe, fpipe.amp, fpipe.optim, fpipe.saving, fpipe.stages, "
            "fpipe.distributed\n")
    patience.run([sys.executable, "-c", code], 120, check=True, cwd=ROOT)


def test_typed_package_and_extras():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    assert (ROOT / "fpipe" / "py.typed").exists()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["dependencies"] == ["torch>=2.3", "optree>=0.11"]
    assert {"test", "plot", "hf"} <= project["project"]["optional-dependencies"].keys()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["fpipe"]


def test_one_version_the_package_and_its_metadata_agree():
    """The version is written once, as ``fpipe.__version__``; pyproject.toml reads it from there
    (a dynamic version), so the built metadata cannot drift from the package."""
    tomllib = pytest.importorskip("tomllib")
    from importlib import metadata

    from setuptools.config.pyprojecttoml import read_configuration

    import fpipe

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "fpipe.__version__"}
    built = read_configuration(ROOT / "pyproject.toml", expand=True)["project"]["version"]
    assert built == fpipe.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+(\w+\d*)?", fpipe.__version__)
    # Where this checkout is the installed one (CI's `pip install -e .`), its metadata agrees.
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return
    if Path(fpipe.__file__).resolve().parent == ROOT / "fpipe" and _installed_from(dist) == ROOT:
        assert dist.version == fpipe.__version__


def _installed_from(dist):
    """The project directory of an editable install (PEP 610's direct_url.json), else None."""
    text = dist.read_text("direct_url.json")
    url = json.loads(text).get("url", "") if text else ""
    return Path(url.removeprefix("file://")).resolve() if url.startswith("file://") else None


def test_license_file_matches_the_metadata():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "BSD-3-Clause"}
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License\n\nCopyright (c) ")
    for clause in ("Redistributions of source code must retain",
                   "Redistributions in binary form must reproduce",
                   "Neither the name of the copyright holder nor the names of its"):
        assert clause in text


def test_the_distribution_name_is_ours_and_no_text_says_pip_install_fpipe():
    """PyPI's ``fpipe`` is another project (``pip install 'fpipe[hf]'`` installs it and warns
    that it has no ``hf`` extra), so fpipe is distributed as ``torch-fpipe`` and imported as
    ``fpipe``; no page, example, docstring or message may tell anyone to install ``fpipe``."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION
    wrong = re.compile(r"""install\s+(-\S+\s+)*['"]?fpipe\b""")
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").rglob("*.py"),
             *(ROOT / "fpipe").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in files
             for n, line in enumerate(path.read_text().splitlines(), 1) if wrong.search(line)]
    assert not found, found
