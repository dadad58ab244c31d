"""
nanomixer: masked mixers and their baselines, in one file.

A masked mixer is a transformer whose attention is replaced by a learned n_ctx x n_ctx
linear mixing over positions, lower-triangular masked so that position t only reads
positions <= t (Badger, "Masked Mixers for Language Generation and Retrieval").

Conventions shared by every model in this file
- idx: LongTensor (B, T) of token ids, T <= n_ctx.
- targets: LongTensor shaped like logits[..., 0]; targets[b, t] is the token logits[b, t]
  should predict, -1 means "no loss here". The data loader does the shift (nanoGPT's
  convention); `objective_targets` builds targets for the non-CLM objectives.
- mask: optional BoolTensor (B, T), True on real tokens, False on padding. Attention uses it
  as a key-padding mask; masked mixers ignore it, as in the paper (with right padding a pad
  can only reach positions after it; with left padding the pads are mixed in like tokens).
- Every language model returns (logits, loss): logits (B, T, vocab_size), loss a scalar or
  None. `model.hidden(idx)` returns the last hidden states (B, T, d_model) for retrieval.
"""
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

# max-autotune writes a table of timings per tuned op to stderr as it compiles: off, unless
# asked for with inductor's own TORCHINDUCTOR_AUTOTUNE_NUM_CHOICES_DISPLAYED or
# TORCHINDUCTOR_MAX_AUTOTUNE_REPORT_CHOICES_STATS
QUIET_AUTOTUNE = {key: value for key, value, env in [
    ('autotune_num_choices_displayed', 0, 'TORCHINDUCTOR_AUTOTUNE_NUM_CHOICES_DISPLAYED'),
    ('max_autotune_report_choices_stats', False, 'TORCHINDUCTOR_MAX_AUTOTUNE_REPORT_CHOICES_STATS')]
    if env not in os.environ}

ARCHS = ('mixer', 'llama', 'gpt', 'hybrid', 'gmlp', 'elita')
OBJECTIVES = ('clm', 'autoencoder', 'bidirectional', 'mtp2', 'half')
POS_CHANNELS = ('none', 'input', 'every')
HYBRID_ORDERS = ('attn_mix', 'mix_attn', 'parallel')
ELITA_CHUNK = 64  # positions per block of ELiTA's parallel scan


@dataclass
class ModelConfig:
    arch: str = 'mixer'        # mixer | llama | gpt | hybrid | gmlp | elita
    vocab_size: int = 4096
    n_ctx: int = 512           # context window; mixers have position-specific weights, so fixed
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 0           # 0 = the arch's default: 4 attention heads (paper's optimum), 1 mixer head
    kernel: int = 1            # mixer Conv1d kernel, sliding along d_model (paper 9.2)
    expansion: float = 0.0     # 0 = flat mixer; e > 0 = original n -> e*n -> n mixing with GELU
    n_convs: int = 1           # p > 1: p parallel masked mixings, each with its own bias and GELU, summed
    softmax: bool = False      # row softmax over the allowed positions of each mixing
    pos_emb: bool = False      # learned absolute positions (mixer ablation; GPT always has them)
    pos_channel: str = 'none'  # none | input | every: blog's ablation, an appended position channel
    hybrid_order: str = 'attn_mix'  # hybrid: attn_mix (attention, then mixing) | mix_attn | parallel
    share_ffn: Optional[bool] = None  # bidirectional: streams share feed-forwards; None: per arch
    causal: bool = True        # False = unmasked, bidirectional mixing/attention
    tie_weights: bool = False  # lm_head shares the token embedding
    objective: str = 'clm'     # clm | autoencoder | bidirectional | mtp2 | half

    def __post_init__(self):
        if self.n_heads == 0:
            self.n_heads = 4 if self.arch in ('llama', 'gpt', 'hybrid', 'elita') else 1
        if self.arch == 'gpt':
            self.pos_emb = True  # GPT-1 learns absolute positions; this is not optional for it
        for name, allowed in (('arch', ARCHS), ('objective', OBJECTIVES), ('pos_channel', POS_CHANNELS),
                              ('hybrid_order', HYBRID_ORDERS)):
            self.require(name, getattr(self, name) in allowed, f"use one of {', '.join(allowed)}")
        for name in ('vocab_size', 'n_ctx', 'd_model', 'n_layers', 'n_heads', 'kernel', 'n_convs'):
            value = getattr(self, name)
            self.require(name, isinstance(value, int) and value >= 1, "must be a positive integer")
        e, two_streams, mixing = self.expansion, self.objective == 'bidirectional', self.arch in ('mixer', 'hybrid')
        if self.share_ffn is None:  # as the author: his bidirectional mixer shares, his llama is
            self.share_ffn = not (two_streams and self.arch == 'llama')  # two stacks; else True
        for name, ok, fix in [  # every rule: (field, holds, what to do instead)
            ('hybrid_order', self.hybrid_order == 'attn_mix' or self.arch == 'hybrid', "only arch hybrid has one"),
            ('share_ffn', isinstance(self.share_ffn, bool) and (self.share_ffn or two_streams),
             "is None (per arch), True or False; only objective bidirectional has two streams"),
            ('n_heads', self.d_model % self.n_heads == 0, f"must divide d_model={self.d_model}"),
            ('n_heads', self.arch not in ('llama', 'hybrid') or self.d_model // self.n_heads % 2 == 0,
             "RoPE needs an even head size d_model // n_heads"),
            ('n_heads', self.arch != 'gmlp' or self.n_heads == 1, "gmlp has one spatial projection: use 0 or 1"),
            ('pos_channel', self.pos_channel == 'none' or (self.arch, self.n_heads) == ('mixer', 1),
             "blocks of width d_model + 1 are defined for a one-head mixer: use pos_channel=none"),
            ('arch', mixing or (self.kernel, e, self.n_convs, self.softmax) == (1, 0, 1, False),
             "kernel, expansion, n_convs and softmax are masked-mixer variants: use arch mixer or hybrid"),
            ('kernel', self.kernel <= self.d_model // (self.n_heads if self.arch == 'mixer' else 1),
             "must not exceed the channels it slides along (d_model // n_heads)"),
            ('expansion', e == 0 or (e > 0 and int(e * self.n_ctx) >= 1), "use 0 (flat) or e > 0, e * n_ctx >= 1"),
            ('expansion', e == 0 or (self.causal and not two_streams), "the expanded mixing is defined for tril only"),
            ('n_convs', e == 0 or self.n_convs == 1, "parallel mixings are a flat-mixer variant: use expansion=0"),
            ('causal', self.causal or (self.arch != 'elita' and self.objective == 'clm'),
             "causal=False is for clm-style encoders of arch mixer/llama/gpt/hybrid/gmlp"),
            ('objective', self.objective not in ('autoencoder', 'bidirectional') or self.arch in ('mixer', 'llama'),
             f"{self.objective} is built from mixer or llama blocks: use arch mixer or llama"),
            ('softmax', not (two_streams and self.softmax), "the reverse stream's last rows have nothing to normalise"),
            ('n_layers', self.objective != 'half' or (self.n_layers >= 2 and self.n_ctx >= 2),
             "half-sequence prediction needs n_layers >= 2 (encoder + decoder halves)"),
        ]:
            self.require(name, ok, fix)

    @property
    def width(self):
        """Channels the blocks run at: d_model, + 1 for pos_channel's appended channel."""
        return self.d_model + (self.pos_channel != 'none')

    def require(self, name, ok, fix):
        if not ok:
            raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} is invalid: {fix}")


