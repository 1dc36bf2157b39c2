"""Check the projection model on more than one point per interconnect: the Nature CNN gradient
reduced by each compression on 2, 4 and 8 simulated nodes of 1 rank.

    sudo .venv/bin/python benchmarks/compression_allreduce.py --out benchmarks/results/compression/allreduce-nodes

slurm/sim_cluster.sh starts 8 nodes (network namespaces, a slurmd each, MPI over TCP). A 2-rank
allreduce sweep on one node gives the model's per-collective constant c; for each link rate, a
sweep across 2 nodes gives the link's alpha and bandwidth (hvd_rl.analysis.projection.fit_allreduce /
cost_model, as the scaling report builds its model). benchmarks/allreduce.py --compressions then
reduces the real gradient on 2, 4 and 8 nodes with none, fp16, topk and powersgd, and each
measured time stands beside the model's prediction: the model's communication time for the bytes
that compression sends (projection.Workload, one gradient round) plus the compression compute
measured on 2 nodes. A second prediction adds the compute measured at that node count instead:
the gap between the two is what oversubscription costs, since 8 single-rank nodes still share this
machine's 2 cores (the cpu_busy column: the ranks' CPU seconds over wall seconds x cores).

The report then fits each link's and compression's exchange to ALL its node counts
(projection.fit_exchange: overhead c, latency alpha per Open MPI step and bandwidth B, the link's
2-node size sweep pinning B), shows every measured point's residual, and projects one gradient
reduction to 1024 ranks with the fit's 95% interval.

Output: OUT/compression_allreduce.json (the 2-node fits, and one row per link, node count and
compression: measured and predicted seconds, relative error, bytes, compression compute, cpu_busy),
OUT/exchange_fits.json (the fits over all node counts, derived from it by --report-only) and
OUT/compression_allreduce.md (the tables).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compression import BIN, CLUSTER, COMPRESSIONS, LINKS, REPO, cluster, cluster_env  # noqa: E402

from hvd_rl.analysis import projection as P  # noqa: E402

BENCH = REPO / "benchmarks" / "allreduce.py"
# Open MPI's tuned collectives pick an allreduce algorithm by size and rank count (not always the
# ring the model assumes); these force the ring for a second set of points on one link.
FORCED_RING = {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1", "OMPI_MCA_coll_tuned_allreduce_algorithm": "4"}


def allreduce(env: dict, out: Path, nodes: int, ranks_per_node: int, extra: list[str], timeout: float) -> dict:
    """benchmarks/allreduce.py under srun on the simulated cluster; its JSON result."""
    placement = ["-N1", f"-n{ranks_per_node}", "-w", "node1"] if nodes == 1 else [f"-N{nodes}", "--ntasks-per-node=1"]
    cmd = ["srun", *placement, "--cpus-per-task=1", "--mpi=pmix", str(BIN / "python"), str(BENCH),
           "--out", str(out), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def predicted_s(model: P.CostModel, row: dict, nodes: int, compress_s: float) -> float:
    workload = P.Workload(compute_s=0.0, gradient_bytes=row["bytes_per_rank"], gradient_rounds=1,
                          compression=row["compression"])
    return workload.comm_s(model, nodes) + compress_s


def point(link: str, nodes: int, algorithm: str, model: P.CostModel, measured: dict, compress_at_two: float) -> dict:
    """One measured reduction beside the model's two predictions."""
    pred = predicted_s(model, measured, nodes, compress_at_two)
    pred_local = predicted_s(model, measured, nodes, measured["time_compress_s"])
    row = {"link": link, "nodes": nodes, "allreduce_algorithm": algorithm, "compression": measured["compression"],
           "measured_s": measured["latency_s"], "predicted_s": pred, "rel_error": pred / measured["latency_s"] - 1,
           "predicted_local_s": pred_local, "rel_error_local": pred_local / measured["latency_s"] - 1,
           "bytes_per_rank": measured["bytes_per_rank"], "time_compress_s": measured["time_compress_s"],
           "cpu_busy": measured["cpu_busy"]}
    print(f"{link:9s} {nodes} nodes {algorithm:16s} {row['compression']:8s} measured {row['measured_s'] * 1e3:8.1f} ms"
          f"  predicted {pred * 1e3:8.1f} / {pred_local * 1e3:8.1f} ms  busy {row['cpu_busy']:.2f}", flush=True)
    return row


