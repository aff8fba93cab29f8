"""The demo pipeline (demo/pipeline.py --quick): SFT -> reward model -> DPO -> RLVR, each a real run of the real
script on a tiny model built locally, then held-out accuracy, plots and a summary.

One run (module fixture) is shared by the tests. The results are not bit-identical across machines (torch picks
its CPU kernels by instruction set, and their rounding differs), so the tests assert a band: each stage's floor is
the lowest value measured over several seeds and kernel paths (`QUICK_MEASURED`,
docs/demos.md#the-tiny-pipeline-make-demo) less a stated margin, and every gain must be significant problem by
problem."""

import json
import os
import random

import pytest

from demo import pipeline as demo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"
    summary = demo.main(["--quick", "--output_dir", str(out), "--quiet"])
    print(summary["report"])
    return out, summary


def acc(summary, name):
    return summary["accuracy"][name]["accuracy"]


def test_every_stage_ran_its_script_and_wrote_a_model(quick_run):
    out, _ = quick_run
    for stage in demo.STAGES:
        assert os.path.isfile(out / stage.name / "final_model" / "config.json"), stage.name
        rows = demo.read_metrics(str(out / stage.name))
        assert rows, f"{stage.name} logged nothing"
        log = (out / "logs" / f"{stage.name}.log").read_text(errors="replace")
        assert f"open_instruct/{stage.script} configs/demo/{stage.recipe}" in log.splitlines()[0]
        assert "it/s" in log or "step/s" in log or "s/step" in log, f"{stage.name}: no progress bar in its output"
    with open(out / "rm" / "final_model" / "config.json") as f:
        assert json.load(f)["architectures"] == ["LlamaForSequenceClassification"]


# The --quick stages with seeds 0, 1, 2 (`python -m demo --quick --seed S`: data and initial weights), each under
# ATEN_CPU_CAPABILITY=avx512 and =avx2 on one AVX-512 machine, one torch thread, 2026-11-26, as far as the shared
# machine allowed (the runs per stage are listed): (min, median, max) held-out accuracy (policies: 1000 problems,
# greedy; reward model: 1000 pairs). Each run is in docs/demos.md. The seed moves SFT by up to 25 points, the kernel
# path by under 1 (seed 0: 49.3% / 48.8%; seed 2: 32.7% / 32.4%).
QUICK_MEASURED = {
    "sft": (0.324, 0.490, 0.579),  # 6 run(s): 0/avx512, 0/avx2, 1/avx512, 1/avx2, 2/avx512, 2/avx2 (seed/kernels)
    "dpo": (0.338, 0.577, 0.611),  # 6 run(s): 0/avx512, 0/avx2, 1/avx512, 1/avx2, 2/avx512, 2/avx2 (seed/kernels)
    "rlvr": (0.447, 0.654, 0.730),  # 6 run(s): 0/avx512, 0/avx2, 1/avx512, 1/avx2, 2/avx512, 2/avx2 (seed/kernels)
    "rm": (0.660, 0.768, 0.842),  # 6 run(s): 0/avx512, 0/avx2, 1/avx512, 1/avx2, 2/avx512, 2/avx2 (seed/kernels)
}
# A floor is the measured minimum less MARGIN: 5 points, three binomial standard errors of an accuracy near 50% on
# 1000 items (sqrt(0.25 / 1000) = 1.6 points), so that a machine or seed not measured, whose run lands a little
# below the measured ones, still passes, while a stage that stops learning (base-level or chance-level) fails.
MARGIN = 0.05


def floor(stage: str) -> float:
    return QUICK_MEASURED[stage][0] - MARGIN


def test_accuracy_rises_over_the_pipeline(quick_run):
    _, summary = quick_run
    n = summary["accuracy"]["base"]["total"]
    assert n >= 200
    assert {summary["accuracy"][k]["total"] for k in demo.POLICIES} == {n}  # the same held-out problems for every row
    assert acc(summary, "base") <= 0.05  # random weights: no arithmetic
    for stage in ("sft", "dpo", "rlvr"):
        assert acc(summary, stage) >= floor(stage), (stage, acc(summary, stage), floor(stage))
    # DPO and then RLVR must each add accuracy, problem by problem and not by luck of the draw. Measured for the
    # test's seed 0: DPO +145 / -60 (p = 3e-9) with AVX-512 kernels, +151 / -63 (p = 2e-9) with AVX2; RLVR (--quick)
    # +196 / -115 (p = 5e-6) with AVX-512, +205 / -128 (p = 3e-5) with AVX2. Other seeds gain less from DPO (seed 1:
    # p = 0.06 / 0.67; seed 2: p = 8e-6 / 0.35), so this check holds for the test's seed, not for any seed.
    for before, after in (("sft", "dpo"), ("dpo", "rlvr")):
        change = summary["paired_vs_previous"][after]
        assert change == demo.paired_change(*(os.path.join(quick_run[0], "eval", k) for k in (before, after)))
        assert change["fixed"] > change["broken"] and change["p_value"] < 0.01, (before, after, change)


def test_reward_model_learns_the_check_on_held_out_pairs(quick_run):
    _, summary = quick_run
    rm = summary["reward_model"]
    assert rm["total"] >= 200
    assert rm["accuracy"] >= floor("rm"), (rm["accuracy"], floor("rm"))
    assert rm["ci95"][0] > 0.5 and rm["mean_margin"] > 0  # whatever the floor: the whole 95% interval above chance


def test_plots_and_summary_files(quick_run):
    out, summary = quick_run
    for path in summary["artifacts"].values():
        if "<" not in path:
            assert os.path.exists(path), path
    for name in ("losses.png", "reward_model_and_dpo.png", "rlvr.png", "accuracy.png"):
        data = (out / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    md = (out / "summary.md").read_text()
    for title in ("base (random init)", "SFT", "DPO (from SFT)", "RLVR (from DPO)", "reward model"):
        assert title in md
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["accuracy"]["rlvr"]["correct"] == summary["accuracy"]["rlvr"]["correct"]
    assert on_disk["quick"] is True


def test_broad_family_held_out_problems_are_new_in_phrasing_and_range():
    """The SmolLM2 demo's generalisation check: held-out problems share no template and (for + and -) no operand
    range with training, and every ground truth is the true result."""
    import re

    from demo.synthetic import BROAD_TEMPLATES, broad_problem

    rng = random.Random(0)
    for split in ("train", "held_out"):
        for _ in range(300):
            p = broad_problem(rng, split)
            a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=\d+", p["work"]).groups()
            a, b = int(a), int(b)
            assert p["answer"] == {"+": a + b, "-": a - b, "*": a * b}[op] >= 0
            if op in "+-":
                assert (max(a, b) <= 30) == (split == "train") and (min(a, b) >= 31) == (split == "held_out")
    train = {t for ts in BROAD_TEMPLATES["train"].values() for t in ts}
    held_out = {t for ts in BROAD_TEMPLATES["held_out"].values() for t in ts}
    assert not train & held_out
