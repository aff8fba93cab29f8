"""Which tests of a `code` row are judged in the trainer, and how (the value path of open_instruct/code_verifier.py).

Test code (an assert list, an MBPP string, a HumanEval `check(candidate)` with its entry point, pytest-style `test_*`
functions, the EvalPlus `assertion(out, exp, atol)` harness) is expanded here into single checks: loops over literal
inputs are unrolled, literal assignments substituted, `check(candidate)` called with the entry point. Each assert's
condition is then split in two:

    answers     the program's part: calls of its functions (arguments that involve nothing it computes), its names,
                their attributes and literal indices. Only these run in the sandbox; their values come back as tagged
                plain data (code_verifier.PROBE) and are decoded here into built-in types (`decode_value`).
    condition   everything else: comparisons, `abs(a - b) < tol`, `math.isclose`, `isinstance`, `len`, `set`,
                `sorted`, `.startswith`, `in`, `not`, `and`/`or`, literals... evaluated HERE on the decoded values by a
                small interpreter of those forms (`evaluate`); the expected values never enter the sandbox, and no
                function or method the program defined decides the verdict.

A raises test (`try: f(x) except E: pass else: assert False`, `with pytest.raises(E): f(x)`, `assertRaises(E, f, x)`)
is a check that passes when the answer raised a built-in exception of class E (or a subclass).

Anything else (a helper the test defines, a comprehension, a random input...) makes that test code one script test:
it runs whole after the program in one interpreter, so the program can patch what it calls and forge its report.
Since issue 67 part 2 these checks decide only tests of code_verifier.value_equivalent's shape; every other piece of
test code runs unmodified in lock-step (code_verifier.WholeTest), and expand() still finds bad ground truth.
"""

from __future__ import annotations

import ast
import builtins as _builtins
import collections
import copy
import dataclasses
import decimal
import fractions
import hashlib
import math
import operator
import re
import sys
from typing import Any, Optional, Sequence

MAX_UNROLLED = 100_000  # tests one loop of a harness may unroll to (the row's own cap applies after)
# Bounds on a reply (the program's values, decoded here), checked before any arithmetic on it; a reply over one is a
# wrong answer counted as `oversized`. Honest values sit far inside them: no test can write an integer literal of
# more than 4300 digits (Python's int_max_str_digits), and an MBPP/HumanEval value is at most a few thousand.
MAX_REPLY_CHARS = 1 << 20  # one test's reply (the supervisor's per-stream output cap)
MAX_DEPTH = 64  # nesting of lists/tuples/dicts/sets
MAX_INT_BITS = 1 << 16  # ~19700 decimal digits
MAX_NUMBER_DIGITS = 4300  # digits of a Fraction's numerator or denominator, of a Decimal's coefficient
MAX_DECIMAL_EXPONENT = 10_000  # |adjusted exponent| of a Decimal (int() of 1E+100000 takes 0.35 s, of 1E+10000 3 ms)
MAX_SAME_HASH = 64  # distinct set/dict members of one value with one hash (an honest value has a handful at most)


@dataclasses.dataclass(frozen=True)
class ValueCheck:
    """A test judged here: `answers` are evaluated in the sandbox (after `setup`: imports and `x = <answer>` lines),
    `condition` (Python source over the names _answer0, _answer1, ...) here on their decoded values. A raises test
    passes when the answers raised one of `raises` (built-in exception names); a call test (APPS/TACO fn_name) when
    the value equals `expected` (tuples compared as JSON lists)."""

    condition: str = ""
    answers: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    raises: tuple[str, ...] = ()
    expected: Any = None
    call: bool = False


class NotJudgeable(Exception):
    """A test shape the value path does not cover (it becomes a script test)."""


# --------------------------------------------------------------------------------------------------------
# What the condition may use (all of it evaluated here, on plain data)
# --------------------------------------------------------------------------------------------------------
def _isclose(a: Any, b: Any, rel_tol: float = 1e-9, abs_tol: float = 0.0) -> bool:
    kinds = (int, float)
    if type(a) not in kinds or type(b) not in kinds:
        raise TypeError("isclose of a non-number")
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol)


def _range(*args: int) -> range:
    span = range(*args)
    if len(span) > 10**6:
        raise NotJudgeable("range too long to compute here")
    return span


def _is_floats(x: Any) -> bool:
    """EvalPlus's is_floats on plain data: a float, or a list/tuple of floats only."""
    if type(x) is float:
        return True
    return type(x) in (list, tuple) and all(type(v) is float for v in x)


def _allclose(out: Any, exp: Any, rtol: float, atol: float) -> bool:
    """numpy.allclose on plain numbers and equal-shaped (nested) lists/tuples of them; anything else fails (numpy
    raises on it, which fails the test)."""
    numbers = (int, float, bool)
    if type(out) in numbers and type(exp) in numbers:
        if math.isnan(out) or math.isnan(exp):
            return False
        if math.isinf(out) or math.isinf(exp):
            return out == exp
        return abs(out - exp) <= atol + rtol * abs(exp)
    if type(out) in (list, tuple) and type(exp) in (list, tuple):
        if len(out) == len(exp):
            return all(_allclose(a, b, rtol, atol) for a, b in zip(out, exp))
        if len(exp) == 1:  # numpy broadcasts a length-1 side
            return all(_allclose(a, exp[0], rtol, atol) for a in out)
        if len(out) == 1:
            return all(_allclose(out[0], b, rtol, atol) for b in exp)
    raise TypeError("allclose of values that are not numbers")


def _evalplus(out: Any, exp: Any, atol: float) -> bool:
    """EvalPlus's default `assertion(out, exp, atol)`: equal, else within numpy.allclose(rtol=1e-7, atol) where atol
    is 1e-6 for a float expected value given atol 0."""
    if atol == 0 and _is_floats(exp):
        atol = 1e-6
    if out != exp and atol != 0:
        return _allclose(out, exp, 1e-7, atol)
    return out == exp


def _evalplus_set(out: Any, exp: Any, atol: float) -> bool:
    """EvalPlus's set-equality `assertion`: set(out) == set(exp) (its allclose branch raises on sets)."""
    return set(_hashable_members(out, "a set")) == set(exp)


