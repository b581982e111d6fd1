"""What a feature draft is tied to: the target's width, depth, vocabulary and tokenizer.

A feature draft reads the target's hidden states, so unlike a standalone draft it only works with
the very target it was trained on. A run records that target in <out_dir>/feature_target.json;
resuming the run against a target that differs in any of these (a local folder replaced under the
same path, say: the config check of distill/training/resume.py sees only the reference) is refused
before any model loads.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import AutoConfig

from common.config import ConfigError
from common.models import EMBEDDED, embedded_dir, tiny_model
from common.prompts import tokenizer_hash


IDENTITY_FILE = "feature_target.json"


def target_config(ref: str):
    """The target's HF config without loading its weights (a tiny target is built: it is small)."""
    if ref.startswith("tiny:"):
        return tiny_model(ref[5:]).config
    return AutoConfig.from_pretrained(embedded_dir() if ref == EMBEDDED else ref)


@dataclass
class TargetIdentity:
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    tokenizer_sha256: str

    @classmethod
    def of(cls, config, tokenizer) -> TargetIdentity:
        return cls(config.hidden_size, config.num_hidden_layers, config.vocab_size, tokenizer_hash(tokenizer))

    def write(self, out_dir: Path) -> None:
        (out_dir / IDENTITY_FILE).write_text(json.dumps(asdict(self), indent=1) + "\n")

    def check_resumes(self, out_dir: Path, target_ref: str) -> None:
        """Raise ConfigError when the run in out_dir was trained against a different target."""
        path = out_dir / IDENTITY_FILE
        if not path.is_file():
            raise ConfigError(f"cannot resume the feature draft in {out_dir}: {path} is missing, so the target it "
                              f"was trained against is unknown; train into a new distill.out_dir")
        before = json.loads(path.read_text())
        changed = [f"{key} {before.get(key)!r} -> {value!r}" for key, value in asdict(self).items()
                   if before.get(key) != value]
        if changed:
            raise ConfigError(f"cannot resume the feature draft in {out_dir} against target {target_ref}: it was "
                              f"trained against a different target ({'; '.join(changed)}); train into a new "
                              f"distill.out_dir")
