"""`hvd-rl export`: a checkpoint's policy network as ONNX or TorchScript, for deployment without
hvd_rl, Horovod or Gymnasium.

The exported graph takes observations exactly as the environment gives them, batched (Atari:
uint8 frames [N, 4, 84, 84] after hvd_rl's CleanRL preprocessing; vector observations: float32
[N, D]); the scaling of frames to [0, 1] and, where the run normalised observations, the running
normalisation (its statistics frozen as constants) happen inside. What it returns:

- PPO, discrete actions: `logits` [N, A]; the greedy action is their argmax;
- PPO, continuous actions: `mean` [N, A], the Gaussian's mean; the greedy action is the mean
  clipped to the action bounds (stored in the ONNX file's metadata);
- DQN: `q_values` [N, A]; the greedy action is their argmax.
- MAPPO / IPPO: the shared actor, decentralised execution: observations [N, agents, D] (every
  agent's own, in the environment's agent order; N environments), the agent ids added inside,
  and `logits` or `mean` [N, agents, ...] per agent. The critic is training-only and not exported.

Float32 throughout, whatever precision the run trained in.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hvd_rl.config import MULTIAGENT_ALGORITHMS, ConfigError
from hvd_rl.envs.multiagent import make_multiagent_envs
from hvd_rl.envs.vector import RankEnvs
from hvd_rl.policy.trained import Trained, checkpoint_config, load_trained, single_process_env

FORMATS = ("onnx", "torchscript")


class ExportedPolicy(nn.Module):
    """Observation in, the policy's output out; frozen preprocessing included."""

    def __init__(self, trained: Trained):
        super().__init__()
        algorithm = trained.algorithm
        network = getattr(algorithm, "model", None) or algorithm.q_network
        self.torso = network.torso
        self.head = network.actor if hasattr(network, "actor") else network.head
        self.input_scale = float(network.input_scale)
        normalizer = getattr(algorithm, "obs_normalizer", None)
        self.normalize = normalizer is not None
        mean, scale = normalizer.affine() if self.normalize else (0.0, 1.0)
        clip = normalizer.clip if self.normalize else 0.0
        self.register_buffer("obs_mean", torch.as_tensor(np.asarray(mean, dtype=np.float32)))
        self.register_buffer("obs_scale", torch.as_tensor(np.asarray(scale, dtype=np.float32)))
        self.obs_clip = float(clip)
        # multi-agent: one-hot agent ids beside each agent's observation, as in training (InputRows)
        spec = getattr(algorithm, "spec", None)
        self.multiagent = spec is not None
        ids = np.eye(spec.num_agents, dtype=np.float32) if self.multiagent and algorithm.inputs.ids is not None \
            else np.zeros((0, 0), np.float32)
        self.register_buffer("agent_ids", torch.as_tensor(ids))
        self.output_name = ("q_values" if trained.cfg.algorithm == "dqn" else
                            "mean" if getattr(network, "continuous", False) else "logits")
        self.float()

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs.to(torch.float32)
        if self.normalize:
            x = torch.clamp((x - self.obs_mean) * self.obs_scale, -self.obs_clip, self.obs_clip)
        if self.input_scale != 1.0:
            x = x * self.input_scale
        if not self.multiagent:
            return self.head(self.torso(x))
        n, agents = x.shape[0], x.shape[1]
        if self.agent_ids.numel():
            x = torch.cat([x, self.agent_ids.expand(n, -1, -1)], dim=-1)
        out = self.head(self.torso(x.reshape(n * agents, -1)))  # the torso flattens: one row per agent
        return out.reshape(n, agents, *out.shape[1:])


def _metadata(trained: Trained, module: ExportedPolicy, observation_space: Any, action_space: Any) -> dict[str, str]:
    meta = {"hvd_rl.env_id": trained.cfg.env.id, "hvd_rl.algorithm": trained.cfg.algorithm,
            "hvd_rl.global_step": str(trained.global_step), "hvd_rl.output": module.output_name,
            "hvd_rl.observation_shape": json.dumps(list(observation_space.shape)),
            **({"hvd_rl.agents": json.dumps(list(trained.algorithm.spec.agents))} if module.multiagent else {}),
            "hvd_rl.observation_dtype": str(observation_space.dtype)}
    if module.output_name == "mean":
        meta["hvd_rl.action_low"] = json.dumps(np.asarray(action_space.low).tolist())
        meta["hvd_rl.action_high"] = json.dumps(np.asarray(action_space.high).tolist())
    return meta


def export_checkpoint(path: str | Path, out: str | Path, fmt: str = "onnx",
                      overrides: list[str] | None = None) -> dict[str, Any]:
    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {FORMATS}, got {fmt!r}")
    cfg, state = checkpoint_config(path, overrides)
    multiagent = cfg.algorithm in MULTIAGENT_ALGORITHMS
    envs = make_multiagent_envs(cfg.env.id, 1, cfg.multiagent.num_agents, cfg.env.max_episode_steps) \
        if multiagent else RankEnvs(single_process_env(cfg.env, 1), threads=1)
    try:
        trained = load_trained(path, envs, cfg, state)
        first = envs.reset([0])
        example = torch.as_tensor(np.asarray(first[0] if multiagent else first))
        observation_space, action_space = envs.single_observation_space, envs.single_action_space
    finally:
        envs.close()
    module = ExportedPolicy(trained).eval()
    meta = _metadata(trained, module, observation_space, action_space)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with torch.no_grad():
        if fmt == "torchscript":
            scripted = torch.jit.trace(module, example)
            torch.jit.save(scripted, str(tmp), _extra_files={"hvd_rl.json": json.dumps(meta)})
        else:
            try:
                import onnx
                import onnxscript  # noqa: F401 - torch.onnx's exporter needs it
            except ImportError as exc:
                raise ConfigError(f"--format onnx needs {exc.name}: pip install 'hvd_rl[tools]' "
                                  "(scripts/setup.sh installs it)") from None

            program = torch.onnx.export(module, (example,), input_names=["obs"], output_names=[module.output_name],
                                        dynamic_shapes=({0: torch.export.Dim("batch")},), dynamo=True,
                                        verbose=False)
            model = program.model_proto
            for key, value in meta.items():
                model.metadata_props.add(key=key, value=value)
            onnx.save(model, str(tmp))
    tmp.replace(out)
    agents = [len(trained.algorithm.spec.agents)] if module.multiagent else []
    return {"checkpoint": str(path), "out": str(out), "format": fmt, "input": "obs",
            "input_shape": ["batch", *agents, *observation_space.shape], "input_dtype": str(observation_space.dtype),
            "output": module.output_name, **{k.split(".", 1)[1]: v for k, v in meta.items()}}
