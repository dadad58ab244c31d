"""nanomixer: masked mixers and their baselines, in one file.

A masked mixer is a transformer whose attention is replaced by a learned n_ctx x n_ctx linear
mixing over positions, lower-triangular masked so that position t reads only positions <= t
(Badger, "Masked Mixers for Language Generation and Retrieval"):

    out = tril(W) @ x + b      x (n_ctx, d_model), W (n_ctx, n_ctx), b (n_ctx, 1)

`Mixing` below is that line; the rest of the file builds language models around it and the
transformer baselines (Llama, GPT-1) they are compared with.

Conventions
- idx: LongTensor (B, T) of token ids, T <= n_ctx; pos: the window position of idx[:, 0].
- targets: shaped like logits[..., 0], the token logits[b, t] should predict; -1 = no loss.
  The data loader shifts (nanoGPT's convention); `objective_targets` builds the other objectives'.
- mask: optional BoolTensor (B, T), True on real tokens. Attention uses it as a key-padding mask;
  masked mixings (a hybrid's too), gMLP and ELiTA ignore it, as the paper's mixers do (causal
  ones: a right pad reaches only positions after it).
- cache: optional `Cache`, the decoding state passed explicitly (as nanochat's kv_cache).
- Language models return (logits, loss): logits (B, T, vocab_size), loss a scalar or None.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

ARCHS = ('mixer', 'llama', 'gpt', 'hybrid', 'gmlp', 'elita')
OBJECTIVES = ('clm', 'autoencoder', 'bidirectional', 'mtp2', 'half')
ELITA_CHUNK = 64  # positions per block of ELiTA's parallel scan


# ---- the masked mixer ----------------------------------------------------------------------------

class Mixing(nn.Module):
    """Masked linear mixing over positions, the heart of the masked mixer, per head of channels:
    out[t] = sum_{s<=t} W[t, s] x[s] + b[t], one learned weight per pair of positions, shared by
    every channel (kernel > 1: k per pair, a kernel sliding along the channels). The mask is
    applied here, never to .data, so masked weights get exactly zero gradient. direction:
    'causal' (tril), 'reverse' (the bidirectional LM's second stream, inputs s >= t + 2) or
    'none'. softmax: each row a distribution over the positions it may read."""

    def __init__(self, n_out, n_in, heads=1, softmax=False, direction='causal', kernel=1):
        super().__init__()
        self.softmax, self.direction = softmax, direction
        bound = 1 / math.sqrt(n_in * kernel)  # nn.Conv1d's default init, as the paper used
        shape = (heads, n_out, n_in) if kernel == 1 else (heads, kernel, n_out, n_in)
        self.weight = nn.Parameter(torch.empty(shape).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(heads, n_out, 1).uniform_(-bound, bound))

    def forward(self, x, pos=0, rows=None):
        """x (B, H, S, c), inputs at positions [0, S) -> out (B, H, rows, c) at [pos, pos+rows)."""
        rows = x.shape[2] - pos if rows is None else rows
        W = self.weight[..., pos:pos + rows, :x.shape[2]]           # rows [pos, pos + rows) of W
        if self.softmax:  # -inf before the softmax, so the future gets no weight
            W = W.masked_fill(~allowed(self.direction, W, pos), float('-inf')).softmax(-1)
        elif self.direction == 'causal':
            W = W.tril(pos)            # <- causality lives here: output t reads inputs s <= t
        elif self.direction == 'reverse':
            W = W.triu(pos + 2)
        return self.product(W, x) + self.bias[:, pos:pos + rows]    # out = tril(W) @ x + b

    def product(self, W, x):  # (H, R, S) @ (B, H, S, c) -> (B, H, R, c)
        if W.dim() == 3:
            return W @ x
        # kernel > 1 (paper §9.2): the paper's Conv1d, its channels a head's input positions, a
        # kernel-wide window sliding along the head's c features ('same' padding). W is (H, k, R,
        # S): forward's tril, on its last two dims, has masked every tap alike.
        H, k, R = W.shape[:3]
        if R == 0:  # no rows (a step past an expanded mixer's e * n_ctx hidden ones): conv1d can't
            return x[:, :, :0]
        x = F.pad(rearrange(x, 'b h s c -> b (h s) c'), ((k - 1) // 2, k // 2))
        y = F.conv1d(x, rearrange(W, 'h k r s -> (h r) s k'), groups=H)  # (B, H * R, c)
        return rearrange(y, 'b (h r) c -> b h r c', h=H)


def allowed(direction, W, pos):
    """Bool (R, S): may the output at position pos + i read the input at position j?"""
    ones = torch.ones(W.shape[-2:], dtype=torch.bool, device=W.device)
    return {'causal': ones.tril(pos), 'reverse': ones.triu(pos + 2)}.get(direction, ones)


class ParallelMixing(nn.ModuleList):
    """Mixings side by side on one input, outputs summed, each through act: the blog's parallel
    mixer (n_convs = p > 1, sum_i GELU(W_i x + b_i)) and the parallel hybrid (attention + mixer)."""

    def __init__(self, modules, act=None):
        super().__init__(modules)
        self.act = act or (lambda y: y)

    def forward(self, x, *args):
        return sum(self.act(module(x, *args)) for module in self)


# ---- the configuration, blocks and the model -----------------------------------------------------

@dataclass
class ModelConfig:
    arch: str = 'mixer'        # mixer | llama | gpt | hybrid | gmlp | elita
    vocab_size: int = 4096
    n_ctx: int = 512           # context window; a mixer's weights are per position, so it is fixed
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 0           # 0 = the arch's default: 4 attention heads, 1 mixer head
    kernel: int = 1            # mixer Conv1d kernel, sliding along a head's channels (paper §9.2)
    expansion: float = 0.0     # 0 = flat mixer; e > 0 = the MLP-mixer's n -> e*n -> n, GELU between
    n_convs: int = 1           # p > 1: p parallel masked mixings, each through GELU, summed
    softmax: bool = False      # each mixing row a softmax over the positions it may read
    pos_emb: bool = False      # learned absolute positions (mixer ablation; GPT always has them)
    pos_channel: str = 'none'  # none | input | every: one extra channel holding the position (blog)
    hybrid_order: str = 'attn_mix'  # hybrid: attn_mix | mix_attn | parallel
    share_ffn: bool = None     # bidirectional: streams share feed-forwards; None: per arch
    causal: bool = True        # False = unmasked (bidirectional) mixing or attention
    tie_weights: bool = False  # the lm head shares the token embedding
    objective: str = 'clm'     # clm | autoencoder | bidirectional | mtp2 | half

    def __post_init__(self):
        for name, allowed in (('arch', ARCHS), ('objective', OBJECTIVES),
                              ('pos_channel', ('none', 'input', 'every')),
                              ('hybrid_order', ('attn_mix', 'mix_attn', 'parallel'))):
            value = getattr(self, name)
            assert value in allowed, f"{name}={value!r} is unknown: use one of {', '.join(allowed)}"
        arch, objective, e = self.arch, self.objective, self.expansion
        two_streams = objective == 'bidirectional'
        self.n_heads = self.n_heads or (4 if arch in ('llama', 'gpt', 'hybrid', 'elita') else 1)
        self.pos_emb = self.pos_emb or arch == 'gpt'  # GPT-1 always learns its positions
        if self.share_ffn is None:  # the author's: one DoubleMixerBlock, but two Llama stacks
            self.share_ffn = not (two_streams and arch == 'llama')
        for name in ('vocab_size', 'n_ctx', 'd_model', 'n_layers', 'n_heads', 'kernel', 'n_convs'):
            value = getattr(self, name)
            assert isinstance(value, int) and value >= 1, f"{name}={value!r}: use an integer >= 1"
        d, h = self.d_model, self.n_heads
        assert arch == 'hybrid' or self.hybrid_order == 'attn_mix', "hybrid_order: arch hybrid only"
        assert d % (2 * h if arch in ('llama', 'hybrid') else h) == 0, \
            f"n_heads={h} must divide d_model={d} (llama, hybrid: into even heads, for RoPE)"
        assert isinstance(self.share_ffn, bool) and (self.share_ffn or two_streams), \
            f"share_ffn={self.share_ffn!r}: None, True or False (False: objective bidirectional)"
        plain = (self.kernel, e, self.n_convs, self.softmax) == (1, 0, 1, False)
        assert plain or arch in ('mixer', 'hybrid'), \
            f"arch={arch}: kernel, expansion, n_convs and softmax need arch mixer or hybrid"
        assert arch != 'gmlp' or h == 1, "n_heads: gmlp has one spatial projection: use 0 or 1"
        assert self.kernel <= d // (h if arch == 'mixer' else 1), \
            f"kernel={self.kernel} must not exceed the channels it slides along"
        assert not e or e * self.n_ctx >= 1 and self.causal and not two_streams, \
            f"expansion={e}: use 0 (flat), or e * n_ctx >= 1 in a causal mixer of one stream"
        assert not e or self.n_convs == 1, "n_convs: parallel mixings need expansion=0 (flat)"
        assert not (self.softmax and two_streams), "softmax: a reverse stream's last rows are empty"
        assert self.pos_channel == 'none' or (arch, h) == ('mixer', 1), \
            f"pos_channel={self.pos_channel}: width d_model + 1 is for a one-head mixer: use none"
        assert self.causal or arch != 'elita' and objective == 'clm', \
            "causal=False is for clm encoders of arch mixer/llama/gpt/hybrid/gmlp"
        assert objective not in ('autoencoder', 'bidirectional') or arch in ('mixer', 'llama'), \
            f"objective={objective} is made of mixer or llama blocks: use arch mixer or llama"
        assert objective != 'half' or min(self.n_layers, self.n_ctx) >= 2, \
            "objective=half needs n_layers >= 2 and n_ctx >= 2 (an encoder and a decoder half)"
        self.width = d + (self.pos_channel != 'none')  # the blocks' channels, a position one added


class TokenMixing(nn.Module):
    """The masked mixer's replacement for attention: a mixing (flat, kernel, parallel), or two
    with GELU between (expanded, n -> e*n -> n), per head of channels; with more than one head (a
    mixer's n_heads > 1) a linear projection before and after it (fig S6), else none."""

    def __init__(self, cfg, direction):
        super().__init__()
        d, n, self.heads = cfg.width, cfg.n_ctx, cfg.n_heads if cfg.arch == 'mixer' else 1
        self.proj_in = nn.Linear(d, d) if self.heads > 1 else nn.Identity()
        self.proj_out = nn.Linear(d, d) if self.heads > 1 else nn.Identity()
        self.m = int(cfg.expansion * n) if cfg.expansion else n  # hidden rows of an expanded mixer

        def mixing(n_out, n_in):  # each parallel mixing has the kernel too
            mixings = [Mixing(n_out, n_in, self.heads, cfg.softmax, direction, cfg.kernel)
                       for _ in range(cfg.n_convs)]
            return ParallelMixing(mixings, act=F.gelu) if cfg.n_convs > 1 else mixings[0]
        self.mix = mixing(self.m, n)
        self.mix2 = mixing(n, self.m) if cfg.expansion else None

    def forward(self, x, pos=0, cache=None, mask=None):  # (B, T, d) -> (B, T, d)
        t = x.shape[1]  # (B, T, H * c) -> (B, H, T, c)
        x = self.proj_in(x).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        if cache is not None:  # earlier calls' inputs at [0, pos), then these at [pos, pos + t)
            x = cache.extend(self.mix, x, pos)
        x = self.mix(x, pos, max(0, min(self.m, pos + t) - pos))  # e < 1: no rows past e * n
        if self.mix2 is not None:  # e > 1: hidden rows >= n_ctx are never read under the mask
            x = F.gelu(x)  # hidden rows exist only below m: those at [min(pos, m), ...)
            x = self.mix2(x if cache is None else cache.extend(self.mix2, x, min(pos, self.m)),
                          pos, t)
        return self.proj_out(x.transpose(1, 2).flatten(2))


class Cache(dict):
    """Decoding state, keyed by the module that reads it (an expanded mixer's layer has two
    mixings, a hybrid's a mixing and an attention): a mixing's inputs, an attention's keys and
    values, ELiTA's running sums. A mixer caches each mixing's inputs, not its outputs: the output
    row of a new position reads every input up to it, as a new query reads every key."""

    def __init__(self, n_ctx):
        super().__init__()
        self.n_ctx = n_ctx

    def extend(self, key, x, pos):
        """x (B, H, T, c): rows at [pos, pos + T) -> every row so far (B, H, pos + T, c), written
        in place into an n_ctx-long buffer made when a window starts (pos 0)."""
        old, end = self.get(key) if pos else None, pos + x.shape[2]
        if old is None:
            self[key] = old = x.new_zeros(*x.shape[:2], self.n_ctx, x.shape[3])
        old[:, :, pos:end] = x
        return old[:, :, :end]


class MLP(nn.Module):
    """Position-wise d -> 4d -> d with GELU (the mixer's feed-forward; GPT-1's uses GELU's tanh)."""

    def __init__(self, d, hidden, approximate='none'):
        super().__init__()
        self.fc, self.out = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.approximate = approximate

    def forward(self, x):
        return self.out(F.gelu(self.fc(x), approximate=self.approximate))


def norm_layer(cfg):
    rms = cfg.arch in ('llama', 'hybrid')
    return nn.RMSNorm(cfg.width, eps=1e-6) if rms else nn.LayerNorm(cfg.width)


class Block(nn.Module):
    """Token mixers (a masked mixing, attention, or both for the hybrid), then a feed-forward,
    each residual with its own norm: pre-norm, but GPT-1's post-norm. Only the token mixers read
    pos, cache and mask; a feed-forward sees one position at a time."""

    def __init__(self, cfg, direction):
        super().__init__()
        d, arch = cfg.width, cfg.arch
        if arch == 'mixer':
            mixers, self.ffn = [TokenMixing(cfg, direction)], MLP(d, 4 * d)
        elif arch in ('llama', 'gpt'):
            mixers = [Attention(cfg, direction)]
            self.ffn = SwiGLU(d, 4 * d) if arch == 'llama' else MLP(d, 4 * d, 'tanh')
        elif arch == 'hybrid':  # the blog's orderings of attention and a masked mixing
            attn, mix = Attention(cfg, direction), TokenMixing(cfg, direction)
            mixers = {'attn_mix': [attn, mix], 'mix_attn': [mix, attn],
                      'parallel': [ParallelMixing([attn, mix])]}[cfg.hybrid_order]
            self.ffn = SwiGLU(d, 4 * d)
        elif arch == 'gmlp':  # one sublayer: the gated MLP holds the spatial mixing
            mixers, self.ffn = [GatedMLP(cfg, direction)], None
        else:
            mixers, self.ffn = [ELiTAAttention(cfg)], ELiTAFeedForward(d)
        self.mixers = nn.ModuleList(mixers)
        self.norms = nn.ModuleList(norm_layer(cfg) for _ in range(len(mixers) + bool(self.ffn)))
        self.post_norm = arch == 'gpt'

    def forward(self, x, pos=0, cache=None, mask=None):  # (B, T, d) -> (B, T, d)
        for norm, mixer in zip(self.norms, self.mixers):
            x = norm(x + mixer(x, pos, cache, mask)) if self.post_norm else \
                x + mixer(norm(x), pos, cache, mask)
        if self.ffn is not None:
            norm = self.norms[-1]
            x = norm(x + self.ffn(x)) if self.post_norm else x + self.ffn(norm(x))
        return x


class Backbone(nn.Module):
    """Token embedding (optional) -> positions (optional) -> blocks -> final norm: (B, T, d)."""

    def __init__(self, cfg, direction='causal', embed=True):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model) if embed else None
        self.wpe = nn.Embedding(cfg.n_ctx, cfg.d_model) if cfg.pos_emb else None
        self.blocks = nn.ModuleList(Block(cfg, direction) for _ in range(cfg.n_layers))
        # the paper's mixer and GPT-1 have no final norm
        self.norm = nn.Identity() if cfg.arch in ('mixer', 'gpt') else norm_layer(cfg)

    def forward(self, x, pos=0, cache=None, mask=None):  # idx (B, T) or embeddings (B, T, d)
        if self.wte is not None:
            x = self.wte(x)
        assert x.dim() == 3, "idx: (B, T) token ids"  # embedded here or by the caller
        cfg, T = self.cfg, x.shape[1]
        assert pos + T <= cfg.n_ctx, f"{pos + T} positions exceed n_ctx={cfg.n_ctx}: crop them"
        assert cache is not None or pos == 0, "pos > 0 reads positions [0, pos) from a cache"
        if self.wpe is not None:
            x = x + self.wpe.weight[pos:pos + T]
        at = torch.arange(pos, pos + T, device=x.device)
        if cfg.pos_channel != 'none':  # the blog's ablation: the centred position, appended
            centred = (at - cfg.n_ctx // 2).to(x.dtype)[None, :, None].expand(len(x), -1, 1)
            x = torch.cat((x, centred), dim=-1)                         # (B, T, d_model + 1)
        split = cfg.n_layers // 2 if cfg.objective == 'half' else -1
        for i, block in enumerate(self.blocks):
            if i == split:  # half-sequence prediction: the second half only sees the first
                x = x * (at < half_split(pos + T))[None, :, None]
            x = block(x, pos, cache, mask)
            if cfg.pos_channel == 'every':
                x = torch.cat((x[..., :-1], centred), dim=-1)
        return self.norm(x)[..., :cfg.d_model]  # the position channel is not a feature


def add_lm_head(model, cfg, wte):
    """The lm head, then the init: transformers N(0, 0.02) (HF Llama, GPT-1), mixers the paper's."""
    model.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
    if cfg.arch in ('llama', 'gpt', 'hybrid'):
        for mod in model.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=0.02)
                if getattr(mod, 'bias', None) is not None:
                    nn.init.zeros_(mod.bias)
    if cfg.tie_weights:  # the table is an output layer too: its scale (a mixer's would be N(0, 1))
        nn.init.normal_(wte.weight, std=0.02)
        model.lm_head.weight = wte.weight


class LanguageModel(nn.Module):
    """A next-token model of any arch: Backbone + lm head (objectives clm, mtp2 and half)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.backbone = Backbone(cfg, 'causal' if cfg.causal else 'none')
        add_lm_head(self, cfg, self.backbone.wte)

    def forward(self, idx, targets=None, cache=None, pos=0, mask=None):
        logits = self.lm_head(self.backbone(idx, pos, cache, mask))    # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = lm_loss(logits, targets)
            if self.cfg.objective == 'mtp2':  # paper §5.2: a second pass on the model's own argmax
                logits2 = self.lm_head(self.backbone(logits.argmax(-1), mask=mask))  # -> t + 2
                loss = loss + lm_loss(logits2[:, :-1], targets[:, 1:])
        return logits, loss

    def hidden(self, idx, mask=None):  # the lm head's input (B, T, d_model)
        return self.backbone(idx, mask=mask)

    def step(self, idx, pos, cache):
        """Logits (B, vocab) after idx (B, T) at window positions [pos, pos + T), reading and
        extending cache: a cached decoding step, a function of its arguments (compilable). One
        token at p costs per layer ~(p + 1)·d multiply-adds of mixing over the cached rows (mixer;
        x kernel, x n_convs, two mixings if expanded; attention 2(p + 1)·d; a hybrid both), beside
        the d² of projections and feed-forward."""
        return self.lm_head(self.backbone(idx, pos, cache)[:, -1]).float()

    @torch.no_grad()
    def stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
               method='cache', generator=None, step=None):
        """Yield (token (B,), logits (B, vocab)) per new token. method='window' is the paper's
        (§4.2): the whole window runs again for each token, O(n^3 d) per window for a mixer.
        method='cache' runs only the new position against a Cache of the earlier ones, O(n^2 d),
        the same numbers up to float rounding. step: replaces self.step on one new token."""
        assert self.cfg.objective != 'half' and self.cfg.causal, \
            "generation needs a causal next-token model (objective clm or mtp2)"
        assert method in ('cache', 'window'), f"method={method!r}: use cache or window"
        n, step = self.cfg.n_ctx, step or self.step
        cache = Cache(n) if method == 'cache' else None
        window, fresh = idx[:, -n:], True  # fresh: no token of the window is in the cache yet
        for _ in range(max_new_tokens):
            T = window.shape[1]
            if cache is None:  # a full forward over the padded window (causal: filler is unseen)
                logits = self.lm_head(self.backbone(F.pad(window, (0, n - T)))[:, T - 1]).float()
            elif fresh:  # the prompt (or a slid window) in one pass at position 0
                logits = self.step(window, 0, cache)
            else:
                logits = step(window[:, -1:], T - 1, cache)
            tok = sample_token(logits, temperature, top_k, top_p, generator)
            yield tok, logits
            window = torch.cat([window, tok[:, None]], dim=1)
            fresh = window.shape[1] > n
            if fresh:  # slide (alike in both): re-encode the last n/2 tokens at the window start
                window = window[:, -(n // 2):]


def sample_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token per row of logits (B, V); temperature 0 is greedy, and a tiny one as good as."""
    if temperature == 0:
        return logits.argmax(-1)
    # the top logit moved to 0: a tiny temperature sends the others to -inf, not all of them to
    # inf; and kept at or above the smallest normal float, where it would otherwise round to 0
    floor = torch.finfo(logits.dtype).tiny
    logits = (logits - logits.amax(-1, keepdim=True)) / max(temperature, floor)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float('-inf'))
    if top_p is not None and top_p < 1.0:
        probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
        drop = probs.cumsum(-1) - probs > top_p   # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float('-inf'))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def lm_loss(logits, targets):
    """The mean over the positions whose target is not -1; 0 where there are none (objective half:
    a batch, or a rank's rows, of short right-padded documents), not cross_entropy's 0/0 = NaN."""
    loss = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=-1,
                           reduction='sum')
    return loss / (targets != -1).sum().clamp(min=1)


