"""`make eval-speedup`: measure acceptance and wall-clock speedup of speculative decoding.

    python -m decode.bench --config configs/smollm2.yaml [key.sub=value ...]

Setup (config, prompts, models, tokenizer check, runners, proposers) -> warm-up -> cost model
(c, r(k)) -> for each temperature and prompt: target-only, then speculative for every k and
proposer, interleaved in one process on the same runners -> HF generate comparisons -> the cost
model again (did the machine's load change?) -> timing reliability -> report.json / report.md /
plots / samples.jsonl (+ W&B). Unreliable timings withhold the go/no-go verdict.

Two draft kinds, side by side on the same prompts: a standalone draft LM (`draft`: rows 'draft',
'draft+lookup') and a feature draft (decode/feature_draft.py; `eval.feature_draft`, or `draft` itself:
rows 'feature', 'feature+lookup'), which verifies on a target runner that keeps the hidden states it
reads and has its own cost model. Target-only decoding keeps the plain runner.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import itertools
import json
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from decode.api import build_feature_runner, build_runners
from decode.cli import cli_config, run_cli
from decode.config import Config, ConfigError, config_to_dict
from decode.feature_draft import FeatureDraft, check_target, feature_draft_problem, is_feature_draft
from decode.feature_proposer import FeatureProposer, make_feature_proposer
from decode.feature_timing import FeatureDraftSteps
from decode.hf_baselines import full_vocab_view, hf_generate
from decode.models import (TOKENIZER_FILES, check_tokenizers, load_model, load_tokenizer, param_count,
                           resolve_device)
from decode.precision import DtypeChoice, machine_class, resolve_decode_dtype
from decode.progress import expectation
from decode.prompts import evaluation_split, load_prompt_set, read_split_prompts
from decode.proposers import LookupProposer, Proposer, make_proposer
from decode.provenance import git_revision
from decode.report import write_markdown, write_plots
from decode.runners import Runner, make_runner
from decode.sampling import SamplingParams
from decode.speculative import speculative_decode, target_decode
from decode.serving import check_serving_memory, measure_serving, speculation_pays_up_to
from decode.stats import SpeculativeStats, predicted_speedup
from decode.timing import cost_model, timed, timing_reliability, verify_cost
from decode.tree import TreeShape, parse_tree
from decode.tree_decode import TreeProposer, tree_decode
from decode.tree_proposers import DraftTreeProposer, FeatureTreeProposer, LookupTreeProposer
from decode.tracking import start_wandb
from decode.vocab import VocabSubset, model_vocab_size


TREE_R_NODES = (12, 16, 24, 32, 48, 64)
"""Node counts whose verification cost r(n) is measured (with 1..eval.r_max_k) when eval.trees lists trees:
nodes=auto reads r between them."""


@dataclass
class Setup:
    """What every stage of the measurement reads, built once."""
    cfg: Config
    device: torch.device
    tokenizer: object
    target: torch.nn.Module
    draft: torch.nn.Module | None
    """The standalone draft; None when only a feature draft is measured."""
    feature: FeatureDraft | None
    prompt_sets: dict[str, list]
    target_runner: Runner
    """The target's plain runner: target-only decoding and the standalone draft's verification."""
    draft_runner: Runner | None
    feature_runner: Runner | None
    """The target's runner keeping the hidden states the feature draft reads: its verification."""
    proposers: dict[str, Proposer]
    """By report name: "draft" and/or "feature", each with "+lookup" when eval.lookup_ngram > 0."""
    out_dir: Path
    dtype: DtypeChoice
    """What target and drafts decode in (eval.dtype resolved), and why."""
    trees: list[TreeShape]
    """eval.trees, parsed."""
    tree_proposers: dict[str, TreeProposer]
    """By report name, as `proposers`: each draft drafting trees (when eval.trees lists any), with prompt
    lookup's guess as one more branch in the "+lookup" ones."""
    tree_runner: Runner | None
    """The target runner that verifies the standalone draft's trees (a masked forward: never the
    CUDA-graph replay)."""

    def verifier(self, proposer: str, tree: bool = False) -> Runner:
        """The target runner that verifies a proposer's tokens (its trees when `tree`)."""
        if draft_kind(proposer) == "feature":
            return self.feature_runner
        return self.tree_runner if tree else self.target_runner


def draft_kind(proposer: str) -> str:
    """'draft' (standalone) or 'feature' from a report's proposer name ('feature+lookup' -> 'feature')."""
    return proposer.split("+")[0]


