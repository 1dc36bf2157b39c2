"""Sweep files: the base training config, the search space over its dotted keys, the objective and
the study's budget (issue 35). Everything is checked before a trial starts.

    # configs/sweeps/acrobot_ppo.toml
    name = "acrobot-ppo"
    config = "configs/acrobot_ppo.toml"     # relative to the repository root, like plans
    overrides = ["ppo.total_timesteps=100_000"]
    ranks = 2                               # ranks of every trial's `hvd-rl train`
    trials = 16                             # complete + pruned trials the study ends with
    seeds = [1]                             # each trial trains once per seed (and per env)
    sampler = "tpe"                         # tpe | random | grid
    pruner = "median"                       # median | hyperband | none
    reports_per_run = 8                     # running objective reported at 1/8, 2/8 ... of the steps

    [objective]
    last_episodes = 50                      # mean of each run's last 50 episodic returns
    envs = ["Acrobot-v1"]                   # optional: several envs (env.id), each normalised ...
    normalize = { "Acrobot-v1" = [-500.0, 0.0] }   # ... to [low, high] as CleanRL's tuner does

    [space]
    "ppo.learning_rate" = { log_uniform = [1e-4, 1e-2] }
    "ppo.ent_coef" = { uniform = [0.0, 0.05] }
    "ppo.update_epochs" = { int = [2, 10] }
    "ppo.num_minibatches" = { choice = [2, 4, 8] }
    "env.num_envs" = { grid = [4, 8] }      # grid: every value, in order, under sampler = "grid"

Each value of every dimension is tried up front on the base config with `validate()` at the
trial's rank count (the ends of a range, every choice): one it refuses, an unknown key, an empty
range or a type the setting does not take is one SweepError naming the file and the key. Points
refused only in combination are recorded at trial time as failed trials with the reason.
"""
from __future__ import annotations

import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvd_rl import CHECKOUT
from hvd_rl.config import ConfigError, TrainConfig, config_problems, load_config, section_classes

SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "hyperband", "none")
KINDS = ("log_uniform", "uniform", "int", "choice", "grid")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TOP_KEYS = {"name", "description", "config", "overrides", "ranks", "trials", "seeds", "sampler", "pruner",
             "reports_per_run", "startup_trials", "warmup_reports", "max_failed", "space", "objective"}
_OBJECTIVE_KEYS = {"last_episodes", "envs", "normalize"}
# Set by the sweep for every run: a dimension over one of them would disagree with the bookkeeping.
_SWEEP_OWNED = {"seed": "seeds", "run_dir": "the study directory", "env.id": "objective.envs"}


class SweepError(ValueError):
    """A sweep file that cannot run; the message names the file and the key."""


@dataclass(frozen=True)
class Dimension:
    """One searched setting: a dotted config key and how its values are drawn."""

    key: str
    kind: str
    values: tuple[Any, ...]  # (low, high) for ranges, the choices otherwise

    def suggest(self, trial: Any) -> Any:
        """The value of this trial (Optuna returns the stored one when the trial is resumed)."""
        if self.kind == "log_uniform":
            return trial.suggest_float(self.key, *self.values, log=True)
        if self.kind == "uniform":
            return trial.suggest_float(self.key, *self.values)
        if self.kind == "int":
            return trial.suggest_int(self.key, *self.values)
        return trial.suggest_categorical(self.key, list(self.values))

    def probe_values(self) -> list[Any]:
        """What is checked up front: a range's ends (and middle), every choice."""
        if self.kind in ("choice", "grid"):
            return list(self.values)
        low, high = self.values
        middle = math.sqrt(low * high) if self.kind == "log_uniform" else (low + high) / 2
        return [low, int(round(middle)) if self.kind == "int" else middle, high]


@dataclass(frozen=True)
class Objective:
    last_episodes: int = 100
    envs: tuple[str, ...] = ()  # empty: the base config's env.id
    normalize: dict[str, tuple[float, float]] = field(default_factory=dict)

    def score(self, env_id: str, mean_return: float) -> float:
        """A run's mean return, normalised to [low, high] -> [0, 1] when the sweep says so."""
        if env_id not in self.normalize:
            return mean_return
        low, high = self.normalize[env_id]
        return (mean_return - low) / (high - low)