def table(rows: list[dict]) -> list[str]:
    lines = ["| link | nodes | allreduce | compression | measured ms | predicted ms (compute at 2 nodes) | error | "
             "predicted ms (compute at these nodes) | error | MiB sent per rank | compress ms | cpu busy |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['link']} | {r['nodes']} | {r['allreduce_algorithm']} | {r['compression']} | {r['measured_s'] * 1e3:.1f} | "
                     f"{r['predicted_s'] * 1e3:.1f} | {r['rel_error']:+.0%} | {r['predicted_local_s'] * 1e3:.1f} | "
                     f"{r['rel_error_local']:+.0%} | {r['bytes_per_rank'] / 2**20:.3f} | "
                     f"{r['time_compress_s'] * 1e3:.1f} | {r['cpu_busy']:.2f} |")
    return lines


PROJECT_TO = 1024
ALGORITHM_NAMES = {"openmpi": "Open MPI 4.1 default", "ring": "ring"}


def powersgd_call_bytes(rank: int) -> tuple[int, int]:
    """Bytes of PowerSGD's two allreduces on the benchmark's Nature CNN gradient: the uncompressed
    tensors with the P factors, then the Q factors (hvd_rl.runtime.compression.PowerSGD.reduce)."""
    import torch

    from allreduce import nature_cnn_gradients
    from hvd_rl.runtime.compression import PowerSGD

    params = [torch.nn.Parameter(g) for _, g in nature_cnn_gradients()]
    codec = PowerSGD(params, rank=rank)
    first = second = 0
    for param in params:
        shape = codec._compressed(param)
        if shape is None:
            first += param.numel() * param.element_size()
        else:
            n, m = shape
            r = min(rank, n, m)
            first, second = first + n * r * param.element_size(), second + m * r * param.element_size()
    return first, second


def exchange_calls(compression: str, bytes_per_rank: float, powersgd_calls: tuple[int, int]) -> tuple[float, ...]:
    """Bytes of each collective one reduction makes (distributed.compression's exchanges)."""
    if compression == "powersgd":
        if sum(powersgd_calls) != bytes_per_rank:
            raise SystemExit(f"compression_allreduce.py: PowerSGD's P + Q ({sum(powersgd_calls)} B) differ from the "
                             f"{bytes_per_rank} B measured: the gradient layout changed since the run")
        return tuple(float(b) for b in powersgd_calls)
    if compression == "topk":  # values and indices, one allgather each
        return (bytes_per_rank / 2, bytes_per_rank / 2)
    return (float(bytes_per_rank),)


def fit_exchanges(data: dict) -> dict:
    """Per link and compression: the exchange fitted to every node count it was measured on (Open
    MPI's default algorithm, and the forced ring where measured), with the link's fp32 size sweep
    on 2 nodes sharing the bandwidth."""
    powersgd_calls = powersgd_call_bytes(data["settings"]["powersgd_rank"])
    fits: dict = {}
    for link, raw in data["raw"].items():
        if link == "local":
            continue
        sweep = [(r["bytes"], r["latency_s"]) for r in raw["open_mpi_default"]["2"]["rows"] if r["compression"] == "fp32"]
        compressions = [r["compression"] for r in raw["open_mpi_default"]["2"]["compressed"]]
        fits[link] = {}
        for compression in compressions:
            points = []
            for key, algorithm in (("open_mpi_default", "openmpi"), ("ring_forced", "ring")):
                for nodes, result in sorted(raw[key].items(), key=lambda item: int(item[0])):
                    for r in result["compressed"]:
                        if r["compression"] != compression:
                            continue
                        calls = exchange_calls(compression, r["bytes_per_rank"], powersgd_calls)
                        points.append(P.Observation(f"{nodes} nodes, {ALGORITHM_NAMES[algorithm]}", int(nodes), calls,
                                                    r["latency_s"] - r["time_compress_s"], algorithm,
                                                    "allgather" if compression == "topk" else "allreduce"))
            fit = P.fit_exchange(points, sweep)
            projected = {}
            for algorithm in ALGORITHM_NAMES:
                terms = P.Observation("", PROJECT_TO, points[0].call_bytes, 1.0, algorithm, points[0].exchange).terms()
                round_s, err = fit.time_s(*terms)
                half = P.t_quantile_95(fit.dof) * err
                projected[algorithm] = {"round_s": round_s, "low_s": round_s - half, "high_s": round_s + half,
                                        "standard_error_s": err}
            fits[link][compression] = {**fit.as_dict(), "call_bytes": list(points[0].call_bytes),
                                       "exchange": points[0].exchange, "projected_round": projected}
    return fits