def draft_refs(cfg: Config) -> tuple[str | None, str | None]:
    """(standalone draft, feature draft) references: `draft` is either kind, and eval.feature_draft adds a
    feature draft next to a standalone one. Refuses one that cannot load, before any model loads."""
    if is_feature_draft(cfg.draft):
        if cfg.eval.feature_draft:
            raise ConfigError(f"draft {cfg.draft!r} is a feature draft already; eval.feature_draft adds a "
                              "feature draft next to a standalone draft")
        standalone, feature, key = None, cfg.draft, "draft"
    else:
        cfg.check_model_refs("draft")
        standalone, feature, key = cfg.draft, cfg.eval.feature_draft, "eval.feature_draft"
    if feature is not None and (problem := feature_draft_problem(feature)):
        raise ConfigError(f"{key}: {problem}")
    if cfg.eval.serving_batches and standalone is None:
        raise ConfigError("eval.serving_batches measures batched decoding with a standalone draft; `draft` is a "
                          "feature draft (batched feature drafting is not built yet): leave serving_batches empty")
    return standalone, feature


def load_feature_draft(ref: str, target: torch.nn.Module, tokenizer, device: torch.device,
                       dtype: torch.dtype) -> FeatureDraft:
    """A feature draft, refused for a target it was not trained on (the tokenizer is compared when the
    folder has one, as training saves it)."""
    if any((Path(ref) / name).is_file() for name in TOKENIZER_FILES):
        check_tokenizers(tokenizer, load_tokenizer(ref))
    feature = FeatureDraft.load(ref, device).to(dtype)
    check_target(feature.config, target.config, model_vocab_size(target))
    return feature


def setup(cfg: Config) -> Setup:
    """Models (with the tokenizer and target checks), prompt sets, runners and proposers."""
    ev = cfg.eval
    device = resolve_device(cfg.device)
    precision = resolve_decode_dtype(ev.dtype, device)
    print(precision.line, file=sys.stderr)
    dtype = precision.torch_dtype
    standalone_ref, feature_ref = draft_refs(cfg)
    tokenizer = load_tokenizer(cfg.target)
    if standalone_ref is not None:
        check_tokenizers(tokenizer, load_tokenizer(standalone_ref))
    target = load_model(cfg.target, device, dtype)
    draft = load_model(standalone_ref, device, dtype) if standalone_ref is not None else None
    feature = load_feature_draft(feature_ref, target, tokenizer, device, dtype) if feature_ref is not None else None
    target_params = param_count(target)
    for name, model in (("draft", draft), ("feature draft", feature)):
        if model is not None and param_count(model) >= target_params:
            warnings.warn(f"the {name} ({param_count(model):,} params) is not smaller than the target "
                          f"({target_params:,})")
    context_length = min([getattr(m.config, "max_position_embeddings", 10**9) for m in (target, draft, feature)
                          if m is not None])
    prompt_sets = eval_prompts(cfg, tokenizer, context_length)
    if draft is not None:
        target_runner, draft_runner = build_runners(target, draft, ev.backend)
    else:
        target_runner, draft_runner = make_runner(target, model_vocab_size(target), ev.backend), None
    feature_runner = build_feature_runner(target, feature, ev.backend) if feature is not None else None
    # Each k runs with each draft alone, and with prompt lookup added when eval.lookup_ngram > 0.
    proposers: dict[str, Proposer] = {}
    if draft_runner is not None:
        proposers["draft"] = make_proposer(draft_runner)
        if ev.lookup_ngram:
            proposers["draft+lookup"] = make_proposer(draft_runner, ev.lookup_ngram)
    embeddings = target.get_input_embeddings().weight
    if feature is not None:
        proposers["feature"] = make_feature_proposer(feature_runner, feature, embeddings)
        if ev.lookup_ngram:
            proposers["feature+lookup"] = make_feature_proposer(feature_runner, feature, embeddings, ev.lookup_ngram)
    if draft is not None:
        check_serving_memory(ev, [len(p.token_ids) for p in next(iter(prompt_sets.values()))], [target, draft])
    trees = [parse_tree(spec) for spec in ev.trees]
    tree_proposers, tree_runner = {}, None
    if trees and draft_runner is not None:
        tree_runner = target_runner if hasattr(target_runner, "forward_masked") else make_runner(
            target, model_vocab_size(target), "lean")
        tree_proposers["draft"] = DraftTreeProposer(draft_runner)
    if trees and feature is not None:
        tree_proposers["feature"] = FeatureTreeProposer(FeatureProposer(feature_runner, feature, embeddings))
    if ev.lookup_ngram:
        for name in list(tree_proposers):
            tree_proposers[f"{name}+lookup"] = LookupTreeProposer(LookupProposer(ev.lookup_ngram), tree_proposers[name])
    return Setup(cfg, device, tokenizer, target, draft, feature, prompt_sets, target_runner, draft_runner,
                 feature_runner, proposers, out_dir=Path(ev.out_dir or Path(cfg.distill.out_dir) / "eval"),
                 dtype=precision, trees=trees, tree_proposers=tree_proposers, tree_runner=tree_runner)


