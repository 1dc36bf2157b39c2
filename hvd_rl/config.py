"""Run configuration: dataclasses loaded from TOML, `--set section.key=value` overrides, validation.

Every rank loads and validates the same files, so a bad value fails identically everywhere before
Horovod, an environment or a network exists: one message, non-zero exit on every rank, no hang.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration problem the user must fix; the message lists every problem found."""


def _one_line(text: str, limit: int = 400) -> str:
    """Text from the user (values, keys, ids) as one printable line of bounded length."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else f"{text[:limit // 2]} ... {text[-limit // 2:]}"


def _show(value: Any) -> str:
    """A value in a message: repr'd, one line, a few hundred characters at most."""
    return _one_line(repr(value), 120)


def _problems_message(problems: list[str]) -> str:
    problems = [_one_line(p) for p in problems]
    if len(problems) == 1:
        return f"invalid configuration: {problems[0]}"
    return f"invalid configuration ({len(problems)} problems): " + "; ".join(problems)


_INT_RANGE = 2 ** 63  # every integer setting ends up in numpy/torch/C (int64)


@dataclass
class EnvConfig:
    id: str = "CartPole-v1"  # a registered Gymnasium id, e.g. ALE/Breakout-v5, Hopper-v5
    # sync | async (Gymnasium vector envs) | ale_vector (ale-py's C++ AtariVectorEnv, Atari only)
    backend: str = "sync"
    num_envs: int = 4  # per rank
    # Atari preprocessing (used only for ALE environments): CleanRL's ppo_atari recipe.
    frame_skip: int = 4
    frame_stack: int = 4  # frames stacked into one observation
    noop_max: int = 30  # up to this many random no-op frames after each reset
    screen_size: int = 84  # frames resized to screen_size x screen_size grayscale
    episodic_life: bool = True  # a lost life ends the episode for training (not for the score)
    fire_reset: bool = True  # press FIRE after a reset and a lost life, where the game needs it
    clip_rewards: bool = True  # train on the sign of the reward
    repeat_action_probability: float = 0.0  # sticky actions at the ALE level (0 = NoFrameskip-v4)
    max_episode_steps: int = 0  # 0 = the environment's own limit
    env_threads: int = 0  # ale_vector: envs stepped at once (C++ threads); 0 = this rank's CPU threads


@dataclass
class ModelConfig:
    kind: str = "auto"  # auto (nature_cnn for image observations, mlp otherwise) | nature_cnn | mlp
    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])  # mlp layers (actor and critic each)


@dataclass
class PPOConfig:
    total_timesteps: int = 500_000  # global environment steps, all ranks together
    num_steps: int = 128  # rollout length per environment
    learning_rate: float = 2.5e-4  # Adam step size (annealed linearly to 0 when anneal_lr)
    adam_eps: float = 1e-5  # Adam epsilon (CleanRL: 1e-5)
    anneal_lr: bool = True  # linear learning-rate decay over anneal_timesteps
    # Horizon of the linear annealing, in global steps; 0 = total_timesteps. Set it to a longer
    # run's length to reproduce that run's curve up to an earlier step (e.g. CleanRL's 10M
    # schedule, stopped at 1M).
    anneal_timesteps: int = 0
    gamma: float = 0.99  # discount
    gae_lambda: float = 0.95  # GAE lambda
    num_minibatches: int = 4  # minibatches per epoch (each an allreduce of the gradient)
    update_epochs: int = 4  # passes over the rollout per iteration
    norm_adv: bool = True  # normalise advantages per minibatch
    # Normalise advantages with allreduced (global) minibatch statistics, so N ranks compute the
    # same update as one process on the whole batch. False uses each rank's local statistics.
    global_advantage_norm: bool = True
    clip_coef: float = 0.2  # PPO's policy-ratio clip
    clip_vloss: bool = True  # clip the value loss as CleanRL does
    ent_coef: float = 0.01  # entropy bonus weight
    vf_coef: float = 0.5  # value loss weight
    max_grad_norm: float = 0.5  # 0 disables clipping
    target_kl: float = 0.0  # 0 disables KL early stopping
    backward_passes_per_step: int = 1  # micro-batches per minibatch, one allreduce per minibatch
    # CleanRL's ppo_continuous_action preprocessing. Statistics are merged over all ranks once
    # per iteration (so every rank normalises identically) and frozen during a rollout.
    normalize_observations: bool = False  # running mean/std of observations
    normalize_rewards: bool = False  # scale rewards by the std of the discounted return
    observation_clip: float = 10.0  # normalised observations are clipped to +-this
    reward_clip: float = 10.0  # scaled rewards are clipped to +-this
    # "sync": sample, then learn. "overlap": a sampler thread collects the next rollout with the
    # weights from before this update while the learner works (a one-step policy lag; the PPO
    # ratio uses the behaviour policy's stored log-probabilities). hvd_rl/algorithms/sampler.py.
    pipeline: str = "sync"


