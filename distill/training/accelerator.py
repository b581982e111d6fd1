"""The Accelerator a run trains under."""

from __future__ import annotations

import json
from pathlib import Path

from common.models import resolve_device


def make_accelerator(config):
    """bf16 autocast when distill.precision (resolved: never 'auto' here) is bf16; gloo under torchrun
    on CPU. DeepSpeed from a JSON whose "auto" entries are filled from the distill config."""
    from accelerate import Accelerator

    dc = config.distill
    on_cpu = resolve_device(config.device).type == "cpu"
    bf16 = dc.precision == "bf16"
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
            skip_shm_allreduce_build()
    return Accelerator(cpu=on_cpu and not dc.deepspeed_config, mixed_precision="bf16" if bf16 else "no",
                       gradient_accumulation_steps=dc.grad_accum, **kwargs)


def shards_parameters(accelerator) -> bool:
    """Whether each rank holds only a shard of every parameter (DeepSpeed ZeRO-3, FSDP)."""
    kind = accelerator.distributed_type.name
    plugin = accelerator.state.deepspeed_plugin
    return kind == "FSDP" or (kind == "DEEPSPEED" and plugin is not None and plugin.zero_stage == 3)


def skip_shm_allreduce_build():
    """DeepSpeed on CPU JIT-compiles its shared-memory allreduce at the first collective (~100 s on 2 cores,
    every fresh machine) unless the op was prebuilt at install (DS_BUILD_SHM_COMM=1). gloo's allreduce
    carries a draft's gradients well enough, so an op that is not prebuilt is marked unavailable."""
    from deepspeed import ops
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    if not installed_ops.get(ShareMemCommBuilder.NAME, False):
        ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
