"""eval-speedup's results: runs pooled into rows, the go/no-go verdict, report.json and what is printed
and logged of it (report.md and the plots: decode/report.py)."""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml

from common.config import config_to_dict
from common.models import param_count
from common.precision import machine_class
from common.provenance import git_revision
from decode.drafts.feature.model import FeatureDraft
from decode.report import write_markdown, write_plots
from decode.stats import SpeculativeStats, predicted_speedup
from decode.timing import timing_reliability, verify_cost
from decode.vocab import VocabSubset


if TYPE_CHECKING:
    from decode.eval_speedup import Setup


def draft_kind(proposer: str) -> str:
    """'draft' (standalone) or 'feature' from a report's proposer name ('feature+lookup' -> 'feature')."""
    return proposer.split("+")[0]


def aggregate(runs: list[dict], costs: dict[str, dict]) -> list[dict]:
    """One row per (prompt set, temperature, proposer, k): pooled tokens/s and merged acceptance statistics,
    predicted by the cost model of the proposer's draft kind (costs: by draft_kind)."""
    def key(r: dict) -> tuple:
        return r["prompt_set"], r["temperature"], r["proposer"], r["k"], r.get("tree") or ""

    rows = []
    for prompt_set, temperature, proposer, k, tree in sorted({key(r) for r in runs}):
        group = [r for r in runs if key(r) == (prompt_set, temperature, proposer, k, tree)]
        stats = SpeculativeStats(k=k)
        for r in group:
            stats = stats.merge(SpeculativeStats.from_dict(r["stats"]))
        base_tok_s = sum(r["baseline_tokens"] for r in group) / sum(r["baseline_s"] for r in group)
        spec_tok_s = sum(r["speculative_tokens"] for r in group) / sum(r["speculative_s"] for r in group)
        cost = costs[draft_kind(proposer)]
        # Verified per target forward: k drafted tokens for a chain, the tree's nodes (fewer near the end).
        verified = stats.proposed / stats.target_forwards if stats.target_forwards else 0.0
        # Reports from before r_tree was measured price trees by r.
        r_block = (verify_cost(cost.get("r_tree", cost["r"]), max(verified, 1.0)) if tree else
                   cost["r"][k] if k in cost["r"] else verify_cost(cost["r"], max(verified, 1.0)))
        predicted = predicted_speedup(stats.tau, stats.draft_steps_per_forward, cost["c"], r_block)
        speedup = spec_tok_s / base_tok_s
        greedy = [r["greedy_identical"] for r in group if r["greedy_identical"] is not None]
        rows.append({
            "prompt_set": prompt_set, "temperature": temperature, "proposer": proposer, "k": k, "tree": tree or None,
            "verified_per_forward": verified, "target_forwards": stats.target_forwards,
            "n_prompts": len(group), "looked_up": stats.looked_up, "looked_up_accepted": stats.looked_up_accepted,
            "draft_steps_per_forward": stats.draft_steps_per_forward,
            "alpha": stats.alpha, "token_acceptance": stats.token_acceptance, "tau": stats.tau, "per_position_acceptance": stats.per_position_acceptance,
            "accept_length_hist": stats.accept_length_hist,
            "baseline_tok_s": base_tok_s, "speculative_tok_s": spec_tok_s, "speedup": speedup,
            "speedup_per_prompt": {"median": statistics.median(r["speedup"] for r in group),
                                   "min": min(r["speedup"] for r in group), "max": max(r["speedup"] for r in group)},
            "predicted_speedup": predicted,
            "measured_over_predicted": speedup / predicted if predicted else None,
            "greedy_identical": all(greedy) if greedy else None,
        })
    return rows

def verdict(results: list[dict], reliability: dict) -> str:
    """GO / NO-GO from the best row, or withheld when a busy machine made the timings unreliable."""
    if not reliability["reliable"]:
        return ("VERDICT WITHHELD: timings unreliable: machine busy (see timing reliability); "
                "rerun eval-speedup on an otherwise idle machine before trusting any speedup here.")
    best = max(results, key=lambda r: r["speedup"])
    if best["speedup"] > 1.05:
        which = "the feature draft" if draft_kind(best["proposer"]) == "feature" else "this draft"
        return (f"GO: {which}{' with prompt lookup' if '+lookup' in best['proposer'] else ''} speeds up "
                f"this target here by {best['speedup']:.2f}× at k={best['k']} "
                f"(T={best['temperature']}, {best['prompt_set']}; α={best['alpha']:.2f}, τ={best['tau']:.2f}).")
    return (f"NO-GO: best measured speedup {best['speedup']:.2f}× (k={best['k']}, T={best['temperature']}, "
            f"{best['prompt_set']}); target-only decoding is as fast or faster here.")

