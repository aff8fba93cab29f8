"""Word problems for the SmolLM2 calculator demo (demo/smollm2_tools.py): the model must choose the operation(s)
and the operands itself, from a story, a price list, a comparison or a log, then use the calculator.

Every problem has a *family* (a way of phrasing: the setting, the words that name the operation, the order of the
sentences) and a *shape* (the arithmetic under it). Training and held-out sets share no family:

    training families  story, shop, question_first, compare, school, math_words
    held-out families  measures (lengths, liters, kilograms), money (prices, wages), records (terse "Label: 123." logs)

    shapes  one-step: add (a+b), sub (a-b), mul (x*y)
            two-step: add_sub (a+b-c), mul_add (c+x*y): in training and held out;
                      mul_sub (c-x*y), add_mul ((a+b)*x): held out only (never trained on);
                      sub_mul ((a-b)*x), mul_less (x*y-c): training only, with `--train_shapes more`

A problem may carry an irrelevant number (a *distractor*: "Ann is 43 years old."): training uses its own
distractor sentences, the held-out distractor set others. Operands are 2-3 digits, too large for a 135M model to
add or multiply in its head. A problem is a dict: question, answer, expression (the canonical calculator input),
text_order_expression (the same with each sum's and product's operands as the question states them),
ops (its operations in order), operands, distractor, family, shape.
"""

from __future__ import annotations

import random
import re
from typing import Any, Optional

NAMES = ["Ann", "Ben", "Cara", "Dev", "Ella", "Finn", "Gia", "Hugo", "Ivy", "Jon", "Kai", "Lena", "Mia", "Noah"]
ITEMS = ["apples", "stamps", "marbles", "pencils", "stickers", "shells", "coins", "cards", "beads", "books"]

ONE_STEP = ("add", "sub", "mul")
TWO_STEP_TRAINED = ("add_sub", "mul_add")
TWO_STEP_HELD_OUT_ONLY = ("mul_sub", "add_mul")
# Training-only neighbours of the held-out-only shapes (`--train_shapes more`): the same two operations composed the
# other way round, (a-b)*x beside (a+b)*x and x*y-c beside c-x*y.
TWO_STEP_MORE_TRAINED = ("sub_mul", "mul_less")
SHAPE_OPS = {"add": "+", "sub": "-", "mul": "*", "add_sub": "+-", "mul_add": "*+", "mul_sub": "*-", "add_mul": "+*",
             "sub_mul": "-*", "mul_less": "*-"}  # fmt: skip

