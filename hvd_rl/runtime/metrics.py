"""Run outputs written by rank 0: metrics.jsonl, TensorBoard events (and W&B), a console line per iteration."""
from __future__ import annotations

import json
import math
import os
import sys
from collections import deque
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
EPISODES_FILE = "episodes.jsonl"  # one row per finished game: global_step, return, length
ENV_SEEDS_FILE = "env_seeds.jsonl"  # one row per environment build: iteration before it, seeds by rank
BALANCE_FILE = "balance.jsonl"  # one row per load-balancer decision: after which iteration, from, to
CONSOLE_EXTRAS = (("approx_kl", "kl"), ("td_loss", "td loss"), ("epsilon", "eps"))  # when present


class RemainingTime:
    """Seconds to `total` steps at the pace of the last `window` iterations. The pace of a whole
    run would promise far too early an end where it changes: DQN runs ~6x slower once learning
    starts."""

    def __init__(self, window: int = 10):
        self._points: deque[tuple[float, int]] = deque(maxlen=window + 1)

    def start(self, now: float, step: int) -> None:
        self._points.clear()
        self._points.append((now, step))

    def update(self, now: float, step: int, total: int) -> float:
        self._points.append((now, step))
        (t0, s0), (t1, s1) = self._points[0], self._points[-1]
        return (total - s1) * (t1 - t0) / (s1 - s0) if s1 > s0 else float("nan")


def _clean(value: Any) -> Any:
    """JSON has no NaN/Inf: write them as null rather than produce an unparsable line."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file; a torn last line (a crash mid-write) is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's metrics rows; a torn last line (a crash mid-write) is skipped."""
    return read_jsonl(Path(run_dir) / METRICS_FILE)


def read_episodes(run_dir: str | Path) -> list[dict[str, Any]]:
    return read_jsonl(Path(run_dir) / EPISODES_FILE)


def _rewrite(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(tmp, path)


def truncate_metrics(run_dir: str | Path, last_iteration: int, last_global_step: int | None = None) -> None:
    """On resume, drop rows from iterations after the checkpoint (they will be run again)."""
    path = Path(run_dir) / METRICS_FILE
    if path.exists():
        _rewrite(path, [row for row in read_metrics(run_dir) if row.get("iteration", 0) <= last_iteration])
    episodes = Path(run_dir) / EPISODES_FILE
    if episodes.exists() and last_global_step is not None:
        _rewrite(episodes, [row for row in read_episodes(run_dir) if row.get("global_step", 0) <= last_global_step])
    # A decision after the checkpoint's iteration is rolled back; so is a build after it (the build
    # right after the checkpoint, at its iteration, happens again with the same seeds).
    for name, keep in ((BALANCE_FILE, lambda i: i <= last_iteration), (ENV_SEEDS_FILE, lambda i: i < last_iteration)):
        path = Path(run_dir) / name
        if path.exists():
            _rewrite(path, [row for row in read_jsonl(path) if keep(row.get("iteration", 0))])


def _chart_group(key: str) -> str:
    if key.startswith("time_"):
        return "time"
    if key.startswith("return_"):  # multi-agent: each agent's return (return_<agent>)
        return "agents"
    if key in ("episodic_return_mean", "episodic_length_mean", "sps", "learning_rate", "episodes", "world_size") \
            or key.endswith(("_rate", "_per_episode")):  # multi-agent tasks' statistics: collision_rate, ...
        return "charts"
    return "losses"


def chart_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of a metrics row as charts name them (TensorBoard, W&B): charts/, losses/,
    time/, agents/ (multi-agent: each agent's return), and ranks/<metric>/rank<i> for the per-rank
    load figures."""
    scalars: dict[str, float] = {}
    for key, value in record.items():
        if key.endswith("_by_rank") and isinstance(value, list):  # load monitoring
            for rank, item in enumerate(value):
                if isinstance(item, (int, float)) and not isinstance(item, bool):
                    scalars[f"ranks/{key[:-len('_by_rank')]}/rank{rank}"] = item
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("iteration", "global_step"):
            scalars[f"{_chart_group(key)}/{key}"] = value
    return scalars


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(seconds)
    hours, rem = divmod(seconds, 3600)
    minutes, secs = divmod(rem, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class MetricsLogger:
    """Owned by rank 0 alone; other ranks never create one."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, console: bool = True,
                 purge_step: int | None = None, tracker: Any = None):
        """`purge_step`: on resume, TensorBoard drops the events of steps >= it (the iterations
        after the checkpoint are run again), as metrics.jsonl is truncated. `tracker`: a
        tracking.WandbTracker that gets the same scalars (except at steps it already holds), or None."""
        self.run_dir = Path(run_dir)
        self._tracker = tracker
        self._tracker_skip_noted = False
        self._jsonl = open(self.run_dir / METRICS_FILE, "a", buffering=1)
        self._episodes = open(self.run_dir / EPISODES_FILE, "a", buffering=1)
        self._console = console
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=purge_step)

    def log(self, record: dict[str, Any], total_timesteps: int, eta_seconds: float) -> None:
        clean = {k: _clean(v) for k, v in record.items()}
        self._jsonl.write(json.dumps(clean) + "\n")
        self._jsonl.flush()
        step = record["global_step"]
        if self._tb is not None or self._tracker is not None:
            scalars = chart_scalars(clean)
            if self._tb is not None:
                for name, value in scalars.items():
                    self._tb.add_scalar(name, value, step)
            if self._tracker is not None and not self._tracker.log(scalars, step) and not self._tracker_skip_noted:
                self._tracker_skip_noted = True
                self.note(f"W&B already holds global steps up to {self._tracker.logged_through} (logged before "
                          "this restart): the iterations run again up to there go to metrics.jsonl and "
                          "TensorBoard, not to W&B again")
        if self._console:
            ret = record.get("episodic_return_mean")
            ret_text = f"return {ret:9.2f} ({record['episodes']} ep)" if ret is not None else "return       n/a"
            learning = "".join(f" | {label} {record[key]:.4f}" for key, label in CONSOLE_EXTRAS
                               if isinstance(record.get(key), (int, float)))
            print(f"[hvd_rl] it {record['iteration']:5d} | step {step:>11,d}/{total_timesteps:,d} | "
                  f"{record['sps']:8.0f} SPS | {ret_text}{learning} | "
                  f"ETA {format_duration(eta_seconds)}", flush=True)

    def episodes(self, global_step: int, returns: Any, lengths: Any) -> None:
        """Every game finished in an iteration (all ranks), stamped with the iteration's end step."""
        if len(returns):
            self._episodes.write("".join(
                json.dumps({"global_step": global_step, "return": float(r), "length": int(n)}) + "\n"
                for r, n in zip(returns, lengths)))
            self._episodes.flush()

    def summary(self, data: dict[str, Any]) -> None:
        """The run's summary.json, for the tracker's run summary."""
        if self._tracker is not None:
            self._tracker.summary(data)

    def note(self, message: str) -> None:
        if self._console:
            print(f"[hvd_rl] {message}", flush=True)

    def close(self) -> None:
        self._jsonl.close()
        self._episodes.close()
        if self._tb is not None:
            self._tb.close()
        if self._tracker is not None:
            self._tracker.close()


def log_line(message: str, stream=sys.stdout) -> None:
    print(f"[hvd_rl] {message}", file=stream, flush=True)
