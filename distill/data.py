"""Training data: generate-data shards -> examples -> deterministic, sharded micro-batches.

Exactly the shards manifest.json lists are read, each verified against it first (sha256, rows).

An example is one prompt + completion. Position t of the model input predicts token t + 1, so
the completion token j (at sequence index P + j) is predicted at position P + j - 1, and the
cached teacher row j (the target's top-K for completion token j) lines up with that position.

Batching is a pure function of (seed, epoch, step): each optimizer step takes the next
`global_batch = micro_batch_size x grad_accum x world_size` examples of the epoch's seeded
permutation, dealt round-robin to ranks, then cut into micro-batches. So resuming mid-epoch
needs only the step number, and 1 rank x accum 4 sees exactly the examples of 2 ranks x accum 2.
The last step of an epoch may be short: ranks/micro-batches with nothing left get a dummy row
whose loss mask is all False (it keeps every rank's forward/backward count equal, as DDP and
DeepSpeed require, and contributes nothing). Every example is used exactly once per epoch.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from common.errors import UserError
from distill.generation.shards import CorruptShardError, verify_shards


class DataError(UserError):
    """Missing, corrupt or unusable training data (names the shard)."""


@dataclass
class Example:
    ids: np.ndarray
    """[P + C] full-vocabulary ids: prompt then completion (after truncation)."""
    n_prompt: int
    topk_ids: np.ndarray | None
    """[C, K] target top-K ids for each completion token (None without a teacher cache)."""
    topk_logp: np.ndarray | None
    """[C, K] their log-probs at T = 1, sorted descending."""
    source: str
    folder: int = 0
    """Index of its data dir in the list it was read from (distill.data_dirs: the mixture's groups)."""
    origin: tuple[Path, int, int] | None = None
    """(shard, row index in it, index of ids[0] in the row's untruncated prompt + completion): where the
    row's stored hidden states are (distill/feature_store.py); None for a dummy row."""


def manifest_shards(data_dir: str | Path) -> list[Path]:
    """The shards data_dir/manifest.json lists, each checked against it (sha256, row count) with
    generate-data's own checks. Only these are read: a *.parquet file the manifest does not list
    (a stray copy would add its rows twice) is named in a warning and skipped."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"data dir {str(data_dir)!r} does not exist; run `make generate-data` first")
    try:
        paths = verify_shards(data_dir)
    except CorruptShardError as e:
        raise DataError(str(e)) from e
    if not paths:
        raise DataError(f"the manifest in {str(data_dir)!r} lists no shards")
    extra = sorted(set(data_dir.glob("*.parquet")) - set(paths))
    if extra:
        warnings.warn(f"{data_dir}: not reading {[p.name for p in extra]}: manifest.json does not list them")
    return paths


def read_rows(data_dirs: list[str], need_topk: bool) -> list[dict]:
    """All rows of the manifest-listed shards, as python dicts. A shard that cannot be read is an
    error, never skipped."""
    columns = ["prompt_ids", "completion_ids", "split", "source"]
    rows = []
    for folder, data_dir in enumerate(data_dirs):
        for path in manifest_shards(data_dir):
            try:
                table = pq.read_table(path)
            except (OSError, ValueError) as e:  # pyarrow raises ArrowInvalid (a ValueError) / OSError
                raise DataError(f"cannot read shard {path}: {e}") from e
            missing = [c for c in columns if c not in table.column_names]
            if need_topk:
                missing += [c for c in ("teacher_topk_ids", "teacher_topk_logprobs") if c not in table.column_names]
            if missing:
                hint = " (set generate.teacher_topk > 0, or distill.teacher=online)" if need_topk else ""
                raise DataError(f"shard {path} lacks columns {missing}{hint}")
            keep = columns + (["teacher_topk_ids", "teacher_topk_logprobs"] if need_topk else [])
            rows += [{**row, "origin": (path, i), "folder": folder}
                     for i, row in enumerate(table.select(keep).to_pylist())]
    return rows


def make_example(row: dict, max_seq_len: int, need_topk: bool) -> Example | None:
    """Truncate to max_seq_len + 1 tokens (the model sees max_seq_len inputs): drop the prompt's
    oldest tokens first (keeping one), then the completion's tail. None if no completion is left."""
    prompt, completion = list(row["prompt_ids"]), list(row["completion_ids"])
    if not prompt or not completion:
        return None
    budget = max_seq_len + 1
    dropped = max(0, len(prompt) - max(1, budget - len(completion)))  # the prompt's oldest tokens cut
    prompt = prompt[dropped:]
    completion = completion[: budget - len(prompt)]
    if not completion:
        return None
    topk_ids = topk_logp = None
    if need_topk:
        topk_ids = np.asarray(row["teacher_topk_ids"][: len(completion)], dtype=np.int64)
        topk_logp = np.asarray(row["teacher_topk_logprobs"][: len(completion)], dtype=np.float32)
        if topk_ids.shape[0] != len(completion):
            raise DataError(f"teacher cache has {topk_ids.shape[0]} rows for {len(completion)} completion tokens")
    origin = (*row["origin"], dropped) if "origin" in row else None
    return Example(np.asarray(prompt + completion, dtype=np.int64), len(prompt), topk_ids, topk_logp,
                   row["source"], row.get("folder", 0), origin)


def load_examples(data_dirs: list[str], max_seq_len: int, need_topk: bool,
                  sources: list[str] | None = None) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples; the split is the one generate-data chose (by prompt).
    sources: keep only rows from these prompt sources (a workload-specialised draft); None/[] = all."""
    rows = read_rows(data_dirs, need_topk)
    if sources:
        present = sorted({row["source"] for row in rows})
        unknown = sorted(set(sources) - set(present))
        if unknown:
            raise DataError(f"distill.sources {unknown} not in {data_dirs}; their rows come from {present}")
        rows = [row for row in rows if row["source"] in sources]
    train, held_out = [], []
    for row in rows:
        example = make_example(row, max_seq_len, need_topk)
        if example is not None:
            (held_out if row["split"] == "eval" else train).append(example)
    if not train:
        raise DataError(f"no training rows in {data_dirs}")
    return train, held_out


def held_out_subset(held_out: list[Example], n: int) -> list[Example]:
    """The n held-out rows training and `distill.held_out` evaluate on: the first data dir's held-out rows
    first, then the next dir's, each dir's spread evenly over its rows when it has more than are left to
    take. generate-data writes a dir's rows sorted by length, so its first rows are its shortest prompts:
    the demo's first 64 of 118 held-out rows were 49 short FreshQA/PersistBench questions and 13 GSM8K
    ones (prompts of 56 tokens on average against 102 for the rest, 49 of which were GSM8K), and their
    exact tau(4) was 1.555 against 1.678 over all 118. An even spread keeps every length and source."""
    chosen: list[Example] = []
    for folder in sorted({ex.folder for ex in held_out}):
        room = n - len(chosen)
        if room <= 0:
            break
        rows = [ex for ex in held_out if ex.folder == folder]
        if len(rows) > room:  # room distinct indices, first and last rows included
            rows = [rows[i] for i in np.linspace(0, len(rows) - 1, room).round().astype(int)]
        chosen += rows
    return chosen


def token_counts(examples: list[Example], vocab_size: int) -> torch.Tensor:
    """Occurrences of each id in prompts and completions [vocab_size] (for the vocabulary subset)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ex in examples:
        counts += np.bincount(ex.ids, minlength=vocab_size)[:vocab_size]
    return torch.from_numpy(counts)


# ---------------------------------------------------------------------------------------------
# Deterministic sharding


class StepSampler:
    """Which examples each rank's micro-batches hold at a given optimizer step.

    With mixture `weights` (one per group, `groups[i]` = example i's group), each epoch of n examples
    draws round(n · w_g / Σw) of them from group g: a fresh seeded permutation of the group, repeated
    when the group is smaller than its share (oversampled) and cut when larger. Without weights every
    example appears exactly once per epoch.

    With `lengths` and `length_window` > 0, each run of `length_window` steps' examples of the epoch's order is
    sorted by length and cut into steps, and the epoch's full steps are then shuffled: a batch holds rows of
    similar length, so it pads less (collate pads to the batch's longest row), and the epoch still holds the
    same examples."""

    def __init__(self, num_examples: int, micro_batch_size: int, grad_accum: int, world_size: int, seed: int,
                 groups: list[int] | None = None, weights: list[float] | None = None,
                 lengths: list[int] | None = None, length_window: int = 0):
        self.n = num_examples
        self.micro, self.accum, self.world = micro_batch_size, grad_accum, world_size
        self.global_batch = micro_batch_size * grad_accum * world_size
        self.steps_per_epoch = math.ceil(num_examples / self.global_batch)
        self.seed = seed
        self.lengths = lengths if length_window else None
        self.length_window = length_window
        self.members = self.quotas = None
        if weights:
            groups = torch.tensor(groups if groups is not None else [0] * num_examples)
            self.members = [torch.nonzero(groups == g).flatten() for g in range(len(weights))]
            self.quotas = mixture_quotas(num_examples, weights, [len(m) for m in self.members])

    def epoch_order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        order = self.shuffled(generator)
        return self.grouped_by_length(order, generator) if self.lengths is not None else order

    def shuffled(self, generator: torch.Generator) -> list[int]:
        if self.members is None:
            return torch.randperm(self.n, generator=generator).tolist()
        picks = []
        for members, quota in zip(self.members, self.quotas):
            if quota:
                repeats = math.ceil(quota / len(members))
                picks.append(torch.cat([members[torch.randperm(len(members), generator=generator)]
                                        for _ in range(repeats)])[:quota])
        order = torch.cat(picks)
        return order[torch.randperm(len(order), generator=generator)].tolist()

    def grouped_by_length(self, order: list[int], generator: torch.Generator) -> list[int]:
        window = self.global_batch * self.length_window
        steps = []
        for start in range(0, len(order), window):
            part = sorted(order[start:start + window], key=lambda i: self.lengths[i], reverse=True)
            steps += [part[b:b + self.global_batch] for b in range(0, len(part), self.global_batch)]
        # only the epoch's last step can be short; it stays last so every other step is a full one
        short = [steps.pop()] if len(steps[-1]) < self.global_batch else []
        steps = [steps[i] for i in torch.randperm(len(steps), generator=generator).tolist()] + short
        return [i for step in steps for i in step]

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        """[grad_accum] lists of example indices for `rank` at 0-based optimizer step `step` (may be empty)."""
        epoch, within = divmod(step, self.steps_per_epoch)
        chunk = self.epoch_order(epoch)[within * self.global_batch:(within + 1) * self.global_batch]
        mine = chunk[rank::self.world]
        return [mine[a * self.micro:(a + 1) * self.micro] for a in range(self.accum)]


def mixture_quotas(total: int, weights: list[float], sizes: list[int]) -> list[int]:
    """Examples per group in an epoch of `total`: proportional to the weights, rounded by largest remainder
    so they sum to `total`. Raises DataError for a weighted group with no examples."""
    empty = [g for g, (w, size) in enumerate(zip(weights, sizes)) if w > 0 and size == 0]
    if empty:
        raise DataError(f"distill.data_weights gives data dirs {empty} (0-based) a weight but they hold no "
                        "training rows")
    shares = [total * w / sum(weights) for w in weights]
    quotas = [math.floor(share) for share in shares]
    by_remainder = sorted((g for g, w in enumerate(weights) if w > 0), key=lambda g: quotas[g] - shares[g])
    for g in by_remainder[: total - sum(quotas)]:
        quotas[g] += 1
    return quotas


def collate(examples: list[Example], pad_id: int, with_topk: bool) -> dict[str, torch.Tensor]:
    """Right-padded batch. An empty list gives one dummy row with an all-False loss mask.

    input_ids [B, T] (T = longest sequence - 1), attention_mask [B, T], loss_mask [B, T] (positions
    predicting completion tokens), labels [B, T] (next token), and with a teacher cache
    topk_ids / topk_logp [B, T, K] aligned to those positions."""
    dummy = not examples
    if dummy:
        examples = [Example(np.array([pad_id, pad_id]), 1, None, None, "dummy")]
    length = max(len(ex.ids) for ex in examples) - 1
    batch = len(examples)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    labels = torch.full((batch, length), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, length), dtype=torch.long)
    loss_mask = torch.zeros((batch, length), dtype=torch.bool)
    k = next((ex.topk_ids.shape[1] for ex in examples if ex.topk_ids is not None), 1)
    topk_ids = torch.zeros((batch, length, k), dtype=torch.long)
    topk_logp = torch.zeros((batch, length, k), dtype=torch.float32)
    for b, ex in enumerate(examples):
        n = len(ex.ids) - 1
        ids = torch.from_numpy(ex.ids)
        input_ids[b, :n] = ids[:-1]
        labels[b, :n] = ids[1:]
        attention[b, :n] = 1
        if not dummy:
            loss_mask[b, ex.n_prompt - 1:n] = True
        if ex.topk_ids is not None:
            topk_ids[b, ex.n_prompt - 1:n] = torch.from_numpy(ex.topk_ids)
            topk_logp[b, ex.n_prompt - 1:n] = torch.from_numpy(ex.topk_logp)
    out = dict(input_ids=input_ids, attention_mask=attention, loss_mask=loss_mask, labels=labels)
    if with_topk:
        out.update(topk_ids=topk_ids, topk_logp=topk_logp)
    return out
