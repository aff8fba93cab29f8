"""IFBench scoring without a model: real IFBench samples with hand-written responses, loose mode, nltk skips."""

import json

import pytest

pytest.importorskip("if_verifiable", reason="IFBench eval deps: pip install -r requirements-eval.txt")
pytest.importorskip("ifbench", reason="IFBench prompts: pip install -r requirements-eval.txt")

from eval import ifbench  # noqa: E402
from eval.ifbench import (  # noqa: E402
    NLTK_NEEDS,
    format_report,
    load_ifbench,
    metrics_dict,
    missing_nltk_resources,
    score_response,
    summarize,
)

NOTHING_MISSING: set = set()


@pytest.fixture(scope="module")
def samples():
    rows = load_ifbench()
    return {r["key"]: r for r in rows}


def _strict(sample, response, missing=NOTHING_MISSING):
    (score,) = score_response(sample, response, missing)
    assert score.status == "scored"
    return score.strict


def test_test_file_is_complete(samples):
    assert len(samples) == 294
    registry = ifbench.ifbench_registry()
    ids = {i for r in samples.values() for i in r["instruction_id_list"]}
    assert ids <= set(registry)  # every instruction has a checker
    assert set(NLTK_NEEDS) <= ids  # the nltk map names real instruction ids


@pytest.mark.parametrize(
    "key,good,bad",
    [
        (  # count:keywords_multiple: kaleidoscope x1, nebula x2, whisper x3, labyrinth x5, paradox x7
            "0",
            "kaleidoscope " + "nebula " * 2 + "whisper " * 3 + "labyrinth " * 5 + "paradox " * 7,
            "kaleidoscope nebula whisper labyrinth paradox",
        ),
        (  # format:output_template
            "292",
            "My Answer: pain. My Conclusion: stop it. Future Outlook: better.",
            "Suffering on a cosmic scale is hard to describe.",
        ),
        ("296", "No,notallclassesaresets;allsetsareclasses.", "No, not all classes are sets."),  # no_whitespace
        ("82", "Save half\nSEPARATOR consume half\nSEPARATOR repeat", "- save half\n- consume half"),  # format:list
    ],
)
def test_real_samples_strict(samples, key, good, bad):
    assert _strict(samples[key], good) is True
    assert _strict(samples[key], bad) is False


def test_loose_accepts_response_without_its_first_line(samples):
    (score,) = score_response(samples["296"], "Here you go:\nNo,setsareclasses.", NOTHING_MISSING)
    assert score.strict is False and score.loose is True


def test_empty_response_fails_every_instruction(samples):
    (score,) = score_response(samples["292"], "   ", NOTHING_MISSING)
    assert score.status == "scored" and score.strict is False and score.loose is False


def test_missing_nltk_data_is_skipped_not_failed():
    sample = {
        "key": "x",
        "prompt": "Keep stop words under 40%. Do not use whitespace.",
        "instruction_id_list": ["ratio:stop_words", "format:no_whitespace"],
        "kwargs": [{"percentage": 40}, {}],
    }
    scores = score_response(sample, "Cats,dogs,birds.", missing_nltk={"corpora/stopwords"})
    assert [s.status for s in scores] == ["skipped", "scored"]
    assert "stopwords" in scores[0].skip_reason and scores[0].strict is None
    assert scores[1].strict is True

    summary = summarize([scores, score_response(sample, "a b", missing_nltk={"corpora/stopwords"})])
    m = metrics_dict(summary)
    assert m["instructions_scored"] == 2 and m["instructions_skipped"] == 2
    assert m["inst_level_strict"] == 0.5
    assert m["prompts_scored"] == 0 and m["prompts_left_out"] == 2  # a prompt with a skipped instruction is left out
    assert m["skipped_by_instruction"]["ratio:stop_words"]["count"] == 2
    report = format_report(summary)
    assert "SKIPPED 2 instructions" in report and "ratio:stop_words" in report


def test_nltk_lookup_error_at_check_time_is_skipped(samples, monkeypatch):
    checker = ifbench.ifbench_registry()["format:no_whitespace"]

    def needs_punkt(self, value):
        raise LookupError("\n  Resource 'punkt_tab' not found.\n  Please use the NLTK Downloader")

    monkeypatch.setattr(checker, "check_following", needs_punkt)
    (score,) = score_response(samples["296"], "abc", NOTHING_MISSING)
    assert score.status == "skipped" and "punkt_tab" in score.skip_reason


def test_missing_nltk_lookup():
    assert missing_nltk_resources(["corpora/surely_not_installed_here"]) == {"corpora/surely_not_installed_here"}
    found = missing_nltk_resources()
    assert found <= set(ifbench.NLTK_RESOURCES)


def test_predictions_round_trip_through_json(samples):
    scores = score_response(samples["0"], "kaleidoscope", NOTHING_MISSING)
    row = json.loads(json.dumps({"results": [s.__dict__ for s in scores]}))
    assert row["results"][0]["instruction_id"] == "count:keywords_multiple"


class _FakeTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)


class _FakeGenerator:
    """Greedy-like: prompt [k, ...] answers k, k+1, ... up to max_new_tokens; prompts starting with 0 stop at 3."""

    def __init__(self):
        self.tokenizer = _FakeTokenizer()
        self.calls = 0

    def generate(self, prompt_ids, config):
        from open_instruct.generation import GenerationOutput

        self.calls += len(prompt_ids)
        out = GenerationOutput(prompt_ids=prompt_ids)
        for i, p in enumerate(prompt_ids):
            stop = p[0] == 0 and config.max_new_tokens >= 3
            ids = list(range(p[0], p[0] + (3 if stop else config.max_new_tokens)))
            out.response_ids.append(ids)
            out.texts.append(self.tokenizer.decode(ids))
            out.stopped.append(stop)
            out.prompt_index.append(i)
        return out


def test_generation_cache_resumes_and_cuts_longer_budgets(tmp_path):
    cache = str(tmp_path / "gen.jsonl")
    prompts = [[0, 9], [5], [7, 7, 7]]
    gen = _FakeGenerator()
    a = ifbench.generate_responses(gen, prompts, 6, block=2, cache_path=cache, cache_tag="m", log=lambda m: None)
    assert gen.calls == 3 and a.response_ids[1] == [5, 6, 7, 8, 9, 10] and a.stopped == [True, False, False]
    b = ifbench.generate_responses(gen, prompts, 6, block=2, cache_path=cache, cache_tag="m", log=lambda m: None)
    assert gen.calls == 3 and b.response_ids == a.response_ids  # all reused
    c = ifbench.generate_responses(gen, prompts, 4, block=2, cache_path=cache, cache_tag="m", log=lambda m: None)
    assert gen.calls == 3  # a shorter greedy budget is a cut of the longer one
    assert c.response_ids == [[0, 1, 2], [5, 6, 7, 8], [7, 8, 9, 10]] and c.stopped == [True, False, False]
    assert c.texts[1] == "fghi"
    ifbench.generate_responses(gen, prompts, 8, block=2, cache_path=cache, cache_tag="m", log=lambda m: None)
    assert gen.calls == 6  # a longer budget regenerates
    ifbench.generate_responses(gen, prompts, 4, block=2, cache_path=cache, cache_tag="other", log=lambda m: None)
    assert gen.calls == 9  # another model never reuses
