"""The compile cache is no way in (`backends/cache_folder.py`): a cache folder, entry or library
object that another user owns or could have written is refused with one warning and never loaded;
flowjit compiles as if the cache were off. Folders flowjit creates are private, and `FLOWJIT_CACHE=0`
writes nothing.

Each test plants a file that would be loaded if it were trusted (an entry compiled into a trusted
folder and copied, or a library object), checks that it is loaded while trusted, then makes it
untrusted and checks what happens: the compile path ran, the load path did not, the results are right.
"""

import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from flowjit.backends import cache_folder, compile_graph
from flowjit.backends.cache_folder import UntrustedCacheWarning
from flowjit.backends.cpu import reduction_library, toolchain
from flowjit.ir.parser import parse_graph

_GRAPH = (
    "func @g(%x: tensor<64xf32>) -> (tensor<64xf32>) {\n  %0 = tanh %x : tensor<64xf32>\n"
    "  return %0 : tensor<64xf32>\n}\n"
)
_X = np.linspace(-3, 3, 64, dtype=np.float32)
_LIBRARY = reduction_library.LIBRARY  # any library: its build is replaced by fake object code

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


@pytest.fixture(autouse=True)
def fresh_cache_state(monkeypatch):
    """Each test starts with no path warned about and the cache on; monkeypatch restores both."""
    monkeypatch.setattr(cache_folder, "_warned", set())
    monkeypatch.setenv("FLOWJIT_CACHE", "1")


@pytest.fixture
def loads(monkeypatch):
    """The names `toolchain.load_objects` linked (cached entries are linked under their symbol)."""
    names = []
    load_objects = toolchain.load_objects

    def counting(objects, name, resolve=None):
        names.append(name)
        return load_objects(objects, name, resolve)

    monkeypatch.setattr(toolchain, "load_objects", counting)
    return names


def _compile(folder, monkeypatch):
    """Compile `_GRAPH` with `folder` as the cache: (whether it was loaded from an entry, not
    compiled, its result on `_X`)."""
    monkeypatch.setenv("FLOWJIT_CACHE_DIR", str(folder))
    executable = compile_graph(parse_graph(_GRAPH), "cpu")
    loaded = not executable.stages.parts  # a compile builds the LLVM parts; a load has none
    return loaded, executable.run([_X])[0]


def _planted_entry(tmp_path, monkeypatch):
    """A folder holding the entry of `_GRAPH`, copied from a trusted folder where it was compiled."""
    trusted, planted = tmp_path / "trusted", tmp_path / "planted"
    loaded, _ = _compile(trusted, monkeypatch)
    assert not loaded
    planted.mkdir(mode=0o700)
    (entry,) = trusted.glob("*.fjo")
    shutil.copy2(entry, planted / entry.name)
    return planted, planted / entry.name


@pytest.mark.parametrize(
    "mode, writers", [(0o770, "group"), (0o707, "others"), (0o777, "group and others")], ids=["g", "o", "go"]
)
def test_a_writable_cache_folder_is_refused_and_never_loaded(tmp_path, monkeypatch, loads, mode, writers):
    folder, entry = _planted_entry(tmp_path, monkeypatch)
    assert _compile(folder, monkeypatch)[0], "the planted entry is loaded while the folder is trusted"
    assert len(loads) == 1  # linked from the folder
    folder.chmod(mode)
    with pytest.warns(UntrustedCacheWarning) as warned:
        loaded, result = _compile(folder, monkeypatch)
    assert not loaded and len(loads) == 1  # compiled; nothing linked from the folder
    np.testing.assert_allclose(result, np.tanh(_X), rtol=1e-6)
    (message,) = [str(w.message) for w in warned]
    assert str(folder) in message and f"writable by {writers}" in message and f"mode {mode:04o}" in message
    assert f"chmod 700 {folder}" in message and "FLOWJIT_CACHE_DIR" in message
    assert sorted(p.name for p in folder.iterdir()) == [entry.name]  # nothing written either
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert _compile(folder, monkeypatch)[0] is False
    assert again == []  # one warning per path and process
    folder.chmod(0o700)


def test_a_writable_entry_is_refused_and_never_loaded(tmp_path, monkeypatch, loads):
    folder, entry = _planted_entry(tmp_path, monkeypatch)
    entry.chmod(0o666)
    with pytest.warns(
        UntrustedCacheWarning,
        match=re.escape(
            f"{entry} in the compile cache: it is writable by group and others (mode 0666); fix: `chmod 600"
        ),
    ):
        loaded, result = _compile(folder, monkeypatch)
    assert not loaded and loads == []
    np.testing.assert_allclose(result, np.tanh(_X), rtol=1e-6)
    assert stat.S_IMODE(entry.stat().st_mode) == 0o666  # refused, not replaced


@needs_root
def test_an_entry_owned_by_another_user_is_refused_and_never_loaded(tmp_path, monkeypatch, loads):
    folder, entry = _planted_entry(tmp_path, monkeypatch)
    os.chown(entry, 1, 1)  # mode 0600, trusted but for its owner
    with pytest.warns(UntrustedCacheWarning, match=re.escape(f"{entry} in the compile cache: it is owned by uid 1")):
        loaded, result = _compile(folder, monkeypatch)
    assert not loaded and loads == []
    np.testing.assert_allclose(result, np.tanh(_X), rtol=1e-6)


