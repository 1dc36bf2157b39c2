"""Actor-critic networks: CleanRL's Nature CNN for Atari frames and an MLP for vector observations."""
from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from hvd_rl.config import ModelConfig
from hvd_rl.runtime.precision import Precision


def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Module:
    """Orthogonal weights, constant bias: the PPO implementation-detail init CleanRL uses."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class ActorCritic(nn.Module):
    """Policy head and value head, on a shared torso or on separate ones.

    CleanRL's recipes: Atari shares the Nature CNN; the MLP agent keeps actor and critic apart,
    because on a shared MLP torso the large early value loss drowns the policy gradient.
    Discrete actions: the policy head gives logits (categorical). Box actions: it gives the mean
    of a diagonal Gaussian whose log-std is a state-independent parameter (CleanRL's
    ppo_continuous_action; no tanh squashing: the collector clips actions to the bounds).
    """

    def __init__(self, torso: nn.Module, feature_dim: int, action_space: gym.Space, input_scale: float,
                 critic_torso: nn.Module | None = None):
        super().__init__()
        self.torso = torso
        self.critic_torso = critic_torso
        self.continuous = isinstance(action_space, gym.spaces.Box)
        outputs = int(np.prod(action_space.shape)) if self.continuous else int(action_space.n)
        self.actor = layer_init(nn.Linear(feature_dim, outputs), std=0.01)
        if self.continuous:
            self.log_std = nn.Parameter(torch.zeros(outputs))
        self.critic = layer_init(nn.Linear(feature_dim, 1), std=1.0)
        self.input_scale = input_scale
        # Set by the algorithm; every forward pass (rollout, learner, evaluation) runs under it.
        self.precision = Precision("off", "cpu")

    def _prepare(self, obs: torch.Tensor) -> torch.Tensor:
        """uint8 frames go straight to the compute dtype (no fp32 copy in between: ~1.3x faster
        bf16 training on CPU), channels-last (oneDNN convolutions ~1.4x faster)."""
        if obs.dim() == 4:
            obs = obs.contiguous(memory_format=torch.channels_last)
        dtype = self.precision.dtype if self.precision.device_type == obs.device.type else None
        x = obs.to(dtype or self.float_dtype)
        if self.input_scale == 1.0:
            return x
        return x.mul_(self.input_scale) if x.data_ptr() != obs.data_ptr() else x * self.input_scale

    @property
    def float_dtype(self) -> torch.dtype:
        """fp32, or float64 for a network made double (the exactness tests compare N ranks with
        one process in float64, where no CPU's kernel order can tell them apart). Outputs and
        the fp32 path's inputs take this dtype; a bf16 inference copy still outputs fp32."""
        return torch.promote_types(next(self.parameters()).dtype, torch.float32)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logits or Gaussian mean, value) in fp32 (see float_dtype). `obs` may be
        uint8 frames; scaling happens here, on the device."""
        with self.precision.autocast():
            x = self._prepare(obs)
            hidden = self.torso(x)
            critic_hidden = hidden if self.critic_torso is None else self.critic_torso(x)
            policy, value = self.actor(hidden), self.critic(critic_hidden).squeeze(-1)
        return policy.to(self.float_dtype), value.to(self.float_dtype)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast():
            x = self._prepare(obs)
            hidden = self.torso(x) if self.critic_torso is None else self.critic_torso(x)
            value = self.critic(hidden).squeeze(-1)
        return value.to(self.float_dtype)

    def log_prob_entropy(self, policy: torch.Tensor, actions: torch.Tensor,
                         log_std: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """log pi(a|s) and the entropy, per sample (summed over action dimensions)."""
        if not self.continuous:
            log_probs = torch.log_softmax(policy, dim=-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
            return log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1), entropy
        log_std = (self.log_std if log_std is None else log_std).to(policy.dtype).expand_as(policy)
        z = (actions - policy) * torch.exp(-log_std)
        log_prob = (-0.5 * z * z - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + log_std).sum(-1)
        return log_prob, entropy

    def sample(self, policy: torch.Tensor, log_std: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Actions and their log-probabilities. Categorical via Gumbel-max (one random draw per
        logit, no softmax normalisation pass); Gaussian via the reparametrised normal, with
        `log_std` when given (a sampler's snapshot), else this model's own."""
        if not self.continuous:
            log_probs = torch.log_softmax(policy, dim=-1)
            gumbel = -torch.log(-torch.log(torch.rand_like(log_probs).clamp_(min=1e-20)))
            actions = torch.argmax(log_probs + gumbel, dim=-1)
            return actions, log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        log_std = self.log_std if log_std is None else log_std
        actions = policy + torch.exp(log_std.to(policy.dtype)) * torch.randn_like(policy)
        return actions, self.log_prob_entropy(policy, actions, log_std)[0]

    def mode(self, policy: torch.Tensor) -> torch.Tensor:
        """The most likely action (greedy evaluation)."""
        return policy if self.continuous else policy.argmax(-1)


