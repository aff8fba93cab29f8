"""reasoning-gym scoring in the sandbox: `score_many` (the trainer's side: the calls and the verdicts it reads back)
and the inside of a call (`prepare`, `main`: run in the sandbox, open_instruct/sandbox.py, never in the trainer; this
module's own source is what the call's supervisor executes, so the inside uses the standard library and the
reasoning-gym package only, its folders made visible, read-only, in the call).

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
import functools
import gc
import json
import os
import pickle
import re
import shutil
import sys
import tempfile
from typing import Any, Optional, Sequence

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


# --------------------------------------------------------------------------------------------------------
# The trainer's side: the calls, and the verdicts read back (never executed in the sandbox)
# --------------------------------------------------------------------------------------------------------
RUN_PROGRAM = "import sys\nsys.modules['oi_reasoning_gym_scoring'].main()\n"
MEMORY_MB = 2048  # RLIMIT_AS of a scoring run: the supervisor's address space with sympy and numpy loaded, and room
PREPARE_SECONDS = 120.0  # wall time for a call's import of the package and its datasets (about 2 s here)
MAX_REPLY_BYTES = 256  # a run's stdout: one JSON line {"score": x}


@functools.lru_cache(maxsize=1)
def _visible_paths() -> tuple[str, ...]:
    """The folders the package and its dependencies import from (bound back read-only in the call)."""
    import importlib.util

    found = []
    for name in ("reasoning_gym", "sympy", "numpy", "mpmath"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            folder = os.path.dirname(os.path.dirname(os.path.realpath(spec.origin)))
            if folder not in found:
                found.append(folder)
    return tuple(found)


def score_many(
    texts: Sequence[str],
    ground_truths: Sequence[Any],
    *,
    timeout: float,
    workers: int = 2,
    hide_paths: Sequence[str] = (),
    batch_timeout: Optional[float] = None,
) -> list[tuple[float, str]]:
    """Per answer (the completion after its last </think>): (its clipped package score, its status: "ok", "timeout"
    (a CPU or wall limit), "tripped" (the scorer tried to run text as code: 0), or "error" (no verdict: 0)), scored
    in `workers` sandbox calls, each answer in a run of its own with `timeout` seconds of CPU time."""
    from open_instruct.reasoning_gym_tasks import BadGroundTruth, entry_payload
    from open_instruct.sandbox import SandboxCall, SandboxLimits, SandboxPool, SandboxRun

    if not texts:
        return []
    keys, jobs = [], []
    for gt in ground_truths:
        try:
            key, entry = entry_payload(gt if isinstance(gt, str) else json.dumps(gt, sort_keys=True))
        except BadGroundTruth:
            raise
        except Exception as e:  # a ground truth that is not JSON of a row
            raise BadGroundTruth(f"reasoning_gym ground truth {str(gt)[:200]!r} names no row: {e!r}") from None
        keys.append(key)
        jobs.append(entry)
    names = {key: f"d{i}" for i, key in enumerate(dict.fromkeys(keys))}
    chunks = [list(range(len(texts)))[w::workers] for w in range(min(workers, len(texts)))]
    run_wall = timeout + 2.0
    calls = []
    for chunk in chunks:
        mine = dict.fromkeys(keys[i] for i in chunk)
        datasets = {names[k]: [k[0], json.loads(k[1]), k[2], k[3]] for k in mine}
        warmups = {names[k]: jobs[keys.index(k)] for k in mine}
        runs = tuple(
            SandboxRun(
                stdin=json.dumps({"key": names[keys[i]], "entry": jobs[i], "text": texts[i]}),
                cpu_seconds=timeout,
                wall_seconds=run_wall,
                max_output_bytes=MAX_REPLY_BYTES,
            )
            for i in chunk
        )
        limits = SandboxLimits(
            wall_seconds=PREPARE_SECONDS + run_wall * len(chunk),
            cpu_seconds=max(1, int(timeout + 0.999)),
            memory_mb=MEMORY_MB,
            max_output_bytes=MAX_REPLY_BYTES,
        )
        with open(os.path.abspath(__file__), encoding="utf-8") as f:  # this module, run by the supervisor
            source = f.read()
        preload = {"name": "oi_reasoning_gym_scoring", "source": source, "path": list(_visible_paths()),
                   "call": "prepare", "kwargs": {"datasets": datasets, "warmups": warmups}}  # fmt: skip
        calls.append(SandboxCall(RUN_PROGRAM, limits=limits, runs=runs, visible_paths=_visible_paths(),
                                 preload=preload))  # fmt: skip
    out: list[tuple[float, str]] = [(0.0, "error")] * len(texts)
    with SandboxPool(len(calls), hide_paths=hide_paths) as pool:
        results = pool.run(calls, batch_timeout=batch_timeout)
    for chunk, result in zip(chunks, results):
        runs = result.runs or [result]
        for k, i in enumerate(chunk):
            out[i] = verdict(runs[k]) if k < len(runs) else (0.0, "timeout" if result.limit else "error")
    return out


def verdict(run: Any) -> tuple[float, str]:
    """(score, status) from one run's result: its stdout must be exactly {"score": number or null}."""
    from open_instruct.reasoning_gym_tasks import clipped

    if run.limit in ("cpu_time", "wall_time"):
        return 0.0, "timeout"
    if run.exit_code == TRIPPED:
        return 0.0, "tripped"
    if run.exit_code != 0 or run.limit or run.setup_error:
        return 0.0, "error"
    try:
        reply = json.loads(run.stdout)
        score = reply["score"]
        if set(reply) != {"score"} or not (score is None or type(score) in (int, float)):
            raise ValueError(reply)
    except (ValueError, TypeError, KeyError):
        return 0.0, "error"
    return (0.0 if score is None else clipped(score)), "ok"


def score(answer_text: str, ground_truth: Any, timeout: float = 10.0) -> float:
    """The task's own score_answer of the last <answer>...</answer> in `answer_text` (None without one), the
    completion after its last </think>, clipped: one answer through score_many."""
    return score_many([answer_text], [ground_truth], timeout=timeout)[0][0]
