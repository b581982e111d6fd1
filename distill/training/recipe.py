"""DistillRecipe, read top to bottom: setup (data, draft, teacher, optimizer, resume) -> loop (train step,
maybe evaluate, maybe save) -> summary. FeatureRecipe (distill/training/feature.py) subclasses it.

One optimizer step = micro_batch_size x grad_accum x world_size examples (e.g. 8 x 4 x 2 = 64 prompts,
~6k completion tokens at 96 new tokens each). The loss is a sum over completion tokens divided by the
GLOBAL count of those tokens in the step (all micro-batches, all ranks, counted before any backward),
so the gradient does not depend on how the step is split.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from common.config import ConfigError, config_to_dict
from common.models import check_tokenizers, load_model, load_tokenizer, param_count, resolve_device
from common.precision import resolve_dtype
from common.progress import expectation
from decode.drafts.standalone.build import add_outside_rows, build_pretrained_draft, build_scratch_draft
from decode.vocab import VocabSubset
from distill.checkpoint import TrainState, latest_checkpoint, load_newest_loadable, save_checkpoint
from distill.data import StepSampler, collate, held_out_subset, load_examples
from distill.export.hf import copy_hf, export_hf
from distill.losses import kl_per_token, mixed_loss
from distill.training.accelerator import make_accelerator, shards_parameters
from distill.training.evaluate import evaluate
from distill.training.optimizer import make_optimizer
from distill.training.resume import check_resumable
from distill.training.run_log import RunLogger
from distill.training.teacher import Teacher, draft_logits
from distill.training.vocab_choice import choose_subset
from distill.training.weight_average import WeightAverage


class NonFiniteError(RuntimeError):
    """More non-finite steps than distill.max_bad_steps allows."""


@dataclass
class StepResult:
    loss: float
    """Σ loss over the step's completion tokens / their global count."""
    kl: float
    """True KL(target ‖ draft) per token on the training support (logged: the loss may mix in CE)."""
    tokens: int
    grad_norm: float
    bad: tuple[int, list[int]] | None = None
    """(micro-batch, its example indices on this rank) when a non-finite value stopped the step."""


