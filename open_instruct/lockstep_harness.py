"""T, the test's side of a lock-step test, run in the sandbox by a pair's test process (sandbox_boot.run_pair), which
never loads the program; standard library only (and numpy where the sandbox exposes it); the design:
docs/sandbox.md#the-unmodified-tests-verdict-issue-67-part-2-lock-step-stand-ins.
`SEALED` (set by the supervisor) is the test code, unmodified, that only this process holds. It runs as
Python runs it, in a namespace where every name the program defines (the names P sent first) stands for the
program's object: a function or class is a stand-in that forwards each call to P (lockstep_program.py) as tagged
data; plain values come back as exact built-in types, anything else as a handle (`Handle`) whose methods,
attributes, iteration and length are P's. A handle is never equal to (or ordered against) the test's own data: only
two handles are compared, by P. Mutable arguments are updated in place from P's copy after each call.

The verdict is this process's exit status, read by the sandbox's supervisor: 0 the test ran to its end; 1 an
AssertionError; 3 MemoryError; 4 the program does not compile; 2 anything else (the program could not load, a
call's exception the test did not catch, P gone or malformed answers).
"""

import ast
import builtins
import collections
import decimal
import fractions
import importlib
import json
import os
import sys
import traceback
import types

REQUESTS, ANSWERS = 4, 3
MAX_MESSAGE = 1 << 28
PASS, WRONG, CRASH, MEMORY, SYNTAX = 0, 1, 2, 3, 4


class ProgramGone(Exception):
    """P ended, or sent something that is not an answer: the test cannot go on."""


class NotPlain(TypeError):
    """The program answered with an object the test cannot take: not plain data, not an instance of a class the test
    names (looked up by name), not an iterator or an re.Match. A wrong answer, as on the value path: whatever such an
    object says (an __eq__ that always holds, a startswith that always does) would be the program's verdict."""


# standard-library objects a call may return besides plain data: iterated (their items are judged like any value),
# or, for a match, read through these methods and attributes only (none takes an expected value)
ITERATORS = frozenset(
    "generator map filter zip enumerate reversed list_iterator tuple_iterator range_iterator str_ascii_iterator "
    "str_iterator set_iterator dict_keyiterator dict_valueiterator dict_itemiterator chain islice count".split()
)
MATCH_ATTRIBUTES = frozenset("group groups groupdict span start end string pos endpos lastindex lastgroup".split())


def send(obj):
    data = json.dumps(obj).encode()
    data = b"%012d" % len(data) + data
    try:
        while data:
            data = data[os.write(REQUESTS, data) :]
    except OSError as e:
        raise ProgramGone(f"the program's process is gone ({e})") from None


def receive():
    def exact(n):
        buf = bytearray()
        while len(buf) < n:
            chunk = os.read(ANSWERS, min(n - len(buf), 1 << 20))
            if not chunk:
                raise ProgramGone("the program's process ended")
            buf += chunk
        return bytes(buf)

    head = exact(12)
    if not head.isdigit() or int(head) > MAX_MESSAGE:
        raise ProgramGone("a malformed answer")
    reply = json.loads(exact(int(head)))
    if not isinstance(reply, dict):
        raise ProgramGone("a malformed answer")
    return reply


_classes = {}  # P's class handle -> its stand-in here (one per class: isinstance works across calls)
_objects = {}  # P's handle -> its Handle here (the same object each time)
_named = set()  # class handles the test looked up by name (their instances may define `in` and `==`)


def _exception_base(names):
    for name in names:
        found = getattr(builtins, name, None)
        if isinstance(found, type) and issubclass(found, Exception) and name not in ("StopAsyncIteration",):
            return found
    return ProgramException


class ProgramException(Exception):
    """An exception of the program whose class derives from no built-in Exception (SystemExit, say)."""


class ProgramClass(type):
    """The metaclass of a stand-in for a class the program defines: calling it constructs the object in P."""

    def __call__(cls, *args, **kwargs):
        return call(cls._class_ref, args, kwargs)


