"""Load balancing against a real straggler: off, static and dynamic, measured in one run.

    python benchmarks/balance.py --out benchmarks/results/balance

Two ranks of the Atari preset (16 environments in all, 2048 env steps per iteration), launched as
`make train` does (mpirun binds rank r to core r). Scenarios, each run with the load balancer off
(every rank keeps 8 environments), `distributed.balance = static` (one decision, after the first
window) and `dynamic` (a decision after every window):
  straggler  a busy loop pinned to rank 1's core: rank 1 gets about half a core (a real CPU
             competitor, not a sleep in the trainer)
  balanced   nothing else running: the balancer must cost nothing
The order of the runs rotates from round to round, so machine drift hits every mode alike. The
report gives throughput (all iterations after the first, and after the balancer's last change),
each rank's busy and waiting time, how many iterations the balancer needed, and per-rank plots
of the imbalance before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import REPO, VENV_BIN, repo_relative  # noqa: E402

sys.path.insert(0, str(REPO))
from hvd_rl.cluster.launch import mpi_env  # noqa: E402
from hvd_rl.runtime.metrics import read_jsonl  # noqa: E402
from hvd_rl.analysis.report import plot_rank_timeline  # noqa: E402

MODES = ("off", "static", "dynamic")


def start_straggler(cpu: int) -> subprocess.Popen:
    """A busy loop pinned to `cpu`: the rank bound there gets about half of its core."""
    return subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c", "while True: pass"])


def run_once(args, mode: str, run_dir: Path) -> dict:
    total = args.iterations * 2 * args.envs * 128
    cmd = [shutil.which("mpirun") or "mpirun", "-np", "2", "--oversubscribe", str(VENV_BIN / "hvd-rl"), "train",
           "--config", args.config, "--run-dir", str(run_dir), "--set", f"env.num_envs={args.envs}",
           "--set", f"ppo.total_timesteps={total}", "--set", f"distributed.balance={mode}",
           "--set", f"distributed.balance_every={args.every}", "--set", "checkpoint.every=0",
           "--set", "logging.tensorboard=false", "--set", "logging.console=false"]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    decisions = read_jsonl(run_dir / "balance.jsonl")
    measured = rows[1:]
    settled_from = (decisions[-1]["iteration"] + 1) if decisions else 1
    settled = [r for r in rows if r["iteration"] > settled_from] or measured

    def sps(part):
        return sum(2 * args.envs * 128 for _ in part) / sum(r["time_iteration"] for r in part)

    def per_rank(key, part):
        return [statistics.mean(r[key][i] for r in part) for i in range(2)]

    return {"mode": mode, "sps": sps(measured), "sps_settled": sps(settled),
            "settled_after_iteration": settled_from if decisions else None,
            "decisions": decisions, "final_env_counts": rows[-1]["env_counts"],
            "busy_by_rank": per_rank("time_busy_by_rank", measured),
            "wait_by_rank": per_rank("time_wait_by_rank", measured),
            "wait_by_rank_settled": per_rank("time_wait_by_rank", settled),
            "cpu_util_by_rank": per_rank("cpu_util_by_rank", measured), "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/atari_ppo.toml")
    parser.add_argument("--envs", type=int, default=8, help="environments per rank before balancing")
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--every", type=int, default=3, help="distributed.balance_every")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.chdir(REPO)
    args.config = repo_relative(args.config)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or not shutil.which("taskset"):
        print("needs 2 CPUs and taskset (util-linux)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = [(s, m) for s in ("straggler", "balanced") for m in MODES]
    results: dict[str, list[dict]] = {f"{s}/{m}": [] for s, m in plan}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            for scenario, mode in plan[index % len(plan):] + plan[:index % len(plan)]:
                hog = start_straggler(cpus[1]) if scenario == "straggler" else None
                try:
                    result = run_once(args, mode, Path(tmp) / f"{scenario}-{mode}-{index}")
                finally:
                    if hog is not None:
                        hog.kill()
                        hog.wait()
                results[f"{scenario}/{mode}"].append(result)
                print(f"round {index + 1}: {scenario:9s} balance={mode:7s} {result['sps']:6.0f} SPS "
                      f"(settled {result['sps_settled']:.0f}), envs {result['final_env_counts']}, wait/rank "
                      f"{'/'.join(f'{w:.2f}' for w in result['wait_by_rank'])} s", flush=True)
                if index == 0 and scenario == "straggler":
                    plot_rank_timeline(result["rows"], out / f"ranks-straggler-{mode}.png",
                                       f"Rank 1 on half a core, balance = {mode}")

    def ratio(scenario: str, mode: str, base: str, key: str = "sps") -> float:
        """Median over rounds of mode / base, each round's pair measured side by side."""
        return statistics.median(m[key] / b[key] for b, m in zip(results[f"{scenario}/{base}"],
                                                                 results[f"{scenario}/{mode}"]))

    summary = {f"{scenario}_{mode}_over_{base}{'_settled' if key == 'sps_settled' else ''}":
               ratio(scenario, mode, base, key)
               for scenario in ("straggler", "balanced") for mode, base in (("dynamic", "static"), ("dynamic", "off"),
                                                                          ("static", "off"))
               for key in (("sps", "sps_settled") if scenario == "straggler" else ("sps",))}
    lines = ["# Load balancing against a real straggler", "",
             f"2 ranks of `{args.config}` ({args.envs} envs per rank to start, 16 in all, 2048 env steps per "
             f"iteration), `mpirun -np 2 --oversubscribe` (rank r bound to core r), {args.iterations} "
             f"iterations per run, `distributed.balance_every = {args.every}`, {args.rounds} rounds with the "
             "order rotating. Straggler: a busy loop pinned to rank 1's core (about half a core left). "
             "Throughput over every iteration after the first (the balancer's learning period included), "
             "and settled: after its last change. Nothing else CPU-heavy ran on the machine.", "",
             f"Command: `python benchmarks/balance.py {' '.join(sys.argv[1:])}`", "",
             "| scenario | balance | SPS (median) | settled SPS | final envs per rank | busy s/it rank 0/1 | "
             "wait s/it rank 0/1 | decided after iteration |", "|---|---|---:|---:|---|---|---|---|"]
    for key, runs in results.items():
        scenario, mode = key.split("/")

        def med(get, runs=runs):
            return statistics.median(get(r) for r in runs)

        busy = "/".join(f"{med(lambda r, i=i: r['busy_by_rank'][i]):.2f}" for i in range(2))
        wait = "/".join(f"{med(lambda r, i=i: r['wait_by_rank'][i]):.2f}" for i in range(2))
        counts = " / ".join(str(r["final_env_counts"]) for r in runs)
        settled = ", ".join(str(r["settled_after_iteration"]) for r in runs)
        lines.append(f"| {scenario} | {mode} | {med(lambda r: r['sps']):.0f} | {med(lambda r: r['sps_settled']):.0f} | "
                     f"{counts} | {busy} | {wait} | {settled} |")
    lines += [""] + [f"- {scenario}: {mode} / {base} = **{summary[f'{scenario}_{mode}_over_{base}']:.2f}x**"
                     + (f" (settled {summary[f'{scenario}_{mode}_over_{base}_settled']:.2f}x)" if scenario == "straggler" else "")
                     for scenario in ("straggler", "balanced")
                     for mode, base in (("dynamic", "static"), ("dynamic", "off"), ("static", "off"))]
    lines += ["", "![off](ranks-straggler-off.png)", "", "![static](ranks-straggler-static.png)", "",
              "![dynamic](ranks-straggler-dynamic.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    for runs in results.values():
        for r in runs:
            r.pop("rows")
    (out / "balance.json").write_text(json.dumps({"command": "python benchmarks/balance.py " + " ".join(sys.argv[1:]),
                                                  "summary": summary, "results": results}, indent=1) + "\n")
    print("\n".join(line for line in lines if line.startswith("- ")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