# family -> shape -> templates. Slots: {n} {m} {k} names, {it} a plural item, numbers {a} {b} {c} (sums and
# differences), {x} (a count) and {y} (an amount per unit) for products.
TRAIN_FAMILIES: dict[str, dict[str, list[str]]] = {
    "story": {
        "add": [
            "{n} had {a} {it}. Then {n} got {b} more {it}. How many {it} does {n} have now?",
            "{n} collected {a} {it} last year and {b} {it} this year. How many {it} has {n} collected?",
        ],
        "sub": [
            "{n} had {a} {it} and gave {b} of them away. How many {it} does {n} have left?",
            "{n} had {a} {it}. {n} lost {b} of them. How many {it} are left?",
        ],
        "mul": [
            "{n} bought {x} bags of {it}. Each bag holds {y} {it}. How many {it} did {n} buy?",
            "{n} filled {x} jars with {y} {it} in each jar. How many {it} are in the jars?",
        ],
        "add_sub": ["{n} had {a} {it}, found {b} more, and then lost {c}. How many {it} does {n} have now?"],
        "mul_add": [
            "{n} had {c} {it}. Then {n} bought {x} boxes with {y} {it} in each box. How many {it} does {n} have now?"
        ],
    },
    "shop": {
        "add": ["A shop sold {a} {it} on Monday and {b} {it} on Tuesday. How many {it} did it sell on the two days?"],
        "sub": ["A shop had {a} {it} in stock and sold {b}. How many {it} are still in stock?"],
        "mul": ["A shop packs {it} into crates of {y}. How many {it} are in {x} crates?"],
        "add_sub": [
            "A shop had {a} {it}. A delivery brought {b} more, and customers bought {c}. "
            "How many {it} does the shop have?"
        ],
        "mul_add": ["A shop had {c} {it} and received {x} cartons of {y} {it} each. How many {it} does it have now?"],
    },
    "question_first": {
        "add": ["How many {it} are there altogether if {n} has {a} {it} and {m} has {b} {it}?"],
        "sub": ["How many {it} remain if there were {a} {it} and {b} were taken away?"],
        "mul": ["How many {it} are there in {x} rows if each row has {y} {it}?"],
        "add_sub": ["How many {it} does {n} have if {n} started with {a}, received {b}, and gave away {c}?"],
        "mul_add": ["How many {it} are there if {n} has {c} loose {it} and {x} packs of {y} {it}?"],
    },
    "compare": {
        "add": ["{n} has {a} {it}. {m} has {b} more {it} than {n}. How many {it} does {m} have?"],
        "sub": ["{n} has {a} {it}. {m} has {b} fewer {it} than {n}. How many {it} does {m} have?"],
        "mul": ["{n} has {y} {it}. {m} has {x} times as many {it} as {n}. How many {it} does {m} have?"],
        "add_sub": [
            "{n} has {a} {it}. {m} has {b} more than {n}, and {k} has {c} fewer than {m}. How many {it} does {k} have?"
        ],
        "mul_add": ["{n} has {y} {it}. {m} has {x} times as many as {n}, and {c} more. How many {it} does {m} have?"],
    },
    "school": {
        "add": ["A school has {a} girls and {b} boys. How many children are in the school?"],
        "sub": ["There are {a} children in a school. {b} of them are on a trip. How many children are at school?"],
        "mul": ["A school has {x} classes with {y} children in each class. How many children are there?"],
        "add_sub": ["A school had {a} pupils. {b} new pupils joined and {c} left. How many pupils does it have now?"],
        "mul_add": ["A school has {x} classes of {y} pupils and {c} teachers. How many people are in the school?"],
    },
    "math_words": {
        "add": ["What is the sum of {a} and {b}?", "Add {a} and {b}. What do you get?"],
        "sub": ["Take {b} away from {a}. What is left?", "What is the difference between {a} and {b}?"],
        "mul": ["What is the product of {x} and {y}?", "Multiply {x} by {y}. What is the result?"],
        "add_sub": ["Add {a} and {b}, then subtract {c}. What do you get?"],
        "mul_add": ["Multiply {x} by {y}, then add {c}. What is the result?"],
    },
}
HELD_OUT_FAMILIES: dict[str, dict[str, list[str]]] = {
    "measures": {
        "add": [
            "A rope is {a} cm long. A second rope is {b} cm long. What is their total length in cm?",
            "A pool has {a} liters of water. A hose adds {b} liters. How many liters are in the pool now?",
        ],
        "sub": [
            "A tank holds {a} liters of water. Then {b} liters leak out. How many liters are in the tank now?",
            "A board is {a} cm long. {n} saws off {b} cm. How long is the board now, in cm?",
        ],
        "mul": [
            "A runner covers {y} meters in each lap. How many meters does the runner cover in {x} laps?",
            "One crate weighs {y} kg. How many kg do {x} crates weigh?",
        ],
        "add_sub": [
            "A truck carried {a} kg of sand. Workers loaded {b} kg more and then unloaded {c} kg. "
            "How many kg of sand is on the truck?"
        ],
        "mul_add": ["A car drove for {x} hours at {y} km per hour and then {c} km more. How many km did it drive?"],
        "mul_sub": [
            "A roll has {c} cm of tape. {n} cuts {x} pieces that are {y} cm long each. "
            "How many cm of tape are left on the roll?"
        ],
        "add_mul": ["Each row of a wall has {a} red bricks and {b} grey bricks. How many bricks are in {x} rows?"],
    },
    "money": {
        "add": [
            "A bike costs {a} dollars and a helmet costs {b} dollars. What do the two cost together, in dollars?",
            "{n} paid {a} dollars for rent and {b} dollars for food. How many dollars did {n} pay in all?",
        ],
        "sub": [
            "{n} had {a} dollars and spent {b} dollars on a coat. How many dollars does {n} have left?",
            "A phone cost {a} dollars. On sale it is {b} dollars cheaper. What is the sale price in dollars?",
        ],
        "mul": [
            "{n} earns {y} dollars a day. How many dollars does {n} earn in {x} days?",
            "One chair costs {y} dollars. What do {x} chairs cost, in dollars?",
        ],
        "add_sub": [
            "{n} saved {a} dollars, was given {b} dollars, and then paid {c} dollars for a phone. "
            "How many dollars does {n} have now?"
        ],
        "mul_add": [
            "{n} bought {x} tickets at {y} dollars each and a meal for {c} dollars. How many dollars did {n} spend?"
        ],
        "mul_sub": ["{n} had {c} dollars and bought {x} books at {y} dollars each. How many dollars are left?"],
        "add_mul": [
            "A lunch is a sandwich for {a} dollars and a drink for {b} dollars. "
            "What do {x} such lunches cost, in dollars?"
        ],
    },
    "records": {
        "add": [
            "Visitors on Saturday: {a}. Visitors on Sunday: {b}. Total visitors for the weekend?",
            "Morning orders: {a}. Evening orders: {b}. Orders for the day?",
        ],
        "sub": [
            "Seats in the hall: {a}. Seats taken: {b}. Seats still free?",
            "Tickets printed: {a}. Tickets sold: {b}. Tickets unsold?",
        ],
        "mul": [
            "Boxes on the pallet: {x}. Cans per box: {y}. Cans on the pallet?",
            "Rows of seats: {x}. Seats per row: {y}. Seats in all?",
        ],
        "add_sub": ["Stock at the start: {a}. Items added: {b}. Items removed: {c}. Stock at the end?"],
        "mul_add": ["Full trays: {x}. Eggs per tray: {y}. Loose eggs: {c}. Eggs in total?"],
        "mul_sub": ["Cards in the store: {c}. Packs sold: {x}. Cards per pack: {y}. Cards left in the store?"],
        "add_mul": ["Red beads per necklace: {a}. Blue beads per necklace: {b}. Necklaces: {x}. Beads needed?"],
    },
}
# More training phrasings (`--train_phrasings varied`): a difference stated by what is missing, unused, not back or
# still needed, not only by what was lost or given away; none of the held-out families' words, units or layouts.
MORE_TRAIN_FAMILIES: dict[str, dict[str, list[str]]] = {
    "home": {
        "add": [
            "{n} made {a} {it} and {m} made {b}. How many {it} did they make together?",
            "A box holds {a} {it}. {n} puts {b} more {it} in it. How many {it} are in the box?",
        ],
        "sub": [
            "There were {a} {it} on the table. {b} fell on the floor. How many {it} are still on the table?",
            "{n} needs {a} {it} and already has {b}. How many more {it} does {n} need?",
            "{n} used {b} of the {a} {it} in the drawer. How many {it} were not used?",
        ],
        "mul": [
            "There are {x} shelves with {y} {it} on each shelf. How many {it} are on the shelves?",
            "{n} gets {y} {it} every week. How many {it} does {n} get in {x} weeks?",
        ],
        "add_sub": ["{n} had {a} {it}. {m} gave {n} {b} more, and then {n} used {c}. How many {it} are left?"],
        "mul_add": [
            "{n} keeps {x} tins with {y} {it} in each tin and {c} more {it} in a drawer. How many {it} does {n} keep?"
        ],
    },
    "club": {
        "add": ["A club has {a} old members and {b} new members. How many members does the club have?"],
        "sub": [
            "A club had {a} members. {b} of them did not come back. How many members stayed?",
            "Out of {a} {it}, {b} are broken. How many {it} are not broken?",
            "{a} {it} were ordered, but only {b} arrived. How many {it} are missing?",
        ],
        "mul": ["A club has {x} teams of {y} players. How many players are there?"],
        "add_sub": [
            "A club had {a} members. {b} joined in spring and {c} quit in autumn. How many members are there now?"
        ],
        "mul_add": ["A club rents {x} buses with {y} seats each and {c} more seats in vans. How many seats is that?"],
    },
}
# `--train_shapes more`: the training families' templates of TWO_STEP_MORE_TRAINED (the same words and settings as
# each family's other templates; none of the held-out families' units, money or "Label: n." layout).
MORE_SHAPE_TEMPLATES: dict[str, dict[str, list[str]]] = {
    "story": {
        "sub_mul": ["{n} packed {x} bags with {a} {it} each, then took {b} {it} out of every bag. "
                    "How many {it} are in the bags now?"],
        "mul_less": ["{n} bought {x} bags with {y} {it} in each bag and gave {c} {it} away. "
                     "How many {it} does {n} have left?"],
    },
    "shop": {
        "sub_mul": ["A shop had {a} {it} on each of {x} shelves and sold {b} {it} from each shelf. "
                    "How many {it} are left on the shelves?"],
        "mul_less": ["A shop received {x} cartons of {y} {it} each and sold {c} of them. How many {it} are left?"],
    },
    "question_first": {
        "sub_mul": ["How many {it} are left in {x} boxes if each box had {a} {it} and {b} were taken from each box?"],
        "mul_less": ["How many {it} are left if {n} had {x} packs of {y} {it} and used {c} of them?"],
    },
    "compare": {
        "sub_mul": ["{n} has {a} {it}. {m} has {b} fewer than {n}, and {k} has {x} times as many as {m}. "
                    "How many {it} does {k} have?"],
        "mul_less": ["{n} has {y} {it}. {m} has {x} times as many as {n}, and {k} has {c} fewer than {m}. "
                     "How many {it} does {k} have?"],
    },
    "school": {
        "sub_mul": ["A school has {x} classes. Each class had {a} pupils, and {b} pupils left each class. "
                    "How many pupils are in the classes now?"],
        "mul_less": ["A school has {x} classes of {y} pupils. {c} pupils are away today. "
                     "How many pupils are at school?"],
    },
    "math_words": {
        "sub_mul": ["Subtract {b} from {a}, then multiply by {x}. What is the result?"],
        "mul_less": ["Multiply {x} by {y}, then subtract {c}. What do you get?"],
    },
    "home": {
        "sub_mul": ["{n} bakes {x} batches of {a} {it}, and {b} {it} in each batch burn. "
                    "How many good {it} are there?"],
        "mul_less": ["{n} has {x} tins with {y} {it} in each tin and eats {c} of them. "
                     "How many {it} are still in the tins?"],
    },
    "club": {
        "sub_mul": ["A club has {x} teams. Each team had {a} players, and {b} players left each team. "
                    "How many players are there now?"],
        "mul_less": ["A club rents {x} buses with {y} seats each. {c} seats stay empty. How many seats are used?"],
    },
}  # fmt: skip
TRAIN_DISTRACTORS = ["{n}'s school has {d} lockers.", "The street has {d} houses.", "It is day {d} of the school year."]
HELD_OUT_DISTRACTORS = ["The building is {d} meters tall.", "The store opened {d} days ago.",
                        "{n} lives at number {d}."]  # fmt: skip

