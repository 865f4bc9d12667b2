#!/usr/bin/env bash
# The checks only a CUDA GPU can run, in one go: the CUDA tests (engine against transformers
# and peft, Triton kernels compiled for real against their references), the Triton
# multi-LoRA kernels' speed (bench.lora_triton) and the engine's multi-LoRA throughput on
# the GPU (bench.lora, random weights in the shape of the model whose config.json is in
# $MODEL_CONFIG). Results go to $OUT (default /tmp/switchboard-gpu). Needs torch with CUDA,
# triton, transformers, peft, safetensors and pytest; nothing else of the project's stack.
set -u
OUT=${OUT:-/tmp/switchboard-gpu}
MODEL_CONFIG=${MODEL_CONFIG:-$HOME/.cache/switchboard/models/SmolLM2-135M-Instruct}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PYTHON -c "import torch, triton, transformers, peft; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
status=0
timeout "${TESTS_S:-240}" $PYTHON -m pytest -q -p no:cacheprovider --maxfail=15 \
    tests/test_engine_cuda.py tests/test_lora_kernels.py 2>&1 | tee "$OUT/tests.log" | tail -n 60
status=$((status | PIPESTATUS[0]))
timeout "${KERNELS_S:-150}" $PYTHON -m bench.lora_triton --out "$OUT/lora_triton.json" \
    2>&1 | tee "$OUT/lora_triton.log"
status=$((status | PIPESTATUS[0]))
timeout "${ENGINE_S:-300}" $PYTHON -m bench.lora --model "$MODEL_CONFIG" --random-weights \
    --device cuda --adapters 1,32,128 --requests 128 --max-loras 128 --repeats 3 --peft-subset 4 \
    --workdir /tmp/switchboard-bench-lora-gpu --out "$OUT/lora.json" 2>&1 | tee "$OUT/lora.log"
status=$((status | PIPESTATUS[0]))
exit $status
