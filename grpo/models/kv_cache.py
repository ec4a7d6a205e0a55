"""A preallocated static KV cache: one buffer per layer, written at explicit positions."""

from __future__ import annotations

import torch


class _LayerBuffers:
    """What both caches read off their per-layer (rows, H_kv, slots, D) buffers."""

    k_layers: list[torch.Tensor]

    @property
    def rows(self) -> int:
        return self.k_layers[0].shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_layers[0].dtype

    @property
    def max_len(self) -> int:
        """Slots per row."""
        return self.k_layers[0].shape[2]


class KVCache(_LayerBuffers):
    """Keys and values of every layer for B rows and up to `max_len` positions.

    Buffers are allocated once, one (B, H_kv, S, D) pair per layer; each forward writes its T
    new positions at `[pos, pos + T)` in place. Nothing is concatenated or re-allocated per
    step. `pos` is shared by all rows: rows are left-padded so that they all end at the same
    slot, and padding is hidden by the attention mask, not by the cache. Separate per-layer
    tensors (not views of one (L, ...) tensor) let a compiled step update each one in place;
    a mutated view of a graph input makes inductor copy the whole base every step.

    Two modes, same buffers:

    - dynamic (default): `pos` is a Python int; a forward attends over `[0, pos + T)` only.
    - static (`static=True`, gpt-fast style, for `torch.compile`): `pos` lives in a 0-d long
      tensor and a forward attends over all `max_len` slots (unwritten ones are hidden by the
      causal mask), so a decode step has the same shapes and guards at every position and
      compiles once. Writes are not bounds-checked on the host (that would need a sync);
      an index past `max_len` fails inside `index_copy_`. A caller that knows how far the
      cache is filled (the sampler counts its steps on the host) sets `limit`: forwards then
      attend over the first `limit` slots only (`attend_len`), so a step's attention costs
      what is filled, rounded up to the caller's bucket, not the whole buffer.
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
        static: bool = False,
    ):
        shape = (rows, num_kv_heads, max_len, head_dim)
        self.k_layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.static = static
        self._pos = 0
        # static mode: the write position as a tensor, advanced in place (no Python int).
        self.pos_tensor = torch.zeros((), dtype=torch.long, device=device) if static else None
        self.limit: int | None = None  # static mode: attend over this many slots (None: all)

    @classmethod
    def for_model(
        cls, model, rows: int, max_len: int, static: bool = False, dtype: torch.dtype | None = None
    ) -> KVCache:
        """A cache sized for `model` (a `Decoder`), on its device; in `dtype` (the precision
        policy's `kv_dtype`), by default the weights' dtype."""
        cfg = model.config
        p = next(model.parameters())
        return cls(
            cfg.num_hidden_layers,
            rows,
            cfg.num_key_value_heads,
            max_len,
            cfg.head_dim,
            dtype=dtype or p.dtype,
            device=p.device,
            static=static,
        )

    @property
    def pos(self) -> int:
        """Number of positions written so far (a host sync in static mode)."""
        return int(self.pos_tensor) if self.static else self._pos

    @property
    def k(self) -> torch.Tensor:
        """(L, B, H_kv, S, D) copy of all keys, for inspection."""
        return torch.stack(self.k_layers)

    @property
    def v(self) -> torch.Tensor:
        """(L, B, H_kv, S, D) copy of all values, for inspection."""
        return torch.stack(self.v_layers)

    @property
    def attend_len(self) -> int:
        """Static mode: the slots a forward attends over (`limit`, else all `max_len`)."""
        return self.max_len if self.limit is None else self.limit

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, H_kv, T, D) at [pos, pos+T) of `layer`; return the keys/values to
        attend over: (B, H_kv, pos+T, D) in dynamic mode, (B, H_kv, attend_len, D) in static
        mode.
        """
        T = k.shape[2]
        k_buf, v_buf = self.k_layers[layer], self.v_layers[layer]  # (B, H_kv, S, D)
        # Under autocast keys come out of rotary embeddings in float32 and values out of a 16-bit
        # matmul: both are stored as the attention will read them (the buffers' dtype).
        k, v = k.to(k_buf.dtype), v.to(v_buf.dtype)
        if self.static:
            idx = self.pos_tensor + torch.arange(T, device=k.device)  # (T,)
            k_buf.index_copy_(2, idx, k)
            v_buf.index_copy_(2, idx, v)
            if self.limit is not None:
                return k_buf[:, :, : self.limit], v_buf[:, :, : self.limit]
            return k_buf, v_buf
        end = self._pos + T
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions > max_len {self.max_len}")
        k_buf[:, :, self._pos : end] = k
        v_buf[:, :, self._pos : end] = v
        return k_buf[:, :, :end], v_buf[:, :, :end]  # (B, H_kv, pos+T, D)

    def advance(self, T: int) -> None:
        """Mark T more positions as written (called once per forward, after all layers)."""
        if self.static:
            self.pos_tensor.add_(T)
        else:
            self._pos += T

    def select_rows(self, idx: torch.Tensor) -> KVCache:
        """A new cache holding only rows `idx` (e.g. the trajectories still running)."""
        out = KVCache.__new__(KVCache)
        out.k_layers = [k.index_select(0, idx) for k in self.k_layers]
        out.v_layers = [v.index_select(0, idx) for v in self.v_layers]
        out.static = self.static
        out._pos = self._pos
        out.pos_tensor = self.pos_tensor.clone() if self.static else None
        out.limit = None
        return out

    def repeat_rows(self, G: int, out: KVCache | None = None) -> KVCache:
        """A cache whose rows are each of this cache's rows repeated G times in a row.

        Row b of this cache becomes rows b*G .. b*G + G - 1: a prompt prefilled once serves
        its whole group. With `out` (a cache of rows * G rows and the same length), the rows
        are copied into its buffers in place and `out` is returned: a compiled decode step
        (CUDA graphs) keeps seeing the same tensors call after call. With G == 1 and no `out`
        there is nothing to copy: this cache itself is returned.
        """
        if G == 1 and out is None:
            return self
        if out is not None:
            if (out.rows, out.max_len, out.static) != (self.rows * G, self.max_len, self.static):
                raise ValueError("repeat_rows: `out` has the wrong shape")
            for src, dst in zip(self.k_layers + self.v_layers, out.k_layers + out.v_layers):
                P = src.shape[0]
                dst.view(P, G, *src.shape[1:]).copy_(src[:, None])  # row b -> b*G .. b*G+G-1
            if self.static:
                out.pos_tensor.copy_(self.pos_tensor)
            out._pos = self._pos
            out.limit = None
            return out
        out = KVCache.__new__(KVCache)
        out.k_layers = [k.repeat_interleave(G, dim=0) for k in self.k_layers]  # (B*G, H_kv, S, D)
        out.v_layers = [v.repeat_interleave(G, dim=0) for v in self.v_layers]
        out.static = self.static
        out._pos = self._pos
        out.pos_tensor = self.pos_tensor.clone() if self.static else None
        out.limit = None
        return out


class GroupedKVCache(_LayerBuffers):
    """Decode-time cache of B = P*G rows whose groups of G share a prompt, held once.

    The prompt's keys and values live in `prefix`, the prefill's P-row `KVCache` (T_p slots,
    all written); each row's own tokens go to slots of its own, (B, H_kv, N, D) per layer.
    A decode step reads each prompt's keys and values once for its G rows
    (`grpo.models.decoder.grouped_decode_attention`) instead of G copies, and the prefill's
    rows are never copied G times (`KVCache.repeat_rows`): at the Qwen3-0.6B shape with B=32
    and a 128-token prompt that copy was ~1 GB of fresh float32 memory per rollout.

    Positions count both parts: slots [0, T_p) are the prompt's, [T_p, T_p + N) the rows'; the
    attention mask a forward gets spans both, as it would over one `KVCache` of T_p + N slots.
    Dynamic mode only (a Python position; each forward attends over the slots written so far),
    one token per row per forward (decode steps).
    """

    static = False
    pos_tensor = None

    def __init__(self, prefix: KVCache, group_size: int, new_slots: int):
        if prefix.static:
            raise ValueError("GroupedKVCache: the prefix must be a dynamic KVCache")
        k0 = prefix.k_layers[0]
        P, H_kv, T_p, D = k0.shape
        if prefix.pos != T_p:
            raise ValueError(f"GroupedKVCache: the prefix holds {prefix.pos} of {T_p} slots")
        self.prefix = prefix
        self.group_size = group_size
        self.prompt_len = T_p
        # Every row writes every slot before any forward reads it (a forward attends over
        # [0, pos + T) only), so the buffers need no zeroing.
        shape = (P * group_size, H_kv, new_slots, D)
        n = len(prefix.k_layers)
        self.k_layers = [torch.empty(shape, dtype=k0.dtype, device=k0.device) for _ in range(n)]
        self.v_layers = [torch.empty(shape, dtype=k0.dtype, device=k0.device) for _ in range(n)]
        self._pos = T_p

    @property
    def pos(self) -> int:
        """Positions written so far, the prompt's T_p included."""
        return self._pos

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.k_layers[0].shape[2]

    def prefix_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The P prompts' keys and values of `layer`, (P, H_kv, T_p, D) each."""
        return self.prefix.k_layers[layer], self.prefix.v_layers[layer]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, H_kv, T, D) at the rows' next T slots of `layer`; return the rows'
        own keys/values so far, (B, H_kv, pos + T - T_p, D) (the prompt's: `prefix_kv`)."""
        T = k.shape[2]
        start = self._pos - self.prompt_len
        end = start + T
        k_buf, v_buf = self.k_layers[layer], self.v_layers[layer]
        if end > k_buf.shape[2]:
            raise ValueError(
                f"KV cache overflow: {self._pos + T} positions > max_len {self.max_len}"
            )
        k_buf[:, :, start:end] = k.to(k_buf.dtype)
        v_buf[:, :, start:end] = v.to(v_buf.dtype)
        return k_buf[:, :, :end], v_buf[:, :, :end]

    def advance(self, T: int) -> None:
        self._pos += T


class RowKVCache(_LayerBuffers):
    """Decode-time cache of S slots, each holding one row at its own length (continuous refill).

    Where `KVCache` writes every row's next token at one shared slot, a slot here writes at its
    own `lens[s]`, so a row can leave a slot and another row take it mid-call
    (`grpo.rollout.refill`): the newcomer's prompt is copied in at slots [0, T_p) (`load`),
    laid out as the prefill laid it out (left-padded to the call's T_p), and its tokens
    follow. One token per slot per forward (decode steps). Static-style for `Decoder.forward`
    (a compiled step sees no host value change): positions live on the device (`lens`,
    advanced in place) and each forward attends over the first `limit` slots, a bound the
    caller keeps on the host (the longest slot + 1, rounded up to its bucket); the caller's
    additive mask hides each slot's padding and unwritten slots.
    """

    static = True

    def __init__(self, num_layers, rows, num_kv_heads, max_len, head_dim, dtype, device):
        shape = (rows, num_kv_heads, max_len, head_dim)
        self.k_layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lens = torch.zeros(rows, dtype=torch.long, device=device)  # (S,) next slot to write
        self.pos_tensor = self.lens  # what a static forward reads (queries at each slot's own)
        self.limit = max_len  # slots a forward attends over, set by the caller
        self._rows = torch.arange(rows, device=device)

    @classmethod
    def for_model(cls, model, rows: int, max_len: int, dtype: torch.dtype) -> RowKVCache:
        cfg = model.config
        return cls(
            cfg.num_hidden_layers,
            rows,
            cfg.num_key_value_heads,
            max_len,
            cfg.head_dim,
            dtype,
            model.device,
        )

    @property
    def attend_len(self) -> int:
        return self.limit

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (S, H_kv, 1, D) at each slot's own next position; return (S, H_kv,
        limit, D) keys and values. Not bounds-checked on the host (a sync): a slot written
        past `max_len` fails inside the indexing."""
        if k.shape[2] != 1:
            raise ValueError(f"a RowKVCache takes one token per slot, got {k.shape[2]}")
        k_buf, v_buf = self.k_layers[layer], self.v_layers[layer]
        k_buf[self._rows, :, self.lens] = k[:, :, 0].to(k_buf.dtype)  # (S, H_kv, D)
        v_buf[self._rows, :, self.lens] = v[:, :, 0].to(v_buf.dtype)
        return k_buf[:, :, : self.limit], v_buf[:, :, : self.limit]

    def advance(self, T: int) -> None:
        self.lens.add_(T)

    def load(self, slots: torch.Tensor, prefix: KVCache, rows: torch.Tensor, T_p: int) -> None:
        """Copy rows `rows` (n,) of a prefill's cache (its first T_p slots written) into
        slots `slots` (n,), which then hold T_p positions."""
        for src, dst in zip(prefix.k_layers + prefix.v_layers, self.k_layers + self.v_layers):
            dst[:, :, :T_p].index_copy_(0, slots, src[:, :, :T_p].index_select(0, rows))
        self.lens[slots] = T_p