# The splits: which families, shapes and distractor sentences each draws from, and how often a distractor is added.
SPLITS: dict[str, dict[str, Any]] = {
    "train": {"families": TRAIN_FAMILIES, "shapes": ONE_STEP * 2 + TWO_STEP_TRAINED,
              "distractors": TRAIN_DISTRACTORS, "distractor_rate": 0.25},
    "one_step": {"families": HELD_OUT_FAMILIES, "shapes": ONE_STEP, "distractors": [], "distractor_rate": 0.0},
    "distractor": {"families": HELD_OUT_FAMILIES, "shapes": ONE_STEP, "distractors": HELD_OUT_DISTRACTORS,
                   "distractor_rate": 1.0},
    "two_step": {"families": HELD_OUT_FAMILIES, "shapes": TWO_STEP_TRAINED + TWO_STEP_HELD_OUT_ONLY,
                 "distractors": [], "distractor_rate": 0.0},
}  # fmt: skip

# `--train_phrasings varied`: the training split with the added families, everything else as "train".
SPLITS["train_varied"] = {**SPLITS["train"], "families": {**TRAIN_FAMILIES, **MORE_TRAIN_FAMILIES}}
# `--train_shapes more`: either training split with TWO_STEP_MORE_TRAINED (still 1 in 4 problems two-step by default).
SPLITS.update({
    f"{name}_more_shapes": {
        **SPLITS[name],
        "shapes": ONE_STEP * 4 + TWO_STEP_TRAINED + TWO_STEP_MORE_TRAINED,
        "families": {f: {**shapes, **MORE_SHAPE_TEMPLATES[f]} for f, shapes in SPLITS[name]["families"].items()},
    }
    for name in ("train", "train_varied")
})  # fmt: skip