# The EvalPlus harness functions this module stands in for, recognized by the shape of their syntax tree (`shape`):
# MBPP+ v0.2.0's default `assertion` and its set-equality variant, HumanEval+'s `assertion` (numpy's assert_allclose,
# the same rtol 1e-7), and the `is_floats` they call. Any other helper makes its test code a script test.
EVALPLUS_ASSERTIONS = {
    "c61509657b17f831": "_evalplus",
    "3d945038cd7c27c1": "_evalplus_set",
    "2666b173fa8db786": "_evalplus",
}
EVALPLUS_HELPERS = {"731ad2bd1b623350"}  # is_floats

# What an operator here may build from the program's values, checked BEFORE the operation runs (the values are
# hostile: a product, power, shift or `%` format of them must not cost the trainer more than milliseconds).
_MAX_BUILT = 10**6  # elements or characters of a sequence built here (`x * n`), steps of a comprehension
_MAX_BUILT_BITS = 1 << 20  # bits of an integer built here (`x * y`, `x ** n`, `x << n`): a product of two is ~1 ms
_MAX_FORMAT_WIDTH = 10_000  # width or precision of a `%` format applied here (`'%0999999999d' % 2` builds 1 GB)
_FORMAT_SPEC_RE = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.)", re.DOTALL)


class OverBound(NotJudgeable, ValueError):
    """An operation on the program's values that would build or cost more than the bounds here allow: the test fails
    (a wrong answer), counted as `oversized`."""


def _complex_isclose(a: Any, b: Any, rel_tol: float = 1e-9, abs_tol: float = 0.0) -> bool:
    if type(a) not in (int, float, complex) or type(b) not in (int, float, complex):
        raise TypeError("isclose of a non-number")
    return abs(a - b) <= max(rel_tol * max(abs(a), abs(b)), abs_tol)


def _bits(x: Any) -> int:
    """The size in bits of an exact number (0 for anything else: floats, Decimals under the bounded context)."""
    if isinstance(x, int):
        return x.bit_length()
    if isinstance(x, fractions.Fraction):
        return x.numerator.bit_length() + x.denominator.bit_length()
    return 0


def _sequence(x: Any) -> bool:
    return isinstance(x, (str, bytes, list, tuple, collections.deque))


def _check_format(text: Any) -> None:
    """A `%` format string's widths and precisions, before it is applied to the program's value."""
    for width, precision, _ in _FORMAT_SPEC_RE.findall(text if isinstance(text, str) else text.decode("latin-1")):
        if "*" in (width, precision):
            raise OverBound("a `%` format whose width comes from the values")
        if any(len(n) > 5 or int(n) > _MAX_FORMAT_WIDTH for n in (width, precision) if n):
            raise OverBound("a `%` format too wide to compute here")


def _binary(op: type, a: Any, b: Any) -> Any:
    """An arithmetic operator, refused (OverBound) where its result would be huge or its cost large: the operands are
    the program's values, so every size is checked before the operation runs."""
    if op is ast.Mult:
        for seq, n in ((a, b), (b, a)):
            if _sequence(seq) and isinstance(n, int) and len(seq) * max(n, 0) > _MAX_BUILT:
                raise OverBound("a repeated sequence too long to build here")
        if _bits(a) + _bits(b) > _MAX_BUILT_BITS:
            raise OverBound("a product too large to compute here")
    elif op is ast.Pow:
        if isinstance(b, int) and _bits(a) > 1 and _bits(a) * abs(b) > _MAX_BUILT_BITS:
            raise OverBound("a power too large to compute here")
        if isinstance(b, fractions.Fraction) or _bits(b) > 64:
            raise OverBound("a power with a huge or fractional exponent")
    elif op is ast.LShift:
        if isinstance(b, int) and _bits(a) + max(b, 0) > _MAX_BUILT_BITS:
            raise OverBound("a shift too large to compute here")
    elif op is ast.Mod and isinstance(a, (str, bytes)):
        _check_format(a)  # (the formatted values are bounded: the reply is)
    elif op is ast.Add and _sequence(a) and _sequence(b) and len(a) + len(b) > _MAX_BUILT:
        raise OverBound("a concatenation too long to build here")
    return _BINARY[op](a, b)


def _hashable_members(items: Any, what: str) -> list:
    """`items` as a list, refused when too many share one hash (building a set or dict of colliding members, crafted
    ints say, costs quadratic time) or when there are more than _MAX_BUILT."""
    members = list(items) if not isinstance(items, list) else items
    if len(members) > _MAX_BUILT:
        raise OverBound(f"{what} too large to build here")
    if len(members) > MAX_SAME_HASH:
        counts = collections.Counter(hash(x) for x in members)
        if max(counts.values()) > MAX_SAME_HASH:
            raise OverBound(f"{what} of colliding members")
    return members


def _guarded(constructor: Any, what: str) -> Any:
    """A set/dict-like constructor for conditions: its members' hashes checked first (`set(answer)`)."""

    def build(items: Any = (), *args: Any, **kwargs: Any) -> Any:
        if isinstance(items, (dict, collections.Counter)):
            _hashable_members(items.keys(), what)
        elif not isinstance(items, (str, bytes)):
            items = _hashable_members(items, what)
            if constructor in (dict, collections.OrderedDict):
                _hashable_members([k for k, _ in items], what)
        return constructor(items, *args, **kwargs)

    build.__name__ = getattr(constructor, "__name__", what)
    return build


def _number_text_bound(text: str) -> None:
    """A number written as text (to Fraction, Decimal): digits and exponent bounded, else OverBound (`Fraction('1e9')`
    is 10**9 in digits; int() of `Decimal('1E+999999999')` never ends)."""
    if len(text) > 2 * MAX_NUMBER_DIGITS + 64:
        raise OverBound("a number too long to read here")
    for exponent in re.findall(r"[eE]\s*([+-]?[\d_]+)", text):
        if len(exponent) > 8 or abs(int(exponent.replace("_", ""))) > MAX_DECIMAL_EXPONENT:
            raise OverBound("a number's exponent too large to read here")