@dataclass
class DQNConfig:
    """CleanRL's dqn.py defaults (CartPole); configs/atari_dqn.toml has dqn_atari.py's."""

    total_timesteps: int = 500_000  # global environment steps, all ranks together
    learning_rate: float = 2.5e-4  # Adam step size
    adam_eps: float = 1e-8  # Adam epsilon
    buffer_size: int = 10_000  # transitions over all ranks; each rank's shard holds its share
    gamma: float = 0.99  # discount
    tau: float = 1.0  # target network update rate (1 = hard copy)
    target_network_frequency: int = 500  # global env steps between target updates
    batch_size: int = 128  # samples per gradient update over all ranks (each rank draws its share)
    start_e: float = 1.0  # epsilon at the start
    end_e: float = 0.05  # epsilon after exploration_fraction of the run
    exploration_fraction: float = 0.5  # of total_timesteps to anneal epsilon over
    learning_starts: int = 10_000  # global env steps of experience before learning (also after a
    #                                resume without the replay shards: they refill first)
    train_frequency: int = 10  # global env steps per gradient update: replay ratio 1/train_frequency
    steps_per_iteration: int = 1000  # global env steps per iteration (one metrics row)
    max_grad_norm: float = 0.0  # 0: no clipping (CleanRL)
    apex_epsilon: bool = False  # Ape-X: env i of N explores with eps^(1 + alpha i / (N - 1))
    apex_base_epsilon: float = 0.4  # Ape-X: eps
    apex_alpha: float = 7.0  # Ape-X: alpha
    checkpoint_replay: bool = False  # also write each rank's replay shard at every checkpoint


@dataclass
class MultiAgentConfig:
    """Cooperative multi-agent PPO (algorithm = "mappo" | "ippo", hvd_rl/algorithms/mappo.py) on a
    multi-agent env.id (hvd_rl/envs/multiagent.py); the PPO hyperparameters come from [ppo]."""

    num_agents: int = 0  # agents per environment (0: the task's default, e.g. 3 for simple_spread)
    agent_id: bool = True  # a one-hot agent id beside every agent's input (one shared actor)
    # MAPPO's finding: value targets normalised by running mean/std statistics merged over ranks
    value_normalization: bool = True