@dataclass(frozen=True)
class SweepSpec:
    name: str
    path: Path
    config: str
    space: tuple[Dimension, ...]
    objective: Objective
    trials: int
    ranks: int = 1
    seeds: tuple[int, ...] = (1,)
    overrides: tuple[str, ...] = ()
    sampler: str = "tpe"
    pruner: str = "median"
    reports_per_run: int = 8
    startup_trials: int = 4  # trials before the sampler models and the pruner judges
    warmup_reports: int = 2  # reports of a run before it may be pruned
    max_failed: int = 0  # failed trials (refused points, crashes) after which workers stop; 0: trials
    description: str = ""

    @property
    def config_path(self) -> Path:
        path = Path(self.config)
        return path if path.is_absolute() else CHECKOUT / path

    def base_config(self, extra: list[str] | tuple[str, ...] = ()) -> TrainConfig:
        return load_config(self.config_path, [*self.overrides, *extra])

    def env_ids(self) -> tuple[str, ...]:
        return self.objective.envs or (self.base_config().env.id,)

    def runs(self) -> list[tuple[str, int]]:
        """(env id, seed) of each run of a trial, in the order they train."""
        return [(env, seed) for seed in self.seeds for env in self.env_ids()]

    def run_overrides(self, params: dict[str, Any], env_id: str, seed: int) -> list[str]:
        """The sweep's overrides, then the trial's values, then what the sweep owns."""
        return [*self.overrides, *(f"{key}={json.dumps(value)}" for key, value in params.items()),
                f"seed={seed}", f"env.id={json.dumps(env_id)}"]

    def refusal(self, params: dict[str, Any], env_id: str, seed: int, ranks: int | None = None) -> str | None:
        """Why `validate()` refuses this point at the trial's rank count, or None."""
        try:
            cfg = load_config(self.config_path, self.run_overrides(params, env_id, seed))
        except ConfigError as exc:
            return str(exc)
        problems = config_problems(cfg, world_size=ranks or self.ranks)
        return "; ".join(problems) if problems else None

    def failure_budget(self) -> int:
        return self.max_failed or self.trials

    def grid_space(self) -> dict[str, list[Any]]:
        return {d.key: list(d.values) for d in self.space}


# ---- parsing --------------------------------------------------------------------------------

def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SweepError(f"{where} must be a positive integer, got {value!r}")
    return value


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SweepError(f"{where} must be a finite number, got {value!r}")
    return value


def _dimension(key: str, raw: Any, where: str) -> Dimension:
    where = f"{where}: space {key!r}"
    if key in _SWEEP_OWNED:
        raise SweepError(f"{where}: {key} is set by the sweep ({_SWEEP_OWNED[key]}), not searched")
    if not isinstance(raw, dict) or len(raw) != 1 or next(iter(raw)) not in KINDS:
        raise SweepError(f"{where}: expected one of {{ {' | '.join(f'{k} = [...]' for k in KINDS)} }}, got {raw!r}")
    kind, values = next(iter(raw.items()))
    if not isinstance(values, list) or not values:
        raise SweepError(f"{where}: {kind} needs a non-empty list, got {values!r}")
    if kind in ("choice", "grid"):
        if len(set(map(json.dumps, values))) != len(values):
            raise SweepError(f"{where}: {kind} lists a value twice")
        return Dimension(key, kind, tuple(values))
    if len(values) != 2:
        raise SweepError(f"{where}: {kind} needs [low, high], got {values!r}")
    low, high = (_number(v, where) for v in values)
    if kind == "int" and not all(isinstance(v, int) for v in values):
        raise SweepError(f"{where}: int needs integer ends, got {values!r}")
    if not low < high:
        raise SweepError(f"{where}: empty range [{low}, {high}] (low must be below high)")
    if kind == "log_uniform" and low <= 0:
        raise SweepError(f"{where}: log_uniform needs low > 0, got {low}")
    return Dimension(key, kind, (low, high))


def _objective(raw: Any, where: str) -> Objective:
    if not isinstance(raw, dict):
        raise SweepError(f"{where}: [objective] must be a table")
    unknown = sorted(set(raw) - _OBJECTIVE_KEYS)
    if unknown:
        raise SweepError(f"{where}: unknown key 'objective.{unknown[0]}' (valid: {', '.join(sorted(_OBJECTIVE_KEYS))})")
    envs = raw.get("envs", [])
    if not isinstance(envs, list) or not all(isinstance(e, str) and e for e in envs) or len(set(envs)) != len(envs):
        raise SweepError(f"{where}: objective.envs must be a list of distinct env ids, got {envs!r}")
    normalize: dict[str, tuple[float, float]] = {}
    for env_id, bounds in (raw.get("normalize") or {}).items():
        if env_id not in envs:
            raise SweepError(f"{where}: objective.normalize names {env_id!r}, which is not in objective.envs")
        if not isinstance(bounds, list) or len(bounds) != 2:
            raise SweepError(f"{where}: objective.normalize.{env_id} must be [low, high]")
        low, high = (_number(b, f"{where}: objective.normalize.{env_id}") for b in bounds)
        if not low < high:
            raise SweepError(f"{where}: objective.normalize.{env_id}: empty range [{low}, {high}]")
        normalize[env_id] = (float(low), float(high))
    if len(envs) > 1 and set(normalize) != set(envs):
        missing = sorted(set(envs) - set(normalize))[0]
        raise SweepError(f"{where}: several envs are averaged after normalising each: objective.normalize "
                         f"needs [low, high] for {missing!r}")
    return Objective(_positive_int(raw.get("last_episodes", 100), f"{where}: objective.last_episodes"),
                     tuple(envs), normalize)