# ----------------------------------------------------------------------------- the masked mixer

@dataclass
class Context:
    """What a sublayer needs besides x: where x sits in the window, padding, decoding state."""
    pos: int = 0                              # window position of x[:, 0]
    mask: Optional[torch.Tensor] = None       # (B, T) True on real tokens (attention only)
    cache: Optional[dict] = None              # per-module decoding state, keyed by module
    shared: Optional[dict] = None             # per-Mixing inputs of a shared pad prefix (Backbone.hidden)


def allowed_positions(direction, rows, cols, row0, device):
    """Bool (rows, cols): may output position row0 + i read input position j?"""
    ones = torch.ones(rows, cols, dtype=torch.bool, device=device)
    return {'causal': ones.tril(row0), 'reverse': ones.triu(row0 + 2)}.get(direction, ones)  # j <= t; j >= t + 2


class Mixing(nn.Module):
    """Masked linear mixing over positions, the heart of the masked mixer:

        out = tril(W) @ x + b      x (n_in, c): positions x channels, W (n_out, n_in), b (n_out, 1)

    out[t] = sum_{s<=t} W[t, s] x[s] + b[t]: a learned weight per pair of positions, the same for every
    channel. The mask is applied in forward, never to .data, so masked entries get exactly zero gradient.
    The weight is stored (n_convs, heads, kernel, n_out, n_in) for the variants, each a few lines below:
    heads, a W per group of channels; kernel > 1, the paper's Conv1d with positions as channels, sliding
    along the features; n_convs = p > 1, the blog's parallel mixer sum_i GELU(W_i x + b_i) (the GELUs make
    it more than one flat mixing); softmax, each row a distribution over its allowed positions."""

    def __init__(self, n_out, n_in, channels, heads=1, kernel=1, n_convs=1, softmax=False, direction='causal'):
        super().__init__()
        self.n_out, self.n_in, self.channels, self.heads = n_out, n_in, channels, heads
        self.kernel, self.softmax, self.direction = kernel, softmax, direction
        bound = 1 / math.sqrt(n_in * kernel)  # nn.Conv1d's default init, as the paper used
        self.weight = nn.Parameter(torch.empty(n_convs, heads, kernel, n_out, n_in).uniform_(-1, 1) * bound)
        self.bias = nn.Parameter(torch.empty(n_convs, heads, n_out, 1).uniform_(-bound, bound))

    def matrix(self, row0, rows, cols):
        """Masked weights (n_convs, heads, kernel, rows, cols): outputs [row0, row0 + rows), inputs [0, cols)."""
        w = self.weight[..., row0:row0 + rows, :cols]
        if self.softmax:  # mask with -inf *before* the softmax, so the future gets no weight
            keep = allowed_positions(self.direction, rows, cols, row0, w.device)
            return w.masked_fill(~keep, float('-inf')).softmax(dim=-1)
        if self.direction == 'causal':
            return w.tril(row0)       # <- causality lives here: output t reads only inputs s <= t
        if self.direction == 'reverse':
            return w.triu(row0 + 2)   # bidirectional LM's reverse stream: inputs s >= t + 2
        return w

    def mix(self, x, row0, rows):
        """Outputs (B, H, rows, c) at positions [row0, row0 + rows) from inputs x (B, H, T, c) at [0, T)."""
        if rows == 0:  # an e < 1 expanded mixing has no hidden rows past e * n_ctx
            return x.new_zeros(x.shape[0], self.heads, 0, self.channels)
        w, b = self.matrix(row0, rows, x.shape[2]), self.bias[..., row0:row0 + rows, :]  # (P, H, k, R, T), (P, H, R, 1)
        if self.kernel == 1 and len(w) == 1:  # the flat mixer, per head:
            return w[0, :, 0] @ x + b[0]      # out = tril(W) @ x + b
        if self.kernel == 1:  # each parallel mixing m (H, 1, R, T), bias (H, R, 1)
            ys = [m[:, 0] @ x + bias for m, bias in zip(w, b)]
        else:  # grouped Conv1d: positions are channels, the kernel slides along c ('same' size)
            x = F.pad(rearrange(x, 'b h s c -> b (h s) c'), ((self.kernel - 1) // 2, self.kernel // 2))
            ys = [rearrange(F.conv1d(x, rearrange(m, 'h k r s -> (h r) s k'), groups=self.heads),
                            'b (h r) c -> b h r c', h=self.heads) + bias for m, bias in zip(w, b)]
        return ys[0] if len(ys) == 1 else sum(F.gelu(y) for y in ys)

    def forward(self, x, ctx, t_new):
        """x (B, H, T_in, c): inputs at window positions [pos, pos + T_in) -> the outputs at [pos, pos + t_new)
        that exist (rows < n_out). Earlier inputs come from ctx.cache (decoding) or ctx.shared (a pad prefix)."""
        p0, t_in = ctx.pos, x.shape[2]
        if ctx.shared is not None:  # Backbone.hidden: positions < p0 are one batch-1 pass, read by every row
            if p0 == 0:
                ctx.shared[self] = x
            else:  # cat, not the cache's in-place writes: gradients flow back into the shared rows
                x = torch.cat([ctx.shared[self].expand(x.shape[0], -1, -1, -1), x], dim=2)
        elif ctx.cache is not None:
            buf = ctx.cache.get(self)
            if buf is None or p0 == 0:
                buf = ctx.cache[self] = x.new_zeros(x.shape[0], self.heads, self.n_in, self.channels)
            if t_in == t_new == 1 and self.kernel == 1 and self.weight.shape[0] == 1 and p0 < self.n_out \
                    and self.direction == 'causal':
                return self.step(x, p0, buf)
            buf[:, :, p0:p0 + t_in] = x
            x = buf[:, :, :p0 + t_in]
        elif p0 != 0:
            raise ValueError("Mixing without a cache must start at window position 0")
        return self.mix(x, p0, max(0, min(self.n_out, p0 + t_new) - p0))

    def step(self, x, p0, buf):
        """One decoding step, x (B, H, 1, c) at position p0 < n_in, n_out (kernel 1, one mixing): row p0
        reads the cached inputs s <= p0, all of which the causal mask allows, so nothing is masked."""
        buf[:, :, p0:p0 + 1] = x
        w = self.weight[0, :, 0, p0:p0 + 1, :p0 + 1]               # (H, 1, p0 + 1)
        w = w.softmax(dim=-1) if self.softmax else w
        return torch.matmul(w, buf[:, :, :p0 + 1]) + self.bias[0, :, p0:p0 + 1]  # (B, H, 1, c)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        bias = state_dict.get(prefix + 'bias')
        if bias is not None and bias.dim() == 3:  # a checkpoint from before per-mixing biases (one mixing)
            state_dict[prefix + 'bias'] = bias[None]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class TokenMixing(nn.Module):
    """The masked mixer's replacement for attention: flat, expanded, parallel or multi-head."""

    def __init__(self, cfg, direction):
        super().__init__()
        d, n = cfg.width, cfg.n_ctx
        self.heads = cfg.n_heads if cfg.arch == 'mixer' else 1  # hybrid: heads belong to attention
        kw = dict(channels=d // self.heads, heads=self.heads, kernel=cfg.kernel, n_convs=cfg.n_convs,
                  softmax=cfg.softmax, direction=direction)
        # fig S6: per-head input projections, a mixing per head, concat, output projection
        self.proj_in = nn.Linear(d, d) if self.heads > 1 else nn.Identity()
        self.proj_out = nn.Linear(d, d) if self.heads > 1 else nn.Identity()
        m = int(cfg.expansion * n) if cfg.expansion else n  # expanded: the MLP-mixer's n -> e*n -> n, both tril
        self.mix = Mixing(m, n, **kw)
        self.mix2 = Mixing(n, m, **kw) if cfg.expansion else None

    def forward(self, x, ctx):  # (B, T, d) -> (B, T, d)
        t_new = x.shape[1]  # (B, T, H * c) -> (B, H, T, c) as a view (einops costs ~20 us a call)
        x = self.mix(self.proj_in(x).reshape(*x.shape[:-1], self.heads, -1).transpose(1, 2), ctx, t_new)
        if self.mix2 is not None:  # e > 1: hidden rows >= n_ctx are never read under the mask
            x = self.mix2(F.gelu(x), ctx, t_new)
        return self.proj_out(x.transpose(1, 2).flatten(2))


# ----------------------------------------------------------------------------- blocks and the language model

class MLP(nn.Module):
    """Position-wise d -> hidden -> d with GELU (the mixer's feed-forward; GPT-1's uses GELU's tanh form)."""

    def __init__(self, d, hidden, approximate='none'):
        super().__init__()
        self.fc, self.out = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.approximate = approximate

    def forward(self, x, ctx=None):
        return self.out(F.gelu(self.fc(x), approximate=self.approximate))


def norm_layer(cfg):
    w = cfg.width
    return nn.RMSNorm(w, eps=1e-6) if cfg.arch in ('llama', 'hybrid') else nn.LayerNorm(w)


class Block(nn.Module):
    """One residual block: a list of (norm, sublayer) pairs; pre-norm, except GPT-1's post-norm."""

    def __init__(self, cfg, direction):
        super().__init__()
        d, arch = cfg.width, cfg.arch  # d_model, + 1 with a position channel (pos_channel)
        if arch == 'mixer':
            layers = [TokenMixing(cfg, direction), MLP(d, 4 * d)]
        elif arch == 'llama':
            layers = [Attention(cfg, direction), SwiGLU(d, 4 * d)]
        elif arch == 'gpt':
            layers = [Attention(cfg, direction), MLP(d, 4 * d, approximate='tanh')]
        elif arch == 'hybrid':  # the blog's orderings; attn_mix (mixing right after attention) its best
            attn, mix = Attention(cfg, direction), TokenMixing(cfg, direction)
            orders = {'attn_mix': [attn, mix], 'mix_attn': [mix, attn], 'parallel': [Parallel([attn, mix])]}
            layers = orders[cfg.hybrid_order] + [SwiGLU(d, 4 * d)]
        elif arch == 'gmlp':
            layers = [GatedMLP(cfg, direction)]
        else:
            layers = [ELiTAAttention(cfg), ELiTAFeedForward(d)]
        self.layers = nn.ModuleList(layers)
        self.norms = nn.ModuleList(norm_layer(cfg) for _ in layers)
        self.post_norm = arch == 'gpt'

    def forward(self, x, ctx):  # (B, T, d) -> (B, T, d)
        for norm, layer in zip(self.norms, self.layers):
            x = norm(x + layer(x, ctx)) if self.post_norm else x + layer(norm(x), ctx)
        return x


class Backbone(nn.Module):
    """Token embedding (optional) -> positions (optional) -> blocks -> norm -> d_model channels"""

    def __init__(self, cfg, direction='causal', embed=True):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model) if embed else None
        self.wpe = nn.Embedding(cfg.n_ctx, cfg.d_model) if cfg.pos_emb else None
        self.blocks = nn.ModuleList(Block(cfg, direction) for _ in range(cfg.n_layers))
        self.norm = nn.Identity() if cfg.arch in ('mixer', 'gpt') else norm_layer(cfg)  # paper's mixer, GPT-1: none
        # hidden(keep) can skip pad columns exactly: causal mixings share them, RoPE attention drops them;
        # 'half' blanks from half the input's length on, which a shorter pass would move
        self.trims = embed and cfg.objective != 'half' and (
            cfg.arch == 'llama' or (cfg.arch in ('mixer', 'gmlp') and direction == 'causal'))

    def forward(self, x, ctx):  # idx (B, T) or embeddings (B, T, d_model) -> (B, T, d_model)
        if self.wte is not None:
            check_tokens(x, self.cfg, ctx.pos)
            x = self.wte(x)
        elif ctx.pos + x.shape[1] > self.cfg.n_ctx:
            raise ValueError(f"sequence of {x.shape[1]} positions exceeds n_ctx={self.cfg.n_ctx}")
        if self.wpe is not None:
            x = x + self.wpe.weight[ctx.pos:ctx.pos + x.shape[1]]
        pos = torch.arange(ctx.pos, ctx.pos + x.shape[1], device=x.device)
        if self.cfg.pos_channel != 'none':  # (B, T, d_model) -> (B, T, d_model + 1)
            x = torch.cat((x, self.centred(x, pos)), dim=-1)
        split = self.cfg.n_layers // 2 if self.cfg.objective == 'half' else -1
        for i, block in enumerate(self.blocks):
            if i == split:  # half-sequence prediction: the second half only sees the first half
                x = x * (pos < half_split(ctx.pos + x.shape[1]))[None, :, None]
            x = block(x, ctx)
            if self.cfg.pos_channel == 'every':
                x = torch.cat((x[..., :-1], self.centred(x, pos)), dim=-1)
        return self.norm(x)[..., :self.cfg.d_model]  # token channels only: the author's x[..., :-1]

    def centred(self, x, pos):
        """The blog's positional channel (B, T, 1): t - n_ctx/2, appended to the token channels."""
        return (pos - self.cfg.n_ctx // 2).to(x.dtype)[None, :, None].expand(x.shape[0], -1, 1)

    def hidden(self, idx, mask=None, keep=None):
        """Hidden states (B, T, d) of idx (B, T), or only the last `keep`, exactly and without spending rows on
        the first T - keep columns, which must be the same padding in every row. Causal mixers: pad-only
        positions read only pads, so one batch-1 pass computes them for every row. Llama: pad keys are masked
        and RoPE sees only relative positions, so pad columns are dropped. Other archs run the full window."""
        cut = 0 if keep is None else idx.shape[1] - keep
        if cut <= 0 or not self.trims or (mask is None and self.cfg.arch == 'llama'):
            return self(idx, Context(mask=mask))[:, max(cut, 0):]
        if (mask is not None and mask[:, :cut].any()) or not (idx[:, :cut] == idx[:1, :cut]).all():
            raise ValueError(f"hidden(keep={keep}): the first {cut} columns must be the same padding in every row")
        if self.cfg.arch == 'llama':
            return self(idx[:, cut:], Context(mask=None if mask is None else mask[:, cut:]))
        shared = {}
        self(idx[:1, :cut], Context(shared=shared))                     # (1, cut, d): the pad prefix, once
        return self(idx[:, cut:], Context(pos=cut, shared=shared))


def check_tokens(idx, cfg, pos=0):
    if idx.dim() != 2:
        raise ValueError(f"idx must be (B, T) token ids, got shape {tuple(idx.shape)}")
    if pos + idx.shape[1] > cfg.n_ctx:
        raise ValueError(f"sequence of {pos + idx.shape[1]} tokens exceeds n_ctx={cfg.n_ctx}: "
                         f"crop it or train with a larger n_ctx")
    checked = pos == 0 and not torch.compiler.is_compiling()  # decode steps feed sampled ids: no sync
    if checked and idx.numel() and (idx.min() < 0 or idx.max() >= cfg.vocab_size):
        raise ValueError(f"token ids must lie in [0, vocab_size={cfg.vocab_size}), got "
                         f"[{int(idx.min())}, {int(idx.max())}]")


def param_versions(model):
    """In-place writes to each parameter so far (optimizer steps, load_state_dict): tells a frozen graph is stale."""
    return [p._version for p in model.parameters()]


def add_lm_head(model, cfg, wte):
    """The lm head, then the init: transformers get the usual N(0, 0.02) (HF Llama / GPT-1); mixers
    keep PyTorch's defaults, as the paper did, and mixings their own."""
    model.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
    if cfg.arch in ('llama', 'gpt', 'hybrid'):
        for mod in model.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=0.02)
                if getattr(mod, 'bias', None) is not None:
                    nn.init.zeros_(mod.bias)
    if cfg.tie_weights:
        model.lm_head.weight = wte.weight


class LanguageModel(nn.Module):
    """A next-token model of any arch: Backbone + lm head (objectives clm, mtp2 and half)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.backbone = Backbone(cfg, 'causal' if cfg.causal else 'none')
        add_lm_head(self, cfg, self.backbone.wte)

    def hidden(self, idx, mask=None, keep=None):
        """Last hidden states (B, T, d_model), the lm head's input (keep: see Backbone.hidden)."""
        return self.backbone.hidden(idx, mask, keep)

    def forward(self, idx, targets=None, mask=None):
        logits = self.lm_head(self.hidden(idx, mask))
        loss = None
        if targets is not None:
            loss = lm_loss(logits, targets)
            if self.cfg.objective == 'mtp2':  # paper 5.2: a second pass on the model's own argmax
                logits2 = self.lm_head(self.hidden(logits.argmax(-1), mask))  # logits2[t] -> token t+2
                loss = loss + lm_loss(logits2[:, :-1], targets[:, 1:])
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, **kw):
        """idx (B, T0) -> (B, T0 + max_new_tokens). Keyword arguments as in `stream`."""
        new = [tok[:, None] for tok, _ in self.stream(idx, max_new_tokens, **kw)]
        return torch.cat([idx] + new, dim=1)

    @torch.no_grad()
    def stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
               method='cache', generator=None, compile=False):
        """Yield (token (B,), logits (B, vocab)) for each new token. method='window' is the paper's generation
        (§4.2): the whole n_ctx window runs again for each token, O(n^3 d) per window for a mixer. method='cache'
        keeps what each position contributed (mixer inputs, keys/values, ELiTA's running sums) and runs only the
        new position, O(n^2 d), the same numbers up to float rounding. A full window slides alike in both: its
        last n_ctx/2 tokens are re-encoded at the window start. compile=True runs the cached steps through
        torch.compile, one dynamic-shape graph for every position (seconds to a minute once; on CPU with the weights
        frozen in: see compile_step)."""
        cfg = self.cfg
        if cfg.objective == 'half' or not cfg.causal:
            raise ValueError("generation needs a causal next-token model (objective clm or mtp2)")
        if method not in ('cache', 'window'):
            raise ValueError(f"method={method!r}: use 'cache' or 'window'")
        n = cfg.n_ctx
        cache = {} if method == 'cache' else None
        step = self.decode_step
        if compile and method == 'cache':
            if getattr(self, '_compiled_step', None) is None:  # compiled once per model and process
                self._compiled_step = self.compile_step()
            if getattr(self, '_frozen_versions', None) not in (None, param_versions(self)):
                raise ValueError("the weights changed after stream(compile=True) froze them into the compiled step; "
                                 "decode with compile=False, or compile a fresh copy of the model")
            step = self._compiled_step

        def next_logits(window, new):  # logits after `window`, whose last `new` tokens are unseen
            length = window.shape[1]
            if cache is None:  # one full forward over the padded window (causal: filler is unseen)
                h = self.backbone(F.pad(window, (0, n - length)), Context())[:, length - 1]
                return self.lm_head(h).float()
            if new == length:  # the prompt (or a slid window) in one pass at position 0, eager
                return self.decode_step(window, 0, cache)
            return step(window[:, -1:], length - 1, cache)

        window = idx[:, -n:]
        logits = next_logits(window, window.shape[1])
        for _ in range(max_new_tokens):
            tok = sample_token(logits, temperature, top_k, top_p, generator)
            yield tok, logits
            window = torch.cat([window, tok[:, None]], dim=1)
            if window.shape[1] > n:  # slide: re-encode the last n/2 tokens at the window start
                window = window[:, -(n // 2):]
                logits = next_logits(window, window.shape[1])
            else:
                logits = next_logits(window, 1)

    def decode_step(self, tok, pos, cache):
        """Logits (B, vocab) after tokens tok (B, T) at window positions [pos, pos + T), reading and
        extending cache: the cached decoding step, a function of its arguments so it can be compiled."""
        return self.lm_head(self.backbone(tok, Context(pos=pos, cache=cache))[:, -1]).float()

    def compile_step(self):
        """decode_step through torch.compile: one dynamic-shape graph for every position. On CPU the weights are
        frozen into it as constants (inductor's freezing), so that max-autotune can repack each Linear for its own
        GEMV kernel, bias and GELU fused in, and dynamo checks the weights by identity only: a batch-1 step runs
        ~1.2-1.3x faster (README). Frozen means later changes to the weights are not seen: stream() then refuses."""
        if next(self.parameters()).device.type != 'cpu':
            return torch.compile(self.decode_step, dynamic=True)
        compiled = torch.compile(self.decode_step, dynamic=True,
                                 options=dict(max_autotune=True, **QUIET_AUTOTUNE))
        # nor the deprecation warning that max-autotune's CPU benchmarks raise inside torch
        warnings.filterwarnings('ignore', 'TypedStorage is deprecated', UserWarning,
                                r'torch\._inductor')
        config, self._frozen_versions = torch._inductor.config, param_versions(self)

        def step(tok, pos, cache):  # dynamo reads `freezing` as it traces, inside the call (patch() costs ~40 us)
            frozen, config.freezing = config.freezing, True
            try:
                return compiled(tok, pos, cache)
            finally:
                config.freezing = frozen
        return step

    def decode_layout(self):
        """Store each CPU Linear weight with its longer side contiguous (same values; returns self). A
        batch-1 step is one GEMV per weight, and MKL streams a weight ~2x faster along its long side
        (AVX2 EPYC: the 8000 x 256 lm_head at 10 GB/s row-major, 26 GB/s column-major)."""
        for mod in self.modules():
            w = getattr(mod, 'weight', None)
            if isinstance(mod, nn.Linear) and w.device.type == 'cpu' and w.shape[0] > w.shape[1]:
                w.data = w.data.t().contiguous().t()
        return self


# ----------------------------------------------------------------------------- baselines: llama and GPT-1

def attend(q, k, v, direction, pos, key_mask):
    """softmax(q k^T / sqrt(d) + mask) v for queries q (B, H, T, d) at [pos, pos + T), keys and values (B, H, S, d)
    at [0, S). On GPU: SDPA's flash / memory-efficient kernels. On CPU the plain bf16 matmuls are ~2x faster than
    SDPA's CPU flash kernel (fwd + bwd, T = 512), at the cost of O(T^2) activation memory. One query (a cached
    decoding step) takes the plain path everywhere: two GEMVs, where SDPA on an H100 planned afresh for each
    new key length (60 ms a token)."""
    t, s = q.shape[2], k.shape[2]
    mask, is_causal = None, False
    if key_mask is not None or direction == 'reverse' or (direction == 'causal' and t not in (s, 1)):
        qi, ki = torch.arange(pos, pos + t, device=q.device)[:, None], torch.arange(s, device=q.device)[None, :]
        mask = {'causal': ki <= qi, 'reverse': (ki >= qi + 2) | (ki == qi), 'none': ki >= 0}[direction]
        if key_mask is not None:  # padding keys are never read, but a query may always read itself,
            mask = mask & (key_mask[:, None, None, :] | (ki == qi))  # so no row is empty (no NaN)
    else:  # no mask, or SDPA's own causal one
        is_causal = direction == 'causal' and t > 1
    if q.device.type != 'cpu' and t > 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5                # (B, H, T, S)
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float('-inf'))
    return scores.softmax(-1).type_as(v) @ v


class Attention(nn.Module):
    """Multi-head self-attention. llama/hybrid: RoPE, no biases; gpt: biases (positions are learned)."""

    def __init__(self, cfg, direction):
        super().__init__()
        d, self.heads, self.direction, self.n_ctx = cfg.d_model, cfg.n_heads, direction, cfg.n_ctx
        self.rope = cfg.arch != 'gpt'
        self.qkv = nn.Linear(d, 3 * d, bias=not self.rope)
        self.proj = nn.Linear(d, d, bias=not self.rope)
        hd = d // self.heads
        if self.rope:
            inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
            angle = torch.outer(torch.arange(cfg.n_ctx).float(), inv_freq)   # (n_ctx, hd/2)
            self.register_buffer('cos', angle.cos(), persistent=False)
            self.register_buffer('sin', angle.sin(), persistent=False)

    def rotate(self, x, pos):  # RoPE on (..., T, hd); pairs are (x[j], x[j + hd/2])
        cos, sin = (t[pos:pos + x.shape[-2]].to(x.dtype) for t in (self.cos, self.sin))  # no bf16 -> fp32
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)

    def forward(self, x, ctx):  # (B, T, d) -> (B, T, d)
        qkv = self.qkv(x).reshape(*x.shape[:-1], 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv                                                  # (B, H, T, hd) each
        if self.rope:
            q, k = self.rotate(qkv[:2], ctx.pos)
        if ctx.cache is not None:  # KV cache
            kv = ctx.cache.get(self)
            if kv is None or ctx.pos == 0:
                kv = ctx.cache[self] = k.new_zeros(2, *k.shape[:2], self.n_ctx, k.shape[-1])
            end = ctx.pos + k.shape[2]
            kv[:, :, :, ctx.pos:end] = torch.stack((k, v))
            k, v = kv[:, :, :, :end]
        return self.proj(attend(q, k, v, self.direction, ctx.pos, ctx.mask).transpose(1, 2).flatten(2))


class SwiGLU(nn.Module):
    """Llama's gated feed-forward: w2(silu(w1 x) * w3 x), no biases."""

    def __init__(self, d, hidden):
        super().__init__()
        self.w13 = nn.Linear(d, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x, ctx=None):
        a, b = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(a) * b)