@dataclass
class DistributedConfig:
    reduction: str = "average"  # average | adasum
    # none | fp16 (Horovod's) | powersgd | topk (hvd_rl/runtime/compression.py: error feedback, for slow links)
    compression: str = "none"
    powersgd_rank: int = 4  # rank of PowerSGD's low-rank approximation
    topk_ratio: float = 0.01  # fraction of the gradient entries top-k sends
    threads_per_rank: int = 0  # 0 = CPUs available to this rank / ranks sharing them
    device: str = "auto"  # auto | cpu | cuda  (cuda: one device per local rank)
    # off | auto | bf16 | fp16: autocast for rollout inference and learner alike (see precision.py);
    # auto = bf16 for CNNs where the CPU/GPU does bf16 natively, fp32 otherwise
    amp: str = "auto"
    # Waiting without burning the core (see distributed.apply_runtime_settings); an environment
    # variable set by the user or launcher takes precedence over these.
    mpi_yield_when_idle: bool = True  # OMPI_MCA_mpi_yield_when_idle
    # HOROVOD_CYCLE_TIME, set explicitly (so runs record it); 0 = leave Horovod's default (1 ms).
    # 1 ms beat 2 ms in 10 of 12 rotated rounds (benchmarks/results/throughput/runtime_settings_cycle1.txt).
    cycle_time_ms: float = 1.0
    # HOROVOD_HIERARCHICAL_ALLREDUCE=1: reduce within each node, then across nodes. Horovod applies
    # it only to NCCL (GPU) allreduces across several nodes; summary.json says whether it was active.
    hierarchical_allreduce: bool = False
    # Keep freed memory in the process instead of returning it to the OS between iterations
    # (hvd_rl/runtime/heap.py): measured, PPO updates 1.3 s -> 0.95 s without ~155K page faults each.
    retain_freed_memory: bool = True
    verify_every: int = 0  # check parameters agree across ranks every K iterations (0: at the end)
    # Environments per rank in proportion to each rank's measured speed (hvd_rl/runtime/balance.py):
    # off | static (decide once, after the first window) | dynamic (every balance_every iterations)
    balance: str = "off"
    # Environments per rank, one entry per rank, for nodes known to differ (empty: env.num_envs on
    # every rank). Another number of entries than ranks is refused at startup; an elastic job's
    # world of another size (a resize) falls back to env.num_envs each.
    env_counts: list[int] = field(default_factory=list)
    balance_every: int = 5  # iterations per measurement window / decision
    balance_threshold: float = 0.05  # act only if the slowest rank gets at least this much faster
    balance_min_envs: int = 1  # environments every rank keeps
    elastic_min_np: int = 1  # informational for `hvd-rl train --elastic`; horovodrun enforces it
    # Seconds without an answer from the other ranks (a heartbeat over Horovod, hvd_rl/runtime/watchdog.py)
    # before a rank gives up and exits 4: a node that went silent (power, link) ends the job instead
    # of hanging in a collective. Must exceed the longest single allreduce/broadcast. 0: off.
    peer_timeout: float = 30.0


@dataclass
class CheckpointConfig:
    every: int = 50  # iterations between checkpoints (0: only the final one)
    keep: int = 3  # newest checkpoints kept on disk


@dataclass
class LoggingConfig:
    tensorboard: bool = True  # TensorBoard events in <run dir>/tb
    console: bool = True  # one line per iteration on rank 0
    # Weights & Biases from rank 0 (hvd_rl/runtime/tracking.py): TensorBoard's scalars, the config and
    # the topology; one W&B run per run directory, continued by every resume and requeue.
    wandb: bool = False
    wandb_project: str = "hvd_rl"
    wandb_entity: str = ""  # your W&B user or team (empty: the default of your W&B login)
    wandb_group: str = ""  # groups runs in the W&B UI, e.g. one study
    wandb_tags: list[str] = field(default_factory=list)
    wandb_mode: str = "offline"  # offline (sync later: `wandb sync <run dir>/wandb/offline-run-*`) | online


@dataclass
class DebugConfig:
    """Fault injection for the test suite; leave at defaults in real runs."""

    nan_at_iteration: int = 0  # make the loss NaN on `nan_rank` at this iteration (0: never)
    nan_rank: int = 0  # the rank whose loss nan_at_iteration spoils
    iteration_sleep: float = 0.0  # seconds of extra sleep per iteration (slows tiny jobs for tests)


@dataclass
class TrainConfig:
    seed: int = 1  # base seed: every rank and environment derives its own from it
    run_dir: str = "runs/default"  # output directory (--run-dir overrides it)
    # ppo (discrete or continuous actions) | dqn | mappo, ippo (multi-agent: centralised or own critic)
    algorithm: str = "ppo"
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    dqn: DQNConfig = field(default_factory=DQNConfig)
    multiagent: MultiAgentConfig = field(default_factory=MultiAgentConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    @property
    def algorithm_section(self) -> str:
        """The section holding the chosen algorithm's hyperparameters: MAPPO and IPPO are PPO's."""
        return "ppo" if self.algorithm in MULTIAGENT_ALGORITHMS else self.algorithm

    @property
    def algorithm_config(self) -> Any:
        """The section of the chosen algorithm ([ppo] or [dqn])."""
        return getattr(self, self.algorithm_section)

    @property
    def total_timesteps(self) -> int:
        """Global environment steps of the whole run, all ranks together."""
        return self.algorithm_config.total_timesteps

    # Derived sizes (per rank unless stated).
    @property
    def local_batch_size(self) -> int:
        return self.env.num_envs * self.ppo.num_steps

    @property
    def minibatch_size(self) -> int:
        return self.local_batch_size // self.ppo.num_minibatches

    def global_batch_size(self, world_size: int) -> int:
        return world_size * self.local_batch_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())