def _bounded_number(constructor: Any) -> Any:
    def build(*args: Any, **kwargs: Any) -> Any:
        for arg in args:
            if isinstance(arg, str):
                _number_text_bound(arg)
            elif isinstance(arg, decimal.Decimal):
                _decimal_bound(arg)
        return constructor(*args, **kwargs)

    build.__name__ = constructor.__name__
    return build


def _decimal_bound(value: decimal.Decimal) -> None:
    if value.is_finite() and (
        len(value.as_tuple().digits) > MAX_NUMBER_DIGITS or abs(value.adjusted()) > MAX_DECIMAL_EXPONENT
    ):
        raise OverBound("a Decimal too large to compute with here")


def _sum(items: Any, start: Any = 0) -> Any:
    """sum, refused where it would copy sequences quadratically (`sum(answer, [])` of 100k one-item lists)."""
    if _sequence(start):
        members = list(items)
        if len(members) > 10_000:
            raise OverBound("a sum of sequences too long to compute here")
        return sum(members, start)
    return sum(items, start)


def _divmod(a: Any, b: Any) -> Any:
    return (_binary(ast.FloorDiv, a, b), _binary(ast.Mod, a, b))


# The types a condition may call, called through a guard (the names stay the types: `isinstance(x, set)`)
_GUARDED_CALLS: dict[type, Any] = {
    set: _guarded(set, "a set"),
    frozenset: _guarded(frozenset, "a frozenset"),
    dict: _guarded(dict, "a dict"),
    collections.Counter: _guarded(collections.Counter, "a Counter"),
    collections.OrderedDict: _guarded(collections.OrderedDict, "a dict"),
    fractions.Fraction: _bounded_number(fractions.Fraction),
    decimal.Decimal: _bounded_number(decimal.Decimal),
}
_FUNCTIONS: dict[str, Any] = {
    "abs": abs,
    "len": len,
    "set": set,
    "frozenset": frozenset,
    "sorted": sorted,
    "list": list,
    "tuple": tuple,
    "dict": dict,
    "str": str,
    "int": int,
    "float": float,
    "bool": bool,
    "complex": complex,
    "round": round,
    "sum": _sum,
    "min": min,
    "max": max,
    "isinstance": isinstance,
    "all": all,
    "any": any,
    "type": type,
    "repr": repr,
    "divmod": _divmod,
    "ord": ord,
    "chr": chr,
    "isclose": _isclose,
    "range": _range,
    "Counter": collections.Counter,
    "OrderedDict": collections.OrderedDict,
    "deque": collections.deque,
    "Fraction": fractions.Fraction,
    "Decimal": decimal.Decimal,
    "_evalplus": _evalplus,
    "_evalplus_set": _evalplus_set,
}
_CONSTANTS: dict[str, Any] = {
    "True": True,
    "False": False,
    "None": None,
    "inf": math.inf,
    "nan": math.nan,
    "bytes": bytes,
    "NoneType": type(None),
}
_MODULES: dict[str, dict[str, Any]] = {
    "math": {
        "isclose": _isclose,
        "fabs": math.fabs,
        "sqrt": math.sqrt,
        "floor": math.floor,
        "ceil": math.ceil,
        "isnan": math.isnan,
        "isinf": math.isinf,
        "pi": math.pi,
        "e": math.e,
        "tau": math.tau,
        "inf": math.inf,
        "nan": math.nan,
    },
    "collections": {"Counter": collections.Counter, "OrderedDict": collections.OrderedDict, "deque": collections.deque},
    "cmath": {"isclose": lambda a, b, **k: _complex_isclose(a, b, **k)},
}
# Methods and attributes of the decoded (built-in) values a condition may use: none of them grows a value much.
_METHODS = {
    "startswith",
    "endswith",
    "lower",
    "upper",
    "strip",
    "lstrip",
    "rstrip",
    "split",
    "count",
    "index",
    "find",
    "keys",
    "values",
    "items",
    "get",
    "isdigit",
    "isalpha",
    "isalnum",
    "isupper",
    "islower",
    "isspace",
    "most_common",
    "conjugate",
    "group",
    "span",
    "start",
    "end",
}
_ATTRIBUTES = {"real", "imag", "numerator", "denominator"}
_NAMES = {**_FUNCTIONS, **_CONSTANTS}
BUILTIN_EXCEPTIONS = frozenset(
    name for name, value in vars(_builtins).items() if isinstance(value, type) and issubclass(value, BaseException)
)
_BINARY = {
    getattr(ast, node): getattr(operator, function)
    for node, function in (
        ("Add", "add"),
        ("Sub", "sub"),
        ("Mult", "mul"),
        ("Div", "truediv"),
        ("FloorDiv", "floordiv"),
    )
    + (("Mod", "mod"), ("Pow", "pow"), ("BitAnd", "and_"), ("BitOr", "or_"), ("BitXor", "xor"))
    + (("LShift", "lshift"), ("RShift", "rshift"))
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Not: operator.not_, ast.Invert: operator.invert}
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}


