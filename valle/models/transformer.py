"""Transformer blocks on scaled_dot_product_attention: fused QKV, pre/post-norm,
adaptive layer norm (AdaLN) conditioning, optional cross-attention, KV cache.

Masks follow SDPA's boolean convention: True = may attend. They are built once per
batch by the model and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class KVCache:
    """Keys/values of one attention layer, preallocated to ``max_len`` positions.

    Allocation is lazy so the cache takes the dtype the projections produce
    (bf16/fp16 under autocast, the model dtype otherwise).
    """

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = k.shape[2]
        if self.k is None:
            b, h, _, d = k.shape
            self.k = k.new_empty(b, h, self.max_len, d)
            self.v = v.new_empty(b, h, self.max_len, d)
        if self.length + n > self.max_len:
            raise RuntimeError(f"KV cache overflow: {self.length} + {n} > {self.max_len}")
        self.k[:, :, self.length : self.length + n] = k
        self.v[:, :, self.length : self.length + n] = v
        self.length += n
        return self.k[:, :, : self.length], self.v[:, :, : self.length]


class StaticKVCache:
    """Keys/values of one attention layer in buffers of fixed shape (B, H, max_len, Dh).

    With ``fixed_shape`` (for CUDA graphs), new keys are written at column ``cursor`` (a
    device tensor shared by every layer of a stack; whoever decodes advances it) and
    attention always reads the whole buffer, the columns not written yet masked out:
    every decoding step then has the same shapes and no host synchronisation, so a graph
    can replay it. Without it the cache counts its columns on the host and attention
    reads only the written ones: the same buffers, never re-allocated or concatenated
    (what makes it faster than the growing cache), and no attention over empty columns
    (which a step without a graph would pay for nothing).
    """

    def __init__(self, max_len: int, cursor: torch.Tensor, fixed_shape: bool = True):
        self.max_len, self.cursor, self.fixed_shape = max_len, cursor, fixed_shape
        self.length = 0  # columns written (tracked when not fixed_shape)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:
            b, h, _, d = k.shape
            # Zeros, not empty: a masked key's value is still multiplied by its zero weight,
            # and 0 x NaN garbage would be NaN.
            self.k = k.new_zeros(b, h, self.max_len, d)
            self.v = v.new_zeros(b, h, self.max_len, d)
        if not self.fixed_shape:
            end = self.length + k.shape[2]
            self.k[:, :, self.length:end] = k
            self.v[:, :, self.length:end] = v
            self.length = end
            return self.k[:, :, :end], self.v[:, :, :end]
        cols = self.cursor + torch.arange(k.shape[2], device=k.device)
        self.k.index_copy_(2, cols, k)
        self.v.index_copy_(2, cols, v)
        return self.k, self.v


class LayerCache:
    """Self-attention cache plus (for cross-attention layers) the memory's keys/values.

    With ``cursor`` (a (1,) long tensor) the self-attention cache is a ``StaticKVCache``."""

    def __init__(self, max_len: int, cursor: torch.Tensor | None = None, fixed_shape: bool = True):
        self.self_attn = (KVCache(max_len) if cursor is None
                          else StaticKVCache(max_len, cursor, fixed_shape))
        self.memory_kv: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class AttentionProbe:
    """Which attention scores probed layers record; the attention itself stays on SDPA.

    Each probed layer appends the scaled scores (float32, masked keys at -inf) of its first
    ``heads`` heads (all when None), query rows ``queries`` and key columns ``keys`` to
    ``scores``. Only that block is computed: the guided-attention loss needs audio queries
    over text keys of two heads, a small fraction of the full (B, H, L, L) matrix that the
    attention would otherwise have to materialise (and keep for backward) in every probed
    layer (docs/training.md, "Guided attention").
    """

    heads: int | None = None
    queries: slice = field(default_factory=lambda: slice(None))
    keys: slice = field(default_factory=lambda: slice(None))
    scores: list[torch.Tensor] = field(default_factory=list)

    def record(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> None:
        """q (B, H, N, Dh), k (B, H, K, Dh); mask broadcastable to (B, H, N, K)."""
        h = slice(None, self.heads)
        scores = q[:, h, self.queries] @ k[:, h, self.keys].transpose(-2, -1)
        scores = scores.float() * q.shape[-1] ** -0.5
        if mask is not None:
            # A (B, 1, 1, K) key-padding mask has one row for every query.
            rows = self.queries if mask.shape[-2] > 1 else slice(None)
            scores = scores.masked_fill(~mask[..., rows, self.keys], float("-inf"))
        self.scores.append(scores)


class MultiHeadAttention(nn.Module):
    """Multi-head attention; self-attention uses one fused QKV projection."""

    def __init__(self, dim: int, nhead: int, dropout: float, cross: bool = False):
        super().__init__()
        if dim % nhead:
            raise ValueError(f"width {dim} is not divisible by {nhead} heads")
        self.nhead, self.head_dim, self.cross = nhead, dim // nhead, cross
        self.dropout = dropout
        # No key bias: softmax is invariant to it (q.(k+b) shifts every key's score of a
        # query by the same q.b), so its true gradient is zero and an Adam-type optimizer
        # would only amplify rounding noise into it. Query and value keep theirs.
        if cross:
            self.q_proj = nn.Linear(dim, dim)
            self.kv_proj = nn.Linear(dim, 2 * dim, bias=False)
        else:
            self.qkv_proj = nn.Linear(dim, 3 * dim, bias=False)
            self.q_bias = nn.Parameter(torch.zeros(dim))
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("k_bias", torch.zeros(dim), persistent=False)
        self.out_proj = nn.Linear(dim, dim)

    def _heads(self, x: torch.Tensor, parts: int) -> torch.Tensor:
        b, n, _ = x.shape
        # (B, N, parts*D) -> (parts, B, H, N, Dh)
        return x.view(b, n, parts, self.nhead, self.head_dim).permute(2, 0, 3, 1, 4)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        memory: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        probe: AttentionProbe | None = None,
    ) -> torch.Tensor:
        """``probe``: records a block of this layer's attention scores (AttentionProbe)."""
        b, n, d = x.shape
        if self.cross:
            q = self._heads(self.q_proj(x), 1)[0]
            if cache is not None and cache.memory_kv is not None:
                k, v = cache.memory_kv  # the text memory does not change while decoding
            else:
                kv = F.linear(memory, self.kv_proj.weight, torch.cat([self.k_bias, self.v_bias]))
                k, v = self._heads(kv, 2).unbind(0)
                if cache is not None:
                    cache.memory_kv = (k, v)
        else:
            bias = torch.cat([self.q_bias, self.k_bias, self.v_bias])
            q, k, v = self._heads(F.linear(x, self.qkv_proj.weight, bias), 3).unbind(0)
            if cache is not None:
                k, v = cache.self_attn.append(k, v)
                if mask is not None and mask.shape[-1] < k.shape[2]:
                    # A fixed-shape cache: the columns after the mask's are not written yet.
                    mask = F.pad(mask, (0, k.shape[2] - mask.shape[-1]), value=False)
                elif mask is not None and mask.shape[-1] > k.shape[2]:
                    # A host-counted static cache: the mask's later columns have no key yet.
                    mask = mask[..., : k.shape[2]]
        dropout_p = self.dropout if self.training else 0.0
        if probe is not None:
            probe.record(q, k, mask)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class AdaptiveLayerNorm(nn.Module):
    """LayerNorm whose scale and shift come from a per-row condition (the NAR stage).

    Initialised to the identity transform (scale 1, shift 0), so at the start it is a
    plain LayerNorm and the stage dependence is learned.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.proj = nn.Linear(dim, 2 * dim)
        nn.init.zeros_(self.proj.weight)
        with torch.no_grad():
            self.proj.bias.copy_(torch.cat([torch.ones(dim), torch.zeros(dim)]))

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        scale, shift = self.proj(cond).unsqueeze(1).chunk(2, dim=-1)  # (B, 1, D) each
        return scale * self.norm(x) + shift


class TransformerLayer(nn.Module):
    def __init__(
        self,
        dim: int,
        nhead: int,
        dropout: float,
        norm_first: bool,
        adaptive: bool = False,
        cross: bool = False,
        ff_mult: int = 4,
    ):
        super().__init__()
        self.norm_first, self.adaptive, self.has_cross = norm_first, adaptive, cross
        norm_cls = AdaptiveLayerNorm if adaptive else nn.LayerNorm
        self.self_attn = MultiHeadAttention(dim, nhead, dropout)
        self.norm1 = norm_cls(dim)
        if cross:
            self.cross_attn = MultiHeadAttention(dim, nhead, dropout, cross=True)
            self.norm2 = norm_cls(dim)
        self.linear1 = nn.Linear(dim, ff_mult * dim)
        self.linear2 = nn.Linear(ff_mult * dim, dim)
        self.norm3 = norm_cls(dim)
        self.dropout = nn.Dropout(dropout)

    def _norm(self, norm: nn.Module, x: torch.Tensor, cond: torch.Tensor | None) -> torch.Tensor:
        return norm(x, cond) if self.adaptive else norm(x)

    def _ff(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.dropout(F.relu(self.linear1(x))))

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        cond: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        probe: AttentionProbe | None = None,
    ) -> torch.Tensor:
        """``probe`` records the scores of the attention that sees the text (the
        cross-attention when there is one, else the self-attention)."""
        drop = self.dropout
        self_probe = None if self.has_cross else probe
        cross_probe = probe if self.has_cross else None
        if self.norm_first:
            h = self._norm(self.norm1, x, cond)
            x = x + drop(self.self_attn(h, mask, cache=cache, probe=self_probe))
            if self.has_cross:
                h = self._norm(self.norm2, x, cond)
                x = x + drop(
                    self.cross_attn(
                        h, memory_mask, memory=memory, cache=cache, probe=cross_probe
                    )
                )
            return x + drop(self._ff(self._norm(self.norm3, x, cond)))
        x = self._norm(
            self.norm1, x + drop(self.self_attn(x, mask, cache=cache, probe=self_probe)), cond
        )
        if self.has_cross:
            attended = self.cross_attn(
                x, memory_mask, memory=memory, cache=cache, probe=cross_probe
            )
            x = self._norm(self.norm2, x + drop(attended), cond)
        return self._norm(self.norm3, x + drop(self._ff(x)), cond)


class TransformerStack(nn.Module):
    """Layers plus a final norm when pre-norm (the residual stream is otherwise unnormalised)."""

    def __init__(
        self,
        num_layers: int,
        dim: int,
        nhead: int,
        dropout: float,
        norm_first: bool,
        adaptive: bool = False,
        cross: bool = False,
    ):
        super().__init__()
        self.adaptive = adaptive
        # Set by the trainer (--activation-checkpointing); not part of the architecture.
        self.activation_checkpointing = False
        self.layers = nn.ModuleList(
            TransformerLayer(dim, nhead, dropout, norm_first, adaptive, cross)
            for _ in range(num_layers)
        )
        self.final_norm: nn.Module | None = None
        if norm_first:
            self.final_norm = AdaptiveLayerNorm(dim) if adaptive else nn.LayerNorm(dim)

    def new_caches(self, max_len: int, cursor: torch.Tensor | None = None,
                   fixed_shape: bool = True) -> list[LayerCache]:
        """One cache per layer; with ``cursor``, static ones that all write at it."""
        return [LayerCache(max_len, cursor, fixed_shape) for _ in self.layers]

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        cond: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        caches: list[LayerCache] | None = None,
        probe: AttentionProbe | None = None,
        probe_last: int = 0,
    ) -> torch.Tensor:
        """``probe`` with ``probe_last`` = n: the last n layers record their text-attention
        scores into it (see TransformerLayer.forward)."""
        first_probed = len(self.layers) - probe_last
        if self._recompute(caches, probe):
            for layer in self.layers:
                x = checkpoint(layer, x, mask, cond, memory, memory_mask, None, use_reentrant=False)
            return self._final(x, cond)
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, cond, memory, memory_mask, None if caches is None else caches[i],
                      probe=probe if i >= first_probed else None)  # fmt: skip
        return self._final(x, cond)

    def _recompute(self, caches: list[LayerCache] | None, probe: AttentionProbe | None) -> bool:
        """Activation checkpointing applies to training forwards only (no cache, no probe):
        each layer keeps its input and recomputes the rest in backward. torch's checkpoint
        (use_reentrant=False) restores the RNG state, so dropout replays the same masks."""
        return (self.activation_checkpointing and self.training and torch.is_grad_enabled()
                and caches is None and probe is None)

    def _final(self, x: torch.Tensor, cond: torch.Tensor | None) -> torch.Tensor:
        if self.final_norm is not None:
            x = self.final_norm(x, cond) if self.adaptive else self.final_norm(x)
        return x


def set_activation_checkpointing(model: nn.Module, on: bool) -> None:
    """Every decoder stack of `model` recomputes its layers in backward (or stops to)."""
    for module in model.modules():
        if isinstance(module, TransformerStack):
            module.activation_checkpointing = on


def prefix_causal_mask(key_valid: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """(B, 1, L, L) mask for [prefix; sequence] with key padding.

    Query q may see key k when k is a valid key and either k is in the prefix
    (columns < prefix_len, the text) or k <= q. So the prefix attends within itself
    only (it has no column beyond prefix_len - 1 to see) and the rest is causal.
    Every query also sees itself, so a padded query never has an empty row (SDPA
    would return NaN); padded queries are never keys of valid ones.
    prefix_len = 0 gives a plain causal mask.
    """
    length = key_valid.shape[1]
    idx = torch.arange(length, device=key_valid.device)
    structure = (idx[None, :] < prefix_len) | (idx[None, :] <= idx[:, None])  # (L, L) [q, k]
    eye = idx[None, :] == idx[:, None]
    return ((structure & key_valid[:, None, :]) | eye).unsqueeze(1)


def key_padding_mask(key_valid: torch.Tensor) -> torch.Tensor:
    """(B, 1, 1, L): every query may see every valid key."""
    return key_valid[:, None, None, :]