def training_split(phrasings: str = "base", shapes: str = "base") -> str:
    """The SPLITS key of the training problems: `phrasings` "base" or "varied" (MORE_TRAIN_FAMILIES), `shapes`
    "base" or "more" (TWO_STEP_MORE_TRAINED)."""
    if phrasings not in ("base", "varied") or shapes not in ("base", "more"):
        raise ValueError(f"phrasings must be base or varied, shapes base or more; got {phrasings!r}, {shapes!r}")
    return "train" + ("_varied" if phrasings == "varied" else "") + ("_more_shapes" if shapes == "more" else "")


def shape_numbers(rng: random.Random, shape: str) -> tuple[dict[str, int], list[int], str, int]:
    """The numbers of one problem of `shape`: (template slots, operands in the order the expression uses them,
    the canonical expression, the answer)."""
    if shape in ("add", "sub"):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if shape == "sub":
            a, b = max(a, b), min(a, b)
            b = b if b != a else b - 1
        return {"a": a, "b": b}, [a, b], f"{a}{SHAPE_OPS[shape]}{b}", a + b if shape == "add" else a - b
    if shape == "mul":
        x, y = rng.randint(3, 29), rng.randint(12, 99)
        return {"x": x, "y": y}, [x, y], f"{x}*{y}", x * y
    if shape == "add_sub":
        a, b = rng.randint(200, 999), rng.randint(100, 999)
        c = rng.randint(100, min(999, a + b - 1))
        return {"a": a, "b": b, "c": c}, [a, b, c], f"{a}+{b}-{c}", a + b - c
    if shape in ("mul_add", "mul_sub"):
        x, y = rng.randint(3, 19), rng.randint(12, 60)
        if shape == "mul_add":
            c = rng.randint(100, 999)
            return {"x": x, "y": y, "c": c}, [c, x, y], f"{c}+{x}*{y}", c + x * y
        c = x * y + rng.randint(50, 999)
        return {"x": x, "y": y, "c": c}, [c, x, y], f"{c}-{x}*{y}", c - x * y
    if shape == "add_mul":
        a, b, x = rng.randint(11, 60), rng.randint(11, 60), rng.randint(3, 19)
        return {"a": a, "b": b, "x": x}, [a, b, x], f"({a}+{b})*{x}", (a + b) * x
    if shape == "sub_mul":
        a, x = rng.randint(30, 99), rng.randint(3, 19)
        b = rng.randint(11, a - 11)
        return {"a": a, "b": b, "x": x}, [a, b, x], f"({a}-{b})*{x}", (a - b) * x
    if shape == "mul_less":
        x, y = rng.randint(3, 19), rng.randint(12, 60)
        c = rng.randint(10, min(999, x * y - 10))
        return {"x": x, "y": y, "c": c}, [x, y, c], f"{x}*{y}-{c}", x * y - c
    raise ValueError(f"unknown shape {shape!r}")


