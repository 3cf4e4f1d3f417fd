"""tasks.py: the task record and every way to get tasks (what agent.py solves, evaluate.py scores, train.py trains on).

A task is a dict (the Task record below): a KernelBench-format problem `code` (class Model, get_inputs,
get_init_inputs) and where it came from. Loaders, each raising env.UsageError with one readable line:

    load_problem("examples/relu.py")                   # one problem file (agent.py --problem)
    load_bench_dir("KernelBench/KernelBench", ["1"])   # a KernelBench folder: level1/ level2/ ... or flat
    load_hub(["1", "2"])                               # KernelBench from the hub (ScalingIntelligence/KernelBench)
    load_split("data/ops6k", "test")                   # a synth.py dataset (folder or hub id), one split
    load_data("data/ops6k", need_train=True)           # its train and test splits (train.py)

read_dataset() gives the synth.py dataset itself (a datasets.Dataset with FEATURES' columns).
"""
from __future__ import annotations

import ast
import json
import os
import re
import socket
from pathlib import Path
from typing import TypedDict

import datasets
import huggingface_hub

import env

KERNELBENCH_HUB = "ScalingIntelligence/KernelBench"
SYNTH_HUB = "BytedTsinghua-SIA/CUDA-Agent-Ops-6K"  # the paper's published dataset (synth.py's columns, no timings)
PROBLEM_RE = re.compile(r"^(\d+)_(.+)\.py$")  # KernelBench's file names: N_Name.py
REQUIRED_COLUMNS = ("code",)  # what a synthetic split must have; ops / data_source are only reported
# The columns synth.py writes (and read_dataset returns, filling in timings a hub copy lacks)
FEATURES = datasets.Features({"ops": datasets.List(datasets.Value("string")), "data_source": datasets.Value("string"),
                              "code": datasets.Value("string"), "eager_ms": datasets.Value("float64"),
                              "compile_ms": datasets.Value("float64")})


class Task(TypedDict, total=False):
    task_id: str  # unique in a run: "level1/19_ReLU", "test/00042", or a problem file's stem
    code: str  # the KernelBench-format reference module (model.py of the workspace)
    level: str  # KernelBench level "1".."3", or the synthetic task's data_source ("torch#2"...)
    name: str  # file stem or row number: what a solution folder names (evaluate.py --solutions)
    num: int  # problem number (KernelBench) or row index, for sorting
    ops: list  # the operators a synthetic task chains (None elsewhere)


def load_problem(path) -> Task:
    """One KernelBench-format problem file."""
    p = Path(path)
    if not p.is_file():
        raise env.UsageError(f"no such problem file: {p}")
    m = PROBLEM_RE.match(p.name)
    return {"task_id": p.stem, "code": p.read_text(), "level": "1", "name": p.stem, "num": int(m.group(1)) if m else 0}


def parse_levels(levels: str | None) -> list[str] | None:
    """"1,2,3" or "level1,level2" -> ["1", "2", "3"]; None or "" -> None (all levels)."""
    if not levels:
        return None
    out = [s.strip().removeprefix("level") for s in levels.split(",") if s.strip()]
    if not all(s.isdigit() for s in out):
        raise env.UsageError(f"--levels must be comma-separated numbers like 1,2,3, got {levels!r}")
    return out


def load_bench_dir(bench_dir: str, levels: list[str] | None) -> list[Task]:
    """Every N_Name.py of a folder, sorted by level and number. Folders level1/, level2/... give the levels;
    a flat folder is one level (levels [K], default 1)."""
    root = Path(bench_dir)
    if not root.is_dir():
        raise env.UsageError(f"no such bench directory: {bench_dir}")
    sub = {m.group(1): d for d in root.iterdir() if d.is_dir() and (m := re.fullmatch(r"level_?(\d+)", d.name))}
    if sub:
        folders = [(lv, sub[lv]) for lv in sorted(sub, key=int) if levels is None or lv in levels]
    else:
        if levels and len(levels) > 1:
            raise env.UsageError(f"{bench_dir} has no level1/ level2/ ... subfolders, so it is one level: pass a single --levels")
        folders = [(levels[0] if levels else "1", root)]
    tasks = []
    for lv, d in folders:
        for f in d.iterdir():
            m = PROBLEM_RE.match(f.name)
            if m and f.is_file():
                tasks.append({"task_id": f"level{lv}/{f.stem}", "level": lv, "name": f.stem, "num": int(m.group(1)),
                              "code": f.read_text()})
    if not tasks:
        want = f" for levels {','.join(levels)}" if levels else ""
        raise env.UsageError(f"no KernelBench-format problems (N_Name.py) in {bench_dir}{want}")
    return sorted(tasks, key=lambda t: (int(t["level"]), t["num"], t["name"]))