# ----------------------------------------------------------------------------- extras: hybrid, gMLP, ELiTA

class Parallel(nn.ModuleList):
    """Sublayers side by side on one normed input, outputs added (the parallel hybrid)."""

    def forward(self, x, ctx):
        return sum(layer(x, ctx) for layer in self)


class GatedMLP(nn.Module):
    """gMLP's block body: up-projection, GELU, Spatial Gating Unit, down-projection. SGU: split the
    channels into u, v; v = spatial(LayerNorm(v)), a masked n_ctx x n_ctx mixing; out u * v."""

    def __init__(self, cfg, direction, ffn_mult=6):
        super().__init__()
        d, n, half = cfg.d_model, cfg.n_ctx, ffn_mult * cfg.d_model // 2
        self.up, self.down = nn.Linear(d, 2 * half), nn.Linear(half, d)
        self.norm = nn.LayerNorm(half)
        self.spatial = Mixing(n, n, half, direction=direction)
        with torch.no_grad():  # gMLP's init, W near 0 and b = 1: the block starts as a plain feed-forward
            self.spatial.weight.uniform_(-0.01 / n, 0.01 / n)
            self.spatial.bias.fill_(1.0)

    def forward(self, x, ctx):
        u, v = F.gelu(self.up(x)).chunk(2, dim=-1)
        v = self.spatial(self.norm(v)[:, None], ctx, v.shape[1])[:, 0]
        return self.down(u * v)


