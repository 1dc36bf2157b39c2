"""Weak-scaling projection: measured per-rank compute time plus an allreduce cost model fitted to
the allreduce benchmark, extrapolated to many ranks and other interconnects.

Cost of one allreduce of S bytes over n ranks (the classic alpha-beta model, per link and direction
bandwidth B, per-step network latency alpha, per-operation overhead c):

    ring          c + 2(n-1) alpha        + 2(n-1)/n S/B      (Horovod's CPU path: MPI/Gloo ring)
    tree          c + 2 ceil(log2 n) alpha + 2(n-1)/n S/B     (recursive halving/doubling, Rabenseifner:
                                                               the latency of a tree, the volume of a ring)
    hierarchical  c + [2(g-1) alpha_l + 2(g-1)/g S/B_l]  +  [2(m-1) alpha + 2(m-1)/m S/B]
                  (g ranks per node reduce on the node's own bus, m = n/g nodes reduce over the network;
                   Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE with NCCL)

c is Horovod's own price per collective (negotiation in its background thread, cycle time, copies
into the fusion buffer) and does not grow with n in this model. The benchmark across 2 nodes
measures t(S) = c + 2 alpha + S/B; the same benchmark with both ranks on one node (shared memory,
alpha ~ 0) separates c from alpha. Without it, alpha is taken as 0 and the whole constant is c.

Open MPI (Horovod's CPU path here) does not always run the ring: its tuned component picks by rank
count and message size (open_mpi_allreduce_algorithm, Open MPI 4.1's fixed decision); at 4-8 ranks
and > 8 KiB, and for PowerSGD's factors at 1024 ranks, that is Rabenseifner (2 log2 n steps, the
ring's volume) or recursive doubling (log2 n steps of the whole message). Algorithm "openmpi"
models that choice.

fit_exchange fits c, alpha and B of one exchange (a compression's collectives on one link) by least
squares to its measured times at every node count, with the link's size sweep pinning B, and keeps
the parameters' covariance and each point's residual; the projection's interval comes from that
covariance (ExchangeFit.round_s).

Weak scaling keeps the work per rank: an iteration takes the compute time of one rank (env steps,
inference, learner: every phase that is not communication) plus, per iteration, `gradient_rounds`
allreduces of the gradient and `small_collectives` latency-bound ones (metrics, stop flags).
Efficiency(n) = T(1) / T(n). Overlap of the gradient allreduce with the backward pass is ignored,
so the model errs on the slow side.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

ALGORITHMS = ("ring", "tree", "hierarchical")
SMALL_COLLECTIVE_BYTES = 64  # the runtime's per-iteration metrics/flags collectives

# Published anchors for the report (other workloads: far more compute per gradient byte than a
# Nature CNN on one CPU core, so they show what well-balanced jobs reach, not what this one will).
ANCHORS = (
    {"label": "Horovod: ResNet-101 / Inception V3, 512 GPUs, 25 Gbit/s RoCE", "ranks": 512, "efficiency": 0.90,
     "source": "Horovod benchmarks (docs/benchmarks.rst, github.com/horovod/horovod): 128 servers x 4 Pascal "
               "GPUs on RoCE-capable 25 Gbit/s, 90% scaling efficiency for Inception V3 and ResNet-101, "
               "68% for VGG-16; Sergeev & Del Balso, arXiv:1802.05799"},
    {"label": "DD-PPO: 107x on 128 GPUs", "ranks": 128, "efficiency": 107 / 128,
     "source": "Wijmans et al., DD-PPO, ICLR 2020, arXiv:1911.00357 (abstract: 'a speedup of 107x on 128 GPUs "
               "over a serial implementation', i.e. 84% efficiency)"},
)


class ProjectionError(ValueError):
    pass


# ---- interconnect labels --------------------------------------------------------------------

_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt])(?:i?bit|bps|b/s|bit/s)", re.I)
_UNITS = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str | None) -> float | None:
    """Bits per second from a label such as '1gbit', '10 Gbit/s', '100Mbit' (tc's spelling); None
    for 'unlimited' or no rate at all."""
    if not text:
        return None
    found = _RATE.search(text)
    return float(found.group(1)) * _UNITS[found.group(2).lower()] if found else None


def format_rate(bits_per_s: float | None) -> str:
    if bits_per_s is None:
        return "unlimited"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g} {unit}"
    return f"{bits_per_s:g} bit/s"


def interconnect_from_environment(env: Mapping[str, str] | None = None) -> str:
    """What the ranks' links are, for a benchmark's metadata: $HVD_RL_INTERCONNECT if set (a real
    cluster: e.g. '100 Gbit/s InfiniBand EDR'); else the simulated cluster's per-link shaping
    (slurm/sim_cluster.sh, $HVD_RL_SIMCLUSTER_DIR/cluster.env); else ''."""
    env = os.environ if env is None else env
    if env.get("HVD_RL_INTERCONNECT"):
        return env["HVD_RL_INTERCONNECT"]
    state = Path(env.get("HVD_RL_SIMCLUSTER_DIR") or "/tmp/hvd_rl_simcluster") / "cluster.env"
    try:
        lines = state.read_text().splitlines()
    except OSError:
        return ""
    rates = sorted({line.split("=", 1)[1] for line in lines if line.startswith("RATE_")})
    if not rates:
        return ""
    if rates == ["unlimited"]:
        return "simulated cluster: unlimited veth links"
    return f"simulated cluster: {', '.join(rates)} per link (tc tbf)"


# ---- cost model -----------------------------------------------------------------------------

def open_mpi_allreduce_algorithm(ranks: int, nbytes: float) -> str:
    """The allreduce Open MPI 4.1's tuned component runs for a commutative op (what Horovod's MPI
    path calls), from ompi/mca/coll/tuned/coll_tuned_decision_fixed.c (v4.1.4). Segmented ring is
    the ring's cost, nonoverlapping a reduce then a bcast."""
    n, size = int(ranks), float(nbytes)
    # (upper bound on ranks, [(upper bound on bytes, algorithm), ...] with the last bound infinite)
    table = ((4, ((8, "ring"), (4096, "recursive_doubling"), (8192, "ring"), (16384, "recursive_doubling"),
                  (65536, "ring"), (262144, "segmented_ring"))),
             (8, ((16, "ring"), (8192, "recursive_doubling"))),
             (16, ((8192, "recursive_doubling"),)),
             (32, ((64, "segmented_ring"), (4096, "recursive_doubling"))),
             (64, ((128, "segmented_ring"),)),
             (128, ((262144, "recursive_doubling"),)),
             (256, ((131072, "nonoverlapping"), (262144, "recursive_doubling"))),
             (512, ((4096, "nonoverlapping"),)),
             (2048, ((2048, "nonoverlapping"), (16384, "recursive_doubling"))),
             (4096, ((2048, "nonoverlapping"), (4096, "segmented_ring"), (16384, "recursive_doubling"))),
             (math.inf, ((2048, "nonoverlapping"), (16384, "segmented_ring"), (32768, "recursive_doubling"))))
    for max_ranks, by_size in table:
        if n < max_ranks:
            return next((name for limit, name in by_size if size < limit), "rabenseifner")
    raise AssertionError("unreachable")