class Handle:
    """An object of the program, kept in P."""

    __slots__ = ("_ref",)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        kind = type(self).__name__
        if isinstance(self, ProgramClass) or type(type(self)) is ProgramClass or kind not in ITERATORS | {"Match"}:
            return request({"op": "attr", "ref": self._ref, "name": name}, via="attr")
        if kind == "Match" and name in MATCH_ATTRIBUTES:
            return request({"op": "attr", "ref": self._ref, "name": name}, via="attr")
        raise NotPlain(f"the program's {kind} has no attribute {name!r} a test may use")

    def __call__(self, *args, **kwargs):
        return call(self._ref, args, kwargs)

    def _apply(self, fn, *args):
        return request({"op": "apply", "fn": fn, "args": [encode(self), *(encode(a) for a in args)]})

    def __len__(self):
        n = self._apply("len")
        if type(n) is not int:
            raise TypeError("len() of a program object is not an int")
        return n

    def __iter__(self):
        iterator = request({"op": "apply", "fn": "iter", "args": [encode(self)]}, via="attr")
        while True:
            try:
                yield request({"op": "apply", "fn": "next", "args": [encode(iterator)]})
            except StopIteration:
                return

    def __next__(self):
        return self._apply("next")

    def __getitem__(self, key):
        return self._apply("getitem", key)

    def __bool__(self):
        return self._apply("bool") is True

    def __str__(self):
        return str(self._apply("str"))

    def __repr__(self):
        return str(self._apply("repr"))

    def __hash__(self):
        value = self._apply("hash")
        if type(value) is not int:
            raise TypeError("hash of a program object is not an int")
        return value

    def _compare(self, other, fn):
        if not isinstance(other, Handle):
            return NotImplemented  # the program's object is never equal to the test's own data
        return self._apply(fn, other) is True

    def __eq__(self, other):
        return self._compare(other, "eq")

    def __ne__(self, other):
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    def __lt__(self, other):
        return self._compare(other, "lt")

    def __le__(self, other):
        return self._compare(other, "le")

    def __gt__(self, other):
        return self._compare(other, "gt")

    def __ge__(self, other):
        return self._compare(other, "ge")


def _contains(self, item):
    return self._apply("contains", item) is True


def stand_in_class(enc):
    """The stand-in for P's class `enc` (["K", handle, name, built-in exception bases, program-made bases])."""
    _, ref, name, exceptions, bases = enc
    if ref in _classes:
        return _classes[ref]
    if exceptions:
        cls = type(str(name), (_exception_base(exceptions),), {"_class_ref": ref})
    else:
        parents = tuple(stand_in_class(b) for b in bases if b[0] == "K") or (Handle,)
        cls = ProgramClass(str(name), parents, {"__slots__": (), "_class_ref": ref})
    _classes[ref] = cls
    return cls


def resolve(module, qualname):
    """A standard-library object by name, this process's own."""
    found = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


_foreign = {}
# Standard-library objects P may name that T uses as its own (`from collections import Counter` in the program, a
# math function returned): only from these modules, and never the builtins below. Anything else P names stays in P as
# a handle, so no name P sends can make this process exit, exec or open anything (os._exit, sys.exit, eval...).
OWN_MODULES = frozenset(
    "builtins math cmath fractions decimal numbers collections collections.abc itertools functools operator re string "
    "heapq bisect typing statistics datetime copy enum array textwrap unicodedata numpy".split()
)
NOT_OWN_BUILTINS = frozenset(
    "exit quit open exec eval compile __import__ input breakpoint help globals locals vars setattr delattr".split()
)


def may_resolve(module, qualname):
    if module not in OWN_MODULES or not isinstance(qualname, str) or qualname.startswith("_"):
        return False
    return not (module == "builtins" and qualname in NOT_OWN_BUILTINS)


def foreign_handle(ref, name, via):
    """A handle of an object P keeps (a generator, a match, a function of a module T does not take as its own)."""
    if ref in _objects:
        return _objects[ref]
    name = str(name) or "object"
    if via == "result" and name not in ITERATORS | {"Match"}:
        raise NotPlain(f"the program returned a {name}, which is not plain data")
    cls = _foreign.get(name) or _foreign.setdefault(name, type(name, (Handle,), {"__slots__": ()}))
    obj = object.__new__(cls)
    object.__setattr__(obj, "_ref", ref)
    _objects[ref] = obj
    return obj


_test_identifiers = set()  # every name and attribute name the test's source uses


def _named_class(cls):
    """Whether the test names this class of the program (or a base of it): looked up by name, or its name in the
    test's source (isinstance(x, Node) after x = make(3))."""
    return any(
        getattr(c, "_class_ref", None) in _named or (c.__name__ in _test_identifiers and "_class_ref" in c.__dict__)
        for c in cls.__mro__
    )