@functools.cache  # the classes never change; resolving their hints costs ~1 ms a call
def section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(TrainConfig)
    return {name: tp for name, tp in hints.items() if dataclasses.is_dataclass(tp)}


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Converts a TOML/CLI value to the field's declared type, or raises ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        (item_tp,) = typing.get_args(tp)[:1]
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").split() if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {_show(value)}")
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        raise ConfigError(f"{where}: unsupported union type")  # pragma: no cover - not used
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true or false, got {_show(value)}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {_show(value)}")
        number = None
        if isinstance(value, int):
            number = value
        elif isinstance(value, float) and value.is_integer():
            number = int(value)
        elif isinstance(value, str):
            try:
                number = int(value.replace("_", ""))
            except ValueError:  # also: more digits than int() converts
                pass
        if number is None:
            raise ConfigError(f"{where}: expected an integer, got {_show(value)}")
        if not -_INT_RANGE <= number < _INT_RANGE:
            raise ConfigError(f"{where}: {_show(value)} is out of range (64-bit integers)")
        return number
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {_show(value)}")
        number = None
        if isinstance(value, (int, float)):
            try:
                number = float(value)
            except OverflowError:  # an integer beyond float's range
                pass
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{where}: expected a number, got {_show(value)}")
        if not math.isfinite(number):  # no setting means anything with NaN; inf sleeps/waits forever
            raise ConfigError(f"{where}: expected a finite number, got {_show(value)}")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {_show(value)}")
    raise ConfigError(f"{where}: unsupported type {tp}")  # pragma: no cover


def _apply(cfg: TrainConfig, data: dict[str, Any], source: str) -> None:
    sections = section_classes()
    top_types = {k: v for k, v in _field_types(TrainConfig).items() if k not in sections}
    for key, value in data.items():
        if key in sections:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: [{key}] must be a table")
            section = getattr(cfg, key)
            types_ = _field_types(sections[key])
            for sub, sub_value in value.items():
                if sub not in types_:
                    raise ConfigError(
                        f"{source}: unknown key {_show(f'{key}.{sub}')} (valid: {', '.join(sorted(types_))})"
                    )
                setattr(section, sub, _coerce(sub_value, types_[sub], f"{source}: {key}.{sub}"))
        elif key in top_types:
            setattr(cfg, key, _coerce(value, top_types[key], f"{source}: {key}"))
        else:
            valid = sorted(list(sections) + list(top_types))
            raise ConfigError(f"{source}: unknown key {_show(key)} (valid: {', '.join(valid)})")


