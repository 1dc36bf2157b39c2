"""Gradient compression on slow links: weak scaling of the Atari preset on 2 simulated nodes.

    sudo .venv/bin/python benchmarks/compression.py --out benchmarks/results/compression

slurm/sim_cluster.sh starts 2 nodes (network namespaces, a slurmd each, MPI over TCP between
them; `rate` shapes every node's link with tc tbf). For each link rate and each
`distributed.compression`, one rank per node runs the Atari preset (`srun -N2 --mpi=pmix`, one CPU
thread per rank, as the multi-node study did) and is compared with one rank alone on one node
without compression, measured in the same round: weak-scaling efficiency = SPS(2 nodes) /
(2 x SPS(1 rank)), the 1-rank SPS being the mean of two runs that bracket each link's group of
2-node runs. Rounds rotate the order of the links and of the compressions, so machine drift hits
every setting alike; the table gives medians over rounds and the spread. The 2 nodes share this
machine's 2 cores, so each simulated node is given one core: every rank is pinned (taskset) to
core SLURM_NODEID, the lone rank of the baseline included. Without pinning the lone rank spreads
its Horovod thread and the OS's work over both cores while each 2-node rank has one, and the
unlimited link's efficiency (the machine's ceiling) fell to 0.72 (--no-pin reproduces that). The
efficiency still includes what the hardware's own 2-core efficiency costs
(benchmarks/results/throughput/: ~0.96-0.98).

Output: OUT/compression.json (rows with link, compression, round, efficiency, sps, comm_bytes,
compression_ratio, time_compress, time_allreduce, time_wait, and the runs' settings) and
OUT/compression.md (the table).
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "slurm" / "sim_cluster.sh"
BIN = REPO / ".venv" / "bin"
sys.path.insert(0, str(REPO))
from hvd_rl.analysis import projection as P  # noqa: E402
LINKS = {"unlimited": "off", "1gbit": "1gbit", "100mbit": "100mbit"}
COMPRESSIONS = ("none", "fp16", "topk", "powersgd")


def cluster(*args: str, env: dict | None = None) -> str:
    return subprocess.run([str(CLUSTER), *args], check=True, capture_output=True, text=True, env=env).stdout


def cluster_env() -> dict[str, str]:
    env = dict(os.environ)
    for line in cluster("env").splitlines():
        if line.startswith("export "):
            key, value = line[len("export "):].split("=", 1)
            env[key] = value.replace("${PATH}", env.get("PATH", ""))
    env.update({"PATH": f"{BIN}:{env['PATH']}", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "PYTHONUNBUFFERED": "1"})
    return env


def run_point(args, env: dict, run_dir: Path, nodes: int, compression: str) -> dict:
    """One training run (1 warm-up + args.iterations measured iterations); its measured rows."""
    per_iteration = nodes * args.envs * 128
    sets = [f"env.num_envs={args.envs}", f"ppo.total_timesteps={(1 + args.iterations) * per_iteration}",
            f"distributed.compression={compression}", f"distributed.powersgd_rank={args.powersgd_rank}",
            f"distributed.topk_ratio={args.topk_ratio}", "distributed.threads_per_rank=1",
            "checkpoint.every=0", "logging.tensorboard=false", "logging.console=false"]
    # One core per simulated node: the rank on node k (SLURM_NODEID) runs on core k.
    pin = [] if args.no_pin else ["bash", "-c", f'exec taskset -c $((SLURM_NODEID % {os.cpu_count()})) "$@"', "pin"]
    cmd = ["srun", f"-N{nodes}", "--ntasks-per-node=1", "--cpus-per-task=1", "--mpi=pmix",
           *(["-w", "node1"] if nodes == 1 else []), *pin, str(BIN / "hvd-rl"), "train",
           "--config", args.config, "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{nodes} node(s), {compression}: exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    wall = sum(r["time_iteration"] for r in rows)
    mean = lambda key: statistics.mean(r[key] for r in rows)  # noqa: E731
    return {"sps": per_iteration * len(rows) / wall, "comm_bytes": mean("comm_bytes"),
            "compression_ratio": mean("compression_ratio"), "time_compress": mean("time_compress"),
            "time_allreduce": mean("time_allreduce"), "time_wait": mean("time_wait"),
            "time_iteration": mean("time_iteration")}


def table(rows: list[dict], links: list[str], compressions: list[str]) -> list[str]:
    """Medians over rounds. 'vs unlimited' divides by the same compression's efficiency on unlimited
    links in the same round: what the link costs, apart from what the machine itself loses."""
    lines = ["| link | compression | weak-scaling efficiency (median) | range over rounds | vs unlimited link | "
             "SPS (2 nodes) | MiB sent per rank and iteration | compression ratio | compress s/iteration | "
             "allreduce s/iteration |", "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    unlimited = {(r["compression"], r["round"]): r["efficiency"] for r in rows if r["link"] == "unlimited"}
    for link in links:
        for compression in compressions:
            mine = [r for r in rows if r["link"] == link and r["compression"] == compression]
            if not mine:
                continue
            med = lambda key: statistics.median(r[key] for r in mine)  # noqa: E731
            eff = [r["efficiency"] for r in mine]
            relative = [r["efficiency"] / unlimited[compression, r["round"]] for r in mine
                        if (compression, r["round"]) in unlimited]
            lines.append(f"| {link} | {compression} | **{med('efficiency'):.2f}** | {min(eff):.2f}-{max(eff):.2f} | "
                         f"{statistics.median(relative) if relative else float('nan'):.2f} | {med('sps'):.0f} | "
                         f"{med('comm_bytes') / 2**20:.2f} | {med('compression_ratio'):.0f} | "
                         f"{med('time_compress'):.3f} | {med('time_allreduce'):.3f} |")
    return lines


PROJECTED_RANKS = (2, 8, 64, 1024)


def projection_lines(rows: list[dict], settings: dict, fits: dict, fits_name: str) -> list[str]:
    """Weak scaling projected to 1024 ranks (one rank per node) per link and compression: each
    compression's measured work per iteration (compute and compression compute: everything but
    the allreduces and the waiting) and bytes, on the exchange fitted over 2, 4 and 8 nodes by
    compression_allreduce.py (OUT/allreduce-nodes/exchange_fits.json), with the fit's 95% interval;
    beside it the ring, and the first projection's 2-node model (alpha = 0)."""
    from hvd_rl.config import load_config

    cfg = load_config(REPO / settings["config"], [])
    rounds = cfg.ppo.update_epochs * cfg.ppo.num_minibatches
    lines = ["## Projection to 1024 ranks", "",
             f"One rank per node; per iteration each rank computes what it measured here (the median over rounds of "
             f"time_iteration - time_allreduce - time_wait, compression compute included) and makes {rounds} gradient "
             "reductions of the bytes it measured, each costing what the link's and compression's exchange fitted "
             f"over 2, 4 and 8 simulated nodes predicts ([fits, with every point's residual]({fits_name})): "
             "c + alpha per step + bytes / B, with Open MPI 4.1's default algorithm at each rank count (at 1024 ranks "
             "Rabenseifner, 2 log2 n steps, for all but PowerSGD's 15.5 KiB P factors, which go by recursive "
             "doubling). Brackets: the 95% interval from the fit's covariance (the parameters' uncertainty; the "
             "extrapolation from 8 ranks is not in it). Efficiency is against the lone uncompressed rank, as measured "
             "above, so a compression's own compute counts as a loss; the '2 measured' column is this run's.", "",
             "**Read with care**: the fitted alpha (milliseconds per step) is mostly this machine's, not the "
             "link's: 8 simulated nodes share 2 cores, and the time per step grows as much on unlimited links. The "
             "projection carries that cost to 1024 ranks, so it is a pessimistic end; the last column, the first "
             "projection's model fitted on 2 nodes alone (alpha = 0, ring), is the optimistic one, and it "
             "underpredicted PowerSGD's measured reduction at 8 nodes 3.5x at 1 Gbit/s "
             "(`allreduce-nodes/compression_allreduce.md`). Where the fit's alpha is below 0 (none and fp16 at "
             "100 Mbit/s: their time grows less than the steps would have it) the ring is not projected.", "",
             "| link | compression | 2 measured | " + " | ".join(f"{n} projected (95%)" for n in PROJECTED_RANKS)
             + " | 1024, ring | 1024, 2-node model (alpha = 0) |",
             "|---|---|---:|" + "---:|" * len(PROJECTED_RANKS) + "---:|---:|"]
    old_models = {link: P.CostModel(f["overhead_s"], f["latency_s"], f["bandwidth_Bps"])
                  for link, f in fits.get("two_node", {}).items()}
    for link, by_compression in fits["exchanges"].items():
        for compression in COMPRESSIONS:
            mine = [r for r in rows if r["link"] == link and r["compression"] == compression]
            if not mine or compression not in by_compression:
                continue
            exchange = by_compression[compression]
            fit = P.ExchangeFit(exchange["overhead_s"], exchange["latency_s"], exchange["bandwidth_Bps"],
                                tuple(tuple(r) for r in exchange["covariance"]), exchange["dof"], (), 0.0)
            compute = statistics.median(r["time_iteration"] - r["time_allreduce"] - r["time_wait"] for r in mine)
            sent = statistics.median(r["comm_bytes"] for r in mine) / rounds
            if abs(sent - sum(exchange["call_bytes"])) > 0.01 * sent:
                raise SystemExit(f"compression.py: {link} {compression}: {sent:.0f} B per reduction in training, "
                                 f"{sum(exchange['call_bytes']):.0f} B in the fitted benchmark")
            workload = P.Workload(compute_s=compute, gradient_bytes=sent, gradient_rounds=rounds,
                                  compression=compression, call_bytes=tuple(exchange["call_bytes"]))
            # against the lone uncompressed rank, as the measured efficiency is
            alone_s = statistics.median(settings["envs_per_rank"] * 128 / statistics.mean(r["sps_1rank"]) for r in mine)
            cells = []
            for n in PROJECTED_RANKS:
                point, low, high = workload.projected_efficiency(fit, n, alone_s)
                cells.append(f"{point:.2f} ({low:.2f}-{high:.2f})")
            ring, ring_low, ring_high = workload.projected_efficiency(fit, PROJECTED_RANKS[-1], alone_s, "ring")
            ring_cell = f"{ring:.2f} ({ring_low:.2f}-{ring_high:.2f})"
            if fit.latency_s < 0:  # a falling cost per step: 2(n-1) of them reach below zero
                ring_cell = "- (alpha < 0)"
            old = old_models.get(link)
            old_cell = f"{alone_s / workload.iteration_s(old, PROJECTED_RANKS[-1]):.2f}" if old else "-"
            lines.append(f"| {link} | {compression} | {statistics.median(r['efficiency'] for r in mine):.2f} | "
                         + " | ".join(cells) + f" | {ring_cell} | {old_cell} |")
    return lines + [""]


