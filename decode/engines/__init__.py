"""`make eval-engines`: the exported draft measured inside serving engines (python -m decode.engines).

  job.py              EngineJob (config, prompts as token ids, modes, log folder) and EngineFailed
  rows.py             EngineRun (one engine mode at one temperature over a prompt set) -> report rows
  exports.py          the layout of `make export`'s folder, which the engines read (never distill/)
  hf_engine.py        transformers generate: plain, assistant_model = the exported draft, prompt lookup
  vllm_engine.py      vLLM in its own environment, one subprocess per mode ...
  vllm_worker.py      ... which runs this script under the vLLM interpreter
  llamacpp_engine.py  llama.cpp's built tools (llama-completion, llama-speculative-simple)
  llamacpp_output.py  ... and what they print, parsed
  target_logprob.py   the target's log-probability of every output: the check on sampled (T > 0) outputs
  __main__.py         every engine in engines.run -> report.json `engines` and report.md "Serving engines"
"""
