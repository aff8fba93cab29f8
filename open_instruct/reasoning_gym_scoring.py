"""The inside of a reasoning-gym scoring call: run in the sandbox (open_instruct/sandbox.py), never in the trainer.
Standard library and the reasoning-gym package only (its folder is made visible, read-only, in the call).

The sandbox's supervisor executes this module once per call (`prepare`: import reasoning-gym, build the batch's task
datasets, score each task's first entry with its own right answer, so that every lazy import is done) before any
model text is read; every answer is then scored in a run of its own, a fork of that supervisor (`main`): a patched
function or any state one answer leaves is gone for the next.

Why the verdict a run prints is the package's, and the ground truth cannot be read by the answer: model text never
runs as code in the scoring process. Every place a reasoning-gym scorer evaluates text is guarded (GUARDED):
  * sympy's `parse_expr` (countdown, puzzle24, polynomial_multiplication, the integration tasks) only sees text of
    MATH_CHARS whose names are all in MATH_NAMES or single letters, with no attribute access: such text cannot name
    a builtin, a module, a frame or an attribute, so `__import__(...)`, `inspect.stack()` and the like are refused
    before sympy sees them;
  * `eval` in the modules that call it on an answer (string_insertion, spiral_matrix, binary_matrix, n_queens,
    number_sorting) only sees a literal (numbers, strings, lists, tuples, sets, dicts, a sign): no name, call,
    attribute or operator; bitwise_arithmetic's, which evaluates the row's own problem, only integer arithmetic.
A refused text raises ValueError inside the scorer, so the package's own `except` gives its own score for text it
cannot read (0.01 in countdown and puzzle24, 0 elsewhere). Anything else that would turn text into code while an
answer is scored (`compile`, `exec`, `eval` of a string, unpickling, anywhere in the package or its dependencies) is
refused by an audit hook (TRIPWIRE_EVENTS) that ends the process at once, before the code would run: the run exits
TRIPPED with no verdict, scored 0. The verdict is printed after score_answer returns, by this code, on stdout; the
trainer clips it (the package's score, a plain float, in [0, 1]).
"""

import ast
import base64
import gc
import json
import os
import pickle
import re
import shutil
import sys
import tempfile

TRIPPED = 3  # the run's exit status when the tripwire fired
TRIPWIRE_EVENTS = frozenset({"compile", "exec", "pickle.find_class", "marshal.loads", "code.__new__"})
MAX_EVAL_CHARS = 20_000  # a scorer's text to evaluate: far beyond any right answer of these tasks
MATH_CHARS = re.compile(r"[0-9A-Za-z \t\n+\-*/^().,]*", re.ASCII)
MATH_NAMES = frozenset(
    "sin cos tan cot sec csc asin acos atan acot asec acsc sinh cosh tanh coth asinh acosh atanh exp log ln sqrt "
    "cbrt pi oo Abs abs sign floor ceiling factorial binomial gamma Integral Rational Integer Float".split()
)
# modules whose score_answer calls eval on the answer: their `eval` becomes literal-only
LITERAL_EVAL_MODULES = (
    "reasoning_gym.algorithmic.string_insertion",
    "reasoning_gym.algorithmic.spiral_matrix",
    "reasoning_gym.algorithmic.binary_matrix",
    "reasoning_gym.algorithmic.number_sorting",
    "reasoning_gym.games.n_queens",
)
# bitwise_arithmetic's scorer evals the row's own problem (not the answer): integer arithmetic of hex and decimal
# literals, + - * << >> and parentheses, no name
ARITHMETIC_EVAL_MODULES = ("reasoning_gym.arithmetic.bitwise_arithmetic",)
INTEGER_ARITHMETIC = re.compile(r"(?:0[xX][0-9a-fA-F]+|[0-9]+|[-+*()<>\s])*", re.ASCII)
_LITERAL_NODES = (ast.Expression, ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.UnaryOp, ast.USub,
                  ast.UAdd, ast.Load)  # fmt: skip

_armed = False  # the tripwire: set while an answer is scored
_permitted = 0  # > 0 while a guard evaluates text it has checked


def _tripwire(event, args):
    if _armed and not _permitted and event in TRIPWIRE_EVENTS:
        os._exit(TRIPPED)


