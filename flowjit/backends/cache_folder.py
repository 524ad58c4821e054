"""The on-disk cache folder every backend keeps its compiled code in: whether it is on, where it is,
and whether what is in it may be loaded.

flowjit loads native code from this folder (the compile cache's entries, the precompiled libraries)
and runs it, so a file that someone else could have written there is a way to run their code in the
user's processes; the entries' checksums guard against damage, not against tampering. The rule:

- `FLOWJIT_CACHE=0` (or `false`, `off`, empty) turns the cache off: flowjit writes nothing into the
  folder (what a backend still reads then is its own decision: the CPU backend reads precompiled
  libraries that `make` installed, never compile-cache entries).
- The folder is `$FLOWJIT_CACHE_DIR`, else `~/.cache/flowjit`, with the symbolic links of that path
  resolved: the links and the folders above the cache are the user's configuration, as much as the
  variable is. flowjit creates the folder, its missing parents and its sub-folders with mode 0700.
- A folder or file in the cache is trusted when it is owned by this process's effective user and is
  not writable by group or others; so is every folder from the cache folder down to it, the cache
  folder included (read with `lstat`: a symbolic link inside the cache is refused, since it could
  lead anywhere, and files are opened without following one). A file is checked on the open file
  itself, so it cannot be swapped between the check and the read.
- An untrusted path is refused: one `UntrustedCacheWarning` per path and process names the path,
  the owner or mode found and the fix, and flowjit goes on as if the cache were off for it: nothing
  is read from it or written to it. Nothing untrusted is ever loaded.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import pwd
import stat
import struct
import tempfile
import warnings
from collections.abc import Callable
from typing import TypeVar

from flowjit.errors import CompileError

T = TypeVar("T")


class UntrustedCacheWarning(UserWarning):
    """A cache folder or file that another user could have written was refused (not loaded)."""


def enabled() -> bool:
    """False when `FLOWJIT_CACHE=0` (or false/off/empty) turns the cache off."""
    return os.environ.get("FLOWJIT_CACHE", "1") not in ("0", "false", "off", "")


def location() -> str:
    """The cache folder: `$FLOWJIT_CACHE_DIR`, else `~/.cache/flowjit`, symbolic links resolved."""
    configured = os.environ.get("FLOWJIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flowjit")
    return os.path.realpath(configured)


def read(path: str) -> bytes | None:
    """The contents of the file `path` in the cache folder, or None when it (or a folder on its way)
    does not exist or is refused (warned once, `UntrustedCacheWarning`)."""
    for depth, folder in enumerate(_folders_to(path)):
        info = _lstat(folder)
        if info is None:
            return None
        if _refused(folder, info, depth == 0):
            return None
        if not stat.S_ISDIR(info.st_mode):
            return None  # a file where a folder should be: nothing to read through it
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        info = _lstat(path)
        if info is not None and stat.S_ISLNK(info.st_mode):
            _refused(path, info, False)
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or _refused(path, info, False):
            return None
        return f.read()


def read_entry(path: str, decode: Callable[[bytes], T | None]) -> T | None:
    """The decoded entry in file `path` (`read`), or None when there is none, it is refused, or
    `decode` finds it damaged (then the file is deleted, so that it is compiled and written again)."""
    data = read(path)
    if data is None:
        return None
    entry = decode(data)
    if entry is None:
        try:
            os.remove(path)
        except OSError:
            pass
    return entry


_LENGTH = struct.Struct("<Q")
_DIGEST = 32  # sha256


def sealed(body: bytes) -> bytes:
    """`body` followed by its sha256 (`unsealed` checks it), so that a truncated or damaged file is
    rebuilt, never loaded."""
    return body + hashlib.sha256(body).digest()


def unsealed(data: bytes) -> bytes | None:
    """The body of `sealed` data, or None when the data is truncated or damaged."""
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    return body if len(data) > _DIGEST and hashlib.sha256(body).digest() == digest else None


def pack_entry(magic: bytes, header: dict, payload: bytes) -> bytes:
    """A compile-cache entry file: `magic`, the length and JSON of `header`, the length and bytes of
    `payload`, `sealed` (`unpack_entry` checks it)."""
    text = json.dumps(header).encode()
    return sealed(magic + _LENGTH.pack(len(text)) + text + _LENGTH.pack(len(payload)) + payload)


def unpack_entry(magic: bytes, data: bytes) -> tuple[dict, bytes] | None:
    """(header, payload) of a `pack_entry` file, or None when `data` is not a complete, intact one
    starting with `magic`."""
    if len(data) < len(magic) + 2 * _LENGTH.size + _DIGEST or not data.startswith(magic):
        return None
    body = unsealed(data)
    if body is None:
        return None
    pos = len(magic)
    (header_len,) = _LENGTH.unpack_from(body, pos)
    pos += _LENGTH.size
    header = json.loads(body[pos : pos + header_len])
    pos += header_len
    (payload_len,) = _LENGTH.unpack_from(body, pos)
    pos += _LENGTH.size
    if pos + payload_len != len(body):
        return None
    return header, body[pos:]


@functools.cache
def source_digest(folders: tuple[str, ...]) -> str:
    """A sha256 of the Python source of the `flowjit/backends/` sub-folders `folders` (those whose
    code generates a backend's code: part of its cache keys)."""
    source = hashlib.sha256()
    backends = os.path.dirname(os.path.abspath(__file__))
    for folder in folders:
        path = os.path.join(backends, folder)
        for name in sorted(os.listdir(path)):
            if name.endswith(".py"):
                with open(os.path.join(path, name), "rb") as f:
                    source.update(f"{folder}/{name}".encode() + b"\0" + f.read())
    return source.hexdigest()


def write(path: str, data: bytes) -> bool:
    """Write `data` to the file `path` in the cache folder, creating the folders on its way (mode
    0700): through a unique temporary file in the same folder (mode 0600) and `os.replace`, so that
    readers see the old file or the new one and concurrent writers never interleave. False when the
    cache is off or a folder on the way, or a file already at `path`, is refused (warned). Raises
    OSError when the folder cannot be made or written (a read-only home)."""
    if not enabled():
        return False
    folders = _folders_to(path)
    _make_parents(folders[0])
    for depth, folder in enumerate(folders):
        try:
            os.mkdir(folder, 0o700)
            os.chmod(folder, 0o700)  # exactly 0700, whatever the umask
        except FileExistsError:
            pass
        info = os.lstat(folder)
        if _refused(folder, info, depth == 0):
            return False
        if not stat.S_ISDIR(info.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "the cache folder's path holds a file", folder)
    existing = _lstat(path)
    if existing is not None and _refused(path, existing, False):
        return False
    fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)[:16]}-", suffix=".tmp", dir=folders[-1])
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    return True