class ELiTAAttention(nn.Module):
    """ELiTA's linear-time attention. Per head, with scalar projections K1, K2, K3 and
    sinusoidal positions p1, p2 (P(i, j) = c.p1_j + c.p2_i):
        y_i = (e^{K2 x_i} V x_i + e^{c.p2_i + K3 x_i} sum_{j<=i} e^{K1 x_j + c.p1_j} V x_j)
              / (e^{K2 x_i} + e^{c.p2_i + K3 x_i} sum_{j<=i} e^{K1 x_j + c.p1_j})
    The running sums are kept relative to a running maximum (blockwise, exact and causal), and
    the same scan with one position per block is the O(1)-state recurrent decoder."""

    def __init__(self, cfg):
        super().__init__()
        d, h = cfg.d_model, cfg.n_heads
        self.heads, self.n_ctx, hd = h, cfg.n_ctx, d // h
        self.keys = nn.Linear(d, 3 * h, bias=False)   # K1 (sum logit), K2 (diagonal), K3 (query)
        self.value = nn.Linear(d, d, bias=False)
        self.proj = nn.Linear(d, d)
        self.freq = nn.Parameter(2 * math.pi * 8 * torch.rand(2, h, hd))   # a1, a2
        self.phase = nn.Parameter(2 * math.pi * torch.rand(2, h, hd))      # b1, b2
        self.c = nn.Parameter(torch.randn(h, hd) / math.sqrt(hd))

    def forward(self, x, ctx):  # (B, T, d) -> (B, T, d)
        B, T, _ = x.shape
        dt = torch.promote_types(x.dtype, torch.float32)  # the scan runs in at least fp32
        i = torch.arange(ctx.pos, ctx.pos + T, device=x.device, dtype=dt) / self.n_ctx
        p = torch.sin(i[None, None, :, None] * self.freq[:, :, None] + self.phase[:, :, None])
        p = (p * self.c[None, :, None]).sum(-1)                         # (2, H, T): c.p1_j, c.p2_i
        k1, k2, k3 = rearrange(self.keys(x).to(dt), 'b t (n h) -> n b h t', n=3)
        key, diag, query = k1 + p[0], k2, k3 + p[1]                     # (B, H, T) logits
        v = rearrange(self.value(x).to(dt), 'b t (h c) -> b h t c', h=self.heads)
        state = ctx.cache.get(self) if ctx.cache is not None and ctx.pos > 0 else None
        if state is None:  # empty sums: running max -inf, sums 0
            state = (key.new_full((B, self.heads), float('-inf')), v.new_zeros(B, self.heads, v.shape[-1]),
                     key.new_zeros(B, self.heads))
        ys = []
        for a in range(0, T, ELITA_CHUNK):
            chunk = slice(a, a + ELITA_CHUNK)
            y, state = self.scan(key[..., chunk], diag[..., chunk], query[..., chunk], v[:, :, chunk], state)
            ys.append(y)
        if ctx.cache is not None:
            ctx.cache[self] = state
        return self.proj(rearrange(torch.cat(ys, dim=2).type_as(x), 'b h t c -> b t (h c)'))

    @staticmethod
    def scan(key, diag, query, v, state):
        """One block of positions: y and the carried (max m, sum S e^-m, sum Z e^-m)."""
        m0, S0, Z0 = state
        m = torch.maximum(m0[..., None], key.cummax(dim=-1).values)   # (B, H, L) running max
        L = key.shape[-1]
        causal = torch.ones(L, L, dtype=torch.bool, device=key.device).tril()
        w = (key[..., None, :] - m[..., :, None]).masked_fill(~causal, float('-inf')).exp()  # (B,H,L,L)
        decay = torch.exp(m0[..., None] - m)                           # rescale the carried sums
        S = decay[..., None] * S0[:, :, None] + w @ v                  # (B, H, L, c)
        Z = decay * Z0[..., None] + w.sum(-1)                          # (B, H, L)
        top = torch.maximum(diag, query + m)
        a, b = torch.exp(diag - top), torch.exp(query + m - top)
        y = (a[..., None] * v + b[..., None] * S) / (a + b * Z)[..., None]
        return y, (m[..., -1], S[:, :, -1], Z[..., -1])


