"""Learning-study plans: experiments x seeds, each one resumable `hvd-rl train` run.

A plan is a small TOML file (see benchmarks/learning_atari.toml). Top-level keys are defaults for
every `[[experiment]]`, which may override them:

    name = "atari-10m"              # the study's directory: <run root>/learning/<name>
    algorithm = "ppo"               # with the env id, picks the reference points
    config = "configs/atari_ppo_cleanrl.toml"
    ranks = 2                       # N of `mpirun -np N`
    steps = 10_000_000              # global env steps (ppo.total_timesteps, or dqn's)
    seeds = [1, 2, 3]
    global_envs = 8                 # optional: env.num_envs = global_envs / ranks
    overrides = ["distributed.amp=off"]

    [[experiment]]
    name = "breakout"
    env = "ALE/Breakout-v5"         # optional: env.id
    acceptance = { mean_at_least = 16.0, each_above = 10.0 }   # optional, shown in the report

Relative paths in a plan are relative to the repository root, so a plan means the same thing
from any working directory and on a cluster. Every mistake raises one PlanError that names the
plan, the experiment and the key, before any run starts: a typo found after hours of training
costs hours.
"""
from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvd_rl import CHECKOUT

REPO = CHECKOUT
SUMMARY_FILE = "summary.json"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_DEFAULT_KEYS = {"algorithm", "config", "ranks", "steps", "seeds", "global_envs", "overrides"}
_PLAN_KEYS = _DEFAULT_KEYS | {"name", "description", "experiment"}
_EXPERIMENT_KEYS = _DEFAULT_KEYS | {"name", "env", "reference_env", "acceptance"}
_ACCEPTANCE_KEYS = {"mean_at_least", "each_above"}
# Config keys the plan itself sets for every run: an override of one would silently disagree
# with what the report says the run was.
_PLAN_OWNED = {"seed": "seeds", "run_dir": "the study's directory", "ppo.total_timesteps": "steps",
               "algorithm": "algorithm",
               "dqn.total_timesteps": "steps"}


class PlanError(ValueError):
    """A plan that cannot be run; the message says where and what."""


@dataclass(frozen=True)
class Experiment:
    name: str
    config: str
    steps: int
    ranks: int = 1
    seeds: tuple[int, ...] = (1,)
    algorithm: str = "ppo"
    env: str | None = None
    global_envs: int | None = None
    overrides: tuple[str, ...] = ()
    reference_env: str | None = None
    acceptance: dict[str, float] = field(default_factory=dict)

    @property
    def config_path(self) -> Path:
        path = Path(self.config)
        return path if path.is_absolute() else REPO / path

    @property
    def num_envs(self) -> int | None:
        """Environments per rank when the plan fixes the global count (sizes are per rank)."""
        return self.global_envs // self.ranks if self.global_envs else None

    def derived_overrides(self, seed: int) -> list[str]:
        section = "dqn" if self.algorithm == "dqn" else "ppo"  # MAPPO and IPPO take PPO's [ppo]
        sets = [f"seed={seed}", f"{section}.total_timesteps={self.steps}"]
        if self.algorithm in ("mappo", "ippo"):  # one config serves both: the plan says which trains
            sets.append(f"algorithm={self.algorithm}")
        if self.env:
            sets.append(f"env.id={json.dumps(self.env)}")
        if self.num_envs:
            sets.append(f"env.num_envs={self.num_envs}")
        return sets


@dataclass(frozen=True)
class RunSpec:
    """One (experiment, seed): a run directory and the exact command that trains it."""

    experiment: Experiment
    seed: int
    run_dir: Path
    extra_overrides: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.experiment.name}/seed{self.seed}"

    @property
    def log_file(self) -> Path:
        return self.run_dir.with_name(f"{self.run_dir.name}.log")

    def overrides(self) -> list[str]:
        """Plan overrides, then the command line's, then what the plan owns (seed, steps, env)."""
        return [*self.experiment.overrides, *self.extra_overrides, *self.experiment.derived_overrides(self.seed)]

    def config_args(self) -> list[str]:
        """`--config C --set ...`: what the run trains, without where."""
        args = ["--config", self.experiment.config]
        for text in self.overrides():
            args += ["--set", text]
        return args

    def train_args(self) -> list[str]:
        """Arguments of `hvd-rl` (after the launcher): `make train`'s, with this run's values."""
        config, *sets = self.config_args()[1:]
        return ["train", "--config", config, "--run-dir", str(self.run_dir), "--resume", "auto", *sets]

    def command(self, bin_dir: Path) -> list[str]:
        """`mpirun -np N --oversubscribe <venv>/bin/hvd-rl train ...` (1 rank: no mpirun)."""
        hvd_rl = [str(bin_dir / "hvd-rl"), *self.train_args()]
        if self.experiment.ranks == 1:
            return hvd_rl
        return ["mpirun", "-np", str(self.experiment.ranks), "--oversubscribe", *hvd_rl]


