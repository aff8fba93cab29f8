"""GPU-launch hazards refused or handled before anything loads (docs/gpu-support.md), all checked on CPU:
supported torch/transformers versions, fp16 (needs a loss scaler the scripts do not use), the collective timeout,
async hf generation under an FSDP launch (torch cannot deep-copy an FSDP2 module), a vllm_server engine on the
trainer's GPU with NCCL weight transfer, and frozen RL models held in the compute dtype."""

from __future__ import annotations

import os
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from training_helpers import recipe_args

from demo.synthetic import rl_rows, write_jsonl
from open_instruct import distributed, generation_backends
from open_instruct.config import RLVRConfig, SFTConfig, parse_config
from open_instruct.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture()
def rl_argv(tiny_models, tmp_path):
    data = write_jsonl(str(tmp_path / "rl.jsonl"), rl_rows(16, 0))
    return recipe_args("rlvr_tiny.yaml", tiny_models["causal_lm"], data, data, tmp_path / "out")


@pytest.mark.parametrize(
    "torch_version,transformers_version,problems",
    [
        ("2.11.0+cu130", "5.17.0", 0),  # the GPU image
        ("2.13.0+cpu", "5.24.0", 0),
        ("2.14.1", "5.17.0", 0),
        ("2.10.1", "5.17.0", 1),  # FSDP2 internals of a release the adapter was not written for
        ("2.15.0a0+git123", "5.17.0", 1),  # a pre-release of an unsupported minor
        ("2.11.0", "5.16.1", 1),
        ("2.6.0", "4.57.0", 2),
    ],
)
def test_supported_versions(torch_version, transformers_version, problems):
    found = distributed.version_problems(torch_version, transformers_version)
    assert len(found) == problems, found
    if problems:
        assert "supported: 2.11 to 2.14" in " ".join(found) or "supported: >= 5.17" in " ".join(found)


def test_this_environment_is_supported():
    import transformers

    assert distributed.version_problems(torch.__version__, transformers.__version__) == []


def test_fp16_is_refused_before_anything_loads(tiny_models, tmp_path):
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    data = write_jsonl(str(tmp_path / "sft.jsonl"), [row])
    argv = ["--model_name_or_path", tiny_models["causal_lm"], "--dataset_name_or_path", data]
    argv += ["--output_dir", str(tmp_path / "out")]
    parse_config(SFTConfig, [*argv, "--mixed_precision", "bf16"])
    with pytest.raises(ConfigError, match=r"mixed_precision fp16 is not supported.*use bf16"):
        parse_config(SFTConfig, [*argv, "--mixed_precision", "fp16"])


def test_collective_timeout_reaches_the_accelerator(rl_argv, monkeypatch):
    cfg = parse_config(RLVRConfig, [*rl_argv, "--distributed_timeout_minutes", "90"])
    handlers = distributed.process_group_kwargs(cfg)
    assert [h.timeout for h in handlers] == [timedelta(minutes=90)]
    assert handlers[0].to_kwargs() == {"timeout": timedelta(minutes=90)}  # what accelerate hands init_process_group

    seen = {}

    class Stop(Exception):
        pass

    def recording_accelerator(**kwargs):
        seen.update(kwargs)
        raise Stop

    import accelerate

    monkeypatch.setattr(accelerate, "Accelerator", recording_accelerator)
    with pytest.raises(Stop):
        distributed.build_accelerator(cfg)
    assert [h.timeout for h in seen["kwargs_handlers"]] == [timedelta(minutes=90)]
    assert parse_config(RLVRConfig, rl_argv).distributed_timeout_minutes == 60  # the default: torch's is 10
    assert [h.timeout for h in distributed.process_group_kwargs(SimpleNamespace())] == [timedelta(minutes=60)]
    with pytest.raises(ConfigError, match="distributed_timeout_minutes"):
        parse_config(RLVRConfig, [*rl_argv, "--distributed_timeout_minutes", "0"])