def parse_override(text: str) -> dict[str, Any]:
    """Turns 'section.key=value' into a nested dict; the value is parsed as TOML when it can be."""
    if "=" not in text:
        raise ConfigError(f"--set {_show(text)}: expected section.key=value")
    path, raw = text.split("=", 1)
    path = path.strip()
    if not path or any(not part for part in path.split(".")):
        raise ConfigError(f"--set {_show(text)}: expected section.key=value")
    try:
        doc = tomllib.loads(f"v = {raw}")
    except (ValueError, RecursionError):  # TOMLDecodeError; too many digits; nesting too deep
        doc = {}
    # One TOML value or else the text itself ('0.9\nseed = 3' is not 0.9 with the rest dropped).
    value = doc["v"] if list(doc) == ["v"] else raw.strip()
    parts = path.split(".")
    nested: dict[str, Any] = {parts[-1]: value}
    for part in reversed(parts[:-1]):
        nested = {part: nested}
    return nested


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Defaults, then the TOML file, then each `--set` in order. Does not validate."""
    cfg = TrainConfig()
    if path is not None:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
        _apply(cfg, data, str(path))
    for text in overrides or []:
        _apply(cfg, parse_override(text), f"--set {_show(text)}")
    return cfg


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    cfg = TrainConfig()
    _apply(cfg, data, "checkpoint config")
    return cfg


BACKENDS = ("sync", "async", "ale_vector")
ALGORITHMS = ("ppo", "dqn", "mappo", "ippo")
MULTIAGENT_ALGORITHMS = ("mappo", "ippo")
AMP_MODES = ("off", "auto", "bf16", "fp16")  # see hvd_rl/runtime/precision.py
COMPRESSIONS = ("none", "fp16", "powersgd", "topk")  # see hvd_rl/runtime/compression.py
MODEL_KINDS = ("auto", "nature_cnn", "mlp")
WANDB_MODES = ("offline", "online")
REDUCTIONS = ("average", "adasum")
DEVICES = ("auto", "cpu", "cuda")
PIPELINE_MODES = ("sync", "overlap")
BALANCE_MODES = ("off", "static", "dynamic")
# Every setting that takes one of a few words, and its words (what validate() accepts): the
# probe of combinations in tests/test_config.py tries each.
CHOICES: dict[str, tuple[str, ...]] = {
    "algorithm": ALGORITHMS, "env.backend": BACKENDS, "model.kind": MODEL_KINDS,
    "distributed.reduction": REDUCTIONS, "distributed.compression": COMPRESSIONS, "distributed.device": DEVICES,
    "distributed.amp": AMP_MODES, "distributed.balance": BALANCE_MODES, "logging.wandb_mode": WANDB_MODES,
    "ppo.pipeline": PIPELINE_MODES,
}


def _plain_name(text: str, empty_ok: bool, limit: int = 128, extra: str = "") -> bool:
    """A W&B project/entity/group name or tag: what W&B's UI and URLs take, one short line."""
    return (empty_ok or bool(text)) and len(text) <= limit and all(c.isascii() and (c.isalnum() or c in "-_." + extra)
                                                                   for c in text)


def validate(cfg: TrainConfig, world_size: int | None = None, elastic: bool = False) -> None:
    """Raises ConfigError listing every problem; checks the env id against the registry.
    `world_size`: the number of ranks, where the launcher says it before Horovod starts (else
    `hvd-rl train` checks again once Horovod knows it). `elastic`: the world may change size."""
    problems = config_problems(cfg, world_size, elastic)
    if problems:
        raise ConfigError(_problems_message(problems))