class ELiTAFeedForward(nn.Module):
    """ELiTA's feed-forward: y = W3 (silu(W1 x + b1) outer silu(W2 x + b2)) + b3, scale 8."""

    def __init__(self, d, scale=8):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, d), nn.Linear(d, scale)
        self.w3 = nn.Linear(d * scale, d)   # the i,j,ijk->k einsum as one matmul

    def forward(self, x, ctx=None):
        outer = F.silu(self.w1(x))[..., :, None] * F.silu(self.w2(x))[..., None, :]
        return self.w3(outer.flatten(-2))


# ----------------------------------------------------------------------------- objectives and decoding

def objective_targets(objective, x, y, mask=None):
    """Targets for an objective from the loader's inputs x and next-token targets y (-1 = ignore).
    mask: (B, T) True on real tokens of x (None = no padding)."""
    if objective in ('clm', 'mtp2', 'bidirectional'):
        return y
    t = x if mask is None else x.masked_fill(~mask, -1)      # autoencoder: every input token
    if objective == 'half':                                   # predict the second half from the first
        t = t.clone()
        t[:, :half_split(x.shape[1])] = -1
    return t


def half_split(length):
    """Objective half: the first predicted position of a length-T input, where the backbone's blanking and
    objective_targets' training both start."""
    return length // 2


