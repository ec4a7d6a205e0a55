"""Attention over packed sequences: many segments on one token axis, no padding token.

A packed forward runs the decoder on (1, N) tokens, the real tokens of several rows laid end
to end, so every linear layer (projections, MLP, head) touches real tokens only. Attention
stays inside each segment: a segment's queries see its own earlier tokens and, when it has
one, every token of its *prefix* segment (the group's prompt, run once for G completions:
`train.shared_prefix`). Segments are attended in buckets of similar lengths: each bucket is
one SDPA call over its segments padded to the bucket's longest, so the scores computed are
about sum_i len_i * (prefix_i + len_i), never (sum_i len_i)^2 (`PackedSegments.score_elements`
counts them). The buckets come from a small dynamic program that trades padding against a
per-call cost (`bucket_overhead`), recorded per device type with its source (`PACKING_COSTS`),
which also decides `train.pack_sequences: auto`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

Segment = tuple[int, int, int, int]  # (start, length, prefix_start, prefix_length) in the stream


@dataclass(frozen=True)
class PackingCost:
    """What packing costs on one device type, from a measurement recorded with its source.

    Attributes:
        bucket_macs: the fixed cost of one more attention bucket (its launches and gathers),
            in multiply-adds of the device's matmuls (`bucket_overhead` turns it into score
            elements of one row).
        packed_vs_padded: packed / padded time of the reference + update passes at the GSM8K
            length spread (`bench_step --lengths gsm8k`); `train.pack_sequences: auto` packs
            where it is below 1. None: not measured (auto stays padded).
        source: where the numbers come from.
    """

    bucket_macs: int
    packed_vs_padded: float | None
    source: str


PACKING_COSTS: dict[str, PackingCost] = {
    "cpu": PackingCost(
        bucket_macs=1 << 20,
        packed_vs_padded=0.569,
        source="2-core CPU VM, Qwen3-0.6B shape, LoRA r16, 256 new tokens: packed 45.3 s vs "
        "padded 79.6 s (benchmarks/results/packing_cpu.md); bucket cost calibrated there "
        "(docs/benchmarks.md, sequence packing)",
    ),
    "cuda": PackingCost(
        # ~9 launches per layer per bucket x ~24 us per eager launch (the tutorial step's
        # rollout: 7.5 s over 128 decode steps of ~2,470 launches) = ~0.21 ms, at the float32
        # matmul rate that run measured (50.6 TFLOP/s = 2.5e13 multiply-adds/s)
        bucket_macs=5_400_000_000,
        packed_vs_padded=1.08,
        source="H200, torch 2.11, 2026-12-04, Qwen3-0.6B shape float32, LoRA r16, 256 new "
        "tokens: packed 1520 ms vs padded 1412 ms with the CPU's bucket cost (15-18 buckets "
        "per 16-row micro-batch; benchmarks/results/packing_gpu_qwen3-0.6b.md). The bucket "
        "cost above is derived from that run's launch rate; packing with it is not measured",
    ),
}


def packing_cost(device_type: str) -> PackingCost | None:
    """The recorded `PackingCost` of a device type (None: nothing measured there)."""
    return PACKING_COSTS.get(device_type)


def packs_by_default(device_type: str) -> bool:
    """`train.pack_sequences: auto` on this device type: pack where the recorded measurement
    found packing faster than padding (`PACKING_COSTS`)."""
    cost = packing_cost(device_type)
    return cost is not None and cost.packed_vs_padded is not None and cost.packed_vs_padded < 1


def packs_sequences(
    mode: str, device: torch.device | str, micro_batch_tokens: int | None = None
) -> bool:
    """Whether the training passes on `device` pack each micro-batch's rows.

    Args:
        mode: train.pack_sequences: on | off | auto (where the recorded measurement found it
            faster, `packs_by_default`: a CPU, not CUDA; docs/benchmarks.md).
        device: where the passes run.
        micro_batch_tokens: train.micro_batch_tokens; a token budget cuts packed
            micro-batches, so auto packs wherever one is set.
    """
    if mode == "auto":
        device_type = str(device).split(":")[0]
        return micro_batch_tokens is not None or packs_by_default(device_type)
    return mode == "on"


def bucket_overhead(num_heads: int, head_dim: int, device_type: str = "cpu") -> int:
    """The fixed cost of one more attention call (launches, gathers), in score elements of one
    row: the device type's recorded `bucket_macs` over the H * D multiply-adds of one score (a
    few hundred at Qwen3-0.6B's heads on a CPU, so small models take few buckets and large
    ones many; millions on CUDA, where launches cost more than padding: one or two buckets).
    A device type with no record takes the CPU's."""
    cost = packing_cost(device_type) or PACKING_COSTS["cpu"]
    return max(1, cost.bucket_macs // max(1, num_heads * head_dim))


def plan_buckets(q_lens: np.ndarray, k_lens: np.ndarray, overhead: int) -> list[np.ndarray]:
    """Segments grouped into buckets minimizing sum over buckets of (rows x longest query x
    longest key span + overhead): segments sorted by key span (longest first), then the best
    split into consecutive runs (dynamic programming, O(n^2) in numpy).

    Returns:
        the segment indices of each bucket.
    """
    n = len(q_lens)
    order = np.lexsort((-q_lens, -k_lens))  # key span descending, then query length
    q, k = q_lens[order].astype(np.int64), k_lens[order].astype(np.int64)
    best = np.zeros(n + 1, dtype=np.float64)  # best[j]: cost of the first j segments
    cut = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        # a last bucket holding segments i .. j-1, for every i: its longest query and key span
        q_max = np.maximum.accumulate(q[:j][::-1])[::-1]
        k_max = k[:j]  # sorted descending: the first of the run is the longest
        i = np.arange(j)
        cost = best[:j] + (j - i) * q_max * k_max + overhead
        cut[j] = int(np.argmin(cost))
        best[j] = cost[cut[j]]
    buckets, j = [], n
    while j > 0:
        buckets.append(order[cut[j] : j])
        j = cut[j]
    return buckets[::-1]


class Bucket:
    """One attention call: `rows` segments padded to T queries and S keys.

    Attributes:
        q_index: (b * T,) long, the stream position of each query slot, row-major (0 on
            padding).
        k_index: (b * S,) long, the stream position of each key slot: the prefix's tokens,
            then the segment's own (0 on padding).
        keep: (b, 1, T, S) bool, True = the query attends to the key; padded query slots keep
            key slot 0 (never a row with nothing to attend to, which would make softmax NaN).
        valid: (n,) long, the flat query slots (of b * T) that hold a token, in slot order
            (their outputs are kept).

    Gathers and scatters go through `index_select` (backward: `index_add_`), which a CPU runs
    several times faster than advanced indexing's backward (`index_put_` with accumulate).
    """

    __slots__ = ("q_index", "k_index", "keep", "valid", "_masks")

    def __init__(self, q_index, k_index, keep, valid):
        self.q_index, self.k_index = q_index.reshape(-1), k_index.reshape(-1)  # flat
        self.keep, self.valid = keep, valid
        self._masks: dict[torch.dtype, torch.Tensor] = {}

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask in `dtype` (0 = attend, -inf = not), built once per dtype and
        shared by every layer (and a checkpointed block's recompute)."""
        if dtype not in self._masks:
            # rows padded to a multiple of 8 elements, a view of the first S, as the decoder's
            # own mask: memory-efficient attention would copy a mask of other strides per call
            b, _, T, S = self.keep.shape
            m = torch.zeros(b, 1, T, -(-S // 8) * 8, dtype=dtype, device=self.keep.device)
            self._masks[dtype] = m[..., :S].masked_fill_(~self.keep, float("-inf"))
        return self._masks[dtype]


class PackedSegments:
    """The attention layout of a packed forward: positions, buckets and the order that puts
    the buckets' outputs back on the token axis. Not a dataclass on purpose: DDP passes it to
    the module untouched (it rebuilds dataclasses it finds among the inputs).

    Attributes:
        position_ids: (N,) rotary positions, restarting at each row (a completion segment
            continues its prefix's count), as the padded forward counts them.
        buckets: the `Bucket`s.
        order: (N,) long: stream token i's output is row order[i] of the buckets' kept outputs
            concatenated.
        score_elements: attention scores computed per head (padding included): sum over
            buckets of rows x T x S.
    """

    __slots__ = ("position_ids", "buckets", "order", "score_elements", "num_tokens")

    def __init__(
        self,
        segments: list[Segment],
        position_ids: np.ndarray,
        overhead: int,
        device: torch.device | str = "cpu",
    ):
        """Args:
        segments: (start, length, prefix_start, prefix_length) of each query segment in the
            stream; every stream token belongs to exactly one; prefix_length 0 = none.
        position_ids: (N,) rotary positions.
        overhead: `bucket_overhead`.
        device: where the index tensors live (the model's device)."""
        seg = np.asarray(segments, dtype=np.int64).reshape(-1, 4)
        N = len(position_ids)
        if seg[:, 1].sum() != N:
            raise ValueError(f"segments cover {int(seg[:, 1].sum())} tokens, the stream has {N}")
        self.num_tokens = N
        self.position_ids = torch.as_tensor(position_ids, dtype=torch.long).to(device)
        q_lens, k_lens = seg[:, 1], seg[:, 1] + seg[:, 3]
        self.buckets, kept, self.score_elements = [], [], 0
        for idx in plan_buckets(q_lens, k_lens, overhead):
            s = seg[idx]  # (b, 4)
            b, T, S = len(s), int(s[:, 1].max()), int((s[:, 1] + s[:, 3]).max())
            t, j = np.arange(T)[None, :], np.arange(S)[None, :]  # query slot, key slot
            length, p0, plen = s[:, 1:2], s[:, 2:3], s[:, 3:4]
            valid = t < length  # (b, T)
            q_index = np.where(valid, s[:, 0:1] + t, 0)
            own = j - plen  # the key slot's position in the segment's own tokens
            k_index = np.where(j < plen, p0 + j, np.where(own < length, s[:, 0:1] + own, 0))
            keep = (j[:, None, :] < plen[:, :, None]) | (  # (b, T, S): the whole prefix ...
                (own[:, None, :] >= 0) & (own[:, None, :] <= t[:, :, None])  # ... causal own
            )
            keep &= valid[:, :, None]
            keep[:, :, 0] |= ~valid  # padded queries: one key, outputs dropped
            self.buckets.append(
                Bucket(
                    torch.as_tensor(q_index).to(device),
                    torch.as_tensor(k_index).to(device),
                    torch.as_tensor(keep[:, None]).to(device),
                    torch.as_tensor(np.flatnonzero(valid)).to(device),
                )
            )
            kept.append(q_index[valid])
            self.score_elements += b * T * S
        inverse = np.empty(N, dtype=np.int64)
        inverse[np.concatenate(kept)] = np.arange(N)
        self.order = torch.as_tensor(inverse).to(device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention) -> torch.Tensor:
        """Attention of the packed stream, bucket by bucket.

        Args:
            q: (1, H, N, D); k, v: (1, H_kv, N, D), all in the dtype attention runs in.
            attention: the decoder's `attention(q, k, v, mask)` (SDPA arranged per device).

        Returns:
            (1, N, H * D), the stream's attention outputs in stream order.
        """
        H, D = q.shape[1], q.shape[3]
        q, k, v = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)  # (N, h, D)
        outs = []
        for bk in self.buckets:
            b, _, T, S = bk.keep.shape
            qb = q.index_select(0, bk.q_index).view(b, T, H, D).transpose(1, 2)  # (b, H, T, D)
            kb = k.index_select(0, bk.k_index).view(b, S, -1, D).transpose(1, 2)  # (b, H_kv, S, D)
            vb = v.index_select(0, bk.k_index).view(b, S, -1, D).transpose(1, 2)
            y = attention(qb, kb, vb, bk.mask(q.dtype))  # (b, H, T, D)
            outs.append(y.transpose(1, 2).reshape(b * T, H * D).index_select(0, bk.valid))
        return torch.cat(outs).index_select(0, self.order)[None]  # (1, N, H*D)