def text_order_expression(template: str, shape: str, slots: dict[str, int]) -> str:
    """The problem's expression with the operands of each `+` and `*` in the order the question states them (the
    canonical 207+5*43 is 5*43+207 for "Full trays: 5. Eggs per tray: 43. Loose eggs: 207."); a `-` keeps its
    order, whatever the wording ("Take 12 away from 30" is 30-12)."""
    at = {slot: template.find("{" + slot + "}") for slot in slots}
    in_text = lambda *names: sorted(names, key=lambda n: at[n])  # noqa: E731
    commutative = lambda op, *names: op.join(str(slots[n]) for n in in_text(*names))  # noqa: E731
    if shape in ("add", "mul"):
        return commutative(SHAPE_OPS[shape], *slots)
    if shape == "sub":
        return f"{slots['a']}-{slots['b']}"
    if shape == "add_sub":
        return f"{commutative('+', 'a', 'b')}-{slots['c']}"
    if shape == "mul_sub":
        return f"{slots['c']}-{commutative('*', 'x', 'y')}"
    if shape == "mul_add":
        product = commutative("*", "x", "y")
        return f"{slots['c']}+{product}" if at["c"] < min(at["x"], at["y"]) else f"{product}+{slots['c']}"
    if shape in ("add_mul", "sub_mul"):
        total = f"({commutative('+', 'a', 'b')})" if shape == "add_mul" else f"({slots['a']}-{slots['b']})"
        return f"{slots['x']}*{total}" if at["x"] < min(at["a"], at["b"]) else f"{total}*{slots['x']}"
    if shape == "mul_less":
        return f"{commutative('*', 'x', 'y')}-{slots['c']}"
    raise ValueError(f"unknown shape {shape!r}")


