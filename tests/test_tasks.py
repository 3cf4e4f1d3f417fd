"""tasks.py: the task record from each source (problem file, KernelBench folder, synth.py dataset) and one-line
errors for bad sources. CPU, seconds."""
from pathlib import Path

import datasets
import pytest

import env
import tasks

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tests" / "fixtures_bench" / "bench"


def test_problem_file_and_kernelbench_folder():
    t = tasks.load_problem(ROOT / "examples" / "relu.py")
    assert t["task_id"] == "relu" and "class Model" in t["code"]
    with pytest.raises(env.UsageError, match="no such problem file"):
        tasks.load_problem(ROOT / "examples" / "nope.py")
    two = tasks.load_bench_dir(str(BENCH), tasks.parse_levels("level2"))
    assert two and all(t["level"] == "2" and t["task_id"] == f"level2/{t['name']}" for t in two)
    every = tasks.load_bench_dir(str(BENCH), None)
    assert [(t["level"], t["num"]) for t in every] == sorted((t["level"], t["num"]) for t in every) and len(every) > len(two)
    with pytest.raises(env.UsageError, match="comma-separated"):
        tasks.parse_levels("one")


def test_synth_dataset_splits_and_missing_columns(tmp_path):
    code = (ROOT / "examples" / "relu.py").read_text()
    row = {"ops": [["torch.relu"]], "data_source": ["torch#1"], "code": [code], "eager_ms": [1.0], "compile_ms": [2.0]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(row, features=tasks.FEATURES)}).save_to_disk(tmp_path / "ds")
    train, test = tasks.load_data(str(tmp_path / "ds"), need_train=True)
    assert test == [] and train == [{"task_id": "train/00000", "level": "torch#1", "name": "00000", "num": 0,
                                     "code": code, "ops": ["torch.relu"]}]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"ops": [["x"]]})}).save_to_disk(tmp_path / "nocode")
    with pytest.raises(env.UsageError, match=r"missing column\(s\) code"):
        tasks.load_split(str(tmp_path / "nocode"), "train")
    with pytest.raises(env.UsageError, match="not a synth.py output"):
        tasks.load_split(str(tmp_path), "train")