def evaluate(node: ast.AST, env: dict[str, Any]) -> Any:
    """The value of a condition's syntax tree over `env` (the decoded answers), with only the forms above; raises
    NotJudgeable on anything else and lets the forms' own errors (TypeError...) through."""
    kind = type(node)
    if kind is ast.Constant:
        return node.value
    if kind is ast.Name:
        if node.id in env:
            return env[node.id]
        if node.id in _NAMES:
            return _NAMES[node.id]
        raise NotJudgeable(f"name {node.id}")
    if kind in (ast.List, ast.Tuple, ast.Set):
        items = _unpacked(node.elts, env)
        if len(items) > _MAX_BUILT:
            raise OverBound("a display too long to build here")
        return (
            set(_hashable_members(items, "a set"))
            if kind is ast.Set
            else {ast.List: list, ast.Tuple: tuple}[kind](items)
        )
    if kind is ast.Dict:
        if any(k is None for k in node.keys):
            raise NotJudgeable("dict unpacking")
        return {evaluate(k, env): evaluate(v, env) for k, v in zip(node.keys, node.values)}
    if kind is ast.UnaryOp:
        return _UNARY[type(node.op)](evaluate(node.operand, env))
    if kind is ast.BinOp:
        if type(node.op) not in _BINARY:
            raise NotJudgeable("operator")
        return _binary(type(node.op), evaluate(node.left, env), evaluate(node.right, env))
    if kind is ast.BoolOp:
        value = None
        for part in node.values:
            value = evaluate(part, env)
            if isinstance(node.op, ast.And) != bool(value):
                return value
        return value
    if kind is ast.Compare:
        left = evaluate(node.left, env)
        for op, right_node in zip(node.ops, node.comparators):
            right = evaluate(right_node, env)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if kind in (ast.ListComp, ast.SetComp, ast.GeneratorExp):
        results: list = []
        _comprehend(node, list(node.generators), env, results)
        return set(_hashable_members(results, "a set")) if kind is ast.SetComp else results
    if kind is ast.IfExp:
        return evaluate(node.body if evaluate(node.test, env) else node.orelse, env)
    if kind is ast.Subscript:
        return evaluate(node.value, env)[evaluate(node.slice, env)]
    if kind is ast.Slice:
        parts = (node.lower, node.upper, node.step)
        return slice(*(None if p is None else evaluate(p, env) for p in parts))
    if kind is ast.Attribute:
        if isinstance(node.value, ast.Name) and node.value.id in _MODULES and node.value.id not in env:
            if node.attr in _MODULES[node.value.id]:
                return _MODULES[node.value.id][node.attr]
            raise NotJudgeable(f"{node.value.id}.{node.attr}")
        if node.attr not in _ATTRIBUTES and node.attr not in _METHODS:
            raise NotJudgeable(f"attribute {node.attr}")
        return getattr(evaluate(node.value, env), node.attr)
    if kind is ast.Call:
        func = evaluate(node.func, env)
        if not (callable(func) and (_is_named_function(node.func) or isinstance(node.func, ast.Attribute))):
            raise NotJudgeable("call")
        if isinstance(func, type):
            func = _GUARDED_CALLS.get(func, func)
        args = _unpacked(node.args, env)
        if any(k.arg is None for k in node.keywords):
            raise NotJudgeable("keyword unpacking")
        return func(*args, **{k.arg: evaluate(k.value, env) for k in node.keywords})
    raise NotJudgeable(type(node).__name__)


def _bind(target: ast.AST, value: Any, env: dict[str, Any]) -> None:
    if isinstance(target, ast.Name):
        env[target.id] = value
    elif isinstance(target, (ast.Tuple, ast.List)) and not any(isinstance(t, ast.Starred) for t in target.elts):
        values = list(value)
        if len(values) != len(target.elts):
            raise ValueError("cannot unpack")
        for t, v in zip(target.elts, values):
            _bind(t, v, env)
    else:
        raise NotJudgeable("a comprehension target")


def _comprehend(node: ast.AST, generators: list, env: dict[str, Any], results: list) -> None:
    """A list/set comprehension or generator expression, evaluated eagerly (at most _MAX_BUILT steps)."""
    if not generators:
        results.append(evaluate(node.elt, env))
        return
    first, rest = generators[0], generators[1:]
    if first.is_async:
        raise NotJudgeable("async comprehension")
    for steps, item in enumerate(evaluate(first.iter, env)):
        if steps > _MAX_BUILT or len(results) > _MAX_BUILT:
            raise NotJudgeable("comprehension too long to compute here")
        inner = dict(env)
        _bind(first.target, item, inner)
        if all(evaluate(condition, inner) for condition in first.ifs):
            _comprehend(node, rest, inner, results)


def _unpacked(nodes: Sequence[ast.AST], env: dict[str, Any]) -> list:
    """The values of a list display's items or a call's arguments, `*x` unpacked."""
    items: list = []
    for node in nodes:
        if isinstance(node, ast.Starred):
            items.extend(evaluate(node.value, env))
        else:
            items.append(evaluate(node, env))
    return items


def _is_named_function(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in _FUNCTIONS


# --------------------------------------------------------------------------------------------------------
# Splitting a condition into the program's answers and what is judged here
# --------------------------------------------------------------------------------------------------------
_OPERATOR_NODES = (ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp)


def _depends_on_program(node: ast.AST) -> bool:
    return any(isinstance(n, (ast.Name, ast.Call)) and not _is_constant(n) for n in ast.walk(node))


def _is_constant(node: ast.AST) -> bool:
    """Whether `node` is computed here from literals alone (no name the program could define)."""
    try:
        evaluate(node, {})
        return True
    except Exception:  # NotJudgeable, or fails here: `sum(10, 15)` calls the program's own `sum`
        return False


def answer_only(node: ast.AST, shadowed: bool = False) -> bool:
    """Whether evaluating `node` in the program's interpreter yields only the program's answer: a call of a name
    (or of a method of one, `Solution().f`), a name, an attribute or a literal index of one, with arguments in which
    no operator touches anything the program computes and no dunder is named. `shadowed`: the call may be of a
    builtin's name (which the program then defines: `sum(10, 15)` where the builtin fails)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr.startswith("__"):
            return False
        if isinstance(sub, _OPERATOR_NODES) and _depends_on_program(sub):
            return False
        if isinstance(sub, (ast.Lambda, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom, ast.comprehension)):
            return False
    if isinstance(node, ast.Name):
        return node.id not in _NAMES
    if isinstance(node, ast.Call):
        func = node.func
        while isinstance(func, ast.Attribute):
            func = func.value.func if isinstance(func.value, ast.Call) else func.value
        return isinstance(func, ast.Name) and (shadowed or func.id not in _NAMES)
    if isinstance(node, ast.Subscript):
        return answer_only(node.value) and _is_constant(node.slice)
    if isinstance(node, ast.Attribute):
        return answer_only(node.value)
    return False


def _constructed(node: ast.AST) -> bool:
    """`Solution()` / `Cls(args)`: an object of the program's class (its methods are the program's answers)."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id[:1].isupper()


def _root_name(node: ast.AST) -> Optional[str]:
    """The name a call/attribute/index chain starts from: `random` of `random.randint(1, 9)`."""
    while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


