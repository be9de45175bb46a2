"""What one accelerator chip can do: the datasheet table that `launch.plan` and `launch.bench` read.

Per chip: dense peak FLOP/s (TFLOP/s as datasheets print them; NVIDIA's "with sparsity" halved),
HBM (datasheet "GB" read as GiB, as devices report), and the links: TPU ICI (`ici_links` links,
each `ici_link_bytes_per_s` one way; wraparound per docs/planning.md), the data-center network
between slices (`dcn_bytes_per_s` per chip), GPU NVLink per GPU and the node's network. `source`
and `network_source` name the vendor pages; the ICI per-link figures are the scaling book's
(https://jax-ml.github.io/scaling-book/tpus/: one-way 4.5e10 B/s on v4 and v5e, 9e10 on v5p and v6e).

    >>> chip("v5p").hbm_bytes / 2**30, chip("H100").nvlink_bytes_per_s / 1e9
    (95.0, 450.0)
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
_GBIT = 1e9 / 8  # bytes/s in one Gb/s


@dataclass(frozen=True)
class Chip:
    name: str
    kinds: tuple[str, ...]  # substrings of jax's device_kind that name this chip
    bf16: float  # dense peak, TFLOP/s
    tf32: float | None  # NVIDIA: what a float32 matmul at JAX's default precision runs on
    fp32: float | None  # non-tensor-core float32 (TPUs publish none: f32 matmuls run as bf16 passes)
    source: str
    hbm_bytes: int
    hbm_bytes_per_s: float
    network_source: str
    # TPU: the ICI torus
    ici_link_bytes_per_s: float | None = None  # one direction, one link
    ici_links: int | None = None  # per chip: 2 per torus dimension
    torus_multiple: int | None = None  # a side that is a multiple of this can wrap around (module docstring)
    wraps_per_side: bool = False  # each such side wraps on its own (v5e, v6e); else all sides or none (v4, v5p)
    pod: tuple[int, ...] | None = None  # the sides of the largest ICI-connected grid
    max_slice_chips: int | None = None  # the largest single-slice job Google schedules, where smaller than the pod
    dcn_bytes_per_s: float | None = None  # data-center network between slices, one direction, per chip
    # GPU: NVLink inside a node, the network between nodes
    nvlink_bytes_per_s: float | None = None  # one direction, per GPU
    gpus_per_node: int | None = None
    node_network_bytes_per_s: float | None = None  # one direction, all NICs of a node
    int8: float | None = None  # dense int8 peak, TOP/s (int32 accumulation), from the same datasheet

    @property
    def is_tpu(self) -> bool:
        return self.ici_links is not None

    @property
    def torus_dims(self) -> int | None:
        """2 (v5e, v6e) or 3 (v4, v5p) for a TPU; None for a GPU."""
        return None if self.ici_links is None else self.ici_links // 2


_NVIDIA_DC = "https://www.nvidia.com/en-us/data-center/"
_GCLOUD_TPU = "https://cloud.google.com/tpu/docs/"
_BOOK_ICI = "https://jax-ml.github.io/scaling-book/tpus/ (ICI bandwidth per link, one-way)"
_V5P_DCN = 50 * _GBIT  # per chip: cloud.google.com/tpu/docs/v5p
# v5e's data-center network per chip, one way: "Per-host NIC configuration: 2 x 100 Gbps NIC" over
# "Chips per host: 8" (https://cloud.google.com/tpu/docs/v5e, the key specifications table): 25 Gb/s
# = 3.125 GB/s a chip; the same page's "Data center network bandwidth per Pod: 6.4 Tbps" over 256
# chips agrees.
V5E_DCN_BYTES_PER_S = 2 * 100 * _GBIT / 8

# Order matters: the first chip whose kind is a substring of device_kind wins ('TPU v5 lite' before 'TPU v5').
CHIPS: tuple[Chip, ...] = (
    Chip("H200", ("H200",), 989.4, 494.7, 66.9, _NVIDIA_DC + "h200/ (SXM)", 141 * GIB, 4.8e12,
         _NVIDIA_DC + "dgx-h200/ (NVLink 900 GB/s per GPU both ways; 8x ConnectX-7 400 Gb/s per node)",
         nvlink_bytes_per_s=450e9, gpus_per_node=8, node_network_bytes_per_s=8 * 400 * _GBIT, int8=1978.9),
    Chip("H100", ("H100",), 989.4, 494.7, 66.9, _NVIDIA_DC + "h100/ (SXM)", 80 * GIB, 3.35e12,
         _NVIDIA_DC + "dgx-h100/ (NVLink 900 GB/s per GPU both ways; 8x ConnectX-7 400 Gb/s per node)",
         nvlink_bytes_per_s=450e9, gpus_per_node=8, node_network_bytes_per_s=8 * 400 * _GBIT, int8=1978.9),
    Chip("A100", ("A100",), 312.0, 156.0, 19.5, _NVIDIA_DC + "a100/ (SXM)", 80 * GIB, 2.039e12,
         _NVIDIA_DC + "dgx-a100/ (NVLink 600 GB/s per GPU both ways; 8x ConnectX-6 200 Gb/s per node)",
         nvlink_bytes_per_s=300e9, gpus_per_node=8, node_network_bytes_per_s=8 * 200 * _GBIT, int8=624.0),
    Chip("v4", ("TPU v4",), 275.0, None, None, _GCLOUD_TPU + "v4", 32 * GIB, 1.2e12, _BOOK_ICI,
         ici_link_bytes_per_s=4.5e10, ici_links=6, torus_multiple=4, pod=(16, 16, 16), int8=275.0),
    Chip("v5e", ("TPU v5 lite", "TPU v5e"), 197.0, None, None, _GCLOUD_TPU + "v5e", 16 * GIB, 8.19e11,
         _BOOK_ICI, ici_link_bytes_per_s=4.5e10, ici_links=4, torus_multiple=16, wraps_per_side=True,
         pod=(16, 16), dcn_bytes_per_s=V5E_DCN_BYTES_PER_S, int8=394.0),
    Chip("v5p", ("TPU v5p", "TPU v5"), 459.0, None, None, _GCLOUD_TPU + "v5p", 95 * GIB, 2.765e12,
         _BOOK_ICI, ici_link_bytes_per_s=9e10, ici_links=6, torus_multiple=4, pod=(16, 20, 28),
         max_slice_chips=6144, dcn_bytes_per_s=_V5P_DCN, int8=918.0),
    Chip("v6e", ("TPU v6 lite", "TPU v6e"), 918.0, None, None, _GCLOUD_TPU + "v6e", 32 * GIB, 1.64e12,
         _BOOK_ICI, ici_link_bytes_per_s=9e10, ici_links=4, torus_multiple=16, wraps_per_side=True,
         pod=(16, 16), int8=1836.0),
)


@dataclass(frozen=True)
class Efficiency:
    """The fractions of a chip's datasheet peaks that its kernels reach, which the step-time prediction
    (twinshard.hardware.step_time) prices a compiled program's ops at: matmuls and convolutions (of
    `Chip.bf16`), HBM-bound ops (of `Chip.hbm_bytes_per_s`) and the splash attention kernel (of
    `Chip.bf16`; by head_dim where measured: the kernel is softmax-bound, so a head of 64 runs at
    less than half the rate of one of 128). `source` says where the numbers come from."""

    matmul_efficiency: float = 1.0
    hbm_efficiency: float = 1.0
    splash_efficiency: float = 1.0
    splash_by_head_dim: tuple[tuple[int, float], ...] = ()
    source: str = "none measured: the datasheet peaks"

    def __post_init__(self) -> None:
        shares = [(name, getattr(self, name)) for name in ("matmul_efficiency", "hbm_efficiency", "splash_efficiency")]
        shares += [(f"splash_by_head_dim[{d}]", e) for d, e in self.splash_by_head_dim]
        for name, value in shares:
            if not 0 < value <= 1:
                raise ValueError(f"{name}={value} must be in (0, 1]: a fraction of the peak")


# chip name -> efficiencies measured by microbenchmarks on that chip (tools/chip_micro.py: a large
# matmul, an HBM-bound elementwise pass, the splash kernel alone; never a training step, which is
# what the prediction is checked against); a chip not listed is priced at its datasheet peaks.
EFFICIENCIES: dict[str, Efficiency] = {
    # One v5e, jax 0.10.2, 2026-12-06 (BENCHMARKS.md, "The chip's own rates"), each sample five calls
    # blocked once (a call timed alone carried 0.6-0.8 ms of dispatch): bf16 matmul 8192^3 182.1
    # TFLOP/s of 197; an elementwise pass 611 GB/s (bf16) and 629 GB/s (float32) of 819, the mean
    # taken; splash fwd+bwd (3.5 forwards, causal half) at the block each preset runs: 25.8 and 24.3
    # TFLOP/s at head_dim 64 (B16 H12/H16 T1024, block 512), the mean taken, and 82.7 at 128 (B2 H16/4
    # T2048, block 1024).
    "v5e": Efficiency(matmul_efficiency=0.924, hbm_efficiency=0.757, splash_efficiency=0.420,
                      splash_by_head_dim=((64, 0.127), (128, 0.420)),
                      source="measured on one v5e by tools/chip_micro.py, 2026-12-06"),
}


def efficiency(chip: Chip) -> Efficiency:
    """The measured efficiencies of `chip` (EFFICIENCIES), else the peaks (1.0, saying so in `source`)."""
    return EFFICIENCIES.get(chip.name, Efficiency())


def chip_for(device_kind: str) -> Chip | None:
    """The chip a jax device_kind names ('NVIDIA H100 80GB HBM3', 'TPU v5 lite'), or None."""
    return next((c for c in CHIPS if any(k in device_kind for k in c.kinds)), None)


def chip(name: str) -> Chip:
    """The chip called `name` (case-insensitive: 'v5p', 'h100'); ValueError listing the known ones."""
    found = next((c for c in CHIPS if c.name.lower() == name.lower()), None)
    if found is None:
        raise ValueError(f"unknown chip {name!r}; choose one of {', '.join(c.name.lower() for c in CHIPS)}.")
    return found


def matmul_peak_flops(chip: Chip, dtype: str) -> tuple[float, str]:
    """(FLOP/s, which peak) of one chip's matmuls in `dtype` at JAX's default precision: the bf16
    peak for bfloat16, and for float32 on a TPU too (one bf16 MXU pass); TF32 for float32 on NVIDIA;
    the int8 peak for int8 (int32 accumulation: v5e's measured 2.02x its bf16)."""
    if dtype == "bfloat16":
        return chip.bf16 * 1e12, "bf16"
    if dtype == "int8":
        return (chip.int8 or chip.bf16) * 1e12, "int8" if chip.int8 else "bf16 (no int8 peak in the table)"
    if chip.is_tpu:
        return chip.bf16 * 1e12, "bf16 (TPU's default precision multiplies float32 in one bf16 pass)"
    return chip.tf32 * 1e12, "tf32 (JAX's default precision runs float32 matmuls on TF32 tensor cores)"