@needs_root
def test_a_cache_folder_owned_by_another_user_is_refused(tmp_path, monkeypatch, loads):
    folder, _ = _planted_entry(tmp_path, monkeypatch)
    os.chown(folder, 1, 1)
    with pytest.warns(UntrustedCacheWarning, match="owned by uid 1.*set FLOWJIT_CACHE_DIR to a folder of your own"):
        loaded, _ = _compile(folder, monkeypatch)
    assert not loaded and loads == []


def test_a_symbolic_link_inside_the_cache_is_refused(tmp_path, monkeypatch, loads):
    folder, entry = _planted_entry(tmp_path, monkeypatch)
    elsewhere = tmp_path / "elsewhere.fjo"
    entry.rename(elsewhere)
    entry.symlink_to(elsewhere)
    with pytest.warns(UntrustedCacheWarning, match="symbolic link"):
        loaded, _ = _compile(folder, monkeypatch)
    assert not loaded and loads == []


def test_folders_flowjit_creates_are_private(tmp_path, monkeypatch):
    """The cache folder, its missing parents and the library folder are made 0700 (whatever the
    umask), the files in them 0600."""
    folder = tmp_path / "home" / "cache" / "flowjit"
    monkeypatch.setattr(_LIBRARY, "build", lambda: b"object code")
    umask = os.umask(0)
    try:
        _compile(folder, monkeypatch)
        _LIBRARY.object_code()
    finally:
        os.umask(umask)
    for made in (tmp_path / "home", tmp_path / "home" / "cache", folder, folder / "library"):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made
    for file in [*folder.glob("*.fjo"), *(folder / "library").iterdir()]:
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file


@pytest.mark.parametrize("untrusted", ["library folder", "object"])
def test_library_objects_follow_the_same_rule(tmp_path, monkeypatch, untrusted):
    """A library object is read while it and its folders are trusted; once another user could have
    written it, it is refused: the library is built in memory, the planted file neither loaded nor
    replaced."""
    monkeypatch.setenv("FLOWJIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_LIBRARY, "build", lambda: b"planted code")
    _LIBRARY.object_code()
    monkeypatch.setattr(_LIBRARY, "build", lambda: b"built code")
    assert _LIBRARY.object_code() == b"planted code"  # read back while trusted
    path = tmp_path / "library" / os.path.basename(_LIBRARY.path())
    (path.parent if untrusted == "library folder" else path).chmod(0o777 if untrusted == "library folder" else 0o622)
    with pytest.warns(UntrustedCacheWarning, match="writable by"):
        assert _LIBRARY.object_code() == b"built code"
    assert path.read_bytes().startswith(b"planted code")


@needs_root
def test_a_library_object_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWJIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_LIBRARY, "build", lambda: b"planted code")
    _LIBRARY.object_code()
    os.chown(_LIBRARY.path(), 1, 1)
    monkeypatch.setattr(_LIBRARY, "build", lambda: b"built code")
    with pytest.warns(UntrustedCacheWarning, match="owned by uid 1"):
        assert _LIBRARY.object_code() == b"built code"


def test_cache_off_writes_nothing_and_reads_only_installed_libraries(tmp_path, monkeypatch, loads):
    """With `FLOWJIT_CACHE=0` no entry is read or written and no folder made; a library already
    installed in the folder is still read (it is installed code), a missing one built in memory."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    monkeypatch.setattr(_LIBRARY, "build", lambda: b"built code")
    assert _compile(folder, monkeypatch)[0] is False
    assert _LIBRARY.object_code() == b"built code"
    assert not folder.exists()
    monkeypatch.setenv("FLOWJIT_CACHE", "1")
    monkeypatch.setattr(_LIBRARY, "build", lambda: b"installed code")
    _LIBRARY.object_code()
    _compile(folder, monkeypatch)
    installed = sorted(folder.rglob("*"))
    monkeypatch.setenv("FLOWJIT_CACHE", "0")
    monkeypatch.setattr(_LIBRARY, "build", lambda: b"built code")
    assert _LIBRARY.object_code() == b"installed code"
    assert _compile(folder, monkeypatch)[0] is False and loads == []  # the entry is not read
    assert sorted(folder.rglob("*")) == installed


def test_cache_off_process_writes_nothing(tmp_path):
    """A process with `FLOWJIT_CACHE=0` that compiles a function and uses a precompiled library
    (built in memory: none is installed in its folder) leaves the folder empty; so does the
    command `make` installs libraries with."""
    script = textwrap.dedent(
        """
        import numpy as np, flowjit as fj
        from flowjit.backends.cpu import reduction_library
        x = np.arange(100_000, dtype=np.float32) % 7
        assert float(fj.jit(lambda x: x.sum())(x)) == float(x.sum(dtype=np.float64))
        assert reduction_library.LIBRARY.loaded
        """
    )
    env = {**os.environ, "FLOWJIT_CACHE": "0", "FLOWJIT_CACHE_DIR": str(tmp_path), "FLOWJIT_REDUCTION_LIBRARY": "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    install = [sys.executable, "-m", "flowjit.backends.cpu.libraries"]
    run = subprocess.run(install, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "the cache is off" in run.stdout, run.stdout + run.stderr
    assert list(tmp_path.iterdir()) == []