def lm_loss(logits, targets):
    """Mean cross-entropy over the positions whose target is not -1."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=-1)


def sample_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token per row of logits (B, V); temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float('-inf'))
    if top_p is not None and top_p < 1.0:
        probs, order = logits.sort(dim=-1, descending=True)
        probs = probs.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p   # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float('-inf'))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


# ----------------------------------------------------------------------------- bidirectional, autoencoder, retrieval

class BidirectionalLM(nn.Module):
    """Paper §5.1, fig S11: a forward stream (tril) and a reverse stream (triu, offset 2) that
    are added once, before the lm head, so logits[t] predicts token t+1 from tokens <= t and
    >= t+2 and every token is trained in one pass. Mixing the streams more than once would
    let token t+1 flow back into its own prediction. share_ffn: see __init__."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.fwd = Backbone(cfg, 'causal', embed=False)
        self.rev = Backbone(cfg, 'reverse', embed=False)
        if cfg.share_ffn:  # the author's code: one feed-forward (and its norm) per block serves both streams
            for f, r in zip(self.fwd.blocks, self.rev.blocks):
                r.layers[-1], r.norms[-1] = f.layers[-1], f.norms[-1]
        add_lm_head(self, cfg, self.wte)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Weights saved with a feed-forward per stream must not load into shared ones (one would win)."""
        fwd = dict(self.fwd.named_parameters())
        for name, p in self.rev.named_parameters(remove_duplicate=False):
            a, b = state_dict.get(f'{prefix}fwd.{name}'), state_dict.get(f'{prefix}rev.{name}')
            if p is fwd.get(name) and a is not None and b is not None and not torch.equal(a, b):
                raise ValueError("these weights have a feed-forward per stream: build the model with share_ffn=False")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def hidden(self, idx, mask=None):
        check_tokens(idx, self.cfg)
        x, ctx = self.wte(idx), Context(mask=mask)
        return self.fwd(x, ctx) + self.rev(x, ctx)

    def forward(self, idx, targets=None, mask=None):
        logits = self.lm_head(self.hidden(idx, mask))
        return logits, None if targets is None else lm_loss(logits, targets)


class Autoencoder(nn.Module):
    """Paper §5.3, fig 8: the encoder's last-token last hidden state, repeated n positions, is
    the decoder's only input; the decoder (blocks without token embedding) predicts every input
    token, unshifted. arch mixer: masked-mixer encoder/decoder; arch llama: transformer ones."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.encoder = Backbone(cfg)
        self.decoder = Backbone(cfg, embed=False)
        add_lm_head(self, cfg, self.encoder.wte)

    def hidden(self, idx, mask=None, keep=None):
        """Encoder hidden states (B, T, d_model); its last position is the sequence embedding."""
        return self.encoder.hidden(idx, mask, keep)

    def encode(self, idx, mask=None):  # (B, T) -> (B, d_model)
        return self.hidden(idx, mask)[:, -1]

    def decode(self, z, length):  # (B, d_model) -> logits (B, length, vocab)
        return self.lm_head(self.decoder(z[:, None, :].expand(-1, length, -1), Context()))

    def forward(self, idx, targets=None, mask=None):
        logits = self.decode(self.encode(idx, mask), idx.shape[1])
        return logits, None if targets is None else lm_loss(logits, targets)


