"""`make onpolicy`: rounds of on-policy distillation after `make distill` (DistillSpec, arXiv 2310.08461).

Round r: (1) rollouts: the round's starting draft samples one completion per prompt of generate.sources at
onpolicy.temperature, and the target scores each (generate-data with generate.rollout_draft, in the round's
own folder, seed + r so every round draws new samples; a feature draft drafts generate.rollout_k tokens at a
time from the target's states, as in the decoder, and the folder keeps those states: generate.features);
(2) training continues from that draft on distill.data_dirs plus every round's rollouts so far, mixed by
onpolicy.weight, for onpolicy.steps.
Each stage runs as its own process (python -m distill.generate / distill.train) from a config written into
the round's folder, so each resumes on its own after a kill; a rerun skips finished stages and rounds.
rounds.json records per round the draft that sampled (path, weights' hash, step), the folders, each
stage's wall-clock seconds and the held-out α and τ the round's training reached.

    python -m distill.onpolicy --config configs/smollm2.yaml onpolicy.rounds=2
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from common.cli import cli_config, run_cli
from common.config import Config, ConfigError, save_config
from common.errors import UserError


ROUNDS_FILE = "rounds.json"


class StageFailed(UserError):
    """A round's generate-data or training process exited with an error (its own message is above)."""


def onpolicy_root(config: Config) -> Path:
    return Path(config.onpolicy.out_dir or Path(config.distill.out_dir) / "onpolicy")


def mixture_weights(config: Config, rounds_so_far: int) -> list[float]:
    """distill.data_dirs share 1 - onpolicy.weight (by distill.data_weights when given, else evenly), the
    rollout folders of rounds 1..rounds_so_far share onpolicy.weight evenly."""
    base = config.distill.data_weights or [1.0] * len(config.distill.data_dirs)
    rest = 1 - config.onpolicy.weight
    return [rest * w / sum(base) for w in base] + [config.onpolicy.weight / rounds_so_far] * rounds_so_far


