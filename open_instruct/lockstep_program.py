"""P, the program's side of a lock-step test, run in the sandbox as __main__ of a pair's program process
(sandbox_boot.run_pair), standard library only; the design:
docs/sandbox.md#the-unmodified-tests-verdict-issue-67-part-2-lock-step-stand-ins.
It loads solution.py, then answers the test process T, which never loads the program and never shows P the test: P
gets only the names the test looks up, the calls it makes and their arguments (what the program's functions receive
in the original harness too).

Messages both ways: a 12-digit length, then that many bytes of JSON. Values are tagged data (exact built-in and
standard-library types, see `encode`); whatever else the program hands out stays here and goes over as a handle
(its id and its class), on which T can call methods, read attributes, iterate. P's first message is the names the
program defines ({"names": [...]}), or why it could not load ({"syntax_error": 1} / {"raised": ...}). Requests:
    {"op": "global", "name": n}                      the program's global n now
    {"op": "call", "ref": h, "args": [...], "kwargs": [[k, v], ...]}
                                                     answer {"v": value, "after": [...]}: the value, and the mutable
                                                     arguments as they are after the call (T applies them in place)
    {"op": "attr", "ref": h, "name": n}              getattr(handle, n)
    {"op": "apply", "fn": f, "args": [...]}          len, iter, next, bool, str, repr, hash, getitem, contains, eq,
                                                     ne, lt, le, gt, ge on handles (T sends only handle pairs to
                                                     the comparisons)
An exception becomes {"raised": [built-in exception names of its class's MRO], "cls": its class, "text": str(e)}.
Every reference below was taken before the program ran: a program that patches them changes only its own answers.
"""

import builtins
import collections
import decimal
import fractions
import importlib
import json
import operator
import os
import sys

_type, _id, _isinstance, _len, _int_format, _float_hex = type, id, isinstance, len, int.__format__, float.hex
_str, _int, _float, _bool, _bytes, _complex, _list, _tuple = str, int, float, bool, bytes, complex, list, tuple
_set, _frozenset, _dict, _NoneType, _bytearray = set, frozenset, dict, type(None), bytearray
_Counter, _deque, _OrderedDict, _defaultdict = (
    collections.Counter,
    collections.deque,
    collections.OrderedDict,
    collections.defaultdict,
)
_Fraction, _Decimal = fractions.Fraction, decimal.Decimal
_fraction_text, _decimal_text = fractions.Fraction.__str__, decimal.Decimal.__str__
_dumps, _loads, _read, _write, _exit = json.dumps, json.loads, os.read, os.write, os._exit
_getattr, _mro, _callable = getattr, type.__dict__["__mro__"].__get__, callable
_import, _modules, _ModuleType = importlib.import_module, sys.modules, type(sys)
_dict_items, _list_of = dict.items, list
_exceptions = {
    _id(c): c.__name__ for c in vars(builtins).values() if _isinstance(c, type) and issubclass(c, BaseException)
}
_APPLY = {
    "len": len,
    "iter": iter,
    "next": next,
    "bool": bool,
    "str": str,
    "repr": repr,
    "hash": hash,
    "getitem": operator.getitem,
    "contains": operator.contains,
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
}
_MUTABLE = (_list, _dict, _set, _bytearray, _deque, _Counter, _OrderedDict, _defaultdict)
MAX_DEPTH = 64

_in = _out = -1  # T's requests and P's answers (main)
_handles: dict = {}


def send(obj):
    data = _dumps(obj).encode()
    data = b"%012d" % _len(data) + data
    while data:
        data = data[_write(_out, data) :]


def receive():
    def exact(n):
        buf = bytearray()
        while _len(buf) < n:
            chunk = _read(_in, n - _len(buf))
            if not chunk:
                _exit(0)  # T is done (or gone): nothing more to answer
            buf += chunk
        return bytes(buf)

    return _loads(exact(_int(exact(12))))


def handle(x):
    key = _id(x)
    _handles[key] = x
    return key


def encode_class(c, depth=0):
    """A class: a reference to a standard-library one (T uses its own), else a class the program made (a handle,
    its name, the built-in exception classes it derives from, and its program-made bases)."""
    module, qualname = _getattr(c, "__module__", None), _getattr(c, "__qualname__", None)
    if _type(module) is _str and module != "__main__" and _type(qualname) is _str:
        return ["r", module, qualname, handle(c)]
    name = _getattr(c, "__name__", "?")
    bases = []
    if depth < 8:
        for base in _getattr(c, "__bases__", ()):
            if _getattr(base, "__module__", None) == "__main__":
                bases.append(encode_class(base, depth + 1))
    exceptions = [_exceptions[_id(k)] for k in _mro(c) if _id(k) in _exceptions]
    return ["K", handle(c), name if _type(name) is _str else "?", exceptions, bases]


