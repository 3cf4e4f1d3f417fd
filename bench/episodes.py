"""What each recorded episode did, one line per episode: the task's ops, the reward, how it ended, its tool calls
(ok or not) and the final verdict's error. The held-out rows of docs/results.md say *how many* pass; this says
*where the rest went wrong*.

    python bench/episodes.py RUN/eval/sft/rank0.jsonl                 # one line per episode
    python bench/episodes.py RUN/eval/sft/rank0.jsonl --text 400      # + the model's first turn, decoded (400 chars)
    python bench/episodes.py RUN/eval/*/rank0.jsonl --failed          # only those below +1

Files: train.py's eval/STAGE/rank*.jsonl, sft/teacher/rank*/chunk-*/trajectories.jsonl, or any agent.py --out file.
--text decodes the episode's tokens with the embedded model's tokenizer (or --tokenizer, a folder or GGUF's model).
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def one_line(ep: dict) -> str:
    v = ep.get("verdict") or {}
    calls = " ".join(f"{t.get('tool') or '(malformed)'}{'' if t.get('ok') else '!'}" for t in ep.get("turns", []))
    err = (v.get("error") or "").strip().splitlines()
    what = "correct" if v.get("correct") else "built" if v.get("compiled") else "not built"
    speed = f" {v['speedup_eager']:.2f}x eager" if v.get("correct") and v.get("speedup_eager") else ""
    return (f"{ep.get('task_id')} | {' -> '.join(ep.get('ops') or [])} | reward {ep.get('reward'):+d} | {what}{speed} | "
            f"end {ep.get('end_reason')} | calls: {calls or '-'}" + (f" | error: {err[0][:160]}" if err else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="episode JSONL files")
    p.add_argument("--failed", action="store_true", help="only episodes whose reward is below +1")
    p.add_argument("--text", type=int, default=0, metavar="CHARS", help="also print the first turn's text, decoded")
    p.add_argument("--tokenizer", help="for --text: a tokenizer folder (default: the embedded model's)")
    a = p.parse_args(argv)
    tok = None
    if a.text:
        if a.tokenizer:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(a.tokenizer)
        else:
            import agent
            tok = agent.embedded_tokenizer()
    for f in a.files:
        path = Path(f)
        if not path.is_file():
            print(f"episodes.py: error: no such file {f}", file=sys.stderr)
            return 2
        eps = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        shown = [e for e in eps if not a.failed or e.get("reward", -1) < 1]
        print(f"== {f}: {len(eps)} episodes, {sum(e.get('reward', -1) >= 1 for e in eps)} pass")
        for ep in shown:
            print(one_line(ep))
            turns = ep.get("turns") or []
            if tok is not None and turns:
                first = tok.decode(ep["tokens"][turns[0]["start"]:turns[0]["end"]], skip_special_tokens=False)
                print("    " + first[:a.text].replace("\n", "\n    "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
