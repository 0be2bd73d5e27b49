"""torchgpipe's own tests, run against ``fpipe.GPipe`` and against torchgpipe itself.

    python scripts/torchgpipe_suite.py [--tests DIR] [--json PATH]

The tests are torchgpipe 0.0.7's (``test_gpipe``, ``test_transparency``, ``test_bugs``,
``test_inplace``, ``test_deferred_batch_norm``): taken from ``DIR`` (a copy of torchgpipe's
``tests/`` folder), or else from its source distribution fetched with ``pip download``. They run
twice, in a temporary folder: once as they are (the real torchgpipe installed here), once with a
package named ``torchgpipe`` in front of it that re-exports fpipe's face. The table gives each
test's outcome under both; the counts at the end are what the compatibility claim rests on.
Nothing of torchgpipe's is copied into this repository.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION = "0.0.7"
FILES = ("conftest.py", "test_gpipe.py", "test_transparency.py", "test_bugs.py",
         "test_inplace.py", "test_deferred_batch_norm.py")

# The face torchgpipe's tests import, each module re-exporting fpipe's counterpart.
SHIM = {
    "__init__.py": "from fpipe import GPipe\nfrom fpipe.stages import DeferredBatchNorm\n"
                   "__version__ = 'fpipe'\n",
    "gpipe.py": "from fpipe import GPipe\nfrom fpipe._gpipe.arguments import verify_module\n",
    "batchnorm.py": "from fpipe.stages import DeferredBatchNorm\n",
    "balance/__init__.py": "from fpipe.stages import balance_by_size, balance_by_time\n",
}


def fetch_tests(into: Path) -> Path:
    """torchgpipe's ``tests/`` from its sdist, through pip (the registry must be reachable)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:",
                    "--no-deps", "--dest", str(into), f"torchgpipe=={VERSION}"], check=True)
    archive = next(into.glob("torchgpipe-*.tar.gz"))
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/tests/" in m.name and m.isfile()]
        tar.extractall(into, members=members, filter="data")
    return next(into.glob("torchgpipe-*/tests"))


def stage_tests(source: Path, into: Path) -> Path:
    missing = [name for name in FILES if not (source / name).is_file()]
    if missing:
        raise SystemExit(f"{source} lacks {', '.join(missing)}: give torchgpipe's tests/ folder")
    into.mkdir()
    for name in FILES:
        (into / name).write_text((source / name).read_text())
    return into


def write_shim(into: Path) -> Path:
    for name, text in SHIM.items():
        path = into / "torchgpipe" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return into


def run(tests: Path, report: Path, extra_path: list[Path]) -> dict[str, str]:
    """Each test's outcome (passed, failed, skipped, xfailed) under one ``torchgpipe``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, [*extra_path, ROOT])))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={report}", "--rootdir", str(tests), str(tests)],
                   env=env, cwd=tests, stdout=subprocess.DEVNULL, check=False)
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        kinds = {child.tag for child in case}
        skipped = case.find("skipped")
        if skipped is not None:
            xfail = skipped.get("type") == "pytest.xfail"
            outcomes[name] = "xfailed" if xfail else "skipped"
        elif kinds & {"failure", "error"}:
            outcomes[name] = "failed"
        else:
            outcomes[name] = "passed"
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=Path, help="torchgpipe's tests/ folder")
    parser.add_argument("--json", type=Path, help="write the outcomes here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        source = args.tests or fetch_tests(tmp / "sdist")
        tests = stage_tests(source, tmp / "tests")
        real = run(tests, tmp / "real.xml", [])
        shimmed = run(tests, tmp / "fpipe.xml", [write_shim(tmp / "shim")])
    names = sorted(set(real) | set(shimmed))
    width = max(map(len, names))
    print(f"{'test':<{width}}  {'torchgpipe':<10}  fpipe.GPipe")
    for name in names:
        print(f"{name:<{width}}  {real.get(name, '-'):<10}  {shimmed.get(name, '-')}")
    passes = [n for n in names if real.get(n) in ("passed", "xfailed")]
    kept = [n for n in passes if shimmed.get(n) == real.get(n)]
    print(f"\ntorchgpipe passes {len(passes)} of {len(names)}; fpipe.GPipe passes {len(kept)} "
          f"of those {len(passes)}")
    if args.json:
        args.json.write_text(json.dumps({"torchgpipe": real, "fpipe": shimmed}, indent=1))


if __name__ == "__main__":
    main()
