"""`make distill`: train a small draft to imitate the target. Reads top to bottom:
setup -> loop (train step, eval, save) -> final export.

  python -m distill.train --config configs/tiny.yaml distill.max_steps=20
  torchrun --standalone --nproc_per_node 2 -m distill.train --config ...           CPU: gloo, DDP
  ... distill.deepspeed_config=configs/deepspeed_zero2.json                         ZeRO-2/3
  accelerate launch --config_file configs/fsdp.yaml -m distill.train --config ...   GPUs: FSDP

One optimizer step = micro_batch_size x grad_accum x world_size examples (e.g. 8 x 4 x 2 = 64
prompts, ~6k completion tokens at 96 new tokens each). The loss is a sum over completion tokens
divided by the GLOBAL count of those tokens in the step (all micro-batches, all ranks, counted
before any backward), so the gradient does not depend on how the step is split.
"""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path

import torch
import yaml

from decode.config import ConfigError, cli_config, config_to_dict
from decode.models import load_model, load_tokenizer, param_count, resolve_device
from decode.stats import expected_tau
from distill.checkpoint import (TrainState, copy_export, export_draft, latest_checkpoint, load_checkpoint,
                                save_checkpoint)
from distill.data import StepSampler, collate, load_examples, token_counts
from distill.draft import VocabMap, build_pretrained_draft, build_scratch_draft, select_vocab
from distill.losses import kl_per_token, acceptance, mixed_loss
from distill.train_logging import RunLogger
from distill.train_teacher import Teacher, keep_positions


class NonFiniteError(RuntimeError):
    """More non-finite steps than distill.max_bad_steps allows."""


def check_distill_config(config) -> None:
    dc = config.distill
    problems = []
    if dc.init == "scratch" and dc.lora_rank > 0:
        problems.append("distill.lora_rank > 0 needs a pretrained distill.init (LoRA on a random draft is pointless)")
    if dc.init != "scratch" and dc.vocab_subset:
        problems.append("distill.vocab_subset works with init=scratch only (a pretrained head has the full vocabulary)")
    if not 0 < dc.jsd_beta < 1:
        problems.append(f"distill.jsd_beta={dc.jsd_beta} must be in (0, 1)")
    if dc.kd_temperature <= 0:
        problems.append(f"distill.kd_temperature={dc.kd_temperature} must be > 0")
    if any(w < 0 for w in dc.loss.values()) or not any(w > 0 for w in dc.loss.values()):
        problems.append(f"distill.loss={dc.loss}: weights must be >= 0 with at least one > 0")
    for name in ("micro_batch_size", "grad_accum", "max_steps", "max_seq_len", "tau_k"):
        if getattr(dc, name) < 1:
            problems.append(f"distill.{name} must be >= 1")
    if dc.precision not in ("auto", "fp32", "bf16"):
        problems.append(f"distill.precision={dc.precision!r}; use 'auto', 'fp32' or 'bf16'")
    if dc.embed_init not in ("target", "random"):
        problems.append(f"distill.embed_init={dc.embed_init!r}; use 'target' or 'random'")
    if dc.deepspeed_config and not Path(dc.deepspeed_config).is_file():
        problems.append(f"distill.deepspeed_config: {dc.deepspeed_config!r} does not exist")
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def make_accelerator(config):
    """CPU: fp32, gloo under torchrun. GPU: bf16 autocast. DeepSpeed from a JSON whose "auto"
    entries are filled from the distill config."""
    from accelerate import Accelerator

    dc = config.distill
    on_cpu = resolve_device(config.device).type == "cpu"
    bf16 = dc.precision == "bf16" or (dc.precision == "auto" and not on_cpu)
    kwargs = {}
    if dc.deepspeed_config:
        from accelerate.utils import DeepSpeedPlugin

        ds = json.loads(Path(dc.deepspeed_config).read_text())
        for key, value in (("train_micro_batch_size_per_gpu", dc.micro_batch_size),
                           ("gradient_accumulation_steps", dc.grad_accum), ("gradient_clipping", dc.grad_clip)):
            if ds.get(key, "auto") == "auto":
                ds[key] = value
        ds.pop("train_batch_size", None)  # derived by DeepSpeed from the two above and the world size
        ds.setdefault("bf16", {})["enabled"] = bf16
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=ds)
        if on_cpu:
            # Accelerate runs DeepSpeed only with cpu=False; naming gloo makes it work on CPUs (tests).
            from accelerate.utils import InitProcessGroupKwargs

            kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    return Accelerator(cpu=on_cpu and not dc.deepspeed_config, mixed_precision="bf16" if bf16 else "no",
                       gradient_accumulation_steps=dc.grad_accum, **kwargs)


