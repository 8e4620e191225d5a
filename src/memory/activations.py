"""Activation memory of a training step, from the ops' saved arrays and the tape's references.

A symbolic run of the decoder: every op output is a buffer; a recorded op holds what it saves
until its backward runs (the tape links ops, not input data). Buffers nobody holds are freed at
once. Backward walks blocks from the last to the first, so a buffer lives until the
block of its earliest holder is done. Follows src/models/llama.py and the ops it calls
(tests/test_activation_tape.py compares it with a real tape, block by block):
RMSNorm saves r (rows,); RoPE keeps only the cos/sin tables; Attention saves grouped q, contiguous
k and v, the output and the row log-sum-exp (its mask applies per block); LoraMatmul
saves x (a view; none when SwiGLU made x, which remakes it, but in a checkpoint's recompute),
x·Aᵀ and, with dropout, its mask and dropped input; PackedMatmul saves nothing.
"""
F32 = 4


class Buf:
    __slots__ = ("nbytes", "tracked", "holder", "saved")

    def __init__(self, nbytes, tracked=True):
        self.nbytes, self.tracked, self.holder = int(nbytes), tracked, None
        self.saved = False  # some backward reads it (else only the tape's parent link keeps it)


class Val:
    """An op result: its buffer and whether it is on the tape."""

    __slots__ = ("buf", "tracked")

    def __init__(self, buf, tracked):
        self.buf, self.tracked = buf, tracked


class Graph:
    """Buffers of one symbolic forward; `layer` tags who holds what."""

    def __init__(self):
        self.bufs, self.layer = [], -1

    def new(self, nbytes, tracked=True):
        b = Buf(nbytes, tracked)
        self.bufs.append(b)
        return b

    def op(self, inputs, out, saves=(), record=None):
        rec = any(v.tracked for v in inputs) if record is None else record
        if rec:  # the tape keeps only what an op saves (parents are nodes, not data)
            for b in saves:
                b.holder = self.layer if b.holder is None else min(b.holder, self.layer)
                b.saved = True
        return Val(out, rec)

    def parent_only(self):
        """Held bytes no backward reads: kept alive only as parent Tensors of the tape."""
        return sum(b.nbytes for b in self.bufs if b.holder is not None and not b.saved)

    def held(self, upto=None, tracked=True):
        """Bytes held by ops of blocks <= upto (all when None); tracker-visible ones only."""
        return sum(b.nbytes for b in self.bufs if b.holder is not None and b.tracked == tracked
                   and (upto is None or b.holder <= upto))


