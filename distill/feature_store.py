"""The features files `make features` (python -m distill.features) writes and the stored teacher reads: the
target's hidden states of the layers a feature draft reads, computed once for every row of the training data,
so that `distill.teacher=stored` trains without running the target.

For each folder in distill.data_dirs (the data the run trains on) and each shard its manifest lists:

  <data_dir>/features/<shard stem>.safetensors
      hidden   [tokens, L, H] bf16  every row's untruncated prompt + completion, teacher-forced, rows
                                    concatenated in shard order (layer i: the output of decoder layer i,
                                    the last one after the final norm, as the online teacher reads it)
      offsets  [rows + 1] int64     row r is hidden[offsets[r]:offsets[r + 1]]
      metadata shard_sha256, rows   the shard it was made from (its manifest.json entry)
  <data_dir>/features/features.json the target's identity (feature_target.py), the layers and the dtype

Size: tokens x L x H x 2 bytes; the demo's data (~2.5k rows x ~170 tokens, 3 layers of 576) is ~1.5 GB.
Each file is written to a temporary name and renamed (complete or absent); a rerun skips files whose
shard is unchanged, and refuses a folder made for another target or other layers.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow.parquet as pq
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.config import Config
from common.models import load_model, load_tokenizer, resolve_device
from common.precision import resolve_dtype
from common.progress import BatchProgress
from decode.drafts.feature.shape import feature_layers
from distill.data import DataError, manifest_shards
from distill.generation.shards import remove_stale_temp
from distill.training.feature_target import TargetIdentity, target_config
from distill.training.feature_teacher import forward_keeping_layers


FEATURES_DIR = "features"
INFO_FILE = "features.json"
DTYPE = "bf16"


@dataclass
class FeatureSpec:
    """What a features folder was made for: training refuses any other target, layers or dtype."""
    identity: dict
    layers: list[int]
    dtype: str = DTYPE

    @classmethod
    def of(cls, config: Config) -> FeatureSpec:
        """The spec a run of `config` needs (the target's config and tokenizer only: no weights load)."""
        target = target_config(config.target)
        layers = feature_layers(config.distill.feature_layers, target.num_hidden_layers, config.target)
        return cls(asdict(TargetIdentity.of(target, load_tokenizer(config.target))), layers)

    def differences(self, folder: Path) -> list[str] | None:
        """How folder's features.json differs from this spec, one line a field; None when there is none."""
        path = folder / INFO_FILE
        if not path.is_file():
            return None
        stored, wanted = _flat(json.loads(path.read_text())), _flat(asdict(self))
        return [f"{key} {stored.get(key)!r} -> {value!r}" for key, value in wanted.items() if stored.get(key) != value]

    def write(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{INFO_FILE}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(tmp, folder / INFO_FILE)


def _flat(spec: dict) -> dict:
    """A spec's fields with the identity's own (hidden_size, ...) beside layers and dtype: one per difference."""
    return {**spec.get("identity", {}), **{key: value for key, value in spec.items() if key != "identity"}}


def features_dir(data_dir: str | Path) -> Path:
    return Path(data_dir) / FEATURES_DIR


def features_file(shard: Path) -> Path:
    return features_dir(shard.parent) / f"{shard.stem}.safetensors"


def shard_digests(data_dir: str | Path) -> dict[Path, tuple[str, int]]:
    """{shard path: (sha256, rows)} of the shards data_dir's manifest lists, each verified first."""
    paths = manifest_shards(data_dir)
    entries = {s["name"]: (s["sha256"], s["rows"]) for s in json.loads((Path(data_dir) / "manifest.json")
                                                                       .read_text())["shards"]}
    return {path: entries[path.name] for path in paths}


def stored_shard(path: Path) -> dict | None:
    """The metadata of shard `path`'s features file ({shard_sha256, rows}), or None when there is none."""
    file = features_file(path)
    if not file.is_file():
        return None
    with safe_open(file, framework="pt") as f:
        return f.metadata()


def is_current(path: Path, digest: tuple[str, int]) -> bool:
    """Whether shard `path` has a features file made from exactly this shard (sha256, rows)."""
    stored = stored_shard(path)
    return stored is not None and (stored.get("shard_sha256"), stored.get("rows")) == (digest[0], str(digest[1]))


def check_folder(data_dir: str | Path, spec: FeatureSpec) -> bool:
    """Whether data_dir's features folder was made for `spec` (False: none yet). Raises DataError for a
    folder made for another target, other layers or another dtype."""
    folder = features_dir(data_dir)
    changed = spec.differences(folder)
    if changed:
        raise DataError(f"{folder} holds features for another target or other layers ({'; '.join(changed)}); "
                        f"delete it and run `make features` again, or choose the layers it was made for")
    return changed is not None


@torch.no_grad()
def teacher_forced_hidden(target, rows: list[list[int]], layers: list[int], device) -> torch.Tensor:
    """[B, longest row, L, H] in the target's dtype: the outputs of decoder `layers` (the last one after the final
    norm) over each row, right-padded, in one forward with an attention mask."""
    length = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), length), dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, :len(row)], mask[b, :len(row)] = torch.tensor(row), 1
    # The decoder alone: only hidden states are wanted. (The whole model with logits_to_keep=1 ran its head over
    # a strided [B, 1, H] slice, which torch 2.13's CPU bf16 linear took 1.6 s for at 24 rows, against 4 ms
    # contiguous: the head cost twice the decoder.)
    _, hidden = forward_keeping_layers(target.get_decoder(), layers, input_ids=ids.to(device),
                                       attention_mask=mask.to(device), use_cache=False)
    return hidden