def lr_lambda(dc):
    """Linear warmup over warmup_steps, then cosine decay to 10% of lr at max_steps (nanoGPT)."""
    def factor(step: int) -> float:
        if step < dc.warmup_steps:
            return (step + 1) / dc.warmup_steps
        progress = min(1.0, (step - dc.warmup_steps) / max(1, dc.max_steps - dc.warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def draft_logits(model, batch: dict, vocab_map: VocabMap | None) -> torch.Tensor:
    """Draft logits at the loss positions, fp32 [N, V_draft]; the head runs only from the first
    completion position on."""
    ids = batch["input_ids"] if vocab_map is None else vocab_map.input_rows[batch["input_ids"]]
    keep = keep_positions(batch)
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"], logits_to_keep=keep).logits
    return logits[batch["loss_mask"][:, keep]].float()  # [N, V_draft]


def main(argv: list[str] | None = None) -> dict:
    config = cli_config(argv, "Distil a draft model from the target (make distill).")
    previous = signal.getsignal(signal.SIGTERM)
    try:
        return train(config)
    finally:  # in-process callers (tests) get their own SIGTERM handling back
        signal.signal(signal.SIGTERM, previous)


def train(config) -> dict:
    # ------------------------------------------------------------------ setup
    dc = config.distill
    check_distill_config(config)
    accelerator = make_accelerator(config)
    from accelerate.utils import set_seed

    set_seed(config.seed)
    rank, world, is_main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    out_dir = Path(dc.out_dir)
    say = print if is_main else (lambda *a, **k: None)

    train_set, eval_set = load_examples(dc.data_dirs, dc.max_seq_len, need_topk=dc.teacher == "cached",
                                         sources=dc.sources)
    eval_set = eval_set[: dc.eval_samples]
    tokenizer = load_tokenizer(config.target)
    target = load_model(config.target)  # fp32 on CPU: sizing, embedding init, and the online teacher
    full_vocab = target.get_input_embeddings().weight.shape[0]
    say(f"data: {len(train_set)} train / {len(eval_set)} eval examples from {dc.data_dirs}")

    if dc.init == "scratch":
        vocab_ids = None
        if dc.vocab_subset:
            special = [i for i in tokenizer.all_special_ids if i < full_vocab]
            vocab_ids = select_vocab(token_counts(train_set, full_vocab), dc.vocab_subset,
                                     special + [target.config.eos_token_id])
            covered = VocabMap(vocab_ids, full_vocab).output_rows
            held = [t for ex in eval_set for t in ex.ids[ex.n_prompt:].tolist()]
            if held:
                say(f"vocab subset: {len(vocab_ids)} tokens cover "
                    f"{float((covered[torch.tensor(held)] >= 0).float().mean()):.1%} of held-out completion tokens")
        draft, shape = build_scratch_draft(target, dc.param_ratio, dc.num_layers, vocab_ids, dc.embed_init, config.seed)
        say(f"draft: {shape.num_layers} layers, hidden {shape.hidden_size}, mlp {shape.intermediate_size}, "
            f"heads {shape.num_attention_heads}/{shape.num_key_value_heads} x {shape.head_dim}, "
            f"{shape.vocab_rows} vocab rows -> {shape.params / 1e6:.2f}M params "
            f"= {shape.ratio:.2%} of the target's {param_count(target) / 1e6:.1f}M")
        draft.config.draft_ratio = shape.ratio
    else:
        from decode.models import check_tokenizers

        check_tokenizers(tokenizer, load_tokenizer(dc.init))
        draft = build_pretrained_draft(dc.init, dc.lora_rank, config.seed)
        say(f"draft: {dc.init} ({param_count(draft) / 1e6:.2f}M params, "
            f"{sum(p.numel() for p in draft.parameters() if p.requires_grad) / 1e6:.2f}M trainable)")
    vocab_map = VocabMap.of(draft)
    teacher_model = None
    if dc.teacher == "online":
        dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
        teacher_model = target.to(accelerator.device, dtype)
    del target
    teacher = Teacher(dc.teacher, vocab_map, teacher_model).to(accelerator.device)

    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=dc.lr, weight_decay=dc.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(dc))
    model, optimizer = accelerator.prepare(draft, optimizer)
    # The scheduler stays unwrapped (stepped once per optimizer step) but is saved with the state.
    accelerator.register_for_checkpointing(scheduler)
    use_deepspeed = accelerator.distributed_type.name == "DEEPSPEED"

    sampler = StepSampler(len(train_set), dc.micro_batch_size, dc.grad_accum, world, config.seed)
    say(f"batch: {dc.micro_batch_size} x {dc.grad_accum} accum x {world} ranks = {sampler.global_batch} "
        f"examples/step, {sampler.steps_per_epoch} steps/epoch")
    state = TrainState()
    resume_from = latest_checkpoint(out_dir) if dc.resume else None
    if resume_from is not None:
        state = load_checkpoint(accelerator, resume_from)
        say(f"resumed from {resume_from} (step {state.step}, epoch {state.step // sampler.steps_per_epoch})")
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    logger = RunLogger(config, out_dir, is_main, state.step)

    stop_requested = {"signal": False}
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.update(signal=True))
    with_topk = dc.teacher == "cached"
    device = accelerator.device

    def batch_on_device(indices: list[int], examples) -> dict:
        batch = collate([examples[i] for i in indices], tokenizer.pad_token_id or 0, with_topk)
        return {k: v.to(device) for k, v in batch.items()}

    # ------------------------------------------------------------------ one optimizer step
    def train_step(step: int) -> dict:
        """Forward/backward over this rank's micro-batches, then one optimizer step unless any
        rank saw a non-finite teacher value or loss (then nothing reaches the optimizer)."""
        micro = sampler.micro_batches(step, rank)
        batches = [batch_on_device(indices, train_set) for indices in micro]
        tokens = torch.tensor(float(sum(int(b["loss_mask"].sum()) for b in batches)), device=device)
        global_tokens = accelerator.reduce(tokens, "sum")  # before any backward
        # DDP/DeepSpeed average gradients over ranks and accelerate divides by grad_accum:
        # multiplying by both leaves Σ_tokens ∇loss / global_tokens.
        scale = world * dc.grad_accum / global_tokens.clamp(min=1)
        sums = torch.zeros(3, device=device)  # [loss, true KL, tokens] for logging
        bad = None
        for a, batch in enumerate(batches):
            with accelerator.accumulate(model):
                if bad is not None and not use_deepspeed:
                    continue
                if bad is not None:  # DeepSpeed steps inside backward: feed it a zero gradient
                    accelerator.backward(0.0 * draft_logits(model, batch_on_device([], train_set), vocab_map).sum())
                    continue
                logits = draft_logits(model, batch, vocab_map)
                target = teacher.targets(batch)
                draft_logp, target_logp = teacher.buckets(logits, target)
                labels = batch["labels"][batch["loss_mask"]]
                if vocab_map is not None:
                    labels = vocab_map.input_rows[labels]  # tokens outside the subset train the "other" row
                mask = torch.ones_like(labels, dtype=torch.bool)
                loss_sum, _, _ = mixed_loss(dc.loss, draft_logp, target_logp, logits, labels, mask,
                                            dc.jsd_beta, dc.kd_temperature)
                finite = target.finite() and bool(torch.isfinite(loss_sum))
                any_bad = accelerator.reduce(torch.tensor(0.0 if finite else 1.0, device=device), "sum")
                if any_bad > 0:
                    bad = (a, micro[a], finite)
                    if use_deepspeed:
                        accelerator.backward(0.0 * draft_logits(model, batch_on_device([], train_set), vocab_map).sum())
                    continue
                accelerator.backward(loss_sum * scale)
                with torch.no_grad():
                    sums += torch.stack([loss_sum.detach(), kl_per_token(target_logp, draft_logp).sum(),
                                         mask.sum().float()])
        grad_norm = None
        if bad is None and not use_deepspeed:
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), dc.grad_clip)
            if not torch.isfinite(grad_norm):
                bad = (dc.grad_accum - 1, micro[-1], False)
        if bad is None or use_deepspeed:
            optimizer.step()  # DeepSpeed: already stepped inside backward; this is a no-op
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        sums = accelerator.reduce(sums, "sum")
        return dict(bad=bad, loss=float(sums[0] / global_tokens.clamp(min=1)),
                    kl=float(sums[1] / sums[2].clamp(min=1)), tokens=int(global_tokens),
                    grad_norm=float(grad_norm) if grad_norm is not None else float("nan"))

    # ------------------------------------------------------------------ held-out evaluation
    @torch.no_grad()
    def evaluate() -> dict:
        """KL, top-1 agreement and α = Σ_v min(draft_probs, target_probs) at T = 1, per token.
        With a cached teacher α sums min() over the stored top-K tokens only: a lower bound on
        the true α (the overlap outside the top-K is unknown; counting the whole "rest" bucket
        would over-count it badly when the tail is heavy). The draft is used as the decoder uses
        it (a subset draft's "other" row gets probability 0)."""
        model.eval()
        mine = list(range(rank, len(eval_set), world))
        n_micro = math.ceil(math.ceil(len(eval_set) / world) / dc.micro_batch_size)  # equal on all ranks
        sums = torch.zeros(4, device=device)  # [tokens, KL, α, top-1 agreement]
        for a in range(n_micro):
            batch = batch_on_device(mine[a * dc.micro_batch_size:(a + 1) * dc.micro_batch_size], eval_set)
            logits = draft_logits(model, batch, vocab_map)
            target = teacher.targets(batch)
            draft_logp, target_logp = teacher.buckets(logits, target)
            decode_logp, decode_target_logp = teacher.buckets(teacher.decode_logits(logits), target)
            if target.logits is None:  # cached: drop the "rest" column (lower bound, see docstring)
                decode_logp, decode_target_logp = decode_logp[:, :-1], decode_target_logp[:, :-1]
            ones = torch.ones(logits.shape[0], dtype=torch.bool, device=device)
            sums += torch.stack([ones.sum().float(), kl_per_token(target_logp, draft_logp).sum(),
                                 acceptance(decode_logp, decode_target_logp, ones)[0],
                                 (teacher.draft_top1(logits) == target.top1()).sum().float()])
        model.train()
        sums = accelerator.reduce(sums, "sum")
        n = float(sums[0].clamp(min=1))
        alpha = float(sums[2]) / n
        return {"eval/kl": float(sums[1]) / n, "eval/alpha": alpha, "eval/top1": float(sums[3]) / n,
                f"eval/tau_k{dc.tau_k}": expected_tau(alpha, dc.tau_k), "eval/tokens": int(sums[0])}

    def export(path: Path, metrics: dict | None = None) -> None:
        extra = {"config.yaml": yaml.safe_dump(config_to_dict(config), sort_keys=False)}
        if metrics is not None:
            extra["metrics.json"] = json.dumps(metrics, indent=1)
        export_draft(accelerator, model, path, tokenizer, extra)

    def run_eval() -> dict:
        metrics = evaluate()
        if metrics["eval/alpha"] > state.best_alpha:
            state.best_alpha, state.best_step, state.evals_since_best = metrics["eval/alpha"], state.step, 0
            export(out_dir / "best", {"step": state.step, **metrics})
        else:
            state.evals_since_best += 1
        logger.log(state.step, metrics)
        logger.message(f"step {state.step}: " + ", ".join(f"{k[5:]} {v:.4g}" for k, v in metrics.items()))
        return metrics

    # ------------------------------------------------------------------ loop
    model.train()
    t_start, steps_here = time.monotonic(), 0
    elapsed_before = state.elapsed_s
    last_eval_step, stop_reason = -1, None
    while state.step < dc.max_steps:
        t0 = time.monotonic()
        result = train_step(state.step)
        state.step += 1
        steps_here += 1
        state.elapsed_s = elapsed_before + time.monotonic() - t_start
        if result["bad"] is not None:
            state.bad_steps += 1
            a, indices, _ = result["bad"]
            message = (f"step {state.step} (epoch {(state.step - 1) // sampler.steps_per_epoch}): non-finite teacher "
                       f"values or loss in micro-batch {a} (train examples {indices} on rank {rank}); "
                       f"optimizer not stepped ({state.bad_steps}/{dc.max_bad_steps} bad steps allowed)")
            print(message, flush=True)
            if state.bad_steps > dc.max_bad_steps:
                raise NonFiniteError(message)
        else:
            lr = scheduler.get_last_lr()[0]
            tokens_per_s = result["tokens"] / max(1e-9, time.monotonic() - t0)
            logger.log(state.step, {"train/loss": result["loss"], "train/kl": result["kl"], "train/lr": lr,
                                    "train/grad_norm": result["grad_norm"], "train/tokens_per_s": tokens_per_s},
                       show={"loss": result["loss"], "kl": result["kl"], "tok/s": tokens_per_s})
        logger.advance()

        if eval_set and dc.eval_every > 0 and state.step % dc.eval_every == 0:
            run_eval()
            last_eval_step = state.step
            if dc.early_stop_patience and state.evals_since_best >= dc.early_stop_patience:
                stop_reason = f"early stop: α has not improved for {state.evals_since_best} evaluations"
        # Every rank must agree to stop at this boundary (a signal may reach only one of them).
        local_stop = stop_requested["signal"] or (dc.stop_after and steps_here >= dc.stop_after) or (
            dc.max_minutes and state.elapsed_s >= 60 * dc.max_minutes)
        if accelerator.reduce(torch.tensor(float(bool(local_stop)), device=device), "sum") > 0 and stop_reason is None:
            stop_reason = "interrupted" if stop_requested["signal"] or dc.stop_after else "max_minutes reached"
        if stop_reason or (dc.save_every > 0 and state.step % dc.save_every == 0) or state.step == dc.max_steps:
            save_checkpoint(accelerator, out_dir, state, dc.keep_checkpoints)
        if stop_reason:
            logger.message(f"step {state.step}: {stop_reason}; checkpoint saved")
            break

    if stop_reason == "interrupted":  # resume later from the checkpoint just saved
        logger.finish({})
        return {"step": state.step, "stopped": stop_reason}

    # ------------------------------------------------------------------ final export
    if eval_set and last_eval_step != state.step:
        run_eval()
    summary = {"step": state.step, "best_step": state.best_step, "stopped": stop_reason or "max_steps",
               "bad_steps": state.bad_steps, "elapsed_s": round(state.elapsed_s, 1),
               "teacher": dc.teacher, "alpha_note": "cached teacher: α summed over the stored top-K tokens (lower bound)"
               if dc.teacher == "cached" else "online teacher: exact α over the full vocabulary"}
    best = out_dir / "best"
    if is_main and eval_set and best.is_dir():
        best_metrics = json.loads((best / "metrics.json").read_text())
        summary.update({k.replace("eval/", "final/"): v for k, v in best_metrics.items() if k.startswith("eval/")})
    accelerator.wait_for_everyone()
    if eval_set and best.is_dir():
        if is_main:
            copy_export(best, out_dir / "final", {"metrics.json": json.dumps(summary, indent=1)})
    else:
        export(out_dir / "final", summary)
    accelerator.wait_for_everyone()
    if is_main:
        (out_dir / "final_metrics.json").write_text(json.dumps(summary, indent=1))
        say(json.dumps(summary))
    logger.finish(summary)
    return summary


if __name__ == "__main__":
    main()
