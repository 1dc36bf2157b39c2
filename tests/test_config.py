"""Config loading, overrides and validation (before any rank starts work)."""
import tomllib

import pytest

from conftest import ATARI, BIN, CARTPOLE, QUICK, check, mpirun_cmd, run, train_cmd
from hvd_rl.config import ConfigError, TrainConfig, load_config, validate


def test_presets_load_and_validate():
    atari = load_config(ATARI)
    validate(atari)
    assert (atari.env.num_envs, atari.ppo.num_steps, atari.ppo.clip_coef) == (8, 128, 0.1)
    assert atari.ppo.learning_rate == 2.5e-4 and atari.ppo.adam_eps == 1e-5
    assert atari.ppo.total_timesteps == 10_000_000 and atari.ppo.max_grad_norm == 0.5
    assert atari.model.kind == "nature_cnn" and atari.env.frame_stack == 4 and atari.env.noop_max == 30
    cartpole = load_config(CARTPOLE)
    validate(cartpole)
    assert cartpole.model.kind == "mlp"


def test_overrides_apply_in_order_and_coerce_types():
    cfg = load_config(CARTPOLE, ["ppo.total_timesteps=1e5", "env.num_envs=3", "ppo.anneal_lr=false",
                                 "env.id=ALE/Pong-v5", "model.hidden_sizes=[32, 16]", "seed=7",
                                 "env.num_envs=5"])
    assert cfg.ppo.total_timesteps == 100_000 and isinstance(cfg.ppo.total_timesteps, int)
    assert cfg.env.num_envs == 5 and cfg.ppo.anneal_lr is False and cfg.env.id == "ALE/Pong-v5"
    assert cfg.model.hidden_sizes == [32, 16] and cfg.seed == 7


@pytest.mark.parametrize("override, message", [
    ("ppo.bogus=1", "unknown key 'ppo.bogus'"),
    ("nosuch.key=1", "unknown key 'nosuch'"),
    ("env.num_envs=many", "expected an integer"),
    ("ppo.anneal_lr=maybe", "expected true or false"),
    ("justtext", "expected section.key=value"),
])
def test_bad_overrides_are_rejected(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CARTPOLE, [override])


def test_validation_lists_every_problem():
    cfg = load_config(CARTPOLE, ["env.num_envs=0", "ppo.num_steps=30", "ppo.num_minibatches=4",
                                 "distributed.reduction=sum", "env.backend=gpu", "ppo.gamma=1.5"])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    text = str(err.value)
    for fragment in ("env.num_envs must be positive", "divisible by ppo.num_minibatches",
                     "distributed.reduction", "env.backend", "ppo.gamma"):
        assert fragment in text


def test_unknown_env_id_and_wrong_backend():
    with pytest.raises(ConfigError, match="not a registered Gymnasium environment"):
        validate(load_config(CARTPOLE, ["env.id=NoSuchEnv-v0"]))
    with pytest.raises(ConfigError, match="needs an ALE environment"):
        validate(load_config(CARTPOLE, ["env.backend=ale_vector"]))


def test_resolved_config_round_trips_through_toml():
    cfg = load_config(ATARI, ["seed=3"])
    again = TrainConfig()
    from hvd_rl.config import _apply

    _apply(again, tomllib.loads(cfg.to_toml()), "roundtrip")
    assert again == cfg


def test_check_config_cli_prints_resolved_toml():
    out = check(run([BIN / "hvd-rl", "train", "--config", CARTPOLE, "--set", "ppo.num_steps=64",
                     "--check-config"], timeout=60))
    assert tomllib.loads(out)["ppo"]["num_steps"] == 64


def test_missing_config_file_is_one_clear_error(tmp_path):
    result = run([BIN / "hvd-rl", "train", "--config", tmp_path / "nope.toml"], timeout=60)
    assert result.returncode == 2
    assert "config file not found" in result.stdout and "Traceback" not in result.stdout