def _folders_to(path: str) -> list[str]:
    """The cache folder and each folder below it down to the one holding `path`."""
    root = location()
    relative = os.path.relpath(os.path.dirname(path), root)
    if relative == os.pardir or relative.startswith(os.pardir + os.sep) or os.path.isabs(relative):
        raise CompileError(f"internal error: {path} is not inside the cache folder {root}")
    folders = [root]
    if relative != os.curdir:
        for part in relative.split(os.sep):
            folders.append(os.path.join(folders[-1], part))
    return folders


def _make_parents(root: str) -> None:
    """Create the missing folders above the cache folder, private (0700) as it is."""
    missing = []
    parent = os.path.dirname(root)
    while not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _refused(path: str, info: os.stat_result, is_root: bool) -> bool:
    """True, after a warning (once per path and process), when `path` (`info`: its lstat or fstat)
    may not be trusted: a symbolic link inside the cache, another user's, or writable by group or
    others."""
    problem = _problem(path, info, is_root)
    if problem is None:
        return False
    if path not in _warned:
        _warned.add(path)
        warnings.warn(
            f"flowjit: not using {path} in the compile cache: {problem}. Native code that another user "
            f"could have written there is never loaded; flowjit compiles without it, as with FLOWJIT_CACHE=0 "
            f"(nothing read from it or written to it).",
            UntrustedCacheWarning,
            stacklevel=2,
        )
    return True


_warned: set[str] = set()  # paths refused (and warned about) in this process


def _problem(path: str, info: os.stat_result, is_root: bool) -> str | None:
    """What makes `path` untrusted, with the fix, or None."""
    folder = stat.S_ISDIR(info.st_mode)
    if stat.S_ISLNK(info.st_mode):
        return (
            f"it is a symbolic link inside the cache folder; fix: remove it (`rm {path}`), flowjit makes what it needs"
        )
    me = os.geteuid()
    if info.st_uid != me:
        fix = (
            "set FLOWJIT_CACHE_DIR to a folder of your own"
            if is_root
            else f"remove it (`rm {'-r ' if folder else ''}{path}`), flowjit rebuilds it"
        )
        return f"it is owned by {_user(info.st_uid)}, not by you ({_user(me)}); fix: {fix}"
    writers = " and ".join(
        who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if info.st_mode & bit
    )
    if writers:
        mode = f"{stat.S_IMODE(info.st_mode):04o}"
        fix = f"`chmod 700 {path}`" if folder else f"`chmod 600 {path}`"
        if is_root:
            fix += " or set FLOWJIT_CACHE_DIR to a folder of your own"
        return f"it is writable by {writers} (mode {mode}); fix: {fix}"
    return None


def _user(uid: int) -> str:
    """`uid 1 (daemon)`, or `uid 1` where no name is known."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"
