"""Option dataclasses: one per component, typed fields with help text, validated from their types.

A component's options (:class:`forkrl.core.train.TreeOptions`,
:class:`forkrl.core.speculative.SpeculativeOptions`) are a dataclass whose fields carry
``metadata={"help": ...}`` and a type that says what is valid: ``bool``, ``int``, ``float``, a
``Literal`` of the allowed values, or any of these ``| None``; a class may add lower bounds in
``_minimums``. The metadata holds argparse keywords only, so transformers' ``HfArgumentParser``
(and TRL's ``TrlParser``) parse a host config that inherits these fields unchanged.

Hosts derive their flags from these classes: TRL's configs inherit them, and :func:`add_arguments`
builds argparse flags (OpenRLHF's dotted ``--forkrl.tree_packing`` style) from the same fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args, get_origin, get_type_hints

__all__ = [
    "OptionDoc",
    "add_arguments",
    "changed_fields",
    "check_fields",
    "field_defaults",
    "format_value",
    "from_namespace",
    "markdown_table",
    "option",
    "option_docs",
]


def option(default: Any, help: str) -> Any:
    """A dataclass field with its help text (the only metadata: argparse parses it as given)."""
    return dataclasses.field(default=default, metadata={"help": help})


def field_defaults(cls: type) -> dict[str, Any]:
    """``{name: default}`` of the fields ``cls`` itself declares (not those it inherits)."""
    own = cls.__dict__.get("__annotations__", {})
    return {f.name: f.default for f in dataclasses.fields(cls) if f.name in own}


def changed_fields(obj: Any, cls: type) -> list[str]:
    """Names of ``cls``'s own fields whose value on ``obj`` differs from the default."""
    return [name for name, default in field_defaults(cls).items() if getattr(obj, name) != default]


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """``(X, True)`` for ``X | None``, ``(tp, False)`` otherwise (only single-type optionals are used)."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"option type {tp} is not supported: use one type, optionally | None")
        return args[0], len(args) < len(get_args(tp))
    return tp, False


def _same_kind(value: Any, allowed: Any) -> bool:
    """``True == 1`` and ``32.0 == 32`` in Python; an option value must also be of the allowed kind."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return isinstance(value, bool) and isinstance(allowed, bool)
    if isinstance(allowed, int):
        return isinstance(value, numbers.Integral)
    return isinstance(value, type(allowed))


def _type_error(name: str, value: Any, base: Any) -> str | None:
    """Why ``value`` is not of option type ``base`` (None when it is)."""
    if get_origin(base) is Literal:
        allowed = get_args(base)
        ok = any(_same_kind(value, a) and value == a for a in allowed)
        return None if ok else f"{name}={value!r} is not one of {allowed}"
    if base is bool:
        return None if isinstance(value, bool) else f"{name} must be True or False, got {value!r}"
    if base is int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        return f"{name}={value!r} must be an integer (got {type(value).__name__})"
    if base is float and (
        isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
    ):
        return f"{name}={value!r} must be a finite number"
    return None


def _check_value(name: str, value: Any, tp: Any, minimum: float | None) -> None:
    base, optional = _split_optional(tp)
    if value is None:
        if optional:
            return
        raise ValueError(
            f"{name}=None is not allowed: give a value of type {getattr(base, '__name__', base)}"
        )
    problem = _type_error(name, value, base)
    if problem is None and minimum is not None and value < minimum:
        problem = f"{name}={value!r} must be >= {minimum}"
    if problem is not None:
        raise ValueError(problem)


def check_fields(obj: Any, cls: type) -> None:
    """Validate every field ``cls`` declares, on ``obj``, against its type and ``cls._minimums``.

    Raises:
        ValueError: naming the field, the value and the rule.
    """
    hints = get_type_hints(cls)
    minimums = cls.__dict__.get("_minimums", {})
    for name in field_defaults(cls):
        _check_value(name, getattr(obj, name), hints[name], minimums.get(name))


def _parser_type(tp: Any):
    base, _ = _split_optional(tp)
    if get_origin(base) is Literal:
        allowed = get_args(base)
        return type(allowed[0]), list(allowed)
    return base, None


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