class MultiAgentActorCritic(ActorCritic):
    """One actor shared by all agents and a critic, each reading its own columns of an agent's
    input row [actor input | critic input] (hvd_rl/algorithms/mappo.py builds the rows): MAPPO's
    critic reads the global state, IPPO's (critic_from = 0, rows of the actor input alone) the
    agent's own observation. One row per agent keeps the PPO learner's minibatches rows of one tensor."""

    def __init__(self, torso: nn.Module, critic_torso: nn.Module, width: int, action_space: gym.Space,
                 actor_width: int, critic_from: int):
        super().__init__(torso, width, action_space, input_scale=1.0, critic_torso=critic_torso)
        self.actor_width, self.critic_from = actor_width, critic_from

    def forward(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with self.precision.autocast():
            x = self._prepare(rows)
            policy = self.actor(self.torso(x[..., :self.actor_width]))
            value = self.critic(self.critic_torso(x[..., self.critic_from:])).squeeze(-1)
        return policy.to(self.float_dtype), value.to(self.float_dtype)

    def value(self, rows: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast():
            value = self.critic(self.critic_torso(self._prepare(rows)[..., self.critic_from:])).squeeze(-1)
        return value.to(self.float_dtype)


def build_multiagent_model(cfg: ModelConfig, actor_width: int, critic_width: int, action_space: gym.Space,
                           centralised: bool) -> MultiAgentActorCritic:
    """MLP actor on `actor_width` columns; MLP critic on the next `critic_width` (centralised) or
    on the actor's columns."""
    _check_spaces(gym.spaces.Box(-np.inf, np.inf, (actor_width,), np.float32), action_space, continuous_ok=True)
    torso, width = mlp(actor_width, cfg.hidden_sizes)
    critic_torso, _ = mlp(critic_width if centralised else actor_width, cfg.hidden_sizes)
    return MultiAgentActorCritic(torso, critic_torso, width, action_space, actor_width,
                                 actor_width if centralised else 0)


class QNetwork(nn.Module):
    """Action values on a torso (CleanRL's dqn / dqn_atari networks)."""

    def __init__(self, torso: nn.Module, feature_dim: int, num_actions: int, input_scale: float):
        super().__init__()
        self.torso = torso
        self.head = nn.Linear(feature_dim, num_actions)
        self.input_scale = input_scale
        self.precision = Precision("off", "cpu")

    _prepare = ActorCritic._prepare
    float_dtype = ActorCritic.float_dtype

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast():
            q = self.head(self.torso(self._prepare(obs)))
        return q.to(self.float_dtype)


class InferencePolicy:
    """The rollout's view of the policy: the training model's weights, pre-cast to the compute
    dtype once per iteration instead of by autocast at every step.

    Under autocast each forward pass re-casts every fp32 weight (1.7M for the Nature CNN) to
    bf16, which for batch-of-8 rollout inference costs more than the convolutions. A bf16 copy
    computes exactly what autocast computes (same bf16 weights and inputs, same kernels), so the
    learner's first PPO ratio stays 1. The copy's convolution weights are channels-last like the
    frames (RolloutBuffer), so no step re-lays them out (bitwise the same result; with the
    channels-last frames, ~10% faster rollout forward passes on one core). In fp32 the training
    model is used directly, unless `separate`: a sampler thread that runs while the learner
    updates the weights (ppo.pipeline = "overlap") needs a copy of its own in any precision, and
    a snapshot of the Gaussian's log-std.
    """

    def __init__(self, model: nn.Module, separate: bool = False):
        self.source = model
        self.model = model
        self.log_std: torch.Tensor | None = None  # None: the training model's own, read live
        if model.precision.dtype is not None or separate:
            import copy

            self.model = copy.deepcopy(model).requires_grad_(False)
            if model.precision.dtype is not None:
                self.model = self.model.to(model.precision.dtype).to(memory_format=torch.channels_last)
        if separate and getattr(model, "continuous", False):
            self.log_std = model.log_std.detach().clone()

    def sync(self) -> None:
        """Copies the training weights in (after an update, a broadcast or a resume)."""
        with torch.no_grad():
            if self.model is not self.source:
                for mine, theirs in zip(self.model.parameters(), self.source.parameters()):
                    mine.copy_(theirs)
            if self.log_std is not None:
                self.log_std.copy_(self.source.log_std)

    def __call__(self, obs: torch.Tensor):
        return self.model(obs)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.model.value(obs)

    def sample(self, policy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.source.sample(policy, self.log_std)  # the Gaussian's log-std stays fp32


def nature_cnn(in_channels: int, init: bool = True) -> tuple[nn.Module, int]:
    """The Nature DQN torso. `init`: orthogonal weights and zero biases (CleanRL's PPO); False
    keeps PyTorch's default init (CleanRL's dqn_atari)."""
    wrap = layer_init if init else (lambda layer: layer)
    torso = nn.Sequential(
        wrap(nn.Conv2d(in_channels, 32, 8, stride=4)), nn.ReLU(),
        wrap(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
        wrap(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(),
        nn.Flatten(),
        wrap(nn.Linear(64 * 7 * 7, 512)), nn.ReLU(),
    )
    return torso, 512


def mlp(in_features: int, hidden_sizes: list[int], activation: type[nn.Module] = nn.Tanh,
        init: bool = True) -> tuple[nn.Module, int]:
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for size in hidden_sizes:
        linear = nn.Linear(width, size)
        layers += [layer_init(linear) if init else linear, activation()]
        width = size
    return nn.Sequential(*layers), width


class ModelError(ValueError):
    """The configured network cannot take this environment's observations or actions."""


def _check_spaces(obs_space: gym.Space, action_space: gym.Space, continuous_ok: bool) -> None:
    if not isinstance(obs_space, gym.spaces.Box):
        raise ModelError(f"only Box observation spaces are supported, got {obs_space}")
    if isinstance(action_space, gym.spaces.Discrete):
        return
    if continuous_ok and isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1:
        return
    kinds = "Discrete or 1-D Box" if continuous_ok else "Discrete"
    raise ModelError(f"this algorithm needs {kinds} actions, got {action_space}")


def _torso(kind: str, obs_space: gym.Space, cfg: ModelConfig, **mlp_kwargs) -> tuple[nn.Module, int, float]:
    if kind == "auto":
        kind = "nature_cnn" if len(obs_space.shape) == 3 else "mlp"
    if kind == "nature_cnn":
        if len(obs_space.shape) != 3 or tuple(obs_space.shape[1:]) != (84, 84):
            raise ModelError(f"model.kind 'nature_cnn' needs (C, 84, 84) image observations, but "
                             f"this environment's observations have shape {tuple(obs_space.shape)}; "
                             "use model.kind = 'mlp' or 'auto'")
        torso, width = nature_cnn(obs_space.shape[0], init=mlp_kwargs.get("init", True))
        # Weights stay contiguous (Horovod only reduces contiguous tensors); inputs go channels-last.
        return torso, width, 1.0 / 255.0
    torso, width = mlp(int(np.prod(obs_space.shape)), cfg.hidden_sizes, **mlp_kwargs)
    return torso, width, 1.0


def build_model(cfg: ModelConfig, obs_space: gym.Space, action_space: gym.Space) -> ActorCritic:
    _check_spaces(obs_space, action_space, continuous_ok=True)
    torso, width, scale = _torso(cfg.kind, obs_space, cfg)
    if scale != 1.0:
        return ActorCritic(torso, width, action_space, input_scale=scale)
    critic_torso, _, _ = _torso(cfg.kind, obs_space, cfg)
    return ActorCritic(torso, width, action_space, input_scale=1.0, critic_torso=critic_torso)


def build_q_network(cfg: ModelConfig, obs_space: gym.Space, action_space: gym.Space) -> QNetwork:
    _check_spaces(obs_space, action_space, continuous_ok=False)
    torso, width, scale = _torso(cfg.kind, obs_space, cfg, activation=nn.ReLU, init=False)
    return QNetwork(torso, width, int(action_space.n), input_scale=scale)


def model_signature(obs_space: gym.Space, action_space: gym.Space, model: nn.Module) -> dict:
    """What a checkpoint must match to be loaded into this run (spaces and parameter shapes)."""
    return {
        "observation_shape": list(obs_space.shape),
        "observation_dtype": str(obs_space.dtype),
        "num_actions": int(action_space.n) if isinstance(action_space, gym.spaces.Discrete) else None,
        "action_shape": list(action_space.shape or ()),
        "parameters": {name: list(p.shape) for name, p in model.named_parameters()},
    }
