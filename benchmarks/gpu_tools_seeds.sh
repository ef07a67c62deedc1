#!/usr/bin/env bash
# Issue 48 item 5 on a lent GPU machine: the tool quickstart (experiments/synthetic/grpo_tools.yaml) over
# seeds, several runs at once on one GPU (each run is the whole quickstart: world, tokenizer, SFT warm start,
# GRPO, test evaluation). On this repository's 2-core CPU machine one seed takes about 55 minutes.
#
#   bash benchmarks/gpu_tools_seeds.sh BUDGET_S NAME:SEED[:OVERRIDE,...] ...
#
# e.g. bash benchmarks/gpu_tools_seeds.sh 520 base:1 base:2 b32:0:trainer.batch_size=32
# Each run's directory (results, evaluations, metrics, config; no checkpoints, no weights) comes back
# in $OUT/runs.tgz, packed every 20 s, so a command cut off at its limit still returns what finished. Six runs at
# once on an H100 (16 cores) did not finish in 530 s (SFT about 2.5 minutes, GRPO 7-16 s per step); three at once
# took 360-407 s each (OMP_NUM_THREADS=4), one alone 230 s (OMP_NUM_THREADS=8). Model weights stay behind (the
# archive must stay under the device tool's 16 MiB a file).
set -u
BUDGET=$1; shift
START=$(date +%s)
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
PY=${PY:-python3}
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/pip.txt" 2>&1 || echo "wheel install failed"
fi
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
$PY -c "import torch, transformers; print(torch.__version__, torch.cuda.get_device_name(0), transformers.__version__)" \
  >> "$OUT/gpu.txt" 2>&1
pids=()
for spec in "$@"; do
  IFS=: read -r name seed overrides <<<"$spec"
  dir=/tmp/runs/$name-seed$seed
  mkdir -p "$dir"
  # shellcheck disable=SC2086
  ( t0=$(date +%s)
    timeout -k 5 $((BUDGET - 25)) $PY -m searchrl train experiments/synthetic/grpo_tools.yaml seed="$seed" \
      output_dir="$dir" ${overrides//,/ } > "$dir/log.txt" 2>&1
    echo "rc=$? wall_s=$(( $(date +%s) - t0 ))" >> "$dir/log.txt" ) &
  pids+=($!)
done
pack() {  # one archive: the device tool brings back only a few files per command
  for d in /tmp/runs/*; do tail -c 20000 "$d/log.txt" > "$d/log_tail.txt" 2>/dev/null; done
  tar -czf "$OUT/runs.tgz" -C /tmp/runs --exclude='checkpoints' --exclude='world' --exclude='*.predictions.jsonl' \
    --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' --exclude='log.txt' --exclude='samples' . 2>/dev/null
}
while [ $(( $(date +%s) - START )) -lt $((BUDGET - 10)) ]; do
  alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
  pack; [ $alive = 0 ] && break
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader >> "$OUT/gpu_util.txt" 2>&1
  sleep 20
done
pack
for d in /tmp/runs/*; do echo "$(basename "$d"): $(tail -1 "$d/log.txt")"; done
