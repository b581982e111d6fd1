"""Export a trained draft to a format another program loads, as a step of its own.

  hf.py        the Hugging Face folder (weights with LoRA merged, config, tokenizer, and the run's
               config.yaml / metrics.json): what a run's best/ and final/ are
  hf_full.py   a subset draft as a plain full-vocabulary model (exact for spread_other drafts)
  gguf.py      GGUF files (f16, q8_0) of the full-vocabulary draft (and of the target) for llama.cpp
  eagle3.py    a feature draft as the EAGLE-3 head vLLM and SGLang load (config.json, d2t/t2d)
  run.py       export a finished run folder's final/ (or best/) draft to a chosen format (FORMATS)
  __main__.py  python -m distill.export --run runs/x --out exports/x [--format hf|hf-full|gguf|target-gguf|eagle3]
               [--source final|best]
  engines.py   `make export`: the exports `make eval-engines` reads, into <run>/export/ (decode/engines/exports.py)

The training loop writes best/ and final/ through hf.py; everything else starts from those
folders. A vocabulary-subset draft's row <-> token id map travels in its HF config
(decode.vocab.VocabSubset.write_to / from_config); hf-full and gguf leave it behind.
"""
