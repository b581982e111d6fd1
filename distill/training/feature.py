"""`make distill` with distill.draft_kind=feature: DistillRecipe's loop (accelerate, optimizer, checkpoints,
resume, evaluation cadence, run log, early stop, SIGTERM) with a feature draft (decode/drafts/feature/model.py)
in place of the standalone one.

Per micro-batch the frozen target runs online (feature_teacher.py) and gives the hidden states of the
layers the draft reads, the embedding of each next token and its own distribution one position on; with
distill.teacher=stored the hidden states come from `make features` and the distribution from the shards'
top-K instead, and the target runs only for held-out evaluation (feature_stored.py);
the draft is unrolled distill.ttt_steps times on its own outputs (EAGLE-3's training-time test) and
each step's loss (feature_loss.py) is weighted ttt_decay**j (with distill.ttt_reach also by the chance the
decoder reaches it). best/ and final/ hold FeatureDraft.save
plus the target's tokenizer files and the run's config.yaml and metrics.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from common.models import load_tokenizer, param_count
from common.errors import UserError
from decode.drafts.feature.model import (CONFIG_FILE, FeatureDraft, FeatureDraftConfig, check_target,
                                         feature_draft_problem)
from decode.drafts.feature.shape import build_feature_draft, choose_feature_shape, feature_layers
from decode.vocab import VocabSubset
from distill.checkpoint import latest_checkpoint
from distill.export.hf import export_hf
from distill.feature_store import FeatureSpec
from distill.training.feature_eval import evaluate_feature
from distill.training.feature_loss import unrolled_loss
from distill.training.feature_stored import StoredFeatures, StoredFeatureTeacher
from distill.training.feature_target import TargetIdentity, target_config
from distill.training.feature_teacher import FeatureTeacher, step_masks
from distill.training.recipe import DistillRecipe
from distill.training.vocab_choice import choose_subset


class UnrolledFeatureDraft(nn.Module):
    """A FeatureDraft's training forward as a module's forward, so DDP, FSDP and DeepSpeed can wrap it."""

    def __init__(self, draft: FeatureDraft):
        super().__init__()
        self.draft = draft

    def forward(self, target_hidden: torch.Tensor, embeds: torch.Tensor, masks: list[torch.Tensor]):
        """Logits [n_j, N] of each unrolled step j (len(masks) of them) at the positions masks[j] [B, T] holds."""
        outs = self.draft.unrolled(target_hidden, embeds, len(masks))
        return [self.draft.logits(out[mask]) for out, mask in zip(outs, masks)]


class SavedAsFeatureDraft:
    """What export_hf writes a model with (save_pretrained), for a feature draft: FeatureDraft.save, so
    best/ and final/ get export_hf's temp-name-then-rename, tokenizer files and run files."""

    def __init__(self, draft: FeatureDraft):
        self.draft = draft

    def save_pretrained(self, folder, state_dict: dict | None = None) -> None:
        draft = self.draft
        if state_dict is not None:  # gathered weights (the live module may hold a shard under ZeRO-3/FSDP)
            weights = {name.removeprefix("draft."): t for name, t in state_dict.items()}
            draft = FeatureDraft(draft.config, weights["draft_ids"].cpu())
            draft.load_state_dict(weights)
        draft.save(Path(folder))


