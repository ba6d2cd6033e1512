"""The field checks of the configuration dataclasses (`dream_trainer.configs`): each names
the owner, the field, the bad value and what is allowed."""

from __future__ import annotations

import math
import os
from typing import Any


def positive_int(owner: str, name: str, value: Any, *, allow_none: bool = False, allow_zero: bool = False) -> None:
    if value is None and allow_none:
        return
    lowest = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        allowed = f"an int >= {lowest}" + (" or None" if allow_none else "")
        raise ValueError(f"{owner}.{name}={value!r} is invalid: expected {allowed}")


def flags(owner: str, obj: Any, *names: str) -> None:
    """Bool fields must be bools: ``compile_model="no"`` would otherwise turn compiling on."""
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, bool):
            raise TypeError(f"{owner}.{name}={value!r} is invalid: expected True or False")


def seconds(owner: str, name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}.{name}={value!r} is invalid: expected a finite number > 0" + (" or None" if allow_none else ""))


def watchdog_fields(owner: str, hang_report_s: Any, hang_abort_s: Any, timeout_s: float, straggler_factor: Any) -> None:
    """`DeviceParameters.hang_report_s` (None, 0: off, or under `timeout_s`), `hang_abort_s`
    (None, or seconds > 0 under `timeout_s`) and `straggler_factor` (None or > 1)."""
    if hang_report_s is not None and (isinstance(hang_report_s, bool) or not isinstance(hang_report_s, (int, float))
                                      or not 0 <= hang_report_s < math.inf):
        raise ValueError(f"{owner}.hang_report_s={hang_report_s!r} is invalid: expected None (the default), 0 (off) "
                         "or a number of seconds > 0")
    if hang_report_s:
        if hang_report_s >= timeout_s:
            raise ValueError(f"{owner}.hang_report_s={hang_report_s!r} is invalid: expected less than "
                             f"timeout_s={timeout_s!r} (a hang is reported before the collective times out), "
                             "None (the default) or 0 (off)")
    if hang_abort_s is not None and (isinstance(hang_abort_s, bool) or not isinstance(hang_abort_s, (int, float))
                                     or not 0 < hang_abort_s < timeout_s):
        raise ValueError(f"{owner}.hang_abort_s={hang_abort_s!r} is invalid: expected None (the default: just before "
                         f"the collective timeout) or seconds > 0 and under timeout_s={timeout_s!r}")
    if straggler_factor is not None and (isinstance(straggler_factor, bool) or not isinstance(
            straggler_factor, (int, float)) or not math.isfinite(straggler_factor) or straggler_factor <= 1):
        raise ValueError(f"{owner}.straggler_factor={straggler_factor!r} is invalid: expected a number > 1 or None")


def check_name(what: str, value: Any) -> str:
    """`value` if it is a valid directory name (experiment, run): non-empty, no path
    separator, not ``.``/``..``, no NUL; else ValueError naming `what`. Used for names
    from the config and for names read back (the environment, files)."""
    if not isinstance(value, str) or not value or "/" in value or "\\" in value or "\0" in value or value in (".", ".."):
        raise ValueError(f"{what}={value!r} is invalid: expected a non-empty name without '/', '\\' or NUL, "
                         "not '.' or '..'")
    return value


def path_field(owner: str, name: str, value: Any, *, allow_none: bool = False) -> str | None:
    """A path field as a ``str``; ``pathlib.Path`` (any ``os.PathLike``) is accepted."""
    if value is None and allow_none:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        allowed = "a non-empty str or pathlib.Path" + (" or None" if allow_none else "")
        error = ValueError if isinstance(value, str) else TypeError
        raise error(f"{owner}.{name}={value!r} is invalid: expected {allowed}")
    return value