def insert_sentence(question: str, sentence: str, rng: random.Random) -> str:
    """`sentence` put before one of the question's sentences (never after the last: the question stays last)."""
    parts = re.split(r"(?<=[.?]) ", question)
    at = rng.randint(0, len(parts) - 1)
    return " ".join(parts[:at] + [sentence] + parts[at:])


def word_problem(rng: random.Random, split: str, two_step_share: Optional[float] = None) -> dict[str, Any]:
    """One problem of `split` (a key of SPLITS); `two_step_share` sets how often its shape is a two-step one (default:
    as the split's shape list draws them, 1 in 4 for training)."""
    spec = SPLITS[split]
    if two_step_share is None:
        shape = rng.choice(spec["shapes"])
    else:
        two_step = rng.random() < two_step_share
        shape = rng.choice([s for s in spec["shapes"] if (len(SHAPE_OPS[s]) == 2) == two_step])
    family = rng.choice(sorted(f for f, shapes in spec["families"].items() if shape in shapes))
    slots, operands, expression, answer = shape_numbers(rng, shape)
    n, m, k = rng.sample(NAMES, 3)
    template = rng.choice(spec["families"][family][shape])
    question = template.format(n=n, m=m, k=k, it=rng.choice(ITEMS), **slots)
    distractor: Optional[int] = None
    if spec["distractors"] and rng.random() < spec["distractor_rate"]:
        distractor = rng.choice([d for d in range(10, 1000) if d not in operands and d != answer])
        question = insert_sentence(question, rng.choice(spec["distractors"]).format(n=n, d=distractor), rng)
    return {"question": question, "answer": answer, "expression": expression,
            "text_order_expression": text_order_expression(template, shape, slots), "ops": SHAPE_OPS[shape],
            "operands": operands, "distractor": distractor, "family": family, "shape": shape}  # fmt: skip


def word_problem_rows(
    n: int, seed: int, split: str, system_prompt: Optional[str] = None, two_step_share: Optional[float] = None
) -> list[dict[str, Any]]:
    """RL / evaluation rows of `split`: messages (the system prompt first when given), ground_truth for the
    `arithmetic` verifier, and the problem's metadata under `problem` (for the demo's call analysis)."""
    rng = random.Random(f"{split}-{seed}")
    rows = []
    for i in range(n):
        p = word_problem(rng, split, two_step_share)
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": p["question"]}
        ]
        rows.append({"id": f"word-{split}-{seed}-{i}", "messages": messages, "ground_truth": str(p["answer"]),
                     "dataset": "arithmetic", "problem": p})  # fmt: skip
    return rows


SYMBOLIC_TEMPLATES = ["Compute {e}.", "What is {e}?", "Calculate {e}."]


def symbolic_problem(rng: random.Random) -> dict[str, Any]:
    """A problem of a training shape written as the expression itself ("What is 340+5*12?"): what a cold start that
    teaches only the call's format shows the model, with no word to translate."""
    shape = rng.choice(ONE_STEP * 2 + TWO_STEP_TRAINED)
    _, operands, expression, answer = shape_numbers(rng, shape)
    question = rng.choice(SYMBOLIC_TEMPLATES).format(e=expression)
    return {"question": question, "answer": answer, "expression": expression, "text_order_expression": expression,
            "ops": SHAPE_OPS[shape], "operands": operands, "distractor": None, "family": "symbolic",
            "shape": shape}  # fmt: skip


def first_step(expression: str) -> re.Match:
    """Where a two-step expression's first step is: the bracket, else the product, else the leading sum (group 1 is
    the step without its brackets)."""
    patterns = (r"\((\d+[-+]\d+)\)", r"(\d+\*\d+)", r"^(\d+\+\d+)")  # in this order of precedence
    return next(m for m in (re.search(pattern, expression) for pattern in patterns) if m)


def grouped_expression(problem: dict[str, Any], text_order: bool = False) -> str:
    """The problem's expression (`text_order`: its text_order_expression) with the step computed first in brackets
    (577+818-753: `(577+818)-753`; 5*43+207: `(5*43)+207`); a one-step expression as it is. The training shapes
    written this way show the bracket that the held-out (a+b)*x needs without showing that shape."""
    written = problem["text_order_expression" if text_order else "expression"]
    if len(SHAPE_OPS[problem["shape"]]) == 1:
        return written
    step = first_step(written)
    return f"{written[: step.start()]}({step.group(1)}){written[step.end() :]}"