class _Splitter:
    def __init__(self, test_names: frozenset[str], imported: frozenset[str] = frozenset()):
        self.test_names = test_names  # functions the test code defines: they never run in the sandbox
        # modules the test code imports: a call of one is no answer of the program's, though it would run in the
        # program's interpreter, which can patch it (`random.randint` answering what the program wants)
        self.imported = imported
        self.answers: list[str] = []

    def answer(self, node: ast.AST, shadowed: bool = False) -> ast.AST:
        if (
            not answer_only(node, shadowed)
            or _root_name(node) in self.imported
            or any(isinstance(n, ast.Name) and n.id in self.test_names for n in ast.walk(node))
        ):
            raise NotJudgeable(ast.unparse(node))
        self.answers.append(ast.unparse(node))
        return ast.Name(f"_answer{len(self.answers) - 1}", ast.Load())

    def split(self, node: ast.AST) -> ast.AST:
        if _is_constant(node):
            return node
        if isinstance(node, ast.Name):
            return self.answer(node)
        if isinstance(node, ast.Call):
            func = node.func
            here = (isinstance(func, ast.Name) and func.id in _FUNCTIONS) or (
                isinstance(func, ast.Attribute)
                and (
                    (isinstance(func.value, ast.Name) and func.value.id in _MODULES)
                    or (func.attr in _METHODS and not _constructed(func.value))
                )
            )
            constant_args = all(_is_constant(a.value if isinstance(a, ast.Starred) else a) for a in node.args)
            if not here or isinstance(func, ast.Name) and constant_args:
                return self.answer(node, shadowed=here)  # a builtin's name that fails here: the program's own
            if isinstance(func, ast.Attribute) and not (isinstance(func.value, ast.Name) and func.value.id in _MODULES):
                func = ast.Attribute(self.split(func.value), func.attr, ast.Load())
            args = [
                ast.Starred(self.split(a.value), ast.Load()) if isinstance(a, ast.Starred) else self.split(a)
                for a in node.args
            ]
            keywords = [ast.keyword(k.arg, self.split(k.value)) for k in node.keywords]
            return ast.Call(func, args, keywords)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in _MODULES:
                return node
            if node.attr in _ATTRIBUTES:
                return ast.Attribute(self.split(node.value), node.attr, ast.Load())
            return self.answer(node)
        if isinstance(node, ast.Subscript):
            if answer_only(node) and not _constructed(node.value):
                return self.answer(node)
            return ast.Subscript(self.split(node.value), self.split(node.slice), ast.Load())
        if isinstance(
            node,
            (
                ast.Compare,
                ast.BoolOp,
                ast.BinOp,
                ast.UnaryOp,
                ast.IfExp,
                ast.List,
                ast.Tuple,
                ast.Set,
                ast.Dict,
                ast.Slice,
                ast.Starred,
            ),
        ):
            node = copy.copy(node)
            for field, value in ast.iter_fields(node):
                if isinstance(value, ast.expr):
                    setattr(node, field, self.split(value))
                elif isinstance(value, list):
                    setattr(node, field, [self.split(v) if isinstance(v, ast.expr) else v for v in value])
            return node
        raise NotJudgeable(type(node).__name__)


def split_condition(
    cond: ast.AST, test_names: frozenset[str] = frozenset(), imported: frozenset[str] = frozenset()
) -> tuple[str, tuple[str, ...]]:
    """(the condition over _answer0.., the answers' sources); NotJudgeable if some part is neither."""
    splitter = _Splitter(test_names, imported)
    outside = splitter.split(cond)
    if not splitter.answers:
        raise NotJudgeable("the condition involves nothing the program computes")
    return ast.unparse(outside), tuple(splitter.answers)