def build_report(s: Setup, argv: list[str] | None, costs: dict[str, dict], costs_end: dict[str, dict],
                 results: list[dict], hf_rows: list[dict], runs: list[dict]) -> dict:
    """report.json. cost_model / cost_model_end: the standalone draft's (the feature draft's when it is
    measured alone), which the timing-reliability check reads; feature_cost_model: the feature draft's."""
    cfg = s.cfg
    target_params = param_count(s.target)
    standalone, feature = s.draft is not None, s.feature is not None
    kind = "draft" if standalone else "feature"
    report = {
        "command": " ".join(["python -m decode.bench"] + (argv if argv is not None else sys.argv[1:])),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": machine_class(s.device), "dtype": s.dtype.as_record(), "git_sha": git_revision() or "unknown",
        "backend": type(s.target_runner).__name__,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__},
        "config": config_to_dict(cfg), "max_new_tokens": cfg.eval.max_new_tokens,
        "target": {"ref": cfg.target, "params": target_params},
        "draft": draft_record(cfg.draft, s.draft, target_params) if standalone else None,
        "feature_draft": (draft_record(cfg.eval.feature_draft if standalone else cfg.draft, s.feature, target_params)
                          if feature else None),
        "prompt_sets": {name: [p.prompt_id for p in prompts] for name, prompts in s.prompt_sets.items()},
        "cost_model": costs[kind], "cost_model_end": costs_end[kind],
        "feature_cost_model": {"start": costs["feature"], "end": costs_end["feature"]} if feature else None,
        "results": results, "hf": hf_rows, "runs": runs,
    }
    report["timing_reliability"] = timing_reliability(report, s.device.type)
    report["verdict"] = verdict(results, report["timing_reliability"])
    return report

def draft_record(ref: str, model: torch.nn.Module, target_params: int) -> dict:
    """A draft's reference, size (every weight it adds) and vocabulary subset, for the report header."""
    params = param_count(model)
    if isinstance(model, FeatureDraft):
        subset, layers = model.config.draft_vocab_size, model.config.target_layers
    else:
        vocab = VocabSubset.from_config(model.config)
        subset, layers = (vocab.size if vocab is not None else None), None
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(next(model.parameters()).dtype, "other")
    return {"ref": ref, "params": params, "param_ratio": params / target_params, "vocab_subset": subset,
            "target_layers": layers, "dtype": dtype, "recipe": training_recipe(Path(ref))}


def training_recipe(folder: Path) -> dict | None:
    """How `make distill` trained the draft in `folder` (the config.yaml and metrics.json it writes beside the
    weights), for the report to say what it measured; None for a folder from elsewhere."""
    if not (folder / "config.yaml").is_file():
        return None
    distill = (yaml.safe_load((folder / "config.yaml").read_text()) or {}).get("distill") or {}
    metrics = json.loads((folder / "metrics.json").read_text()) if (folder / "metrics.json").is_file() else {}
    return {"loss": distill.get("loss"), "steps": metrics.get("step", distill.get("max_steps")),
            "examples_per_step_per_rank": distill.get("micro_batch_size", 0) * distill.get("grad_accum", 1),
            "data_dirs": distill.get("data_dirs"), "data_weights": distill.get("data_weights") or None,
            "init": distill.get("init"), "vocab_subset": distill.get("vocab_subset"),
            "outside_rank": distill.get("outside_rank", 0), "filter_hardest": distill.get("filter_hardest", 0.0),
            "ema_decay": distill.get("ema_decay", 0.0),
            "seconds": metrics.get("elapsed_s"), "machine": (metrics.get("precision") or {}).get("machine")}

def log_to_wandb(tracker, report: dict) -> None:
    for row in report["results"]:
        tracker.log({f"{row['prompt_set']}/T{row['temperature']}/{row['proposer']}/k{row['k']}/{m}": row[m]
                     for m in ("alpha", "tau", "speedup", "predicted_speedup") if row[m] is not None})
    tracker.summary.update({"verdict": report["verdict"], "c": report["cost_model"]["c"],
                            "timing_reliable": report["timing_reliability"]["reliable"]})
    tracker.finish()

def write_outputs(report: dict, samples: list[dict], out_dir: Path) -> None:
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    with open(out_dir / "samples.jsonl", "w") as f:
        for sample in samples:
            f.write(json.dumps(sample) + "\n")
    write_markdown(report, out_dir / "report.md")
    write_plots(report, out_dir)

def print_headline(report: dict, out_dir: Path) -> None:
    reliability = report["timing_reliability"]
    if not reliability["reliable"]:
        print("\ntimings unreliable: machine busy; the go/no-go verdict is withheld:")
        for reason in reliability["reasons"]:
            print(f"  - {reason}")
    print(f"\n{'prompts':<22}{'T':>5}{'proposer':>16}{'k':>4}  {'tree':<34}{'alpha':>6}{'tau':>7}{'speedup':>9}"
          f"{'pred':>7}  greedy-identical")
    for r in report["results"]:
        same = "-" if r["greedy_identical"] is None else str(r["greedy_identical"])
        pred = f"{r['predicted_speedup']:.2f}" if r["predicted_speedup"] else "-"
        print(f"{r['prompt_set']:<22}{r['temperature']:>5}{r['proposer']:>16}{r['k']:>4}  {r.get('tree') or 'chain':<34}"
              f"{r['alpha']:>6.2f}{r['tau']:>7.2f}{r['speedup']:>8.2f}x{pred:>7}  {same}")
    for r in report["hf"]:
        extra = f", ours speculative is {r['ours_over_this']:.2f}x this" if r.get("ours_over_this") else ""
        print(f"{r['prompt_set']}: {r['method']}{' k=' + str(r['k']) if r['k'] else ''}: {r['tok_s']:.1f} tok/s"
              f" ({r.get('vs_our_baseline', float('nan')):.2f}x our target-only{extra})")
    print(f"\n{report['verdict']}\nfull report: {out_dir / 'report.md'}")