def config_problems(cfg: TrainConfig, world_size: int | None = None, elastic: bool = False) -> list[str]:
    """Every problem validate() would report, one message each (empty: the config is valid)."""
    problems: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    e, p, d = cfg.env, cfg.ppo, cfg.distributed
    need(cfg.algorithm in ALGORITHMS, f"algorithm must be one of {ALGORITHMS}, got {cfg.algorithm!r}")
    need(e.backend in BACKENDS, f"env.backend must be one of {BACKENDS}, got {e.backend!r}")
    for name in ("num_envs", "frame_skip", "frame_stack", "screen_size"):
        need(getattr(e, name) > 0, f"env.{name} must be positive, got {getattr(e, name)}")
    for name in ("noop_max", "max_episode_steps", "env_threads"):
        need(getattr(e, name) >= 0, f"env.{name} must be >= 0, got {getattr(e, name)}")
    need(0.0 <= e.repeat_action_probability < 1.0,
         f"env.repeat_action_probability must be in [0, 1), got {e.repeat_action_probability}")
    need(cfg.model.kind in MODEL_KINDS, f"model.kind must be one of {MODEL_KINDS}, got {cfg.model.kind!r}")
    need(len(cfg.model.hidden_sizes) > 0 and all(h > 0 for h in cfg.model.hidden_sizes),
         f"model.hidden_sizes must be a non-empty list of positive sizes, got {cfg.model.hidden_sizes}")

    for name in ("total_timesteps", "num_steps", "num_minibatches", "update_epochs",
                 "backward_passes_per_step"):
        need(getattr(p, name) > 0, f"ppo.{name} must be positive, got {getattr(p, name)}")
    for name in ("learning_rate", "adam_eps", "clip_coef"):
        need(getattr(p, name) > 0, f"ppo.{name} must be positive, got {getattr(p, name)}")
    for name in ("ent_coef", "vf_coef", "max_grad_norm", "target_kl"):
        need(getattr(p, name) >= 0, f"ppo.{name} must be >= 0, got {getattr(p, name)}")
    need(0.0 <= p.gamma <= 1.0, f"ppo.gamma must be in [0, 1], got {p.gamma}")
    need(0.0 <= p.gae_lambda <= 1.0, f"ppo.gae_lambda must be in [0, 1], got {p.gae_lambda}")
    need(p.observation_clip > 0 and p.reward_clip > 0, "ppo.observation_clip and ppo.reward_clip must be positive")
    need(p.anneal_timesteps >= 0, f"ppo.anneal_timesteps must be >= 0, got {p.anneal_timesteps}")
    need(p.pipeline in PIPELINE_MODES, f"ppo.pipeline must be one of {PIPELINE_MODES}, got {p.pipeline!r}")
    if p.pipeline == "overlap":
        need(cfg.algorithm == "ppo", f"ppo.pipeline = 'overlap' is PPO's; {cfg.algorithm!r} samples synchronously")
        need(not elastic, "ppo.pipeline = 'overlap' cannot run elastic (a reset would land while the sampler "
             "thread steps the environments): use ppo.pipeline = 'sync' with --elastic")
        need(d.balance == "off", "ppo.pipeline = 'overlap' hides the busy time distributed.balance measures: use one")
    if p.num_steps > 0 and p.num_minibatches > 0:
        # Minibatches are drawn per environment (see ppo.minibatch_indices), which is what makes
        # N ranks compute exactly the same update as one process.
        need(p.num_steps % p.num_minibatches == 0,
             f"ppo.num_steps ({p.num_steps}) must be divisible by ppo.num_minibatches "
             f"({p.num_minibatches})")
        if p.num_steps % p.num_minibatches == 0 and e.num_envs > 0 and p.backward_passes_per_step > 0:
            need(cfg.minibatch_size % p.backward_passes_per_step == 0,
                 f"minibatch size {cfg.minibatch_size} (env.num_envs x ppo.num_steps / "
                 f"ppo.num_minibatches) must be divisible by ppo.backward_passes_per_step "
                 f"({p.backward_passes_per_step})")

    q = cfg.dqn
    for name in ("total_timesteps", "buffer_size", "target_network_frequency", "batch_size",
                 "train_frequency", "steps_per_iteration"):
        need(getattr(q, name) > 0, f"dqn.{name} must be positive, got {getattr(q, name)}")
    need(q.learning_rate > 0 and q.adam_eps > 0, "dqn.learning_rate and dqn.adam_eps must be positive")
    need(0.0 < q.tau <= 1.0, f"dqn.tau must be in (0, 1], got {q.tau}")
    need(0.0 <= q.gamma <= 1.0, f"dqn.gamma must be in [0, 1], got {q.gamma}")
    for name in ("start_e", "end_e", "exploration_fraction", "apex_base_epsilon"):
        need(0.0 <= getattr(q, name) <= 1.0, f"dqn.{name} must be in [0, 1], got {getattr(q, name)}")
    need(q.learning_starts >= 0 and q.max_grad_norm >= 0 and q.apex_alpha >= 0,
         "dqn.learning_starts, dqn.max_grad_norm and dqn.apex_alpha must be >= 0")
    need(q.learning_starts <= q.buffer_size,
         f"dqn.learning_starts ({q.learning_starts}) must not exceed dqn.buffer_size ({q.buffer_size}): "
         "the replay shards can never hold that many transitions, so learning would never start")
    need(d.reduction in REDUCTIONS,
         f"distributed.reduction must be 'average' or 'adasum', got {d.reduction!r}")
    need(d.compression in COMPRESSIONS, f"distributed.compression must be one of {COMPRESSIONS}, got {d.compression!r}")
    need(d.powersgd_rank >= 1, f"distributed.powersgd_rank must be >= 1, got {d.powersgd_rank}")
    need(0 < d.topk_ratio <= 1, f"distributed.topk_ratio must be in (0, 1], got {d.topk_ratio}")
    if d.compression in ("powersgd", "topk"):
        need(d.reduction == "average", f"distributed.compression = {d.compression!r} needs distributed.reduction "
             "= 'average' (Adasum combines whole gradients inside Horovod)")
        need(d.amp != "fp16", f"distributed.compression = {d.compression!r} does not work with distributed.amp = "
             "'fp16' (a step the loss scaler skips for overflow would leave inf in the residuals); use 'bf16' or 'off'")
    need(d.device in DEVICES,
         f"distributed.device must be 'auto', 'cpu' or 'cuda', got {d.device!r}")
    need(d.amp in AMP_MODES, f"distributed.amp must be one of {AMP_MODES}, got {d.amp!r}")
    need(d.cycle_time_ms >= 0, f"distributed.cycle_time_ms must be >= 0, got {d.cycle_time_ms}")
    if d.reduction == "adasum":
        # Horovod's Adasum optimizer steps on each rank's gradient inside the backward hooks.
        if cfg.algorithm in ALGORITHMS:
            clip = cfg.algorithm_config.max_grad_norm
            default = section_classes()[cfg.algorithm_section]().max_grad_norm
            need(clip == 0, "distributed.reduction = 'adasum' cannot clip gradients (each rank steps inside "
                 f"Horovod's backward hooks): set {cfg.algorithm_section}.max_grad_norm = 0 "
                 f"(it is {clip}{', the default' if clip == default else ''})")
        need(d.amp != "fp16", "distributed.reduction = 'adasum' does not work with distributed.amp = "
             "'fp16' (loss scaling); use 'bf16' or 'off'")
    if d.reduction == "adasum" and world_size is not None:
        need(world_size & (world_size - 1) == 0, f"distributed.reduction = 'adasum' needs a power-of-2 "
             f"number of ranks, got {world_size} (Horovod's CPU Adasum)")
    need(d.threads_per_rank >= 0, f"distributed.threads_per_rank must be >= 0, got {d.threads_per_rank}")
    need(d.verify_every >= 0, f"distributed.verify_every must be >= 0, got {d.verify_every}")
    need(d.balance in BALANCE_MODES,
         f"distributed.balance must be 'off', 'static' or 'dynamic', got {d.balance!r}")
    need(d.balance_every >= 2, f"distributed.balance_every must be >= 2, got {d.balance_every}")
    need(all(c > 0 for c in d.env_counts), f"distributed.env_counts must be positive, got {d.env_counts}")
    if d.env_counts and world_size is not None and not elastic:
        need(len(d.env_counts) == world_size,
             f"distributed.env_counts has {len(d.env_counts)} entr{'y' if len(d.env_counts) == 1 else 'ies'} "
             f"({_show(d.env_counts)}) for a job of {world_size} rank{'' if world_size == 1 else 's'}: "
             "give one count per rank")
    if d.env_counts:
        need(cfg.algorithm == "ppo", f"distributed.env_counts (uneven layouts) needs algorithm 'ppo', "
             f"not {cfg.algorithm!r}")
        need(d.reduction == "average", "distributed.env_counts needs distributed.reduction = 'average' "
             "(Adasum's result is not an average, so ranks cannot be weighted by their share)")
    per_env = p.num_steps // p.num_minibatches if p.num_minibatches > 0 else 0
    if (d.env_counts or d.balance != "off") and p.backward_passes_per_step > 1 and per_env > 0:
        # Each rank's share of a minibatch (envs x steps per env) must split into whole micro-batches.
        if d.balance != "off":
            need(per_env % p.backward_passes_per_step == 0,
                 f"distributed.balance may give a rank any number of environments, so ppo.num_steps / "
                 f"ppo.num_minibatches ({per_env}) must be divisible by ppo.backward_passes_per_step "
                 f"({p.backward_passes_per_step})")
        else:
            need(all(c * per_env % p.backward_passes_per_step == 0 for c in d.env_counts),
                 f"every rank's minibatch share (distributed.env_counts x ppo.num_steps / ppo.num_minibatches = "
                 f"{[c * per_env for c in d.env_counts]}) must be divisible by ppo.backward_passes_per_step "
                 f"({p.backward_passes_per_step})")
    need(0 <= d.balance_threshold < 1, f"distributed.balance_threshold must be in [0, 1), got {d.balance_threshold}")
    need(1 <= d.balance_min_envs <= e.num_envs,
         f"distributed.balance_min_envs must be in [1, env.num_envs], got {d.balance_min_envs}")
    if d.balance != "off":
        need(cfg.algorithm == "ppo", "distributed.balance makes environment counts uneven, "
             f"which only algorithm 'ppo' supports, not {cfg.algorithm!r}")
        need(d.reduction == "average", "distributed.balance needs distributed.reduction = 'average' "
             "(Adasum does not weight ranks by their share)")
    need(d.peer_timeout >= 0, f"distributed.peer_timeout must be >= 0 (0: off), got {d.peer_timeout}")
    need(d.elastic_min_np >= 1, f"distributed.elastic_min_np must be >= 1, got {d.elastic_min_np}")
    lg = cfg.logging
    if lg.wandb:
        import importlib.util

        need(importlib.util.find_spec("wandb") is not None,
             "logging.wandb = true needs the wandb package: pip install 'hvd_rl[tools]' (scripts/setup.sh installs it)")
    need(lg.wandb_mode in WANDB_MODES, f"logging.wandb_mode must be one of {WANDB_MODES}, got {lg.wandb_mode!r}")
    for name in ("wandb_project", "wandb_entity", "wandb_group"):
        need(_plain_name(getattr(lg, name), empty_ok=name != "wandb_project"),
             f"logging.{name} must be letters, digits and - _ . (at most 128), got {getattr(lg, name)!r}")
    need(all(_plain_name(t, empty_ok=False, limit=64, extra=" :/=+") for t in lg.wandb_tags),
         f"logging.wandb_tags must be short printable names (at most 64 each), got {lg.wandb_tags!r}")
    need(cfg.checkpoint.every >= 0, f"checkpoint.every must be >= 0, got {cfg.checkpoint.every}")
    need(cfg.checkpoint.keep >= 1, f"checkpoint.keep must be >= 1, got {cfg.checkpoint.keep}")
    need(cfg.debug.nan_at_iteration >= 0, "debug.nan_at_iteration must be >= 0")
    need(cfg.debug.iteration_sleep >= 0, "debug.iteration_sleep must be >= 0")
    need(bool(cfg.run_dir.strip()), "run_dir must not be empty")
    need(cfg.seed >= 0, f"seed must be >= 0 (NumPy's and Gymnasium's seeding refuse negative ones), got {cfg.seed}")

    multiagent = cfg.algorithm in MULTIAGENT_ALGORITHMS
    m = cfg.multiagent
    need(m.num_agents >= 0, f"multiagent.num_agents must be >= 0 (0: the task's default), got {m.num_agents}")
    if multiagent:
        need(e.backend == "sync", f"algorithm {cfg.algorithm!r} steps its environments in the rank's process "
             f"(VMAS vectorises them itself): env.backend must be 'sync', got {e.backend!r}")
        need(not (p.normalize_observations or p.normalize_rewards),
             f"algorithm {cfg.algorithm!r} does not take ppo.normalize_observations or ppo.normalize_rewards "
             "(its value targets are normalised by multiagent.value_normalization)")
        need(cfg.model.kind in ("auto", "mlp"), f"algorithm {cfg.algorithm!r} uses MLPs on agents' vector "
             f"observations: model.kind must be 'auto' or 'mlp', got {cfg.model.kind!r}")

    # The env id last: it imports Gymnasium and ale-py, and only matters when the rest is sane.
    from hvd_rl.envs.ids import check_env_id  # local import keeps config importable without gym

    env_problem = check_env_id(e.id, e.backend, cfg.algorithm, m.num_agents, e.max_episode_steps)
    if env_problem:
        problems.append(env_problem)
    return problems


def dump_toml(data: dict[str, Any]) -> str:
    """Writes the resolved config as TOML (flat scalars first, then one table per section)."""

    def fmt(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (int, float)):
            return repr(value)
        if isinstance(value, str):
            return toml_string(value)
        if isinstance(value, (list, tuple)):
            return "[" + ", ".join(fmt(v) for v in value) + "]"
        raise TypeError(f"cannot write {value!r} as TOML")

    lines = [f"{k} = {fmt(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(f"\n[{key}]")
            lines.extend(f"{k} = {fmt(v)}" for k, v in value.items())
    return "\n".join(lines) + "\n"


_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def toml_string(text: str) -> str:
    """A TOML basic string holding exactly `text` (json.dumps writes characters beyond the BMP as
    surrogate-pair escapes, which TOML refuses, and leaves DEL unescaped, which TOML forbids)."""
    return '"' + "".join(_TOML_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                         for c in text) + '"'