# --------------------------------------------------------------------------------------------------------
# Expanding test code into single checks
# --------------------------------------------------------------------------------------------------------
def shape(node: ast.AST) -> str:
    """A short digest of a syntax tree's node kinds, names and constants (not its layout or Python version's dump)."""
    parts = []
    for sub in ast.walk(node):
        detail = ""
        for field in ("id", "attr", "arg", "name", "value"):
            value = getattr(sub, field, None)
            if isinstance(value, (str, int, float, bool)) or value is None and field == "value":
                detail = repr(value)
                break
        parts.append(f"{type(sub).__name__}:{detail}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _to_node(value: Any) -> ast.expr:
    if isinstance(value, (list, tuple)):
        return (ast.List if isinstance(value, list) else ast.Tuple)([_to_node(v) for v in value], ast.Load())
    return ast.Constant(value)


def _checks_in(node: ast.AST, constant_asserts: bool = True) -> bool:
    """An assert (with constant_asserts False: not of a true constant, `assert True`), a raise, or a call of an
    assert*/raises function the code does not define (a helper it defines checks only by what its body does: the
    EvalPlus `assertion()` of MBPP+ 737, 787, 794 asserts nothing) anywhere under `node`."""
    defined = {n.name for n in ast.walk(node) if isinstance(n, ast.FunctionDef)}
    for sub in ast.walk(node):
        if (
            isinstance(sub, ast.Raise)
            or isinstance(sub, ast.Assert)
            and (constant_asserts or not _is_constant(sub.test) or not evaluate(sub.test, {}))
        ):
            return True
        if isinstance(sub, ast.Call):
            func = sub.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if (name.lower().startswith("assert") or name == "raises") and name not in defined:
                return True
    return False


def _called_names(nodes: Sequence[ast.AST]) -> set[str]:
    return {
        n.func.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }


def _exception_names(node: Optional[ast.AST]) -> tuple[str, ...]:
    """The built-in exception classes an `except`/raises names (a name or a tuple of names); NotJudgeable else."""
    nodes = node.elts if isinstance(node, ast.Tuple) else [node]
    names = tuple(n.id for n in nodes if isinstance(n, ast.Name) and n.id in BUILTIN_EXCEPTIONS)
    if not names or len(names) != len(nodes):
        raise NotJudgeable("an exception class that is not built in")
    return names


def _fails(stmts: Sequence[ast.stmt]) -> bool:
    """`assert False` / `raise ...` / `pytest.fail(...)`: a block that fails the test when reached."""
    if len(stmts) != 1:
        return False
    s = stmts[0]
    if isinstance(s, ast.Raise):
        return True
    if isinstance(s, ast.Assert) and _is_constant(s.test):
        return not evaluate(s.test, {})
    return (
        isinstance(s, ast.Expr)
        and isinstance(s.value, ast.Call)
        and isinstance(s.value.func, (ast.Attribute, ast.Name))
        and (s.value.func.attr if isinstance(s.value.func, ast.Attribute) else s.value.func.id) == "fail"
    )


def _raises_context(item: ast.withitem) -> Optional[ast.AST]:
    """The exception of `with pytest.raises(E)` / `with self.assertRaises(E)` / `with raises(E)`, else None."""
    call = item.context_expr
    if not isinstance(call, ast.Call) or len(call.args) != 1:
        return None
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return call.args[0] if name in ("raises", "assertRaises") else None


class _Expander:
    """Walks test code as Python would run it, with literals substituted, collecting one ValueCheck per assert."""

    def __init__(self, tree: ast.Module):
        self.defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        self.test_names = frozenset(self.defs)
        self.checks: list[ValueCheck] = []
        self.imports: list[ast.stmt] = []
        self.globals: dict[str, ast.AST] = {}
        self.shapes = {name: shape(d) for name, d in self.defs.items()}
        self.imported = frozenset(
            (a.asname or a.name).split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom))
            for a in n.names
        )

    def substitute(self, node: ast.AST, env: dict[str, ast.AST]) -> ast.AST:
        """`node` with the names bound in `env` replaced by their nodes (shared, not copied: nothing here changes a
        node in place)."""
        if isinstance(node, ast.Name):
            return env[node.id] if isinstance(node.ctx, ast.Load) and node.id in env else node
        if not env or not any(isinstance(n, ast.Name) and n.id in env for n in ast.walk(node)):
            return node
        new = copy.copy(node)
        for field, value in ast.iter_fields(node):
            if isinstance(value, ast.AST):
                setattr(new, field, self.substitute(value, env))
            elif isinstance(value, list):
                setattr(new, field, [self.substitute(v, env) if isinstance(v, ast.AST) else v for v in value])
        return new

    def add(self, cond: ast.AST, setup: list[str]) -> None:
        condition, answers = split_condition(cond, self.test_names, self.imported)
        self.checks.append(ValueCheck(condition, answers, tuple(setup)))

    def add_raises(self, expr: ast.AST, exception: ast.AST, setup: list[str]) -> None:
        if (
            not answer_only(expr)
            or _root_name(expr) in self.imported
            or any(isinstance(n, ast.Name) and n.id in self.test_names for n in ast.walk(expr))
        ):
            raise NotJudgeable("a raises test of something other than the program's call")
        self.checks.append(ValueCheck("", (ast.unparse(expr),), tuple(setup), raises=_exception_names(exception)))

    def iterate(self, node: ast.AST) -> list[ast.AST]:
        """The items of a loop's iterable: literal lists/tuples/strings, range, zip and enumerate of those."""
        items: Optional[list[ast.AST]] = None
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and not any(isinstance(e, ast.Starred) for e in node.elts):
            items = list(node.elts)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
            name, args = node.func.id, node.args
            if name == "zip" and args:
                items = [ast.Tuple(list(t), ast.Load()) for t in zip(*(self.iterate(a) for a in args))]
            elif name == "enumerate" and len(args) in (1, 2):
                start = evaluate(args[1], {}) if len(args) == 2 and _is_constant(args[1]) else 0
                if not isinstance(start, int):
                    raise NotJudgeable("enumerate start")
                items = [
                    ast.Tuple([ast.Constant(start + i), item], ast.Load())
                    for i, item in enumerate(self.iterate(args[0]))
                ]
            elif name == "range" and all(_is_constant(a) for a in args):
                span = range(*(evaluate(a, {}) for a in args))
                if len(span) > MAX_UNROLLED:
                    raise NotJudgeable("loop too long")
                items = [ast.Constant(i) for i in span]
        if items is None and _is_constant(node):
            value = evaluate(node, {})
            if isinstance(value, (str, list, tuple, dict, set, frozenset, range)) and len(value) <= MAX_UNROLLED:
                items = [_to_node(v) for v in value]
        if items is None:
            raise NotJudgeable("a loop over something other than literals")
        if len(items) > MAX_UNROLLED:
            raise NotJudgeable("loop too long")
        return items

    def bind(self, target: ast.AST, item: ast.AST, env: dict[str, ast.AST]) -> None:
        if isinstance(target, ast.Name):
            env[target.id] = item
            return
        if isinstance(target, (ast.Tuple, ast.List)):
            if not isinstance(item, (ast.Tuple, ast.List)) and _is_constant(item):
                item = _to_node(evaluate(item, {}))
            if isinstance(item, (ast.Tuple, ast.List)) and len(item.elts) == len(target.elts):
                for t, i in zip(target.elts, item.elts):
                    self.bind(t, i, env)
                return
        raise NotJudgeable("a loop target that does not unpack")

    def call(self, name: str, args: list[ast.AST], env: dict[str, ast.AST], setup: list[str], depth: int) -> None:
        definition = self.defs[name]
        if isinstance(definition, ast.FunctionDef) and self.shapes[name] in EVALPLUS_ASSERTIONS:
            helpers = [d for d in self.defs.values() if d is not definition and d.name in _called_names([definition])]
            if any(self.shapes[d.name] not in EVALPLUS_HELPERS for d in helpers) or len(args) != 3:
                raise NotJudgeable("an EvalPlus assertion with changed helpers")
            self.add(ast.Call(ast.Name(EVALPLUS_ASSERTIONS[self.shapes[name]], ast.Load()), args, []), setup)
            return
        if not isinstance(definition, ast.FunctionDef) or depth > 4:
            raise NotJudgeable(f"a call of {name}")
        params = definition.args
        if params.vararg or params.kwarg or params.kwonlyargs or params.posonlyargs or params.defaults:
            raise NotJudgeable(f"the parameters of {name}")
        if len(args) != len(params.args):
            raise NotJudgeable(f"a call of {name} with {len(args)} arguments")
        local = dict(self.globals)
        local.update({p.arg: a for p, a in zip(params.args, args)})
        self.block(definition.body, local, list(setup), depth + 1)

    def block(self, stmts: Sequence[ast.stmt], env: dict[str, ast.AST], setup: list[str], depth: int = 0) -> None:
        for s in stmts:
            self.statement(s, env, setup, depth)

    def statement(self, s: ast.stmt, env: dict[str, ast.AST], setup: list[str], depth: int) -> None:
        if isinstance(s, ast.Assert):
            cond = self.substitute(s.test, env)
            if _is_constant(cond):
                if not evaluate(cond, {}):
                    raise NotJudgeable("assert of a false constant")
                return  # `assert True`: checks nothing
            self.add(cond, setup)
        elif isinstance(s, ast.Expr) and isinstance(s.value, (ast.Constant, ast.Name)) or isinstance(s, ast.Pass):
            return  # a docstring, a bare `print`
        elif isinstance(s, ast.Expr) and isinstance(s.value, ast.Call):
            call = self.substitute(s.value, env)
            func = call.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if isinstance(func, ast.Name) and name in self.defs and not call.keywords:
                self.call(name, list(call.args), env, setup, depth)
            elif name in ("assertRaises", "raises") and len(call.args) >= 2 and not call.keywords:
                target = ast.Call(call.args[1], list(call.args[2:]), [])
                self.add_raises(target, call.args[0], setup)
            else:
                raise NotJudgeable("a call statement")
        elif isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
            name, value = s.targets[0].id, self.substitute(s.value, env)
            if _is_constant(value):
                env[name] = value
                if depth == 0:
                    self.globals[name] = value
            elif (
                answer_only(value)
                and _root_name(value) not in self.imported
                and not any(isinstance(n, ast.Name) and n.id in self.test_names for n in ast.walk(value))
            ):
                setup.append(f"{name} = {ast.unparse(value)}")
                env.pop(name, None)
            else:
                raise NotJudgeable("an assignment")
        elif isinstance(s, ast.For) and not s.orelse:
            for item in self.iterate(self.substitute(s.iter, env)):
                local = dict(env)
                self.bind(s.target, item, local)
                self.block(s.body, local, list(setup), depth)
        elif isinstance(s, (ast.Import, ast.ImportFrom)):
            self.imports.append(s)
        elif isinstance(s, ast.Try) and len(s.handlers) == 1 and not s.finalbody and s.body:
            handler, body = s.handlers[0], list(s.body)
            if body and _fails(body[-1:]) and not s.orelse:
                body = body[:-1]
            elif not _fails(s.orelse):
                raise NotJudgeable("a try that is not a raises test")
            if (
                len(body) != 1
                or not isinstance(body[0], (ast.Expr, ast.Assign))
                or _checks_in(ast.Module(handler.body, []))
            ):
                raise NotJudgeable("a try that is not a raises test")
            self.add_raises(self.substitute(body[0].value, env), handler.type, setup)
        elif isinstance(s, ast.With) and len(s.items) == 1 and _raises_context(s.items[0]) is not None:
            if len(s.body) != 1 or not isinstance(s.body[0], (ast.Expr, ast.Assign)):
                raise NotJudgeable("a raises block of more than one statement")
            self.add_raises(self.substitute(s.body[0].value, env), _raises_context(s.items[0]), setup)
        else:
            raise NotJudgeable(type(s).__name__)

    def with_imports(self, check: ValueCheck) -> ValueCheck:
        """The check with the test code's imports of the standard library (a program may lean on them, as it could
        when the test ran after it) and any other its answers use (numpy, say, only then: the sandbox has none)."""
        needed, used, text = [], None, "\n".join((*check.answers, *check.setup))
        for node in self.imports:
            modules = {node.module or ""} if isinstance(node, ast.ImportFrom) else {a.name for a in node.names}
            bound = {(a.asname or a.name).split(".")[0] for a in node.names}
            if all(m.split(".")[0] in sys.stdlib_module_names for m in modules) and not getattr(node, "level", 0):
                needed.append(ast.unparse(node))
            elif any(name in text for name in bound):  # (a quick test first: parsing every answer is slow)
                if used is None:
                    used = {n.id for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Name)}
                if bound & used:
                    needed.append(ast.unparse(node))
        return dataclasses.replace(check, setup=(*needed, *check.setup)) if needed else check


