#!/usr/bin/env bash
# Issue 31's measurements on a lent GPU machine (one H100 or H200, no network), as few long commands.
#
#   bash benchmarks/gpu_session.sh [--budget SECONDS] STEP [STEP ...]
#
# Steps, in the issue's order (each under its own time limit, cut to what the budget leaves; a failing step
# does not stop the others):
#   env            the GPU, driver and package versions; our imports
#   models S...    random-weight models at real shapes (qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b), bf16,
#                  Qwen2.5's vocabulary, drawn on the GPU, saved under $MODELS
#   smoke          gpu_smoke.py at the 0.5B shape: every algorithm x LoRA/full, HF backend, one process
#   rollout S      rollout_overhead.py at shape S, batch 64 and 256, and a profile of each loop at batch 64
#   rollout-nocudnn S   the same with cuDNN's attention turned off (--no-cudnn-sdpa)
#   step           step_time.py: our GRPO step against TRL's GRPOTrainer, 0.5B shape
#   step-reversed  the same with our turn loop first, then the per-episode loop, then TRL
#   memory S       a GRPO step's peak GPU memory at shape S (episodes padded to ~1.1k tokens, gpu_smoke
#                  --pad-actions): LoRA and full, lean log-probs on and off, with
#                  activation checkpointing (memory-lean: lean only; memory-nockpt: lean, without checkpointing)
#   zero3          DeepSpeed ZeRO-3 on one GPU against one plain process, 1.5B shape, full parameters
#   async          async_rollout.py: sync against max_staleness 1 and 4, with and without 50 ms retrieval
#   async-short    async_rollout.py: sync against max_staleness 1, the worker as a thread and as a process
#   graph-tests    tests/rollout/test_graph_decode_gpu.py: CUDA-graph decode equals the eager batch (float32)
#   decode S...    issue 53: rollout_overhead.py at shape S, batch 64 and 256, the per-episode loop eager and
#                  through CUDA graphs (rollout.compile) against transformers' generate; summary merged into
#                  $RES/decode-gpu.json
#   step-compiled  step_time.py: ours with rollout.compile + prefix_sharing, ours eager, TRL (0.5B shape), with
#                  each step's breakdown (collection, training, decode graphs captured)
#   prefix S...    issue 67: prefix_training.py's instruct shapes (1,024- and 2,048-token prompts, groups of 8)
#                  at shape S, all layers, bf16: padded, packed and shared-prefix training passes
#   prefix-tests   tests/models/test_prefix_gpu.py (the prefix tree equals the padded batch on the GPU: float32,
#                  full and LoRA, Qwen2.5's vocabulary; bf16 gaps printed) and the packed/shared training-step
#                  equality tests of tests/models/test_packing.py, whose trainer takes the GPU
#   step-alloc     step_time.py, ours with rollout.compile + prefix_sharing only, 6 steps: PyTorch's caching
#                  allocator as it comes (PYTORCH_CUDA_ALLOC_CONF set empty), then with expandable segments
#                  (step_time.py, like `searchrl train`, sets them where the variable is unset)
#   prefix-profile S   prefix_training.py at the 2,048-token instruct shape, shape S: the layout's construction
#                  timed apart (--breakdown) and one profiled round per mode (top operators by GPU time)
#
# Issue 53's whole GPU part, as one command (within 10 minutes on one GPU):
#   bash benchmarks/gpu_session.sh --budget 560 env models qwen2.5-0.5b qwen2.5-1.5b graph-tests \
#     decode qwen2.5-0.5b step-compiled decode qwen2.5-1.5b
#
# Packages the machine lacks travel as wheels in .whl/ (see docs/scaling.md, "Running on a lent GPU").
# Results: JSON and Markdown under $RES (default /tmp/gpu_results), packed into $OUT/results.tgz after
# every step with the log, so a command cut off at its limit still returns what finished.
set -u
BUDGET=540
if [ "${1:-}" = "--budget" ]; then BUDGET=$2; shift 2; fi
START=$(date +%s)
OUT=${OUT:-/tmp/gpu_out}
RES=${RES:-/tmp/gpu_results}
MODELS=${MODELS:-/tmp/gpu_models}
mkdir -p "$OUT" "$RES" "$MODELS"
LOG=$OUT/log.txt
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TRL_EXPERIMENTAL_SILENCE=1 HF_HUB_OFFLINE=1
# The image has JAX: should anything start its GPU backend it takes 75% of the card up front
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
PY=${PY:-python3}
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 || echo "wheel install failed" | tee -a "$LOG"
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}
GPU=$($PY -c "import torch; n=torch.cuda.get_device_name(0); print('gpu-' + next((k for k in ('h200','h100','a100') if k in n.lower()), 'cuda'))" 2>/dev/null || echo cpu)

