"""The GPU check's results (benchmarks/gpu/run_on_device.sh): one JSON summary and a text table
from the steps' records, each run directory's metrics.jsonl and summary.json, the resumed run's
checkpoint (CUDA RNG state saved per rank) and the learner rows.

    python benchmarks/gpu/summarize.py --runs DIR --steps steps.jsonl --learner learner.json \
        --resumed r2_bf16_resumed --resumed-from r2_bf16 --out summary.json --table table.txt
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from throughput import PHASES  # noqa: E402  (the phase times every benchmark reads)

WARMUP_ITERATIONS = 2  # CUDA context, cuDNN autotuning and the first allocations


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_row(run_dir: Path) -> dict:
    """SPS and phase times: medians over this invocation's iterations after the warm-up ones."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    timed = rows[WARMUP_ITERATIONS:] if len(rows) > WARMUP_ITERATIONS else rows
    out = {"run": run_dir.name, "status": summary.get("status", "unfinished"), "iterations": len(rows),
           "global_step": summary.get("global_step"), "world_size": summary.get("world_size"),
           "parameters_identical": summary.get("parameters_identical"),
           "device": summary.get("topology", {}).get("device"),
           "precision": summary.get("topology", {}).get("precision"),
           "env_counts": rows[-1].get("env_counts") if rows else None}
    if timed:
        out["sps"] = statistics.median(r["sps"] for r in timed)
        for phase in PHASES:
            values = [r[phase] for r in timed if r.get(phase) is not None]
            out[phase] = statistics.median(values) if values else None
    return out


def resume_check(runs: Path, resumed: str, resumed_from: str) -> dict:
    """The resumed run continued the earlier one: its first iteration follows the earlier run's
    last, it ran to its longer total, and its checkpoint holds every rank's CUDA RNG state when
    on a GPU."""
    import torch

    before, after = runs / resumed_from, runs / resumed
    if not (before / "summary.json").exists() or not (after / "summary.json").exists():
        return {"ok": False, "why": "a run of the pair did not finish"}
    first = json.loads((before / "summary.json").read_text())
    second = json.loads((after / "summary.json").read_text())
    new_rows = [r for r in read_jsonl(after / "metrics.jsonl") if r["iteration"] > first["iteration"]]
    rank_files = sorted((after / "checkpoints" / "ranks").glob("rank*.pt"))  # each rank's RNG streams
    cuda_rng = [torch.load(p, map_location="cpu", weights_only=True).get("cuda_rng") for p in rank_files]
    on_gpu = str(second.get("topology", {}).get("device", "")).startswith("cuda")
    out = {"from_step": first["global_step"], "to_step": second["global_step"],
           "continued_at_iteration": new_rows[0]["iteration"] if new_rows else None,
           "parameters_identical": second["parameters_identical"], "on_gpu": on_gpu,
           "cuda_rng_saved": bool(cuda_rng) and all(s is not None for s in cuda_rng)}
    out["ok"] = bool(new_rows and new_rows[0]["iteration"] == first["iteration"] + 1
                     and second["global_step"] > first["global_step"] and second["parameters_identical"]
                     and (out["cuda_rng_saved"] or not on_gpu))
    return out


def table(summary: dict) -> str:
    lines = ["steps:"]
    for s in summary["steps"]:
        lines.append(f"  {s['step']:<24} rc {s['rc']:>3}  {s['seconds']:7.1f} s (limit {s['limit']} s)")
    lines += ["", f"{'run':<18} {'ranks':>5} {'envs':>9} {'prec':>5} {'SPS':>9} {'env s':>7} {'infer s':>7} "
              f"{'update s':>8} {'allred s':>8} {'identical':>9}"]
    for r in summary["runs"]:
        fmt = lambda k: f"{r[k]:.3f}" if r.get(k) is not None else "-"  # noqa: E731
        sps = f"{r['sps']:,.0f}" if r.get("sps") is not None else "-"
        lines.append(f"{r['run']:<18} {r['world_size'] or '-':>5} {str(r['env_counts'] or '-'):>9} "
                     f"{r['precision'] or '-':>5} {sps:>9} {fmt('time_env'):>7} {fmt('time_inference'):>7} "
                     f"{fmt('time_update'):>8} {fmt('time_allreduce'):>8} {str(r['parameters_identical']):>9}")
    rc = summary.get("resume")
    if rc:
        lines += ["", f"resume: {rc}"]
    for name, check in summary.get("compression_resume", {}).items():
        lines.append(f"resume {name}: {check}")
    if summary.get("compression_check"):
        lines.append(f"compression state on the device: {summary['compression_check']}")
    if summary["learner"]:
        lines += ["", "learner alone (samples/s through full PPO updates):"]
        for row in summary["learner"]:
            lines.append(f"  {row['device']} {row['precision']:>4} minibatch {row['minibatch']:>5}: "
                         f"{row['learner_samples_per_s']:>12,.0f}")
    best = max((r.get("sps") or 0 for r in summary["runs"]), default=0)
    lines += ["", f"best global env steps/s: {best:,.0f} (goal on one H200 + 16 cores: 15,000)"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", required=True)
    parser.add_argument("--steps", required=True)
    parser.add_argument("--learner")
    parser.add_argument("--resumed")
    parser.add_argument("--resumed-from")
    parser.add_argument("--compression", help="compression_check.py's output")
    parser.add_argument("--out", required=True)
    parser.add_argument("--table", required=True)
    args = parser.parse_args()
    runs = Path(args.runs)
    summary = {
        "steps": read_jsonl(Path(args.steps)),
        "runs": [run_row(d) for d in sorted(runs.iterdir()) if d.is_dir()] if runs.is_dir() else [],
        "learner": json.loads(Path(args.learner).read_text()) if args.learner and Path(args.learner).exists() else [],
    }
    if args.resumed and (runs / args.resumed).is_dir():
        summary["resume"] = resume_check(runs, args.resumed, args.resumed_from)
    compressed = [d.name[:-len("_resumed")] for d in sorted(runs.glob("c_*_resumed"))] if runs.is_dir() else []
    if compressed:
        summary["compression_resume"] = {name: resume_check(runs, f"{name}_resumed", name) for name in compressed}
    if args.compression and Path(args.compression).exists():
        summary["compression_check"] = json.loads(Path(args.compression).read_text())
    summary["failed_steps"] = [s["step"] for s in summary["steps"] if s["rc"] != 0]
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    Path(args.table).write_text(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
