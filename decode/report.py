"""report.md tables and PNG plots from the figures eval-speedup measured (report.json)."""

from __future__ import annotations

from pathlib import Path


def _fmt(x, digits=2, unit=""):
    return "–" if x is None else f"{x:.{digits}f}{unit}"


def reliability_lines(reliability: dict) -> list[str]:
    """The report's first lines: a warning with its reasons when a busy machine made the timings
    unreliable, else one line of the figures that say it was quiet."""
    if not reliability["reliable"]:
        return (["**Timings unreliable: machine busy.** The go/no-go verdict is withheld; rerun on an "
                 "otherwise idle machine before trusting any speedup below. Why:", ""]
                + [f"- {reason}" for reason in reliability["reasons"]] + [""])
    figures = reliability["figures"]
    spread = max(figures["target_only_spread"].values(), default=None)
    band = figures["measured_over_predicted"] or (None, None)
    step = figures["target_step_ms"]
    hf = max(figures["hf_greedy_over_ours"].values(), default=None)
    trees = figures.get("tree_measured_over_predicted")
    tree_part = (f" Tree rows: measured ÷ predicted {_fmt(trees[0])}–{_fmt(trees[1])} (not a sign of a busy "
                 "machine: the cost model leaves out a tree's host work)." if trees else "")
    return [f"Timings reliable: target-only spread across prompts ≤ {_fmt(spread)}, measured ÷ predicted "
            f"{_fmt(band[0])}–{_fmt(band[1])} (chains), target step {step['start']:.1f} ms before the timed runs "
            f"and {step['end']:.1f} ms after, HF greedy ≤ {_fmt(hf)}× our target-only.{tree_part}", ""]


def _draft_part(name: str, draft: dict | None) -> str:
    """', draft `ref` (2.36M params, 1.75% of the target)' for the header line; '' without that draft."""
    if not draft:
        return ""
    layers = f", reads layers {draft['target_layers']}" if draft.get("target_layers") else ""
    dtype = f", {draft['dtype']}" if draft.get("dtype") else ""
    return (f", {name} `{draft['ref']}` ({draft['params'] / 1e6:.2f}M params, "
            f"{100 * draft['param_ratio']:.2f}% of the target{layers}{dtype})")


def recipe_lines(report: dict) -> list[str]:
    """'- draft trained by make distill: ...' for each draft whose folder says how it was trained."""
    lines = []
    for name, key in (("draft", "draft"), ("feature draft", "feature_draft")):
        recipe = (report.get(key) or {}).get("recipe")
        if not recipe:
            continue
        loss = " + ".join(n if w == 1 else f"{w:g} {n}" for n, w in (recipe["loss"] or {}).items())
        parts = [f"{loss}, {recipe['steps']:,} steps of {recipe['examples_per_step_per_rank']} prompts (per rank)",
                 "on " + ", ".join(recipe["data_dirs"] or [])
                 + (f" (weights {recipe['data_weights']})" if recipe["data_weights"] else "")]
        if recipe["init"] not in (None, "scratch"):
            parts.append(f"continued from `{recipe['init']}`")
        if recipe["vocab_subset"]:
            parts.append(f"{recipe['vocab_subset']:,}-token subset")
        if recipe["outside_rank"]:
            parts.append(f"factored outside rows of rank {recipe['outside_rank']}")
        if recipe["filter_hardest"]:
            parts.append(f"filter_hardest {recipe['filter_hardest']:g}")
        if recipe.get("ema_decay"):
            parts.append(f"weights averaged (ema_decay {recipe['ema_decay']:g})")
        if recipe["seconds"] is not None:
            parts.append(f"{recipe['seconds']:.0f} s of training on {recipe['machine']}")
        lines.append(f"- {name} trained by `make distill`: " + "; ".join(parts))
    return lines