def collective_terms(ranks: int, nbytes: float, algorithm: str = "ring", exchange: str = "allreduce") -> tuple[float, float]:
    """(latency steps, bytes each rank sends) of one collective of `nbytes` per rank: the alpha and
    1/B coefficients of its time. Allgather (top-k's values and indices): n - 1 steps, (n - 1) S."""
    n = int(ranks)
    if n <= 1:
        return 0.0, 0.0
    if exchange == "allgather":
        return float(n - 1), (n - 1) * float(nbytes)
    if exchange != "allreduce":
        raise ProjectionError(f"unknown exchange {exchange!r} (allreduce or allgather)")
    if algorithm == "openmpi":
        algorithm = open_mpi_allreduce_algorithm(n, nbytes)
    log_steps = math.ceil(math.log2(n))
    if algorithm in ("ring", "segmented_ring"):
        return 2.0 * (n - 1), ring_volume(n) * nbytes
    if algorithm in ("tree", "rabenseifner"):
        return 2.0 * log_steps, ring_volume(n) * nbytes
    if algorithm == "recursive_doubling":
        return float(log_steps), log_steps * float(nbytes)
    if algorithm == "nonoverlapping":  # binomial reduce, then binomial bcast, of the whole message
        return 2.0 * log_steps, 2 * log_steps * float(nbytes)
    raise ProjectionError(f"unknown allreduce algorithm {algorithm!r} (one of {ALGORITHMS} or openmpi)")


