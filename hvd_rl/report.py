"""`hvd-rl report`: a scaling-study report (Markdown + PNG plots + JSON) from sweep results.

Inputs, in any mix: sweep directories (sweep.json + one run directory per point), single run
directories (metrics.jsonl + summary.json), allreduce benchmark JSON, env-throughput JSON.

Efficiency: with X(N) the global throughput (env steps/s) on N ranks, both weak and strong
efficiency are X(N) / (N * X(1)). (In time terms: weak is t(1)/t(N) for the same work per rank,
strong is t(1)/(N * t(N)) for the same total work.) Without a 1-rank point the smallest rank
count N0 is the baseline: X(N) * N0 / (N * X(N0)), and the report says so.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hvd_rl.metrics import read_metrics

# time_allreduce: communication (the fastest rank's time in collectives); time_wait: waiting for
# slower ranks (older results have no time_wait: their time_allreduce holds both).
PHASES = ("time_env", "time_inference", "time_update", "time_allreduce", "time_wait")


class ReportError(ValueError):
    pass


@dataclass
class Point:
    name: str
    mode: str
    ranks: int
    nodes: int = 1
    status: str = "ok"
    oversubscribed: bool = False
    run_dir: str = ""
    measured_iterations: int = 0
    warmup_iterations: int = 0
    global_sps: float | None = None
    per_rank_sps: float | None = None
    efficiency: float | None = None
    phases_s: dict[str, float] = field(default_factory=dict)
    iteration_s: float | None = None
    envs_per_rank: int | None = None
    global_batch: int | None = None
    topology: dict[str, Any] = field(default_factory=dict)
    busy_by_rank: list[float] = field(default_factory=list)  # mean seconds per iteration
    wait_by_rank: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.global_sps is not None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ReportError(f"cannot read {path}: {exc}") from None


def measure_run(run_dir: Path, warmup: int) -> dict[str, Any]:
    """Throughput and phase times over the measured (post warm-up) iterations of one run."""
    rows = read_metrics(run_dir)
    measured = rows[warmup:]
    if not measured:
        return {"measured_iterations": 0}
    steps = [r["global_step"] for r in rows]
    batches = [b - a for a, b in zip([0] + steps[:-1], steps)][warmup:]
    wall = sum(r["time_iteration"] for r in measured)
    ranks = measured[-1]["world_size"]
    global_sps = sum(batches) / wall
    return {
        "measured_iterations": len(measured), "global_sps": global_sps, "per_rank_sps": global_sps / ranks,
        "iteration_s": wall / len(measured), "global_batch": batches[-1],
        "phases_s": {k: sum(r.get(k, 0.0) for r in measured) / len(measured) for k in PHASES},
        **{f"{key}_by_rank": _mean_lists([r.get(f"time_{key}_by_rank") for r in measured])
           for key in ("busy", "wait")},
    }


def _mean_lists(lists: list[list[float] | None]) -> list[float]:
    """Element-wise mean of per-rank lists of the same length (others, e.g. from a resize, skipped)."""
    lists = [x for x in lists if x]
    if not lists:
        return []
    size = len(lists[-1])
    same = [x for x in lists if len(x) == size]
    return [sum(x[i] for x in same) / len(same) for i in range(size)]


def _point_from_run(run_dir: Path, plan_entry: dict[str, Any] | None) -> Point:
    point_file = run_dir / "point.json"
    meta = _read_json(point_file) if point_file.exists() else {}
    summary = _read_json(run_dir / "summary.json") if (run_dir / "summary.json").exists() else {}
    topology = summary.get("topology", {})
    mode = meta.get("mode") or (plan_entry or {}).get("mode") or "run"
    ranks = meta.get("ranks") or (plan_entry or {}).get("ranks") or topology.get("ranks") or 0
    warmup = meta.get("warmup_iterations", 0)
    status = meta.get("status", "ok" if summary else "incomplete (no summary.json)")
    point = Point(name=run_dir.name, mode=mode, ranks=int(ranks),
                  nodes=int(meta.get("nodes") or topology.get("nodes") or 1), status=status,
                  oversubscribed=bool(meta.get("oversubscribed", False)), run_dir=str(run_dir),
                  warmup_iterations=int(warmup), topology=topology)
    config = run_dir / "config.toml"
    if config.exists():
        import tomllib

        point.envs_per_rank = tomllib.loads(config.read_text()).get("env", {}).get("num_envs")
    if status == "ok":
        for key, value in measure_run(run_dir, point.warmup_iterations).items():
            setattr(point, key, value)
        if not point.measured_iterations:
            point.status = "no measured iterations"
    return point


def collect(paths: list[str]) -> tuple[list[Point], list[dict], list[dict], list[dict]]:
    points: list[Point] = []
    allreduce: list[dict] = []
    env_tp: list[dict] = []
    sweeps: list[dict] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise ReportError(f"no such result: {path}")
        if path.is_file():
            data = _read_json(path)
            kind = data.get("kind", "")
            if kind == "hvd_rl.allreduce_benchmark":
                allreduce.append(data)
            elif kind == "hvd_rl.env_throughput":
                env_tp.append(data)
            else:
                raise ReportError(f"{path}: not an allreduce or env-throughput result")
        elif (path / "sweep.json").exists():
            plan = _read_json(path / "sweep.json")
            sweeps.append({"path": str(path), **{k: v for k, v in plan.items() if k != "points"}})
            for entry in plan.get("points", []):
                run_dir = path / entry["name"]
                if run_dir.is_dir():
                    points.append(_point_from_run(run_dir, entry))
                else:
                    points.append(Point(name=entry["name"], mode=entry["mode"], ranks=entry["ranks"],
                                        nodes=entry.get("nodes", 1), status="missing (never ran)"))
            for extra in ("allreduce.json", "env_throughput.json"):
                if (path / extra).exists():
                    data = _read_json(path / extra)
                    (allreduce if extra.startswith("allreduce") else env_tp).append(data)
        elif (path / "metrics.jsonl").exists():
            points.append(_point_from_run(path, None))
        else:
            raise ReportError(f"{path}: not a sweep directory, run directory or result file")
    if not points and not allreduce and not env_tp:
        raise ReportError("nothing to report")
    return points, allreduce, env_tp, sweeps


def compute_efficiency(points: list[Point]) -> dict[str, str]:
    """Fills Point.efficiency per mode; returns a note per mode about its baseline."""
    notes = {}
    for mode in sorted({p.mode for p in points}):
        done = sorted((p for p in points if p.mode == mode and p.ok), key=lambda p: p.ranks)
        if not done:
            continue
        base = done[0]
        notes[mode] = ("baseline: 1 rank" if base.ranks == 1 else
                       f"baseline: {base.ranks} ranks (no 1-rank point): X(N)*{base.ranks}/(N*X({base.ranks}))")
        for p in done:
            p.efficiency = p.global_sps * base.ranks / (p.ranks * base.global_sps)
    return notes


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _plot_scaling(points: list[Point], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    modes = sorted({p.mode for p in points})
    fig, (ax_x, ax_e) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, mode in enumerate(modes):
        color = f"C{i}"
        mine = sorted((p for p in points if p.mode == mode), key=lambda p: p.ranks)
        done = [p for p in mine if p.ok]
        if done:
            base = done[0]
            ranks = [p.ranks for p in mine]
            ideal = [base.global_sps * r / base.ranks for r in ranks]
            ax_x.plot(ranks, ideal, "--", color=color, alpha=0.5, label=f"{mode}: ideal linear")
            ax_x.plot([p.ranks for p in done], [p.global_sps for p in done], "o-", color=color, label=f"{mode}: measured")
            ax_e.plot([p.ranks for p in done], [p.efficiency for p in done], "o-", color=color, label=mode)
            for p in done:
                if p.oversubscribed:
                    ax_x.plot(p.ranks, p.global_sps, "o", mfc="white", mec=color, ms=11)
                    ax_x.annotate("oversubscribed", (p.ranks, p.global_sps), textcoords="offset points",
                                  xytext=(6, -4 - 10 * i), fontsize=7, color=color)
        for p in mine:
            if not p.ok:
                ax_x.axvline(p.ranks, color=color, ls=":", alpha=0.6)
                ax_x.annotate(f"{mode} {p.ranks}r: {p.status}", (p.ranks, 0), textcoords="offset points",
                              xytext=(3, 5 + 10 * i), fontsize=7, color=color, rotation=0)
    for ax in (ax_x, ax_e):
        ax.set_xlabel("ranks")
        ax.set_xticks(sorted({p.ranks for p in points}))
        ax.grid(alpha=0.3)
    ax_x.set_ylabel("global env steps / s")
    ax_x.set_title("Throughput vs ranks")
    ax_x.set_ylim(bottom=0)
    ax_e.axhline(1.0, color="gray", ls="--", alpha=0.6)
    ax_e.set_ylabel("efficiency  X(N) / (N X(1))")
    ax_e.set_title("Scaling efficiency")
    ax_e.set_ylim(0, max(1.1, max((p.efficiency or 0 for p in points), default=1) * 1.1))
    ax_x.legend(fontsize=8)
    ax_e.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=120)
    plt.close(fig)
    files.append("scaling.png")

    done = [p for p in sorted(points, key=lambda p: (p.mode, p.ranks)) if p.ok]
    if done:
        fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(done) + 2), 4.2))
        labels = [f"{p.mode}\n{p.ranks}r" + ("*" if p.oversubscribed else "") for p in done]
        bottom = [0.0] * len(done)
        for j, key in enumerate(PHASES + ("other",)):
            values = [(p.iteration_s - sum(p.phases_s.values())) if key == "other" else p.phases_s[key] for p in done]
            values = [max(v, 0.0) for v in values]
            ax.bar(labels, values, bottom=bottom, label=key.replace("time_", ""), color=f"C{j}")
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylabel("seconds per iteration (mean over ranks)\nallreduce = communication, wait = for slower ranks")
        ax.set_title("Where an iteration's time goes" + ("  (* oversubscribed)" if any(p.oversubscribed for p in done) else ""))
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "phases.png", dpi=120)
        plt.close(fig)
        files.append("phases.png")
    files += _plot_ranks(done, out)
    return files


def _plot_ranks(points: list[Point], out: Path) -> list[str]:
    """Per-rank busy vs waiting time of every multi-rank point: imbalance at a glance."""
    import matplotlib.pyplot as plt

    shown = [p for p in points if len(p.busy_by_rank) > 1]
    if not shown:
        return []
    fig, axes = plt.subplots(1, len(shown), figsize=(max(5, 2.6 * len(shown)), 3.8), squeeze=False)
    for ax, p in zip(axes[0], shown):
        ranks = list(range(len(p.busy_by_rank)))
        ax.bar(ranks, p.busy_by_rank, label="busy", color="C0")
        ax.bar(ranks, p.wait_by_rank, bottom=p.busy_by_rank, label="waiting for others", color="C3")
        ax.set_title(f"{p.mode} {p.ranks}r" + (f" {p.nodes}n" if p.nodes > 1 else ""), fontsize=9)
        ax.set_xlabel("rank")
        ax.set_xticks(ranks)
    axes[0][0].set_ylabel("seconds per iteration")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Load per rank (busy: env + inference + learner; waiting: at collectives)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "ranks.png", dpi=120)
    plt.close(fig)
    return ["ranks.png"]


def plot_rank_timeline(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Per-rank busy and waiting time and environment counts over the iterations of one run,
    with the load balancer's decisions marked: the imbalance before and after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("time_busy_by_rank")]
    iterations = [r["iteration"] for r in rows]
    ranks = len(rows[-1]["time_busy_by_rank"]) if rows else 0
    fig, (ax_t, ax_n) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for rank in range(ranks):
        values = [r["time_busy_by_rank"][rank] if len(r["time_busy_by_rank"]) > rank else None for r in rows]
        waits = [r["time_wait_by_rank"][rank] if len(r["time_wait_by_rank"]) > rank else None for r in rows]
        counts = [r["env_counts"][rank] if len(r.get("env_counts", [])) > rank else None for r in rows]
        ax_t.plot(iterations, values, "-", color=f"C{rank}", label=f"rank {rank} busy")
        ax_t.plot(iterations, waits, ":", color=f"C{rank}", label=f"rank {rank} waiting")
        ax_n.step(iterations, counts, where="mid", color=f"C{rank}", label=f"rank {rank}")
    changes = [b["iteration"] for a, b in zip(rows, rows[1:]) if a.get("env_counts") != b.get("env_counts")]
    for x in changes:
        for ax in (ax_t, ax_n):
            ax.axvline(x - 0.5, color="gray", ls="--", alpha=0.6)
    ax_t.set_ylabel("seconds per iteration")
    ax_t.set_title(title, fontsize=10)
    ax_t.legend(fontsize=7, ncol=2)
    ax_t.grid(alpha=0.3)
    ax_n.set_ylabel("environments")
    ax_n.set_xlabel("iteration (dashed: the layout changed)")
    ax_n.legend(fontsize=7)
    ax_n.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_allreduce(results: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bw, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, result in enumerate(results):
        for j, compression in enumerate(("fp32", "fp16")):
            rows = [r for r in result["rows"] if r["compression"] == compression]
            label = f"{result['ranks']} ranks, {compression}"
            style = "-" if compression == "fp32" else "--"
            ax_bw.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], "o" + style,
                       color=f"C{i}", label=label, alpha=1.0 if j == 0 else 0.7)
            ax_lat.plot([r["bytes"] for r in rows], [r["latency_s"] * 1e3 for r in rows], "o" + style,
                        color=f"C{i}", label=label, alpha=1.0 if j == 0 else 0.7)
        grad = result.get("gradient")
        if grad:
            ax_bw.plot([grad["bytes"]], [grad["busbw_GBps"]], "*", ms=14, color=f"C{i}",
                       label=f"Nature CNN gradient ({result['ranks']} ranks)")
    for ax in (ax_bw, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes, fp32 payload)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    ax_lat.set_yscale("log")
    ax_bw.set_ylabel("bus bandwidth (GB/s) = S/t * 2(n-1)/n")
    ax_lat.set_ylabel("latency (ms)")
    ax_bw.set_title("Allreduce bandwidth")
    ax_lat.set_title("Allreduce latency")
    fig.tight_layout()
    fig.savefig(out / "allreduce.png", dpi=120)
    plt.close(fig)
    return ["allreduce.png"]


def _plot_env(results: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for result in results:
        combos = sorted({(r["backend"], r["threads"]) for r in result["rows"]})
        for k, (backend, threads) in enumerate(combos):
            rows = sorted((r for r in result["rows"] if r["backend"] == backend and r["threads"] == threads),
                          key=lambda r: r["num_envs"])
            ax.plot([r["num_envs"] for r in rows], [r["steps_per_s"] for r in rows], "o-", color=f"C{k}",
                    label=f"{backend} ({threads} thread{'s' if threads > 1 else ''})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("environments in the vector")
    ax.set_ylabel("env steps / s")
    ax.set_title(f"Environment throughput: {results[0]['env']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "env_throughput.png", dpi=120)
    plt.close(fig)
    return ["env_throughput.png"]


def write_report(paths: list[str], out_dir: str, title: str = "hvd_rl scaling study") -> Path:
    points, allreduce, env_tp, sweeps = collect(paths)
    notes = compute_efficiency(points)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = []
    if points:
        plots += _plot_scaling(points, out)
    if allreduce:
        plots += _plot_allreduce(allreduce, out)
    if env_tp:
        plots += _plot_env(env_tp, out)

    lines = [f"# {title}", ""]
    topologies = [p.topology for p in points if p.topology]
    hosts = sorted({h for t in topologies for h in t.get("hostnames", [])})
    machine = (sweeps[0].get("machine") if sweeps else None) or {}
    lines += ["## Machine and topology", ""]
    if machine:
        lines.append(f"- sweep host: {machine.get('hostname', '?')}, {machine.get('cpus', '?')} CPUs")
    if hosts:
        lines.append(f"- hosts used: {', '.join(hosts)}")
    versions = next((t.get("versions") for t in topologies if t.get("versions")), None)
    if versions:
        lines.append("- software: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    for sweep in sweeps:
        lines.append(f"- sweep `{sweep['path']}`: config `{sweep.get('config')}`, launcher "
                     f"{sweep.get('launcher')}, {sweep.get('warmup')} warm-up + {sweep.get('iterations')} "
                     f"measured iterations per point, envs/rank (weak) {sweep.get('envs_per_rank')}, "
                     f"global envs (strong) {sweep.get('global_envs')}, threads/rank "
                     f"{sweep.get('threads_per_rank', '?')}")
    lines.append("")

    if points:
        lines += ["## Scaling", "",
                  "Throughput X(N) is global environment steps per second over the measured iterations "
                  "(sum of global batches / sum of iteration wall times, from each run's metrics.jsonl). "
                  "Efficiency is X(N) / (N X(1)) for both weak and strong scaling.", ""]
        for mode, note in notes.items():
            lines.append(f"- {mode}: {note}")
        lines += ["", "![throughput and efficiency](scaling.png)", ""]
        if "phases.png" in plots:
            lines += ["![phase breakdown](phases.png)", ""]
        if "ranks.png" in plots:
            lines += ["Per rank, busy time (env + inference + learner) against time spent waiting for "
                      "the other ranks at collectives:", "", "![load per rank](ranks.png)", ""]
        header = ("| mode | ranks | nodes | ranks/node | threads/rank | device | envs/rank | global batch "
                  "| iterations | global SPS | per-rank SPS | efficiency | env s | inference s | update s "
                  "| allreduce s | wait s | iteration s | status |")
        lines += [header, "|" + "|".join(["---"] * (header.count("|") - 1)) + "|"]
        for p in sorted(points, key=lambda p: (p.mode, p.ranks, p.nodes)):
            t = p.topology
            status = p.status + (" (oversubscribed)" if p.oversubscribed else "")
            lines.append("| " + " | ".join([
                p.mode, str(p.ranks), str(p.nodes), _fmt(t.get("ranks_per_node")), _fmt(t.get("threads_per_rank")),
                _fmt(t.get("device")), _fmt(p.envs_per_rank), _fmt(p.global_batch), str(p.measured_iterations),
                _fmt(p.global_sps), _fmt(p.per_rank_sps), _fmt(p.efficiency, 3),
                *[_fmt(p.phases_s.get(k), 3) for k in PHASES], _fmt(p.iteration_s, 3), status]) + " |")
        missing = [p for p in points if not p.ok]
        if missing:
            lines += ["", "Points without a measurement (kept in the table, not dropped): "
                      + ", ".join(f"{p.mode} {p.ranks} ranks ({p.status})" for p in missing) + "."]
        lines.append("")

    for result in allreduce:
        lines += [f"## Allreduce ({result['ranks']} ranks, {result['controller'].upper()} controller)", "",
                  f"Fusion threshold {result['fusion_threshold_bytes'] / 2**20:.0f} MiB, cycle time "
                  f"{result['cycle_time_ms']:g} ms. algbw = S/t; busbw = algbw x 2(n-1)/n (the nccl-tests "
                  "convention); S is the fp32 payload for both modes.", "", "![allreduce](allreduce.png)", "",
                  "| bytes | compression | latency ms | algbw GB/s | busbw GB/s |", "|---|---|---|---|---|"]
        for r in result["rows"]:
            lines.append(f"| {r['bytes']} | {r['compression']} | {r['latency_s'] * 1e3:.3f} | "
                         f"{r['algbw_GBps']:.3f} | {r['busbw_GBps']:.3f} |")
        grad = result.get("gradient")
        if grad:
            lines += ["", f"Real gradient: {grad['model']}, {grad['tensors']} tensors, {grad['bytes']} bytes "
                      f"({grad['bytes'] / 2**20:.2f} MiB): {grad['latency_s'] * 1e3:.3f} ms, busbw "
                      f"{grad['busbw_GBps']:.3f} GB/s."]
        lines.append("")

    for result in env_tp:
        lines += [f"## Environment throughput ({result['env']})", "", "![env throughput](env_throughput.png)", "",
                  "| backend | envs | threads | steps/s |", "|---|---|---|---|"]
        for r in result["rows"]:
            lines.append(f"| {r['backend']} | {r['num_envs']} | {r['threads']} | {r['steps_per_s']:.0f} |")
        lines.append("")

    (out / "report.md").write_text("\n".join(lines))
    data = {"points": [asdict(p) for p in points], "efficiency_baselines": notes,
            "allreduce": allreduce, "env_throughput": env_tp, "sweeps": sweeps, "plots": plots}
    (out / "report.json").write_text(json.dumps(data, indent=1) + "\n")
    return out / "report.md"