def test_async_hf_generation_under_an_fsdp_launch_is_refused_before_loading(rl_argv, monkeypatch):
    cfg = parse_config(RLVRConfig, [*rl_argv, "--generation_backend", "hf", "--async_steps", "1"])
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    generation_backends.check_before_loading(cfg, 128)  # one plain process: frozen copies of an unsharded policy
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # `accelerate launch --config_file fsdp_*.yaml --num_processes 1`
    with pytest.raises(ConfigError, match=r"cannot be copied.*without the FSDP accelerate config.*async_steps 0"):
        generation_backends.check_before_loading(cfg, 128)
    synchronous = parse_config(RLVRConfig, [*rl_argv, "--generation_backend", "hf"])
    generation_backends.check_before_loading(synchronous, 128)


def _server_cfg(**overrides):
    cfg = dict(
        generation_backend="vllm_server",
        vllm_server_urls=None,
        vllm_engine_devices=[0],
        vllm_weight_transfer="auto",
        async_steps=0,
    )
    return SimpleNamespace(**{**cfg, **overrides})


def test_an_engine_on_the_trainers_gpu_with_nccl_transfer_is_refused():
    problem = generation_backends.same_gpu_nccl_problem(_server_cfg(), on_gpu=True)
    assert "GPU 0" in problem and "generation_backend vllm" in problem and "vllm_weight_transfer gloo" in problem
    assert generation_backends.same_gpu_nccl_problem(_server_cfg(vllm_weight_transfer="nccl"), on_gpu=True)
    for fine in (
        _server_cfg(vllm_engine_devices=[1]),  # a GPU of its own
        _server_cfg(vllm_engine_devices=None),  # the default: the GPUs after the training processes'
        _server_cfg(vllm_weight_transfer="gloo"),  # host-staged: no NCCL group
        _server_cfg(vllm_server_urls=["http://gen-node:8000"]),  # engines started apart
        _server_cfg(generation_backend="vllm"),
    ):
        assert generation_backends.same_gpu_nccl_problem(fine, on_gpu=True) is None
    assert generation_backends.same_gpu_nccl_problem(_server_cfg(), on_gpu=False) is None  # CPU: gloo


def test_check_before_loading_refuses_the_same_gpu_engine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="cannot join two ranks on one GPU"):
        generation_backends.check_before_loading(_server_cfg(), 128)