@dataclass(frozen=True)
class Plan:
    name: str
    path: Path
    experiments: tuple[Experiment, ...]
    description: str = ""

    def default_out(self, run_root: str | Path = "runs") -> Path:
        root = Path(run_root)
        return (root if root.is_absolute() else REPO / root) / "learning" / self.name

    def runs(self, out: Path, extra_overrides: list[str] | tuple[str, ...] = ()) -> list[RunSpec]:
        """Every (experiment, seed) in plan order: the order of a sequential study and of the
        SLURM array's elements."""
        out = Path(out).resolve()
        return [RunSpec(exp, seed, out / exp.name / f"seed{seed}", tuple(extra_overrides))
                for exp in self.experiments for seed in exp.seeds]


# ---- parsing --------------------------------------------------------------------------------

def _fail(where: str, message: str) -> PlanError:
    return PlanError(f"{where}: {message}")


def _positive_int(value: Any, where: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _fail(where, f"{key} must be a positive integer, got {value!r}")
    return value


def _check_keys(table: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise _fail(where, f"unknown key '{unknown[0]}' (valid: {', '.join(sorted(allowed))})")


def _overrides(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(where, f"overrides must be a list of 'section.key=value' strings, got {value!r}")
    for text in value:
        key = text.split("=", 1)[0].strip()
        if "=" not in text or not key:
            raise _fail(where, f"override {text!r}: expected 'section.key=value'")
        if key in _PLAN_OWNED:
            raise _fail(where, f"override {text!r}: {key} is set by the plan ({_PLAN_OWNED[key]}), not by overrides")
    return tuple(value)


def _experiment(raw: Any, defaults: dict[str, Any], where: str) -> Experiment:
    if not isinstance(raw, dict):
        raise _fail(where, "each [[experiment]] must be a table")
    _check_keys(raw, _EXPERIMENT_KEYS, where)
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _fail(where, f"name must be letters, digits, '_', '-' or '.', got {name!r}")
    where = f"{where} '{name}'"
    merged = {**defaults, **{k: v for k, v in raw.items() if k != "overrides"}}
    overrides = _overrides(defaults.get("overrides", []), where) + _overrides(raw.get("overrides", []), where)

    config = merged.get("config")
    if not isinstance(config, str) or not config:
        raise _fail(where, "config (a training config file) is missing")
    steps = merged.get("steps")
    if steps is None:
        raise _fail(where, "steps (global env steps per run) is missing")
    steps = _positive_int(steps, where, "steps")
    ranks = _positive_int(merged.get("ranks", 1), where, "ranks")
    seeds = merged.get("seeds", [1])
    if (not isinstance(seeds, list) or not seeds or len(set(seeds)) != len(seeds)
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)):
        raise _fail(where, f"seeds must be a non-empty list of distinct integers >= 0, got {seeds!r}")
    global_envs = merged.get("global_envs")
    if global_envs is not None:
        global_envs = _positive_int(global_envs, where, "global_envs")
        if global_envs % ranks:
            raise _fail(where, f"global_envs = {global_envs} does not split over {ranks} ranks "
                               "(env.num_envs = global_envs / ranks must be whole)")
        if any(o.split("=", 1)[0].strip() == "env.num_envs" for o in overrides):
            raise _fail(where, "set either global_envs or an env.num_envs override, not both")
    env = merged.get("env")
    if env is not None and (not isinstance(env, str) or not env):
        raise _fail(where, f"env must be an environment id, got {env!r}")
    if env is not None and any(o.split("=", 1)[0].strip() == "env.id" for o in overrides):
        raise _fail(where, "set either env or an env.id override, not both")
    for key in ("algorithm", "reference_env"):
        if key in merged and (not isinstance(merged[key], str) or not merged[key]):
            raise _fail(where, f"{key} must be a non-empty string, got {merged[key]!r}")
    acceptance = merged.get("acceptance", {})
    if not isinstance(acceptance, dict):
        raise _fail(where, "acceptance must be a table like { mean_at_least = 16.0, each_above = 10.0 }")
    _check_keys(acceptance, _ACCEPTANCE_KEYS, f"{where} acceptance")
    for key, value in acceptance.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(where, f"acceptance.{key} must be a number, got {value!r}")
    exp = Experiment(name=name, config=config, steps=steps, ranks=ranks, seeds=tuple(seeds),
                     algorithm=merged.get("algorithm", "ppo"), env=env, global_envs=global_envs,
                     overrides=overrides, reference_env=merged.get("reference_env"),
                     acceptance={k: float(v) for k, v in acceptance.items()})
    if not exp.config_path.is_file():
        raise _fail(where, f"config file not found: {exp.config_path}")
    return exp


def parse_plan(text: str, path: str | Path = "<plan>") -> Plan:
    where = f"plan {path}"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _fail(where, f"invalid TOML: {exc}") from None
    _check_keys(data, _PLAN_KEYS, where)
    name = data.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _fail(where, f"name must be letters, digits, '_', '-' or '.', got {name!r}")
    raw_experiments = data.get("experiment")
    if not isinstance(raw_experiments, list) or not raw_experiments:
        raise _fail(where, "no [[experiment]] tables")
    defaults = {k: v for k, v in data.items() if k in _DEFAULT_KEYS}
    experiments = tuple(_experiment(raw, defaults, f"{where}: experiment {i + 1}")
                        for i, raw in enumerate(raw_experiments))
    names = [e.name for e in experiments]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise _fail(where, f"two experiments are named '{duplicate}' (names are directories)")
    return Plan(name=name, path=Path(path), experiments=experiments, description=str(data.get("description", "")))


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanError(f"plan {path}: cannot read it: {exc.strerror or exc}") from None
    return parse_plan(text, path)


# ---- run state ------------------------------------------------------------------------------

def read_summary(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(run_dir) / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return {}


def is_completed(run_dir: Path, steps: int) -> bool:
    """Finished to at least the planned steps (a later plan with more steps reopens it)."""
    summary = read_summary(run_dir)
    return summary.get("status") == "completed" and int(summary.get("global_step", 0)) >= steps


def is_started(run_dir: Path) -> bool:
    return (Path(run_dir) / "metrics.jsonl").exists() or (Path(run_dir) / "checkpoints").is_dir()


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# Sections that do not change what a run learns (where it logs, how often it checkpoints).
_NEUTRAL = ("run_dir", "logging.", "checkpoint.", "debug.iteration_sleep")


def config_conflicts(spec: RunSpec) -> list[str]:
    """Differences between the config a started run was trained with and what the plan asks now.

    Resuming such a run would splice two different trainings into one curve (a longer
    ppo.total_timesteps, for one, reshapes the learning-rate schedule half-way)."""
    from hvd_rl.config import load_config  # here: keeps this module light for `hvd-rl slurm render`

    from hvd_rl.runtime.metrics import read_metrics

    conflicts = []
    rows = read_metrics(spec.run_dir)
    if rows and rows[-1].get("world_size") not in (None, spec.experiment.ranks):
        conflicts.append(f"ranks: {rows[-1]['world_size']} in the run, {spec.experiment.ranks} in the plan")
    recorded = spec.run_dir / "config.toml"
    if recorded.exists():
        old = _flatten(load_config(recorded).to_dict())
        new = _flatten(load_config(spec.experiment.config_path, spec.overrides()).to_dict())
        conflicts += [f"{key}: {old.get(key)!r} in the run, {new.get(key)!r} in the plan"
                      for key in sorted(set(old) | set(new))
                      if not key.startswith(_NEUTRAL) and old.get(key) != new.get(key)]
    return conflicts
