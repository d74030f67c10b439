"""The TOML reading and typed-section building shared by config.py and model_config.py.

build_dataclass() turns a TOML table into a settings dataclass, checking every key and type, so an
unknown key, a wrong type or an impossible value raises ConfigError naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 on JetPack 6
    import tomli as tomllib

from .errors import ConfigError


def build_dataclass(cls: type, table: dict[str, Any], where: str) -> Any:
    """Build dataclass `cls` from a TOML table, checking keys and types; errors name the key."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table, got {type(table).__name__}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in table:
        if key not in fields:
            raise ConfigError(
                f"{where}: unknown key {key!r}; expected one of "
                f"{', '.join(n for n in fields if n not in ('source', 'name', 'directory'))}"
            )
    values = {}
    for name, f in fields.items():
        if name in table:
            values[name] = _coerce(table[name], hints[name], f"{where} {name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: missing required key {name!r}")
    return cls(**values)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = get_origin(hint)
    if origin is not None and type(None) in get_args(hint):  # Optional[X]
        if value is None:
            return None
        (inner,) = [a for a in get_args(hint) if a is not type(None)]
        return _coerce(value, inner, where)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return build_dataclass(hint, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (inner,) = get_args(hint)
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        return dict(value)
    if hint is Path:
        return Path(value)
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported setting type {hint}")  # a bug in this module


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML file's tables; ConfigError in one line for anything that is not a readable
    UTF-8 TOML file (missing, a directory, unreadable, binary, invalid)."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a TOML file") from None
    except OSError as exc:  # permission denied, I/O error, ...
        raise ConfigError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:  # tomllib decodes the whole file first
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                          "a TOML file must be UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def check_positive(value: float, where: str, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{where}: expected a {'non-negative' if allow_zero else 'positive'} number, got {value}")