class BlockModel:
    """The decoder's ops on symbolic buffers, for a PlanInputs."""

    def __init__(self, inputs):
        self.inp, self.cfg = inputs, inputs.model
        self.B, self.T = inputs.batch, inputs.seq
        self.M = self.B * self.T
        self.calls = set()  # (linear path, whether its backward computes dx)

    # -- ops ------------------------------------------------------------------------------------
    def rmsnorm(self, g, x, rows, dim):
        return g.op([x], g.new(rows * dim * F32), [x.buf, g.new(rows * F32)])  # x, r

    def reshape(self, g, x):
        return g.op([x], x.buf)

    def linear(self, g, x, path, remade=False):
        """remade: x's producer can remake it (SwiGLU), so a LoRA without dropout keeps none."""
        inp, M = self.inp, self.M
        n, k = inp.linears[path].shape
        ad = inp.adapters.get(path)
        self.calls.add((path, x.tracked))
        if ad is not None:
            saves = [] if remade else [x.buf]
            if ad.dropout > 0:
                saves = [g.new(M * k * F32), g.new(M * k)]  # dropped x, keep-mask (bool)
            saves.append(g.new(M * ad.rank * F32))  # x @ A.T
            if ad.dora:
                saves.append(g.new(M * n * F32))  # `pre` (W x' + s B A x'), tracked on the op
            return g.op([x], g.new(M * n * F32), saves, record=True)
        y = g.op([x], g.new(M * n * F32))
        if not inp.linears[path].packed and f"{path}.bias" in inp.others:
            y = g.op([y], g.new(M * n * F32))  # y + bias as its own node
        return y

    def attention(self, g, q, k, v):
        c = self.cfg
        B, T, M = self.B, self.T, self.M
        h, hkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        copy_q, copy_kv = T > 1 and h > 1, T > 1 and hkv > 1
        qg = g.new(M * h * hd * F32) if copy_q else q.buf
        kc = g.new(M * hkv * hd * F32) if copy_kv else k.buf
        vv = g.new(M * hkv * hd * F32) if copy_kv else v.buf
        og = g.new(M * h * hd * F32)
        lse = g.new(B * h * T * F32)
        # the mask applies per block of scores (ops/attention.py): nothing T x T is kept
        out = g.op([q, k, v], og, [qg, kc, vv, og, lse])  # a (B, T, H, D) view of og
        # the block's reshape to (B, T, H*D) copies that strided view
        return g.op([out], g.new(M * h * hd * F32)) if copy_q else out

    def add(self, g, a, b):
        return g.op([a, b], g.new(self.M * self.cfg.hidden_size * F32))

    # -- one decoder block ----------------------------------------------------------------------
    def block(self, g, i, h, remake=True):
        """remake: SwiGLU's output is remade, not kept (off in a checkpoint's recompute)."""
        c, M = self.cfg, self.M
        d, hd = c.hidden_size, c.head_dim
        p = f"model.layers.{i}."
        n1 = self.rmsnorm(g, h, M, d)
        q = self.reshape(g, self.linear(g, n1, p + "self_attn.q_proj"))
        k = self.reshape(g, self.linear(g, n1, p + "self_attn.k_proj"))
        v = self.reshape(g, self.linear(g, n1, p + "self_attn.v_proj"))
        if c.qk_norm:
            q = self.rmsnorm(g, q, M * c.num_heads, hd)
            k = self.rmsnorm(g, k, M * c.num_kv_heads, hd)
        q = g.op([q], g.new(M * c.num_heads * hd * F32))  # rope (keeps only cos/sin)
        k = g.op([k], g.new(M * c.num_kv_heads * hd * F32))
        o = self.attention(g, q, k, v)
        h1 = self.add(g, h, self.linear(g, o, p + "self_attn.o_proj"))
        n2 = self.rmsnorm(g, h1, M, d)
        gate = self.linear(g, n2, p + "mlp.gate_proj")
        up = self.linear(g, n2, p + "mlp.up_proj")
        act = g.op([gate, up], g.new(M * c.intermediate_size * F32), [gate.buf, up.buf])
        return self.add(g, h1, self.linear(g, act, p + "mlp.down_proj",
                                           remade=remake and act.tracked))

    def head(self, g, h):
        g.layer = self.cfg.num_layers
        nf = self.reshape(g, self.rmsnorm(g, h, self.M, self.cfg.hidden_size))
        # head + loss saves dh (the input's gradient, computed in the forward) and the targets
        return g.op([nf], g.new(F32), [g.new(self.M * self.cfg.hidden_size * F32)])

    # -- whole forward ----------------------------------------------------------------------------
    def forward(self, checkpointing):
        """The outer graph of one forward; with checkpointing each block is one node."""
        g = Graph()
        md = self.M * self.cfg.hidden_size * F32
        h = Val(g.new(md), False)  # embedding output
        for i in range(self.cfg.num_layers):
            g.layer = i
            if checkpointing:
                h = g.op([h], g.new(md), [h.buf], record=True)
            else:
                h = self.block(g, i, h)
        self.head(g, h)
        return g

    def block_held(self, i, input_tracked, remake=True, parent_only=False):
        """Tracked bytes block i keeps for its backward (its input excluded, output included)
        and untracked bytes kept on its ops (or, with parent_only, the bytes only the tape's
        parent links keep). remake=False: as a checkpoint's recompute runs it."""
        g = Graph()
        g.layer = i
        x = Val(Buf(0), input_tracked)
        out = self.block(g, i, x, remake=remake)
        if parent_only:
            return g.parent_only()
        return g.held() + out.buf.nbytes, g.held(tracked=False)

    def recompute(self, i, input_tracked, parent_only=False):
        """block_held of block i re-run with recording by its checkpoint in backward."""
        return self.block_held(i, input_tracked, False, parent_only)