def decode(v, args=(), via="result"):
    """P's tagged value as this process's own. `via`: how it came: "global" (a name the program defines: its
    functions, classes and objects all stand in), "attr" (an attribute of a handle: bound methods too), "result" (a
    call's value: only plain data, instances of classes the test named, iterators and matches; else NotPlain)."""
    tag = v[0]
    if tag == "n":
        return None
    if tag == "b":
        return v[1] is True
    if tag == "i":
        return int(v[1], 16)
    if tag == "f":
        return float.fromhex(v[1])
    if tag == "c":
        return complex(float.fromhex(v[1][0]), float.fromhex(v[1][1]))
    if tag == "s":
        return str(v[1])
    if tag == "y":
        return bytes.fromhex(v[1])
    if tag == "Q":
        return fractions.Fraction(v[1])
    if tag == "D":
        return decimal.Decimal(v[1])
    if tag in ("l", "t", "S", "F", "q", "B"):
        items = [decode(e, via=via) for e in v[1]]
        kind = {"l": list, "t": tuple, "S": set, "F": frozenset, "q": collections.deque, "B": bytearray}[tag]
        return kind(items)
    if tag in ("d", "C", "E", "O"):
        pairs = [(decode(k, via=via), decode(e, via=via)) for k, e in v[1]]
        if tag == "E":
            return collections.defaultdict(None, pairs)
        if tag == "C":
            return collections.Counter(dict(pairs))
        return {"d": dict, "O": collections.OrderedDict}[tag](pairs)
    if tag == "a":  # an argument, or a part of one: the test's own object
        found = args[v[1]]
        for index in v[2:]:
            found = found[index]
        return found
    if tag == "m":
        if may_resolve(v[1], "module"):
            return importlib.import_module(v[1])
        return foreign_handle(v[2], "module", via)
    if tag == "r":
        if may_resolve(v[1], v[2]):
            try:
                return resolve(v[1], v[2])
            except (ImportError, AttributeError):
                pass
        return foreign_handle(v[3], str(v[2]).rsplit(".", 1)[-1], via)
    if tag == "K":
        return stand_in_class(v)
    if tag == "o":
        if v[1] in _objects:
            return _objects[v[1]]
        cls_enc = v[2]
        if cls_enc[0] == "K" and not cls_enc[3]:
            cls = stand_in_class(cls_enc)
            if via == "result" and not _named_class(cls):
                raise NotPlain(f"the program returned a {cls.__name__}, a class the test does not name")
            if _named_class(cls) and "__contains__" not in cls.__dict__:
                cls.__contains__ = _contains
        else:  # a standard-library class (a generator, a match, ...): a handle of that name, nothing more
            return foreign_handle(v[1], str(cls_enc[2]).rsplit(".", 1)[-1] if cls_enc[0] == "r" else "object", via)
        obj = object.__new__(cls)
        object.__setattr__(obj, "_ref", v[1])
        _objects[v[1]] = obj
        return obj
    raise ProgramGone(f"unknown tag {tag!r}")