def write_report(out: Path) -> None:
    """OUT/compression.md from OUT/compression.json (and the projection, where
    OUT/allreduce-nodes/compression_allreduce.json has the links' fits)."""
    data = json.loads((out / "compression.json").read_text())
    settings, rows = data["settings"], data["rows"]
    links = [link for link in LINKS if any(r["link"] == link for r in rows)]
    compressions = [c for c in COMPRESSIONS if any(r["compression"] == c for r in rows)]
    fits_file = out / "allreduce-nodes" / "exchange_fits.json"  # compression_allreduce.py --report-only
    two_node_file = out / "allreduce-nodes" / "compression_allreduce.json"
    fits = {"exchanges": json.loads(fits_file.read_text()) if fits_file.exists() else {},
            "two_node": json.loads(two_node_file.read_text())["fits"] if two_node_file.exists() else {}}
    lines = ["# Gradient compression on slow links: 2 simulated nodes x 1 rank, Atari preset", "",
             f"Weak-scaling efficiency = SPS of 1 rank on each of 2 simulated nodes / (2 x SPS of 1 rank alone, "
             f"uncompressed, in runs bracketing each link's group). {settings['envs_per_rank']} envs x 128 steps per rank and iteration, 1 CPU "
             f"thread per rank, {settings['iterations']} measured iterations after 1 warm-up, {settings['rounds']} "
             f"rounds in rotated order; PowerSGD rank {settings['powersgd_rank']}, top-k ratio "
             f"{settings['topk_ratio']}. The 2 nodes share the machine's 2 cores"
             + (": each node's rank, and the lone rank, pinned to a core of its own." if settings.get("pinned") else
                ", the ranks not pinned (the lone rank of the baseline could use both).")
             + " Nothing else ran on the machine.", "",
             f"Command: `{settings['command']}` ({settings['seconds']} s)", "",
             *table(rows, links, compressions), ""]
    if fits["exchanges"]:
        fits["exchanges"] = {link: fit for link, fit in fits["exchanges"].items() if link in links}
        lines += projection_lines(rows, settings, fits, "allreduce-nodes/compression_allreduce.md")
    (out / "compression.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default="configs/atari_ppo.toml")
    parser.add_argument("--links", nargs="+", default=list(LINKS), choices=list(LINKS))
    parser.add_argument("--compressions", nargs="+", default=list(COMPRESSIONS), choices=list(COMPRESSIONS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=3, help="measured iterations per run (after 1 warm-up)")
    parser.add_argument("--envs", type=int, default=8, help="environments per rank")
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--topk-ratio", type=float, default=0.01)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--no-pin", action="store_true", help="do not pin each node's rank to a core of its own")
    parser.add_argument("--report-only", action="store_true", help="rewrite OUT/compression.md from its json")
    args = parser.parse_args()
    if args.report_only:
        write_report(Path(args.out))
        return 0
    if not args.no_pin and not shutil.which("taskset"):
        print("benchmarks/compression.py: taskset (util-linux) is needed to pin ranks (or pass --no-pin)", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("benchmarks/compression.py: needs root (network namespaces, tc)", file=sys.stderr)
        return 2
    problem = subprocess.run([str(CLUSTER), "check"], capture_output=True, text=True)
    if problem.returncode != 0:
        print(f"benchmarks/compression.py: simulated cluster unavailable: {problem.stdout.strip()}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    started = time.time()
    cluster("start", "2")
    try:
        env = cluster_env()
        with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
            for index in range(args.rounds):
                # Links in rotated order; per link, the compressions in rotated order between two
                # runs of 1 rank alone (their mean is the baseline), so drift within minutes cancels.
                links = args.links[index % len(args.links):] + args.links[:index % len(args.links)]
                for link in links:
                    singles = [run_point(args, env, Path(tmp) / f"single-{link}-{index}-a", 1, "none")["sps"]]
                    cluster("rate", LINKS[link])
                    shift = index % len(args.compressions)
                    points = {}
                    for compression in args.compressions[shift:] + args.compressions[:shift]:
                        points[compression] = run_point(args, env, Path(tmp) / f"{link}-{compression}-{index}", 2,
                                                        compression)
                    cluster("rate", "off")
                    singles.append(run_point(args, env, Path(tmp) / f"single-{link}-{index}-b", 1, "none")["sps"])
                    baseline = statistics.mean(singles)
                    for compression, point in points.items():
                        row = {"link": link, "compression": compression, "round": index + 1,
                               "efficiency": point["sps"] / (2 * baseline), "sps_1rank": singles, **point}
                        rows.append(row)
                        print(f"round {index + 1}: {link:9s} {compression:8s} efficiency {row['efficiency']:.2f}, "
                              f"{point['sps']:.0f} SPS, {point['comm_bytes'] / 2**20:.2f} MiB/iteration "
                              f"(1 rank alone {singles[0]:.0f}/{singles[1]:.0f} SPS)", flush=True)
    finally:
        subprocess.run([str(CLUSTER), "stop"], capture_output=True)
    settings = {"config": args.config, "envs_per_rank": args.envs, "iterations": args.iterations,
                "rounds": args.rounds, "powersgd_rank": args.powersgd_rank, "topk_ratio": args.topk_ratio,
                "threads_per_rank": 1, "pinned": not args.no_pin, "machine": f"{os.uname().nodename}, {os.cpu_count()} cores",
                "seconds": round(time.time() - started),
                "command": "sudo .venv/bin/python benchmarks/compression.py " + " ".join(sys.argv[1:])}
    (out / "compression.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1) + "\n")
    write_report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