class DistillRecipe:
    """One run in out_dir. `setup()` builds everything (resuming from the newest checkpoint that
    loads, if any), `train()` runs the loop and the final export and returns the summary."""

    def __init__(self, config):
        # A feature draft's init is a FeatureDraft folder, not an HF model: FeatureRecipe checks it.
        init = [] if config.distill.init == "scratch" or config.distill.draft_kind == "feature" else ["distill.init"]
        config.check_model_refs("target", *init)  # a mistyped path fails before any heavy work
        # 'auto' resolved once into the config the run writes and a resume compares (training/resume.py).
        self.precision = resolve_dtype(config.distill.precision, resolve_device(config.device), "distill.precision")
        config = dataclasses.replace(config, distill=dataclasses.replace(config.distill, precision=self.precision.name))
        self.config, self.dc = config, config.distill
        self.accelerator = make_accelerator(config)
        if self.dc.outside_rank and shards_parameters(self.accelerator):
            # ZeRO-3 is refused with the config (common/config_training.py); FSDP comes from accelerate's own file.
            raise ConfigError("distill.outside_rank > 0 is not built for FSDP, which shards the outside factors the "
                              "loss reads outside the model's forward: use DDP or ZeRO-1/2 (the draft is small)")
        if self.dc.ema_decay and shards_parameters(self.accelerator):
            raise ConfigError("distill.ema_decay > 0 is not built for FSDP, which shards the weights the average "
                              "follows: use DDP or ZeRO-1/2 (the draft is small)")
        from accelerate.utils import set_seed

        set_seed(config.seed)
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        self.is_main, self.device = self.accelerator.is_main_process, self.accelerator.device
        self.out_dir = Path(self.dc.out_dir)
        self.stop_requested = False
        self.last_eval_step = -1
        self.say(self.precision.line)

    def say(self, text: str) -> None:
        if self.is_main:
            print(text)

    # ------------------------------------------------------------------ setup
    def setup(self, resume: bool = True) -> bool:
        """Build everything, resuming unless `resume` or distill.resume is off. False when there
        were checkpoints but none loaded (each is named in a warning): this recipe's state may then
        hold part of one, so the caller starts again from a fresh recipe with resume=False."""
        newest = latest_checkpoint(self.out_dir) if resume and self.dc.resume else None
        if newest is not None:  # before any model loads: a refused resume fails fast
            check_resumable(self.config, self.out_dir, newest)
        self.setup_data()
        target = load_model(self.config.target)  # fp32 on CPU: sizing, embedding init, and the online teacher
        self.setup_draft(target)
        self.setup_teacher(target)
        self.setup_optimizer()
        self.state = TrainState()
        if newest is not None:
            loaded = load_newest_loadable(self.accelerator, self.out_dir)
            if loaded is None:
                return False
            self.state, resumed_from = loaded
            self.say(f"resumed from {resumed_from} (step {self.state.step}, "
                     f"epoch {self.state.step // self.sampler.steps_per_epoch})")
        if self.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.yaml").write_text(self.config_yaml())
        self.logger = RunLogger(self.config, self.out_dir, self.is_main, self.state.step)
        signal.signal(signal.SIGTERM, self.request_stop)
        return True

    @property
    def alpha_note(self) -> str:
        """How held-out α was measured (final_metrics.json)."""
        if self.dc.teacher == "cached":
            return "cached teacher: α summed over the stored top-K tokens (lower bound)"
        return "the target run on the held-out rows: exact α over the full vocabulary"

    @property
    def need_topk(self) -> bool:
        """Whether batches carry the shards' stored top-K (the teacher reads them)."""
        return self.dc.teacher in ("cached", "stored")

    def setup_data(self) -> None:
        dc = self.dc
        self.train_set, eval_set = load_examples(dc.data_dirs, dc.max_seq_len, need_topk=self.need_topk,
                                                 sources=dc.sources)
        self.eval_set = held_out_subset(eval_set, dc.eval_samples)
        self.tokenizer = load_tokenizer(self.config.target)
        self.say(f"data: {len(self.train_set)} train / {len(self.eval_set)} eval examples from {dc.data_dirs}")
        self.sampler = StepSampler(len(self.train_set), dc.micro_batch_size, dc.grad_accum, self.world,
                                   self.config.seed, [ex.folder for ex in self.train_set], dc.data_weights,
                                   [len(ex.ids) for ex in self.train_set], dc.group_by_length)
        if dc.data_weights:
            self.say("mixture: " + ", ".join(f"{d} {q} of {len(m)} rows per epoch" for d, q, m in
                                              zip(dc.data_dirs, self.sampler.quotas, self.sampler.members)))

    def setup_draft(self, target) -> None:
        dc = self.dc
        if dc.init == "scratch":
            subset = choose_subset(target, self.tokenizer, self.train_set, self.eval_set, dc.vocab_subset,
                                   dc.spread_other, self.say, dc.outside_rank) if dc.vocab_subset else None
            self.draft, shape = build_scratch_draft(target, dc.param_ratio, dc.num_layers, subset, dc.embed_init,
                                                    self.config.seed)
            self.say(f"draft: {shape.num_layers} layers, hidden {shape.hidden_size}, mlp {shape.intermediate_size}, "
                     f"heads {shape.num_attention_heads}/{shape.num_key_value_heads} x {shape.head_dim}, "
                     f"{shape.vocab_rows} vocab rows -> {shape.params / 1e6:.2f}M params "
                     f"= {shape.ratio:.2%} of the target's {param_count(target) / 1e6:.1f}M")
        else:
            check_tokenizers(self.tokenizer, load_tokenizer(dc.init))
            self.draft = build_pretrained_draft(dc.init, dc.lora_rank, self.config.seed)
            if dc.outside_rank:
                add_outside_rows(self.draft, dc.outside_rank, self.config.seed)
            trainable = sum(p.numel() for p in self.draft.parameters() if p.requires_grad)
            self.say(f"draft: {dc.init} ({param_count(self.draft) / 1e6:.2f}M params, "
                     f"{trainable / 1e6:.2f}M trainable)")

    def setup_teacher(self, target) -> None:
        teacher_model = None
        if self.dc.teacher == "online":
            dtype = torch.bfloat16 if self.accelerator.mixed_precision == "bf16" else torch.float32
            teacher_model = target.to(self.device, dtype)
        self.teacher = Teacher(self.dc.teacher, VocabSubset.of(self.draft, self.device), teacher_model)

    def setup_optimizer(self) -> None:
        optimizer, self.scheduler = make_optimizer(self.draft, self.dc)
        self.model, self.optimizer = self.accelerator.prepare(self.draft, optimizer)
        # The scheduler stays unwrapped (stepped once per optimizer step) but is saved with the state.
        self.accelerator.register_for_checkpointing(self.scheduler)
        self.average = None
        if self.dc.ema_decay:
            self.average = WeightAverage(self.accelerator.unwrap_model(self.model).parameters(), self.dc.ema_decay)
            self.accelerator.register_for_checkpointing(self.average)
        self.use_deepspeed = self.accelerator.distributed_type.name == "DEEPSPEED"
        self.say(f"batch: {self.dc.micro_batch_size} x {self.dc.grad_accum} accum x {self.world} ranks = "
                 f"{self.sampler.global_batch} examples/step, {self.sampler.steps_per_epoch} steps/epoch")

    def request_stop(self, *_) -> None:
        """SIGTERM: finish the current step, save, exit cleanly."""
        self.stop_requested = True

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict:
        """Step, maybe evaluate, maybe save, until max_steps or a stop; then the final export."""
        self.model.train()
        t_start, elapsed_before = time.monotonic(), self.state.elapsed_s
        steps_here, stop_reason = 0, None
        while stop_reason is None and self.state.step < self.dc.max_steps:
            self.state.step += 1
            steps_here += 1
            t0 = time.monotonic()
            result = self.train_step()
            self.state.elapsed_s = elapsed_before + time.monotonic() - t_start
            self.log_step(result, time.monotonic() - t0)
            if steps_here == 1 and self.state.step < self.dc.max_steps:
                self.logger.message(expectation("distill", 1, self.dc.max_steps - self.state.step + 1,
                                                time.monotonic() - t_start, "steps (evaluations not counted)"))
            early_stop = self.maybe_evaluate()
            interrupt = self.agreed_stop(steps_here)  # a collective: every rank calls it every step
            stop_reason = early_stop or interrupt
            self.maybe_save(stop_reason)
        if stop_reason == "interrupted":  # resume later from the checkpoint just saved
            self.logger.finish({})
            return {"step": self.state.step, "stopped": stop_reason}
        return self.finish(stop_reason or "max_steps")

    def train_step(self) -> StepResult:
        """Forward/backward over this rank's micro-batches of the step, then one optimizer step
        unless any rank saw a non-finite teacher value or loss (then nothing reaches the optimizer)."""
        micro = self.sampler.micro_batches(self.state.step - 1, self.rank)  # the sampler counts from 0
        batches = [self.batch_on_device(indices, self.train_set) for indices in micro]
        tokens = torch.tensor(float(sum(self.loss_tokens(b) for b in batches)), device=self.device)
        global_tokens = self.accelerator.reduce(tokens, "sum")  # before any backward
        # DDP/DeepSpeed average gradients over ranks and accelerate divides by grad_accum:
        # multiplying by both leaves Σ_tokens ∇loss / global_tokens.
        scale = self.world * self.dc.grad_accum / global_tokens.clamp(min=1)
        sums = torch.zeros(3, device=self.device)  # [loss, true KL, tokens] for logging
        bad = None
        for a, batch in enumerate(batches):
            with self.accelerator.accumulate(self.model):
                if bad is not None:
                    self.skip_micro_batch()
                    continue
                loss_sum, draft_logp, target_logp, finite = self.micro_batch_loss(batch)
                if self.accelerator.reduce(torch.tensor(0.0 if finite else 1.0, device=self.device), "sum") > 0:
                    bad = (a, micro[a])
                    self.skip_micro_batch()
                    continue
                self.accelerator.backward(loss_sum * scale)
                with torch.no_grad():
                    sums += torch.stack([loss_sum.detach(), kl_per_token(target_logp, draft_logp).sum(),
                                         torch.tensor(float(draft_logp.shape[0]), device=self.device)])
        grad_norm, bad = self.optimizer_step(bad, micro)
        sums = self.accelerator.reduce(sums, "sum")
        return StepResult(loss=float(sums[0] / global_tokens.clamp(min=1)), kl=float(sums[1] / sums[2].clamp(min=1)),
                          tokens=int(global_tokens), grad_norm=grad_norm, bad=bad)

    def loss_tokens(self, batch: dict) -> int:
        """The positions of `batch` the loss sums over (what the step's loss is divided by)."""
        return int(batch["loss_mask"].sum())

    def micro_batch_loss(self, batch: dict):
        """(Σ loss, draft_logp, target_logp, finite) for one micro-batch; the loss mixes the
        distill.loss terms at distill.kd_temperature on the teacher's support."""
        logits = draft_logits(self.model, batch, self.teacher.subset)
        target = self.teacher.targets(batch)
        draft_logp, target_logp = self.teacher.buckets(logits, target)
        labels = batch["labels"][batch["loss_mask"]]
        if self.teacher.row_subset is not None:
            labels = self.teacher.row_subset.rows(labels)  # tokens outside the subset train the "other" row
        mask = torch.ones_like(labels, dtype=torch.bool)
        loss_sum = mixed_loss(self.dc.loss, draft_logp, target_logp, logits, labels, mask, self.dc.jsd_beta,
                              self.dc.kd_temperature, self.dc.lk_eta, self.dc.filter_hardest)
        return loss_sum, draft_logp, target_logp, target.finite() and bool(torch.isfinite(loss_sum))

    def skip_micro_batch(self) -> None:
        """A micro-batch of a bad step: nothing, except under DeepSpeed, which steps inside
        backward and must see every micro-batch: it gets a zero gradient."""
        if self.use_deepspeed:
            dummy = self.batch_on_device([], self.train_set)
            self.accelerator.backward(0.0 * draft_logits(self.model, dummy, self.teacher.subset).sum())

    def optimizer_step(self, bad, micro: list[list[int]]):
        """Clip and step unless the step is bad (a non-finite gradient norm makes it bad too);
        returns (grad_norm, bad)."""
        grad_norm = None
        if bad is None and not self.use_deepspeed:
            grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.dc.grad_clip)
            if not torch.isfinite(grad_norm):
                bad = (self.dc.grad_accum - 1, micro[-1])
        if bad is None or self.use_deepspeed:
            self.optimizer.step()  # DeepSpeed: already stepped inside backward; this is a no-op
            self.scheduler.step()
            if self.average is not None and bad is None:
                self.average.update(self.state.step - self.state.bad_steps)
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm) if grad_norm is not None else float("nan"), bad

    def batch_on_device(self, indices: list[int], examples) -> dict:
        batch = collate([examples[i] for i in indices], self.tokenizer.pad_token_id or 0, self.need_topk)
        return {k: v.to(self.device) for k, v in batch.items()}

    def log_step(self, result: StepResult, seconds: float) -> None:
        step = self.state.step
        if result.bad is not None:
            self.state.bad_steps += 1
            a, indices = result.bad
            message = (f"step {step} (epoch {(step - 1) // self.sampler.steps_per_epoch}): non-finite teacher "
                       f"values or loss in micro-batch {a} (train examples {indices} on rank {self.rank}); "
                       f"optimizer not stepped ({self.state.bad_steps}/{self.dc.max_bad_steps} bad steps allowed)")
            print(message, flush=True)
            if self.state.bad_steps > self.dc.max_bad_steps:
                raise NonFiniteError(message)
        else:
            tokens_per_s = result.tokens / max(1e-9, seconds)
            self.logger.log(step, {"train/loss": result.loss, "train/kl": result.kl,
                                   "train/lr": self.scheduler.get_last_lr()[0], "train/grad_norm": result.grad_norm,
                                   "train/tokens_per_s": tokens_per_s},
                            show={"loss": result.loss, "kl": result.kl, "tok/s": tokens_per_s})
        self.logger.advance()

    # ------------------------------------------------------------------ evaluate, stop, save
    def maybe_evaluate(self) -> str | None:
        """Evaluate every distill.eval_every steps; the early-stop reason, if that fires."""
        if not (self.eval_set and self.dc.eval_every > 0 and self.state.step % self.dc.eval_every == 0):
            return None
        self.run_eval()
        patience = self.dc.early_stop_patience
        if patience and self.state.evals_since_best >= patience:
            return f"early stop: α has not improved for {self.state.evals_since_best} evaluations"
        return None

    def evaluated_weights(self):
        """What evaluations and exports read: the weight average (distill.ema_decay) swapped into the model,
        else the weights as trained."""
        return self.average.swapped_in() if self.average is not None else nullcontext()

    def run_eval(self) -> dict:
        """Held-out metrics, logged; a new best α is exported to best/."""
        state = self.state
        with self.evaluated_weights():
            metrics = self.held_out_metrics()
            if metrics["eval/alpha"] > state.best_alpha:
                state.best_alpha, state.best_step, state.evals_since_best = metrics["eval/alpha"], state.step, 0
                self.export(self.out_dir / "best", {"step": state.step, **metrics})
            else:
                state.evals_since_best += 1
        self.logger.log(state.step, metrics)
        self.logger.message(f"step {state.step}: " + ", ".join(f"{k[5:]} {v:.4g}" for k, v in metrics.items()))
        self.last_eval_step = state.step
        return metrics

    def held_out_metrics(self) -> dict:
        """eval/* metrics on the held-out set; eval/alpha picks best/."""
        return evaluate(self.model, self.teacher, self.eval_batches(), self.accelerator, self.dc.tau_k)

    def eval_batches(self):
        """This rank's share of the held-out set, in the same number of batches on every rank."""
        mine = list(range(self.rank, len(self.eval_set), self.world))
        size = self.dc.micro_batch_size
        for a in range(math.ceil(math.ceil(len(self.eval_set) / self.world) / size)):
            yield self.batch_on_device(mine[a * size:(a + 1) * size], self.eval_set)

    def agreed_stop(self, steps_here: int) -> str | None:
        """SIGTERM, distill.stop_after or max_minutes on any rank stops every rank at this step
        boundary (a signal may reach only one of them), and for the same reason on every rank:
        an interrupted run only saves, a timed-out one also runs the final export (collectives)."""
        dc = self.dc
        interrupted = self.stop_requested or bool(dc.stop_after and steps_here >= dc.stop_after)
        timed_out = bool(dc.max_minutes and self.state.elapsed_s >= 60 * dc.max_minutes)
        votes = self.accelerator.reduce(torch.tensor([float(interrupted), float(timed_out)], device=self.device),
                                        "sum")
        if votes[0] > 0:
            return "interrupted"
        return "max_minutes reached" if votes[1] > 0 else None

    def maybe_save(self, stop_reason: str | None) -> None:
        dc, step = self.dc, self.state.step
        if stop_reason or (dc.save_every > 0 and step % dc.save_every == 0) or step == dc.max_steps:
            save_checkpoint(self.accelerator, self.out_dir, self.state, dc.keep_checkpoints)
        if stop_reason:
            self.logger.message(f"step {step}: {stop_reason}; checkpoint saved")

    # ------------------------------------------------------------------ export
    def config_yaml(self) -> str:
        return yaml.safe_dump(config_to_dict(self.config), sort_keys=False)

    def export(self, path: Path, metrics: dict) -> None:
        """Every rank calls this (the state dict is gathered under ZeRO-3/FSDP); the main process
        writes the HF folder with the run's config.yaml and `metrics` as metrics.json."""
        state_dict = self.accelerator.get_state_dict(self.model)
        if self.is_main:
            export_hf(self.accelerator.unwrap_model(self.model), self.tokenizer, path,
                      {"config.yaml": self.config_yaml(), "metrics.json": json.dumps(metrics, indent=1)}, state_dict)
        self.accelerator.wait_for_everyone()

    def finish(self, stopped: str) -> dict:
        """A last evaluation, then final/: the best draft (best/ plus the summary) when there was
        a held-out set, else the last one."""
        if self.eval_set and self.last_eval_step != self.state.step:
            self.run_eval()
        summary = self.summary(stopped)
        best = self.out_dir / "best"
        self.accelerator.wait_for_everyone()
        if self.eval_set and best.is_dir():
            if self.is_main:
                copy_hf(best, self.out_dir / "final", {"metrics.json": json.dumps(summary, indent=1)})
        else:
            with self.evaluated_weights():
                self.export(self.out_dir / "final", summary)
        self.accelerator.wait_for_everyone()
        if self.is_main:
            (self.out_dir / "final_metrics.json").write_text(json.dumps(summary, indent=1))
            self.say(json.dumps(summary))
        self.logger.finish(summary)
        return summary

    def summary(self, stopped: str) -> dict:
        dc, state = self.dc, self.state
        summary = {"step": state.step, "best_step": state.best_step, "stopped": stopped,
                   "bad_steps": state.bad_steps, "elapsed_s": round(state.elapsed_s, 1), "teacher": dc.teacher,
                   "alpha_note": self.alpha_note, "precision": self.precision.as_record()}
        best = self.out_dir / "best"
        if self.is_main and self.eval_set and best.is_dir():
            best_metrics = json.loads((best / "metrics.json").read_text())
            summary.update({k.replace("eval/", "final/"): v for k, v in best_metrics.items() if k.startswith("eval/")})
        return summary