def encode(x, depth=0):
    """The test's own values as tagged data (exact types), handles by reference."""
    if depth > 64:
        raise ValueError("nesting deeper than 64")
    t = type(x)
    if isinstance(x, Handle):
        return ["h", x._ref]
    if isinstance(x, type) and "_class_ref" in x.__dict__:
        return ["h", x._class_ref]
    if t is type(None):
        return ["n"]
    if t is bool:
        return ["b", x]
    if t is int:
        return ["i", format(x, "x")]
    if t is float:
        return ["f", x.hex()]
    if t is complex:
        return ["c", [x.real.hex(), x.imag.hex()]]
    if t is str:
        return ["s", x]
    if t is bytes:
        return ["y", x.hex()]
    if t is fractions.Fraction:
        return ["Q", str(x)]
    if t is decimal.Decimal:
        return ["D", str(x)]
    tags = {list: "l", tuple: "t", set: "S", frozenset: "F", collections.deque: "q", bytearray: "B"}
    if t in tags:
        return [tags[t], [encode(v, depth + 1) for v in x]]
    tags = {dict: "d", collections.Counter: "C", collections.defaultdict: "E", collections.OrderedDict: "O"}
    if t in tags:
        return [tags[t], [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()]]
    module, qualname = getattr(x, "__module__", None), getattr(x, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        try:
            if resolve(module, qualname) is x:
                return ["r", module, qualname]  # a standard-library function or class: P uses its own
        except Exception:
            pass
    raise TypeError(f"a {t.__name__} cannot be passed to the program's process")


def _raise(reply):
    names = [n for n in reply.get("raised", ()) if isinstance(n, str)]
    text = reply.get("text") if isinstance(reply.get("text"), str) else ""
    if "StopIteration" in names[:1]:
        raise StopIteration
    if names[:1] == ["MemoryError"]:
        raise MemoryError(text)
    cls_enc = reply.get("cls")
    cls = stand_in_class(cls_enc) if isinstance(cls_enc, list) and cls_enc[:1] == ["K"] else None
    if cls is None or not issubclass(cls, BaseException):
        cls = _exception_base(names)
    raise cls(text)


def request(message, via="result"):
    send(message)
    reply = receive()
    if "raised" in reply:
        _raise(reply)
    if "v" not in reply:
        raise ProgramGone("a malformed answer")
    return decode(reply["v"], via=via)


def _update(target, state):
    """Apply P's copy of a mutable argument, after the call, to the test's own object in place."""
    value = decode(state)
    if type(value) is not type(target) or value == target:
        return  # (unchanged: the test's inner objects keep their identity)
    if isinstance(target, (list, bytearray)):
        target[:] = value
    elif isinstance(target, (dict, set, collections.deque)):
        target.clear()
        target.update(value) if not isinstance(target, collections.deque) else target.extend(value)


def call(ref, args, kwargs):
    send(
        {
            "op": "call",
            "ref": ref,
            "args": [encode(a) for a in args],
            "kwargs": [[k, encode(v)] for k, v in kwargs.items()],
        }
    )
    reply = receive()
    if "raised" in reply:
        _raise(reply)
    if "v" not in reply:
        raise ProgramGone("a malformed answer")
    for target, state in zip(args, reply.get("after") or ()):
        if state is not None:
            _update(target, state)
    for key, state in reply.get("after_kw") or ():
        if key in kwargs:
            _update(kwargs[key], state)
    return decode(reply["v"], args)


def _builtin_first(builtin, program):
    """A built-in function's name that the program defines too (`sum`, `isinstance`): the built-in's answer where it
    takes these arguments (so a program's `isinstance = lambda *a: True` decides nothing), else the program's
    function (`sum(10, 15)`: MBPP's tasks name functions like builtins)."""

    def either(*args, **kwargs):
        try:
            return builtin(*args, **kwargs)
        except TypeError:
            return program()(*args, **kwargs)

    either.__name__ = builtin.__name__
    return either


class ProgramNames(dict):
    """The test's globals: its own names first; a name the program defines is looked up in P when the test reads it
    (a function or class once, a value each time: the program's globals as they are now)."""

    def __init__(self, names):
        super().__init__()
        self._names = frozenset(names)
        self._fixed = {}

    def __missing__(self, name):
        if name not in self._names:
            raise KeyError(name)
        if name in self._fixed:
            return self._fixed[name]
        builtin = getattr(builtins, name, None)
        if isinstance(builtin, type) or (builtin is not None and not callable(builtin)):
            raise KeyError(name)  # a built-in class or constant the program rebinds: the test's stays
        if builtin is not None:  # a built-in function the program rebinds: the builtin where it applies (below)
            self._fixed[name] = _builtin_first(builtin, lambda: request({"op": "global", "name": name}, via="global"))
            return self._fixed[name]
        reply_value = request({"op": "global", "name": name}, via="global")
        if isinstance(reply_value, ProgramClass):
            _named.add(reply_value._class_ref)
        if isinstance(reply_value, (type, Handle)) or callable(reply_value):
            self._fixed[name] = reply_value
        return reply_value


def _pytest_module():
    """`pytest.raises` for tests that use it (pytest is not in the sandbox's interpreter)."""
    module = types.ModuleType("pytest")

    class raises:
        def __init__(self, expected, match=None):
            self.expected, self.match = expected, match

        def __enter__(self):
            return self

        def __exit__(self, kind, value, tb):
            if kind is None:
                raise AssertionError(f"DID NOT RAISE {self.expected}")
            if not issubclass(kind, self.expected):
                return False
            if self.match is not None:
                import re

                assert re.search(self.match, str(value)), f"{str(value)!r} does not match {self.match!r}"
            return True

    module.raises = raises
    return module


def main(source):
    code = compile(source, "test", "exec")  # the test is ground truth: it compiles (checked before the run)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            _test_identifiers.add(node.id)
        elif isinstance(node, ast.Attribute):
            _test_identifiers.add(node.attr)
    first = receive()
    if "syntax_error" in first:
        return SYNTAX
    if "load" in first:
        print("the program raised while loading:", first["load"].get("raised"), file=sys.stderr)
        return MEMORY if first["load"].get("raised", [None])[:1] == ["MemoryError"] else CRASH
    names = first.get("names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return CRASH
    sys.modules.setdefault("pytest", _pytest_module())
    namespace = ProgramNames(names)
    namespace.update({"__name__": "__main__", "__builtins__": builtins})
    try:
        exec(code, namespace)
    except (AssertionError, NotPlain):
        traceback.print_exc(limit=-3)
        return WRONG
    except MemoryError:
        return MEMORY
    except BaseException:
        traceback.print_exc(limit=-3)
        return CRASH
    return PASS


def run(source):
    try:
        status = main(source)
    except BaseException:
        traceback.print_exc(limit=-3)
        status = CRASH
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


if __name__ == "__main__":
    run(SEALED)  # noqa: F821 - given by the supervisor (sandbox_boot.run_pair)
