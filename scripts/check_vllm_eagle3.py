"""Does vLLM (method eagle3) run a feature draft's EAGLE-3 export as this project's decoder runs the draft?

    .venv/bin/python scripts/check_vllm_eagle3.py --run runs/smollm2-feature [--source final] [--k 3]

Exports the run's feature draft (`--format eagle3`) into <run>/export/eagle3, decodes a few chat
prompts greedily with vLLM (CPU, in the environment `make setup-vllm` makes) speculating with it, and
with this project's decoder and the same draft. Prints per prompt whether vLLM's tokens equal
target-only greedy and the draft tokens each system accepted (equal when vLLM reads the same layers,
norms and weights), and exits 1 when any tokens differ.

vLLM runs with enforce_eager: on CPU its torch.compile warm-up of the eagle3 drafter kills the worker
process (vLLM 0.32: an ignored RecursionError in CPUDNNLGEMMHandler.__del__, then the engine waits).
The vLLM side runs this file under the vLLM interpreter (`--worker`), which imports nothing of the project.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


PROMPTS = ["What is the capital of France?", "Write a short poem about the sea.",
           "Explain what a prime number is.", "List three uses of a paperclip."]


def vllm_worker(job_path: str, result_path: str) -> None:
    """Under the vLLM interpreter: greedy outputs and per-prompt speculative counters."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(job_path).read_text())
    llm = LLM(model=job["target"], tokenizer=job["target"], dtype="float32", max_model_len=job["max_model_len"],
              kv_cache_memory_bytes=1 << 30, enforce_eager=True, disable_log_stats=False,
              speculative_config={"method": "eagle3", "model": job["draft"], "num_speculative_tokens": job["k"]})

    def accepted() -> int:
        return sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens")

    outputs = []
    for ids in job["prompts"]:
        before = accepted()
        (result,) = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                                 SamplingParams(max_tokens=job["max_new_tokens"], temperature=0.0), use_tqdm=False)
        outputs.append({"tokens": list(result.outputs[0].token_ids), "accepted": accepted() - before})
    Path(result_path).write_text(json.dumps(outputs))


def main(argv: list[str] | None = None) -> None:
    import torch
    import yaml

    from common.config import Config
    from common.models import load_model, load_tokenizer
    from common.sampling import SamplingParams
    from decode.api import build_feature_runner
    from decode.drafts.feature.model import FeatureDraft
    from decode.drafts.feature.proposer import make_feature_proposer
    from decode.engines.vllm_engine import target_folder, vllm_python, worker_env
    from decode.runners import make_runner
    from decode.speculative import speculative_decode, target_decode
    from decode.vocab import model_vocab_size
    from distill.export.run import export_run

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a distill.draft_kind=feature run folder")
    parser.add_argument("--source", default="final", choices=["final", "best"])
    parser.add_argument("--k", type=int, default=3, help="draft tokens per verification")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--vllm-python", default=Config().generate.vllm.python,
                        help="the vLLM environment's interpreter (default: generate.vllm.python's)")
    args = parser.parse_args(argv)
    # Only the target of the run's config: a run saved before a config key was renamed still loads.
    target_ref = yaml.safe_load((args.run / args.source / "config.yaml").read_text())["target"]
    export = export_run(args.run, args.run / "export" / "eagle3", "eagle3", args.source)
    tokenizer = load_tokenizer(target_ref)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"]) for text in PROMPTS]
    python = vllm_python(args.vllm_python)
    with tempfile.TemporaryDirectory() as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"target": target_folder(target_ref), "draft": str(export), "k": args.k,
                                   "max_new_tokens": args.max_new_tokens, "prompts": prompts, "max_model_len": 1024}))
        subprocess.run([str(python), __file__, "--worker", str(job), str(result)], check=True,
                       env=worker_env(python, torch.get_num_threads()))
        vllm_outputs = json.loads(result.read_text())
    target, draft = load_model(target_ref), FeatureDraft.load(args.run / args.source)
    plain, feature_runner = make_runner(target, model_vocab_size(target)), build_feature_runner(target, draft)
    proposer = make_feature_proposer(feature_runner, draft, target.get_input_embeddings().weight)
    greedy_args = dict(max_new_tokens=args.max_new_tokens, sampling=SamplingParams(),
                       eos_token_id=tokenizer.eos_token_id)
    same = True
    for ids, theirs in zip(prompts, vllm_outputs):
        greedy = target_decode(plain, torch.tensor([ids]), **greedy_args).tolist()
        ours = speculative_decode(feature_runner, proposer, torch.tensor([ids]), k=args.k, **greedy_args)
        same &= theirs["tokens"] == greedy == ours.tokens.tolist()
        print(f"{len(greedy)} tokens: vLLM eagle3 = target-only greedy: {theirs['tokens'] == greedy}; "
              f"accepted draft tokens: vLLM {theirs['accepted']}, ours {ours.stats.accepted} "
              f"(of {ours.stats.proposed} proposed)")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        vllm_worker(*sys.argv[2:4])
    else:
        from common.cli import run_cli

        run_cli(main)
