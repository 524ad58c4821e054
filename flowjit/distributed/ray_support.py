"""Ray, imported when a cluster starts, and the rules every wait on it follows.

flowjit imports and runs without Ray; `flowjit.distributed` needs the `distributed` extra
(`pip install "flowjit[distributed]"`). Every `ray.get` here has a timeout (`FLOWJIT_RAY_TIMEOUT`,
default 300 s), and a failure of a task reaches the caller as a `TaskError` naming the task.
"""

from __future__ import annotations

from flowjit.errors import FlowjitError
from flowjit.runtime.rendezvous import seconds_setting
from flowjit.runtime.tasks import TaskError

DEFAULT_TIMEOUT_S = 300.0

# A local cluster stays on the loopback interface and sends no usage reports. Ray's token
# authentication keeps its default (on for local clusters: Ray makes the token itself).
LOCAL_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}


def ray():
    """The `ray` module, or a clear error naming the extra to install."""
    try:
        import ray as module
    except ImportError:
        raise FlowjitError(
            'flowjit.distributed needs Ray: install the extra with `pip install "flowjit[distributed]"` (ray==2.60.0)'
        ) from None
    return module


def loopback_only(module) -> None:
    """Keep a local Ray on 127.0.0.1 even when Ray was imported before LOCAL_ENV was set (Ray reads
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER into this constant on import; when it is set, a local node
    takes the machine's address and listens on it)."""
    constants = getattr(getattr(module, "_private", None), "ray_constants", None)
    if constants is not None and getattr(constants, "ENABLE_RAY_CLUSTER", False):
        constants.ENABLE_RAY_CLUSTER = False


def timeout_s() -> float:
    """Seconds any wait on a task may take (`FLOWJIT_RAY_TIMEOUT`, default 300)."""
    return seconds_setting("FLOWJIT_RAY_TIMEOUT", DEFAULT_TIMEOUT_S)


def get(refs, what: str, timeout: float | None = None):
    """`ray.get(refs)` within the timeout; a task's failure becomes its own error (a flowjit error
    raised in the task) or a TaskError saying `what` failed and why."""
    r = ray()
    limit = timeout_s() if timeout is None else timeout
    try:
        return r.get(refs, timeout=limit)
    except r.exceptions.GetTimeoutError:
        raise TaskError(f"{what}: no answer within {limit:g} s (FLOWJIT_RAY_TIMEOUT sets the limit)") from None
    except r.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else None
        if isinstance(cause, FlowjitError):
            raise cause from None
        raise TaskError(f"{what} failed: {cause if cause is not None else e}") from None
    except r.exceptions.RayActorError as e:
        raise TaskError(f"{what}: the task's process died ({_first_line(e)})") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
