"""The generation plan: which rows go to which shard, and the fingerprint a resume must match.

Rows are (prompt, sample_index) pairs sorted by prompt length, so each shard (and each batch in
it) holds prompts of similar length: little padding work. Shards are cut from that list in
order and given to ranks round-robin (shard i -> rank i % world_size). The plan depends only on
the config and the prompts, never on the world size or batch size, so a run can be resumed with
another number of processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from common.config import Config, ConfigError
from common.errors import UserError
from common.models import model_hash
from common.prompts import Prompt, PromptSet, build_prompt_set, chat_template_hash, tokenizer_hash
from distill.generation.pairs import response_rows, responses_by_prompt


PLAN_FILE = "plan.json"


@dataclass(frozen=True)
class Row:
    prompt: Prompt
    sample_index: int
    completion_ids: tuple[int, ...] = ()
    """Score mode: the tokens the target is teacher-forced over."""


def plan_rows(config: Config, tokenizer, context_length: int | None) -> tuple[PromptSet, list[Row]]:
    """Prompts -> (prompt set, rows). Score mode scores the raw text (token 0 is the context), or with
    generate.response_field each chat-templated prompt's response (distill/generation/pairs.py).

    Raises ConfigError when no row is left (an empty source, a text_field no record has): a run
    must never finish "complete" with 0 rows."""
    g = config.generate
    score = g.mode == "score"
    pairs = score and g.response_field is not None
    prompt_set = build_prompt_set(
        g.sources, tokenizer, text_field=g.text_field, system_prompt=g.system_prompt,
        max_prompt_tokens=g.max_prompt_tokens, max_new_tokens=0 if score else g.max_new_tokens,
        context_length=context_length, eval_fraction=g.eval_fraction, max_prompts=g.max_prompts,
        chat_template=pairs or not score)
    if pairs:
        responses = responses_by_prompt(g.sources, g.text_field, g.response_field)
        rows = [Row(p, 0, ids) for p, ids in response_rows(prompt_set, responses, tokenizer, tokenizer.eos_token_id,
                                                         context_length)]
    elif score:
        rows = [Row(dataclasses.replace(p, token_ids=p.token_ids[:1]), 0, p.token_ids[1:])
                for p in prompt_set.prompts if len(p.token_ids) >= 2]
    else:
        rows = [Row(p, s) for p in prompt_set.prompts for s in range(g.samples_per_prompt)]
    if not rows:
        read = sum(count["read"] for count in prompt_set.counts.values())
        raise ConfigError(
            f"no rows to {g.mode}: generate.sources {g.sources} held {read} records, "
            f"{len(prompt_set.prompts)} prompts kept (skipped: {skipped_by_reason(prompt_set) or 'none'}); "
            f"check the sources and generate.text_field ({g.text_field!r})"
            + ("; score mode needs texts of >= 2 tokens" if score else ""))
    return prompt_set, rows


def skipped_by_reason(prompt_set: PromptSet) -> dict[str, int]:
    return dict(Counter(s["reason"] for s in prompt_set.skipped))


def plan_shards(rows: list[Row], shard_size: int) -> list[list[Row]]:
    ordered = sorted(rows, key=lambda r: (len(r.prompt.token_ids) + len(r.completion_ids),
                                          r.prompt.prompt_id, r.sample_index))
    return [ordered[i:i + shard_size] for i in range(0, len(ordered), shard_size)]


def plan_hash(shards: list[list[Row]]) -> str:
    digest = hashlib.sha256()
    for i, shard in enumerate(shards):
        digest.update(f"[{i}]".encode())
        for row in shard:
            digest.update(f"{row.prompt.prompt_id}:{row.sample_index};".encode())
    return digest.hexdigest()


def fingerprint(config: Config, tokenizer, shards: list[list[Row]], engine: str, sampler: str) -> dict:
    """Everything that changes what a row contains. Batch size, world size and vLLM's parallel
    sizes do not. `engine`: 'project' or 'vllm'; `sampler`: the engine's name for what fixes the
    token each row's stream draws."""
    g = config.generate
    return {
        "target": config.target, "target_hash": model_hash(config.target),
        "tokenizer_hash": tokenizer_hash(tokenizer), "chat_template_hash": chat_template_hash(tokenizer),
        "mode": g.mode, "seed": config.seed, "engine": engine, "sampler": sampler,
        "vllm_llm_args": (g.vllm.llm_args or None) if engine == "vllm" else None,
        "temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k,
        "max_new_tokens": g.max_new_tokens, "samples_per_prompt": g.samples_per_prompt,
        "teacher_topk": g.teacher_topk, "dtype": g.dtype, "system_prompt": g.system_prompt,
        "sources": g.sources, "text_field": g.text_field, "response_field": g.response_field,
        "max_prompts": g.max_prompts,
        "max_prompt_tokens": g.max_prompt_tokens, "eval_fraction": g.eval_fraction, "shard_size": g.shard_size,
        "num_shards": len(shards), "plan_hash": plan_hash(shards),
    }


def recorded_engine(out_dir: Path) -> str | None:
    """The engine that started out_dir (None for a new folder)."""
    path = out_dir / PLAN_FILE
    return _with_engine(json.loads(path.read_text()))["engine"] if path.is_file() else None


def _with_engine(recorded: dict) -> dict:
    """Plans written before generate.engine existed were all made by the project engine."""
    return {"engine": "project", **recorded}


class ResumeMismatch(UserError):
    """out_dir holds a run started with different settings; mixing them would corrupt the data."""


def check_or_write_plan(out_dir: Path, fingerprint: dict, write: bool) -> None:
    """First run: record the fingerprint. Later runs: refuse to continue if anything differs."""
    path = out_dir / PLAN_FILE
    if not path.is_file():
        if write:
            tmp = path.with_name(f".{PLAN_FILE}.tmp")
            tmp.write_text(json.dumps(fingerprint, indent=1, sort_keys=True))
            tmp.replace(path)
        return
    recorded = _with_engine(json.loads(path.read_text()))
    differs = [f"{key}: {recorded.get(key)!r} -> {fingerprint.get(key)!r}"
               for key in sorted(set(recorded) | set(fingerprint)) if recorded.get(key) != fingerprint.get(key)]
    if differs:
        raise ResumeMismatch(
            f"refusing to resume in {out_dir}: it was started with different settings:\n  "
            + "\n  ".join(differs)
            + ("\ngenerate.engine=auto resumes with the engine that started it."
               if recorded["engine"] != fingerprint.get("engine") else "")
            + "\nUse another generate.out_dir, or delete the folder to start over.")
