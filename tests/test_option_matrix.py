"""Options tested together: a generated pairwise matrix of real runs (issue 22).

Every pair of values of any two options (hvd_rl.combinations.OPTIONS) appears in at least one row:
a greedy pairwise cover of the whole option space, generated, nobody picks the rows. `validate()`
is the oracle for what must be refused: a row it refuses must exit 2 on every rank, before any
rank starts work, with one line naming the conflict; a row it accepts must run a few short
iterations to exactly total_timesteps on every rank, with identical parameters at the end and an
algorithm that really updated. Never a hang (every launch has a timeout), never a traceback.

The runnable rows cover every pair found in some combination `validate()` accepts (so every
accepted pair is covered by a run), the refused rows every pair found in some refused combination
(each refusal rule meets the other options). Small CartPole/Pendulum settings keep a row at a few
seconds; one Atari row covers the image path. `distributed.amp = fp16` needs CUDA and is left out
on CPUs (its refusal there is tested in tests/test_precision.py).
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import pytest

from conftest import ATARI, REPO, mpirun_cmd, read_jsonl, run, train_cmd
from hvd_rl import combinations
from hvd_rl.combinations import NAMES, OPTIONS, option_overrides
from hvd_rl.config import load_config

CONFIGS = {"ppo_discrete": REPO / "configs" / "cartpole_ppo.toml",
           "ppo_continuous": REPO / "configs" / "cartpole_ppo.toml",  # env.id set to Pendulum by the row
           "dqn": REPO / "configs" / "cartpole_dqn.toml",
           "mappo": REPO / "configs" / "mpe_spread_mappo.toml"}
STEPS = 16  # PPO steps per env per iteration; the totals below are multiples of every global batch
FIRST_TOTAL, TOTAL = 192, 384  # a resumed row runs to FIRST_TOTAL, then resumes to TOTAL


@dataclass(frozen=True)
class Row:
    values: tuple

    def __getattr__(self, name: str):
        return self.values[NAMES.index(name)]

    def id(self) -> str:
        return "-".join(str(v) for v in self.values)


def overrides(row: Row, *, num_envs: int = 2, total: int = TOTAL, ranks: int | None = None,
              pipeline: str = "sync") -> list[str]:
    """The row's options (hvd_rl.combinations, shared with the docs' table of refused pairs) and small sizes;
    `ranks`: launched on another number of ranks (a resume), whose uneven layout has one count per rank."""
    values = dict(zip(NAMES, row.values)) | {"ranks": ranks or row.ranks, "pipeline": pipeline}
    sets = ["logging.tensorboard=false", "logging.console=false", f"env.num_envs={num_envs}",
            "distributed.balance_every=2", "distributed.verify_every=1", "checkpoint.every=2",
            *option_overrides(values)]
    if row.algorithm == "dqn":
        return sets + [f"dqn.total_timesteps={total}", "dqn.buffer_size=256", "dqn.learning_starts=96",
                       "dqn.batch_size=32", "dqn.train_frequency=4", "dqn.target_network_frequency=64",
                       "dqn.steps_per_iteration=96", "dqn.checkpoint_replay=true"]
    sets += [f"ppo.total_timesteps={total}", f"ppo.num_steps={STEPS}", "ppo.num_minibatches=2", "ppo.update_epochs=2"]
    if row.algorithm == "ppo_continuous":
        sets += ["ppo.normalize_observations=true", "ppo.normalize_rewards=true"]
    return sets


def refusal(row: Row, pipeline: str = "sync") -> str | None:
    """What validate() says against the row (as the first launch would run it), or None."""
    total = FIRST_TOTAL if row.start != "fresh" else TOTAL
    return combinations.refusal(load_config(CONFIGS[row.algorithm], overrides(row, total=total, pipeline=pipeline)),
                                row.ranks)


def greedy_cover(rows: list[Row], parts) -> list[Row]:
    """A few of `rows` that together hold every part (`parts(row)`: a set) that any of them holds:
    greedy (each pick covers the most parts not covered yet), deterministic."""
    todo = set().union(*(parts(r) for r in rows)) if rows else set()
    chosen = []
    while todo:
        best = max(rows, key=lambda r: len(parts(r) & todo))
        chosen.append(best)
        todo -= parts(best)
    return chosen


def pairwise(rows: list[Row]) -> list[Row]:
    """Rows holding every pair of option values that any of `rows` holds."""
    return greedy_cover(rows, lambda row: {(a, row.values[a], b, row.values[b]) for a in range(len(NAMES))
                                           for b in range(a + 1, len(NAMES))})


def single_cover(rows: list[Row]) -> list[Row]:
    """Rows holding every option value that any of `rows` holds."""
    return greedy_cover(rows, lambda row: set(enumerate(row.values)))


SPACE = [Row(values) for values in itertools.product(*OPTIONS.values())]
_REFUSALS = {row: refusal(row) for row in SPACE}
RUNNABLE = pairwise([row for row in SPACE if _REFUSALS[row] is None])
REFUSED = pairwise([row for row in SPACE if _REFUSALS[row] is not None])
# ppo.pipeline = "overlap" meets every value of every other option at least once: a single cover,
# not pairwise (crossed with the whole space it would double the matrix's runs and its collection).
# Its own refusals (algorithms other than PPO, balancing) are rows that run with "sync".
_OVERLAP_CANDIDATES = [row for row in SPACE if _REFUSALS[row] is None and row.algorithm.startswith("ppo")
                       and row.balance == "off"]
OVERLAP_RUNNABLE = single_cover(_OVERLAP_CANDIDATES)
OVERLAP_REFUSED = single_cover([row for row in RUNNABLE if row.algorithm in ("dqn", "mappo") or row.balance != "off"])


def _launch(row: Row, run_dir, ranks: int, *, num_envs: int = 2, total: int = TOTAL, resume: bool = False,
            pipeline: str = "sync"):
    cmd = train_cmd(run_dir, *overrides(row, num_envs=num_envs, total=total, ranks=ranks, pipeline=pipeline),
                    config=CONFIGS[row.algorithm], extra=("--resume", "auto") if resume else ())
    return run(mpirun_cmd(ranks, *cmd), timeout=240)


def _assert_clean_exit(result, code: int = 0) -> None:
    assert result.returncode == code, result.stdout[-4000:]
    assert "Traceback" not in result.stdout, result.stdout[-4000:]


def _assert_trained(row: Row, run_dir, total: int) -> None:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert rows[-1]["global_step"] == total == summary["global_step"]
    assert summary["parameters_identical"] and all(r["parameters_identical"] for r in rows)
    if row.algorithm == "dqn":
        assert sum(r["updates"] for r in rows) > 0
        assert all(r["td_loss"] is not None and r["td_loss"] == r["td_loss"] for r in rows if r["updates"])
    else:
        assert all(isinstance(r["policy_loss"], float) and abs(r["policy_loss"]) < 1e6 for r in rows)


def test_the_matrix_covers_every_pair_and_both_outcomes():
    assert len(RUNNABLE) >= 9 and len(REFUSED) >= 1
    for a in range(len(NAMES)):
        for b in range(a + 1, len(NAMES)):
            for va in OPTIONS[NAMES[a]]:
                for vb in OPTIONS[NAMES[b]]:
                    for rows, outcome in ((RUNNABLE, None), (REFUSED, "refused")):
                        possible = any(r.values[a] == va and r.values[b] == vb and (_REFUSALS[r] is None) == (outcome is None)
                                       for r in SPACE)
                        assert not possible or any(r.values[a] == va and r.values[b] == vb for r in rows), \
                            f"pair {NAMES[a]}={va}, {NAMES[b]}={vb} is in no {outcome or 'runnable'} row"


def _run_row(tmp_path, row: Row, pipeline: str) -> None:
    run_dir = tmp_path / "run"
    if row.start == "fresh":
        _assert_clean_exit(_launch(row, run_dir, row.ranks, pipeline=pipeline))
    else:
        _assert_clean_exit(_launch(row, run_dir, row.ranks, total=FIRST_TOTAL, pipeline=pipeline))
        _assert_trained(row, run_dir, FIRST_TOTAL)
        ranks, envs = (row.ranks % 3 + 1, 2) if row.start == "resume_ranks" else (row.ranks, 4)
        if row.reduction == "adasum" and ranks & (ranks - 1):
            ranks = 1  # Adasum on CPUs: powers of 2 only (that refusal has its own rows)
        _assert_clean_exit(_launch(row, run_dir, ranks, num_envs=envs, resume=True, pipeline=pipeline))
    _assert_trained(row, run_dir, TOTAL)


@pytest.mark.parametrize("row", RUNNABLE, ids=Row.id)
def test_accepted_combination_runs_to_exactly_total_timesteps(tmp_path, row):
    _run_row(tmp_path, row, "sync")


def test_overlap_meets_every_option_value_and_refuses_with_one_line():
    assert all(refusal(row, "overlap") is None for row in OVERLAP_RUNNABLE)
    for a, name in enumerate(NAMES):
        possible = {row.values[a] for row in _OVERLAP_CANDIDATES}
        assert possible == {row.values[a] for row in OVERLAP_RUNNABLE}, name
    assert {"dqn", "mappo"} <= {row.algorithm for row in OVERLAP_REFUSED}
    assert {"static", "dynamic"} <= {row.balance for row in OVERLAP_REFUSED}
    for row in OVERLAP_REFUSED:
        message = refusal(row, "overlap")
        assert message and "\n" not in message and "ppo.pipeline = 'overlap'" in message, row


@pytest.mark.parametrize("row", OVERLAP_RUNNABLE, ids=Row.id)
def test_accepted_combination_with_overlapped_sampling_runs(tmp_path, row):
    _run_row(tmp_path, row, "overlap")


# Launched: the refused rows on several ranks (the ones where "every rank" says something); every
# refused row's message is checked in-process (test_every_refusal_is_one_line; REFUSED holds only rows
# validate() refuses).
LAUNCHED_REFUSALS = [row for row in REFUSED if row.ranks > 1]


def test_every_refusal_is_one_line():
    assert LAUNCHED_REFUSALS and all("\n" not in refusal(row) for row in REFUSED)


@pytest.mark.parametrize("row", LAUNCHED_REFUSALS, ids=Row.id)
def test_refused_combination_exits_2_on_every_rank_before_any_work(tmp_path, row):
    message = refusal(row)
    assert "\n" not in message  # one line naming the conflict(s)
    run_dir = tmp_path / "run"
    result = _launch(row, run_dir, row.ranks, total=FIRST_TOTAL if row.start != "fresh" else TOTAL)
    _assert_clean_exit(result, 2)
    assert result.stdout.count(message) == 1  # one copy, not one per rank
    assert not run_dir.exists()


def test_atari_row_with_the_vector_backend_and_dynamic_balancing(tmp_path):
    """The image path: ale_vector, the Nature CNN, amp auto, 2 ranks, the balancer on."""
    run_dir = tmp_path / "run"
    sets = ["logging.tensorboard=false", "env.backend=ale_vector", "env.num_envs=2", f"ppo.num_steps={STEPS}",
            "ppo.num_minibatches=2", "ppo.update_epochs=1", "ppo.total_timesteps=256", "distributed.amp=auto",
            "distributed.balance=dynamic", "distributed.balance_every=2", "distributed.verify_every=1"]
    _assert_clean_exit(run(mpirun_cmd(2, *train_cmd(run_dir, *sets, config=ATARI)), timeout=240))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[-1]["global_step"] == 256 and all(r["parameters_identical"] for r in rows)


def test_readme_table_is_what_validate_refuses():
    """The README's 'what combines with what' table is generated from validate()'s rules."""
    text = (REPO / "README.md").read_text()
    start, end = "<!-- combinations:start -->\n", "<!-- combinations:end -->"
    assert text[text.index(start) + len(start):text.index(end)] == combinations.markdown_table()