def eval_prompts(cfg: Config, tokenizer, context_length: int) -> dict[str, list]:
    """Prompt sets by name. 'data:eval' is the held-out split of generate.out_dir (never trained on)."""
    sets = {}
    for source in cfg.eval.prompts:
        if source.startswith("data:"):
            split = source.split(":", 1)[1]
            data_dir = Path(cfg.generate.out_dir)
            if not any(data_dir.glob("shard-*.parquet")):
                raise ConfigError(f"eval.prompts: {source!r} needs generate-data shards in {data_dir}; "
                                  "run `make generate-data` first or list another prompt source")
            prompts = read_split_prompts(data_dir, split, tokenizer)
            name = source
        else:
            prompts = load_prompt_set(source, tokenizer, split=evaluation_split(source, cfg.generate.sources),
                                      system_prompt=cfg.generate.system_prompt,
                                      max_new_tokens=cfg.eval.max_new_tokens, context_length=context_length,
                                      eval_fraction=cfg.generate.eval_fraction)
            name = source
        fits = [p for p in prompts if len(p.token_ids) + cfg.eval.max_new_tokens <= context_length]
        if not fits:
            raise ConfigError(f"eval.prompts: no usable prompts in {source!r}")
        sets[name] = fits[: cfg.eval.num_prompts]
    return sets


def prompt_seed(seed: int, prompt_id: str, temperature: float) -> int:
    return int(hashlib.sha256(f"{seed}:{prompt_id}:{temperature}".encode()).hexdigest()[:12], 16)


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
        r_block = cost["r"][k] if not tree and k in cost["r"] else verify_cost(cost["r"], max(verified, 1.0))
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


def first_prompt_ids(s: Setup) -> list[int]:
    """The first prompt's tokens: the warm-up's input and the context both cost models are measured at."""
    return list(next(iter(s.prompt_sets.values()))[0].token_ids)


def warm_up_and_cost(s: Setup) -> dict[str, dict]:
    """Untimed warm-up (first calls allocate caches and pick kernels), each draft kind's cost model, then the
    trees' warm-up."""
    ev = s.cfg.eval
    first = torch.tensor([first_prompt_ids(s)])
    greedy = SamplingParams()
    for _ in range(ev.warmup):
        target_decode(s.target_runner, first, max_new_tokens=8, sampling=greedy)
        for name in ("draft", "feature"):
            if name in s.proposers:
                speculative_decode(s.verifier(name), s.proposers[name], first, k=max(ev.ks), max_new_tokens=8,
                                   sampling=greedy)
    costs = measure_costs(s)  # before the trees' warm-up: nodes=auto reads it
    for _ in range(ev.warmup):
        for shape, (name, proposer) in itertools.product(s.trees, s.tree_proposers.items()):
            tree_decode(s.verifier(name, tree=True), proposer, first, shape=shape, max_new_tokens=8, sampling=greedy)
    return costs


def measure_costs(s: Setup) -> dict[str, dict]:
    """By draft kind: c (its draft step ÷ the target step) and r(k), timed on the runners it decodes with:
    k = 1..eval.r_max_k, and node counts up to the largest tree's (nodes=auto trees read r between them)."""
    context = first_prompt_ids(s)
    ks = list(range(1, s.cfg.eval.r_max_k + 1))
    if s.trees:
        largest = max(shape.max_nodes for shape in s.trees)
        ks += [n for n in TREE_R_NODES if n < largest] + [largest]
    costs = {}
    if s.draft_runner is not None:
        costs["draft"] = cost_model(s.target_runner, s.draft_runner, context, ks)
    if s.feature is not None:
        steps = FeatureDraftSteps(s.feature, s.target.get_input_embeddings().weight)
        costs["feature"] = cost_model(s.feature_runner, steps, context, ks)
    for name, proposer in s.tree_proposers.items():
        cost = costs[draft_kind(name)]
        proposer.costs = (cost["c"], functools.partial(verify_cost, cost["r"]))
    return costs


