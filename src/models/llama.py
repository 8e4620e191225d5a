"""The Llama-family decoder (Llama 2/3, SmolLM, TinyLlama, Mistral, Qwen2/2.5, Qwen3) in one file.

Config flags select the differences: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3),
tied embeddings, llama3 RoPE scaling. Module names follow Hugging Face's, so LoRA targets and
PEFT keys line up: `model.layers.N.self_attn.q_proj`, `model.layers.N.mlp.down_proj`, `lm_head`.
"""
import numpy as np

from .. import kernels, ops
from ..autodiff import is_recording, plain, plain_arrays
from ..nn import Module, PackedLinear
from ..ops import checkpoint, head_cross_entropy
from ..tensor import Tensor
from .config import rope_frequencies


class Attention(Module):
    def __init__(self, cfg, q_proj, k_proj, v_proj, o_proj, q_norm=None, k_norm=None):
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def forward(self, x, cos, sin, cache=None, segments=None):
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.n_heads, self.head_dim)  # (B, T, H, D)
        k = self.k_proj(x).reshape(b, t, self.n_kv, self.head_dim)  # (B, T, Hkv, D)
        v = self.v_proj(x).reshape(b, t, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
        key_valid = None
        if cache is not None:
            k, v = cache.append(k, v)
            key_valid = cache.key_valid(k.shape[1])
        out = ops.attention(q, k, v, key_valid=key_valid, segments=segments)  # (B, T, H, D)
        return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))


class MLP(Module):
    def __init__(self, gate_proj, up_proj, down_proj):
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x, value=True):
        """value=False: the down projection records its op but skips its product (see
        DecoderLayer.recompute)."""
        return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)), value=value)


class DecoderLayer(Module):
    def __init__(self, input_layernorm, self_attn, post_attention_layernorm, mlp):
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp

    def forward(self, h, cos, sin, cache=None, segments=None, value=True):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, segments)
        return h + self.mlp(self.post_attention_layernorm(h), value)

    def recompute(self, h, cos, sin, cache=None, segments=None):
        """forward as gradient checkpointing re-runs it in backward: only the tape is used
        there, never the block's output, so the MLP's down projection (a quarter of a SmolLM2
        layer's forward products, a fifth of a 7B layer's) is not computed again."""
        return self.forward(h, cos, sin, cache, segments, value=False)


class Backbone(Module):
    def __init__(self, embed_tokens, layers, norm):
        self.embed_tokens = embed_tokens
        self.layers = layers
        self.norm = norm


