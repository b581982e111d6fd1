"""Hugging Face transformers `generate`: the target alone, with the exported full-vocabulary draft as
`assistant_model` (a plain HF folder, no code of ours) and with HF's prompt lookup. HF has no
EAGLE-3, so a feature draft's mode (eagle3) is left out and only plain and prompt lookup run.

HF does not report how many drafted tokens it accepted, so its rows have no α or τ.
"""

from __future__ import annotations

import torch
import transformers
from transformers import AutoModelForCausalLM

from common.models import load_model, resolve_device, torch_dtype
from decode.engines.exports import draft_hf
from decode.engines.job import EngineJob
from decode.engines.rows import EngineRun
from decode.hf_baselines import hf_generate
from decode.timing import timed


def run_hf(job: EngineJob) -> list[EngineRun]:
    cfg, ev = job.cfg, job.cfg.eval
    torch.set_num_threads(job.threads)
    device = resolve_device(cfg.device)
    dtype = torch_dtype(ev.dtype, device)
    target = load_model(cfg.target, device, dtype)
    modes = [(mode, k) for mode, k in job.modes if mode != "eagle3"]
    if len(modes) < len(job.modes):
        print("hf: transformers generate cannot run an EAGLE-3 draft; its plain and prompt-lookup rows only")
    assistant = (AutoModelForCausalLM.from_pretrained(draft_hf(cfg), dtype=dtype).to(device).eval()
                 if any(mode == "draft" for mode, _ in modes) else None)
    eos = job.tokenizer.eos_token_id
    note = f"transformers {transformers.__version__}, {str(dtype).removeprefix('torch.')}"

    def generate(mode: str, k: int | None, ids: list[int], temperature: float, max_new_tokens: int):
        return hf_generate(target, torch.tensor([ids], device=device), max_new_tokens, eos,
                           assistant=assistant if mode == "draft" else None, k=k or 1,
                           prompt_lookup=mode == "ngram", ngram=cfg.engines.ngram, sampling=ev.sampling(temperature))

    for mode, k in modes:
        generate(mode, k, job.prompts[0][1], 0.0, 8)  # untimed warm-up: first calls allocate and pick kernels
    runs: dict[tuple, EngineRun] = {}
    for temperature in ev.temperatures:
        for index, (set_name, ids) in enumerate(job.prompts):
            for mode, k in modes:  # every mode on this prompt back to back, as llama.cpp's: drift hits all alike
                run = runs.setdefault((mode, k, temperature, set_name),
                                      EngineRun("hf", set_name, mode, k, temperature, [], [], [], notes=[note]))
                torch.manual_seed(job.seed(index))
                with timed(device, run.seconds):
                    new = generate(mode, k, ids, temperature, ev.max_new_tokens)
                run.new_tokens.append(len(new))
                run.outputs.append(new.tolist())
    return list(runs.values())