def measure(s: Setup) -> tuple[list[dict], list[dict], dict[tuple[str, str], list[int]]]:
    """For each temperature and prompt: target-only, then speculative for every (k, proposer), interleaved
    on the same runners. Returns (runs, samples, target-only greedy tokens by (prompt set, prompt id))."""
    ev = s.cfg.eval
    n_prompts = sum(len(p) for p in s.prompt_sets.values())
    per_prompt = 1 + len(ev.ks) * len(s.proposers) + len(s.trees) * len(s.tree_proposers)
    progress = tqdm(total=n_prompts * len(ev.temperatures) * per_prompt,
                    desc="eval-speedup", dynamic_ncols=True, smoothing=0)
    start = time.perf_counter()
    runs, samples = [], []
    greedy_tokens: dict[tuple[str, str], list[int]] = {}  # target-only greedy output, for the HF checks
    for temperature in ev.temperatures:
        for set_name, prompts in s.prompt_sets.items():
            for prompt in prompts:
                base = measure_prompt(s, set_name, prompt, temperature, runs, samples, progress)
                if len(samples) == per_prompt:  # the first prompt's runs
                    progress.write(expectation("eval-speedup", progress.n, progress.total, time.perf_counter() - start,
                                               "decoding runs (HF baselines and the cost model follow)"),
                                   file=sys.stderr)
                if temperature == 0:
                    greedy_tokens[(set_name, prompt.prompt_id)] = base
    progress.close()
    return runs, samples, greedy_tokens


def measure_prompt(s: Setup, set_name: str, prompt, temperature: float, runs: list[dict], samples: list[dict],
                   progress) -> list[int]:
    """One prompt at one temperature: target-only, then each (k, proposer); appends to runs and samples.
    Returns the target-only tokens."""
    ev = s.cfg.eval
    sampling = SamplingParams(temperature, ev.top_k, ev.top_p)
    input_ids = torch.tensor([prompt.token_ids], device=s.device)
    seed = prompt_seed(s.cfg.seed, prompt.prompt_id, temperature)
    eos = s.tokenizer.eos_token_id
    where = {"prompt_set": set_name, "prompt_id": prompt.prompt_id, "temperature": temperature}
    base_s: list[float] = []
    with timed(s.device, base_s):
        base = target_decode(s.target_runner, input_ids, max_new_tokens=ev.max_new_tokens, sampling=sampling,
                             eos_token_id=eos, generator=torch.Generator(s.device).manual_seed(seed))
    progress.update(1)
    samples.append({**where, "method": "target-only", "text": s.tokenizer.decode(base)})
    decodes = [(name, k, None, functools.partial(speculative_decode, s.verifier(name), proposer, k=k))
               for k, (name, proposer) in itertools.product(ev.ks, s.proposers.items())]
    decodes += [(name, shape.depth, shape.label, functools.partial(tree_decode, s.verifier(name, tree=True),
                                                                    proposer, shape=shape))
                for shape, (name, proposer) in itertools.product(s.trees, s.tree_proposers.items())]
    for i, (name, k, tree, decode) in enumerate(decodes):
        spec_s: list[float] = []
        with timed(s.device, spec_s):
            out = decode(input_ids, max_new_tokens=ev.max_new_tokens, sampling=sampling, eos_token_id=eos,
                         generator=torch.Generator(s.device).manual_seed(seed + (k if tree is None else 1000 + i)))
        progress.update(1)
        speedup = (len(out.tokens) / spec_s[0]) / (len(base) / base_s[0])
        runs.append({**where, "proposer": name, "k": k, "tree": tree, "prompt_tokens": len(prompt.token_ids),
                     "baseline_tokens": len(base), "baseline_s": base_s[0],
                     "speculative_tokens": len(out.tokens), "speculative_s": spec_s[0],
                     "speedup": speedup, "stats": out.stats.to_dict(),
                     "greedy_identical": out.tokens.tolist() == base.tolist() if sampling.greedy else None})
        method = (f"speculative {'k=' + str(k) if tree is None else 'tree ' + tree}"
                  + (" feature" if draft_kind(name) == "feature" else "") + (" + lookup" if "+lookup" in name else ""))
        samples.append({**where, "method": method, "text": s.tokenizer.decode(out.tokens)})
        progress.set_postfix(speedup=f"{speedup:.2f}", tau=f"{out.stats.tau:.2f}")
    return base.tolist()