left() { echo $((BUDGET - ($(date +%s) - START))); }
pack() { tar -czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null; }
run() {  # run CAP_SECONDS NAME CMD...: the command under min(CAP, what the budget leaves - 15 s)
  local cap=$1 name=$2; shift 2
  local t=$(( $(left) - 15 )); [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 20 ]; then echo "== $name: skipped, $(left) s of the budget left" | tee -a "$LOG"; return; fi
  echo "== $name (limit $t s): $*" | tee -a "$LOG"
  local t0=$(date +%s)
  timeout -k 10 "$t" "$@" 2>&1 | tee -a "$LOG" | grep -v -E "^\s*$|Warning|warn\(" | tail -40
  echo "== $name: rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
  pack
}
model() { echo "$MODELS/$1"; }

while [ $# -gt 0 ]; do
  step=$1; shift
  sizes=()
  while [ $# -gt 0 ] && [[ $1 == qwen* ]]; do sizes+=("$1"); shift; done
  case $step in
    env)
      run 60 env bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; \
        $PY -c 'import torch, transformers, accelerate, peft, trl, datasets, bm25s, searchrl; \
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0)); \
print(\"transformers\", transformers.__version__, \"accelerate\", accelerate.__version__, \"peft\", peft.__version__, \"trl\", trl.__version__)'; \
        $PY -c 'import deepspeed; print(\"deepspeed\", deepspeed.__version__)'" ;
      cp "$LOG" "$RES/$GPU-log-env.txt" ;;
    diag)  # GPU memory in use after our imports and a BM25 search, and which GPU libraries got loaded
      run 90 diag $PY -c "
