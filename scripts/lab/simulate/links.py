"""Links: the alpha-beta(-gamma) constants one message pays, named or calibrated.

    time of a message of n bytes = alpha + n beta        (Hockney 1994)
    time to add n bytes           = n gamma              (Thakur et al. 2005)

A preset is a round nominal figure for a kind of link (line rate, typical
one-message latency), not a measurement; the hardware generations (GENERATIONS: NVLink
2/3/4 on NVSwitch, InfiniBand EDR/HDR/NDR, RoCE 100/200 GbE) take the spec sheets' line
rate, NVLink's at the fraction NCCL achieves of it (NVLINK_EFFICIENCY). `local` is
the measured host read from a calibration JSON (`--calibrate` writes one), and a cluster measured
elsewhere (for example an emulated one with netns + tc) is plugged in the
same way: its calibration JSON with `--link local --calibration PATH`, or
its figures with `--alpha-us` and `--gbit`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dtlab.models.config import ConfigError


@dataclass(frozen=True)
class Link:
    name: str
    alpha_s: float  # one message's latency
    beta_s_per_byte: float  # 1 / bandwidth
    gamma_s_per_byte: float = 0.0  # adding one byte at the receiver

    @property
    def gbit(self) -> float:
        return 8 / self.beta_s_per_byte / 1e9 if self.beta_s_per_byte else float("inf")

    def describe(self) -> str:
        return (f"{self.name}: alpha {self.alpha_s * 1e6:.3g} us, "
                f"{self.gbit:.4g} Gbit/s ({1 / self.beta_s_per_byte / 1e9:.4g} GB/s)")


def _gbit(alpha_us: float, gbit: float, name: str) -> Link:
    return Link(name, alpha_us * 1e-6, 8 / (gbit * 1e9))


# nominal figures: line rate, and a typical small-message latency of that kind of link
PRESETS = {
    "nvlink": _gbit(3.0, 1200.0, "nvlink"),  # 150 GB/s a GPU, NCCL-class latency
    "400gbit": _gbit(5.0, 400.0, "400gbit"),  # InfiniBand NDR / 400GbE, RDMA
    "200gbit": _gbit(5.0, 200.0, "200gbit"),
    "100gbit": _gbit(8.0, 100.0, "100gbit"),
    "25gbit": _gbit(20.0, 25.0, "25gbit"),
    "10gbit": _gbit(30.0, 10.0, "10gbit"),  # TCP
    "1gbit": _gbit(50.0, 1.0, "1gbit"),  # TCP
}

# What NCCL's protocol achieves of NVLink's line rate: 370 of H100's 450 GB/s a direction,
# "the protocol overhead (~20%)" (NCCL's maintainer, NVIDIA/nccl-tests issue #212, 2024);
# the one constant fitted for the NVLink presets (simulate/published.py "nccl-h100-ring").
NVLINK_EFFICIENCY = 370 / 450
# Spec-sheet line rates per GPU and direction; NVLink at NVLINK_EFFICIENCY of it.
GENERATIONS = {
    # NVLink 2 (V100: 6 links x 25 GB/s), 3 (A100: 12 x 25), 4 (H100, H200: 18 x 25), each
    # GPU on NVSwitch (DGX-2, DGX A100, DGX H100): any pair at the GPU's full rate
    "nvlink2": _gbit(3.0, 150 * 8 * NVLINK_EFFICIENCY, "nvlink2 (V100, 150 GB/s line)"),
    "nvlink3": _gbit(3.0, 300 * 8 * NVLINK_EFFICIENCY, "nvlink3 (A100, 300 GB/s line)"),
    "nvlink4": _gbit(3.0, 450 * 8 * NVLINK_EFFICIENCY, "nvlink4 (H100/H200, 450 GB/s line)"),
    # InfiniBand EDR / HDR / NDR (100 / 200 / 400 Gbit/s a port), RoCE on 100 / 200 GbE:
    # line rate, RDMA latency
    "ib-edr": _gbit(5.0, 100.0, "ib-edr (100 Gbit/s)"),
    "ib-hdr": _gbit(5.0, 200.0, "ib-hdr (200 Gbit/s)"),
    "ib-ndr": _gbit(5.0, 400.0, "ib-ndr (400 Gbit/s)"),
    "roce-100": _gbit(8.0, 100.0, "roce-100 (100 GbE)"),
    "roce-200": _gbit(8.0, 200.0, "roce-200 (200 GbE)"),
}
PRESETS.update(GENERATIONS)
LOCAL = "local"
NAMES = (*PRESETS, LOCAL)


def preset(name: str, flag: str = "--link") -> Link:
    """A named preset (not `local`, which needs a calibration)."""
    if name not in PRESETS:
        raise ConfigError(f"{flag}: unknown link {name!r} (known: {', '.join(NAMES)})")
    return PRESETS[name]


def custom(base: Link, alpha_us: float | None, gbit: float | None,
           flags: tuple[str, str] = ("--alpha-us", "--gbit")) -> Link:
    """`base` with --alpha-us / --gbit (or the intra-node link's --intra-alpha-us /
    --intra-gbit: `flags`) given in its place (a measured cluster's figures)."""
    if alpha_us is not None:
        if not alpha_us >= 0:
            raise ConfigError(f"{flags[0]} must be at least 0 (got {alpha_us})")
        base = replace(base, alpha_s=alpha_us * 1e-6, name=f"{base.name}*")
    if gbit is not None:
        if not gbit > 0:
            raise ConfigError(f"{flags[1]} must be positive (got {gbit})")
        base = replace(base, beta_s_per_byte=8 / (gbit * 1e9), name=f"{base.name}*")
    return base