@pytest.mark.parametrize("overrides, message", [
    # Adasum's result is not an average: a rank's share cannot weight its loss (finding 11).
    (["distributed.env_counts=[1, 3]", "distributed.reduction=adasum", "ppo.max_grad_norm=0"],
     "distributed.env_counts needs distributed.reduction = 'average'"),
    # Uneven shares that do not split into whole micro-batches would leave no rollout length at
    # all: the run would end "complete" at step 0 (finding 13).
    (["distributed.env_counts=[1, 3]", "ppo.num_steps=32", "ppo.num_minibatches=4",
      "ppo.backward_passes_per_step=16", "env.num_envs=4"], "every rank's minibatch share"),
    (["distributed.balance=dynamic", "ppo.num_steps=32", "ppo.num_minibatches=4",
      "ppo.backward_passes_per_step=16", "env.num_envs=4"], "distributed.balance may give a rank any number"),
])
def test_uneven_layouts_refuse_what_they_cannot_serve(overrides, message):
    cfg = load_config(CARTPOLE, overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_uneven_layouts_accept_micro_batches_that_split():
    validate(load_config(CARTPOLE, ["distributed.env_counts=[1, 3]", "ppo.num_steps=32", "ppo.num_minibatches=4",
                                    "ppo.backward_passes_per_step=8", "env.num_envs=4"]))
    validate(load_config(CARTPOLE, ["distributed.balance=dynamic", "ppo.num_steps=32", "ppo.num_minibatches=4",
                                    "ppo.backward_passes_per_step=8", "env.num_envs=4"]))


def test_refused_config_is_printed_once_for_all_ranks(tmp_path):
    """2 real ranks: one copy of the message (rank 0's, naming the rank count), not one per rank,
    every line ended; mpirun exits 2."""
    run_dir = tmp_path / "run"
    result = run(mpirun_cmd(2, BIN / "hvd-rl", "train", "--config", CARTPOLE, "--run-dir", run_dir,
                            "--set", "ppo.gamma=2"), timeout=120)
    assert result.returncode == 2, result.stdout
    lines = [line for line in result.stdout.splitlines() if "hvd-rl" in line]
    assert lines == ["hvd-rl: error (all 2 ranks): invalid configuration: ppo.gamma must be in [0, 1], got 2.0"], \
        result.stdout
    assert "Traceback" not in result.stdout and not run_dir.exists()


def test_every_rank_exits_2_and_a_multi_line_message_stays_whole(tmp_path):
    """Each rank's own exit code (a wrapper reports it, so mpirun ends nobody): rank 1 leaves the
    message to rank 0, waits HVD_RL_ERROR_WAIT_S for the launcher to end the job, and since this
    one does not, prints its own copy and exits 2 too. No line runs into another."""
    wrapper = ['bash', '-c', '"$@"; echo "rank $OMPI_COMM_WORLD_RANK exited $?"', "wrapper"]
    result = run(["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", "-x", "HVD_RL_ERROR_WAIT_S=2",
                  *wrapper, BIN / "hvd-rl", "train", "--config", CARTPOLE, "--run-dir", tmp_path / "run",
                  "--set", "ppo.gamma=2", "--set", "ppo.gae_lambda=-1"], timeout=120)
    assert result.returncode == 0, result.stdout
    out = result.stdout
    assert "rank 0 exited 2" in out and "rank 1 exited 2" in out, out
    with pytest.raises(ConfigError) as err:
        validate(load_config(CARTPOLE, ["ppo.gamma=2", "ppo.gae_lambda=-1"]))
    message = str(err.value)
    assert message.startswith("invalid configuration (2 problems):"), message
    assert out.count(f"hvd-rl: error (all 2 ranks): {message}\n") == 1, out
    assert out.count(f"[rank 1] hvd-rl: error: {message}\n") == 1, out
    assert out.index("hvd-rl: error (all 2 ranks)") < out.index("[rank 1] hvd-rl: error")


@pytest.mark.parametrize("run_dir", ["runs/\U0001f680", "runs/a\"b\\c", "runs/del\x7f"])
def test_run_dir_option_is_taken_verbatim(run_dir):
    """--run-dir travels as a TOML string: json.dumps wrote '\\ud83d\\ude80' (not TOML), and the
    run directory became the quoted escape text."""
    import argparse

    from hvd_rl.cli import _load_train_config

    cfg = _load_train_config(argparse.Namespace(config=str(CARTPOLE), overrides=[], run_dir=run_dir))
    assert cfg.run_dir == run_dir


def test_negative_seed_is_refused_before_any_rank_starts():
    """It passed validate() and every rank died in np.random.SeedSequence with a traceback."""
    with pytest.raises(ConfigError, match=r"^invalid configuration: seed must be >= 0 .*got -1$"):
        validate(load_config(CARTPOLE, ["seed=-1"]))
    validate(load_config(CARTPOLE, ["seed=0"]))


# ---- distributed.env_counts: one entry per rank (review item 5) ------------------------------

ENV_COUNTS_MESSAGE = ("invalid configuration: distributed.env_counts has 2 entries ([1, 3]) for a job of 3 ranks: "
                      "give one count per rank")


def test_env_counts_must_have_one_entry_per_rank():
    cfg = load_config(CARTPOLE, ["distributed.env_counts=[1, 3]"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=3)
    assert str(err.value) == ENV_COUNTS_MESSAGE
    validate(cfg, world_size=2)
    validate(cfg)  # the rank count unknown yet: hvd-rl train checks again after hvd.init
    validate(cfg, world_size=3, elastic=True)  # a resized elastic world falls back to env.num_envs


def test_env_counts_of_another_length_exits_2_before_anything_is_written(tmp_path):
    """3 real ranks, env_counts for 2 (mpirun says the size before Horovod starts): one line,
    exit 2, no run directory. It trained on env.num_envs per rank before."""
    run_dir = tmp_path / "run"
    result = run(mpirun_cmd(3, *train_cmd(run_dir, *QUICK, "ppo.total_timesteps=384", "distributed.env_counts=[1, 3]")), timeout=120)
    assert result.returncode == 2, result.stdout[-4000:]
    assert [line for line in result.stdout.splitlines() if "hvd-rl" in line] == \
        [f"hvd-rl: error (all 3 ranks): {ENV_COUNTS_MESSAGE}"], result.stdout
    assert "Traceback" not in result.stdout and not run_dir.exists()


def test_env_counts_checked_after_init_where_the_launcher_does_not_say_the_size(tmp_path):
    """A launcher that names each rank but not the count (here mpirun with OMPI_COMM_WORLD_SIZE
    removed; Horovod still finds 3 ranks through MPI): the ranks agree on the refusal right after
    hvd.init, rank 0 prints it once, every rank exits 2 (each rank's own code, reported by a
    wrapper) and nothing is written."""
    run_dir = tmp_path / "run"
    wrapper = ["bash", "-c", 'r=$OMPI_COMM_WORLD_RANK; unset OMPI_COMM_WORLD_SIZE; "$@"; echo "rank $r exited $?"',
               "wrapper"]
    result = run(mpirun_cmd(3, *wrapper, *train_cmd(run_dir, *QUICK, "ppo.total_timesteps=384", "distributed.env_counts=[1, 3]")), timeout=180)
    out = result.stdout
    assert all(f"rank {r} exited 2" in out for r in range(3)), out[-4000:]
    assert [line for line in out.splitlines() if "hvd-rl" in line] == [f"hvd-rl: error (all 3 ranks): {ENV_COUNTS_MESSAGE}"], out
    assert "Traceback" not in out and not run_dir.exists()


# ---- every pairwise refusal is in the README's table (review item 6) ------------------------

FREE_TEXT = {"env.id", "run_dir", "logging.wandb_project", "logging.wandb_entity", "logging.wandb_group",
             "model.hidden_sizes", "logging.wandb_tags"}


def _probe_values() -> dict[str, list]:
    """Each setting's values besides its default: every other choice, the other truth value, 0
    for a number (1 where 0 is the default); and how a job is launched: ranks, an uneven layout."""
    import dataclasses
    import typing

    from hvd_rl.config import CHOICES, section_classes

    defaults, out = TrainConfig(), {}
    owners = [(None, TrainConfig)] + list(section_classes().items())
    for section, cls in owners:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in section_classes() or f"{section}.{f.name}" == "distributed.env_counts":
                continue  # a section; the layout (below)
            path = f"{section}.{f.name}" if section else f.name
            default = getattr(getattr(defaults, section) if section else defaults, f.name)
            if path in CHOICES:
                out[path] = [c for c in CHOICES[path] if c != default]
            elif hints[f.name] is bool:
                out[path] = [not default]
            elif hints[f.name] in (int, float):
                out[path] = [hints[f.name](0 if default else 1)]
            else:
                assert path in FREE_TEXT, f"{path}: add its values to config.CHOICES (or here, if free text)"
    return out | {"ranks": [2, 3], "layout": ["uneven"]}


def _problems(assignment: dict) -> frozenset[str]:
    from hvd_rl import combinations
    from hvd_rl.combinations import uneven_counts
    from hvd_rl.config import MULTIAGENT_ALGORITHMS, config_problems

    cfg, ranks = TrainConfig(), assignment.get("ranks", 1)
    for path, value in assignment.items():
        if "." in path or path not in ("ranks", "layout"):
            *section, name = path.split(".")
            setattr(getattr(cfg, section[0]) if section else cfg, name, value)
    if cfg.algorithm in MULTIAGENT_ALGORITHMS:  # as the table runs them: on a multi-agent task
        cfg.env.id = combinations.ENV_IDS[cfg.algorithm]
    if "layout" in assignment:
        cfg.distributed.env_counts = uneven_counts(ranks)
    return frozenset(config_problems(cfg, world_size=ranks))


def test_every_refusal_of_a_pair_of_settings_is_in_the_table():
    """validate() probed over every setting (not just the table's options) one and two at a time:
    a problem that needs both values, or that one value raises and another cures, is a refused
    pair, and the README's table must name it. Values refused whatever else is set (num_envs = 0)
    are not options. Fails for a rule added to validate() that the table's options do not reach."""
    import itertools

    from hvd_rl import combinations

    values = [(path, v) for path, vs in _probe_values().items() for v in vs]
    assert _problems({}) == frozenset()
    single = {pv: _problems(dict([pv])) for pv in values}
    pair = {(a, b): _problems(dict([a, b])) for a, b in itertools.combinations(values, 2) if a[0] != b[0]}
    usable = {pv for pv in values if not single[pv]} | {x for key, found in pair.items() if not found for x in key}
    refused: dict[str, tuple] = {}
    for (a, b), found in pair.items():
        if a in usable and b in usable:
            alone = single[a] | single[b]
            for problem in (found - alone) | (alone - found):  # needs both / raised by one, cured by the other
                refused.setdefault(problem, (a, b))
    table = {why for _, _, why in combinations.refused_pairs()}
    assert any("cannot clip gradients" in p for p in refused)  # Adasum with the default ppo.max_grad_norm
    missing = {p: pv for p, pv in refused.items() if p not in table}
    assert not missing, f"refused pairs missing from the README's table (hvd_rl/combinations.py): {missing}"
    assert set(refused) == table  # and the table names nothing validate() does not refuse
