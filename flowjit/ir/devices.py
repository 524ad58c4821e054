"""Device names, as in the TensorFlow paper: `/job:NAME/task:N/device:TYPE:K`.

Short forms are accepted: `cpu:1`, `gpu:0`, `/device:cpu:0`. A spec may be partial (`/job:ps`,
`gpu:*`, `/job:worker/task:1`): it constrains only the fields it names, and matches any device that
fits. Names are all the IR knows of devices: which devices exist is the runtime's business
(`flowjit.runtime.devices`), and placement takes the set it may use as an input.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flowjit.errors import FlowjitValueError
from flowjit.ir.location import user_location

# Device types a name may use. A backend for a new kind of device registers its type here
# (`register_device_type`) before names of that type are parsed.
DEVICE_TYPES = ["cpu", "gpu"]
LOCAL_JOB = "localhost"

_PART_RE = re.compile(r"^(job|task|device|replica):(.+)$")


@dataclass(frozen=True)
class DeviceSpec:
    """A full or partial device name; `None` fields are unconstrained."""

    job: str | None = None
    task: int | None = None
    device_type: str | None = None
    index: int | None = None

    @staticmethod
    def parse(text: str | DeviceSpec | Device) -> DeviceSpec:
        """Parse `/job:ps/task:0/device:cpu:1`, `cpu:1`, `gpu:*`, `/job:worker`, ..."""
        if isinstance(text, DeviceSpec):
            return text
        if isinstance(text, Device):
            return text.spec
        if not isinstance(text, str) or not text.strip():
            raise FlowjitValueError(f"a device must be a name like 'cpu:0' or '/job:ps/task:0'; found {text!r}")
        raw = text.strip()
        if not raw.startswith("/"):
            raw = "/device:" + raw
        job = task = device_type = index = None
        for part in raw.strip("/").split("/"):
            m = _PART_RE.match(part)
            if m is None:
                raise _bad(text, f"cannot read the part {part!r}")
            key, value = m.groups()
            if key == "job":
                job = value
            elif key == "task":
                task = _int_or_any(value, text, "task")
            elif key == "device":
                device_type, _, idx = value.partition(":")
                device_type = device_type.lower()
                if device_type not in DEVICE_TYPES:
                    raise _bad(text, f"unknown device type {device_type!r} (known: {', '.join(DEVICE_TYPES)})")
                index = _int_or_any(idx, text, "device index") if idx else None
        return DeviceSpec(job, task, device_type, index)

    def merged_with(self, inner: DeviceSpec) -> DeviceSpec:
        """The constraint of a `with fj.device(inner)` nested inside this one: inner fields win."""
        return DeviceSpec(
            inner.job if inner.job is not None else self.job,
            inner.task if inner.task is not None else self.task,
            inner.device_type if inner.device_type is not None else self.device_type,
            inner.index if inner.index is not None else self.index,
        )

    def matches(self, device: Device) -> bool:
        d = device.spec
        return all(
            mine is None or mine == theirs
            for mine, theirs in (
                (self.job, d.job),
                (self.task, d.task),
                (self.device_type, d.device_type),
                (self.index, d.index),
            )
        )

    @property
    def is_full(self) -> bool:
        return None not in (self.job, self.task, self.device_type, self.index)

    def __str__(self) -> str:
        parts = []
        if self.job is not None:
            parts.append(f"/job:{self.job}")
        if self.task is not None:
            parts.append(f"/task:{self.task}")
        if self.device_type is not None:
            idx = "*" if self.index is None else str(self.index)
            parts.append(f"/device:{self.device_type}:{idx}")
        return "".join(parts) or "/device:*"


def _int_or_any(value: str, text: str, what: str) -> int | None:
    if value == "*":
        return None
    if not value.isdigit():
        raise _bad(text, f"the {what} must be a number or '*'; found {value!r}")
    return int(value)


def _bad(text, why: str) -> FlowjitValueError:
    return FlowjitValueError(
        f"{user_location()}: bad device name {text!r}: {why}. "
        "Use '/job:NAME/task:N/device:cpu:K' or a short form like 'cpu:1', 'gpu:0'"
    )


@dataclass(frozen=True)
class Device:
    """A concrete device: every field of its spec is set."""

    spec: DeviceSpec

    @property
    def name(self) -> str:
        return str(self.spec)

    @property
    def device_type(self) -> str:
        return self.spec.device_type

    @property
    def short_name(self) -> str:
        return f"{self.spec.device_type}:{self.spec.index}"

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Device({self.name!r})"


def task_name(device: str) -> str:
    """`/job:ps/task:0` for the device `/job:ps/task:0/device:cpu:0`; a name without a job and task
    (`cpu:1`) is a device of this process's task, `/job:localhost/task:0`."""
    spec = DeviceSpec.parse(device)
    return f"/job:{spec.job or LOCAL_JOB}/task:{spec.task or 0}"


def same_task(a: str, b: str) -> bool:
    """Whether the devices named `a` and `b` live in one task (process)."""
    return task_name(a) == task_name(b)


def register_device_type(device_type: str) -> None:
    """Allow names of `device_type` (lower-case letters, digits and '_'), e.g. a new backend's."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", device_type):
        raise FlowjitValueError(f"a device type is a lower-case name like 'gpu'; found {device_type!r}")
    if device_type not in DEVICE_TYPES:
        DEVICE_TYPES.append(device_type)


def unregister_device_type(device_type: str) -> None:
    """Forget a registered device type (the built-in 'cpu' and 'gpu' stay)."""
    if device_type not in ("cpu", "gpu") and device_type in DEVICE_TYPES:
        DEVICE_TYPES.remove(device_type)


def resolve(spec: str | DeviceSpec, candidates: list[Device]) -> list[Device]:
    """The devices of `candidates` matching `spec`, in order."""
    spec = DeviceSpec.parse(spec)
    return [d for d in candidates if spec.matches(d)]