def parse_sweep(text: str, path: Path) -> SweepSpec:
    where = str(path)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SweepError(f"{where}: invalid TOML: {exc}") from None
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise SweepError(f"{where}: unknown key {unknown[0]!r} (valid: {', '.join(sorted(_TOP_KEYS))})")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise SweepError(f"{where}: name must be letters, digits, '_', '-' or '.', got {name!r}")
    config = raw.get("config")
    if not isinstance(config, str) or not config:
        raise SweepError(f"{where}: config (the base training config) is missing")
    overrides = raw.get("overrides", [])
    if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
        raise SweepError(f"{where}: overrides must be a list of 'section.key=value' strings")
    for text_ in overrides:
        if text_.split("=", 1)[0].strip() in _SWEEP_OWNED:
            raise SweepError(f"{where}: override {text_!r} sets what the sweep owns")
    space_raw = raw.get("space")
    if not isinstance(space_raw, dict) or not space_raw:
        raise SweepError(f"{where}: [space] is missing or empty: nothing to search")
    space = tuple(_dimension(key, value, where) for key, value in space_raw.items())
    seeds = raw.get("seeds", [1])
    if (not isinstance(seeds, list) or not seeds or len(set(seeds)) != len(seeds)
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)):
        raise SweepError(f"{where}: seeds must be a non-empty list of distinct non-negative integers, got {seeds!r}")
    for key, choices in (("sampler", SAMPLERS), ("pruner", PRUNERS)):
        if raw.get(key, choices[0]) not in choices:
            raise SweepError(f"{where}: {key} must be one of {', '.join(choices)}, got {raw[key]!r}")
    spec = SweepSpec(
        name=name, path=path, config=config, space=space, objective=_objective(raw.get("objective", {}), where),
        trials=_positive_int(raw.get("trials"), f"{where}: trials"),
        ranks=_positive_int(raw.get("ranks", 1), f"{where}: ranks"), seeds=tuple(seeds),
        overrides=tuple(overrides), sampler=raw.get("sampler", "tpe"), pruner=raw.get("pruner", "median"),
        reports_per_run=_positive_int(raw.get("reports_per_run", 8), f"{where}: reports_per_run"),
        startup_trials=_positive_int(raw.get("startup_trials", 4), f"{where}: startup_trials"),
        warmup_reports=_positive_int(raw.get("warmup_reports", 2), f"{where}: warmup_reports"),
        max_failed=_positive_int(raw["max_failed"], f"{where}: max_failed") if "max_failed" in raw else 0,
        description=str(raw.get("description", "")))
    _check_runnable(spec, where)
    return spec


def _check_runnable(spec: SweepSpec, where: str) -> None:
    """Base config, every probe value of every dimension on it, the grid's size."""
    if not spec.config_path.is_file():
        raise SweepError(f"{where}: config file not found: {spec.config_path}")
    try:
        base = spec.base_config()
    except ConfigError as exc:
        raise SweepError(f"{where}: {exc}") from None
    if base.algorithm not in ("ppo", "dqn", "mappo", "ippo"):
        raise SweepError(f"{where}: unknown algorithm {base.algorithm!r}")
    if spec.sampler == "grid":
        loose = [d.key for d in spec.space if d.kind not in ("grid", "choice")]
        if loose:
            raise SweepError(f"{where}: sampler = 'grid' needs every dimension as grid or choice; "
                             f"{loose[0]!r} is a range")
        size = math.prod(len(d.values) for d in spec.space)
        if spec.trials > size:
            raise SweepError(f"{where}: trials = {spec.trials} but the grid has {size} point(s)")
    sections = section_classes()
    for dim in spec.space:
        section, _, name = dim.key.partition(".")
        field_type = getattr(sections.get(section), "__annotations__", {}).get(name)
        if dim.kind in ("uniform", "log_uniform") and field_type in (int, "int"):
            raise SweepError(f"{where}: space {dim.key!r} is an integer setting: use int = [low, high], "
                             f"not {dim.kind}")
    env_id, seed = spec.runs()[0]
    for env in spec.env_ids():
        why = spec.refusal({}, env, seed)
        if why:
            raise SweepError(f"{where}: the base config is refused for {env}: {why}")
    for dim in spec.space:
        for value in dim.probe_values():
            why = spec.refusal({dim.key: value}, env_id, seed)
            if why:
                raise SweepError(f"{where}: space {dim.key!r} = {value!r} is refused: {why}")


def load_sweep(path: str | Path) -> SweepSpec:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SweepError(f"sweep file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SweepError(f"{path}: cannot read: {exc}") from None
    return parse_sweep(text, path)