class LlamaForCausalLM(Module):
    """`model(input_ids)` -> logits (B, T, V); `model.loss(input_ids, labels)` -> scalar."""

    def __init__(self, cfg, backbone, lm_head, device, tokenizer=None, source=""):
        self.config = cfg
        self.model = backbone
        self.lm_head = lm_head  # a Linear/PackedLinear, or None when tied to the embedding
        self.device = device
        self.tokenizer = tokenizer
        self.source = str(source)
        self.grad_checkpointing = False
        self._inv_freq = rope_frequencies(cfg)  # (D/2,) float64

    # -- pieces ------------------------------------------------------------------------------
    def rope_tables(self, start, t, positions=None):
        """cos, sin (T, D/2) of positions start..start+T-1, or (B, T, D/2) of `positions`
        (B, T) when each row has its own (packed rows)."""
        pos = np.arange(start, start + t, dtype=np.float64) if positions is None else \
            np.asarray(positions, dtype=np.float64)
        ang = pos[..., None] * self._inv_freq  # (T, D/2) or (B, T, D/2)
        xp = self.device.xp
        return (xp.asarray(np.cos(ang), dtype=np.float32),
                xp.asarray(np.sin(ang), dtype=np.float32))

    @property
    def head_weight(self):
        """The LM head's weight: its own, or the tied embedding table (Tensor or PackedWeight)."""
        if self.lm_head is None:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def hidden_states(self, input_ids, cache=None, segments=None):
        """Final-norm hidden states (B, T, D) for integer ids (B, T). segments (B, T) int, for
        packed rows: each example attends only to itself and its positions restart at 0."""
        ids = np.asarray(input_ids) if not hasattr(input_ids, "shape") else input_ids
        if isinstance(ids, Tensor):
            ids = ids.data
        b, t = ids.shape
        start = cache.length if cache is not None else 0
        if segments is not None:
            segments = self.device.xp.asarray(segments)
        cos, sin = self.rope_tables(start, t, None if segments is None else
                                    segment_positions(segments))
        h = self.model.embed_tokens(ids, self.device)
        for i, layer in enumerate(self.model.layers):
            layer_cache = cache.layer(i) if cache is not None else None
            if self.grad_checkpointing and cache is None:
                h = checkpoint(layer, h, cos, sin, None, segments, recompute=layer.recompute)
            else:
                h = layer(h, cos, sin, layer_cache, segments)
        if cache is not None:
            cache.advance(t)
        return self.model.norm(h)

    def forward(self, input_ids, cache=None):
        return self.logits(self.hidden_states(input_ids, cache))

    def logits(self, h):
        """LM head on hidden states (..., D) -> (..., V)."""
        if self.lm_head is not None:
            return self.lm_head(h)
        head = self.model.embed_tokens
        if head.packed:
            return PackedLinear(head.weight)(h)
        return h @ head.weight.T

    def next_logits(self, input_ids, cache):
        """Logits (B, V) of the last position only, extending the KV cache. One new position
        with nothing recorded (decoding) runs on plain arrays (autodiff.plain_arrays). The head
        keeps float32 x even where generation rounds it to 8 bits (kernels/activations.py): its
        error lands on the logits unmixed and flips near-ties (SmolLM2's first answer token:
        "The" 25.33 vs "L" 25.24 turned over)."""
        shape = input_ids.shape if hasattr(input_ids, "shape") else np.shape(input_ids)
        if shape[1] != 1 or (self.device.is_autodiff() and is_recording()):
            return self._next_logits(input_ids, cache)
        with plain_arrays(self.device):
            return Tensor(self._next_logits(input_ids, cache), self.device)

    def _next_logits(self, input_ids, cache):
        h = self.hidden_states(input_ids, cache)
        with kernels.int8_activations(False):
            return self.logits(h[:, -1])

    def loss(self, input_ids, labels, ignore_index=-100, chunk=256):
        """Mean next-token cross-entropy with Hugging Face's convention: labels are aligned with
        input_ids (-100 where masked) and position t predicts labels[t + 1]."""
        xp = self.device.xp
        lab = labels.data if isinstance(labels, Tensor) else xp.asarray(labels)
        ids = input_ids.data if isinstance(input_ids, Tensor) else xp.asarray(input_ids)
        return self.target_loss(ids[:, :-1], lab[:, 1:], ignore_index, chunk)

    def target_loss(self, input_ids, targets, ignore_index=-100, chunk=256, segments=None):
        """Mean cross-entropy where targets[b, t] is the token that should follow position t
        (already shifted, as the data pipeline makes them). The LM head runs fused with the
        loss in row chunks, so the full logits never exist. segments: see hidden_states."""
        xp = self.device.xp
        tgt = targets.data if isinstance(targets, Tensor) else xp.asarray(targets)
        h = self.hidden_states(input_ids, segments=segments)
        b, t, d = h.shape
        return head_cross_entropy(h.reshape(b * t, d), self.head_weight, tgt.reshape(-1),
                                  ignore_index, chunk)

    def trainable_parameters(self):
        """Number of parameters that require grad."""
        return int(sum(p.size for _, p in self.trainable()))

    def num_parameters(self):
        """Logical parameter count of the whole model (packed weights counted by shape)."""
        total = 0
        for _, mod in self.named_modules():
            for value in vars(mod).values():
                if isinstance(value, Tensor):
                    total += value.size
                elif hasattr(value, "dequantize") and hasattr(value, "shape"):
                    total += int(np.prod(value.shape))
        return total


def segment_positions(segments):
    """(B, T) positions that restart at 0 where each packed example (a run of equal segment
    ids) begins, as a host array."""
    seg = np.asarray(segments.get() if hasattr(segments, "get") else segments)
    b, t = seg.shape
    index = np.broadcast_to(np.arange(t), (b, t))
    begins = np.ones((b, t), dtype=bool)
    begins[:, 1:] = seg[:, 1:] != seg[:, :-1]
    return index - np.maximum.accumulate(np.where(begins, index, 0), axis=1)


class KVCache:
    """Preallocated keys and values per layer (B, S_max, Hkv, D), tracked as `kv_cache`.
    `pad` (B,) counts left-padding positions of each row; those keys are masked."""

    def __init__(self, cfg, device, batch, max_len, pad=None):
        xp, mem = device.xp, device.memory
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = [mem.track(xp.zeros(shape, np.float32), "kv_cache") for _ in range(cfg.num_layers)]
        self.v = [mem.track(xp.zeros(shape, np.float32), "kv_cache") for _ in range(cfg.num_layers)]
        self.length, self.max_len, self.device = 0, max_len, device
        self.pad = None if pad is None or not np.any(pad) else xp.asarray(pad)

    def key_valid(self, s):
        """(B, S) bool of real keys, or None when no row is padded."""
        if self.pad is None:
            return None
        return self.device.xp.arange(s)[None, :] >= self.pad[:, None]

    def layer(self, i):
        return _LayerCache(self, i)

    def advance(self, t):
        self.length += t


class _LayerCache:
    def __init__(self, cache, i):
        self.cache, self.i = cache, i

    def key_valid(self, s):
        return self.cache.key_valid(s)

    def append(self, k, v):
        c, i = self.cache, self.i
        s0, t = c.length, k.shape[1]
        if s0 + t > c.max_len:
            raise ValueError(f"KV cache full: {s0 + t} positions > {c.max_len}")
        c.k[i][:, s0:s0 + t] = plain(k)
        c.v[i][:, s0:s0 + t] = plain(v)
        keys, values = c.k[i][:, :s0 + t], c.v[i][:, :s0 + t]
        if not isinstance(k, Tensor):  # plain arrays in, plain views out
            return keys, values
        return Tensor(keys, k.device), Tensor(values, k.device)
