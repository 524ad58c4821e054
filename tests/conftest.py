"""Test-wide settings: the verifier runs after every pass."""

import os

import pytest

os.environ.setdefault("FLOWJIT_VERIFY", "1")

# Ray (tests/test_distributed*.py) on loopback only, without usage reports or a login token: set
# before any test module imports Ray, which reads them then.
for _key, _value in {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}.items():
    os.environ.setdefault(_key, _value)

# The CPU backend's disk cache goes to a fresh folder per test session, never the user's ~/.cache.
# The folder goes when the session ends (each holds several MiB, and a run must not leave one in /tmp).
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if "FLOWJIT_CACHE_DIR" not in os.environ:
    os.environ["FLOWJIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="flowjit-test-cache-")
    atexit.register(shutil.rmtree, os.environ["FLOWJIT_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def fake_libcuda(tmp_path_factory):
    """A folder holding `libcuda.so.1` built from tests/fake_cuda/fake_libcuda.c (a stand-in CUDA
    driver that logs its calls: docs/gpu-backend.md), built once per session; skipped without a C
    compiler."""
    import subprocess

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the fake CUDA driver")
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cuda", "fake_libcuda.c")
    folder = tmp_path_factory.mktemp("fake_cuda")
    built = subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-o", str(folder / "libcuda.so.1"), source, "-ldl"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr
    return folder


@pytest.fixture
def specialized_matmul(monkeypatch):
    """Products get their specialized kernel (`matmul_kernel.py`), not a matmul library call
    (`matmul_library.py`, tested in test_matmul_library.py): for tests of the kernel's code."""
    monkeypatch.setenv("FLOWJIT_MATMUL_LIBRARY", "0")


@pytest.fixture
def compiled_rows(monkeypatch):
    """Softmax and layer norm regions get their compiled row nest (`lower_rows.py`), not a row
    library call (`row_library.py`, tested in test_row_library.py): for tests of the nest's code."""
    monkeypatch.setenv("FLOWJIT_ROW_LIBRARY", "0")


def _ray_processes_of_this_session() -> list[str]:
    """Ray processes (raylet, gcs_server, workers, actors) descended from this pytest process."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                names[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:80]
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        if "ray" in names.get(pid, "") or "raylet" in names.get(pid, "") or "gcs_server" in names.get(pid, ""):
            found.append(f"{pid} {names[pid]}")
    return found


def pytest_sessionfinish(session, exitstatus):
    """The suite leaves no Ray process behind (tests/test_distributed*.py start and stop Ray)."""
    if not os.path.isdir("/proc"):
        return
    import time

    deadline = time.monotonic() + 20
    left = _ray_processes_of_this_session()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _ray_processes_of_this_session()
    if left:
        print("\nRay processes left behind by the test session:\n  " + "\n  ".join(left))
        session.exitstatus = 1