class FeatureRecipe(DistillRecipe):
    def setup(self, resume: bool = True) -> bool:
        """Refuse layers the target lacks, a distill.init that is no feature draft of this target and these
        layers, or a resume against another target, before any model loads."""
        config = target_config(self.config.target)
        self.layers = feature_layers(self.dc.feature_layers, config.num_hidden_layers, self.config.target)
        if self.dc.init != "scratch":
            self.check_init(config)
        identity = TargetIdentity.of(config, load_tokenizer(self.config.target))
        if resume and self.dc.resume and latest_checkpoint(self.out_dir) is not None:
            identity.check_resumes(self.out_dir, self.config.target)
        ready = super().setup(resume)
        if ready and self.is_main:
            identity.write(self.out_dir)
        return ready

    def setup_data(self) -> None:
        """DistillRecipe's; the stored teacher also opens the stored features, refusing missing or
        mismatched ones here, before the target loads."""
        super().setup_data()
        if self.dc.teacher == "stored":
            self.stored = StoredFeatures(self.dc.data_dirs, FeatureSpec.of(self.config))
            self.say(f"stored features of layers {self.stored.spec.layers}")

    def check_init(self, config) -> None:
        """distill.init: a feature draft (best/ or final/ of a feature run) of this target reading these layers."""
        problem = feature_draft_problem(self.dc.init)
        if problem:
            raise UserError(f"distill.init: {problem}; a feature draft starts from best/ or final/ of a feature run")
        init = FeatureDraftConfig(**json.loads((Path(self.dc.init) / CONFIG_FILE).read_text()))
        check_target(init, config, config.vocab_size)
        if init.target_layers != self.layers:
            raise UserError(f"distill.init reads the target's layers {init.target_layers}, this run's features are "
                            f"of layers {self.layers}: set distill.feature_layers={init.target_layers}")

    def setup_draft(self, target) -> None:
        dc = self.dc
        if dc.init != "scratch":
            # Training goes on from its weights, head and vocabulary subset (vocab_subset and param_ratio are its).
            draft = FeatureDraft.load(dc.init).float()
            self.subset = VocabSubset(draft.draft_ids.clone(), draft.config.vocab_size, spread_other=False)
            self.draft = UnrolledFeatureDraft(draft)
            self.say(f"draft: {dc.init} (a feature draft, {param_count(draft) / 1e6:.2f}M params)")
            return
        draft_config, shape = choose_feature_shape(target.config, param_count(target), dc.param_ratio, self.layers,
                                                   dc.vocab_subset, dc.feature_intermediate_size)
        # A feature draft's head has no "other" row to spread (distill.spread_other does not apply).
        self.subset = choose_subset(target, self.tokenizer, self.train_set, self.eval_set, shape.head_rows, False,
                                    self.say)
        draft = build_feature_draft(target, draft_config, self.subset.ids, dc.embed_init, self.config.seed)
        self.draft = UnrolledFeatureDraft(draft)
        self.say(shape.describe(param_count(target), target.config.hidden_size, target.config.num_hidden_layers))

    def setup_teacher(self, target) -> None:
        """The online teacher runs the target on every batch. The stored one needs only its embedding
        matrix for training; the target runs on the held-out rows alone (eval_teacher), so held-out α is
        exact under both teachers and their runs compare by the same measure."""
        dtype = torch.bfloat16 if self.accelerator.mixed_precision == "bf16" else torch.float32
        subset_ids = self.subset.ids.to(self.device)
        self.eval_teacher = FeatureTeacher(target.to(self.device, dtype), self.layers, subset_ids, dtype=torch.float32)
        if self.dc.teacher == "stored":
            embedding = target.get_input_embeddings().weight.detach()
            self.teacher = StoredFeatureTeacher(embedding, subset_ids, dtype=torch.float32)
        else:
            self.teacher = self.eval_teacher

    def batch_on_device(self, indices: list[int], examples) -> dict:
        """DistillRecipe's batch; the stored teacher's also holds stored_hidden [B, T, L, H]."""
        batch = super().batch_on_device(indices, examples)
        if self.dc.teacher == "stored":
            shape = batch["input_ids"].shape
            batch["stored_hidden"] = self.stored.batch([examples[i] for i in indices], shape).to(self.device)
        return batch

    # ------------------------------------------------------------------ one micro-batch
    def unrolled(self, batch: dict, steps: int):
        """(the teacher's FeatureBatch, each step's [B, T] mask, each step's logits at its mask)."""
        features = self.teacher(batch)
        masks = step_masks(features.positions, steps)
        return features, masks, self.model(features.hidden, features.embeds, masks)

    def loss_tokens(self, batch: dict) -> int:
        return int(batch["loss_mask"][:, 1:].sum())  # draft positions: feature_teacher.py

    def micro_batch_loss(self, batch: dict):
        """(Σ loss over the unrolled steps, step 0's draft log-probs and renormalised target, finite)."""
        features, masks, step_logits = self.unrolled(batch, self.dc.ttt_steps)
        rows = [mask[features.positions] for mask in masks]  # [n] per step: its rows of the teacher's n
        loss_sum, draft_logp, target_logp = unrolled_loss(self.dc, step_logits, features.target_logp, rows, masks)
        return loss_sum, draft_logp, target_logp, features.finite and bool(torch.isfinite(loss_sum))

    def skip_micro_batch(self) -> None:
        """DeepSpeed must see every micro-batch: a zero gradient through every weight."""
        if self.use_deepspeed:
            _, _, step_logits = self.unrolled(self.batch_on_device([], self.train_set), self.dc.ttt_steps)
            self.accelerator.backward(0.0 * sum(logits.sum() for logits in step_logits))

    # ------------------------------------------------------------------ evaluate, export
    def held_out_metrics(self) -> dict:
        """α per unrolled step, for as many steps as τ at distill.tau_k needs (at least the trained ones)."""
        steps = max(self.dc.ttt_steps, self.dc.tau_k)
        return evaluate_feature(self.model, self.eval_teacher, self.eval_batches(), self.accelerator, steps,
                                self.dc.tau_k)

    def export(self, path: Path, metrics: dict) -> None:
        state_dict = self.accelerator.get_state_dict(self.model)
        if self.is_main:
            draft = SavedAsFeatureDraft(self.accelerator.unwrap_model(self.model).draft)
            export_hf(draft, self.tokenizer, path,
                      {"config.yaml": self.config_yaml(), "metrics.json": json.dumps(metrics, indent=1)}, state_dict)
        self.accelerator.wait_for_everyone()