@dataclasses.dataclass(frozen=True)
class OptionDoc:
    """One option as a host documents it: its name, default, allowed values and help text."""

    name: str
    default: Any
    choices: tuple[Any, ...] | None
    help: str


def option_docs(
    cls: type, only: Sequence[str] | None = None, overrides: Mapping[str, Mapping[str, Any]] | None = None
) -> list[OptionDoc]:
    """The fields of ``cls`` as documented options, in declaration order.

    Args:
        only: the field names a host takes, in the order it lists them (None: all, in declaration order).
        overrides: per field, a host's ``default``, ``choices`` or ``help`` in place of the class's
            (OpenRLHF's launcher takes only ``speculative_policy='always'``, for example).
    """
    hints = get_type_hints(cls)
    overrides = overrides or {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = (set(overrides) | set(only or ())) - set(fields)
    if unknown:
        raise ValueError(f"{cls.__name__} has no fields {sorted(unknown)} (named in only= or overrides=)")
    docs = []
    for f in fields.values() if only is None else (fields[name] for name in only):
        _, choices = _parser_type(hints[f.name])
        doc = {
            "default": f.default,
            "choices": tuple(choices) if choices else None,
            "help": f.metadata["help"],
        }
        doc.update(overrides.get(f.name, {}))
        docs.append(OptionDoc(f.name, doc["default"], doc["choices"], doc["help"]))
    return docs


def format_value(value: Any, style: str) -> str:
    """``value`` as a host's users write it: ``python`` (``None``, ``'auto'``), ``yaml`` (``null``,
    ``auto``) or ``flag`` (``(unset)``, ``auto``)."""
    if style == "python":
        return repr(value)
    words = {
        "yaml": {True: "true", False: "false", None: "null"},
        "flag": {True: "on", False: "off", None: "(unset)"},
    }
    if isinstance(value, bool) or value is None:
        return words[style][value]
    return str(value)


def markdown_table(docs: Sequence[OptionDoc], key: str = "{name}", style: str = "python") -> str:
    """A Markdown table of ``docs``: key (``key`` formatted with the name), default, meaning.

    ``style`` writes values as the host's users write them (:func:`format_value`).
    """
    lines = ["| Option | Default | Meaning |", "|---|---|---|"]
    for doc in docs:
        allowed = ""
        if doc.choices is not None:
            allowed = " Allowed: " + ", ".join(f"`{format_value(c, style)}`" for c in doc.choices) + "."
        meaning = (doc.help + allowed).replace("|", "\\|")
        lines.append(f"| `{key.format(name=doc.name)}` | `{format_value(doc.default, style)}` | {meaning} |")
    return "\n".join(lines)


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    prefix: str = "--",
    only: Sequence[str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[str]:
    """Add one flag per field of ``cls`` to ``parser`` (``prefix + name``); returns the destinations.

    Booleans take an optional value (``--x``, ``--x true``, ``--x false``). Values are validated
    by :func:`check_fields` after parsing (:func:`from_namespace`), with the same messages as the
    dataclass itself. ``only`` and ``overrides`` as in :func:`option_docs` (the help, choices and
    defaults argparse shows are the documented ones).
    """
    hints = get_type_hints(cls)
    group = parser.add_argument_group(f"{cls.__name__} ({cls.__module__})")
    dests = []
    for doc in option_docs(cls, only, overrides):
        kind, _ = _parser_type(hints[doc.name])
        dest = (prefix.lstrip("-") + doc.name).replace("-", "_")
        kwargs: dict[str, Any] = {"dest": dest, "default": doc.default, "help": doc.help}
        if kind is bool:
            kwargs.update(nargs="?", const=True, type=_parse_bool, metavar="true|false")
        else:
            metavar = None if doc.choices else {int: "N", float: "X"}.get(kind)
            kwargs.update(type=kind, choices=list(doc.choices) if doc.choices else None, metavar=metavar)
        group.add_argument(prefix + doc.name, **kwargs)
        dests.append(dest)
    return dests


def from_namespace(cls: type, namespace: Any, prefix: str = "") -> Any:
    """An instance of ``cls`` from attributes ``prefix + name`` of ``namespace`` (validated)."""
    values = {
        f.name: getattr(namespace, prefix + f.name)
        for f in dataclasses.fields(cls)
        if hasattr(namespace, prefix + f.name)
    }
    return cls(**values)
