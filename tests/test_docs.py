"""Every code block of the documentation runs: README.md and each page of docs/.

A page's ``python`` blocks run in order in one namespace (a block continues the ones before
it, as a reader would type them), in a scratch directory; a ``test_*`` function a block
defines is called. A ``bash`` block's lines run one by one in that directory, with this
interpreter's ``python`` and ``torchrun`` first on the PATH and ``examples/`` at hand; lines
that start the ranks of several hosts (``--node-rank=``) run together, on this machine, with
the first host's address replaced by 127.0.0.1. Two markers, each the first line of a block
and shown to the reader as they are:

- ``# train.py`` (any ``name.py``): the block is a script; it is saved under that name for the
  page's commands to run (``torchrun --standalone --nproc-per-node=2 train.py``), not run in
  the namespace.
- ``# not run by the tests: <why>``: the block is skipped, for a reason a reader can see (a
  GPU, an install in a fresh environment). :func:`test_skipped_blocks_are_few_and_say_why`
  holds the list, so a new skip is a decision, not an accident.

docs/benchmarks.md is the benchmarks' own page: its commands run the benchmarks for minutes,
and tests/test_benchmarks.py runs each of those scripts in its quick mode, which is checked
here instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import patience
import pytest
import torch

import fpipe

ROOT = Path(__file__).resolve().parent.parent
CODE = {"python", "py", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.S | re.M)
SKIP = re.compile(r"# not run by the tests: (\S.*)")
SCRIPT = re.compile(r"# ([\w-]+\.py)$")
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
# page: the extra's package its blocks import (numpy: DCP on several ranks, the [saving] extra)
NEEDS = {"docs/quickstart-hf.md": "transformers", "docs/saving.md": "numpy",
         "docs/scaling-out.md": "numpy"}
# The blocks that do not run, per page, each with its reason in its first line.
SKIPPED = {"README.md": 1, "docs/distributed.md": 1, "docs/gpu-checklist.md": 2,
           "docs/index.md": 1, "docs/quickstart-hf.md": 1, "docs/install.md": 2,
           "docs/distributed-api.md": 1,  # tests/test_examples.py runs its command
           "docs/from-modules.md": 1,  # torchvision's ResNet
           # excerpts of examples/scale_out.py (tests/test_examples.py runs its commands) and
           # of examples/train_fsdp.py (the page's own torchrun block runs it)
           "docs/scaling-out.md": 6}


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    code: str

    @property
    def first(self) -> str:
        return self.code.split("\n", 1)[0].strip()

    @property
    def skip(self) -> str | None:
        match = SKIP.fullmatch(self.first)
        return match.group(1) if match else None

    @property
    def script(self) -> str | None:
        match = SCRIPT.match(self.first) if self.lang in ("python", "py") else None
        return match.group(1) if match else None


def blocks(page: str, text: str | None = None) -> list[Block]:
    """The code blocks of a page (``python``, ``bash``...; not ``text`` or unlabelled ones)."""
    text = (ROOT / page).read_text() if text is None else text
    return [Block(page, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2))
            for m in FENCE.finditer(text) if m.group(1) in CODE]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shell_env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def commands(code: str) -> list[str]:
    joined = code.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def run_commands(block: Block, cwd: Path) -> None:
    lines = commands(block.code)
    where = f"{block.page}:{block.line}"
    if block.page == "docs/benchmarks.md":  # run in quick mode by tests/test_benchmarks.py
        quick = (ROOT / "tests" / "test_benchmarks.py").read_text()
        for line in lines:
            script = re.fullmatch(r"python benchmarks/(\w+\.py)( .*)?", line)
            assert script and f'"{script.group(1)}"' in quick, f"{where}: {line}"
        return
    env = shell_env()
    hosts = [line for line in lines if "--node-rank=" in line]
    if hosts:  # one command per host: here all on this machine, at once
        assert hosts == lines, f"{where}: a block of several hosts holds only their commands"
        address = re.search(r"--master-addr=(\S+)", hosts[0]).group(1)
        port = str(free_port())
        procs = [subprocess.Popen(re.sub(r"--master-port=\d+", f"--master-port={port}",
                                         line.replace(address, "127.0.0.1")),
                                  shell=True, cwd=cwd, env=env, executable="/bin/bash",
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for line in hosts]
        try:
            for line, proc in zip(hosts, procs):
                out, _ = proc.communicate(timeout=patience.limit(300))
                assert proc.returncode == 0, f"{where}: {line}\n{out[-3000:]}"
        finally:
            for proc in procs:  # a host left waiting for one that failed
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        return
    for line in lines:
        run = patience.run(line, 300, shell=True, cwd=cwd, env=env, executable="/bin/bash",
                           capture_output=True, text=True)
        assert run.returncode == 0, f"{where}: {line}\n{run.stdout[-2000:]}{run.stderr[-3000:]}"


def run_page(page: str, cwd: Path) -> None:
    (cwd / "examples").symlink_to(ROOT / "examples")
    namespace: dict = {"__name__": "__docs__"}
    torch.manual_seed(0)
    try:
        for block in blocks(page):
            if block.skip:
                continue
            if block.script:
                (cwd / block.script).write_text(block.code)
            elif block.lang in ("python", "py"):
                before = set(namespace)
                exec(compile(block.code, f"{page}:{block.line}", "exec"), namespace)
                for name in sorted(set(namespace) - before):
                    if name.startswith("test_") and callable(namespace[name]):
                        namespace[name]()
            else:
                run_commands(block, cwd)
    finally:
        for value in list(namespace.values()):  # stop the pipelines' worker threads
            if isinstance(value, fpipe.Pipeline):
                value.close()


@pytest.mark.parametrize("page", [
    pytest.param(page, marks=pytest.mark.needs_extra) if page in NEEDS else page
    for page in PAGES])
def test_every_code_block_runs(page, tmp_path, monkeypatch):
    if page in NEEDS and importlib.util.find_spec(NEEDS[page]) is None:
        pytest.skip(f"{page} needs {NEEDS[page]} (an extra)")
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    try:
        run_page(page, tmp_path)
    finally:
        torch.set_num_threads(threads)


def test_skipped_blocks_are_few_and_say_why():
    skipped: dict[str, int] = {}
    for page in PAGES:
        for block in blocks(page):
            if block.skip:
                assert len(block.skip.split()) >= 3, f"{page}:{block.line}: say why"
                skipped[page] = skipped.get(page, 0) + 1
    assert skipped == SKIPPED


def test_the_markers_are_read_as_documented():
    skip = Block("p.md", 1, "python", "# not run by the tests: needs a CUDA GPU\nx = 1\n")
    script = Block("p.md", 1, "python", "# train.py\nimport torch\n")
    plain = Block("p.md", 1, "python", "# a comment\nx = 1\n")
    assert (skip.skip, skip.script) == ("needs a CUDA GPU", None)
    assert (script.skip, script.script) == (None, "train.py")
    assert (plain.skip, plain.script) == (None, None)
    text = "a\n```python\nx = 1\n```\n```text\nnot code\n```\n```bash\necho \\\n  hi\n```\n"
    found = blocks("p.md", text)
    assert [(b.lang, b.line) for b in found] == [("python", 2), ("bash", 8)]
    assert commands(found[1].code) == ["echo    hi"]


def test_every_page_is_in_the_site_and_the_readme_links_the_site():
    """mkdocs.yml's nav lists every page of docs/, and README.md links each guide."""
    nav = (ROOT / "mkdocs.yml").read_text()
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        name = page.removeprefix("docs/")
        assert f": {name}" in nav, f"{page} is not in mkdocs.yml's nav"
        if not name.startswith("reference/"):
            assert f"]({page})" in readme, f"README.md does not link {page}"


