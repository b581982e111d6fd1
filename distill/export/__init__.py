"""Export a trained draft to a format another program loads, as a step of its own.

  hf.py        the Hugging Face folder (weights with LoRA merged, config, tokenizer, and the run's
               config.yaml / metrics.json): what a run's best/ and final/ are
  run.py       export a finished run folder's final/ (or best/) draft to a chosen format
  __main__.py  python -m distill.export --run runs/x --out exports/x [--format hf] [--source final]

The training loop writes best/ and final/ through hf.py; everything else starts from those
folders. A vocabulary-subset draft's row <-> token id map travels in its HF config
(decode.vocab.VocabSubset.write_to / from_config).
"""
