#!/usr/bin/env bash
# Every GPU figure in the README, in one call on one H200 (about 8 minutes), each step with its own time limit.
#   bash bench/run_h200.sh [OUT_DIR]
# Missing wheels (datasets, gguf, trl and their needs) may be carried in .whl/ (see README, "GPU runs").
set -u
OUT=${1:-${OUT:-/tmp/h200}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_AGENT_CACHE=${CUDA_AGENT_CACHE:-/tmp/cuda-agent-mini-cache}
if [ -d .whl ]; then
  python3 -c "import pyarrow, sys; sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)" 2>/dev/null || keep=pyarrow
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v "pyarrow" ) ${keep:+$(ls .whl/pyarrow*.whl)} && export PYTHONPATH=/tmp/site
fi
step() { local limit=$1 name=$2; shift 2; echo "=== $name (limit ${limit}s)"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "exit $?"; tail -n 30 "$OUT/$name.log"; }
step 170 rollout python3 bench/rollout_bench.py --device cuda --configs dynamic,static,ours,ours-compile --new-tokens 128 --warmup-tokens 16 --json "$OUT/rollout.json"
step 100 evaluate_cuda bash -c 'for s in solutions_cuda solutions_cuda_bad; do python3 evaluate.py --solutions tests/fixtures_bench/$s --bench-dir tests/fixtures_bench/bench --backend cuda --out '"$OUT"'/$s --json; done'
step 130 train_bench python3 bench/train_bench.py --device cuda --models random-135m,random-1.4b --no-split --batch 8 --prompt-len 512 --response-len 512 --repeats 1
step 80 synth_bench python3 bench/synth_bench.py --backend cuda --num-tasks 60 --workers 8