class RetrievalMixer(nn.Module):
    """Paper §6.2, fig 9: a bidirectional mixer over c embeddings [query, target_1 .. target_{c-1}]
    (no token embedding, no lm head) with a d_model -> 1 head: one logit per target."""

    def __init__(self, d_model, n_layers, c):
        super().__init__()
        self.cfg = ModelConfig(vocab_size=1, n_ctx=c, d_model=d_model, n_layers=n_layers, causal=False)
        self.backbone = Backbone(self.cfg, 'none', embed=False)
        self.head = nn.Linear(d_model, 1)

    def forward(self, x, labels=None):  # x (B, c, d) -> logits (B, c - 1); labels index targets
        logits = self.head(self.backbone(x, Context()))[..., 0][:, 1:]
        return logits, None if labels is None else F.cross_entropy(logits.float(), labels)


def build_model(cfg):
    """The model for cfg.objective: LanguageModel, Autoencoder or BidirectionalLM."""
    return {'autoencoder': Autoencoder, 'bidirectional': BidirectionalLM}.get(cfg.objective, LanguageModel)(cfg)


# =============================================================================================
# accounting: parameter split, training FLOPs, decoding bytes, peak FLOP/s (reports and MFU)
# =============================================================================================

def param_counts(model):
    """Parameters split as the paper does: token mixing (mixings, attention), feed-forward, embedding (token and
    position tables, lm head) and other (norms, heads). mixing_effective leaves out the masked-mixing entries no
    output depends on (about half of a causal n x n)."""
    kinds = [('mixing', (TokenMixing, Mixing, Attention, ELiTAAttention)),
             ('feedforward', (MLP, SwiGLU, ELiTAFeedForward, GatedMLP)), ('embedding', nn.Embedding)]
    counts, seen = {}, set()
    for kind, types in kinds:  # a parameter counts once, in the first kind that claims it
        claimed = {id(p): p.numel() for name, mod in model.named_modules() for p in mod.parameters()
                   if isinstance(mod, types) or (kind == 'embedding' and name.endswith('lm_head'))}
        counts[kind] = sum(n for i, n in claimed.items() if i not in seen)
        seen |= claimed.keys()
    counts['other'] = sum(p.numel() for p in model.parameters() if id(p) not in seen)
    counts['total'] = sum(counts.values())
    reads = {id(t.mix): t.mix2.n_out for t in model.modules() if isinstance(t, TokenMixing) and t.mix2 is not None}
    unused = 0  # masked entries, and the rows of an expanded mixing that the next one never reads
    for m in (m for m in model.modules() if isinstance(m, Mixing)):
        rows = min(m.n_out, reads.get(id(m), m.n_out))
        kept = int(allowed_positions(m.direction, rows, m.n_in, 0, 'cpu').sum())
        per_row = m.bias[..., 0, 0].numel()                          # n_convs x heads (x kernel for weights)
        unused += m.weight.numel() + m.bias.numel() - m.weight[..., 0, 0].numel() * kept - per_row * rows
    counts['mixing_effective'] = counts['mixing'] - unused
    return counts


