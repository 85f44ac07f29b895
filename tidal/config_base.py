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
import reprlib
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
    check(value in choices, key, f"{show(value)} is not one of {choices}")


_SHOW = reprlib.Repr()
for _limit, _value in {"maxlevel": 3, "maxstring": 80, "maxother": 80, "maxlong": 40}.items():  # reprlib's knobs
    setattr(_SHOW, _limit, _value)


def show(value: Any) -> str:
    """``repr(value)`` cut to about 100 characters, in bounded work: an error message names the
    value it rejects without printing (or walking) a whole list, an alias expansion or a huge integer."""
    if value is None or isinstance(value, (bool, float)) or (isinstance(value, str) and len(value) <= 80) or (
            isinstance(value, int) and abs(value) < 10**40):
        return repr(value)  # the common case, at builtin speed (messages are built before a check knows it fails)
    try:
        return _SHOW.repr(value)
    except ValueError:  # an integer beyond int->str's digit limit
        return f"<integer of {value.bit_length()} bits>"


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
        raise ConfigError(key, f"{show(value)} matches none of {[_type_name(a) for a in args]}: {errors}")
    if origin is Literal:
        word = {True: "on", False: "off"}.get(value) if isinstance(value, bool) else None
        if word in get_args(tp):  # YAML 1.1 reads the words on/off as true/false
            value = word
        check_choice(value, get_args(tp), key)
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        check(isinstance(value, dict), key, f"expected a mapping for {tp.__name__}, got {show(value)}")
        return build(tp, value, prefix=key)
    if origin in (list, tuple):
        check(isinstance(value, (list, tuple)), key, f"expected a list, got {show(value)}")
        (item_tp, *_rest) = get_args(tp) or (Any,)
        items = [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        check(isinstance(value, dict), key, f"expected a mapping, got {show(value)}")
        k_tp, v_tp = get_args(tp) or (Any, Any)
        return {_coerce(k, k_tp, key): _coerce(v, v_tp, f"{key}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(key, f"expected a number, got {show(value)}") from None
        check(isinstance(value, (int, float)) and not isinstance(value, bool), key, f"expected a number, got {show(value)}")
        try:
            out = float(value)
        except OverflowError:  # an int beyond float's range
            raise ConfigError(key, f"an integer of {len(str(value))} digits is beyond the range of a float") from None
        check(math.isfinite(out), key, f"expected a finite number, got {out}")
        if key.rpartition(".")[2].endswith("_s"):
            check(abs(out) <= MAX_SECONDS, key, f"{out:g} s is longer than any duration Tidal takes (at most {MAX_SECONDS:g} s)")
        return out
    if tp is int:
        check(isinstance(value, int) and not isinstance(value, bool), key, f"expected an integer, got {show(value)}")
        check(INT64_MIN <= value <= INT64_MAX, key, f"{show(value)} does not fit in a 64-bit integer")
        return value
    if tp is bool:
        check(isinstance(value, bool), key, f"expected true/false, got {show(value)}")
        return value
    if tp is str:
        check(isinstance(value, str), key, f"expected a string, got {show(value)}")
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


# Bounds on a config document's shape. A config is a small tree: a few hundred values, nested a
# few levels. Aliases may share a value between places, but a document whose aliases add more than
# MAX_ALIAS_VALUES values to it (a "billion laughs" bomb: nine levels of nine aliases are 387 million
# values from 400 bytes) or that nests deeper than MAX_DEPTH is refused before anything walks it.
MAX_ALIAS_VALUES = 100_000
MAX_DEPTH = 100


class _CheckedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but the composed document is checked before it is constructed:
    a mapping that repeats a key is an error (plain YAML keeps the last one silently: a whole section
    written twice lost its first copy), and so are a recursive alias, an alias bomb and deep nesting."""

    def fetch_flow_collection_start(self, TokenClass):
        """The scanner's work grows with the square of the flow nesting (``[[[[...``: 3,000 levels
        take 10 s to scan): refuse past MAX_DEPTH levels as it reads them."""
        super().fetch_flow_collection_start(TokenClass)
        if self.flow_level > MAX_DEPTH:
            raise ConfigError("", f"{self.name}:{self.line + 1}: values nest more than {MAX_DEPTH} levels deep; "
                                  "a config nests a few")

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        _check_tree(node, self.name)
        return self.construct_document(node)


def _children(node: yaml.Node) -> list[tuple[yaml.Node, str | None]]:
    """(child, its key below ``node`` or None for a mapping's key node) of a composed node."""
    if isinstance(node, yaml.SequenceNode):
        return [(item, f"[{i}]") for i, item in enumerate(node.value)]
    if isinstance(node, yaml.MappingNode):
        out: list[tuple[yaml.Node, str | None]] = []
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
            out += [(key_node, None), (value_node, str(key))]
        return out
    return []


def _check_keys(node: yaml.MappingNode, prefix: str, what: str) -> None:
    """ConfigError at the dotted key of the first key ``node`` repeats, naming both lines (``<<``
    merges aside: a key given beside a merge overrides it, as YAML says)."""
    first: dict[Any, int] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key, line = key_node.value, key_node.start_mark.line + 1
        if key in first:
            raise ConfigError(_join(prefix, key), f"{what}:{line}: duplicate key '{key}' (first at line {first[key]}); "
                                                  "YAML would silently keep only the last one: merge the two or remove one")
        first[key] = line


def _join(prefix: str, key: str) -> str:
    """``prefix.key`` (``prefix[i]`` for an item; the other one where either is empty)."""
    return f"{prefix}{key}" if not prefix or not key or key.startswith("[") else f"{prefix}.{key}"


def _check_tree(root: yaml.Node, what: str) -> None:
    """Walk the composed document once per node (an alias is a second reference to a node already
    walked, never a second walk), in work bounded by the document's size, not by its expansion:
    ConfigError at the dotted key of a repeated mapping key, of an alias inside the node it names
    (a recursive structure), of a value nested deeper than MAX_DEPTH, or of a value whose aliases
    expand it by more than MAX_ALIAS_VALUES values."""
    expanded: dict[int, int] = {}  # id(node) -> values it stands for, once walked
    on_path: set[int] = set()  # nodes being walked: the ancestors of the current one
    walked = 0
    stack: list[tuple[yaml.Node, str, int, bool]] = [(root, "", 0, False)]
    while stack:
        node, key, depth, leaving = stack.pop()
        if isinstance(node, yaml.ScalarNode):  # a leaf: one value, nothing below it
            walked += id(node) not in expanded
            expanded[id(node)] = 1
            continue
        line = node.start_mark.line + 1
        if leaving:
            on_path.discard(id(node))
            expanded[id(node)] = 1 + sum(expanded[id(child)] for child, _ in _children(node))
            if expanded[id(node)] > walked + MAX_ALIAS_VALUES:
                raise ConfigError(key, f"{what}:{line}: aliases expand this value to {expanded[id(node)]:,} values "
                                  f"from {walked:,} written; a config takes at most {MAX_ALIAS_VALUES:,} values added "
                                  "by aliases (an alias bomb?)")
            continue
        if id(node) in expanded:
            continue
        if id(node) in on_path:
            raise ConfigError(key, f"{what}:{line}: an alias to the value anchored at line {line} "
                                  "sits inside that value (a recursive structure); a config must be a tree: copy the value instead")
        if depth > MAX_DEPTH:
            raise ConfigError(key, f"{what}:{line}: values nest more than {MAX_DEPTH} levels deep; "
                                               "a config nests a few")
        on_path.add(id(node))
        walked += 1
        if isinstance(node, yaml.MappingNode):
            _check_keys(node, key, what)
        stack.append((node, key, depth, True))
        stack += [(child, key if name is None else _join(key, name), depth + 1, False)
                  for child, name in reversed(_children(node))]


def load_yaml(text: str, what: str) -> Any:
    """``yaml.safe_load(text)``, checked by :func:`_check_tree` (repeated keys, recursive aliases,
    alias bombs, deep nesting) before it is constructed: a ConfigError at the dotted key naming
    ``what`` (a file, or an override) and the line. Every config Tidal reads goes through it."""
    loader = _CheckedLoader(text)
    loader.name = what
    try:
        return loader.get_single_data()
    except RecursionError:  # the composer recurses per nesting level, before the check sees the tree
        raise ConfigError("", f"{what}: values nest deeper than the YAML parser can follow; a config nests a few "
                              "levels") from None
    except ConfigError:
        raise
    except ValueError as e:  # an integer of more digits than Python converts, ...
        raise ConfigError("", f"{what}: {str(e).splitlines()[0].split('; use sys.')[0]}") from None
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
        raise ConfigError(_join(key, e.key), e.message) from None
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
                raise ConfigError(".".join(path[: i + 1]), f"is a value ({show(child)}), cannot set a sub-key")
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
