"""The parts `distill/train.py` (the `make distill` recipe) is assembled from:

  accelerator.py  the Accelerator: CPU/GPU, bf16 autocast, DeepSpeed from a JSON
  optimizer.py    AdamW and the warmup + cosine learning-rate schedule
  teacher.py      the draft's logits and the teacher's targets at the same loss positions
  evaluate.py     held-out KL, α and top-1 agreement
  run_log.py      metrics.jsonl, W&B and the progress bar (main process only)
  resume.py       which settings a resumed run may change

A feature draft (distill.draft_kind=feature, decode/drafts/feature/model.py) overrides the recipe's draft,
teacher, loss, evaluation and export:

  feature.py         FeatureRecipe: the DistillRecipe with those parts swapped
  feature_target.py  the target it is tied to (layers it has, identity checked on resume)
  feature_teacher.py the online target: hidden states, next-token embeddings, subset log-probs
  feature_loss.py    the unrolled steps' loss (target renormalised over the subset, weighted by its mass)
  feature_eval.py    held-out α per unrolled step and the τ they imply
"""
