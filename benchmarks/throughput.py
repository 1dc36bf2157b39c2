"""Trainer throughput against the machine's limit, and weak scaling, measured in one run.

    python benchmarks/throughput.py --np 2 --out benchmarks/results/throughput/throughput_atari_2ranks_runN.json
    python benchmarks/throughput.py --combine RUN1.json RUN2.json   # medians over both runs' rounds

Each round runs, one after the other with nothing else on the machine:
  probes   one process pinned to one CPU, one thread: each part of an iteration alone, at the
           configured precision -- env steps/s (random actions through the configured vector
           env), inference steps/s (the rollout's copy-in, forward, sample), learner samples/s
           (full PPO updates: every epoch and minibatch, optimizer step included)
  1 rank   the real trainer as one process with one compute thread, pinned to one CPU (each
           of the N ranks gets one core from mpirun's default binding); run twice, right before
           and right after the N-rank run, and averaged, so that a drift of the machine's speed
           during the three runs cancels out of the weak-scaling ratio
  N ranks  the real trainer launched exactly as `make train` does (mpirun -np N --oversubscribe)
  N alone  N independent copies of the probes, then of the 1-rank trainer, at once, each pinned
           to its own CPU: no MPI, no Horovod, nothing shared but the hardware (caches, memory
           bandwidth, the host's scheduling of the virtual CPUs). What they lose against one
           copy alone is the hardware's own N-core efficiency, the bound for any N-rank run.
One iteration needs one env step, one inference and `update_epochs` learner passes per sample, so
one core can do at most 1 / (1/env + epochs/learner + 1/inference) env steps/s, and the machine
limit is that times the cores the N ranks use. Reported: N-rank SPS / machine limit, and
N-rank SPS / (N x 1-rank SPS) (weak scaling on one node). The order of the parts rotates
from round to round, and every ratio is formed within a round, so drift of a shared machine hits
both sides of a ratio alike; the summary gives the median over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hvd_rl.config import load_config, validate  # noqa: E402
from hvd_rl.cluster.launch import mpi_env  # noqa: E402

VENV_BIN = Path(sys.executable).parent
PHASES = ("time_env", "time_inference", "time_update", "time_allreduce", "time_wait", "time_iteration")


# ---- probes: one process, one CPU, one thread ---------------------------------------------------

def one_thread_rank(cfg):
    """A rank's envs and model as the trainer sets them up for one compute thread on CPU: freed
    memory kept (hvd_rl/runtime/heap.py), the configured env backend, the model at the configured
    precision. Returns (envs, model)."""
    import torch

    from hvd_rl.envs.vector import RankEnvs
    from hvd_rl.runtime.heap import retain_freed_memory
    from hvd_rl.algorithms.models import build_model
    from hvd_rl.runtime.precision import precision_for

    torch.set_num_threads(1)
    if cfg.distributed.retain_freed_memory:
        retain_freed_memory()
    envs = RankEnvs(cfg.env, threads=1)
    obs_space, action_space = envs.single_observation_space, envs.single_action_space
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, obs_space, action_space)
    model.precision = precision_for(cfg.distributed.amp, torch.device("cpu"), len(obs_space.shape) == 3)
    return envs, model


def run_probes(cfg, steps: int) -> dict[str, float]:
    import numpy as np
    import torch

    from hvd_rl.runtime import distributed as dist
    from hvd_rl.envs.vector import env_seeds
    from hvd_rl.algorithms.models import InferencePolicy
    from hvd_rl.algorithms.rollout import RolloutBuffer

    dist.init(cfg.distributed.mpi_yield_when_idle, cfg.distributed.cycle_time_ms)
    envs, model = one_thread_rank(cfg)
    obs_space, action_space = envs.single_observation_space, envs.single_action_space
    policy = InferencePolicy(model)
    n = cfg.env.num_envs

    # env: random actions, as many steps as a rollout would take
    envs.reset(env_seeds(cfg.seed + 7919, 0, 0, n))
    rng = np.random.default_rng(0)
    actions = [rng.integers(0, action_space.n, size=n) for _ in range(steps + 32)]
    for a in actions[:32]:
        envs.step(a)
    start = time.perf_counter()
    for a in actions[32:]:
        envs.step(a)
    env_rate = steps * n / (time.perf_counter() - start)
    envs.close()

    # inference: the collector's per-step work without the env
    frames = [rng.integers(0, 255, (n,) + obs_space.shape).astype(obs_space.dtype) for _ in range(4)]
    buffer = RolloutBuffer(cfg.ppo.num_steps, n, obs_space, action_space, torch.device("cpu"))
    slots = buffer.obs
    with torch.no_grad():
        for step in range(steps + 32):
            if step == 32:
                start = time.perf_counter()
            slot = slots[step % len(slots)]
            slot.copy_(torch.from_numpy(frames[step % 4]))
            logits, _ = policy(slot)
            policy.sample(logits)[0].numpy()
    inference_rate = steps * n / (time.perf_counter() - start)

    learner_rate = learner_samples_per_s(cfg, model, buffer.obs, action_space.n, rng)
    return {"env_sps": env_rate, "inference_sps": inference_rate, "learner_samples_per_s": learner_rate,
            "precision": model.precision.mode}


def learner_samples_per_s(cfg, model, obs_slots, n_actions: int, rng, updates: int = 2) -> float:
    """Full PPO updates on a rollout-sized synthetic batch in `obs_slots` (the rollout buffer's
    frames, on the model's device, as rollout_batch sees them): samples through the learner per
    second over `updates` timed updates, after one warm-up update."""
    import numpy as np
    import torch

    from hvd_rl.runtime import distributed as dist
    from hvd_rl.algorithms.ppo import Batch, PPOLearner

    device = obs_slots.device
    size = cfg.local_batch_size
    obs_shape = tuple(obs_slots.shape[2:])
    obs = obs_slots.reshape((size,) + obs_shape)
    obs.copy_(torch.from_numpy(rng.integers(0, 255, (size,) + obs_shape).astype(np.uint8)).to(obs.dtype))
    batch = Batch(obs=obs, actions=torch.from_numpy(rng.integers(0, n_actions, size)).to(device),
                  logprobs=torch.full((size,), -1.4, device=device), values=torch.zeros(size, device=device),
                  advantages=torch.from_numpy(rng.normal(size=size).astype(np.float32)).to(device),
                  returns=torch.from_numpy(rng.normal(size=size).astype(np.float32)).to(device))
    optimizer = dist.distributed_optimizer(
        model.precision.adam(model.parameters(), lr=cfg.ppo.learning_rate, eps=cfg.ppo.adam_eps), model,
        reduction="average", compression="none", backward_passes_per_step=cfg.ppo.backward_passes_per_step)
    learner = PPOLearner(model, optimizer, cfg.ppo, cfg.seed, scaler=model.precision.grad_scaler(), device=device)
    learner.update(batch, 1, 0, cfg.env.num_envs, cfg.ppo.num_steps)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    passes = 0
    for iteration in range(2, 2 + updates):
        passes += size * learner.update(batch, iteration, 0, cfg.env.num_envs, cfg.ppo.num_steps).epochs_run
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return passes / (time.perf_counter() - start)


def repo_relative(path: str) -> str:
    """A path as results record it: relative to the repository, never a machine's absolute path."""
    return os.path.relpath(Path(path).resolve(), REPO)


def core_ceiling(probe: dict[str, float], epochs: int) -> float:
    """Env steps/s one core can reach when an iteration costs env + inference + epochs x learner."""
    return 1.0 / (1.0 / probe["env_sps"] + epochs / probe["learner_samples_per_s"] + 1.0 / probe["inference_sps"])


# ---- the real trainer ---------------------------------------------------------------------------

def train_command(config: str, overrides: list[str], ranks: int, run_dir: Path, iterations: int) -> list[str]:
    """`hvd-rl train` for exactly `iterations` iterations of `ranks` ranks, no checkpoints or logs."""
    cfg = load_config(config, overrides)
    total = iterations * ranks * cfg.local_batch_size
    return [str(VENV_BIN / "hvd-rl"), "train", "--config", str(config), "--run-dir", str(run_dir),
            *[x for s in overrides for x in ("--set", s)],
            "--set", f"ppo.total_timesteps={total}", "--set", "checkpoint.every=0",
            "--set", "logging.tensorboard=false", "--set", "logging.console=false"]


def measure_run(cmd: list[str], run_dir: Path, warmup: int, timeout: float) -> dict:
    """Runs a trainer command that writes to `run_dir`, then reads the run (`read_run`)."""
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return read_run(run_dir, warmup)


def read_run(run_dir: Path, warmup: int) -> dict:
    """A finished run's SPS and mean phase times over the iterations after `warmup`."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = rows[warmup:]
    first_step = rows[warmup - 1]["global_step"] if warmup else 0
    seconds = sum(r["time_iteration"] for r in measured)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"sps": (measured[-1]["global_step"] - first_step) / seconds, "iterations": len(measured),
            "phases_s": {k: statistics.mean(r[k] for r in measured) for k in PHASES},
            "collectives_per_iteration": statistics.mean(r["collectives"] for r in measured),
            "page_faults_per_rank_iteration": statistics.mean(
                statistics.mean(r["page_faults_by_rank"]) for r in measured),
            "precision": measured[-1]["precision"],
            "runtime_settings": summary["topology"].get("runtime_settings")}


def trainer_run(args, ranks: int, run_dir: Path, iterations: int) -> dict:
    train = train_command(args.config, args.overrides, ranks, run_dir, iterations)
    if ranks == 1:
        # One core, as each of the N ranks gets from mpirun's default binding (--bind-to core).
        cmd = pinned(train + ["--set", "distributed.threads_per_rank=1"])
    else:  # make train's command line
        cmd = [shutil.which("mpirun") or "mpirun", "-np", str(ranks), "--oversubscribe", *args.mpirun_arg, *train]
    return measure_run(cmd, run_dir, args.warmup, args.timeout)


def pinned(cmd: list[str], copy: int = 0) -> list[str]:
    """The command confined to one CPU: the first this process may use, or the copy-th."""
    if not shutil.which("taskset"):
        raise RuntimeError("taskset (util-linux) is needed to measure on one core")
    cpus = sorted(os.sched_getaffinity(0))
    if copy >= len(cpus):
        raise RuntimeError(f"{copy + 1} CPUs needed to run {copy + 1} copies side by side; this process may use {len(cpus)}")
    return ["taskset", "-c", str(cpus[copy]), *cmd]


def run_together(cmds: list[list[str]], timeout: float) -> list[str]:
    """Runs the commands at once; their stdout, or an error naming the first that failed."""
    procs = [subprocess.Popen(cmd, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in cmds]
    outputs = [proc.communicate(timeout=timeout) for proc in procs]
    for cmd, proc, (out, err) in zip(cmds, procs, outputs):
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}):\n{out[-2000:]}{err[-2000:]}")
    return [out for out, _ in outputs]


def probe_runs(args, copies: int) -> list[dict]:
    """The probes alone (copies=1) or as `copies` independent processes at once, one per CPU."""
    cmd = [sys.executable, __file__, "--probe", "--config", str(args.config), "--steps", str(args.steps),
           *[x for s in args.overrides for x in ("--set", s)]]
    outputs = run_together([pinned(cmd, copy) for copy in range(copies)], args.timeout)
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


def independent_trainers(args, run_dir: Path, iterations: int) -> list[dict]:
    """N one-rank trainers at once, each pinned to its own CPU: the N-rank run minus all communication."""
    cmds, dirs = [], []
    for copy in range(args.np):
        dirs.append(run_dir / f"copy{copy}")
        train = train_command(args.config, args.overrides, 1, dirs[-1], iterations)
        cmds.append(pinned(train + ["--set", "distributed.threads_per_rank=1"], copy))
    run_together(cmds, args.timeout)
    return [read_run(d, args.warmup) for d in dirs]


def summarize(rounds: list[dict], ranks: int, epochs: int) -> dict:
    for r in rounds:
        r["core_ceiling_sps"] = core_ceiling(r["probes"], epochs)
        r["machine_limit_sps"] = ranks * r["core_ceiling_sps"]
        r["fraction_of_machine_limit"] = r["n_ranks"]["sps"] / r["machine_limit_sps"]
        r["one_rank_sps"] = statistics.mean(r[k]["sps"] for k in ("one_rank", "one_rank_after"))
        r["weak_scaling"] = r["n_ranks"]["sps"] / (ranks * r["one_rank_sps"])
        together = [core_ceiling(p, epochs) for p in r["probes_together"]]
        r["hardware_limit_sps"] = sum(together)
        r["hardware_efficiency"] = sum(together) / r["machine_limit_sps"]
        r["fraction_of_hardware_limit"] = r["n_ranks"]["sps"] / r["hardware_limit_sps"]
        r["independent_trainers_sps"] = sum(t["sps"] for t in r["trainers_together"])
        r["independent_scaling"] = r["independent_trainers_sps"] / (ranks * r["one_rank_sps"])
        r["vs_independent_trainers"] = r["n_ranks"]["sps"] / r["independent_trainers_sps"]

    def med(get):
        return statistics.median(get(r) for r in rounds)

    return {
        "n_ranks_sps": med(lambda r: r["n_ranks"]["sps"]),
        "one_rank_sps": med(lambda r: r["one_rank_sps"]),
        "machine_limit_sps": med(lambda r: r["machine_limit_sps"]),
        "fraction_of_machine_limit": med(lambda r: r["fraction_of_machine_limit"]),
        "weak_scaling": med(lambda r: r["weak_scaling"]),
        "hardware_limit_sps": med(lambda r: r["hardware_limit_sps"]),
        "hardware_efficiency": med(lambda r: r["hardware_efficiency"]),
        "fraction_of_hardware_limit": med(lambda r: r["fraction_of_hardware_limit"]),
        "independent_trainers_sps": med(lambda r: r["independent_trainers_sps"]),
        "independent_scaling": med(lambda r: r["independent_scaling"]),
        "vs_independent_trainers": med(lambda r: r["vs_independent_trainers"]),
        "probes": {k: med(lambda r, k=k: r["probes"][k])
                   for k in ("env_sps", "inference_sps", "learner_samples_per_s")},
        "collectives_per_iteration": med(lambda r: r["n_ranks"]["collectives_per_iteration"]),
    }


def print_summary(summary: dict, ranks: int, cfg, precision: str, rounds: int) -> None:
    p = summary["probes"]
    print(f"{ranks} ranks x 1 thread, {cfg.env.num_envs} envs/rank, {cfg.env.id} ({cfg.env.backend}), "
          f"precision {precision}; medians over {rounds} rounds")
    print(f"  one core alone: env {p['env_sps']:.0f} steps/s, inference {p['inference_sps']:.0f} steps/s, "
          f"learner {p['learner_samples_per_s']:.0f} samples/s (x{cfg.ppo.update_epochs} epochs)")
    print(f"  machine limit       {summary['machine_limit_sps']:8.0f} SPS  = {ranks} cores x "
          f"1/(1/env + {cfg.ppo.update_epochs}/learner + 1/inference)")
    print(f"  1 rank, 1 thread    {summary['one_rank_sps']:8.0f} SPS (before and after the {ranks}-rank run)")
    print(f"  {ranks} ranks             {summary['n_ranks_sps']:8.0f} SPS "
          f"({summary['collectives_per_iteration']:.0f} collectives per iteration)")
    print(f"  {ranks} ranks / machine limit   {summary['fraction_of_machine_limit']:.2f}")
    print(f"  {ranks} ranks / ({ranks} x 1 rank)     {summary['weak_scaling']:.2f}")
    print(f"  the hardware alone: {ranks} probe copies at once reach {summary['hardware_efficiency']:.2f} of the machine "
          f"limit ({summary['hardware_limit_sps']:.0f} SPS); {ranks} independent 1-rank trainers at once "
          f"{summary['independent_trainers_sps']:.0f} SPS = {summary['independent_scaling']:.2f} x ({ranks} x 1 rank)")
    print(f"  {ranks} ranks / hardware limit  {summary['fraction_of_hardware_limit']:.2f}")
    print(f"  {ranks} ranks / {ranks} independent trainers  {summary['vs_independent_trainers']:.2f}")


def combine(paths: list[str]) -> int:
    """Medians over the rounds of several runs of the same setup (more rounds, less drift)."""
    results = [json.loads(Path(path).read_text()) for path in paths]
    setup = {k: results[0][k] for k in ("config", "overrides", "ranks", "update_epochs")}
    for path, result in zip(paths, results):
        if {k: result[k] for k in setup} != setup:
            raise SystemExit(f"throughput.py: {path} measured another setup than {paths[0]}")
    rounds = [r for result in results for r in result["rounds"]]
    if any("one_rank_after" not in r for r in rounds):
        raise SystemExit("throughput.py: a run predates the bracketing 1-rank runs; combine newer runs only")
    if len({json.dumps(r["n_ranks"]["runtime_settings"], sort_keys=True) for r in rounds}) > 1:
        raise SystemExit("throughput.py: these runs waited with different MPI/Horovod settings")
    cfg = load_config(setup["config"], setup["overrides"])
    print(f"{len(rounds)} rounds from {', '.join(paths)}")
    print_summary(summarize(rounds, setup["ranks"], setup["update_epochs"]), setup["ranks"], cfg,
                  rounds[0]["n_ranks"]["precision"], len(rounds))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/atari_ppo.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--np", type=int, default=2, help="ranks of the multi-rank run (one core each)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=6, help="measured trainer iterations per run")
    parser.add_argument("--warmup", type=int, default=1, help="trainer iterations not measured")
    parser.add_argument("--steps", type=int, default=256, help="env and inference probe steps")
    parser.add_argument("--mpirun-arg", action="append", default=[], help="extra mpirun argument (experiments)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--combine", nargs="+", metavar="RESULT_JSON",
                        help="no measuring: the summary over all rounds of these result files (same config)")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.chdir(REPO)  # paths in results stay relative to the repository
    args.config = repo_relative(args.config)

    cfg = load_config(args.config, args.overrides)
    validate(cfg)
    if args.probe:
        print(json.dumps(run_probes(cfg, args.steps)))
        return 0
    if args.combine:
        return combine(args.combine)

    # The 1-rank runs bracket the N-rank run (see the module docstring); the blocks rotate.
    order = ["probes", "scaling", "together"]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            result: dict = {}
            for part in order[index % len(order):] + order[:index % len(order)]:
                if part == "probes":
                    result[part] = probe_runs(args, 1)[0]
                elif part == "together":
                    result["probes_together"] = probe_runs(args, args.np)
                    result["trainers_together"] = independent_trainers(
                        args, Path(tmp) / f"together-{index}", args.warmup + args.iterations)
                else:
                    for name, ranks in (("one_rank", 1), ("n_ranks", args.np), ("one_rank_after", 1)):
                        result[name] = trainer_run(args, ranks, Path(tmp) / f"{name}-{index}",
                                                   args.warmup + args.iterations)
            rounds.append(result)
            print(f"round {index + 1}: probes env {result['probes']['env_sps']:.0f} inference "
                  f"{result['probes']['inference_sps']:.0f} learner {result['probes']['learner_samples_per_s']:.0f} | "
                  f"1 rank {result['one_rank']['sps']:.0f} / {result['one_rank_after']['sps']:.0f} SPS (before / after) | "
                  f"{args.np} ranks {result['n_ranks']['sps']:.0f} SPS | "
                  f"{args.np} independent 1-rank trainers {sum(t['sps'] for t in result['trainers_together']):.0f} SPS",
                  flush=True)
    summary = summarize(rounds, args.np, cfg.ppo.update_epochs)
    import torch

    result = {
        "command": "python benchmarks/throughput.py " + " ".join(
            repo_relative(a) if os.path.isabs(a) else a for a in sys.argv[1:]),
        "config": str(args.config), "overrides": args.overrides, "ranks": args.np, "threads_per_rank": 1,
        "cores_used": args.np, "envs_per_rank": cfg.env.num_envs, "env": cfg.env.id, "backend": cfg.env.backend,
        "update_epochs": cfg.ppo.update_epochs, "launch": f"mpirun -np {args.np} --oversubscribe hvd-rl train",
        "summary": summary, "rounds": rounds,
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "torch": torch.__version__},
    }
    print_summary(summary, args.np, cfg, rounds[0]["n_ranks"]["precision"], args.rounds)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
