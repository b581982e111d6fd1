"""The processes of one generate-data run: torch.distributed when launched by torchrun, else one.

RANK/WORLD_SIZE come from torchrun (gloo on CPU, nccl on GPU); a plain `python -m` run is rank 0
of 1 and never touches torch.distributed.
"""

from __future__ import annotations

import os

import torch

from common.models import resolve_device


class Ranks:
    def __init__(self, device: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = resolve_device(device)
        if self.device.type == "cuda" and self.world > 1:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if self.world > 1:
            import torch.distributed as dist

            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    def owns(self, shard_index: int) -> bool:
        """Shard i belongs to rank i % world_size."""
        return shard_index % self.world == self.rank

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
