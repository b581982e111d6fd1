"""Exact held-out acceptance of drafts, side by side in one process, against the target itself
(`python -m distill.held_out`).

Training's held-out α with a cached teacher sums min(p, q) over the stored top-K tokens only: a lower
bound, and one a draft can raise by moving mass into the top-K without accepting more often. Here the
target runs over the same held-out rows (distill.eval_samples of distill.data_dirs' held-out rows, spread
over them: distill/data.py held_out_subset) and each draft's full-vocabulary distribution, as the decoder
samples it (a subset draft expanded by decode/vocab.py full_logits), meets the target's over the whole
vocabulary:
  α at T       Σ_v min(p_T, q_T) with both tempered: the acceptance of speculative sampling at T
  greedy       P(argmax q = argmax p): the acceptance of greedy decoding
  τ(k)         (1 − α^(k+1)) / (1 − α), tokens per target forward at draft length k (i.i.d. α)
  head mass    the target's mass (T = 1) on the tokens a subset draft has rows for, and `head greedy`
               the share of the target's argmaxes among them (1 for a full-vocabulary draft): how much
               a wider head could add (a spread "other" row covers the rest only uniformly)
Contexts are the target's own completions (teacher-forced), as in decoding after each verification.

A feature draft (decode/drafts/feature/) proposes from the target's hidden states, so its rows come from
its own measure on the same held-out rows: the draft unrolled on its own outputs as it drafts in the
decoder (distill/training/feature_eval.py), α_j = the acceptance of proposal j + 1 of a block given the
first j were accepted, at T = 1 (Σ min(p, q), the target's full-vocabulary p) and greedy (the argmaxes
agree), and τ(k) = 1 + α_0 + α_0·α_1 + ... (their chain product, not the i.i.d. formula). Tempering
needs the target's whole vocabulary, which its teacher keeps only on the draft's rows: T = 1 and greedy only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from common.config import ConfigError
from common.models import check_tokenizers, load_model, load_tokenizer, reference_problem
from decode.drafts.feature.model import FeatureDraft, check_target, feature_draft_problem, is_feature_draft
from decode.stats import expected_tau
from decode.vocab import VocabSubset
from distill.data import collate, held_out_subset, load_examples
from distill.losses import acceptance
from distill.training.feature import UnrolledFeatureDraft
from distill.training.feature_eval import tau_from_step_alphas
from distill.training.feature_teacher import FeatureTeacher, step_masks
from distill.training.teacher import Teacher, draft_row_logits


ROWS_PER_BATCH = 4  # 4 rows x ~100 completion positions x 49k vocab x 4 B: ~80 MB of logits per model


def draft_full_logits(draft, batch: dict) -> torch.Tensor:
    """The draft's logits over the full vocabulary at the batch's loss positions [N, V] (fp32)."""
    subset = VocabSubset.of(draft)
    logits = draft_row_logits(draft, batch, subset)
    return logits if subset is None else subset.full_logits(logits)


@torch.no_grad()
def held_out_acceptance(target, drafts: dict[str, torch.nn.Module], batches, temperatures: list[float],
                        tau_k: int) -> dict[str, dict]:
    """{draft name: {'alpha_T<t>': …, 'greedy': …, 'tau_k<k>_T<t>': …, 'tau_k<k>_greedy': …, 'tokens': n}}."""
    sums = {name: torch.zeros(len(temperatures) + 3, dtype=torch.float64) for name in drafts}
    subsets = {name: VocabSubset.of(draft) for name, draft in drafts.items()}
    teacher = Teacher("online", None, target)
    tokens = 0
    for batch in batches:
        target_logits = teacher.targets(batch).logits
        tokens += target_logits.shape[0]
        for name, draft in drafts.items():
            draft_logits = draft_full_logits(draft, batch)
            vocab = min(draft_logits.shape[-1], target_logits.shape[-1])
            d, t = draft_logits[:, :vocab], target_logits[:, :vocab]
            accepted = [torch.minimum(torch.softmax(d / T, -1), torch.softmax(t / T, -1)).sum() for T in temperatures]
            accepted.append((d.argmax(-1) == t.argmax(-1)).sum())
            ids = subsets[name].ids if subsets[name] is not None else torch.arange(vocab)
            accepted.append(torch.softmax(t, -1)[:, ids].sum())
            accepted.append(torch.isin(t.argmax(-1), ids).sum())
            sums[name] += torch.stack(accepted).double()
    results = {}
    for name, total in sums.items():
        *rates, head_mass, head_greedy = (total / max(tokens, 1)).tolist()
        labels = [f"T{T:g}" for T in temperatures] + ["greedy"]
        results[name] = {**{f"alpha_{label}": rate for label, rate in zip(labels, rates)},
                         **{f"tau_k{tau_k}_{label}": expected_tau(rate, tau_k) for label, rate in zip(labels, rates)},
                         "head_mass": head_mass, "head_greedy": head_greedy, "tokens": tokens}
    return results


@torch.no_grad()
def feature_held_out_acceptance(target, draft: FeatureDraft, batches, tau_k: int) -> dict:
    """{'alpha_T1', 'alpha_greedy' (proposal 1's), 'tau_k<k>_T1', 'tau_k<k>_greedy', 'alpha_steps_T1',
    'alpha_steps_greedy' (proposals 1..k), 'head_mass', 'head_greedy', 'tokens'} of one feature draft."""
    subset_ids = draft.draft_ids
    teacher = FeatureTeacher(target, draft.config.target_layers, subset_ids, dtype=torch.float32)
    unrolled = UnrolledFeatureDraft(draft.float())
    sums = torch.zeros(3, tau_k, dtype=torch.float64)  # per proposal position: tokens, Σ min(p, q), argmaxes agree
    head = torch.zeros(2, dtype=torch.float64)  # proposal 1's tokens: target mass on the rows, argmaxes there
    for batch in batches:
        features = teacher(batch)
        masks = step_masks(features.positions, tau_k)
        for j, (mask, logits) in enumerate(zip(masks, unrolled(features.hidden, features.embeds, masks))):
            rows = mask[features.positions]
            target_logp = features.target_logp[rows]
            every = torch.ones(target_logp.shape[0], dtype=torch.bool, device=target_logp.device)
            accepted = acceptance(torch.log_softmax(logits.float(), -1), target_logp, every)[0]
            agree = (subset_ids[logits.argmax(-1)] == features.target_top1[rows]).sum()
            sums[:, j] += torch.stack([rows.sum(), accepted, agree]).double()
            if j == 0:
                in_head = torch.isin(features.target_top1, subset_ids).sum()
                head += torch.stack([target_logp.exp().sum(), in_head]).double()
    tokens = sums[0].clamp(min=1)
    steps_t1, steps_greedy = (sums[1] / tokens).tolist(), (sums[2] / tokens).tolist()
    return {"alpha_T1": steps_t1[0], "alpha_greedy": steps_greedy[0],
            f"tau_k{tau_k}_T1": tau_from_step_alphas(steps_t1, tau_k),
            f"tau_k{tau_k}_greedy": tau_from_step_alphas(steps_greedy, tau_k),
            "alpha_steps_T1": steps_t1, "alpha_steps_greedy": steps_greedy,
            "head_mass": float(head[0] / tokens[0]), "head_greedy": float(head[1] / tokens[0]),
            "tokens": int(sums[0, 0])}


def held_out_batches(config, tokenizer):
    """The held-out rows training evaluates on, in batches of ROWS_PER_BATCH."""
    dc = config.distill
    _, held_out = load_examples(dc.data_dirs, dc.max_seq_len, need_topk=False)
    held_out = held_out_subset(held_out, dc.eval_samples)
    for start in range(0, len(held_out), ROWS_PER_BATCH):
        yield collate(held_out[start:start + ROWS_PER_BATCH], tokenizer.pad_token_id or 0, with_topk=False)


def table(results: dict[str, dict], temperatures: list[float], tau_k: int) -> str:
    labels = [f"T{T:g}" for T in temperatures] + ["greedy"]
    columns = [f"α {label} | τ({tau_k}) {label}" for label in labels] + ["head mass", "head greedy"]
    head = "| draft | " + " | ".join(columns) + " |"
    lines = [head, "|---" * (3 + 2 * len(labels)) + "|"]
    for name, r in results.items():
        cells = [f"{r[f'alpha_{label}']:.4f} | {r[f'tau_k{tau_k}_{label}']:.3f}" if f"alpha_{label}" in r else "– | –"
                 for label in labels]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r['head_mass']:.4f} | {r['head_greedy']:.4f} |")
    return "\n".join(lines)



def draft_problem(path: str) -> str | None:
    """Why a --drafts folder cannot load (a feature draft's or a model folder's check), without loading it."""
    return feature_draft_problem(path) if is_feature_draft(path) else reference_problem(path)


def compare(config, draft_paths: list[str], temperatures: list[float], json_path: str | None) -> dict:
    """Load the target and every draft (refusing a missing one before any loads), measure, print the table
    (feature drafts' rows after the others', with their α per proposal position below it)."""
    config.check_model_refs("target")
    tokenizer = load_tokenizer(config.target)
    problems = [f"--drafts: {problem}" for path in draft_paths if (problem := draft_problem(path))]
    if problems:
        raise ConfigError("\n".join(problems))
    target = load_model(config.target)
    drafts, feature_drafts = {}, {}
    for path in draft_paths:
        check_tokenizers(tokenizer, load_tokenizer(path))
        if is_feature_draft(path):
            feature_drafts[path] = FeatureDraft.load(path)
            check_target(feature_drafts[path].config, target.config, target.config.vocab_size)
        else:
            drafts[path] = load_model(path)
    tau_k = config.distill.tau_k
    results = {}
    if drafts:
        results = held_out_acceptance(target, drafts, held_out_batches(config, tokenizer), temperatures, tau_k)
    for path, draft in feature_drafts.items():
        results[path] = feature_held_out_acceptance(target, draft, held_out_batches(config, tokenizer), tau_k)
    print(table(results, temperatures, tau_k))
    for path in feature_drafts:
        steps = " / ".join(f"{a:.3f}" for a in results[path]["alpha_steps_T1"])
        greedy = " / ".join(f"{a:.3f}" for a in results[path]["alpha_steps_greedy"])
        print(f"{path}: α per proposal position 1..{tau_k}: T = 1 {steps}; greedy {greedy}")
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    return results
