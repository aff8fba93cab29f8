"""A vLLM logits processor that lets a test step a request one token at a time, so a weight update lands
mid-generation whatever the scheduler does (tests/test_engine_client.py).

A request opts in with `sampling_params.extra_args = {"step_gate": {"at": K, "signal": FIFO, "gate": FIFO}}`. From its
K-th output token on, before each of its decoding steps the processor writes b"w" to the signal FIFO and waits for a
byte on the gate FIFO: b"s" lets one step run, anything else (b"d") lets the request run freely from then on. The
processor runs in vLLM's worker process, inside the engine's step: while it waits, the engine core cannot step, so a
request held here is never finished behind the test's back. Requests without `step_gate` are untouched. Loaded into
the engine with `--logits-processors vllm_step_gate:StepGate` (tests/ on the engine's PYTHONPATH)."""

from typing import Any, Optional

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality


class StepGate(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.gates: dict[int, tuple[dict, list[int]]] = {}  # batch index -> (gate, the request's output tokens)

    def is_argmax_invariant(self) -> bool:
        return False  # applied to greedy requests too

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.gates.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            gate = (params.extra_args or {}).get("step_gate") if params is not None else None
            if gate is None:
                self.gates.pop(index, None)
            else:
                self.gates[index] = (dict(gate), output_ids)
        for a, b, direction in batch_update.moved:
            ga, gb = self.gates.pop(a, None), self.gates.pop(b, None)
            if ga is not None:
                self.gates[b] = ga
            if gb is not None and direction == MoveDirectionality.SWAP:
                self.gates[a] = gb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for gate, output_ids in self.gates.values():
            if gate.get("free") or len(output_ids) < int(gate["at"]):
                continue
            if "to_test" not in gate:  # the test opens them in the same order: signal first, then gate
                gate["to_test"] = open(gate["signal"], "wb", buffering=0)
                gate["from_test"] = open(gate["gate"], "rb", buffering=0)
            gate["to_test"].write(b"w")
            if gate["from_test"].read(1) != b"s":
                gate["free"] = True
                gate["to_test"].close()
                gate["from_test"].close()
        return logits
