"""The eval-speedup stage (`python -m decode.bench`, make eval-speedup): acceptance and wall-clock speedup of
speculative decoding.

Setup (config, prompts, models, tokenizer check, runners, proposers) -> warm-up -> cost model
(c, r(k)) -> for each temperature and prompt: target-only, then speculative for every k and
proposer, interleaved in one process on the same runners -> HF generate comparisons -> the cost
model again (did the machine's load change?) -> timing reliability -> report.json / report.md /
plots / samples.jsonl (+ W&B). Unreliable timings withhold the go/no-go verdict.

Two draft kinds, side by side on the same prompts: a standalone draft LM (`draft`: rows 'draft',
'draft+lookup') and a feature draft (decode/drafts/feature/model.py; `eval.feature_draft`, or `draft` itself:
rows 'feature', 'feature+lookup'), which verifies on a target runner that keeps the hidden states it
reads and has its own cost model. Target-only decoding keeps the plain runner.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from common.config import Config, ConfigError, config_to_dict
from common.models import TOKENIZER_FILES, check_tokenizers, load_model, load_tokenizer, param_count, resolve_device
from common.precision import DtypeChoice, resolve_decode_dtype
from common.progress import expectation
from common.prompts import evaluation_split, load_prompt_set, read_split_prompts
from common.sampling import SamplingParams
from common.tracking import start_wandb
from decode.api import build_feature_runner, build_runners
from decode.drafts.feature.model import FeatureDraft, check_target, feature_draft_problem, is_feature_draft
from decode.drafts.feature.proposer import FeatureProposer, make_feature_proposer
from decode.drafts.feature.timing import FeatureDraftSteps
from decode.drafts.feature.tree_proposer import FeatureTreeProposer
from decode.drafts.standalone.tree_proposer import DraftTreeProposer
from decode.eval_results import aggregate, build_report, draft_kind, log_to_wandb, print_headline, write_outputs
from decode.hf_baselines import hf_comparisons
from decode.proposal import Proposer
from decode.proposers import LookupProposer, make_proposer
from decode.runners import Runner, make_runner
from decode.runners.graphs import MAX_GRAPH_ROWS, MAX_TREE_ROWS, GraphRunner
from decode.serving import check_serving_memory, measure_serving, speculation_pays_up_to
from decode.speculative import speculative_decode, target_decode
from decode.timing import cost_model, timed, verify_cost
from decode.tree import TreeShape, parse_tree
from decode.tree_decode import TreeProposer, tree_decode
from decode.tree_proposers import LookupTreeProposer
from decode.vocab import model_vocab_size


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

    def verifier(self, proposer: str) -> Runner:
        """The target runner that verifies a proposer's tokens (chains and trees)."""
        if draft_kind(proposer) == "feature":
            return self.feature_runner
        return self.target_runner


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
    try:
        precision = resolve_decode_dtype(ev.dtype, device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    print(precision.line, file=sys.stderr)
    dtype = precision.torch_dtype
    standalone_ref, feature_ref = draft_refs(cfg)
    tokenizer = load_tokenizer(cfg.target)
    if standalone_ref is not None:
        check_tokenizers(tokenizer, load_tokenizer(standalone_ref))
    target = load_model(cfg.target, device, dtype)
    draft = load_model(standalone_ref, device, draft_dtype(device, dtype)) if standalone_ref is not None else None
    feature = (load_feature_draft(feature_ref, target, tokenizer, device, draft_dtype(device, dtype))
               if feature_ref is not None else None)
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
    # Serving holds a target cache and the standalone draft's, and a second target cache for the feature draft
    # (its own one-layer cache is small beside it).
    served = [target] + ([draft] if draft is not None else []) + ([target] if feature is not None else [])
    check_serving_memory(ev, [len(p.token_ids) for p in next(iter(prompt_sets.values()))], served)
    trees = [parse_tree(spec) for spec in ev.trees]
    tree_proposers = {}
    if trees and draft_runner is not None:
        tree_proposers["draft"] = DraftTreeProposer(draft_runner)
    if trees and feature is not None:
        tree_proposers["feature"] = FeatureTreeProposer(FeatureProposer(feature_runner, feature, embeddings))
    if ev.lookup_ngram:
        for name in list(tree_proposers):
            tree_proposers[f"{name}+lookup"] = LookupTreeProposer(LookupProposer(ev.lookup_ngram), tree_proposers[name])
    return Setup(cfg, device, tokenizer, target, draft, feature, prompt_sets, target_runner, draft_runner,
                 feature_runner, proposers, out_dir=Path(ev.out_dir or Path(cfg.distill.out_dir) / "eval"),
                 dtype=precision, trees=trees, tree_proposers=tree_proposers)


def draft_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """A draft decodes in fp32 on a CPU whatever the target decodes in: its small GEMMs gain nothing from bf16
    there. On the AMX Xeon, side by side: a 2-layer standalone draft with an 8,192-row head took 0.91 ms a step in
    fp32 and 1.24 ms in bf16 (scripts/bench_verify_cost.py --runners lean --dtype fp32 bf16), the demo's feature
    draft 1.30 ms and 1.81 ms (it casts the target's bf16 hidden states and embeddings to its own dtype). A
    draft's dtype moves only which tokens it proposes, never which the target accepts."""
    return torch.float32 if device.type == "cpu" else dtype


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


def first_prompt_ids(s: Setup) -> list[int]:
    """The first prompt's tokens: the warm-up's input and the context both cost models are measured at."""
    return list(next(iter(s.prompt_sets.values()))[0].token_ids)


def warm_up_and_cost(s: Setup) -> dict[str, dict]:
    """Untimed warm-up (first calls allocate caches and pick kernels), each draft kind's cost model, then the
    trees' warm-up."""
    ev = s.cfg.eval
    first = torch.tensor([first_prompt_ids(s)])
    greedy = SamplingParams()
    capture_graphs(s)
    for _ in range(ev.warmup):
        target_decode(s.target_runner, first, max_new_tokens=8, sampling=greedy)
        for name in ("draft", "feature"):
            if name in s.proposers:
                speculative_decode(s.verifier(name), s.proposers[name], first, k=max(ev.ks), max_new_tokens=8,
                                   sampling=greedy)
    costs = measure_costs(s)  # before the trees' warm-up: nodes=auto reads it
    for _ in range(ev.warmup):
        for shape, (name, proposer) in itertools.product(s.trees, s.tree_proposers.items()):
            tree_decode(s.verifier(name), proposer, first, shape=shape, max_new_tokens=8, sampling=greedy)
    return costs


def capture_graphs(s: Setup) -> None:
    """On CUDA, capture every graph the timed runs can replay before any of them: the causal forwards, and where
    trees are measured the target's verification of up to the largest tree and a draft's tree levels
    (decode/runners/graphs.py). A first run of a 1,000-kernel forward is a capture of tens of milliseconds, which
    timed runs would otherwise pay each time a tree brings a new node count."""
    verified = min(MAX_TREE_ROWS, 1 + max((shape.max_nodes for shape in s.trees), default=0))
    runners = ((s.target_runner, verified), (s.feature_runner, verified), (s.draft_runner, MAX_TREE_ROWS))
    for runner, tree_rows in runners:
        if isinstance(runner, GraphRunner):
            runner.reset()
            runner.capture_ahead(range(1, MAX_GRAPH_ROWS + 1))
            if s.trees:
                runner.capture_ahead(range(1, tree_rows + 1), tree=True)


def measure_costs(s: Setup) -> dict[str, dict]:
    """By draft kind: c (its draft step ÷ the target step) and r(k), timed on the runners it decodes with:
    k = 1..eval.r_max_k, and node counts up to the largest tree's (nodes=auto trees read r between them)."""
    context = first_prompt_ids(s)
    ks = list(range(1, s.cfg.eval.r_max_k + 1))
    tree_ks = []
    if s.trees:
        largest = max(shape.max_nodes for shape in s.trees)
        ks += [n for n in TREE_R_NODES if n < largest] + [largest]
        tree_ks = ks
    costs = {}
    if s.draft_runner is not None:
        costs["draft"] = cost_model(s.target_runner, s.draft_runner, context, ks, tree_ks=tree_ks)
    if s.feature is not None:
        steps = FeatureDraftSteps(s.feature, s.target.get_input_embeddings().weight)
        costs["feature"] = cost_model(s.feature_runner, steps, context, ks, tree_ks=tree_ks)
    for name, proposer in s.tree_proposers.items():
        cost = costs[draft_kind(name)]
        proposer.costs = (cost["c"], functools.partial(verify_cost, cost["r_tree"]))
    return costs


def measure(s: Setup, runs: list[dict], samples: list[dict], greedy_tokens: dict[tuple[str, str], list[int]]) -> None:
    """For each temperature and prompt: target-only, then speculative for every (k, proposer), interleaved
    on the same runners. Fills runs, samples and the target-only greedy tokens by (prompt set, prompt id) as
    each prompt's runs finish, so a run stopped midway keeps them (keep_measured_rows)."""
    ev = s.cfg.eval
    n_prompts = sum(len(p) for p in s.prompt_sets.values())
    per_prompt = 1 + len(ev.ks) * len(s.proposers) + len(s.trees) * len(s.tree_proposers)
    progress = tqdm(total=n_prompts * len(ev.temperatures) * per_prompt,
                    desc="eval-speedup", dynamic_ncols=True, smoothing=0)
    start = time.perf_counter()
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


def warm_prompt_shapes(s: Setup, input_ids: torch.Tensor) -> None:
    """Untimed: prefill the prompt on every runner once. The first forward of a new row count picks its kernels
    (on the AMX Xeon a 97-131-token bf16 prefill took 12-38 ms more the first time, 10-30%), a cost that would
    otherwise fall on the prompt's first timed run, target-only, and flatter every speedup after it (on an H200,
    target-only greedy, run first, measured 140.5 tok/s in domain against 255.0 at T = 0.7 in the same run)."""
    greedy = SamplingParams()
    target_decode(s.target_runner, input_ids, max_new_tokens=1, sampling=greedy)
    for name in ("draft", "feature"):
        if name in s.proposers:
            speculative_decode(s.verifier(name), s.proposers[name], input_ids, k=1, max_new_tokens=2, sampling=greedy)


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
    if temperature == ev.temperatures[0]:
        warm_prompt_shapes(s, input_ids)
    base_s: list[float] = []
    with timed(s.device, base_s):
        base = target_decode(s.target_runner, input_ids, max_new_tokens=ev.max_new_tokens, sampling=sampling,
                             eos_token_id=eos, generator=torch.Generator(s.device).manual_seed(seed))
    progress.update(1)
    samples.append({**where, "method": "target-only", "text": s.tokenizer.decode(base)})
    decodes = [(name, k, None, functools.partial(speculative_decode, s.verifier(name), proposer, k=k))
               for k, (name, proposer) in itertools.product(ev.ks, s.proposers.items())]
    decodes += [(name, shape.depth, shape.label, functools.partial(tree_decode, s.verifier(name),
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


def keep_measured_rows(s: Setup, argv: list[str] | None, costs: dict[str, dict], runs: list[dict],
                       samples: list[dict], error: BaseException) -> None:
    """Write the report of the batch-1 runs measured before `error` stopped the run, saying so: each run carries
    its own target-only baseline, so the rows hold the prompts measured (their counts show); the serving
    table, the HF comparisons and the end-of-run cost check (its drift reason) are missing."""
    report = build_report(s, argv, costs, costs, aggregate(runs, costs), [], runs)
    report["serving"] = None
    report["stopped"] = (f"the run stopped ({type(error).__name__}: {error}) after {len(runs)} speculative runs; the "
                         "rows below hold the prompts measured, the serving table, the HF comparisons and the "
                         "end-of-run cost check are missing")
    write_outputs(report, samples, s.out_dir)
    print(f"eval-speedup: {report['stopped']}; its report is in {s.out_dir}", file=sys.stderr)


def run(cfg: Config, argv: list[str] | None) -> dict:
    """The whole stage on a checked config; `argv` goes into the report as the command."""
    cfg.check_model_refs("target")
    s = setup(cfg)  # refuses a draft reference that cannot load before any model loads (draft_refs)
    s.out_dir.mkdir(parents=True, exist_ok=True)
    tracker = start_wandb(cfg.wandb.mode, cfg.wandb.project, f"{cfg.name}-eval", s.out_dir,
                          config_to_dict(cfg), job_type="eval-speedup")
    costs = warm_up_and_cost(s)
    runs, samples, greedy_tokens = [], [], {}
    try:
        measure(s, runs, samples, greedy_tokens)
        serving_rows = measure_serving(s, greedy_tokens) if cfg.eval.serving_batches else []
        hf_rows = hf_comparisons(s, runs, greedy_tokens) if cfg.eval.hf_baselines else []
    except BaseException as error:  # a crash or Ctrl-C keeps the runs measured, minutes of a CPU's time
        if runs:
            keep_measured_rows(s, argv, costs, runs, samples, error)
        raise
    results = aggregate(runs, costs)
    # The same measurement after every timed run, on the same runners: a machine whose load changed
    # during the run shows as a different target step (one of the timing-reliability signals).
    costs_end = measure_costs(s)
    report = build_report(s, argv, costs, costs_end, results, hf_rows, runs)
    report["serving"] = ({"rows": serving_rows, "pays_up_to": speculation_pays_up_to(serving_rows)}
                         if serving_rows else None)
    write_outputs(report, samples, s.out_dir)
    if tracker is not None:
        log_to_wandb(tracker, report)
    print_headline(report, s.out_dir)
    return report