@dataclass(frozen=True)
class CostModel:
    overhead_s: float  # c: per collective
    latency_s: float  # alpha: per network step
    bandwidth_Bps: float  # B: bytes/s per link and direction
    local_latency_s: float = 0.0  # alpha on a node's own bus (hierarchical)
    local_bandwidth_Bps: float | None = None  # B on a node's own bus (hierarchical); None: as B

    def allreduce_s(self, ranks: int, nbytes: float, algorithm: str = "ring", ranks_per_node: int = 1) -> float:
        n = int(ranks)
        if n <= 1:
            return 0.0
        c, alpha, bw = self.overhead_s, self.latency_s, self.bandwidth_Bps
        if algorithm == "hierarchical":
            g = max(1, min(int(ranks_per_node), n))
            m = math.ceil(n / g)
            local_bw = self.local_bandwidth_Bps or bw
            intra = 0.0 if g == 1 else 2 * (g - 1) * self.local_latency_s + 2 * (g - 1) / g * nbytes / local_bw
            inter = 0.0 if m == 1 else 2 * (m - 1) * alpha + 2 * (m - 1) / m * nbytes / bw
            return c + intra + inter
        steps, moved = collective_terms(n, nbytes, algorithm)
        return c + steps * alpha + moved / bw

    def allgather_s(self, ranks: int, nbytes: float) -> float:
        """Ring allgather of `nbytes` from every rank: each rank receives the other n - 1 shares,
        so the volume grows with n (top-k's exchange), where an allreduce's stays ~2S."""
        if int(ranks) <= 1:
            return 0.0
        steps, moved = collective_terms(ranks, nbytes, exchange="allgather")
        return self.overhead_s + steps * self.latency_s + moved / self.bandwidth_Bps

    def with_bandwidth(self, bandwidth_Bps: float) -> "CostModel":
        return CostModel(self.overhead_s, self.latency_s, bandwidth_Bps, self.local_latency_s,
                         self.local_bandwidth_Bps)


@dataclass(frozen=True)
class Fit:
    """t(S) = constant + volume(n) * S / bandwidth, fitted to one allreduce benchmark."""

    ranks: int
    nodes: int
    constant_s: float
    bandwidth_Bps: float
    rows: int
    rms_rel_error: float
    max_rel_error: float
    interconnect: str = ""

    def predict(self, nbytes: float) -> float:
        return self.constant_s + ring_volume(self.ranks) * nbytes / self.bandwidth_Bps


def ring_volume(ranks: int) -> float:
    """Bytes each rank sends per payload byte in a ring allreduce: 2(n-1)/n."""
    return 2 * (ranks - 1) / ranks if ranks > 1 else 1.0


def fit_allreduce(result: Mapping[str, Any], compression: str = "fp32", max_bytes: float | None = None) -> Fit:
    """Least squares on relative error (every size counts alike, 4 KiB as much as 256 MiB) of
    t = a + k S over the benchmark's rows; bandwidth = 2(n-1)/n / k."""
    import numpy as np

    ranks = int(result["ranks"])
    rows = [r for r in result.get("rows", []) if r.get("compression", "fp32") == compression
            and (max_bytes is None or r["bytes"] <= max_bytes)]
    if len(rows) < 2 or ranks < 2:
        raise ProjectionError(f"an allreduce fit needs >= 2 sizes on >= 2 ranks (got {len(rows)} rows, {ranks} ranks)")
    size = np.array([float(r["bytes"]) for r in rows])
    t = np.array([float(r["latency_s"]) for r in rows])
    design = np.stack([1.0 / t, size / t], axis=1)
    (a, k), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if k <= 0:
        raise ProjectionError("allreduce times do not grow with the message size: no bandwidth to fit")
    if a < 0:  # no negative overhead: refit the slope alone
        a = 0.0
        k = float(np.sum(size / t) / np.sum((size / t) ** 2))
    rel = (a + k * size - t) / t
    return Fit(ranks=ranks, nodes=int(result.get("nodes") or 1), constant_s=float(a),
               bandwidth_Bps=float(ring_volume(ranks) / k), rows=len(rows),
               rms_rel_error=float(np.sqrt(np.mean(rel ** 2))), max_rel_error=float(np.max(np.abs(rel))),
               interconnect=str(result.get("interconnect", "")))