def header_lines(report: dict) -> list[str]:
    """The title, a stopped run's warning, the timing-reliability lines and what was measured with what."""
    return [f"# Speculative decoding report: {report['config']['name']}", "",
            *([f"**Stopped early:** {report['stopped']}.", ""] if report.get("stopped") else []),
            *reliability_lines(report["timing_reliability"]),
            f"- command: `{report['command']}`",
            f"- date: {report['date']} · device: {report['device']} · git {report['git_sha']}",
            f"- target `{report['target']['ref']}` ({report['target']['params'] / 1e6:.1f}M params)"
            + "".join(_draft_part(name, report.get(key)) for name, key in (("draft", "draft"),
                                                                          ("feature draft", "feature_draft"))),
            *recipe_lines(report),
            f"- {report['max_new_tokens']} new tokens per prompt, batch 1, backend `{report['backend']}`, "
            f"{report['dtype']['dtype']} ({report['dtype']['reason']}); "
            "speedup = speculative tokens/s ÷ target-only tokens/s, timed interleaved in one process"]


def write_markdown(report: dict, path: Path) -> None:
    lines = [*header_lines(report),
             "", "## Headline", "", report["verdict"], "",
             "## Speculative vs target-only", "",
             "`draft+lookup` rows add prompt lookup to the draft (decode/lookup.py): looked up = proposed "
             "tokens that came from an earlier n-gram instead of the draft (accepted ones in brackets). "
             "`feature` rows: the feature draft, which reads the target's hidden states (decode/drafts/feature/model.py). "
             "Rows with a tree verify a draft tree in each target forward (decode/tree.py): k is its depth, "
             "nodes = tree nodes verified per target forward (a chain's k).", "",
             "speedup = pooled tokens/s ratio over the prompts; per prompt = the median (min–max) of each "
             "prompt's own ratio, which one slow run on a shared machine moves less.", "",
             "| prompts | T | proposer | k | tree | nodes | α | τ | looked up | target-only tok/s | speculative tok/s | "
             "speedup | per prompt | predicted | measured/predicted | greedy identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["results"]:
        same = "–" if row["greedy_identical"] is None else ("yes" if row["greedy_identical"] else "**NO**")
        looked_up = f"{row['looked_up']} ({row['looked_up_accepted']})" if "+lookup" in row["proposer"] else "–"
        per_prompt = row["speedup_per_prompt"]
        lines.append(f"| {row['prompt_set']} ({row['n_prompts']}) | {row['temperature']} | {row['proposer']} | "
                     f"{row['k']} | {row.get('tree') or 'chain'} | {_fmt(row.get('verified_per_forward'), 1)} | "
                     f"{_fmt(row['alpha'])} | {_fmt(row['tau'])} | {looked_up} | "
                     f"{_fmt(row['baseline_tok_s'], 1)} | "
                     f"{_fmt(row['speculative_tok_s'], 1)} | **{_fmt(row['speedup'])}×** | "
                     f"{_fmt(per_prompt['median'])}× ({_fmt(per_prompt['min'])}–{_fmt(per_prompt['max'])}) | "
                     f"{_fmt(row['predicted_speedup'])}× | {_fmt(row['measured_over_predicted'])} | {same} |")
    lines += cost_model_lines(report)
    if report.get("hf"):
        lines += ["", "## Hugging Face generate on the same prompts (greedy)", "",
                  "Each row against our greedy runs on the same prompts (n: how many)."
                  + (" In bf16 HF's forward rounds in other places than ours (its own kernels, rows not kept "
                     "apart), so its greedy tokens can part from ours at a near tie; ours equal our bf16 "
                     "target-only tokens." if report.get("dtype", {}).get("dtype") == "bf16" else ""), "",
                  "| prompts | n | method | k | tok/s | vs our target-only | ours speculative ÷ this "
                  "| same tokens as ours |", "|---|---|---|---|---|---|---|---|"]
        for row in report["hf"]:
            lines.append(f"| {row['prompt_set']} | {row.get('n_prompts', '–')} | {row['method']} | "
                         f"{row.get('k') or '–'} | {_fmt(row['tok_s'], 1)} | {_fmt(row['vs_our_baseline'])}× | "
                         f"{_fmt(row.get('ours_over_this'), unit='×')} | {row['identical_to_ours']} |")
    if report.get("serving"):
        lines += ["", *serving_lines(report["serving"])]
    if report.get("engines"):
        lines += ["", *engine_lines(report["engines"], report["engines_setup"])]
    lines += ["", "## Per prompt", "", "| prompts | prompt | T | proposer | k | tree | tokens | speedup | greedy identical |",
              "|---|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        same = "–" if run["greedy_identical"] is None else ("yes" if run["greedy_identical"] else "**NO**")
        lines.append(f"| {run['prompt_set']} | {run['prompt_id']} | {run['temperature']} | {run['proposer']} | {run['k']} | "
                     f"{run.get('tree') or 'chain'} | "
                     f"{run['speculative_tokens']} | {_fmt(run['speedup'])}× | {same} |")
    plots = "`acceptance_by_position.png`, `speedup_vs_k.png`" + (", `chains_vs_trees.png`" if _has_trees(report) else "")
    lines += ["", f"Plots: {plots}. Samples: `samples.jsonl`."]
    path.write_text("\n".join(lines) + "\n")


def cost_model_lines(report: dict) -> list[str]:
    """The cost model's paragraph and r(k) table, and the feature draft's next to a standalone one's."""
    cm, cm_end = report["cost_model"], report["cost_model_end"]
    lines: list[str] = []
    lines += ["", "## Cost model", "",
              f"Measured at a {cm['context_tokens']}-token context: target step {cm['target_step_ms']:.2f} ms, "
              f"draft step {cm['draft_step_ms']:.2f} ms, c = {cm['c']:.3f}. "
              "Predicted speedup = τ / (s·c + r(k)), s = draft forwards per target forward "
              "(k for the draft alone, fewer with prompt lookup). "
              f"Measured again after the timed runs: target step {cm_end['target_step_ms']:.2f} ms, "
              f"draft step {cm_end['draft_step_ms']:.2f} ms, c = {cm_end['c']:.3f}.", "",
              "r(k): a target forward over k + 1 tokens (a chain of k, or a tree of k nodes) ÷ one target step.", "",
              "| k | " + " | ".join(str(k) for k in cm["r"]) + " |",
              "|---|" + "---|" * len(cm["r"]),
              "| r(k) | " + " | ".join(f"{v:.2f}" for v in cm["r"].values()) + " |"]
    lines += tree_cost_lines(cm)
    feature_cost = report.get("feature_cost_model")
    if feature_cost and report.get("draft"):  # alone, the feature draft's is the cost model above
        fc, fc_end = feature_cost["start"], feature_cost["end"]
        lines += ["", f"Feature draft (`feature` rows), on the target runner that keeps the layers it reads: target "
                  f"step {fc['target_step_ms']:.2f} ms, draft step {fc['draft_step_ms']:.2f} ms, c = {fc['c']:.3f} "
                  f"(after the timed runs: {fc_end['target_step_ms']:.2f} ms, {fc_end['draft_step_ms']:.2f} ms). "
                  "Its s also counts the forwards through looked-up tokens it reads before drafting again.", "",
                  "| k | " + " | ".join(str(k) for k in fc["r"]) + " |", "|---|" + "---|" * len(fc["r"]),
                  "| r(k) | " + " | ".join(f"{v:.2f}" for v in fc["r"].values()) + " |"]
        lines += tree_cost_lines(fc)
    return lines


def tree_cost_lines(cost: dict) -> list[str]:
    """r_tree(n), where trees were measured: a masked forward over an n-node tree ÷ one target step."""
    if "r_tree" not in cost:
        return []
    return ["", "r_tree(n): the target forward over an n-node tree (a star: siblings' slots between a row's keys) "
                "÷ one target step; the tree rows' prediction reads it.", "",
            "| n | " + " | ".join(str(k) for k in cost["r_tree"]) + " |", "|---|" + "---|" * len(cost["r_tree"]),
            "| r_tree(n) | " + " | ".join(f"{v:.2f}" for v in cost["r_tree"].values()) + " |"]


def serving_lines(serving: dict) -> list[str]:
    """The "Serving (batch > 1)" section: continuous batching, target-only against the draft per batch size."""
    lines = ["## Serving (batch > 1)", "",
             "Requests decoded with continuous batching (decode/batched_speculative.py): speedup = tokens/s ÷ "
             "target-only tokens/s at the same batch size; latency = mean time from a request joining to its "
             "last token; greedy identical = every row equals batch-1 target-only decoding. Plot: `serving.png`.", "",
             "| prompts | batch | T | method | k | p_min | requests | tok/s | speedup | τ | latency s | greedy identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in serving["rows"]:
        same = "–" if r["greedy_identical"] is None else ("yes" if r["greedy_identical"] else "**NO**")
        lines.append(f"| {r['prompt_set']} | {r['batch']} | {r['temperature']} | {r['method']} | {r['k'] or '–'} | "
                     f"{r['p_min'] or '–'} | {r['requests']} | {_fmt(r['tok_s'], 1)} | **{_fmt(r['speedup'])}×** | "
                     f"{_fmt(r['tau'])} | {_fmt(r['mean_latency_s'])} | {same} |")
    lines.append("")
    for temperature, batch in serving["pays_up_to"].items():
        lines.append(f"- T={temperature}: " + (f"a draft row beats target-only up to batch {batch}; serve larger "
                                              "batches without speculation." if batch else
                                              "no draft row beats target-only here; serve without speculation."))
    return lines


def engine_lines(rows: list[dict], setup: dict) -> list[str]:
    """The "Serving engines" section: our exported draft and each engine's own n-gram mode inside the
    engine, against the same engine's plain decoding (`make eval-engines`, decode/engines/)."""
    lines = ["## Serving engines", "",
             f"`{setup['command']}` ({setup['date']}, {setup['threads']} threads per engine). The same "
             "prompt token ids in every engine. Batch 1: one prompt at a time; batch B > 1: the serving "
             "requests with up to B in flight (continuous batching), latency = mean time from a request joining "
             "to its last token. speedup = tokens/s ÷ the same engine's plain tokens/s at the same batch; "
             "α = accepted ÷ drafted tokens; τ = tokens per target forward; greedy identical = every output "
             "equals the engine's plain batch-1 greedy output of its prompt (plot by batch: "
             "`engines_serving.png`); log p = the target's mean "
             "log-probability per output token at that T (sampled outputs of a lossless engine score like "
             "its plain ones).", "",
             *[f"- {name}: {value}" for name, value in setup["files"].items()], "",
             "| engine | prompts | T | batch | mode | k | tok/s | speedup | α | τ | latency s | greedy identical | "
             "log p | notes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        same = "–" if row["greedy_identical"] is None else ("yes" if row["greedy_identical"] else "**NO**")
        speedup = "–" if row["mode"] == "plain" else f"**{_fmt(row['speedup'])}×**"
        lines.append(f"| {row['engine']} | {row['prompt_set']} ({row['n_prompts']}) | {row['temperature']} | "
                     f"{row['batch']} | {row['mode']} | {row['k'] or '–'} | {_fmt(row['tok_s'], 1)} | {speedup} | "
                     f"{_fmt(row['alpha'])} | {_fmt(row['tau'])} | {_fmt(row['mean_latency_s'])} | {same} | "
                     f"{_fmt(row['target_logprob'])} | "
                     f"{'; '.join(row['notes'])} |")
    return lines


def write_engines_markdown(report: dict, path: Path) -> None:
    """report.md of a report with engine rows only (no eval-speedup run in this folder yet)."""
    lines = [f"# Serving engines report: {report['config']['name']}", "",
             f"- target `{report['config']['target']}`, the draft exported to `{report['engines_setup']['export_dir']}`, "
             f"{report['config']['eval']['max_new_tokens']} new tokens per prompt · git {report['git_sha']}", "",
             *engine_lines(report["engines"], report["engines_setup"])]
    path.write_text("\n".join(lines) + "\n")


def write_plots(report: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in report["results"] if not r.get("tree")]
    groups = sorted({(r["prompt_set"], r["temperature"], r["proposer"]) for r in results})

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        acc = r["per_position_acceptance"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o",
                label=f"{r['prompt_set']} T={r['temperature']} {r['proposer']} k={r['k']}")
    ax.set(xlabel="draft position", ylabel="P(accept | reached)", ylim=(0, 1.02),
           title="Acceptance by draft position")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "acceptance_by_position.png", dpi=120)
    plt.close(fig)

    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(10, 4))
    for group in groups:
        rows = sorted((r for r in results if (r["prompt_set"], r["temperature"], r["proposer"]) == group),
                      key=lambda r: r["k"])
        ks = [r["k"] for r in rows]
        label = "{} T={} {}".format(*group)
        ax_tau.plot(ks, [r["tau"] for r in rows], marker="o", label=label)
        (measured,) = ax_speed.plot(ks, [r["speedup"] for r in rows], marker="o", label=f"{label} measured")
        ax_speed.plot(ks, [r["predicted_speedup"] for r in rows], linestyle="--", marker="x",
                      color=measured.get_color(), label=f"{label} predicted")
    ax_tau.set(xlabel="k", ylabel="τ (tokens per target forward)", title="τ vs k")
    ax_speed.axhline(1.0, color="grey", linewidth=0.8)
    ax_speed.set(xlabel="k", ylabel="speedup over target-only", title="Speedup vs k")
    for ax in (ax_tau, ax_speed):
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax_tau.legend(fontsize=7)
    ax_speed.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "speedup_vs_k.png", dpi=120)
    plt.close(fig)
    if _has_trees(report):
        _plot_chains_vs_trees(plt, report["results"], out_dir / "chains_vs_trees.png")
    if report.get("serving"):
        _plot_serving(plt, report["serving"]["rows"], out_dir / "serving.png")


def _plot_serving(plt, rows: list[dict], path: Path) -> None:
    """Speedup over target-only against batch size, one line per (method, k, T)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, k, p_min, temperature in sorted({(r["method"], r["k"], r["p_min"], r["temperature"])
                                                 for r in rows if r["k"]}):
        line = sorted((r for r in rows if (r["method"], r["k"], r["p_min"], r["temperature"])
                       == (method, k, p_min, temperature)), key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in line], [r["speedup"] for r in line], marker="o",
                linestyle="-" if temperature == 0 else "--", label=f"{method} k={k} T={temperature}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch size", ylabel="speedup over target-only (same batch)", title="Speculative decoding by batch size")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_engine_serving(rows: list[dict], path: Path) -> None:
    """`make eval-engines` with batches > 1: each engine mode's speedup over the same engine's plain decoding
    against batch size, one line per (engine, mode, k, T)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for line_key in sorted({(r["engine"], r["mode"], r["k"], r["temperature"]) for r in rows if r["mode"] != "plain"}):
        line = sorted((r for r in rows if (r["engine"], r["mode"], r["k"], r["temperature"]) == line_key
                       and r["speedup"] is not None), key=lambda r: r["batch"])
        engine, mode, k, temperature = line_key
        ax.plot([r["batch"] for r in line], [r["speedup"] for r in line], marker="o",
                linestyle="-" if temperature == 0 else "--", label=f"{engine} {mode} k={k} T={temperature}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch size", ylabel="speedup over the engine's plain decoding", title="Serving engines by batch size")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _has_trees(report: dict) -> bool:
    return any(r.get("tree") for r in report["results"])


def _plot_chains_vs_trees(plt, results: list[dict], path: Path) -> None:
    """τ and speedup of every chain and tree, one group of bars per (prompt set, T, draft kind)."""
    groups = sorted({(r["prompt_set"], r["temperature"], r["proposer"]) for r in results if "+lookup" not in r["proposer"]})
    fig, axes = plt.subplots(2, 1, figsize=(max(6, 2.2 * len(groups)), 7))
    for g, group in enumerate(groups):
        rows = [r for r in results if (r["prompt_set"], r["temperature"], r["proposer"]) == group]
        rows.sort(key=lambda r: (bool(r.get("tree")), r["k"], r.get("tree") or ""))
        width = 0.8 / len(rows)
        for i, r in enumerate(rows):
            label = r.get("tree") or f"chain k={r['k']}"
            for ax, metric in zip(axes, ("tau", "speedup")):
                bar = ax.bar(g + i * width, r[metric], width, color="tab:green" if r.get("tree") else "tab:blue")
                ax.bar_label(bar, labels=[label], rotation=90, fontsize=6, padding=2)
    for ax, name in zip(axes, ("τ (tokens per target forward)", "speedup over target-only")):
        ax.set_xticks([g + 0.4 for g in range(len(groups))], ["{} T={} {}".format(*group) for group in groups], fontsize=7)
        ax.set_ylabel(name)
    axes[1].axhline(1.0, color="grey", linewidth=0.8)
    axes[0].set_title("Chains (blue) and trees (green), same draft and prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