def expand(source: str, entry_point: Optional[str] = None) -> tuple[list[ValueCheck], Optional[str]]:
    """The checks of one piece of test code, or ([], the script to run whole) when some part is not judgeable here.
    ValueError when it defines checks nothing calls (HumanEval's `check(candidate)` without its entry point) or
    checks nothing."""
    tree = ast.parse(source)
    body = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    reached, frontier = set(), _called_names(body)
    while frontier:
        name = frontier.pop()
        if name in defs and name not in reached:
            reached.add(name)
            frontier |= _called_names([defs[name]])
    implicit = []
    for name, definition in defs.items():
        if name in reached or not _checks_in(definition):
            continue
        params = [a.arg for a in definition.args.args]
        if name.startswith("test") and not params:
            implicit.append(f"{name}()")  # pytest-style: the runner calls it
        elif entry_point and len(params) == 1:
            implicit.append(f"{name}({entry_point})")
        else:
            raise ValueError(
                f"the test code defines {name}({', '.join(params)}) with checks but never calls it; "
                "it would check nothing (give the row's entry point, HumanEval's entry_point column, to call it with)"
            )
    script, module = source, tree
    if implicit:
        script = source.rstrip() + "\n\n" + "\n".join(implicit) + "\n"
        module = ast.parse(script)
    expander = _Expander(module)
    judgeable = True
    try:
        expander.block([n for n in module.body if not isinstance(n, (ast.FunctionDef, ast.ClassDef))], {}, [])
    except (NotJudgeable, RecursionError):
        judgeable = False
    if judgeable and expander.checks:
        return [expander.with_imports(c) for c in expander.checks], None
    if judgeable or not _checks_in(module, constant_asserts=False):
        raise ValueError(
            f"the test code checks nothing (no assert on anything the program computes): {source[:200]!r}; "
            "it would reward any program that runs"
        )
    return [], script


