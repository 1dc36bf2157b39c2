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

from hvd_rl.runtime.metrics import read_metrics
from hvd_rl.analysis.projection import format_rate, parse_rate

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
    interconnect: str = ""  # the links between the nodes (point.json; e.g. '1gbit per link (tc tbf)')
    link_rate_bps: float | None = None  # parsed from interconnect; None: unlimited or unknown
    gradient_bytes: float | None = None  # summary.json: bytes one gradient allreduce moves
    gradient_rounds: float | None = None  # PPO: gradient allreduces per iteration (epochs x minibatches)
    collectives: float | None = None  # all collectives per iteration (metrics.jsonl)
    epochs_run: float | None = None  # PPO epochs per iteration (mean; KL early stopping cuts them)
    compression: str = "none"  # summary.json communication: distributed.compression of the run
    comm_bytes: float | None = None  # gradient bytes each rank sent per iteration (summary.json)

    @property
    def group(self) -> str:
        """Points compared with each other (one efficiency baseline): the mode, per interconnect."""
        return f"{self.mode}, {self.interconnect}" if self.interconnect else self.mode

    @property
    def compute_s(self) -> float | None:
        """Per-iteration time that is neither communication nor waiting for other ranks."""
        if self.iteration_s is None:
            return None
        return self.iteration_s - self.phases_s.get("time_allreduce", 0.0) - self.phases_s.get("time_wait", 0.0)

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
        "epochs_run": _mean([r.get("epochs_run") for r in measured]),
        "collectives": _mean([r.get("collectives") for r in measured]),
        **{f"{key}_by_rank": _mean_lists([r.get(f"time_{key}_by_rank") for r in measured])
           for key in ("busy", "wait")},
    }


def _mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


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
                  warmup_iterations=int(warmup), topology=topology,
                  interconnect=str(meta.get("interconnect") or ""), gradient_bytes=summary.get("gradient_bytes"))
    point.link_rate_bps = parse_rate(point.interconnect)
    communication = summary.get("communication") or {}
    point.compression = str(communication.get("compression") or "none")
    point.comm_bytes = communication.get("comm_bytes")
    config = run_dir / "config.toml"
    cfg: dict[str, Any] = {}
    if config.exists():
        import tomllib

        cfg = tomllib.loads(config.read_text())
        point.envs_per_rank = cfg.get("env", {}).get("num_envs")
    if status == "ok":
        for key, value in measure_run(run_dir, point.warmup_iterations).items():
            setattr(point, key, value)
        if not point.measured_iterations:
            point.status = "no measured iterations"
        minibatches = cfg.get("ppo", {}).get("num_minibatches")
        if point.epochs_run is not None and minibatches and cfg.get("algorithm", "ppo") == "ppo":
            point.gradient_rounds = point.epochs_run * minibatches
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
    """Fills Point.efficiency per group (mode, and interconnect where recorded); returns a note
    per group about its baseline."""
    notes = {}
    for group in sorted({p.group for p in points}):
        done = sorted((p for p in points if p.group == group and p.ok), key=lambda p: p.ranks)
        if not done:
            continue
        base = done[0]
        notes[group] = ("baseline: 1 rank" if base.ranks == 1 else
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
    modes = sorted({p.group for p in points})
    fig, (ax_x, ax_e) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, mode in enumerate(modes):
        color = f"C{i}"
        mine = sorted((p for p in points if p.group == mode), key=lambda p: p.ranks)
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

    done = [p for p in sorted(points, key=lambda p: (p.group, p.ranks)) if p.ok]
    if done:
        fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(done) + 2), 4.2))
        labels = [f"{p.mode}\n{p.ranks}r" + (f" {p.nodes}n" if p.nodes > 1 else "") + ("*" if p.oversubscribed else "")
                  + (f"\n{_short_interconnect(p)}" if p.interconnect else "") for p in done]
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


def _short_interconnect(p: Point) -> str:
    return format_rate(p.link_rate_bps) if p.link_rate_bps else ("unlimited" if "unlimited" in p.interconnect
                                                                 else p.interconnect[:16])


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
        ax.set_title(f"{p.mode} {p.ranks}r" + (f" {p.nodes}n" if p.nodes > 1 else "")
                     + (f", {_short_interconnect(p)}" if p.interconnect else ""), fontsize=9)
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


