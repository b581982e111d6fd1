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
    return Accelerator(cpu=on_cpu and not dc.deepspeed_config, mixed_precision="bf16" if bf16 else "no",
                       gradient_accumulation_steps=dc.grad_accum, **kwargs)