import sys, torch
torch.cuda.init(); free0, total = torch.cuda.mem_get_info()
import trl, datasets, peft, deepspeed, gpu_smoke
from searchrl.engine.trainer import Trainer
from searchrl.rollout.hf import HFGenerator
from searchrl.core.records import Doc
from searchrl.envs.retrievers.bm25 import BM25Retriever
BM25Retriever([Doc('a', 'Paris', 'Paris is in France.')]).search(['Paris'], 1)  # bm25s: JAX stays out
free1, _ = torch.cuda.mem_get_info()
print('GPU GB in use: after CUDA init', round((total - free0) / 2**30, 2), 'after imports', round((total - free1) / 2**30, 2))
print('GPU libraries imported:', sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib', 'cupy', 'tensorflow', 'numba', 'flax', 'vllm'}))
" ;
      run 30 "nvidia-smi apps" nvidia-smi --query-compute-apps=pid,used_memory --format=csv ;;
    models)
      for s in "${sizes[@]}"; do
        run 240 "model $s" $PY -m searchrl build-model --size "$s" --dtype bfloat16 --device cuda \
          --out "$(model "$s")"
      done ;;
    smoke)
      run 420 smoke $PY benchmarks/gpu_smoke.py --model "$(model qwen2.5-0.5b)" --layouts single --backends hf \
        --out "$RES" --tag "$GPU-gpu_smoke-qwen2.5-0.5b" ;;
    rollout|rollout-nocudnn)
      extra=(); tag=rollout_overhead
      [ "$step" = rollout-nocudnn ] && extra=(--no-cudnn-sdpa) && tag=rollout_overhead-nocudnn
      for s in "${sizes[@]}"; do
        run 300 "$step $s" $PY benchmarks/rollout_overhead.py --model "$(model "$s")" --device cuda \
          --dtype bfloat16 --batch 64 256 --turns --repeats 2 --profile "${extra[@]}" --out "$RES" \
          --tag "$GPU-$tag-$s"
      done ;;
    step)
      run 300 step $PY benchmarks/step_time.py --model "$(model qwen2.5-0.5b)" --device cuda --dtype bfloat16 \
        --steps 4 --out "$RES" --tag "$GPU-step_time-qwen2.5-0.5b" ;;
    step-reversed)  # the turn loop first: which of our loops pays for the warm-up
      run 300 step-reversed $PY benchmarks/step_time.py --model "$(model qwen2.5-0.5b)" --device cuda \
        --dtype bfloat16 --steps 4 --order turn episode trl --out "$RES" --tag "$GPU-step_time-reversed-qwen2.5-0.5b" ;;
    memory|memory-lean|memory-nockpt)
      # 2 questions x 8 samples of one turn, each action sampled for 16 tokens and then padded with random ids
      # to 1,024 (gpu_smoke --pad-actions: decoding 1,024 tokens one step at a time took over 2 minutes per
      # launch on an H100, most of a lease): episodes of about 1.1k tokens, 8 per micro-batch, 2 steps
      for s in "${sizes[@]}"; do
        variants="lean no-lean"; ckpt=--checkpointing; name=ckpt
        [ "$step" != memory ] && variants=lean
        [ "$step" = memory-nockpt ] && ckpt= && name=nockpt
        for lean in $variants; do
          run 300 "memory $s $lean $name" $PY benchmarks/gpu_smoke.py --model "$(model "$s")" --layouts single \
            --backends hf --algorithms grpo --steps 2 --questions 2 --group-size 8 --micro-batch 8 \
            --max-turns 1 --max-new-tokens 16 --pad-actions 1024 --max-total-tokens 2048 --"$lean" $ckpt \
            --out "$RES" --tag "$GPU-memory-$s-$lean-$name"
        done
      done ;;
    zero3)
      run 360 zero3 $PY benchmarks/gpu_smoke.py --model "$(model qwen2.5-1.5b)" --layouts single zero3 \
        --processes 1 --modes full --backends hf --algorithms grpo --steps 2 --questions 2 --group-size 8 \
        --micro-batch 8 --max-turns 1 --max-new-tokens 16 --pad-actions 1024 --max-total-tokens 2048 --checkpointing \
        --out "$RES" --tag "$GPU-zero3-qwen2.5-1.5b" ;;
    async)
      run 420 async $PY benchmarks/async_rollout.py --model "$(model qwen2.5-0.5b)" --dtype bfloat16 --steps 4 \
        --staleness 0 1 4 --latency 0 0.05 --out "$RES/$GPU-async-qwen2.5-0.5b.json" ;;
    async-short)  # the worker as a thread and as a process of its own, synchronous against staleness 1
      run 240 async-short $PY benchmarks/async_rollout.py --model "$(model qwen2.5-0.5b)" --dtype bfloat16 \
        --steps 4 --staleness 0 1 --latency 0 --worker thread process \
        --out "$RES/$GPU-async-worker-qwen2.5-0.5b.json" ;;
    graph-tests)
      run 150 graph-tests $PY -m pytest -q -m gpu -p no:cacheprovider tests/rollout/test_graph_decode_gpu.py ;;
    decode)
      for s in "${sizes[@]}"; do
        run 200 "decode $s" $PY benchmarks/rollout_overhead.py --model "$(model "$s")" --device cuda \
          --dtype bfloat16 --batch 64 256 --loops episode compiled --turns --repeats 2 --profile --out "$RES" \
          --tag "$GPU-decode-$s" --decode-json "$RES/$GPU-decode.json" --decode-name "$s"
      done ;;
    step-compiled)
      run 200 step-compiled $PY benchmarks/step_time.py --model "$(model qwen2.5-0.5b)" --device cuda \
        --dtype bfloat16 --steps 6 --order compiled episode trl --out "$RES" --tag "$GPU-step_time-compiled-qwen2.5-0.5b" ;;
    prefix)
      for s in "${sizes[@]}"; do
        run 200 "prefix $s" $PY benchmarks/prefix_training.py --shapes instruct-1024 instruct-2048 --size "$s" \
          --layers 0 --device cuda --dtype bfloat16 --repeats 3 --out "$RES/$GPU-prefix_training-$s.json"
      done ;;
    prefix-tests)
      run 200 prefix-tests $PY -m pytest -q -s -m gpu -p no:cacheprovider tests/models/test_prefix_gpu.py
      run 200 prefix-step-tests $PY -m pytest -q -p no:cacheprovider -m numerics tests/models/test_packing.py \
        -k "training_step or slate_step" ;;
    step-alloc)
      PYTORCH_CUDA_ALLOC_CONF= run 120 step-alloc-default $PY benchmarks/step_time.py --model "$(model qwen2.5-0.5b)" --device cuda \
        --dtype bfloat16 --steps 6 --order compiled --out "$RES" --tag "$GPU-step_time-alloc-default-qwen2.5-0.5b"
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run 120 step-alloc-expandable $PY benchmarks/step_time.py \
        --model "$(model qwen2.5-0.5b)" --device cuda --dtype bfloat16 --steps 6 --order compiled --out "$RES" \
        --tag "$GPU-step_time-alloc-expandable-qwen2.5-0.5b" ;;
    prefix-profile)
      for s in "${sizes[@]}"; do
        run 150 "prefix-profile $s" $PY benchmarks/prefix_training.py --shapes instruct-2048 --size "$s" \
          --layers 0 --device cuda --dtype bfloat16 --repeats 3 --breakdown --profile "$RES/profile-$s" \
          --out "$RES/$GPU-prefix_training-breakdown-$s.json"
      done ;;
    *) echo "unknown step $step" | tee -a "$LOG" ;;
  esac
done
cp "$LOG" "$RES/$GPU-log-$(date +%H%M%S).txt"
pack
echo "== done in $(( $(date +%s) - START )) s; results: $(ls "$RES" | tr '\n' ' ')"