def _allreduce_label(result: dict) -> str:
    nodes = result.get("nodes") or 1
    label = f"{result['ranks']} ranks" + (f" on {nodes} nodes" if nodes > 1 else " on 1 node")
    rate = parse_rate(result.get("interconnect"))
    if nodes > 1 and result.get("interconnect"):
        label += f", {format_rate(rate)}" if rate else ", unlimited" if "unlimited" in result["interconnect"] else ""
    return label


def _plot_allreduce(results: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bw, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, result in enumerate(results):
        for j, compression in enumerate(("fp32", "fp16")):
            rows = [r for r in result["rows"] if r["compression"] == compression]
            label = f"{_allreduce_label(result)}, {compression}"
            style = "-" if compression == "fp32" else "--"
            ax_bw.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], "o" + style,
                       color=f"C{i}", label=label, alpha=1.0 if j == 0 else 0.7)
            ax_lat.plot([r["bytes"] for r in rows], [r["latency_s"] * 1e3 for r in rows], "o" + style,
                        color=f"C{i}", label=label, alpha=1.0 if j == 0 else 0.7)
        grad = result.get("gradient")
        if grad:
            ax_bw.plot([grad["bytes"]], [grad["busbw_GBps"]], "*", ms=14, color=f"C{i}",
                       label=f"Nature CNN gradient ({_allreduce_label(result)})")
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
        links = any(p.interconnect for p in points)  # the interconnect column only where recorded
        header = ("| mode | ranks | nodes |" + (" interconnect |" if links else "") + " ranks/node | threads/rank "
                  "| device | envs/rank | global batch "
                  "| iterations | global SPS | per-rank SPS | efficiency | env s | inference s | update s "
                  "| allreduce s | wait s | iteration s | status |")
        lines += [header, "|" + "|".join(["---"] * (header.count("|") - 1)) + "|"]
        for p in sorted(points, key=lambda p: (p.mode, p.ranks, p.nodes, p.link_rate_bps or math.inf, p.interconnect)):
            t = p.topology
            status = p.status + (" (oversubscribed)" if p.oversubscribed else "")
            lines.append("| " + " | ".join([
                p.mode, str(p.ranks), str(p.nodes), *([p.interconnect or "—"] if links else []),
                _fmt(t.get("ranks_per_node")), _fmt(t.get("threads_per_rank")),
                _fmt(t.get("device")), _fmt(p.envs_per_rank), _fmt(p.global_batch), str(p.measured_iterations),
                _fmt(p.global_sps), _fmt(p.per_rank_sps), _fmt(p.efficiency, 3),
                *[_fmt(p.phases_s.get(k), 3) for k in PHASES], _fmt(p.iteration_s, 3), status]) + " |")
        missing = [p for p in points if not p.ok]
        if missing:
            lines += ["", "Points without a measurement (kept in the table, not dropped): "
                      + ", ".join(f"{p.mode} {p.ranks} ranks ({p.status})" for p in missing) + "."]
        lines.append("")

    projection_data = None
    if points and allreduce:
        section, files, projection_data = projection_section(points, allreduce, out)
        lines += section
        plots += files

    for result in allreduce:
        where = f", {result['interconnect']}" if result.get("interconnect") and (result.get("nodes") or 1) > 1 else ""
        lines += [f"## Allreduce ({_allreduce_label(result)}{where}, {result['controller'].upper()} controller)", "",
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
            "allreduce": allreduce, "env_throughput": env_tp, "sweeps": sweeps, "plots": plots,
            "projection": projection_data}
    (out / "report.json").write_text(json.dumps(data, indent=1) + "\n")
    return out / "report.md"


# ---- projection -----------------------------------------------------------------------------

PROJECTION_RANKS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
PROJECTION_RATES = (1e9, 10e9, 100e9)
HIERARCHICAL_RANKS_PER_NODE = 8


