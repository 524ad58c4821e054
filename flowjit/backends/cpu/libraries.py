"""The CPU backend's precompiled libraries, together (each is a `library.Library` of its own module):
which ones code compiled now may call (part of the cache key), loading those that code about to be
linked calls, and installing them all (`python -m flowjit.backends.cpu.libraries`, run by `make`
when it sets up the environment)."""

from __future__ import annotations

from collections.abc import Iterable

from flowjit.backends import cache_folder
from flowjit.backends.cpu import matmul_library, reduction_library, row_library, transpose_library
from flowjit.backends.cpu.library import Library


def libraries() -> list[Library]:
    return [matmul_library.LIBRARY, row_library.LIBRARY, reduction_library.LIBRARY, transpose_library.LIBRARY]


def state() -> str:
    """Which libraries code compiled now may call, for the compile cache's key (`cache.cache_key`):
    a program compiled with a library switched off must not be served one that calls it."""
    return ",".join(str(library.enabled()) for library in libraries())


def resolve(names: Iterable[str]) -> None:
    """Load the libraries that code about to be linked calls (`names`: its undefined symbols)."""
    names = list(names)
    for library in libraries():
        library.resolve(names)


def install() -> None:
    """Build every library into the cache folder (nothing with the cache off), reporting each."""
    import time

    if not cache_folder.enabled():
        print("flowjit: the cache is off (FLOWJIT_CACHE=0): no library installed; processes build those they call")
        return
    for library in libraries():
        start = time.perf_counter()
        library.object_code()
        installed = cache_folder.read(library.path()) is not None
        state = "ready" if installed else "built, not installed (the folder cannot be written or was refused)"
        print(f"flowjit: {library.name} library {state} ({library.path()}, {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    install()