def math_text_allowed(text) -> bool:
    """Text sympy's parse_expr may see: MATH_CHARS only, every name a single letter or in MATH_NAMES, no
    attribute access."""
    if not isinstance(text, str) or len(text) > MAX_EVAL_CHARS or not MATH_CHARS.fullmatch(text):
        return False
    if re.search(r"\.\s*[A-Za-z]", text):
        return False
    return all(len(name) == 1 or name in MATH_NAMES for name in re.findall(r"[A-Za-z]+", text))


def literal_allowed(text) -> bool:
    """Text eval may see: one Python literal (numbers, strings, lists, tuples, sets, dicts, a sign)."""
    if not isinstance(text, str) or len(text) > MAX_EVAL_CHARS:
        return False
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return all(isinstance(node, _LITERAL_NODES) for node in ast.walk(tree))


def integer_arithmetic_allowed(text) -> bool:
    return isinstance(text, str) and len(text) <= MAX_EVAL_CHARS and INTEGER_ARITHMETIC.fullmatch(text) is not None


def _guard(check, evaluate, what):
    def guarded(text, *args, **kwargs):
        global _permitted
        _permitted += 1  # the check's ast.parse compiles to a syntax tree only (no code object)
        try:
            if not check(text):
                raise ValueError(f"{what}: not a text this scorer may evaluate")
            return evaluate(text, *args, **kwargs)
        finally:
            _permitted -= 1

    return guarded


_datasets = {}  # key -> the task's dataset object (built by prepare)


def _install_guards():
    """parse_expr wherever the package or sympy binds it, and eval in LITERAL_EVAL_MODULES, become guarded."""
    import sympy
    from sympy.parsing import sympy_parser

    real_parse = sympy_parser.parse_expr
    guarded_parse = _guard(math_text_allowed, real_parse, "parse_expr")
    for name, module in list(sys.modules.items()):
        if module is not None and (name.startswith("reasoning_gym") or module is sympy):
            if getattr(module, "parse_expr", None) is real_parse:
                module.parse_expr = guarded_parse
    eval_guards = ((LITERAL_EVAL_MODULES, literal_allowed), (ARITHMETIC_EVAL_MODULES, integer_arithmetic_allowed))
    for names, check in eval_guards:
        for name in names:
            if name in sys.modules:
                sys.modules[name].eval = _guard(check, eval, "eval")


def prepare(datasets, warmups):
    """In the supervisor, before any answer: import the package, build each dataset (key -> (task, config, seed,
    size)), and score each warm-up entry with its own answer (trusted data), so every lazy import is done."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    scratch = tempfile.mkdtemp()
    os.environ["MPLCONFIGDIR"] = scratch  # the package imports matplotlib (through cellpylib), which wants one
    try:
        import reasoning_gym
        from reasoning_gym.utils import extract_answer  # noqa: F401
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    for key, (task, config, seed, size) in datasets.items():
        _datasets[key] = reasoning_gym.create_dataset(task, seed=seed, size=size, **config)
    _install_guards()
    for key, entry in warmups.items():
        data = _datasets[key]
        entry = pickle.loads(base64.b64decode(entry))
        for answer in (str(entry["answer"]), None, "x", "[0]"):
            try:
                data.score_answer(answer, entry)
            except Exception:  # noqa: BLE001 - a warm-up only
                pass
    sys.addaudithook(_tripwire)
    gc.freeze()  # the runs are forks: a collection in one must not walk (and so copy) the whole preloaded heap


def main():
    """One run: the job on stdin ({"key", "entry": base64 pickle, "text"}), the package's raw score on stdout."""
    global _armed
    from reasoning_gym.utils import extract_answer

    job = json.loads(sys.stdin.buffer.read())
    entry = pickle.loads(base64.b64decode(job["entry"]))  # the trainer's data, unpickled before the tripwire is armed
    data = _datasets[job["key"]]
    out = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # what the scorer prints is not the verdict
    _armed = True
    score = data.score_answer(extract_answer(job["text"]), entry)
    _armed = False
    os.write(out, json.dumps({"score": None if score is None else float(score)}).encode() + b"\n")
    os._exit(0)  # no interpreter teardown: it would touch (and copy) every page of the preloaded heap