def test_frozen_rl_models_are_held_in_the_compute_dtype(rl_argv, tiny_models):
    """Under bf16 autocast (no FSDP) the reference and reward models keep their matmul weights in bf16 (what autocast
    computes them in), embeddings, norms and the fp32 score head in fp32: about half the bytes, and the reference's
    log-probs equal an fp32 reference's exactly. Trained models keep fp32 master weights."""
    from accelerate.state import AcceleratorState

    from open_instruct import rlvr_ppo, runtime
    from open_instruct.models import load_policy, load_tokenizer

    argv = [*rl_argv, "--beta", "0.05", "--reward_model_path", tiny_models["seq_cls"], "--reward_model_multiplier", "1"]
    AcceleratorState._reset_state()  # one process-wide state, whose precision is fixed once set
    cfg = parse_config(RLVRConfig, [*argv, "--mixed_precision", "bf16"])
    accelerator = runtime.make_accelerator(cfg)
    models, _, _ = rlvr_ppo.load_models(
        cfg, load_tokenizer(tiny_models["causal_lm"]), accelerator, SimpleNamespace(optimizer_steps=4)
    )

    def dtypes(model, kind):
        return {n: p.dtype for n, p in model.named_parameters() if kind in n}

    assert (
        {p.dtype for p in models.policy.parameters()} == {p.dtype for p in models.value.parameters()} == {torch.float32}
    )
    for frozen in (models.reference, models.reward):
        assert set(dtypes(frozen, "proj.weight").values()) == {torch.bfloat16}  # attention and MLP matmuls
        assert set(dtypes(frozen, "norm").values()) == set(dtypes(frozen, "embed").values()) == {torch.float32}
    assert set(dtypes(models.reward, "score").values()) == {torch.float32}
    bytes_held = sum(p.numel() * p.element_size() for p in models.reference.parameters())
    fp32_bytes = 4 * sum(p.numel() for p in models.reference.parameters())
    assert bytes_held < 0.9 * fp32_bytes  # the tiny model is embedding-heavy; Llama-3-8B is ~93% matmul weights

    fp32_reference = accelerator.prepare_model(load_policy(cfg).eval(), evaluation_mode=True)
    ids = torch.randint(0, 60, (4, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), accelerator.autocast():
        held = torch.log_softmax(models.reference(input_ids=ids).logits.float(), -1)
        full = torch.log_softmax(fp32_reference(input_ids=ids).logits.float(), -1)
    assert torch.equal(held, full)  # bit for bit: autocast rounds the fp32 weights to the same bf16 values
    AcceleratorState._reset_state()


def test_frozen_models_under_fsdp_are_all_bf16_and_fp32_runs_are_unchanged(tiny_models):
    from open_instruct.models import hold_frozen_in_compute_dtype, load_causal_lm

    sharded = hold_frozen_in_compute_dtype(load_causal_lm(tiny_models["causal_lm"]), "bf16", sharded=True)
    assert {p.dtype for p in sharded.parameters()} == {torch.bfloat16}  # FSDP2's policy computes all of it in bf16
    buffers = dict(sharded.named_buffers())
    assert buffers and {b.dtype for n, b in buffers.items() if "inv_freq" in n} == {torch.float32}  # as the policy's
    plain = hold_frozen_in_compute_dtype(load_causal_lm(tiny_models["causal_lm"]), "no", sharded=False)
    assert {p.dtype for p in plain.parameters()} == {torch.float32}


GATHER_SCRIPT = r"""
import json, sys, tempfile
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from open_instruct.vllm_generator import hf_weights

dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
whole = {n: p.detach().clone() for n, p in model.named_parameters()}
for module in model:
    for name, p in list(module.named_parameters()):
        setattr(module, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
gathered = []
original = DTensor.full_tensor
def spy(self, *args, **kwargs):
    gathered.append(str(self.dtype))
    return original(self, *args, **kwargs)
DTensor.full_tensor = spy
out = dict(hf_weights(model, dtype=torch.bfloat16))
exact = all(torch.equal(out[n], whole[n].to(torch.bfloat16)) for n in whole)
print(json.dumps({"gathered": gathered, "dtypes": sorted({str(t.dtype) for t in out.values()}), "exact": exact}))
dist.destroy_process_group()
"""


def test_weight_sync_casts_each_shard_before_the_gather(tmp_path):
    """S5: the engine's dtype is applied to the local shard, so the all-gather moves bf16, and the gathered tensors
    are exactly the fp32 weights rounded to bf16 (rounding is elementwise)."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", GATHER_SCRIPT], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"gathered": ["torch.bfloat16"] * 4, "dtypes": ["torch.bfloat16"], "exact": True}


def test_engines_do_not_inherit_the_trainers_launcher_ranks():
    from open_instruct.engines import engine_environment

    parent = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    parent |= {"TORCHELASTIC_RUN_ID": "x", "PATH": "/bin", "HF_HOME": "/hf", "CUDA_VISIBLE_DEVICES": "0,1"}
    env = engine_environment(parent, {"CUDA_VISIBLE_DEVICES": "7", "VLLM_SERVER_DEV_MODE": "1"})
    assert env == {"PATH": "/bin", "HF_HOME": "/hf", "CUDA_VISIBLE_DEVICES": "7", "VLLM_SERVER_DEV_MODE": "1"}