def encode(x, depth=0):
    if depth > MAX_DEPTH:
        raise ValueError("nesting deeper than 64")
    t = _type(x)
    if t is _NoneType:
        return ["n"]
    if t is _bool:
        return ["b", x is True]
    if t is _int:
        return ["i", _int_format(x, "x")]
    if t is _float:
        return ["f", _float_hex(x)]
    if t is _complex:
        return ["c", [_float_hex(x.real), _float_hex(x.imag)]]
    if t is _str:
        return ["s", x]
    if t is _bytes:
        return ["y", x.hex()]
    if t is _Fraction:
        return ["Q", _fraction_text(x)]
    if t is _Decimal:
        return ["D", _decimal_text(x)]
    if t is _list or t is _tuple or t is _set or t is _frozenset or t is _deque or t is _bytearray:
        tag = {_list: "l", _tuple: "t", _set: "S", _frozenset: "F", _deque: "q", _bytearray: "B"}[t]
        return [tag, [encode(v, depth + 1) for v in _list_of(x)]]
    if t is _dict or t is _Counter or t is _defaultdict or t is _OrderedDict:
        tag = {_dict: "d", _Counter: "C", _defaultdict: "E", _OrderedDict: "O"}[t]
        return [tag, [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in _dict_items(x)]]
    if t is _ModuleType:
        return ["m", x.__name__ if _type(x.__name__) is _str else "?", handle(x)]
    if _isinstance(x, type):
        return encode_class(x)
    if _callable(x) and _getattr(x, "__module__", "__main__") not in ("__main__", None):
        module, qualname = x.__module__, _getattr(x, "__qualname__", None)
        if _type(module) is _str and _type(qualname) is _str and "<" not in qualname:
            return ["r", module, qualname, handle(x)]  # a standard-library function: T uses its own, if it may
    return ["o", handle(x), encode_class(t)]


def decode(v):
    tag = v[0]
    if tag == "h":
        return _handles[v[1]]
    if tag == "r":  # one of T's own standard-library objects, by name: this process's own
        found = _import(v[1])
        for part in v[2].split("."):
            found = _getattr(found, part)
        return found
    if tag == "n":
        return None
    if tag == "b":
        return v[1] is True
    if tag == "i":
        return _int(v[1], 16)
    if tag == "f":
        return _float.fromhex(v[1])
    if tag == "c":
        return _complex(_float.fromhex(v[1][0]), _float.fromhex(v[1][1]))
    if tag == "s":
        return _str(v[1])
    if tag == "y":
        return _bytes.fromhex(v[1])
    if tag == "Q":
        return _Fraction(v[1])
    if tag == "D":
        return _Decimal(v[1])
    if tag in ("l", "t", "S", "F", "q", "B"):
        items = [decode(e) for e in v[1]]
        return {"l": _list, "t": _tuple, "S": _set, "F": _frozenset, "q": _deque, "B": _bytearray}[tag](items)
    if tag in ("d", "C", "E", "O"):
        pairs = [(decode(k), decode(e)) for k, e in v[1]]
        if tag == "E":
            return _defaultdict(None, pairs)
        if tag == "C":
            return _Counter(_dict(pairs))
        return {"d": _dict, "O": _OrderedDict}[tag](pairs)
    raise ValueError(f"unknown tag {tag!r}")


def raised(e):
    names = [_exceptions[_id(c)] for c in _mro(_type(e)) if _id(c) in _exceptions]
    try:
        text = _str(e) if _type(e.args) is _tuple else ""
        text = text[:2000] if _type(text) is _str else ""
    except BaseException:
        text = ""
    try:
        cls = encode_class(_type(e))
    except BaseException:
        cls = None
    return {"raised": names, "cls": cls, "text": text}


def answer(request, ns):
    op = request["op"]
    if op == "global":
        return {"v": encode(ns[request["name"]])}
    if op == "attr":
        return {"v": encode(_getattr(_handles[request["ref"]], request["name"]))}
    args = [decode(a) for a in request["args"]]
    if op == "apply":
        return {"v": encode(_APPLY[request["fn"]](*args))}
    kwargs = {k: decode(v) for k, v in request.get("kwargs", ())}
    value = _handles[request["ref"]](*args, **kwargs)
    after = [encode(a) if _type(a) in _MUTABLE else None for a in args]
    after_kw = [[k, encode(a)] for k, a in kwargs.items() if _type(a) in _MUTABLE]
    path = _path_in(value, args) if _type(value) in _MUTABLE else None
    return {"v": ["a", *path] if path is not None else encode(value), "after": after, "after_kw": after_kw}


def _path_in(value, args):
    """Where `value` is among the arguments (an index, then indices into lists and tuples), if it is one of them or
    a part of one: T answers with its own object there, so `f(a) is a[0]` holds as in one interpreter."""
    todo, seen = [((k,), a) for k, a in enumerate(args)], 0
    while todo and seen < 10_000:
        path, item = todo.pop(0)
        seen += 1
        if item is value:
            return path
        if (_type(item) is _list or _type(item) is _tuple) and _len(path) < 8:
            todo.extend((path + (i,), v) for i, v in enumerate(item))
    return None


def main():
    global _in, _out
    _in, _out = os.dup(0), os.dup(1)  # on copies: the program's own stdin and stdout are empty
    os.dup2(os.open(os.devnull, os.O_RDWR), 0)
    os.dup2(0, 1)
    try:
        with open("solution.py", encoding="utf-8") as f:
            program = compile(f.read(), "solution.py", "exec")
    except BaseException:
        send({"syntax_error": 1})
        _exit(0)
    ns = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(program, ns)
    except BaseException as e:
        send({"load": raised(e)})
        _exit(0)
    send({"names": [n for n in _list_of(ns) if _type(n) is _str and not n.startswith("__")]})
    while True:
        request = receive()
        try:
            reply = answer(request, ns)
        except BaseException as e:
            reply = raised(e)
        try:
            send(reply)
        except BaseException as e:  # an answer that cannot be written (too deep, a broken value): an error instead
            send(raised(e))


if __name__ == "__main__":
    main()