def cost_model(network: Fit, local: Fit | None = None) -> tuple[CostModel, str]:
    """The model from a benchmark across nodes (one rank per node) and optionally one within a
    node: c from the node-local constant, alpha from what the network adds. Returns a note on how
    c and alpha were split."""
    steps = 2 * (network.ranks - 1)
    if local is not None:
        overhead = min(local.constant_s, network.constant_s)
        latency = (network.constant_s - overhead) / steps
        note = (f"c = {overhead * 1e3:.3f} ms from the {local.ranks}-rank benchmark within one node; alpha = "
                f"({network.constant_s * 1e3:.3f} - c) / {steps} = {latency * 1e6:.1f} us per network step")
        return CostModel(overhead, latency, network.bandwidth_Bps, 0.0, local.bandwidth_Bps), note
    note = (f"no benchmark within one node: the whole constant ({network.constant_s * 1e3:.3f} ms) is taken as "
            "c (per collective), alpha = 0")
    return CostModel(network.constant_s, 0.0, network.bandwidth_Bps), note


# ---- fit over node counts -------------------------------------------------------------------

# Two-sided 95% quantiles of Student's t by degrees of freedom (the next lower tabulated dof is
# used, which widens the interval); beyond 30 the normal's.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t_quantile_95(dof: int) -> float:
    if dof < 1:
        raise ProjectionError("no degrees of freedom left: as many parameters as measured points")
    return _T975[max(d for d in _T975 if d <= dof)] if dof <= 30 else 1.960


@dataclass(frozen=True)
class Observation:
    """One measured exchange: `call_bytes` per collective (PowerSGD: its P and Q allreduces) on
    `ranks` ranks, taking `seconds` (communication only: compression compute taken out)."""

    label: str
    ranks: int
    call_bytes: tuple[float, ...]
    seconds: float
    algorithm: str = "openmpi"
    exchange: str = "allreduce"

    def terms(self) -> tuple[float, float, float]:
        """(collectives, latency steps, bytes sent): the coefficients of c, alpha and 1/B."""
        steps = moved = 0.0
        for nbytes in self.call_bytes:
            s, m = collective_terms(self.ranks, nbytes, self.algorithm, self.exchange)
            steps, moved = steps + s, moved + m
        return float(len(self.call_bytes)), steps, moved


@dataclass(frozen=True)
class ExchangeFit:
    """c, alpha and B of one exchange, fitted with their covariance (of c, alpha, 1/B)."""

    overhead_s: float
    latency_s: float
    bandwidth_Bps: float
    covariance: tuple[tuple[float, float, float], ...]
    dof: int
    residuals: tuple[dict, ...]  # per measured point: label, ranks, measured_s, fitted_s, rel_error
    rms_rel_error: float

    def model(self) -> CostModel:
        return CostModel(self.overhead_s, self.latency_s, self.bandwidth_Bps)

    def standard_errors(self) -> tuple[float, float, float]:
        """Of c and alpha (seconds) and of B (bytes/s, to first order from that of 1/B)."""
        var_c, var_a, var_k = (self.covariance[i][i] for i in range(3))
        return math.sqrt(var_c), math.sqrt(var_a), math.sqrt(var_k) * self.bandwidth_Bps ** 2

    def time_s(self, calls: float, steps: float, moved: float) -> tuple[float, float]:
        """The fitted time of an exchange with these coefficients, and its standard error."""
        g = (calls, steps, moved)
        point = calls * self.overhead_s + steps * self.latency_s + moved / self.bandwidth_Bps
        var = sum(g[i] * self.covariance[i][j] * g[j] for i in range(3) for j in range(3))
        return point, math.sqrt(max(var, 0.0))

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "standard_errors": self.standard_errors()}


def fit_exchange(points: Iterable[Observation], sweep: Iterable[tuple[float, float]] = ()) -> ExchangeFit:
    """Least squares on relative error (each point counts alike) of

        t = calls c + steps(n) alpha + bytes(n) / B

    over the exchange's measured points at every rank count, none of the three fixed. `sweep`:
    (bytes, seconds) of single allreduces of several sizes on 2 ranks of the same link; they share
    B but get an intercept of their own (c + 2 alpha there, not assumed equal to this exchange's),
    so they pin the bandwidth without deciding the latency."""
    import numpy as np

    points, sweep = list(points), list(sweep)
    rows = [[*pt.terms(), 0.0] for pt in points] + [[0.0, 0.0, float(size), 1.0] for size, _ in sweep]
    t = np.array([pt.seconds for pt in points] + [sec for _, sec in sweep], dtype=float)
    design = np.array(rows, dtype=float)
    if not sweep:
        design = design[:, :3]
    if len({pt.ranks for pt in points}) < 2 and not sweep:
        raise ProjectionError("latency and overhead need points at two or more rank counts")
    if np.any(t <= 0):
        raise ProjectionError("a measured exchange time is <= 0 s (compression compute larger than the total?)")
    weighted = design / t[:, None]
    if np.linalg.matrix_rank(weighted) < weighted.shape[1]:
        raise ProjectionError("the points do not separate overhead, latency and bandwidth "
                              "(need several rank counts, and sizes or a sweep)")
    dof = len(t) - weighted.shape[1]
    if dof < 1:
        raise ProjectionError(f"{len(t)} points for {weighted.shape[1]} parameters: no residual to judge the fit by")
    theta, *_ = np.linalg.lstsq(weighted, np.ones_like(t), rcond=None)
    if theta[2] <= 0:
        raise ProjectionError("the fitted time falls with the bytes sent: no bandwidth to fit")
    fitted = design @ theta
    rel = (fitted - t) / t
    covariance = float(np.sum(rel ** 2) / dof) * np.linalg.inv(weighted.T @ weighted)
    labels = [(pt.label, pt.ranks) for pt in points] + [(f"2-rank sweep, {size / 2**10:g} KiB", 2) for size, _ in sweep]
    residuals = tuple({"label": label, "ranks": ranks, "measured_s": float(m), "fitted_s": float(f),
                       "rel_error": float(r)} for (label, ranks), m, f, r in zip(labels, t, fitted, rel))
    return ExchangeFit(overhead_s=float(theta[0]), latency_s=float(theta[1]), bandwidth_Bps=float(1 / theta[2]),
                       covariance=tuple(tuple(float(v) for v in row[:3]) for row in covariance[:3]), dof=dof,
                       residuals=residuals, rms_rel_error=float(np.sqrt(np.mean(rel ** 2))))


# ---- workload and projection ----------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """Per rank and iteration, from a measured run."""

    compute_s: float  # everything that is not communication or waiting for other ranks
    gradient_bytes: float  # bytes each rank sends per gradient reduction (compressed, if it is)
    gradient_rounds: float  # gradient reductions per iteration (PPO: epochs x minibatches)
    small_collectives: float = 0.0  # other, latency-bound collectives per iteration
    # distributed.compression: powersgd = 2 allreduces per round (plain tensors with P, then Q), topk = 2
    # allgathers (values, indices: the volume grows with the ranks), none/fp16 = one allreduce.
    compression: str = "none"
    # bytes of each collective of one reduction where the compression makes several (PowerSGD: P
    # and Q, whose sizes decide Open MPI's algorithm); empty: PowerSGD's bytes as one call plus a
    # small one, top-k's as two equal allgathers
    call_bytes: tuple[float, ...] = ()

    @property
    def exchange(self) -> str:
        return "allgather" if self.compression == "topk" else "allreduce"

    def calls(self) -> tuple[float, ...]:
        if self.call_bytes:
            return tuple(self.call_bytes)
        if self.compression == "powersgd":
            return (self.gradient_bytes, SMALL_COLLECTIVE_BYTES)
        if self.compression == "topk":
            return (self.gradient_bytes / 2, self.gradient_bytes / 2)
        return (self.gradient_bytes,)

    def round_terms(self, ranks: int, algorithm: str = "openmpi") -> tuple[float, float, float]:
        """(collectives, latency steps, bytes sent) of one gradient reduction on `ranks` ranks."""
        return Observation("", ranks, self.calls(), 1.0, algorithm, self.exchange).terms()

    def _round_s(self, model: CostModel, ranks: int, algorithm: str, ranks_per_node: int) -> float:
        if self.exchange == "allgather":
            return sum(model.allgather_s(ranks, nbytes) for nbytes in self.calls())
        return sum(model.allreduce_s(ranks, nbytes, algorithm, ranks_per_node) for nbytes in self.calls())

    def projected_efficiency(self, fit: ExchangeFit, ranks: int, baseline_s: float, algorithm: str = "openmpi",
                             level_t: float | None = None) -> tuple[float, float, float]:
        """Weak-scaling efficiency baseline_s / (compute + rounds x fitted round time) on `ranks`
        ranks, with the interval that the fit's covariance gives the round time (t quantile of the
        fit's dof unless level_t is given): (point, low, high). The communication's low end stops
        at 0 s; the interval is the fit's parameter uncertainty, not that of the model's form."""
        if int(ranks) <= 1:
            return baseline_s / self.compute_s, baseline_s / self.compute_s, baseline_s / self.compute_s
        round_s, err = fit.time_s(*self.round_terms(ranks, algorithm))
        spread = (t_quantile_95(fit.dof) if level_t is None else level_t) * err
        comm = [max(0.0, self.gradient_rounds * (round_s + d)) for d in (0.0, spread, -spread)]
        point, low, high = (baseline_s / (self.compute_s + c) for c in comm)
        return point, low, high

    def comm_s(self, model: CostModel, ranks: int, algorithm: str = "ring", ranks_per_node: int = 1) -> float:
        return (self.gradient_rounds * self._round_s(model, ranks, algorithm, ranks_per_node)
                + self.small_collectives * model.allreduce_s(ranks, SMALL_COLLECTIVE_BYTES, algorithm, ranks_per_node))

    def iteration_s(self, model: CostModel, ranks: int, algorithm: str = "ring", ranks_per_node: int = 1,
                    compute_s: float | None = None) -> float:
        return (self.compute_s if compute_s is None else compute_s) + self.comm_s(model, ranks, algorithm, ranks_per_node)

    def weak_efficiency(self, model: CostModel, ranks: int, algorithm: str = "ring", ranks_per_node: int = 1) -> float:
        return self.compute_s / self.iteration_s(model, ranks, algorithm, ranks_per_node)


def bandwidth_for(rate_bits_per_s: float, efficiency: float) -> float:
    """Bytes/s a collective gets from a link of the given nominal rate."""
    return rate_bits_per_s / 8.0 * efficiency


@dataclass
class Projection:
    ranks: list[int]
    interconnects: list[float]  # bits/s
    link_efficiency: float  # achieved / nominal, measured on a shaped link (1.0 if none)
    ranks_per_node: int
    model: CostModel
    workload: Workload
    curves: dict[str, list[float]] = field(default_factory=dict)  # "<rate> <algorithm>" -> efficiency

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["curves"] = dict(self.curves)
        return data


def project(model: CostModel, workload: Workload, ranks: Iterable[int] = (8, 16, 32, 64, 128, 256, 512, 1024),
            interconnects: Iterable[float] = (1e9, 10e9, 100e9), link_efficiency: float = 1.0,
            algorithms: Iterable[str] = ALGORITHMS, ranks_per_node: int = 8) -> Projection:
    ranks = [int(r) for r in ranks]
    result = Projection(ranks, [float(r) for r in interconnects], link_efficiency, ranks_per_node, model, workload)
    for rate in result.interconnects:
        scaled = model.with_bandwidth(bandwidth_for(rate, link_efficiency))
        for algorithm in algorithms:
            result.curves[f"{format_rate(rate)} {algorithm}"] = [
                workload.weak_efficiency(scaled, n, algorithm, ranks_per_node if algorithm == "hierarchical" else 1)
                for n in ranks]
    return result


def ranks_for_efficiency(model: CostModel, workload: Workload, target: float, algorithm: str = "ring",
                         ranks_per_node: int = 1, limit: int = 1 << 20) -> int | None:
    """The largest power-of-2 rank count whose weak-scaling efficiency is still >= target."""
    best, n = None, 2
    while n <= limit:
        if workload.weak_efficiency(model, n, algorithm, ranks_per_node) >= target:
            best = n
        else:
            break
        n *= 2
    return best