def objective_targets(objective, x, y, mask=None):
    """The objective's targets, from the loader's inputs x, next-token targets y and mask."""
    if objective in ('clm', 'mtp2', 'bidirectional'):
        return y
    t = x if mask is None else x.masked_fill(~mask, -1)      # autoencoder: every input token
    if objective == 'half':                                   # the second half from the first
        t = t.clone()
        t[:, :half_split(x.shape[1])] = -1
    return t


def half_split(length):  # objective half: where the backbone's blanking and the targets start
    return length // 2


# ---- the baselines: attention (Llama, GPT-1, the hybrid's), gMLP, ELiTA -------------------------

def attend(q, k, v, direction, pos, key_mask):
    """softmax(q k^T / sqrt(d) + mask) v, queries q (B, H, T, d) at [pos, pos + T), keys and values
    (B, H, S, d) at [0, S). GPU: SDPA's fused kernels. CPU: plain matmuls (~2x faster than SDPA's
    CPU flash kernel in bf16, fwd + bwd, T 512). One query (a decoding step) is two GEMVs
    everywhere: SDPA on an H100 planned afresh for each new key length."""
    t, s = q.shape[2], k.shape[2]
    qi = torch.arange(pos, pos + t, device=q.device)[:, None]          # query positions (T, 1)
    ki = torch.arange(s, device=q.device)[None, :]                      # key positions (1, S)
    mask = {'causal': ki <= qi, 'reverse': (ki >= qi + 2) | (ki == qi), 'none': None}[direction]
    if key_mask is not None:  # pad keys are never read, but a query reads itself (no NaN row)
        mask = (ki >= 0 if mask is None else mask) & (key_mask[:, None, None, :] | (ki == qi))
    elif direction == 'causal' and t in (s, 1):  # a causal square, or one query reading all
        mask = None
    is_causal = mask is None and direction == 'causal' and t > 1
    if q.device.type != 'cpu' and t > 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5                # (B, H, T, S)
    mask = ki <= qi if is_causal else mask
    if mask is not None:
        scores = scores.masked_fill(~mask, float('-inf'))
    return scores.softmax(-1).type_as(v) @ v


