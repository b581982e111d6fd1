"""What every engine is given (EngineJob: the config, the prompts as token ids, which are the
chat-templated ids our own decoder uses so every engine sees identical input, the modes to run, and
a folder for its logs) and how it says it failed (EngineFailed)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from common.config import Config
from common.errors import UserError
from decode.serving import serving_requests


class EngineFailed(UserError):
    """An engine's process failed or timed out; the message names its log."""


@dataclass
class EngineJob:
    cfg: Config
    prompt_sets: dict[str, list[list[int]]]
    """Prompt set name -> each prompt's token ids."""
    tokenizer: object
    log_dir: Path
    draft_mode: str = "draft"
    """The mode our exported draft runs in: 'draft' (a standalone draft) or 'eagle3' (a feature draft)."""

    @property
    def threads(self) -> int:
        return self.cfg.engines.threads or os.cpu_count() or 1

    @property
    def modes(self) -> list[tuple[str, int | None]]:
        """(mode, k): plain decoding, then our draft and the engine's n-gram mode at every k."""
        return [("plain", None)] + [(mode, k) for k in self.cfg.engines.ks for mode in (self.draft_mode, "ngram")]

    @property
    def prompts(self) -> list[tuple[str, list[int]]]:
        """(prompt set, token ids) of every prompt, in a fixed order."""
        return [(name, ids) for name, prompts in self.prompt_sets.items() for ids in prompts]

    @property
    def serving_set(self) -> str:
        """The prompt set the serving batches (eval.serving_batches) draw their requests from: the first."""
        return next(iter(self.prompt_sets))

    def requests(self, batch: int) -> list[list[int]]:
        """The token ids of the requests served at `batch` (eval.serving_requests; as our own serving table,
        decode/serving.py): request i is prompt i % n of the serving set."""
        return serving_requests(self.prompt_sets[self.serving_set], self.cfg.eval.serving_requests, batch)

    def seed(self, index: int) -> int:
        """The sampling seed of the index-th prompt (the same in every mode, so runs differ only by the engine)."""
        return self.cfg.seed + index