def chained_steps(problem: dict[str, Any], text_order: bool = False) -> list[tuple[str, int]]:
    """The calculator calls that solve `problem` one step at a time, each (expression, result): a one-step problem
    is its expression; a two-step one is its inner step (the bracket, else the product, else the leading sum) first,
    then the expression with that step's result in its place (577+818-753: `577+818` -> 1395, then `1395-753`;
    207+5*43: `5*43` -> 215, then `207+215`). `text_order`: of the problem's text_order_expression (5*43+207:
    `5*43`, then `215+207`)."""
    from open_instruct.environments import calculate

    written = problem["text_order_expression" if text_order else "expression"]
    if len(SHAPE_OPS[problem["shape"]]) == 1:
        return [(written, problem["answer"])]
    inner = first_step(written)
    step = inner.group(1)
    value = int(calculate(step))
    return [(step, value), (written[: inner.start()] + str(value) + written[inner.end() :], problem["answer"])]


def calculator_traces(
    n: int,
    seed: int,
    task: str,
    chain: bool = False,
    two_step_share: Optional[float] = None,
    text_order: bool = False,
    split: str = "train",
    grouped: bool = False,
) -> list[dict[str, Any]]:
    """Cold-start SFT traces: the question, an assistant turn calling the calculator with the problem's expression
    (OpenAI-style `tool_calls`), the tool's result, and the final answer (the number). `task` "symbolic": questions
    written as expressions (the format only); "word": word problems of the training families. With `chain`, a
    two-step problem takes two calls, the second on the first one's result (`chained_steps`). `two_step_share`:
    as word_problem's (default: 1 in 4 two-step). `text_order`: the calls write each sum's and product's operands
    in the order the question states them (`text_order_expression`), not the canonical order. `split`: the training
    split the word problems come from (a `training_split` key). `grouped`: a two-step call brackets its first step
    (`grouped_expression`; one-call traces only)."""
    from demo.synthetic import calculator_call

    if task not in ("symbolic", "word"):
        raise ValueError(f"task must be 'symbolic' or 'word', got {task!r}")
    if grouped and chain:
        raise ValueError("grouped brackets the first step of a one-call trace; chained traces call each step alone")
    rng = random.Random(f"sft-{task}-{seed}")
    rows = []
    for i in range(n):
        p = symbolic_problem(rng) if task == "symbolic" else word_problem(rng, split, two_step_share)
        messages: list[dict[str, Any]] = [{"role": "user", "content": p["question"]}]
        whole = p["text_order_expression" if text_order else "expression"]
        whole = grouped_expression(p, text_order) if grouped else whole
        for expression, result in chained_steps(p, text_order) if chain else [(whole, p["answer"])]:
            messages.append({"role": "assistant", "content": "", "tool_calls": [calculator_call(expression)]})
            messages.append({"role": "tool", "content": str(result)})
        messages.append({"role": "assistant", "content": str(p["answer"])})
        rows.append({"id": f"calculator-sft-{task}-{seed}-{i}", "messages": messages})
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# What the model's calculator calls did (held-out analysis of demo/smollm2_tools.py)

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_NUMBER = re.compile(r"\d+")
_OPERATION = re.compile(r"\d\s*[-+*/]\s*\(?\s*\d")  # an operator between two numbers
FAILURES = {  # the taxonomy of wrong answers, in the order an episode is classified
    "no_call": "no call: answered without the calculator",
    "words_in_call": 'no well-formed call, and words in the expression ("29 chairs", "27. Cans per box")',
    "malformed": "no well-formed call (unparseable, not the calculator, or an expression it rejects)",
    "right_call_wrong_answer": "a call computed the answer, but the final answer was wrong or missing",
    "copied_number": "the calls hold no operation: a number copied into the calculator",
    "distractor": "a call used the irrelevant number",
    "foreign_number": "a call used a number that is not in the problem (nor a tool result)",
    "wrong_operation": "the calls' operations are not the problem's",
    "one_step_of_two": "two-step problem: the calls did only one of the steps",
    "operand_repeated_or_missing": "the right operations on the problem's numbers, one repeated or left out (41*41)",
    "reversed": "the problem's numbers and operations, in the wrong order (473-909 for 909-473)",
    "other": "the problem's numbers and operations, grouped otherwise",
}