def fit_lines(fits: dict) -> list[str]:
    lines = [f"## Fit over all node counts, and one reduction projected to {PROJECT_TO} ranks", "",
             "Per link and compression, least squares on relative error of t = calls c + steps(n) alpha + bytes(n) / B "
             "to the measured communication time (the whole reduction less the compression compute measured at that "
             "node count) at 2, 4 and 8 nodes (and with the ring forced where measured), with steps and bytes of the "
             "algorithm that ran: Open MPI 4.1's default picks Rabenseifner (2 log2 n steps) for every exchange here "
             "at 4 and 8 ranks (`projection.open_mpi_allreduce_algorithm`). The link's 2-node fp32 sweep shares B "
             "(with an intercept of its own), so B is the link's and c and alpha come from the growth with the "
             "nodes; nothing is fixed at 0. +- is one standard error; the interval at "
             f"{PROJECT_TO} ranks is 95% (Student t on the fit's degrees of freedom) of the fitted parameters: it "
             "does not cover the model's form or the extrapolation from 8 ranks.", "",
             "| link | compression | calls per reduction, bytes | c ms | alpha ms per step | B MB/s | dof | rms error | "
             + " | ".join(f"reduction at {PROJECT_TO} ranks, {name}, ms (95%)" for name in ALGORITHM_NAMES.values()) + " |",
             "|---|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(ALGORITHM_NAMES)]
    for link, by_compression in fits.items():
        for compression, fit in by_compression.items():
            se_c, se_a, se_b = fit["standard_errors"]
            calls = " + ".join(f"{b:.0f}" for b in fit["call_bytes"])
            projected = " | ".join(f"{p['round_s'] * 1e3:,.0f} ({p['low_s'] * 1e3:,.0f} to {p['high_s'] * 1e3:,.0f})"
                                   for p in fit["projected_round"].values())
            lines.append(f"| {link} | {compression} | {calls} | {fit['overhead_s'] * 1e3:.2f} +- {se_c * 1e3:.2f} | "
                         f"{fit['latency_s'] * 1e3:.2f} +- {se_a * 1e3:.2f} | {fit['bandwidth_Bps'] / 1e6:.0f} +- "
                         f"{se_b / 1e6:.0f} | {fit['dof']} | {fit['rms_rel_error']:.0%} | {projected} |")
    lines += ["", "What the fit says: for the small exchanges (PowerSGD, top-k) alpha comes out at milliseconds per "
              "step on every link, unlimited veth links included, where a network step costs microseconds, and c "
              "comes out below 0: the time grows faster "
              "with the nodes than Open MPI's log2 n steps do. That growth is the simulation's, not the network's: "
              "8 single-rank nodes share 2 cores (cpu busy ~1 at every point), so each step waits for its partner "
              "to be scheduled. Projected to 1024 ranks the fit carries that cost per step along, which real nodes "
              "with a core per rank do not pay; the 2-node model (alpha = 0, below) is the other end.", "",
              "Residuals of every point of the fits, (fitted - measured) / measured (the 2-node sweep's in the last "
              "column, 1 MiB and up on shaped links):", "",
              "| link | compression | nodes, algorithm | measured ms | fitted ms | residual | sweep residuals |",
              "|---|---|---|---:|---:|---:|---|"]
    for link, by_compression in fits.items():
        for compression, fit in by_compression.items():
            sweep = ", ".join(f"{r['rel_error']:+.0%}" for r in fit["residuals"] if r["label"].startswith("2-rank sweep"))
            for r in fit["residuals"]:
                if not r["label"].startswith("2-rank sweep"):
                    lines.append(f"| {link} | {compression} | {r['label']} | {r['measured_s'] * 1e3:.1f} | "
                                 f"{r['fitted_s'] * 1e3:.1f} | {r['rel_error']:+.0%} | {sweep} |")
                    sweep = ""
    return lines + [""]


def write_report(out: Path) -> None:
    data = json.loads((out / "compression_allreduce.json").read_text())
    exchange_fits = fit_exchanges(data)
    (out / "exchange_fits.json").write_text(json.dumps(exchange_fits, indent=1) + "\n")
    s = data["settings"]
    fits = [f"- {link}: {fit['note']}; bandwidth {fit['bandwidth_Bps'] / 1e6:.1f} MB/s "
            f"(fit rms error {fit['rms_rel_error']:.0%} over {fit['rows']} sizes)" for link, fit in data["fits"].items()]
    errors = [abs(r["rel_error_local"]) for r in data["rows"]]
    lines = ["# The projection model against measured compressed allreduces on 2, 4 and 8 simulated nodes", "",
             f"The Nature CNN gradient (6.46 MiB fp32, 12 tensors) reduced {s['reps']} times per point (median of the "
             f"slowest rank) by each compression, 1 rank per simulated node (`slurm/sim_cluster.sh`, tc tbf per link), "
             f"PowerSGD rank {s['powersgd_rank']}, top-k ratio {s['topk_ratio']}. First the fit over every node count "
             "that the projection now uses, then (second section) the earlier 2-node model's predictions against the "
             "same points: fitted per link from the 2-node sweep alone, for the bytes each compression sends, plus "
             "the compression's compute. The ranks share the machine's 2 cores: 'cpu busy' is the ranks' "
             "CPU seconds / (wall seconds x cores), Horovod's and MPI's polling included (so ~1 even for a plain "
             "allreduce); with 4 and 8 ranks a rank's compression compute queues behind the others' and their "
             f"polling, so the compute measured at 2 nodes underestimates it. Nothing else ran on the machine. "
             f"The 2-node model's median |error| with the compute at each node count: {sorted(errors)[len(errors) // 2]:.0%}, "
             f"max {max(errors):.0%}.", "",
             f"Command: `{s['command']}` ({s['seconds']} s on {s['machine']})", "",
             *fit_lines(exchange_fits),
             "## The 2-node model against the measured points", "",
             "The model the first projection used: c, alpha and B from the 2-node sweep alone, where alpha came out "
             "0 (the 2-node constant equals the one within a node), with the ring's steps. Fits:", *fits, "",
             *table(data["rows"]), ""]
    (out / "compression_allreduce.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--links", nargs="+", default=list(LINKS), choices=list(LINKS))
    parser.add_argument("--compressions", nargs="+", default=list(COMPRESSIONS), choices=list(COMPRESSIONS))
    parser.add_argument("--nodes", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-size", type=int, default=16 << 20, help="largest size of the fitting sweeps")
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--topk-ratio", type=float, default=0.01)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--ring-link", default="100mbit", choices=[*LINKS, "none"],
                        help="link on which the points are measured a second time with Open MPI's ring forced")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    if args.report_only:
        write_report(out)
        return 0
    if os.geteuid() != 0:
        print("benchmarks/compression_allreduce.py: needs root (network namespaces, tc)", file=sys.stderr)
        return 2
    if min(args.nodes) < 2:
        print("benchmarks/compression_allreduce.py: --nodes must be >= 2", file=sys.stderr)
        return 2
    problem = subprocess.run([str(CLUSTER), "check"], capture_output=True, text=True)
    if problem.returncode != 0:
        print(f"benchmarks/compression_allreduce.py: simulated cluster unavailable: {problem.stdout.strip()}",
              file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    sweep = ["--max-size", str(args.max_size), "--reps", str(args.reps)]
    # Across shaped links the sweep starts at 1 MiB: tc tbf lets a 256 KiB burst pass unshaped
    # (slurm/sim_cluster.sh), so smaller messages would credit a slow link with a bandwidth it lacks
    # for a gradient-sized one (measured at 100 Mbit/s: 12.8 MB/s at 256 KiB, 8.3 MB/s at 4 MiB).
    network_sweep = ["--min-size", str(1 << 20), *sweep]
    reduce = ["--compressions", ",".join(args.compressions), "--reps", str(args.reps),
              "--powersgd-rank", str(args.powersgd_rank), "--topk-ratio", str(args.topk_ratio)]
    rows, fits, raw = [], {}, {}
    unshaped: P.CostModel | None = None
    cluster("start", str(max(args.nodes)))
    try:
        env = cluster_env()
        ring_env = {**env, **FORCED_RING}
        with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
            local = allreduce(env, Path(tmp) / "local.json", 1, 2, sweep, args.timeout)
            raw["local"] = local
            for link in args.links:
                cluster("rate", LINKS[link])
                shaped = LINKS[link] != "off"
                results = {2: allreduce(env, Path(tmp) / f"{link}-2.json", 2, 1,
                                        (network_sweep if shaped else sweep) + reduce, args.timeout)}
                ring = {}
                for nodes in args.nodes:
                    if nodes != 2:
                        results[nodes] = allreduce(env, Path(tmp) / f"{link}-{nodes}.json", nodes, 1,
                                                   ["--no-sweep", *reduce], args.timeout)
                    if link == args.ring_link:
                        ring[nodes] = allreduce(ring_env, Path(tmp) / f"{link}-{nodes}-ring.json", nodes, 1,
                                                ["--no-sweep", *reduce], args.timeout)
                cluster("rate", "off")
                raw[link] = {"open_mpi_default": results, "ring_forced": ring}
                model, note = P.cost_model(P.fit_allreduce(results[2]), P.fit_allreduce(local))
                if link == "unlimited":
                    unshaped = model
                elif unshaped is not None:
                    # The shaped links' sweeps start at 1 MiB, which leaves their constant unfitted:
                    # c and alpha come from the unshaped link (tbf adds bandwidth limits, not latency).
                    model = P.CostModel(unshaped.overhead_s, unshaped.latency_s, model.bandwidth_Bps,
                                        unshaped.local_latency_s, unshaped.local_bandwidth_Bps)
                    note = f"c and alpha as on the unlimited link ({model.overhead_s * 1e3:.3f} ms, " \
                           f"{model.latency_s * 1e6:.1f} us)"
                fit = P.fit_allreduce(results[2])
                fits[link] = {"note": note, "overhead_s": model.overhead_s, "latency_s": model.latency_s,
                              "bandwidth_Bps": model.bandwidth_Bps, "rms_rel_error": fit.rms_rel_error,
                              "rows": fit.rows}
                at_two = {r["compression"]: r["time_compress_s"] for r in results[2]["compressed"]}
                for algorithm, measured in (("Open MPI default", results), ("ring (forced)", ring)):
                    for nodes in sorted(measured):
                        for r in measured[nodes]["compressed"]:
                            rows.append(point(link, nodes, algorithm, model, r, at_two[r["compression"]]))
    finally:
        subprocess.run([str(CLUSTER), "stop"], capture_output=True)
    settings = {"reps": args.reps, "max_size": args.max_size, "powersgd_rank": args.powersgd_rank,
                "topk_ratio": args.topk_ratio, "nodes": args.nodes, "machine": f"{os.uname().nodename}, {os.cpu_count()} cores",
                "seconds": round(time.time() - started),
                "command": "sudo .venv/bin/python benchmarks/compression_allreduce.py " + " ".join(sys.argv[1:])}
    (out / "compression_allreduce.json").write_text(
        json.dumps({"settings": settings, "fits": fits, "rows": rows, "raw": raw}, indent=1) + "\n")
    write_report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