# --------------------------------------------------------------------------------------------------------
# The sandbox's values, decoded; the verdict
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MatchValue:
    """A returned re.Match, as plain data: what it matched and where (truthy, like the match)."""

    text: str
    span: tuple[int, int]

    def group(self, index: int = 0) -> str:
        if index != 0:
            raise IndexError("only group 0 comes back from the sandbox")
        return self.text

    def start(self) -> int:
        return self.span[0]

    def end(self) -> int:
        return self.span[1]


_FRACTION_RE = re.compile(r"[+-]?\d{1,%d}(?:/\d{1,%d})?" % (MAX_NUMBER_DIGITS, MAX_NUMBER_DIGITS))
_DECIMAL_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|[+-]?(?:Infinity|s?NaN\d{0,64})")
_HEX_FLOAT_RE = re.compile(r"-?(?:0x[0-9a-f]{1,20}(?:\.[0-9a-f]{0,20})?p[+-]?\d{1,5}|inf|nan)")


def _decimal(text: str) -> decimal.Decimal:
    if not _DECIMAL_RE.fullmatch(text):
        raise ValueError("malformed Decimal")
    _number_text_bound(text)
    value = decimal.Decimal(text)
    _decimal_bound(value)
    return value


def _float(text: Any) -> float:
    if not isinstance(text, str) or not _HEX_FLOAT_RE.fullmatch(text):
        raise ValueError("malformed float")
    return float.fromhex(text)


def decode_value(encoded: Any, depth: int = 0) -> Any:
    """The Python value of the sandbox's tagged JSON (code_verifier.PROBE's encoding; built-in and standard library
    types only). Every bound (nesting, integer bits, a Fraction's digits, a Decimal's digits and exponent, members of
    one hash in a set or dict) is checked before the value is built: OverBound past one, ValueError if malformed."""
    if depth > MAX_DEPTH:
        raise OverBound("a value nested too deep")
    if not isinstance(encoded, list) or not encoded or not isinstance(encoded[0], str):
        raise ValueError("malformed value")
    tag, rest = encoded[0], encoded[1:]
    if tag == "n" and not rest:
        return None
    if len(rest) != 1:
        raise ValueError("malformed value")
    (payload,) = rest
    if tag == "b" and isinstance(payload, bool):
        return payload
    if tag == "i" and isinstance(payload, str):
        if len(payload) > MAX_INT_BITS // 4 + 1:
            raise OverBound("an integer too large")
        return int(payload, 16)
    if tag == "f":
        return _float(payload)
    if tag == "c" and isinstance(payload, list) and len(payload) == 2:
        return complex(_float(payload[0]), _float(payload[1]))
    if tag == "s" and isinstance(payload, str):
        return payload
    if tag == "y" and isinstance(payload, str):
        return bytes.fromhex(payload)
    if tag == "Q" and isinstance(payload, str):
        # str() of a real Fraction is "n" or "n/d": anything else (a patched __str__'s "1e999999999") is refused
        if not _FRACTION_RE.fullmatch(payload):
            raise OverBound("a Fraction that is not n/d within the digit bound")
        return fractions.Fraction(payload)
    if tag == "D" and isinstance(payload, str):
        return _decimal(payload)
    if tag == "M" and isinstance(payload, list) and len(payload) == 3:
        text, start, end = payload
        if isinstance(text, str) and type(start) is int and type(end) is int:
            return MatchValue(text, (start, end))
    if tag in ("l", "t", "S", "F", "q") and isinstance(payload, list):
        items = [decode_value(v, depth + 1) for v in payload]
        if tag in ("S", "F"):
            items = _hashable_members(items, "a set")
        return {"l": list, "t": tuple, "S": set, "F": frozenset, "q": collections.deque}[tag](items)
    if tag in ("d", "C", "O", "E") and isinstance(payload, list):
        if not all(isinstance(kv, list) and len(kv) == 2 for kv in payload):
            raise ValueError("malformed dict")
        keys = _hashable_members([decode_value(k, depth + 1) for k, _ in payload], "a dict")
        pairs = dict(zip(keys, (decode_value(v, depth + 1) for _, v in payload)))
        if tag == "E":
            return collections.defaultdict(None, pairs)
        return pairs if tag == "d" else {"C": collections.Counter, "O": collections.OrderedDict}[tag](pairs)
    raise ValueError(f"unknown value tag {tag!r}")


def _lists(value: Any) -> Any:
    """Tuples as lists, recursively (a JSON expected value has no tuples: APPS/TACO compare that way)."""
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    return value


_CONDITIONS: dict[str, ast.AST] = {}


# Decimal arithmetic in a condition: results past this exponent overflow (a wrong answer) rather than grow an int()
# of them without end; decoded Decimals are bounded at MAX_DECIMAL_EXPONENT.
_DECIMAL_CONTEXT = decimal.Context(Emax=2 * MAX_DECIMAL_EXPONENT, Emin=-2 * MAX_DECIMAL_EXPONENT)


def judge_values(check: ValueCheck, values: Sequence[Any]) -> str:
    """The verdict of a value test on the decoded values of its answers: "pass", "wrong_answer", or "oversized" (an
    operation refused because of the values' size: a wrong answer, counted apart). Never raises: a comparison that
    does not apply, e.g. < between a str and an int, is a wrong answer."""
    try:
        if check.call:
            (value,) = values
            got = _lists(value)
            return "pass" if got == check.expected or [got] == check.expected else "wrong_answer"
        tree = _CONDITIONS.get(check.condition)
        if tree is None:
            tree = _CONDITIONS.setdefault(check.condition, ast.parse(check.condition, mode="eval").body)
            if len(_CONDITIONS) > 100_000:
                _CONDITIONS.clear()
        if len(values) != len(check.answers):
            return "wrong_answer"
        with decimal.localcontext(_DECIMAL_CONTEXT):
            passed = bool(evaluate(tree, {f"_answer{i}": v for i, v in enumerate(values)}))
        return "pass" if passed else "wrong_answer"
    except OverBound:
        return "oversized"
    except (
        NotJudgeable,
        ArithmeticError,
        TypeError,
        ValueError,
        LookupError,
        AttributeError,
        RecursionError,
        MemoryError,
    ):
        return "wrong_answer"


def check_value(check: ValueCheck, values: Sequence[Any]) -> bool:
    """judge_values as a bool: whether the test passes."""
    return judge_values(check, values) == "pass"
