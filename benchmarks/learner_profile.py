"""The PPO learner against the core it runs on (issue 36): samples/s, FLOP/s, where the time goes.

    python benchmarks/learner_profile.py --rounds 5 --out benchmarks/results/throughput/learner_profile_<cpu>.json

One process, one thread, pinned to one CPU, the trainer's own learner (full PPO updates of the
config's rollout: every epoch and minibatch, the optimizer step included; benchmarks/throughput.py's
probe). In rotated rounds it measures:
  learner     samples/s through the learner (each sample once per epoch), at the config's precision
  variants    the same with each candidate speed-up switched on (--variants): `compile`, the
              network's torso through torch.compile (inductor's CPU backend), warm-up timed apart
  gemm        a 2048^3 matrix product at the learner's dtype on the same thread: what this core's
              BLAS/oneDNN reaches on the friendliest shape, the practical ceiling
FLOP per sample are counted from the network's layers (forward multiply-adds x 2, backward x 2 the
forward, less the first layer's input gradient, which is never needed). Reported: the learner's
FLOP/s, as a fraction of the gemm rate and of the core's nominal peak (FMA width x FMA units x
clock, from the CPU flags), and a torch.profiler breakdown of one update by operator class.
Ratios are formed within a round; run with nothing else on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from throughput import learner_samples_per_s, one_thread_rank  # noqa: E402

from hvd_rl.algorithms.rollout import RolloutBuffer  # noqa: E402
from hvd_rl.config import load_config  # noqa: E402
from hvd_rl.runtime import distributed as dist  # noqa: E402


def cpu_description() -> dict:
    """Model name, clock, and the nominal per-core peak for fp32 and (where native) bf16."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    first = text.split("\n\n")[0]
    fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    ghz = float(fields.get("cpu MHz", 0)) / 1000
    # two FMA pipes on every x86 core of the last decade; an FMA is 2 FLOP per lane
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4
    fp32 = 2 * 2 * lanes * ghz
    bf16 = 1024 * ghz if "amx_bf16" in flags else 2 * fp32 if "avx512_bf16" in flags else None
    return {"model": fields.get("model name", platform.processor()), "ghz": ghz,
            "isa": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
            "nominal_peak_gflops": {"fp32": round(fp32, 1), "bf16": round(bf16, 1) if bf16 else None}}


def flop_per_sample(model: nn.Module, obs: torch.Tensor) -> float:
    """Forward multiply-adds of every conv and linear layer for one sample, x2 (FLOP) x3 (forward,
    input gradient, weight gradient), minus the first layer's input gradient."""
    macs: list[float] = []

    def hook(module, inputs, output):
        if isinstance(module, nn.Conv2d):
            k = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
            macs.append(output[0].numel() * k)
        elif isinstance(module, nn.Linear):
            macs.append(module.in_features * module.out_features)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model(obs[:1])
    for h in handles:
        h.remove()
    return 2 * (3 * sum(macs) - macs[0])


def gemm_gflops(dtype: torch.dtype, size: int = 2048, repeats: int = 4) -> float:
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


OP_CLASSES = {"convolution": ("convolution", "conv"), "matmul": ("aten::mm", "aten::addmm", "aten::bmm"),
              "optimizer": ("adam", "foreach", "addcdiv", "addcmul", "lerp"), "copies": ("copy_", "_to_copy", "index_select", "contiguous")}


def profile_update(cfg, model, obs_slots, rng) -> dict[str, float]:
    """Share of one update's self CPU time by operator class."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        learner_samples_per_s(cfg, model, obs_slots, 4, rng, updates=1)
    shares: dict[str, float] = {name: 0.0 for name in (*OP_CLASSES, "other")}
    events = [e for e in prof.key_averages() if not e.key.startswith("Optimizer.")]  # wrappers: no self time
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    for e in events:
        key = e.key.lower()
        name = next((c for c, words in OP_CLASSES.items() if any(w in key for w in words)), "other")
        shares[name] += e.self_cpu_time_total / total
    return {k: round(v, 3) for k, v in shares.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "atari_ppo.toml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", default="compile", help="comma-separated: compile (or empty)")
    parser.add_argument("--cpu", type=int, default=0, help="the CPU to pin to")
    parser.add_argument("--out")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    cfg = load_config(args.config, args.overrides)
    dist.init(cfg.distributed.mpi_yield_when_idle, cfg.distributed.cycle_time_ms)
    envs, model = one_thread_rank(cfg)
    obs_space, action_space = envs.single_observation_space, envs.single_action_space
    envs.close()
    buffer = RolloutBuffer(cfg.ppo.num_steps, cfg.env.num_envs, obs_space, action_space, torch.device("cpu"))
    rng = np.random.default_rng(0)
    dtype = model.precision.dtype or torch.float32
    flop = flop_per_sample(model, buffer.obs.reshape((-1,) + tuple(buffer.obs.shape[2:])))

    import copy

    models = {"learner": model}
    warmups = {}
    for variant in filter(None, args.variants.split(",")):
        if variant != "compile":
            parser.error(f"unknown variant {variant!r}")
        compiled = copy.deepcopy(model)
        compiled.torso = torch.compile(compiled.torso)
        start = time.perf_counter()
        learner_samples_per_s(cfg, compiled, buffer.obs, action_space.n, rng, updates=1)
        warmups[variant] = time.perf_counter() - start
        models[variant] = compiled

    rounds = []
    parts = [*models, "gemm"]
    for r in range(args.rounds):
        order = parts[r % len(parts):] + parts[:r % len(parts)]
        row = {}
        for part in order:
            if part == "gemm":
                row["gemm_gflops"] = gemm_gflops(dtype)
            else:
                row[part] = learner_samples_per_s(cfg, models[part], buffer.obs, action_space.n, rng)
        row["learner_gflops"] = row["learner"] * flop / 1e9
        row["of_gemm"] = row["learner_gflops"] / row["gemm_gflops"]
        for variant in models.keys() - {"learner"}:
            row[f"{variant}_vs_learner"] = row[variant] / row["learner"]
        rounds.append(row)
        print(json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)

    cpu = cpu_description()
    peak = cpu["nominal_peak_gflops"]["bf16" if dtype == torch.bfloat16 else "fp32"]
    median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    result = {"config": os.path.relpath(args.config, REPO), "overrides": args.overrides, "cpu": cpu,
              "precision": model.precision.mode, "flop_per_sample": flop, "rounds": rounds, "median": median,
              "spread": {k: [min(r[k] for r in rounds), max(r[k] for r in rounds)] for k in rounds[0]},
              "of_nominal_peak": median["learner_gflops"] / peak if peak else None,
              "compile_warmup_s": warmups, "time_by_operator": profile_update(cfg, model, buffer.obs, rng),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps({k: result[k] for k in ("cpu", "precision", "median", "of_nominal_peak", "compile_warmup_s",
                                             "time_by_operator")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
