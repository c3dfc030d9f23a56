"""The docs run: every code block of README.md and docs/*.md is executed.

- Python blocks run in order within a file, all of a file's blocks in one fresh
  subprocess (a later block may use the names an earlier one defined), in an empty
  temporary folder: as on a fresh checkout, no file the docs do not make is there (plan
  examples name presets, which ship with the package).
- Shell blocks: each line that starts with `multihead` runs as `python -m multihead ...`;
  lab commands get `--quick` (they train). Other lines (`make run`, `pip install`) are
  set-up instructions and are not run here.
- A block preceded by `<!-- docs-test: skip (reason) -->` is deliberately abridged (or
  needs what CI has not got) and is skipped; the reason is required.
- A quoted output (a fence without a language right after a shell block of one command)
  is compared with what the command prints: every quoted line must appear in the output,
  except lines holding "..." (the doc's mark for an abridged line).

Blocks that load the MiniLM model or train are marked slow; the rest takes seconds.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
SHELL = {"bash", "sh", "shell", "console"}
HEAVY = re.compile(r"\b(capture|induction_scores|head_roles|AutoModel|from_pretrained|multihead inspect)\b|"
                   r"\bmultihead lab\b")
TIMEOUT = 600
# Files whose light blocks still take over ~10 s on 2 cores (DeepSeek-sized MLA layers).
SLOW_FILES = {"docs/mla.md"}

@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # the reason, when marked skip
    output_of: Block | None = None  # for a quoted output: the shell block it quotes

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, each with its skip mark and quoted output."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        skip = SKIP.search(prev)
        block = Block(path, start + 1, lang, "\n".join(lines[start + 1 : j]), skip and skip.group("reason"))
        if not lang and out and out[-1].lang in SHELL and start - (out[-1].line + out[-1].code.count("\n") + 2) <= 8:
            block.output_of = out[-1]
        out.append(block)
        i = j + 1
    return out


ALL = [b for p in DOCS for b in blocks(p)]
PYTHON_FILES = sorted({b.path for b in ALL if b.lang == "python"})
SHELL_BLOCKS = [b for b in ALL if b.lang in SHELL]
OUTPUTS = [b for b in ALL if b.output_of is not None]


def _commands(block: Block) -> list[str]:
    """The `multihead ...` lines of a shell block, comments removed, lab commands --quick."""
    cmds = []
    for raw in block.code.splitlines():
        line = raw.strip()
        if not line.startswith("multihead "):
            continue
        line = re.sub(r"\s+#.*$", "", line)
        if line.startswith("multihead lab ") and "--quick" not in line:
            line += " --quick"
        cmds.append(line)
    return cmds


def _env() -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", MPLBACKEND="Agg",
               PYTHONPATH=str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", ""))
    return env


@pytest.fixture()
def workdir(tmp_path):
    return tmp_path


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory):
    """One empty folder for the shell commands, so a command that is run and whose quoted
    output is compared runs once (`_RUNS`)."""
    return tmp_path_factory.mktemp("docs-shell")


_RUNS: dict[str, subprocess.CompletedProcess] = {}


def _run_multihead(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    key = f"{cwd}\0{cmd}"
    if key not in _RUNS:
        argv = shlex.split(cmd)
        _RUNS[key] = subprocess.run([sys.executable, "-m", "multihead", *argv[1:]], cwd=cwd, env=_env(),
                                    capture_output=True, text=True, timeout=TIMEOUT)
    return _RUNS[key]


def _marks(heavy: bool):
    return [pytest.mark.slow] if heavy else []


# --- Python blocks -------------------------------------------------------------------


def _python_blocks(path: Path, light_only: bool) -> list[Block]:
    return [b for b in ALL if b.path == path and b.lang == "python" and not b.skip
            and not (light_only and HEAVY.search(b.code))]


def _python_params():
    # Every file's light blocks (no model to load) run in the fast suite; a file with
    # heavy blocks also runs whole, in order, in the slow suite.
    out = []
    for path in PYTHON_FILES:
        name = str(path.relative_to(ROOT))
        light, every = _python_blocks(path, True), _python_blocks(path, False)
        if light:
            out.append(pytest.param(path, True, id=f"{name}-light", marks=_marks(name in SLOW_FILES)))
        if len(every) > len(light):
            out.append(pytest.param(path, False, id=f"{name}-all", marks=[pytest.mark.slow]))
    return out


@pytest.mark.parametrize("path, light_only", _python_params())
def test_python_blocks_run(path, light_only, workdir, request):
    whole = any(p.id.endswith("-all") and p.values[0] == path for p in _python_params())
    if light_only and whole and "not slow" not in (request.config.option.markexpr or ""):
        pytest.skip("the -all run of this file (slow tests are selected) runs these blocks too")
    parts = []
    for b in _python_blocks(path, light_only):
        # Each block prints where it starts, so a failure names its block.
        parts.append(f"print('--- block {b.id}', flush=True)\n{b.code}")
    script = workdir / "blocks.py"
    script.write_text("\n\n".join(parts), encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=workdir, env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT)
    started = re.findall(r"--- block (\S+)", proc.stdout)
    assert proc.returncode == 0, (f"{path.name}: the block at {started[-1] if started else '?'} failed:\n"
                                  f"{proc.stderr[-3000:]}")
    # an example that warns is not one to copy (docs/mla.md's out.past_key_values did)
    warned = [line for line in proc.stderr.splitlines() if "deprecat" in line.lower()]
    assert not warned, f"{path.name}: the docs' code warns of a deprecation:\n" + "\n".join(warned[:5])


# --- shell blocks --------------------------------------------------------------------


def _shell_params():
    out = []
    for b in SHELL_BLOCKS:
        cmds = _commands(b)
        if not cmds:
            continue
        marks = _marks(any(HEAVY.search(c) for c in cmds))
        if b.skip:
            marks.append(pytest.mark.skip(reason=f"docs-test: skip ({b.skip})"))
        out.append(pytest.param(b, id=b.id, marks=marks))
    return out


@pytest.mark.parametrize("block", _shell_params())
def test_shell_blocks_run(block, shared_dir):
    for cmd in _commands(block):
        proc = _run_multihead(cmd, shared_dir)
        assert proc.returncode == 0, f"{block.id}: `{cmd}` exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        assert "Traceback" not in proc.stderr


# --- quoted outputs ------------------------------------------------------------------


def _output_params():
    out = []
    for b in OUTPUTS:
        cmds = _commands(b.output_of)
        if len(cmds) != 1:
            continue
        marks = _marks(bool(HEAVY.search(cmds[0])))
        if b.skip or b.output_of.skip:
            marks.append(pytest.mark.skip(reason=f"docs-test: skip ({b.skip or b.output_of.skip})"))
        out.append(pytest.param(b, id=b.id, marks=marks))
    return out


def _norm(line: str) -> str:
    return " ".join(line.split())


@pytest.mark.parametrize("block", _output_params())
def test_quoted_outputs_match(block, shared_dir):
    (cmd,) = _commands(block.output_of)
    proc = _run_multihead(cmd, shared_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout.replace(str(shared_dir.resolve()) + os.sep, "/home/you/")
    actual = [_norm(line) for line in printed.splitlines()]
    missing = []
    for quoted in block.code.splitlines():
        q = _norm(quoted)
        if not q or "..." in q:
            continue
        if not any(q in line for line in actual):
            missing.append(quoted)
    assert not missing, (f"{block.id}: quoted lines not in the output of `{cmd}`:\n" + "\n".join(missing)
                         + "\n--- actual output:\n" + proc.stdout[:4000])


def test_every_skip_mark_gives_a_reason():
    for path in DOCS:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "docs-test" in line:
                assert SKIP.search(line), f"{path.name}:{n}: write <!-- docs-test: skip (reason) -->"


def test_the_extraction_finds_the_blocks():
    # A guard against an extractor that silently finds nothing: README has shell and
    # Python blocks and plan.md quotes an output.
    readme = blocks(ROOT / "README.md")
    assert sum(b.lang == "python" for b in readme) >= 5
    assert any(_commands(b) for b in readme if b.lang in SHELL)
    assert any(b.output_of is not None for b in blocks(ROOT / "docs" / "plan.md"))
