"""A preallocated static KV cache: one buffer per layer, written at explicit positions."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer for B rows and up to `max_len` positions.

    Buffers are allocated once, (L, B, H_kv, S, D); each forward writes its T new positions at
    `[pos, pos + T)` in place and attends over `[0, pos + T)`. Nothing is concatenated or
    re-allocated per step. `pos` is shared by all rows: rows are left-padded so that they all
    end at the same slot, and padding is hidden by the attention mask, not by the cache.
    """

    def __init__(
        self,
        num_layers: int,
        rows: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (num_layers, rows, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, H_kv, S, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, H_kv, S, D)
        self.pos = 0

    @classmethod
    def for_model(cls, model, rows: int, max_len: int) -> KVCache:
        """A cache sized for `model` (a `Decoder`), on its device and in its dtype."""
        cfg = model.config
        p = next(model.parameters())
        return cls(
            cfg.num_hidden_layers,
            rows,
            cfg.num_key_value_heads,
            max_len,
            cfg.head_dim,
            dtype=p.dtype,
            device=p.device,
        )

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, H_kv, T, D) at [pos, pos+T) of `layer`; return keys/values so far."""
        T = k.shape[2]
        end = self.pos + T
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions > max_len {self.max_len}")
        self.k[layer, :, :, self.pos : end] = k
        self.v[layer, :, :, self.pos : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, H_kv, pos+T, D)

    def advance(self, T: int) -> None:
        """Mark T more positions as written (called once per forward, after all layers)."""
        self.pos += T

    def repeat_rows(self, G: int) -> KVCache:
        """A new cache whose rows are each of this cache's rows repeated G times in a row.

        Row b of this cache becomes rows b*G .. b*G + G - 1: a prompt prefilled once serves
        its whole group.
        """
        out = KVCache.__new__(KVCache)
        out.k = self.k.repeat_interleave(G, dim=1)  # (L, B*G, H_kv, S, D)
        out.v = self.v.repeat_interleave(G, dim=1)
        out.pos = self.pos
        return out
