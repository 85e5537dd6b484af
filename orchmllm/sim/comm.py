"""Communication model: all-to-all time from the bytes each rank sends and receives.

An all-to-all moves item ``k`` (``nbytes[k]`` bytes) from rank ``src[k]`` to rank ``dst[k]``;
items that stay on their rank cost nothing. Bytes between two ranks of one node go over NVLink,
the rest over the network (rank ``r`` lives on node ``r // ranks_per_node``). Each GPU's links
are full duplex and NVLink and the network run at the same time, so a rank is busy for
``max(intra/bw_intra, inter/bw_inter)`` with ``intra``/``inter`` the larger of its sent and
received bytes on that fabric; the collective ends with the busiest rank (paper eq. 4-5), plus
a per-peer latency for the ``num_ranks - 1`` send/receive pairs every rank posts.

Defaults are the paper's cluster (section 8), which is also the published H100 hardware: NVLink
900 GB/s bidirectional per GPU (450 GB/s each way) and 8 x 400 Gbps InfiniBand per 8-GPU node
(50 GB/s each way per GPU). These are link peaks: the achieved all-to-all bandwidth is lower,
so the model's transfer times are lower bounds. The peer latency (2 us) is an assumption, not a
figure from the paper or a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Network:
    """Per-GPU link speeds (bytes/s each way) and topology."""

    # 8 H100 per node: the paper's cluster (section 8), an NVIDIA HGX/DGX H100 node.
    ranks_per_node: int = 8
    # NVLink 4: 900 GB/s bidirectional per H100 SXM (NVIDIA H100 datasheet; paper section 8).
    bw_intra: float = 450e9
    # One 400 Gb/s NDR InfiniBand port per GPU (8 x 400 Gbps per node, paper section 8).
    bw_inter: float = 50e9
    # Assumed per-peer send/receive latency, not measured.
    peer_latency_s: float = 2e-6

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node!r}")
        for name in ("bw_intra", "bw_inter"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.peer_latency_s < 0:
            raise ValueError(f"peer_latency_s must be >= 0, got {self.peer_latency_s!r}")


@dataclass(frozen=True)
class Volumes:
    """Bytes per rank of one all-to-all, ``float64[num_ranks]`` each."""

    sent_intra: np.ndarray
    sent_inter: np.ndarray
    recv_intra: np.ndarray
    recv_inter: np.ndarray
    kept: np.ndarray  # bytes whose source and destination rank are the same

    @property
    def num_ranks(self) -> int:
        return self.kept.size

    @property
    def inter_max_rank(self) -> float:
        """The paper's eq. 5 quantity: inter-node bytes of the busiest rank (either way)."""
        return float(np.maximum(self.sent_inter, self.recv_inter).max(initial=0.0))

    @property
    def inter_mean_rank(self) -> float:
        """Average inter-node bytes sent per rank (the metric of the paper's Figure 13)."""
        return float(self.sent_inter.mean()) if self.num_ranks else 0.0

    @property
    def held(self) -> np.ndarray:
        """Bytes each rank holds before the move (what an all-gather sends from it)."""
        return self.sent_intra + self.sent_inter + self.kept

    @property
    def moves(self) -> bool:
        """Whether any byte changes rank (else the all-to-all is skipped)."""
        return bool(self.sent_intra.any() or self.sent_inter.any())

    @property
    def inter_total(self) -> float:
        return float(self.sent_inter.sum())

    @property
    def intra_total(self) -> float:
        return float(self.sent_intra.sum())

    def __add__(self, other: Volumes) -> Volumes:
        """Two moves that run as one all-to-all (e.g. several tensors of the same plan)."""
        return Volumes(
            self.sent_intra + other.sent_intra,
            self.sent_inter + other.sent_inter,
            self.recv_intra + other.recv_intra,
            self.recv_inter + other.recv_inter,
            self.kept + other.kept,
        )


def volumes(
    src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, *, num_ranks: int, ranks_per_node: int
) -> Volumes:
    """Bytes each rank sends and receives, split into intra- and inter-node."""
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    w = np.asarray(nbytes, dtype=np.float64)
    if not src.shape == dst.shape == w.shape:
        raise ValueError(
            f"src, dst, nbytes must have one shape, got {src.shape, dst.shape, w.shape}"
        )
    for name, ranks in (("src", src), ("dst", dst)):
        if ranks.size and (ranks.min() < 0 or ranks.max() >= num_ranks):
            raise ValueError(
                f"{name} must be in [0, {num_ranks}), got range {ranks.min(), ranks.max()}"
            )
    if w.size and w.min() < 0:
        raise ValueError(f"nbytes must be >= 0, got {w.min()!r}")
    same_rank = src == dst
    same_node = (src // ranks_per_node) == (dst // ranks_per_node)
    intra = w * (same_node & ~same_rank)
    inter = w * ~same_node

    def per(ranks: np.ndarray, weights: np.ndarray) -> np.ndarray:
        return np.bincount(ranks, weights=weights, minlength=num_ranks)

    return Volumes(
        sent_intra=per(src, intra),
        sent_inter=per(src, inter),
        recv_intra=per(dst, intra),
        recv_inter=per(dst, inter),
        kept=per(src, w * same_rank),
    )


def all_to_all_seconds(vol: Volumes, net: Network) -> float:
    """Duration of the all-to-all: the busiest rank's transfer plus per-peer latency."""
    if vol.num_ranks <= 1:
        return 0.0
    intra = np.maximum(vol.sent_intra, vol.recv_intra) / net.bw_intra
    inter = np.maximum(vol.sent_inter, vol.recv_inter) / net.bw_inter
    return float(np.maximum(intra, inter).max()) + net.peer_latency_s * (vol.num_ranks - 1)


def all_gather_seconds(per_rank_bytes: np.ndarray, net: Network) -> float:
    """Duration of an all-gather of every rank's bytes, padded to the largest (NCCL gathers
    equal sizes): each rank receives ``num_ranks - 1`` such buffers through a ring whose
    slowest link bounds it (the network beyond one node, else NVLink), the bus-bandwidth
    model of NCCL's performance notes (``nccl-tests`` doc/PERFORMANCE.md), plus per-peer
    latency as for the all-to-all."""
    b = np.asarray(per_rank_bytes, dtype=np.float64)
    d = b.size
    if d <= 1:
        return 0.0
    bw = net.bw_inter if d > net.ranks_per_node else net.bw_intra
    return (d - 1) * float(b.max()) / bw + net.peer_latency_s * (d - 1)
