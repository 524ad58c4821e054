"""The README's code runs as written, so that it cannot go stale.

Its fenced blocks run in document order, in a fresh folder, in one child process:
- ```python blocks are executed in one namespace; a block whose first line is `# NAME.py: ...` is
  a file the commands use, and is written to NAME.py instead;
- ```c blocks whose first line is `/* NAME.c */` are written to NAME.c;
- ```sh blocks are run by bash (`-e`), with `flowjit` running this checkout's command line;
- ```text blocks (the set-up commands, the stage picture) are not code and are skipped.
Files are written before anything runs, so a command may use a file shown after it.
Every relative link, and every repository path quoted in backticks, must name a file of this checkout.
"""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
RUNNABLE = {"python", "sh", "c"}
LINK = re.compile(r"\]\(([^)\s]+)\)")
QUOTED_PATH = re.compile(r"`((?:benchmarks|docs|examples|flowjit|tests)/[\w./-]+)`")

RUNNER = r"""
import json, os, re, subprocess, sys

blocks = json.load(open(sys.argv[1]))
FILE_LINE = re.compile(r"^(?:# ([\w.-]+\.py):|/\* ([\w.-]+\.c) \*/)")

def file_name(lang, body):
    m = FILE_LINE.match(body)
    return m and (m.group(1) or m.group(2))

for lang, body in blocks:
    name = file_name(lang, body)
    if name:
        with open(name, "w") as f:
            f.write(body)

cli = "import sys; from flowjit.cli import main; sys.exit(main())"
shell_prelude = 'flowjit() { "$FLOWJIT_PYTHON" -c "' + cli + '" "$@"; }\n'
namespace = {"__name__": "__readme__"}
for n, (lang, body) in enumerate(blocks, 1):
    print(f"==== block {n} ({lang})", flush=True)
    if file_name(lang, body):
        continue
    if lang == "python":
        exec(compile(body, f"README.md, python block {n}", "exec"), namespace)
    elif lang == "sh":
        proc = subprocess.run(["bash", "-e", "-c", shell_prelude + body], timeout=240)
        if proc.returncode != 0:
            sys.exit(f"README.md, sh block {n} failed with status {proc.returncode}:\n{body}")
    sys.stdout.flush()
print("==== all blocks ran", flush=True)
"""


def readme_blocks() -> list[tuple[str, str]]:
    with open(README) as f:
        return [(lang, body) for lang, body in FENCE.findall(f.read())]


def test_every_block_is_runnable_or_text():
    kinds = {lang for lang, _ in readme_blocks()}
    assert kinds <= RUNNABLE | {"text"}, f"README blocks need a language this test runs: {kinds}"


def test_every_relative_link_and_quoted_path_exists():
    with open(README) as f:
        text = f.read()
    links = [t.split("#")[0] for t in LINK.findall(text) if "://" not in t and not t.startswith(("#", "mailto:"))]
    paths = links + QUOTED_PATH.findall(text)
    assert len(links) >= 10, f"expected the README's links to docs/ and benchmarks/; found {links}"
    missing = sorted({p for p in paths if not os.path.exists(os.path.join(ROOT, p))})
    assert not missing, f"README.md names files that do not exist: {missing}"


def test_readme_code_runs(tmp_path):
    blocks = [(lang, body) for lang, body in readme_blocks() if lang in RUNNABLE]
    assert sum(lang == "python" for lang, _ in blocks) >= 5
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "runner.py").write_text(RUNNER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["FLOWJIT_CPU_DEVICES"] = "2"
    env["FLOWJIT_PYTHON"] = sys.executable
    proc = subprocess.run(
        [sys.executable, "runner.py", "blocks.json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        pytest.fail(f"a README block failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    assert "==== all blocks ran" in proc.stdout
    # The AOT library's C program prints one row of softmax probabilities.
    rows = [line.split() for line in proc.stdout.splitlines() if re.fullmatch(r"(\d\.\d{4} *){10}", line)]
    assert rows, f"the C program printed no row of 10 probabilities:\n{proc.stdout[-2000:]}"
    assert abs(sum(map(float, rows[-1])) - 1.0) < 1e-3
