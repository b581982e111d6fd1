"""The parts `distill/train.py` (the `make distill` recipe) is assembled from:

  accelerator.py  the Accelerator: CPU/GPU, bf16 autocast, DeepSpeed from a JSON
  optimizer.py    AdamW and the warmup + cosine learning-rate schedule
  teacher.py      the draft's logits and the teacher's targets at the same loss positions
  evaluate.py     held-out KL, α and top-1 agreement
  run_log.py      metrics.jsonl, W&B and the progress bar (main process only)
  resume.py       which settings a resumed run may change
"""