@pytest.mark.parametrize("module", ["fpipe", "fpipe.schedules", "fpipe.stages", "fpipe.optim",
                                    "fpipe.amp", "fpipe.saving", "fpipe.errors"])
def test_the_api_reference_covers_every_public_name(module):
    """Each name of a public module's ``__all__`` has its entry in docs/reference/: a ``:::``
    line for the object itself, or for the module that documents it whole (a package whose
    names a submodule shadows, like ``fpipe.schedules.gpipe``, lists them one by one)."""
    import importlib
    import types

    directives = {line.split()[1] for page in (ROOT / "docs" / "reference").glob("*.md")
                  for line in page.read_text().splitlines() if line.startswith("::: ")}
    package = importlib.import_module(module)
    public = getattr(package, "__all__", None) or [  # without __all__: what it defines
        name for name, obj in vars(package).items()
        if not name.startswith("_") and getattr(obj, "__module__", None) == module]
    shadowed = any(f"{module}.{name}" in sys.modules for name in public)
    missing = []
    for name in public:
        obj = getattr(package, name)
        if isinstance(obj, types.ModuleType):
            ok = obj.__name__ in directives
        else:
            home = getattr(obj, "__module__", None)  # None: a constant, e.g. a dict
            ok = (any(d.endswith(f".{name}") for d in directives) if home is None else
                  f"{home}.{name}" in directives or home in directives
                  or (module in directives and not shadowed))
        if not ok:
            missing.append(name)
    assert not missing, f"{module}: no entry in docs/reference/ for {missing}"


@pytest.mark.needs_extra  # griffe comes with the [docs] extra (mkdocstrings)
def test_the_reference_links_the_objects_docstrings_cite(monkeypatch):
    """A Sphinx role in a docstring becomes an optional cross-reference to where the object is
    defined (scripts/mkdocs_sphinx_roles.py): a re-export is followed, a function is not
    mistaken for the module of its name, and what cannot be found stays inline code."""
    griffe = pytest.importorskip("griffe")
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from mkdocs_sphinx_roles import SphinxRoles

    package = griffe.load("fpipe", search_paths=[str(ROOT)],
                          extensions=griffe.Extensions(SphinxRoles()))
    text = package["distributed.pipeline"].docstring.value
    assert ('<autoref identifier="fpipe.pipeline.pipeline" optional><code>fpipe.pipeline</code>'
            '</autoref>') in text
    assert ":func:" not in text


def test_the_reference_documents_calling_a_pipeline():
    """``pipe(x)`` is ``Pipeline.__call__``: mkdocs.yml's member filters (the last matching
    pattern decides, as mkdocstrings reads them) keep it while dropping private names."""
    config = (ROOT / "mkdocs.yml").read_text()
    filters = json.loads(re.search(r"filters: (\[.*?\])", config).group(1))

    def kept(name: str) -> bool:
        keep = None
        for pattern in filters:
            if re.search(pattern.removeprefix("!"), name):
                keep = not pattern.startswith("!")
        return True if keep is None else keep

    assert kept("__call__") and kept("value_and_grad")
    assert not kept("_step_inputs") and not kept("__init__")
    assert fpipe.Pipeline.__call__.__doc__


def test_what_the_documented_commands_write_is_ignored_by_git():
    """The docs' checkpoint directory and mkdocs' output are not left untracked in a clone."""
    ignored = set((ROOT / ".gitignore").read_text().split())
    pages = "\n".join((ROOT / page).read_text() for page in PAGES)
    assert 'saving.save("ckpt"' in pages and "mkdocs build" in pages
    assert {"ckpt/", "site/"} <= ignored