def hub_reachable(host="huggingface.co", timeout=3.0) -> bool:
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_hub(levels: list[str] | None) -> list[Task]:
    """The public KernelBench dataset (splits level_1...; columns code, level, name, problem_id). Offline, only a
    copy already in the datasets cache works (checked first, so an offline machine fails in seconds)."""
    if not hub_reachable():  # the local cache only, no retries (both libraries read the switch at import: set it live too)
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
        datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        tasks = []
        for lv in levels or ["1", "2", "3"]:
            for row in datasets.load_dataset(KERNELBENCH_HUB, split=f"level_{lv}"):
                name = Path(str(row["name"])).stem
                tasks.append({"task_id": f"level{lv}/{name}", "level": lv, "name": name, "num": int(row["problem_id"]),
                              "code": row["code"]})
    except Exception as e:  # noqa: BLE001 - offline, no such split, hub down: one line, not a traceback
        why = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        offline = " (this machine cannot reach huggingface.co)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
        raise env.UsageError(f"cannot load {KERNELBENCH_HUB} from the hub{offline}: {why}. "
                             "Pass --bench-dir with a local copy (KernelBench/KernelBench has level1/ level2/ level3/)")
    return sorted(tasks, key=lambda t: (int(t["level"]), t["num"]))


def read_dataset(path_or_hub_id: str, split: str = "train") -> datasets.Dataset:
    """A `datasets.Dataset` of synthetic tasks (FEATURES' columns) from a synth.py output folder or from the hub
    (e.g. SYNTH_HUB, needs network; it has one split, so "test" is a fixed 5% of it)."""
    p = Path(path_or_hub_id)
    if p.exists():
        if not (p / "dataset_dict.json").exists():
            raise env.UsageError(f"{p} is not a synth.py output (no dataset_dict.json)")
        dd = datasets.load_from_disk(str(p))
        if split not in dd and split in ("train", "test"):  # saved without rows (synth.save leaves empty splits out)
            return datasets.Dataset.from_dict({k: [] for k in FEATURES}, features=FEATURES)
        if split not in dd:
            raise env.UsageError(f"{p} has no split {split!r} (has {', '.join(dd)})")
        return dd[split]
    try:
        dd = datasets.load_dataset(path_or_hub_id)
    except Exception as e:  # noqa: BLE001
        raise env.UsageError(f"cannot load {path_or_hub_id!r}: not a folder, and the hub failed ({type(e).__name__})")
    if split not in dd:
        parts = dd["train"].train_test_split(test_size=0.05, seed=0)
        dd = {"train": parts["train"], "test": parts["test"]}
        if split not in dd:
            raise env.UsageError(f"{path_or_hub_id} has no split {split!r}")
    ds = dd[split]
    if "ops" in ds.column_names and ds.features["ops"].dtype == "string":  # a list stored as text
        ds = ds.map(lambda r: {"ops": list(ast.literal_eval(r["ops"])) if r["ops"].startswith("[") else [r["ops"]]})
    for col in ("eager_ms", "compile_ms"):
        if col not in ds.column_names:
            ds = ds.add_column(col, [None] * len(ds))
    return ds


def load_split(src: str, split: str) -> list[Task]:
    """The tasks of one split of a synth.py dataset (folder or hub id); a missing column is a one-line error."""
    state = Path(src) / split / "state.json"
    if state.is_file() and not json.loads(state.read_text()).get("_data_files"):
        return []  # a saved split with no rows (datasets cannot even load those back)
    ds = read_dataset(src, split)
    cols = list(ds.column_names)
    missing = [c for c in REQUIRED_COLUMNS if c not in cols]
    if missing:
        raise env.UsageError(f"dataset {src} is missing column(s) {', '.join(missing)} in split {split!r} "
                             f"(has: {', '.join(cols) or 'none'}; tasks need: {', '.join(REQUIRED_COLUMNS)})")
    return [{"task_id": str(r.get("task_id") or f"{split}/{i:05d}"), "level": str(r.get("data_source") or "synth"),
             "name": str(r.get("task_id") or f"{i:05d}"), "num": i, "code": r["code"], "ops": r.get("ops")}
            for i, r in enumerate(ds)]


def load_data(src: str, need_train: bool) -> tuple[list[Task], list[Task]]:
    """(train, test) tasks of a synth.py dataset; a dataset without a test split gives test = []."""
    train = load_split(src, "train")
    try:
        test = load_split(src, "test")
    except env.UsageError as e:
        if "no split" not in str(e):
            raise
        test = []
    if need_train and not train:
        raise env.UsageError(f"dataset {src} is empty: no tasks in its train split")
    return train, test