class Attention(nn.Module):
    """Multi-head self-attention. llama/hybrid: RoPE, no biases; gpt: biases, learned positions."""

    def __init__(self, cfg, direction):
        super().__init__()
        d, self.heads, self.direction = cfg.d_model, cfg.n_heads, direction
        self.rope = cfg.arch != 'gpt'
        self.qkv = nn.Linear(d, 3 * d, bias=not self.rope)
        self.proj = nn.Linear(d, d, bias=not self.rope)
        hd = d // self.heads
        if self.rope:
            inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
            angle = torch.outer(torch.arange(cfg.n_ctx).float(), inv_freq)   # (n_ctx, hd/2)
            self.register_buffer('cos', angle.cos(), persistent=False)
            self.register_buffer('sin', angle.sin(), persistent=False)

    def forward(self, x, pos=0, cache=None, mask=None):  # (B, T, d) -> (B, T, d)
        qkv = self.qkv(x).reshape(*x.shape[:-1], 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv                                                  # (B, H, T, hd) each
        if self.rope:  # RoPE on q and k; pairs are (x[j], x[j + hd/2])
            cos, sin = (t[pos:pos + x.shape[1]].to(qkv.dtype) for t in (self.cos, self.sin))
            x1, x2 = qkv[:2].chunk(2, dim=-1)
            q, k = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        if cache is not None:  # the KV cache
            k, v = cache.extend((self, 'k'), k, pos), cache.extend((self, 'v'), v, pos)
        y = attend(q, k, v, self.direction, pos, mask)                # (B, H, T, hd)
        return self.proj(y.transpose(1, 2).flatten(2))


class SwiGLU(nn.Module):
    """Llama's gated feed-forward: w2(silu(w1 x) * w3 x), no biases."""

    def __init__(self, d, hidden):
        super().__init__()
        self.w13 = nn.Linear(d, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        a, b = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(a) * b)


class GatedMLP(nn.Module):
    """gMLP's block body: up-projection, GELU, Spatial Gating Unit, down-projection. SGU: split
    the channels into u, v; v = spatial(LayerNorm(v)), a masked n_ctx x n_ctx mixing; out u * v."""

    def __init__(self, cfg, direction, ffn_mult=6):
        super().__init__()
        d, n, half = cfg.d_model, cfg.n_ctx, ffn_mult * cfg.d_model // 2
        self.up, self.down = nn.Linear(d, 2 * half), nn.Linear(half, d)
        self.norm = nn.LayerNorm(half)
        self.spatial = Mixing(n, n, direction=direction)
        with torch.no_grad():  # gMLP's init, W near 0 and b = 1: it starts as a plain feed-forward
            self.spatial.weight.uniform_(-0.01 / n, 0.01 / n)
            self.spatial.bias.fill_(1.0)

    def forward(self, x, pos=0, cache=None, mask=None):
        u, v = F.gelu(self.up(x)).chunk(2, dim=-1)
        v = self.norm(v)[:, None]                                         # (B, 1, T, half)
        if cache is not None:
            v = cache.extend(self, v, pos)
        return self.down(u * self.spatial(v, pos, x.shape[1])[:, 0])


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

    def forward(self, x, pos=0, cache=None, mask=None):  # (B, T, d) -> (B, T, d)
        B, T, _ = x.shape
        dt = torch.promote_types(x.dtype, torch.float32)  # the scan runs in at least fp32
        i = torch.arange(pos, pos + T, device=x.device, dtype=dt) / self.n_ctx
        p = torch.sin(i[None, None, :, None] * self.freq[:, :, None] + self.phase[:, :, None])
        p = (p * self.c[None, :, None]).sum(-1)                         # (2, H, T): c.p1_j, c.p2_i
        k1, k2, k3 = rearrange(self.keys(x).to(dt), 'b t (n h) -> n b h t', n=3)
        key, diag, query = k1 + p[0], k2, k3 + p[1]                     # (B, H, T) logits
        v = rearrange(self.value(x).to(dt), 'b t (h c) -> b h t c', h=self.heads)
        state = cache.get(self) if cache is not None and pos > 0 else None
        if state is None:  # empty sums: running max -inf, sums 0
            state = (key.new_full((B, self.heads), float('-inf')),
                     v.new_zeros(B, self.heads, v.shape[-1]), key.new_zeros(B, self.heads))
        ys = []
        for chunk in zip(*(t.split(ELITA_CHUNK, dim=2) for t in (key, diag, query, v))):
            y, state = self.scan(*chunk, state)
            ys.append(y)
        if cache is not None:
            cache[self] = state
        return self.proj(rearrange(torch.cat(ys, dim=2).type_as(x), 'b h t c -> b t (h c)'))

    @staticmethod
    def scan(key, diag, query, v, state):
        """One block of positions: y and the carried (max m, sum S e^-m, sum Z e^-m)."""
        m0, S0, Z0 = state
        m = torch.maximum(m0[..., None], key.cummax(dim=-1).values)   # (B, H, L) running max
        w = key[..., None, :] - m[..., :, None]                         # (B, H, L, L) logits
        w = w.masked_fill(~allowed('causal', w, 0), float('-inf')).exp()
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

    def forward(self, x):
        outer = F.silu(self.w1(x))[..., :, None] * F.silu(self.w2(x))[..., None, :]
        return self.w3(outer.flatten(-2))


# ---- bidirectional, autoencoder, retrieval -------------------------------------------------------

class BidirectionalLM(nn.Module):
    """Paper §5.1, fig S11: a forward stream (tril) and a reverse stream (triu, offset 2), added
    once, before the lm head, so logits[t] predicts token t+1 from tokens <= t and >= t+2 and
    every token is trained in one pass (mixing the streams twice would let t+1 reach itself).
    share_ffn: one feed-forward (and norm) per block serves both streams (the author's mixer)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.fwd = Backbone(cfg, 'causal', embed=False)
        self.rev = Backbone(cfg, 'reverse', embed=False)
        if cfg.share_ffn:
            for f, r in zip(self.fwd.blocks, self.rev.blocks):
                r.ffn, r.norms[-1] = f.ffn, f.norms[-1]
        add_lm_head(self, cfg, self.wte)

    def hidden(self, idx, mask=None):
        x = self.wte(idx)
        return self.fwd(x, mask=mask) + self.rev(x, mask=mask)

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

    def hidden(self, idx, mask=None):  # (B, T, d_model): the last position embeds the sequence
        return self.encoder(idx, mask=mask)

    def encode(self, idx, mask=None):  # (B, T) -> (B, d_model)
        return self.hidden(idx, mask)[:, -1]

    def decode(self, z, length):  # (B, d_model) -> logits (B, length, vocab)
        return self.lm_head(self.decoder(z[:, None, :].expand(-1, length, -1)))

    def forward(self, idx, targets=None, mask=None):
        logits = self.decode(self.encode(idx, mask), idx.shape[1])
        return logits, None if targets is None else lm_loss(logits, targets)


class RetrievalMixer(nn.Module):
    """Paper §6.2, fig 9: an unmasked mixer over c embeddings [query, target_1 .. target_{c-1}]
    (no token embedding, no lm head) with a d_model -> 1 head: one logit per target."""

    def __init__(self, d_model, n_layers, c):
        super().__init__()
        self.cfg = ModelConfig(vocab_size=1, n_ctx=c, d_model=d_model, n_layers=n_layers,
                               causal=False)
        self.backbone = Backbone(self.cfg, 'none', embed=False)
        self.head = nn.Linear(d_model, 1)

    def forward(self, x, labels=None):  # x (B, c, d) -> logits (B, c - 1); labels index targets
        logits = self.head(self.backbone(x))[..., 0][:, 1:]
        return logits, None if labels is None else F.cross_entropy(logits.float(), labels)


def build_model(cfg):
    models = {'autoencoder': Autoencoder, 'bidirectional': BidirectionalLM}
    return models.get(cfg.objective, LanguageModel)(cfg)


# ---- FLOPs for MFU -------------------------------------------------------------------------------

def flops_per_token(cfg):
    """Training FLOPs per token, forward + backward, PaLM's count: 6 per weight a token passes
    through (not the embedding tables or the mixing matrices; the lm head counts), plus 6 x rows x
    inputs x channels / n_ctx per mixing and 12 n_ctx d per attention. Counted per use, by tracing
    one forward on the meta device: a shared feed-forward runs on both streams, mtp2's second pass
    counts. No discount for the causal mask."""
    with torch.device('meta'):
        model = build_model(cfg)
        flops = []

        def count(mod, inputs, out):
            x = inputs[0]
            if isinstance(mod, Mixing):  # rows x (inputs read) x channels, per head and kernel
                B, _, S, c = x.shape
                flops.append(6 * mod.weight[..., 0, 0].numel() * out.shape[2] * S * B * c)
            elif isinstance(mod, Attention):
                flops.append(12 * x.shape[0] * x.shape[1] ** 2 * x.shape[2])
            elif not isinstance(mod, nn.Embedding):  # a lookup is no matmul; biases, norms count
                flops.append(6 * sum(p.numel() for p in mod.parameters(recurse=False))
                             * x[..., 0].numel())
            if isinstance(mod, ELiTAAttention):  # the scan's masked block products
                B, T, d = x.shape
                flops.append(6 * B * T * min(ELITA_CHUNK, T) * d)
        for mod in model.modules():  # once each, shared ones too; dropped with the model
            mod.register_forward_hook(count)
        idx = torch.zeros(1, cfg.n_ctx, dtype=torch.long)
        model(idx, targets=idx)
    return sum(flops) / cfg.n_ctx