def call_numbers(call: dict[str, Any]) -> list[int]:
    return [int(t) for t in _NUMBER.findall(call["expression"])]


def parse_calls(actions: list[str]) -> list[dict[str, Any]]:
    """The calculator calls of an episode's turns: each {"expression", "well_formed", "value"} (value None when the
    call is not well formed); a `<tool_call>` opened and never closed counts as a malformed call."""
    import json

    from open_instruct.environments import ToolError, calculate

    calls = []
    for action in actions:
        bodies = _CALL.findall(action)
        if action.count("<tool_call>") > len(bodies):
            calls.append({"expression": None, "well_formed": False, "value": None})
        for body in bodies:
            expression, value = None, None
            try:
                call = json.loads(body)
                if call.get("name") == "calculator" and isinstance(call.get("arguments"), dict):
                    expression = call["arguments"].get("expression")
                    value = float(calculate(expression)) if isinstance(expression, str) else None
            except (ValueError, TypeError, AttributeError, ToolError):
                value = None
            calls.append({"expression": expression, "well_formed": value is not None, "value": value})
    return calls


def episode_analysis(problem: dict[str, Any], prediction: dict[str, Any]) -> dict[str, Any]:
    """What one held-out episode's calls did, and (for a wrong answer) which FAILURES entry it falls under."""
    calls = parse_calls(prediction.get("actions", []))
    good = [c for c in calls if c["well_formed"]]
    ops_used = {ch for c in good for ch in c["expression"] if ch in "+-*/"}
    numbers_used = {int(t) for c in good for t in _NUMBER.findall(c["expression"])}
    known = set(problem["operands"]) | {c["value"] for c in good}
    result = {
        "calls": len(calls),
        "well_formed_calls": len(good),
        "right_operation": bool(good) and ops_used == set(problem["ops"]),
        "two_calls": len({c["expression"].replace(" ", "") for c in good}) >= 2,  # a repeated call is one
        # a step on an earlier step's result: both calls compute (a copied number is no step)
        "chained": any(
            c["value"] in call_numbers(later)
            for i, c in enumerate(good)
            for later in good[i + 1 :]
            if _OPERATION.search(c["expression"]) and _OPERATION.search(later["expression"])
        ),
        "failure": None,
    }
    if prediction["correct"]:
        return result
    if not calls:
        failure = "no_call"
    elif not good:
        failure = "words_in_call" if any(re.search("[A-Za-z]", c["expression"] or "") for c in calls) else "malformed"
    elif any(c["value"] == problem["answer"] for c in good):
        failure = "right_call_wrong_answer"
    elif not ops_used:
        failure = "copied_number"
    elif problem.get("distractor") is not None and problem["distractor"] in numbers_used:
        failure = "distractor"
    elif numbers_used - known:
        failure = "foreign_number"
    elif len(problem["ops"]) == 2 and ops_used and ops_used < set(problem["ops"]):
        failure = "one_step_of_two"
    elif ops_used != set(problem["ops"]):
        failure = "wrong_operation"
    elif len(good) == 1 and sorted(call_numbers(good[0])) != sorted(problem["operands"]):
        failure = "operand_repeated_or_missing"
    elif len(good) == 1 and len(problem["ops"]) == 1:
        failure = "reversed"
    else:
        failure = "other"
    result["failure"] = failure
    return result


def call_report(problems: list[dict[str, Any]], predictions: list[dict[str, Any]]) -> dict[str, Any]:
    """Per held-out set: calls per episode, the share of calls that are well formed, the share of episodes with a
    call whose calls carry exactly the problem's operations, two-call episodes, episodes with a call on an earlier
    call's result (chained), and the failure counts."""
    rows = [episode_analysis(problems[p["row"]], p) for p in predictions]
    n, calls = len(rows), sum(r["calls"] for r in rows)
    with_call = [r for r in rows if r["well_formed_calls"]]
    failures = {k: sum(r["failure"] == k for r in rows) for k in FAILURES}
    return {
        "calls_per_episode": calls / n,
        "well_formed_share": sum(r["well_formed_calls"] for r in rows) / calls if calls else 0.0,
        "right_operation_share": sum(r["right_operation"] for r in with_call) / len(with_call) if with_call else 0.0,
        "two_call_episodes": sum(r["two_calls"] for r in rows) / n,
        "chained_episodes": sum(r["chained"] for r in rows) / n,
        "failures": {k: v for k, v in failures.items() if v},
    }