def projection_section(points: list[Point], allreduce: list[dict], out: Path) -> tuple[list[str], list[str], dict | None]:
    """Markdown, plot files and data of the weak-scaling projection (hvd_rl/analysis/projection.py): the
    1-rank point's compute time, the allreduce model fitted to the benchmarks, predicted efficiency
    at 8..1024 ranks for 1/10/100 Gbit/s, and the model checked against the measured multi-node points."""
    from hvd_rl.analysis import projection as P

    lines = ["## Projection to many ranks (weak scaling)", ""]
    network = [r for r in allreduce if (r.get("nodes") or 1) > 1]
    local = [r for r in allreduce if (r.get("nodes") or 1) == 1 and r.get("ranks", 1) > 1]
    base = next((p for p in sorted(points, key=lambda p: (p.ranks, p.link_rate_bps is not None))
                 if p.ok and p.ranks == 1 and p.gradient_rounds), None)
    if not network or base is None:
        lines += ["Not projected: this needs an allreduce benchmark across at least 2 nodes and a measured "
                  "1-rank PPO point (the compute time of one rank per iteration).", ""]
        return lines, [], None
    fits, fitted, problems = [], [], []
    for result in network:
        try:
            fits.append(P.fit_allreduce(result))
            fitted.append(result)
        except P.ProjectionError as exc:
            problems.append(f"{_allreduce_label(result)}: {exc}")
    local_fit = None
    for result in local:
        try:
            local_fit = P.fit_allreduce(result)
            break
        except P.ProjectionError as exc:
            problems.append(f"{_allreduce_label(result)}: {exc}")
    if not fits:
        lines += ["Not projected: no allreduce benchmark across nodes could be fitted (" + "; ".join(problems) + ").", ""]
        return lines, [], None
    shaped = [f for f in fits if P.parse_rate(f.interconnect)]
    primary = shaped[0] if shaped else fits[0]
    rate = P.parse_rate(primary.interconnect)
    link_efficiency = min(1.0, primary.bandwidth_Bps / (rate / 8)) if rate else 1.0
    model, split_note = P.cost_model(primary, local_fit)
    gradient_bytes = base.gradient_bytes or next(
        (r["gradient"]["bytes"] for r in allreduce if r.get("gradient")), None)
    if not gradient_bytes:
        lines += ["Not projected: the gradient size is unknown (no gradient_bytes in summary.json, no gradient "
                  "row in the allreduce benchmark).", ""]
        return lines, [], None

    def workload_of(p: Point, compute_s: float | None = None) -> P.Workload:
        rounds = p.gradient_rounds or base.gradient_rounds
        small = max(0.0, (p.collectives or 0.0) - rounds - (p.epochs_run or 0.0)) if p.collectives else 0.0
        # A compressed run exchanges what it measured (comm_bytes) in its own pattern (projection.Workload).
        compressed = p.compression in ("powersgd", "topk") and p.comm_bytes and rounds
        return P.Workload(compute_s=p.compute_s if compute_s is None else compute_s,
                          gradient_bytes=p.comm_bytes / rounds if compressed else (p.gradient_bytes or gradient_bytes),
                          gradient_rounds=rounds, small_collectives=small,
                          compression=p.compression if compressed else "none")

    workload = workload_of(base)
    projection = P.project(model, workload, PROJECTION_RANKS, PROJECTION_RATES, link_efficiency,
                           ranks_per_node=HIERARCHICAL_RANKS_PER_NODE)

    # The model against every measured multi-node point (its own interconnect's fit where there is one).
    checks = []
    for p in sorted((p for p in points if p.ok and p.nodes > 1 and p.compute_s is not None),
                    key=lambda p: (p.ranks, p.link_rate_bps or math.inf)):
        fit = next((f for f in fits if f.interconnect == p.interconnect and f.ranks == p.nodes), None)
        if fit is not None:
            point_model, how = P.cost_model(fit, local_fit)[0], "its own allreduce benchmark"
        elif p.link_rate_bps:
            point_model = model.with_bandwidth(P.bandwidth_for(p.link_rate_bps, link_efficiency))
            how = "the model at its link rate"
        else:
            point_model, how = model, "the model (link rate unknown)"
        mine = workload_of(p)
        comm_pred = mine.comm_s(point_model, p.ranks)
        wait = p.phases_s.get("time_wait", 0.0)
        checks.append({
            "name": p.name, "ranks": p.ranks, "nodes": p.nodes, "interconnect": p.interconnect, "model_from": how,
            "comm_measured_s": p.phases_s.get("time_allreduce", 0.0), "comm_predicted_s": comm_pred,
            "wait_measured_s": wait, "compute_s": p.compute_s, "iteration_measured_s": p.iteration_s,
            "iteration_predicted_s": p.compute_s + comm_pred + wait,
            "efficiency_measured": p.efficiency,
            "efficiency_predicted_own_compute": base.iteration_s / (p.compute_s + comm_pred + wait),
            "efficiency_predicted_dedicated": workload.weak_efficiency(point_model, p.ranks),
        })

    files = _plot_projection(projection, fits, fitted, checks, out)
    pct = lambda x: "—" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    lines += [
        "Model (hvd_rl/analysis/projection.py): one allreduce of S bytes on n ranks costs c + steps(n) alpha + "
        "2(n-1)/n S/B, with steps = 2(n-1) for a ring (Horovod's CPU allreduce: flat MPI/Gloo), "
        "2 ceil(log2 n) for a tree (recursive halving/doubling), and for hierarchical "
        f"({HIERARCHICAL_RANKS_PER_NODE} ranks per node, Horovod's NCCL path) a ring within each node on its own bus "
        "plus a ring over the nodes. Weak scaling keeps each rank's work: T(n) = compute + rounds x t(n, S) + "
        "small collectives x t(n, 64 B); efficiency = T(1) / T(n). Overlap of the allreduce with the backward "
        "pass is ignored (the model errs on the slow side).", "",
        "Fitted to the benchmarks (least squares on relative error over all message sizes, fp32):", ""]
    lines += ["| benchmark | constant c + 2(n-1) alpha (ms) | bandwidth B (MB/s) | rms / max error |",
              "|---|---|---|---|"]
    for f, result in zip(fits, fitted):
        lines.append(f"| {_allreduce_label(result)} | {f.constant_s * 1e3:.3f} | {f.bandwidth_Bps / 1e6:.1f} | "
                     f"{100 * f.rms_rel_error:.0f}% / {100 * f.max_rel_error:.0f}% |")
    if local_fit is not None:
        lines.append(f"| {local_fit.ranks} ranks on 1 node (shared memory) | {local_fit.constant_s * 1e3:.3f} | "
                     f"{local_fit.bandwidth_Bps / 1e6:.1f} | {100 * local_fit.rms_rel_error:.0f}% / "
                     f"{100 * local_fit.max_rel_error:.0f}% |")
    lines += ["", f"- split of the constant: {split_note}",
              f"- link efficiency (achieved / nominal) {link_efficiency:.2f}"
              + (f", from the {P.format_rate(rate)} link: {primary.bandwidth_Bps / 1e6:.1f} MB/s of "
                 f"{rate / 8e6:.1f} MB/s; projected links get nominal rate x this" if rate else
                 " (no shaped link was measured: nominal rates are taken as achieved)"),
              f"- workload per rank and iteration, from the 1-rank point `{base.name}`: compute "
              f"{workload.compute_s:.3f} s (env + inference + learner + bookkeeping), {workload.gradient_rounds:g} "
              f"gradient reductions of {workload.gradient_bytes / 2**20:.2f} MiB"
              + (f" ({workload.compression}: its measured bytes and exchange pattern)" if workload.compression != "none" else "")
              + f", {workload.small_collectives:g} small collectives"]
    if problems:
        lines.append("- not fitted: " + "; ".join(problems))
    lines += ["", "![projection](projection.png)", "",
              "Predicted weak-scaling efficiency (c and alpha as measured here; B = nominal rate x link efficiency):", "",
              "| interconnect | allreduce | " + " | ".join(str(n) for n in PROJECTION_RANKS if n >= 8)
              + f" | largest n >= 90% (up to {PROJECTION_RANKS[-1]}) |", "|---|---|" + "---|" * (sum(n >= 8 for n in PROJECTION_RANKS) + 1)]
    for label, values in projection.curves.items():
        rate_text, algorithm = label.rsplit(" ", 1)
        scaled = model.with_bandwidth(P.bandwidth_for(P.parse_rate(rate_text), link_efficiency))
        top = P.ranks_for_efficiency(scaled, workload, 0.9, algorithm,
                                     HIERARCHICAL_RANKS_PER_NODE if algorithm == "hierarchical" else 1,
                                     limit=PROJECTION_RANKS[-1])
        lines.append(f"| {rate_text} | {algorithm} | " + " | ".join(
            pct(v) for n, v in zip(PROJECTION_RANKS, values) if n >= 8) + f" | {top or '< 2'} |")
    if checks:
        lines += ["", "The model against the measured multi-node points (communication = the fastest rank's time "
                  "blocked in collectives per iteration; waiting for slower ranks is measured, not modelled):", "",
                  "| point | interconnect | model from | comm measured s | comm predicted s | iteration measured s "
                  "| iteration predicted s | efficiency measured | predicted (same compute) | predicted (dedicated cores) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for c in checks:
            lines.append(f"| {c['name']} | {c['interconnect'] or '—'} | {c['model_from']} | {c['comm_measured_s']:.3f} | "
                         f"{c['comm_predicted_s']:.3f} | {c['iteration_measured_s']:.3f} | "
                         f"{c['iteration_predicted_s']:.3f} | {pct(c['efficiency_measured'])} | "
                         f"{pct(c['efficiency_predicted_own_compute'])} | {pct(c['efficiency_predicted_dedicated'])} |")
        lines += ["", "'same compute' uses each point's own measured compute and waiting time (so it differs from "
                  "the measurement only by the communication model); 'dedicated cores' uses the 1-rank compute time, "
                  "what the same links would give if every rank had its own cores."]
    lines += ["", "Published anchors (other workloads, shown on the plot): "
              + "; ".join(f"{a['label']} = {100 * a['efficiency']:.0f}% ({a['source']})" for a in P.ANCHORS) + ".", ""]
    data = {"fits": [asdict(f) for f in fits], "local_fit": asdict(local_fit) if local_fit else None,
            "model": asdict(model), "split": split_note, "link_efficiency": link_efficiency,
            "workload": asdict(workload), "baseline_point": base.name, "ranks": list(PROJECTION_RANKS),
            "curves": projection.curves, "checks": checks, "anchors": list(P.ANCHORS)}
    return lines, files, data


def _plot_projection(projection, fits, network: list[dict], checks: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hvd_rl.analysis import projection as P

    fig, (ax_fit, ax_e) = plt.subplots(1, 2, figsize=(12, 4.6))
    for i, (fit, result) in enumerate(zip(fits, network)):
        rows = [r for r in result["rows"] if r.get("compression", "fp32") == "fp32"]
        sizes = [r["bytes"] for r in rows]
        ax_fit.plot(sizes, [r["latency_s"] * 1e3 for r in rows], "o", color=f"C{i}",
                    label=f"measured: {_allreduce_label(result)}")
        ax_fit.plot(sizes, [fit.predict(b) * 1e3 for b in sizes], "-", color=f"C{i}", alpha=0.7,
                    label=f"fit: {fit.constant_s * 1e3:.2f} ms + S / {fit.bandwidth_Bps / 1e6:.0f} MB/s")
    ax_fit.set_xscale("log", base=2)
    ax_fit.set_yscale("log")
    ax_fit.set_xlabel("message size (bytes)")
    ax_fit.set_ylabel("allreduce time (ms)")
    ax_fit.set_title("Allreduce model fitted to the benchmark")
    ax_fit.grid(alpha=0.3, which="both")
    ax_fit.legend(fontsize=7)

    styles = {"ring": "-", "tree": "--", "hierarchical": ":"}
    for j, rate in enumerate(projection.interconnects):
        for algorithm, style in styles.items():
            key = f"{P.format_rate(rate)} {algorithm}"
            if key in projection.curves:
                ax_e.plot(projection.ranks, projection.curves[key], style, color=f"C{j}",
                          label=key if algorithm == "ring" or j == 0 else None)
    for c in checks:
        ax_e.plot(c["ranks"], c["efficiency_measured"], "s", ms=8, color="black", mfc="none")
        ax_e.annotate(f"measured ({c['interconnect'] or '?'})"[:48], (c["ranks"], c["efficiency_measured"]),
                      textcoords="offset points", xytext=(6, -3), fontsize=6)
        ax_e.plot(c["ranks"], c["efficiency_predicted_own_compute"], "x", ms=8, color="black")
    if checks:
        ax_e.plot([], [], "s", color="black", mfc="none", label="measured here (2 nodes share 2 cores)")
        ax_e.plot([], [], "x", color="black", label="model, same compute as measured")
    for k, anchor in enumerate(P.ANCHORS):
        ax_e.plot(anchor["ranks"], anchor["efficiency"], "*", ms=13, color=f"C{5 + k}", label=anchor["label"])
    ax_e.set_xscale("log", base=2)
    ax_e.set_xticks(projection.ranks)
    ax_e.set_xticklabels([str(n) for n in projection.ranks], fontsize=7)
    ax_e.set_ylim(0, 1.05)
    ax_e.set_xlabel("ranks (one per node for ring/tree; 8 per node for hierarchical)")
    ax_e.set_ylabel("weak-scaling efficiency T(1)/T(n)")
    ax_e.set_title("Projected efficiency (solid ring, dashed tree, dotted hierarchical)")
    ax_e.grid(alpha=0.3, which="both")
    ax_e.legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    fig.savefig(out / "projection.png", dpi=120)
    plt.close(fig)
    return ["projection.png"]
