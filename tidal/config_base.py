"""Typed configuration machinery shared by every component config.

Contract:
- Each component owns one kw-only dataclass (e.g. ``EngineConfig`` in ``tidal/engine/config.py``).
  Its ``__post_init__`` validates the fields and raises :class:`ConfigError` naming the field.
- :func:`build` turns a nested plain dict (from YAML) into the dataclass tree, rejecting unknown
  keys and wrongly typed values with the full dotted key (``engine.tp_size``).
- Configs are never rewritten after construction; derived values are properties or computed by
  the component that needs them.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

T = TypeVar("T")

# Every number a config holds fits the machine type it ends up in: ints in int64 (seeds, sizes), floats
# finite; a float field named ``*_s`` is a duration in seconds, at most MAX_SECONDS (timers and
# timedeltas overflow on larger ones).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_SECONDS = 1e7


class ConfigError(ValueError):
    """A configuration value is invalid. ``key`` is the dotted path of the offending field."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"config error at '{key}': {message}")

    def prefixed(self, prefix: str) -> "ConfigError":
        return ConfigError(f"{prefix}.{self.key}" if prefix else self.key, self.message)


def check(condition: bool, key: str, message: str) -> None:
    """Raise ConfigError(key, message) unless ``condition`` holds."""
    if not condition:
        raise ConfigError(key, message)


def check_choice(value: Any, choices: typing.Iterable[Any], key: str) -> None:
    choices = list(choices)
    check(value in choices, key, f"{value!r} is not one of {choices}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` (dataclass, Optional, list, dict, Literal, scalars)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e.message)
        raise ConfigError(key, f"{value!r} matches none of {[_type_name(a) for a in args]}: {errors}")
    if origin is Literal:
        word = {True: "on", False: "off"}.get(value) if isinstance(value, bool) else None
        if word in get_args(tp):  # YAML 1.1 reads the words on/off as true/false
            value = word
        check_choice(value, get_args(tp), key)
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        check(isinstance(value, dict), key, f"expected a mapping for {tp.__name__}, got {value!r}")
        return build(tp, value, prefix=key)
    if origin in (list, tuple):
        check(isinstance(value, (list, tuple)), key, f"expected a list, got {value!r}")
        (item_tp, *_rest) = get_args(tp) or (Any,)
        items = [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        check(isinstance(value, dict), key, f"expected a mapping, got {value!r}")
        k_tp, v_tp = get_args(tp) or (Any, Any)
        return {_coerce(k, k_tp, key): _coerce(v, v_tp, f"{key}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(key, f"expected a number, got {value!r}") from None
        check(isinstance(value, (int, float)) and not isinstance(value, bool), key, f"expected a number, got {value!r}")
        try:
            out = float(value)
        except OverflowError:  # an int beyond float's range
            raise ConfigError(key, f"an integer of {len(str(value))} digits is beyond the range of a float") from None
        check(math.isfinite(out), key, f"expected a finite number, got {out}")
        if key.rpartition(".")[2].endswith("_s"):
            check(abs(out) <= MAX_SECONDS, key, f"{out:g} s is longer than any duration Tidal takes (at most {MAX_SECONDS:g} s)")
        return out
    if tp is int:
        check(isinstance(value, int) and not isinstance(value, bool), key, f"expected an integer, got {value!r}")
        check(INT64_MIN <= value <= INT64_MAX, key, f"{value} does not fit in a 64-bit integer")
        return value
    if tp is bool:
        check(isinstance(value, bool), key, f"expected true/false, got {value!r}")
        return value
    if tp is str:
        check(isinstance(value, str), key, f"expected a string, got {value!r}")
        return value
    return value


def build(cls: type[T], data: dict[str, Any] | None, prefix: str = "") -> T:
    """Construct dataclass ``cls`` from a nested dict, validating keys, types and values."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted((k for k in data if k not in fields), key=str)  # YAML keys may be ints, None, ...
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(key, f"unknown key; valid keys under '{prefix or '<root>'}' are {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _coerce(value, hints[name], key)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise e.prefixed(prefix) if prefix else e
    except TypeError as e:  # missing required field
        raise ConfigError(prefix or "<root>", str(e)) from None


def decode_utf8(data: bytes, what: str) -> str:
    """``data`` as UTF-8 text, or ValueError naming ``what`` (a file), the line, and the byte offset
    of the first invalid byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"{what}:{line}: not UTF-8 text: byte 0x{data[e.start]:02x} at column {column} "
                         f"(byte offset {e.start}): {e.reason}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a mapping that repeats a key is an error (plain YAML keeps the
    last one silently: a whole section written twice lost its first copy)."""

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        _check_unique_keys(node, "", self.name)
        return self.construct_document(node)


def _check_unique_keys(node: yaml.Node, prefix: str, what: str) -> None:
    """ConfigError at the dotted key of the first key a mapping of ``node`` repeats, naming both lines
    (``<<`` merges aside: a key given beside a merge overrides it, as YAML says)."""
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique_keys(item, f"{prefix}[{i}]", what)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    first: dict[Any, int] = {}
    for key_node, value_node in node.value:
        key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
        if key is None or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        dotted = f"{prefix}.{key}" if prefix else str(key)
        line = key_node.start_mark.line + 1
        if key in first:
            raise ConfigError(dotted, f"{what}:{line}: duplicate key '{key}' (first at line {first[key]}); YAML would "
                                      "silently keep only the last one: merge the two or remove one")
        first[key] = line
        _check_unique_keys(value_node, dotted, what)


def load_yaml(text: str, what: str) -> Any:
    """``yaml.safe_load(text)``, but a repeated mapping key is a ConfigError at its dotted key naming
    ``what`` (a file, or an override) and both lines. Every config Tidal reads goes through it."""
    loader = _UniqueKeyLoader(text)
    loader.name = what
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value`` (value parsed as YAML) into (["a","b","c"], value)."""
    if "=" not in text:
        raise ConfigError(text, "override must look like key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(key or text, "empty key in override")
    if raw == "":
        return key.split("."), ""
    try:
        return key.split("."), load_yaml(raw, f"override {key}=")
    except ConfigError as e:
        raise ConfigError(f"{key}.{e.key}", e.message) from None
    except yaml.YAMLError as e:
        raise ConfigError(key, f"value {raw!r:.80} is not valid YAML: {str(e).splitlines()[0]}") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``key.sub=value`` override set (creating mappings as needed)."""
    import copy

    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(".".join(path[: i + 1]), f"is a value ({child!r}), cannot set a sub-key")
            node = child
        node[path[-1]] = value
    return out


def to_dict(cfg: Any) -> Any:
    """The plain-dict form of a config tree (round-trips through :func:`build`)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg
