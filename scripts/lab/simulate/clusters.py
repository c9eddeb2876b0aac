"""Named GPU clusters, and one call for a step's time on one: the interface other modules
(the at-scale verdict) use.

    from dtlab.lab.simulate import clusters
    clusters.NAMES                                   # ('dgx-a100-hdr', 'dgx-h100-ndr', ...)
    t = clusters.step_time("transformer", config, n=64, cluster="dgx-a100-hdr",
                           batch_size=8, grad_accum=1, precision="bf16")
    t.step_s, t.compute_s, t.comm_s, t.algo          # sync data parallelism, ring family
    clusters.network("a100-eth100")                  # formulas.Network (intra, inter, G, NICs)
    clusters.rate("dgx-a100-hdr", "transformer", config, 8, Precision.of(precision="bf16"))
    clusters.server_link("a100-eth100", "adamw")     # formulas.ServerLink: shards on hosts
                                                     # of their own behind the inter link

A cluster is a GPU of simulate/hardware.py (its spec sheet and achieved-rate curve), G of
them a node on an intra-node link, and K NICs a node on an inter-node link, both from
simulate/links.py's hardware generations:

    name           GPU             G  intra     inter       K   as built
    dgx-a100-hdr   A100 SXM 80GB   8  nvlink3   ib-hdr      8   DGX A100 (SuperPOD)
    dgx-h100-ndr   H100 SXM        8  nvlink4   ib-ndr      8   DGX H100 (SuperPOD)
    hgx-h200-ndr   H200 SXM        8  nvlink4   ib-ndr      8   HGX H200
    a100-eth100    A100 SXM 80GB   8  nvlink3   roce-100    1   one 100 GbE port a node
    h100-eth100    H100 SXM        8  nvlink4   roce-100    1   one 100 GbE port a node
    v100-dgx2-edr  V100 SXM2 32GB 16  nvlink2   ib-edr      8   DGX-2H (Shoeybi et al. 2019)

step_time is the prediction `dtlab-simulate --cluster NAME` prints in its ring columns:
compute from the achieved-rate curve at the model's width (hardware.achieved_rate, at
the precision's compute dtype), the gradient all-reduce of our ring family (two levels
above G, the K NICs shared by the G GPUs), all but the last bucket hidden behind the
last micro-batch's backward (step.sync_step). The signature and the fields of StepTime
are kept stable; new arguments come with defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.collective.reducers.bucket_defaults import DEFAULT_BUCKET_BYTES
from dtlab.lab.simulate import hardware, links
from dtlab.lab.simulate.calibration_links import preset_server
from dtlab.lab.simulate.formulas import Network, ServerLink
from dtlab.lab.simulate.precision import Precision
from dtlab.lab.simulate.step import ComputeRate, Host, Workload, sync_step
from dtlab.models.config import ConfigError
from dtlab.models.cost import estimate

BUCKET_MB = DEFAULT_BUCKET_BYTES / 1e6  # dtlab-sync's --bucket-mb default (MB: 1e6 bytes)


@dataclass(frozen=True)
class Cluster:
    name: str
    gpu: str  # a hardware.GPUS name
    gpus_per_node: int
    intra: str  # a links.PRESETS name
    inter: str
    nics_per_node: int
    built_as: str

    def describe(self) -> str:
        return (f"{self.name}: {hardware.gpu(self.gpu).name} x {self.gpus_per_node} a node "
                f"on {links.preset(self.intra).describe()}; {self.nics_per_node} x "
                f"{links.preset(self.inter).describe()} a node ({self.built_as})")


CLUSTERS = {c.name: c for c in (
    Cluster("dgx-a100-hdr", "a100-sxm-80gb", 8, "nvlink3", "ib-hdr", 8, "DGX A100"),
    Cluster("dgx-h100-ndr", "h100-sxm", 8, "nvlink4", "ib-ndr", 8, "DGX H100"),
    Cluster("hgx-h200-ndr", "h200-sxm", 8, "nvlink4", "ib-ndr", 8, "HGX H200"),
    Cluster("a100-eth100", "a100-sxm-80gb", 8, "nvlink3", "roce-100", 1,
            "one 100 GbE port a node"),
    Cluster("h100-eth100", "h100-sxm", 8, "nvlink4", "roce-100", 1,
            "one 100 GbE port a node"),
    Cluster("v100-dgx2-edr", "v100-sxm2-32gb", 16, "nvlink2", "ib-edr", 8, "DGX-2H"),
)}
NAMES = tuple(CLUSTERS)


def cluster(name: str, flag: str = "--cluster") -> Cluster:
    if name not in CLUSTERS:
        raise ConfigError(f"{flag}: unknown cluster {name!r} (known: {', '.join(CLUSTERS)})")
    return CLUSTERS[name]


def network(name: str) -> Network:
    c = cluster(name)
    return Network(links.preset(c.intra), links.preset(c.inter), c.gpus_per_node,
                   nics_per_node=c.nics_per_node)


def rate(name: str, model_name: str, config, batch: int, precision: Precision, tp: int = 1,
         sequence_parallel: bool = False, flash: bool = False) -> ComputeRate:
    """The compute rate of `batch` samples of the model on the cluster's GPU (flash:
    with fused attention, hardware.achieved)."""
    g = hardware.gpu(cluster(name).gpu)
    return hardware.achieved_rate(g, model_name, config, batch, precision.compute,
                                  precision.activation, precision.activation, tp,
                                  sequence_parallel, flash)


def server_link(name: str, optimizer: str = "adamw") -> ServerLink:
    """Parameter-server shards on hosts of their own behind the inter-node link (their
    apply time not modelled: 0)."""
    return preset_server(links.preset(cluster(name).inter), None, optimizer)


@dataclass(frozen=True)
class StepTime:
    step_s: float  # compute + exposed communication
    compute_s: float  # forward + backward of all micro-batches
    comm_s: float  # the exposed gradient all-reduce
    algo: str  # the all-reduce our ring family runs at that size and N
    workload: Workload  # what the step computes and reduces (step.py)


def workload(model_name: str, config, batch_size: int, grad_accum: int = 1,
             precision: Precision | None = None, optimizer: str = "adamw") -> Workload:
    """One rank's step: grad_accum micro-batches of batch_size samples."""
    p = precision or Precision.of()
    cost = estimate(model_name, config, batch_size * grad_accum, optimizer=optimizer)
    return Workload(model_name, cost.config, cost.batch_size, cost.flops_step,
                    cost.params_total * p.gradient, optimizer, grad_accum)


def step_time(model_name: str, config, n: int, cluster: str, batch_size: int,
              grad_accum: int = 1, precision: str = "bf16", dtype: str = "float32",
              wire: str = "fp32", optimizer: str = "adamw",
              bucket_mb: float = BUCKET_MB) -> StepTime:
    """Sync data parallelism's step at n ranks on `cluster` (the module docstring);
    precision, dtype and wire as the trainers' --precision, --dtype and --wire."""
    if n < 1:
        raise ConfigError(f"n must be at least 1 (got {n})")
    p = Precision.of(dtype, precision, wire)
    w = workload(model_name, config, batch_size, grad_accum, p, optimizer)
    r = rate(cluster, model_name, config, batch_size, p)
    compute = r.seconds(w.flops_step)
    s = sync_step("ring", w, n, network(cluster), compute, bucket_mb * 1e6, Host(0))
    return StepTime(s.step_s, compute, s.comm_s, s.algo, w)
