"""Per-token trainer state (the async rollout buffer) is written beside trainer_state.json as a structure + flat
number arrays, and read back exactly: the same values, the same Python types, the same nesting."""

from __future__ import annotations

import json
import math
import os

from open_instruct.checkpoint import ARRAY_STATE_KEYS, join_arrays, read_array_state, split_arrays, write_array_state


def sample_state() -> dict:
    ids = list(range(100, 140))
    logprobs = [-0.1 * (j + 1) / 3 for j in range(40)] + [0.0, -1e-300, -math.pi]  # exact float64 values
    return {
        "async_steps": 2,
        "ranks": [[{
            "step": 5,
            "prompt_ids": [[1, 2, 3]],  # short lists stay in the JSON
            "output": {"class": "open_instruct.generation:GenerationOutput", "fields": {
                "response_ids": [ids, ids[:20]],
                "logprobs": [logprobs],
                "weight_versions": [[-1] * 3 + [4] * 17],
                "loss_masks": [[True] * 20],  # bools are not ints here: kept as JSON
                "mixed": [1] * 10 + [2.5] * 10,  # a list mixing ints and floats: kept as JSON
                "texts": ["a" * 3] * 20,
                "info": {"__ints__": "a user's key that looks like a reference, but is not one"},
                "nested": {"__dict__": {"__floats__": [0.5] * 20}},
            }},
        }]],
    }  # fmt: skip


def test_split_and_join_round_trip_exactly():
    state = sample_state()
    flats: dict = {}
    structure = split_arrays(state, flats)
    assert len(flats["__ints__"]) == 40 + 20 + 20 and len(flats["__floats__"]) == 43 + 20
    fields = structure["ranks"][0][0]["output"]["fields"]
    assert fields["response_ids"] == [{"__ints__": [0, 40]}, {"__ints__": [40, 20]}]
    assert fields["loss_masks"] == [[True] * 20]
    assert fields["mixed"] == state["ranks"][0][0]["output"]["fields"]["mixed"]
    import numpy as np

    back = join_arrays(json.loads(json.dumps(structure)), {k: np.asarray(v) for k, v in flats.items()})
    assert back == state
    out = back["ranks"][0][0]["output"]["fields"]
    assert all(type(x) is int for x in out["response_ids"][0]) and all(type(x) is float for x in out["logprobs"][0])


def test_written_files_read_back_exactly(tmp_path):
    state = sample_state()
    write_array_state(str(tmp_path), "rollout_buffer", state)
    assert sorted(os.listdir(tmp_path)) == [
        "rollout_buffer.floats.npy", "rollout_buffer.ints.npy", "rollout_buffer.json"
    ]  # fmt: skip
    assert read_array_state(str(tmp_path), "rollout_buffer") == state
    assert "rollout_buffer" in ARRAY_STATE_KEYS
    empty = {"async_steps": 1, "ranks": [[]]}  # a sync run's (or an empty) buffer: no number lists at all
    write_array_state(str(tmp_path), "empty", empty)
    assert read_array_state(str(tmp_path), "empty") == empty