def round_configs(config: Config, r: int, start_draft: str) -> tuple[Config, Config]:
    """(generate-data config, training config) of round r, starting from the draft at start_draft."""
    op, dc, folder = config.onpolicy, config.distill, onpolicy_root(config) / f"round-{r}"
    generate = dataclasses.replace(
        config.generate, out_dir=str(folder / "rollouts"), mode="generate", rollout_draft=start_draft,
        response_field=None, temperature=op.temperature, max_prompts=op.max_prompts, samples_per_prompt=1,
        engine="project", features=dc.draft_kind == "feature")
    rollouts = [str(onpolicy_root(config) / f"round-{i}" / "rollouts") for i in range(1, r + 1)]
    # The draft keeps start_draft's vocabulary subset (vocab_subset=0 with a pretrained init); the schedule
    # warms up again briefly and anneals over the round's steps.
    distill = dataclasses.replace(
        dc, init=start_draft, vocab_subset=0, data_dirs=[*dc.data_dirs, *rollouts],
        data_weights=mixture_weights(config, r), out_dir=str(folder / "run"), max_steps=op.steps,
        lr_schedule_steps=0, warmup_steps=min(dc.warmup_steps, op.steps // 10), stop_after=0,
        export=dc.export and r == op.rounds)
    return (dataclasses.replace(config, seed=config.seed + r, generate=generate),
            dataclasses.replace(config, distill=distill, draft=str(folder / "run" / "final")))


def check_onpolicy(config: Config) -> str:
    """Refuse what cannot run before any model loads; returns round 1's starting draft."""
    if config.generate.teacher_topk < 1:
        raise ConfigError("make onpolicy stores the target's top-k over the draft's rollouts: set "
                          "generate.teacher_topk >= 1 (the training data's own top-k, so the folders mix)")
    first = str(Path(config.distill.out_dir) / "final")
    # Imported here, not at the top: common.models brings in transformers (~6 s on 2 cores), which a bad setting
    # (the config's own checks and the one above) is reported without.
    from common.models import reference_problem
    from decode.drafts.feature.model import feature_draft_problem

    problem = feature_draft_problem(first) if config.distill.draft_kind == "feature" else reference_problem(first)
    if problem:
        raise ConfigError(f"onpolicy: round 1 starts from the draft `make distill` writes to {first}, and {problem}; "
                          "run `make distill` first")
    return first


def run_stage(module: str, config: Config, path: Path) -> float:
    """Write the stage's config to `path`, run `python -m module` on it; its wall-clock seconds."""
    config.validate()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_config(config, path)
    start = time.perf_counter()
    code = subprocess.run([sys.executable, "-m", module, "--config", str(path)]).returncode
    if code:
        raise StageFailed(f"{module} --config {path} exited with code {code} (its messages are above); "
                          "rerun `make onpolicy` to resume the round")
    return round(time.perf_counter() - start, 1)


def read_rounds(root: Path) -> dict[int, dict]:
    path = root / ROUNDS_FILE
    return {entry["round"]: entry for entry in json.loads(path.read_text())} if path.is_file() else {}


def write_rounds(root: Path, rounds: dict[int, dict]) -> None:
    tmp = root / f".{ROUNDS_FILE}.tmp"
    tmp.write_text(json.dumps([rounds[r] for r in sorted(rounds)], indent=1))
    tmp.replace(root / ROUNDS_FILE)


def run_round(config: Config, r: int, start_draft: str, record: dict) -> dict:
    """Round r's missing stages; the updated record."""
    from distill.generation.rollout import draft_identity  # reads the draft's weights: torch + transformers

    generate, train = round_configs(config, r, start_draft)
    folder = onpolicy_root(config) / f"round-{r}"
    rollouts, run = Path(generate.generate.out_dir), Path(train.distill.out_dir)
    record = {"round": r, **draft_identity(start_draft), "rollouts": str(rollouts), "run": str(run),
              "data_weights": train.distill.data_weights, **record}
    if not _complete(rollouts):
        record["rollout_seconds"] = run_stage("distill.generate", generate, folder / "generate.yaml")
        manifest = json.loads((rollouts / "manifest.json").read_text())
        record["rollout_tokens"] = manifest["throughput_this_run"]["tokens"]
    if not (run / "final_metrics.json").is_file():
        record["train_seconds"] = run_stage("distill.train", train, folder / "train.yaml")
    summary = json.loads((run / "final_metrics.json").read_text())
    record.update({key[6:]: value for key, value in summary.items() if key.startswith("final/")})
    return record


def _complete(data_dir: Path) -> bool:
    manifest = data_dir / "manifest.json"
    return manifest.is_file() and json.loads(manifest.read_text()).get("complete", False)


def run_onpolicy(config: Config) -> list[dict]:
    """Every round in order, each from the previous one's draft; rounds.json after each stage's round."""
    start_draft = check_onpolicy(config)
    root = onpolicy_root(config)
    root.mkdir(parents=True, exist_ok=True)
    rounds = read_rounds(root)
    for r in range(1, config.onpolicy.rounds + 1):
        if r in rounds and rounds[r]["draft"] != start_draft:
            raise ConfigError(f"{root / ROUNDS_FILE} says round {r} started from {rounds[r]['draft']}, not "
                              f"{start_draft}: another onpolicy.out_dir, or delete {root} to start over")
        rounds[r] = run_round(config, r, start_draft, rounds.get(r, {}))
        write_rounds(root, rounds)
        print(f"onpolicy round {r}: held-out alpha {rounds[r].get('alpha', float('nan')):.4f}, "
              f"tau(k={config.distill.tau_k}) {rounds[r].get(f'tau_k{config.distill.tau_k}', float('nan')):.3f}; "
              f"draft {rounds[r]['run']}/final", file=sys.stderr)
        start_draft = str(Path(rounds[r]["run"]) / "final")
    return [rounds[r] for r in sorted(rounds)]


def main(argv: list[str] | None = None) -> list[dict]:
    return run_onpolicy(cli_config(argv, "On-policy distillation rounds after make distill (make onpolicy)."))


if __name__ == "__main__":
    run_cli(main)