def main(argv: list[str] | None = None) -> dict:
    cfg = cli_config(argv, "Measure speculative-decoding acceptance and wall-clock speedup; write a report.")
    cfg.check_model_refs("target")
    s = setup(cfg)  # refuses a draft reference that cannot load before any model loads (draft_refs)
    s.out_dir.mkdir(parents=True, exist_ok=True)
    tracker = start_wandb(cfg.wandb.mode, cfg.wandb.project, f"{cfg.name}-eval", s.out_dir,
                          config_to_dict(cfg), job_type="eval-speedup")
    costs = warm_up_and_cost(s)
    runs, samples, greedy_tokens = measure(s)
    results = aggregate(runs, costs)
    serving_rows = measure_serving(s, greedy_tokens) if cfg.eval.serving_batches else []
    hf_rows = hf_comparisons(s, results, greedy_tokens) if cfg.eval.hf_baselines else []
    # The same measurement after every timed run, on the same runners: a machine whose load changed
    # during the run shows as a different target step (one of the timing-reliability signals).
    costs_end = measure_costs(s)
    report = build_report(s, argv, costs, costs_end, results, hf_rows, runs)
    report["serving"] = {"rows": serving_rows, "pays_up_to": speculation_pays_up_to(serving_rows)} if serving_rows else None
    write_outputs(report, samples, s.out_dir)
    if tracker is not None:
        log_to_wandb(tracker, report)
    print_headline(report, s.out_dir)
    return report


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
    return {"ref": ref, "params": params, "param_ratio": params / target_params, "vocab_subset": subset,
            "target_layers": layers}


def log_to_wandb(tracker, report: dict) -> None:
    for row in report["results"]:
        tracker.log({f"{row['prompt_set']}/T{row['temperature']}/{row['proposer']}/k{row['k']}/{m}": row[m]
                     for m in ("alpha", "tau", "speedup", "predicted_speedup") if row[m] is not None})
    tracker.summary.update({"verdict": report["verdict"], "c": report["cost_model"]["c"],
                            "timing_reliable": report["timing_reliability"]["reliable"]})
    tracker.finish()


def hf_comparisons(s: Setup, results: list[dict], greedy_tokens: dict[tuple[str, str], list[int]]) -> list[dict]:
    """HF greedy, assisted generation and prompt lookup on the same prompts (greedy, timed the same way)."""
    ev = s.cfg.eval
    # HF assisted generation runs a standalone draft only (it has no feature-draft mode).
    assistant = s.draft
    if s.draft is not None and VocabSubset.from_config(s.draft.config) is not None:
        assistant = full_vocab_view(s.draft)
    kinds = ("hf assisted", "hf prompt lookup") if assistant is not None else ("hf prompt lookup",)
    methods = [("hf greedy", None)] + [(m, k) for k in ev.hf_ks for m in kinds]
    # HF assisted generation runs the draft alone: compare it with our draft-only rows.
    ours = {(r["prompt_set"], r["k"]): r for r in results if r["temperature"] == 0 and r["proposer"] == "draft"}
    rows = []
    for set_name, prompts in s.prompt_sets.items():
        base_rows = [r for r in results if r["prompt_set"] == set_name and r["temperature"] == 0]
        for method, k in tqdm(methods, desc=f"hf baselines {set_name}", dynamic_ncols=True):
            tok_s, identical = time_hf_method(s, set_name, prompts, method, k, assistant, greedy_tokens)
            row = {"prompt_set": set_name, "method": method, "k": k, "tok_s": tok_s, "identical_to_ours": identical}
            if base_rows:
                row["vs_our_baseline"] = tok_s / base_rows[0]["baseline_tok_s"]
            if k is not None and (set_name, k) in ours:
                row["ours_over_this"] = ours[(set_name, k)]["speculative_tok_s"] / tok_s
            rows.append(row)
    return rows


def time_hf_method(s: Setup, set_name: str, prompts: list, method: str, k: int | None, assistant,
                   greedy_tokens: dict[tuple[str, str], list[int]]) -> tuple[float, bool]:
    """(tokens/s pooled over the prompts, whether every output equals our target-only greedy tokens)."""
    ev, eos = s.cfg.eval, s.tokenizer.eos_token_id
    tokens, seconds, identical = 0, 0.0, True
    for prompt in prompts:
        input_ids = torch.tensor([prompt.token_ids], device=s.device)
        key = (set_name, prompt.prompt_id)
        if key not in greedy_tokens:
            greedy_tokens[key] = target_decode(s.target_runner, input_ids, max_new_tokens=ev.max_new_tokens,
                                               sampling=SamplingParams(), eos_token_id=eos).tolist()
        times: list[float] = []
        with timed(s.device, times):
            new = hf_generate(s.target, input_ids, ev.max_new_tokens, eos,
                              assistant=assistant if method == "hf assisted" else None, k=k or 4,
                              prompt_lookup=method == "hf prompt lookup")
        tokens += len(new)
        seconds += times[0]
        identical &= new.tolist() == greedy_tokens[key]
    return tokens / seconds, identical


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


if __name__ == "__main__":
    run_cli(main)
