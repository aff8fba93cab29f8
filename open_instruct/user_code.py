"""Loading the user's own code named in a config: `module:name` (an importable module, or `pkg/mod.py` under the
current folder) or `path/to/file.py:name`. Reward functions, environments, advantage estimators, policy losses and
KL estimators are all named this way; a bad name, a missing file or a module that fails to import is a ConfigError
(exit 2) naming the spec, before any model loads (`rewards.call_with_deadline` runs it under a deadline).
Imports nothing heavy."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import typing
from typing import Any, Callable, Optional, Sequence

from open_instruct.errors import ConfigError


def is_spec(value: Any) -> bool:
    """`something:name` with an identifier after the last colon (a registered name never has a colon)."""
    if not isinstance(value, str):
        return False
    module, sep, name = value.rpartition(":")
    return bool(sep and module and name.isidentifier())


def module_name_of_file(path: str) -> str:
    """The module name a user's .py file is loaded under: from its absolute path, lower case (verifiers.v1 imports a
    taskset by its id lower-cased, so a folder with capitals in its path must not change the name), with a digest of
    the exact path so that two files differing only in case stay two modules."""
    where = os.path.abspath(path)
    digest = hashlib.sha256(where.encode()).hexdigest()[:12]
    return "open_instruct_user_" + re.sub(r"\W", "_", where).lower() + "_" + digest


def load_module(module: str, what: str) -> Any:
    """A module by dotted name, or a .py file by path (also `pkg.mod` found as pkg/mod.py under the current folder:
    the scripts run with their own folder, not the current one, on sys.path). A file is loaded once per process
    (under a name derived from its absolute path), so its registrations run once."""
    path = module if module.endswith(".py") else module.replace(".", os.sep) + ".py"
    try:
        if module.endswith(".py") or (not importlib.util.find_spec(module.split(".")[0]) and os.path.isfile(path)):
            if not os.path.isfile(path):
                raise ConfigError(f"{what}: file {path!r} does not exist")
            name = module_name_of_file(path)
            if name in sys.modules:
                return sys.modules[name]
            loader_spec = importlib.util.spec_from_file_location(name, path)
            loaded = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = loaded  # dataclasses and pickling look the module up by name
            try:
                loader_spec.loader.exec_module(loaded)
            except BaseException:
                del sys.modules[name]
                raise
            return loaded
        return importlib.import_module(module)
    except ConfigError:
        raise
    except Exception as e:  # the user's module failed to import (ImportError, SyntaxError, its own errors)
        raise ConfigError(f"{what}: importing {module!r} failed: {type(e).__name__}: {e}") from None


def spec_file(spec: str) -> Optional[str]:
    """The absolute path of the file a `module:name` / `path/file.py:name` spec loads (as load_module finds it), or
    None when there is none to read (not a spec, or a module without a source file)."""
    if not is_spec(spec):
        return None
    module = spec.rpartition(":")[0]
    path = module if module.endswith(".py") else module.replace(".", os.sep) + ".py"
    try:
        found = None if module.endswith(".py") else importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is not None and found.origin and os.path.isfile(found.origin):
        return os.path.abspath(found.origin)
    return os.path.abspath(path) if os.path.isfile(path) else None


def load_object(spec: str, what: str, example: str, noun: str = "function") -> Any:
    """The object a `module:name` / `path/file.py:name` spec names (`what` names the option in messages, `example`
    shows a right spec, `noun` says what the name is: function, Class)."""
    module, sep, name = spec.rpartition(":")
    if not sep or not module or not name.isidentifier():
        raise ConfigError(f"{what} {spec!r} must be module:{noun} or path/to/file.py:{noun} (e.g. {example})")
    loaded = load_module(module, f"{what} {spec!r}")
    if not hasattr(loaded, name):
        found = sorted(k for k, v in vars(loaded).items() if callable(v) and not k.startswith("_"))
        raise ConfigError(f"{what} {spec!r}: {module!r} has no {noun.lower()} {name!r} (it has {found})")
    return getattr(loaded, name)


def check_signature(
    function: Callable[..., Any], what: str, positional: Sequence[str], returns: str, keywords: Sequence[str] = ()
) -> None:
    """ConfigError (exit 2) unless `function` can be called as the run calls it: with the `positional` arguments in
    that order (and the run settings its row names, `keywords`), and every other parameter optional (the algo_kwargs
    it takes are keyword arguments with defaults). `what` names the option and the spec; `returns` completes the
    expected signature in the message. The one place that knows the variants' calling contract."""
    expected = f"({', '.join(positional)}, **algo_kwargs) -> {returns}"
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # a builtin or C function without a readable signature: its first call says what is wrong
    try:
        signature.bind(*positional, **dict.fromkeys(keywords))
    except TypeError as e:
        name = getattr(function, "__qualname__", repr(function))
        raise ConfigError(
            f"{what}: function {name}{signature} cannot be called as {expected} ({e}); every parameter after the "
            f"first {len(positional)} needs a default"
        ) from None


def _expected_type(parameter: inspect.Parameter, hints: dict[str, Any]) -> Optional[tuple[type, ...]]:
    """The scalar type(s) a keyword parameter's annotation or default says it takes (None: not known)."""
    hint = hints.get(parameter.name)
    if hint in (bool, int, float, str):
        kind: Any = hint
    elif parameter.default is not inspect.Parameter.empty and type(parameter.default) in (bool, int, float, str):
        kind = type(parameter.default)
    else:
        return None
    return {float: (int, float), int: (int,), bool: (bool,), str: (str,)}[kind]


def check_keyword_types(function: Callable[..., Any], kwargs: dict[str, Any], what: str) -> None:
    """ConfigError (exit 2) when a value in `kwargs` is not of the type the function's parameter of that name takes,
    as its annotation (bool, int, float, str) or else its default's type says: `margin=abc` for `margin=0.0`."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # an annotation that does not resolve: fall back on the defaults
        hints = {}
    name = getattr(function, "__qualname__", repr(function))
    for key, value in kwargs.items():
        parameter = parameters.get(key)
        expected = _expected_type(parameter, hints) if parameter is not None else None
        if expected is None:
            continue
        if isinstance(value, bool) and bool not in expected or not isinstance(value, expected):
            wanted = " or ".join(t.__name__ for t in expected)
            raise ConfigError(
                f"{what}: algo_kwargs {key}={value!r} is a {type(value).__name__}, but {name}'s parameter {key} takes "
                f"{wanted} (its {'annotation' if key in hints else 'default ' + repr(parameter.default)})"
            )