def flops_per_token(cfg):
    """Training FLOPs (forward + backward) per token, counted the PaLM way: 6 x (all parameters but
    the embedding tables and the mixers' position-mixing weights and biases; the lm head included),
    plus per layer 6 n_ctx d per masked mixing (x kernel x n_convs; d its width) and
    12 n_ctx d_model per attention. Work is counted per use: a feed-forward both streams run counts
    twice, shared or not; an expanded mixing counts the min(n_out, n_ctx) x min(n_in, n_ctx) entries
    that run (12 min(e, 1) n_ctx d for the pair). No discount for the causal mask. mtp2 runs two
    passes."""
    with torch.device('meta'):
        model = build_model(cfg)
    n, flops = cfg.n_ctx, 0
    for _, mod in model.named_modules(remove_duplicate=False):  # a module run twice is listed twice
        if isinstance(mod, Mixing):  # rows past n_ctx are never computed, nor read by the next one
            rows, cols = min(mod.n_out, n), min(mod.n_in, n)
            flops += 6 * mod.weight[..., 0, 0].numel() * rows * cols * mod.channels / n
        elif not isinstance(mod, nn.Embedding):  # a lookup is no matmul; a tied lm head is a Linear
            flops += 6 * sum(p.numel() for p in mod.parameters(recurse=False))
        if isinstance(mod, Attention):
            flops += 12 * n * cfg.d_model
        elif isinstance(mod, ELiTAAttention):
            flops += 6 * min(ELITA_CHUNK, n) * cfg.d_model
    return flops * (2 if cfg.objective == 'mtp2' else 1)


def decode_bytes(model, pos, batch=1, cached=True):
    """Bytes one decoding step at window position pos reads: every weight once in its storage dtype, except that
    an embedding table gives a row per sequence and a masked mixing its row pos, plus per sequence the cache rows
    read (mixing inputs, keys and values); not activations or writes. cached=False (window): all parameter bytes,
    a loose figure for a step that is compute-bound."""
    if not cached:
        return sum(p.numel() * p.element_size() for p in model.parameters())
    lm_head = getattr(model, 'lm_head', None)
    total, counted = 0, set()
    for mod in model.modules():
        if isinstance(mod, Mixing):
            size, cols = mod.weight.element_size(), min(pos + 1, mod.n_in)
            if pos < mod.n_out:  # row pos of the weights and bias, the cached inputs it mixes
                total += (mod.weight[..., 0, :cols].numel() + mod.heads * (1 + batch * cols * mod.channels)) * size
            counted |= {id(mod.weight), id(mod.bias)}
        elif isinstance(mod, Attention):  # keys and values of positions <= pos
            total += batch * 2 * (pos + 1) * mod.qkv.in_features * mod.qkv.weight.element_size()
        elif isinstance(mod, nn.Embedding) and (lm_head is None or mod.weight is not lm_head.weight):
            total += batch * mod.embedding_dim * mod.weight.element_size()
            counted.add(id(mod.weight))
    return total + sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in counted)


def measure_peak_flops(device='cpu', dtype=torch.float32, budget=0.25):
    """The denominator of MFU: the best FLOP/s of a square matmul in dtype on device. The size starts
    small and doubles (up to 4096) while the next size fits in what is left of `budget` seconds, so the
    probe is quick on a fast GPU and on a CPU that emulates bf16 alike. On a CPU one thread is timed and
    scaled by the thread count: small matmuls on several threads measure thread wake-ups, not arithmetic."""
    cuda = torch.device(device).type == 'cuda'
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    threads = torch.get_num_threads()
    deadline, best, n = time.perf_counter() + budget, 0.0, 128
    torch.set_num_threads(threads if cuda else 1)
    try:
        while True:
            a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
            dt = float('inf')
            for _ in range(4):  # the first run warms up; keep the best of all
                sync()
                t0 = time.perf_counter()
                a @ b
                sync()
                dt = min(dt, time.perf_counter() - t0)
            best = max(best, 2 * n ** 3 / dt)
            if n >= 4096 or time.perf_counter() + 4 * 8 * dt > deadline:  # 2n costs 8x per matmul
                return best * (1 if cuda else threads)
            n *= 2
    finally:
        torch.set_num_threads(threads)