def row_hidden(target, rows: list[list[int]], layers: list[int], device) -> list[torch.Tensor]:
    """[len(row), L, H] bf16 (on the CPU) per row, as a features file stores it."""
    hidden = teacher_forced_hidden(target, rows, layers, device).to("cpu", torch.bfloat16)
    return [hidden[b, :len(row)] for b, row in enumerate(rows)]


def shard_sequences(path: Path) -> list[list[int]]:
    """Each row's prompt + completion ids, untruncated (training slices what it keeps: distill/data.py)."""
    try:
        table = pq.read_table(path, columns=["prompt_ids", "completion_ids"])
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read shard {path}: {e}") from e
    return [p + c for p, c in zip(table.column("prompt_ids").to_pylist(), table.column("completion_ids").to_pylist())]


def forward_batches(lengths: list[int], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Row indices longest first (little padding), cut into forwards of <= max_rows rows and <= max_tokens
    positions (rows x the longest's length; a row longer than max_tokens goes alone)."""
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    batches: list[list[int]] = []
    for r in order:
        if batches and len(batches[-1]) < max_rows and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(r)
        else:
            batches.append([r])
    return batches


def write_features(target, path: Path, digest: tuple[str, int], layers: list[int], batch: tuple[int, int], device,
                   progress: BatchProgress) -> None:
    """Shard `path`'s features file, batch = (rows, positions) at most per forward; written complete or not at all."""
    sequences = shard_sequences(path)
    hidden: list[torch.Tensor | None] = [None] * len(sequences)
    for chosen in forward_batches([len(s) for s in sequences], *batch):
        for r, states in zip(chosen, row_hidden(target, [sequences[r] for r in chosen], layers, device)):
            hidden[r] = states
        progress.batch_done(len(chosen), sum(len(sequences[r]) for r in chosen))
    save_features(path, digest, hidden)


def save_features(shard: Path, digest: tuple[str, int], hidden: list[torch.Tensor]) -> None:
    """Shard `shard`'s features file from its rows' [len(row), L, H] bf16 states, in shard order: written to a
    temporary name and renamed, so it is complete or absent."""
    lengths = torch.tensor([0] + [len(h) for h in hidden])
    tensors = {"hidden": torch.cat(hidden).contiguous(), "offsets": lengths.cumsum(0)}
    file = features_file(shard)
    remove_stale_temp(file)  # what a killed run left
    tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
    save_file(tensors, tmp, metadata={"shard_sha256": digest[0], "rows": str(digest[1])})
    os.replace(tmp, file)


def load_target(config: Config, device):
    """The frozen target on `device` in distill.precision as this machine resolves it, the dtype the
    online teacher runs it in: bf16 (loaded so directly, no fp32 copy first) where the device computes
    it natively, else fp32. The files are bf16 either way."""
    precision = resolve_dtype(config.distill.precision, device, "distill.precision")
    print(f"features: the target runs in {precision.line}", file=sys.stderr)
    return load_model(config.target, device, precision.torch_dtype).requires_grad_(False)


def shards_to_write(config: Config, spec: FeatureSpec) -> tuple[dict[Path, tuple[str, int]], int]:
    """({shard: (sha256, rows)} lacking a current features file, how many have one). A folder without
    features.json counts as empty: its files' layers are unknown."""
    todo, kept = {}, 0
    for data_dir in config.distill.data_dirs:
        made_for_spec = check_folder(data_dir, spec)
        for path, digest in shard_digests(data_dir).items():
            if made_for_spec and is_current(path, digest):
                kept += 1
            else:
                todo[path] = digest
    return todo, kept


def store(config: Config) -> dict:
    """Write every missing or outdated features file of distill.data_dirs; returns counts and the size."""
    config.check_model_refs("target")
    spec = FeatureSpec.of(config)
    todo, kept = shards_to_write(config, spec)
    if todo:
        device = resolve_device(config.device)
        target = load_target(config, device)
        for data_dir in config.distill.data_dirs:
            spec.write(features_dir(data_dir))
        progress = BatchProgress("features", sum(rows for _, rows in todo.values()), "rows")
        for path, digest in todo.items():
            write_features(target, path, digest, spec.layers,
                           (config.generate.batch_size, config.distill.feature_batch_tokens), device, progress)
        progress.close()
    folders = [features_dir(d) for d in config.distill.data_dirs]
    size = sum(f.stat().st_size for folder in folders for f in folder.glob("*.safetensors"))
    return {"written": len(todo), "skipped": kept, "bytes": size, "layers": spec.layers,
            "folders": [str(f) for f in folders]}

