#!/usr/bin/env bash
# The checks only a CUDA GPU can run, in one go, within 8 minutes (20 s more for
# bench.host_step): the CUDA tests (engine
# against transformers and peft, both attention backends, Triton kernels compiled for real
# against their references), the Triton multi-LoRA kernels' speed (bench.lora_triton), the
# Triton paged attention against its HBM bandwidth floor and the torch path
# (bench.attention_triton), and the engine's throughput for the base model, 1 and 32 adapters
# (bench.lora, random weights) in the shape of the model whose config.json is in
# $MODEL_CONFIG and in a 1.7B Llama's shape, then the host's work per decode step on this
# machine's CPU (bench.host_step). Results go to $OUT (default
# /tmp/switchboard-gpu). Needs torch with CUDA, triton, transformers, peft, safetensors and
# pytest; nothing else of the project's stack. Each step has its own time limit (seconds,
# overridable: TESTS_S, KERNELS_S, ATTENTION_S, ENGINE_S, ENGINE_1B_S, HOST_S).
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
timeout "${TESTS_S:-120}" $PYTHON -m pytest -q -p no:cacheprovider --maxfail=15 \
    tests/worker/test_engine_cuda.py tests/kernels/test_lora_kernels.py tests/kernels/test_paged_attention_kernels.py \
    tests/kernels/test_wq_triton.py tests/worker/test_quantized_base.py \
    tests/worker/test_attention_backend.py 2>&1 | tee "$OUT/tests.log" | tail -n 60
status=$((status | PIPESTATUS[0]))
timeout "${KERNELS_S:-60}" $PYTHON -m bench.lora_triton --out "$OUT/lora_triton.json" \
    2>&1 | tee "$OUT/lora_triton.log"
status=$((status | PIPESTATUS[0]))
timeout "${ATTENTION_S:-50}" $PYTHON -m bench.attention_triton --out "$OUT/attention_triton.json" \
    2>&1 | tee "$OUT/attention_triton.log"
status=$((status | PIPESTATUS[0]))
timeout "${ENGINE_S:-100}" $PYTHON -m bench.lora --model "$MODEL_CONFIG" --random-weights \
    --device cuda --adapters 1,32 --requests 128 --max-loras 32 --repeats 2 --peft-subset 4 \
    --workdir /tmp/switchboard-bench-lora-gpu --out "$OUT/lora.json" 2>&1 | tee "$OUT/lora.log"
status=$((status | PIPESTATUS[0]))
# A 1.7B Llama's shape (SmolLM2-1.7B's config: 24 layers, hidden 2048, 32 heads, no GQA).
LLAMA_1B=/tmp/switchboard-llama-1.7b-config
mkdir -p "$LLAMA_1B"
cat > "$LLAMA_1B/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
 "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 32,
 "num_key_value_heads": 32, "vocab_size": 49152, "max_position_embeddings": 8192,
 "rms_norm_eps": 1e-05, "rope_theta": 130000, "tie_word_embeddings": true,
 "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
JSON
timeout "${ENGINE_1B_S:-150}" $PYTHON -m bench.lora --model "$LLAMA_1B" --random-weights \
    --device cuda --adapters 1,32 --requests 128 --max-loras 32 --repeats 1 --peft-subset 0 \
    --kv-cache-gb 16 \
    --workdir /tmp/switchboard-bench-lora-1.7b --out "$OUT/lora_1.7b.json" 2>&1 \
    | tee "$OUT/lora_1.7b.log"
status=$((status | PIPESTATUS[0]))
# The model's vocabulary and tokenizer (the config's directory must hold them).
timeout "${HOST_S:-20}" $PYTHON -m bench.host_step --model "$MODEL_CONFIG" --repeats 2 \
    --steps 32 --out "$OUT/host_step.json" 2>&1 | tee "$OUT/host_step.log"
status=$((status | PIPESTATUS[0]))
exit $status
