"""nanomixer's tests, written to be read top to bottom: each protects one property, named by the
test or its docstring. Tiny models on the CPU (a GPU only in the CUDA section), every fixture made
by the tests themselves. Run: python -m pytest -q (NANOMIXER_NO_BF16=1 makes --dtype=auto take its
fp32 fallback everywhere; on a GPU machine python -m pytest -q -k cuda runs the CUDA section).

How the file reads:
  1. the three teaching tests: a `Mixing` is tril(W) @ x + b written out by hand; no future token
     reaches a past logit (by perturbation and by exact-zero gradients, every causal variant, with
     a control that does leak); decoding with the cache equals re-running the window
  2. the golden run: train.py for 30 steps from a fixed seed, its losses and a greedy sample pinned
  3. model.py   4. train.py (DDP == one process, kill -9 + resume is bit-identical, the dtype
     choice)   5. sample.py   6. retrieve.py   7. prepare.py (a local stand-in for the hub)
  8. bench.py   9. CUDA: sections 1, 2 and 4 on a GPU's kernels (skipped without one)
 10. fixtures and helpers, the local hub server
 11. refusals in every script: status 2, one `error:` line naming the culprit, nothing overwritten
"""
import ast, contextlib, dataclasses, fnmatch, hashlib, http.server, importlib.util, io, json
import math, os, platform, random, re, shutil, signal, socket, subprocess, sys, threading, time
import types, urllib.parse

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import bench, model as M, prepare, retrieve, sample, train
from model import ModelConfig, build_model
from prepare import Tokenizer, docstring_pairs, ict_pairs

HERE = os.path.dirname(os.path.abspath(__file__))  # the repo: scripts run from here
MAINS = {'train': train.main, 'sample': sample.main, 'retrieve': retrieve.main,
         'prepare': prepare.main, 'bench': bench.main}


# =============================================================================
# 1. the three teaching tests

V, N, D = 40, 12, 16       # vocab, n_ctx, d_model of the tiny test models
ARCHS = ('mixer', 'llama', 'gpt', 'hybrid', 'gmlp', 'elita')
VOCAB, N_CTX = 97, 16      # the decoding tests' (tiny_model's) vocab and n_ctx


def name(variant):
    return '-'.join(f'{k}={x}' for k, x in variant.items()) or 'default'


# every causal model: each arch, each mixer variant and combinations, each causal objective; each
# is also a cached decoding path (section 2)
VARIANTS = [
    dict(arch='mixer'), dict(arch='mixer', kernel=3),
    dict(arch='mixer', kernel=2),                                  # asymmetric 'same' padding
    dict(arch='mixer', expansion=2.0), dict(arch='mixer', expansion=0.5),  # rows past / short of n
    dict(arch='mixer', expansion=1.5, kernel=3), dict(arch='mixer', n_convs=3),
    dict(arch='mixer', n_heads=4), dict(arch='mixer', softmax=True),
    dict(arch='mixer', n_heads=2, kernel=3, softmax=True, n_convs=2),
    dict(arch='mixer', pos_emb=True), dict(arch='mixer', pos_channel='input'),
    dict(arch='mixer', pos_channel='every', n_convs=2),
    dict(arch='mixer', pos_channel='input', expansion=2.0, kernel=3),
    dict(arch='mixer', tie_weights=True),
    dict(arch='llama'), dict(arch='gpt'), dict(arch='hybrid'),
    dict(arch='hybrid', kernel=2, n_convs=2),
    dict(arch='hybrid', kernel=3, n_convs=2), dict(arch='hybrid', hybrid_order='mix_attn'),
    dict(arch='hybrid', hybrid_order='parallel'), dict(arch='gmlp'), dict(arch='elita'),
    dict(arch='mixer', objective='mtp2'), dict(arch='mixer', objective='mtp2', tie_weights=True),
    dict(arch='llama', objective='mtp2'), dict(arch='elita', objective='mtp2'),
]
PADDED = [(dict(arch=a), p) for a in ARCHS for p in ('right', 'left')]


def test_mixing_is_tril_w_x_plus_b():
    """The masked mixer's core, written out by hand: out[t] = sum_{s<=t} W[t, s] x[s] + b[t] for
    every channel, which is tril(W) @ x + b; what W holds above the diagonal (the future) is
    unread."""
    torch.manual_seed(0)
    mix = M.Mixing(N, N).double()                      # weight (1, N, N), bias (1, N, 1)
    x = torch.randn(2, 1, N, D, dtype=torch.float64)   # (B, heads, positions, channels)
    W, b = mix.weight[0], mix.bias[0, :, 0]            # (N, N), (N,)
    by_hand = torch.zeros(2, N, D, dtype=torch.float64)
    for t in range(N):
        for s in range(t + 1):
            by_hand[:, t] += W[t, s] * x[:, 0, s]
        by_hand[:, t] += b[t]
    out = mix(x)[:, 0]                                 # (B, N, D)
    # float64: the hand loop sums the same <= N terms in another order, ~N * 2^-53 of ~1
    torch.testing.assert_close(out, by_hand, rtol=0, atol=1e-12)
    assert torch.equal(mix(x), mix.weight.tril() @ x + mix.bias)   # the same ops: bit for bit
    with torch.no_grad():
        mix.weight.add_(100 * torch.ones(N, N).triu(1))   # move only the future's weights
    assert torch.equal(mix(x)[:, 0], out)


@pytest.mark.parametrize('variant,padding', [(v, None) for v in VARIANTS] + PADDED,
                         ids=lambda x: name(x) if isinstance(x, dict) else str(x))
def test_future_tokens_never_reach_past_logits(variant, padding):
    """Changing the tokens after t leaves the logits up to t bit-identical, and their gradient with
    respect to those tokens' embeddings is exactly zero, not just small. The past does matter."""
    gen = torch.Generator().manual_seed(1)
    assert_causal(make(tiny(**variant)), *padded_batch(padding, gen), gen)


def assert_causal(model, idx, mask, gen, amp=contextlib.nullcontext):
    """The test above, on the device of idx, each forward and backward under the context amp()."""
    with amp():
        logits, _ = model(idx, mask=mask)
    assert torch.isfinite(logits).all()
    for t in (0, 4, N - 2):
        other = idx.clone()
        other[:, t + 1:] = torch.randint(0, V, (2, N - t - 1), generator=gen).to(idx.device)
        with amp():
            assert torch.equal(model(other, mask=mask)[0][:, :t + 1], logits[:, :t + 1])
            grad = embedding_grad(model, idx, mask, lambda lg: lg[:, t].float().pow(2).sum())
        assert torch.count_nonzero(grad[:, t + 1:]) == 0
        assert torch.count_nonzero(grad[:, :t + 1]) > 0


def test_non_causal_mixer_does_mix_backwards():
    """The control: on a model that mixes both ways the causality test above fails, by
    perturbation and by gradient."""
    gen = torch.Generator().manual_seed(1)
    with pytest.raises(AssertionError):
        assert_causal(make(tiny(causal=False)), *padded_batch(None, gen), gen)
    grad = embedding_grad(make(tiny(causal=False)), torch.randint(0, V, (2, N)), None,
                          lambda lg: lg[:, 0].pow(2).sum())
    assert torch.count_nonzero(grad[:, 1:]) > 0


@pytest.mark.parametrize('variant', VARIANTS, ids=name)
def test_window_equals_cache_equals_full_forward(variant):
    """The paper's window (re-run whole each step), the cache (one position a step) and the training
    forward: the same greedy tokens for 2.5 windows (both slide alike), the same logits in the
    first."""
    model, idx = tiny_model(**variant), prompt(5)
    logit_c, tok_c = window_equals_cache(model, idx)
    full, _ = model(torch.cat([idx, tok_c[:, :N_CTX - 5]], 1))      # (B, N_CTX, vocab)
    torch.testing.assert_close(logit_c[:, :N_CTX - 5], full[:, 4:-1], atol=1e-4, rtol=0)


def window_equals_cache(model, idx):
    """Greedy decoding for 2.5 windows both ways: the same tokens, logits within 1e-4."""
    tok_w, logit_w = decode(model, idx, 2 * N_CTX + N_CTX // 2, 'window')
    tok_c, logit_c = decode(model, idx, 2 * N_CTX + N_CTX // 2, 'cache')
    assert torch.equal(tok_w, tok_c) and len(tok_c.unique()) > 3    # > 3: not a trivial comparison
    torch.testing.assert_close(logit_c, logit_w, atol=1e-4, rtol=0)
    return logit_c, tok_c


# =============================================================================
# 2. the golden run: train.py end to end with its numbers pinned, as llama2.c's test_all.py pins
# its model's output. Recorded at one thread, float32, seed 1337, on the `data` corpus.

GOLDEN_STEPS = 30
GOLDEN_LOSS = dict(train_loss=1.4176280498504639, val_loss=1.2088258266448975)  # at step 30
GOLDEN_TOKENS = [269, 267, 280, 281, 279, 261, 14, 269, 267, 280, 281, 279, 261, 14, 269, 267,
                 280, 280, 280, 280]  # greedy from BOS
# Summing in other orders (2 threads instead of 1; every Linear as (W x^T)^T; ATen's unvectorized
# kernels with MKL held to SSE4.2) moved the losses after 30 Adam steps by <= 1.3e-7 relative; a
# 1 % larger lr moves the train loss by 1e-3 relative: rel 1e-5 is ~75x the first, 1/100 the second.
GOLDEN_REL = 1e-5
# top-1 minus top-2 logit: >= 0.07 here, and those re-summed runs moved it by <= 5e-6
GOLDEN_MARGIN = 1e-3


def test_golden_run(data, tmp_path):
    """30 steps of train.py on either CPU kind (float32 asked, so no dtype choice enters): the
    losses it logs, and 20 greedy tokens of the trained model, each chosen by a margin wide enough
    that no other kernel's rounding can flip it."""
    assert train_run(data, tmp_path, '--dtype=float32', f'--max_iters={GOLDEN_STEPS}',
                     f'--eval_interval={GOLDEN_STEPS}') == 0
    last = records(tmp_path, 'val_loss')[-1]
    assert last['step'] == GOLDEN_STEPS
    for key, want in GOLDEN_LOSS.items():
        assert last[key] == pytest.approx(want, rel=GOLDEN_REL), (key, last[key])
    model = train.model_from_checkpoint(weights(tmp_path)).eval()
    bos = torch.tensor([[Tokenizer.from_dir(data).bos_id]])
    tokens, logits = decode(model, bos, len(GOLDEN_TOKENS), 'cache')   # (1, K), (1, K, vocab)
    top2 = logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > GOLDEN_MARGIN
    assert tokens[0].tolist() == GOLDEN_TOKENS


# =============================================================================
# 3. model.py: the models against written-out references, their other masks, decoding,
# accounting, configuration

def test_mixings_and_mlps_match_their_formulas():
    """n_convs=p is sum_i GELU(tril(W_i) x + b_i) (the author's parallel convolutions), not one flat
    tril(W) x + b; a softmax mixing's rows are distributions over the past; gpt's MLP uses GPT-1's
    tanh GELU, the mixer's the exact one."""
    par, flat = make(tiny(n_convs=2)), make(tiny())
    sd = par.state_dict()  # the flat mixer whose W and b are the sums of the two mixings'
    flat.load_state_dict({k: sd[k] if k in sd else sd[k.replace('mix.', 'mix.0.')]
                          + sd[k.replace('mix.', 'mix.1.')] for k in flat.state_dict()})
    idx = torch.randint(0, V, (2, N))
    assert (par(idx)[0] - flat(idx)[0]).abs().max() > 1e-3
    mix, one = par.backbone.blocks[0].mixers[0].mix, flat.backbone.blocks[0].mixers[0].mix
    x = torch.randn(2, 1, N, D, dtype=torch.float64)
    w, b = [m.weight[0].tril() for m in mix], [m.bias[0] for m in mix]    # (N, N), (N, 1) each
    assert torch.allclose(mix(x)[:, 0], sum(F.gelu(w[i] @ x[:, 0] + b[i]) for i in range(2)))
    assert torch.allclose(one(x)[:, 0], one.weight[0].tril() @ x[:, 0] + one.bias[0])
    soft = make(tiny(softmax=True)).backbone.blocks[0].mixers[0].mix
    # (n_out, n_in) rows
    m = soft(torch.eye(N, dtype=torch.float64)[None, None])[0, 0] - soft.bias[0]
    assert torch.allclose(m.sum(-1), torch.ones(N, dtype=m.dtype))
    assert torch.count_nonzero(m.triu(1)) == 0 and (m.tril() > 0).sum() == N * (N + 1) // 2
    x = torch.randn(3, D, dtype=torch.float64)
    for arch, approx in (('gpt', 'tanh'), ('mixer', 'none')):
        mlp = make(tiny(arch=arch)).backbone.blocks[0].ffn
        assert torch.equal(mlp(x), mlp.out(F.gelu(mlp.fc(x), approximate=approx)))
    gelu_tanh = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    assert torch.allclose(F.gelu(x, approximate='tanh'), gelu_tanh)


@pytest.mark.parametrize('variant', [dict(), dict(kernel=3), dict(n_heads=2, kernel=3),
                                     dict(softmax=True), dict(expansion=2.0), dict(expansion=0.5),
                                     dict(n_convs=3), dict(arch='hybrid'), dict(arch='gmlp')],
                         ids=name)
def test_masked_weights_get_exactly_zero_gradient(variant):
    """Above the diagonal a mixing weight gets no gradient; every allowed entry that is read gets
    one. param_counts' mixing_effective (no masked entries, no never-read hidden rows) counts just
    those."""
    model = make(tiny(**variant))
    counts = bench.param_counts(model)
    model(torch.randint(0, V, (2, N)), torch.randint(0, V, (2, N)))[1].backward()
    mixings = [m for m in model.modules() if isinstance(m, M.Mixing)]
    for mix in mixings:
        keep = M.allowed('causal', mix.weight, 0)             # (n_out, n_in)
        g = mix.weight.grad  # (H, n_out, n_in) or (H, k, n_out, n_in)
        assert torch.count_nonzero(g * ~keep) == 0
        used = keep.clone()
        used[N:] = False  # e > 1: hidden rows past n_ctx are never read, so they get no gradient
        used[0] &= not mix.softmax  # a softmax over one allowed entry is the constant 1
        assert torch.count_nonzero(g * used) == used.sum() * g[..., 0, 0].numel()
    kinds = (M.TokenMixing, M.Mixing, M.Attention)
    params = {id(p): p for m in model.modules() if isinstance(m, kinds) for p in m.parameters()}
    assert sum(p.numel() for p in params.values()) == counts['mixing']
    constant = sum(m.weight[..., 0, 0].numel() for m in mixings if m.softmax)
    nonzero = sum(int(torch.count_nonzero(p.grad)) for p in params.values())
    assert nonzero == counts['mixing_effective'] - constant
    # a tril and its bias per layer
    assert variant or counts['mixing_effective'] == 2 * (N * (N + 1) // 2 + N)


@pytest.mark.parametrize('objective,arch,T', [
    ('clm', 'mixer', N), ('mtp2', 'mixer', N), ('mtp2', 'llama', N), ('half', 'mixer', N),
    ('half', 'llama', N), ('half', 'elita', N), ('half', 'mixer', N // 2),
    ('half', 'llama', N // 2)])
def test_loss_never_sees_what_it_predicts(objective, arch, T):
    """A loss with one target at j (half: its own targets, the second half, also for inputs shorter
    than n_ctx) is unchanged by the tokens it predicts and has exactly zero gradient there."""
    model = make(tiny(arch=arch, objective=objective))
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(3))
    if objective == 'half':
        unseen = M.half_split(T)
        targets = M.objective_targets('half', idx, None)
        assert (targets[:, :unseen] == -1).all() and (targets[:, unseen:] >= 0).all()
    else:
        unseen, targets = T - 2, torch.full_like(idx, -1)
        targets[:, T - 3] = 3
    other = idx.clone()
    other[:, unseen:] = (idx[:, unseen:] + 1) % V
    assert torch.equal(model(idx, targets)[1], model(other, targets)[1])
    grad = embedding_grad(model, idx, None, lambda lg: model(idx, targets)[1])
    assert torch.count_nonzero(grad[:, unseen:]) == 0 and torch.count_nonzero(grad[:, :unseen]) > 0


def test_objective_targets():
    x, y = torch.arange(8).view(1, 8), torch.arange(1, 9).view(1, 8)
    mask = torch.tensor([[True] * 6 + [False] * 2])
    assert torch.equal(M.objective_targets('clm', x, y, mask), y)
    assert M.objective_targets('autoencoder', x, y, mask).tolist() == [[0, 1, 2, 3, 4, 5, -1, -1]]
    assert M.objective_targets('half', x, y, mask).tolist() == [[-1, -1, -1, -1, 4, 5, -1, -1]]


def test_expanded_mixer_below_one_loses_tokens():
    """Paper fig S3: with e < 1 tokens at positions >= e*n reach no other position (their own by the
    residual)."""
    model = make(tiny(expansion=0.5, n_layers=1))
    grad = embedding_grad(model, torch.randint(0, V, (2, N)), None,
                          lambda lg: lg[:, N - 1].pow(2).sum())
    assert torch.count_nonzero(grad[:, N // 2:N - 1]) == 0
    assert torch.count_nonzero(grad[:, :N // 2]) > 0


@pytest.mark.parametrize('arch,share_ffn,pos_channel', [
    (a, s, 'none') for a in ('mixer', 'llama') for s in (True, False)] + [('mixer', True, 'every')])
def test_bidirectional_lm_never_sees_the_token_it_predicts(arch, share_ffn, pos_channel):
    """Its logit at t predicts token t+1 from both sides: t+1 itself has no effect, t and t+2 do."""
    model = make(tiny(arch=arch, objective='bidirectional', share_ffn=share_ffn,
                      pos_channel=pos_channel))
    idx = torch.randint(0, V, (2, N))
    logits, _ = model(idx)
    for t in (0, 4, N - 3):
        other = idx.clone()
        other[:, t + 1] = (idx[:, t + 1] + 1) % V
        assert torch.equal(model(other)[0][:, t], logits[:, t])
        grad = embedding_grad(model, idx, None, lambda lg: lg[:, t].pow(2).sum())
        assert torch.count_nonzero(grad[:, t + 1]) == 0
        assert torch.count_nonzero(grad[:, t]) > 0 and torch.count_nonzero(grad[:, t + 2]) > 0


@pytest.mark.parametrize('arch', ['mixer', 'llama'])
def test_autoencoder_sees_input_only_through_its_embedding(arch):
    """The decoder reads only the encoder's last position, a (B, d_model) vector that depends on
    every token."""
    model = make(tiny(arch=arch, objective='autoencoder'))
    idx = torch.randint(0, V, (2, N))
    z = model.encode(idx)
    assert z.shape == (2, D) and torch.allclose(model.decode(z, N), model(idx)[0])
    h = model.hidden(idx).detach().requires_grad_()
    model.decode(h[:, -1], N).pow(2).sum().backward()
    assert torch.count_nonzero(h.grad[:, :-1]) == 0 and torch.count_nonzero(h.grad[:, -1]) > 0
    other = idx.clone()
    other[:, 0] = (idx[:, 0] + 1) % V
    assert not torch.equal(model.encode(other), z)


def reference_attention(x, attn, mask=None):
    """softmax(Q K^T / sqrt(d) + mask) V written out, with RoPE from its complex definition."""
    B, T, d = x.shape
    h, hd = attn.heads, d // attn.heads
    biases = attn.qkv.bias.chunk(3) if attn.qkv.bias is not None else (None,) * 3
    q, k, v = (F.linear(x, w, b).view(B, T, h, hd).transpose(1, 2)
               for w, b in zip(attn.qkv.weight.chunk(3), biases))
    if attn.rope:  # pair (j, j + hd/2) is one complex number, rotated by angle pos * 10000^(-2j/hd)
        theta = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        rot = torch.polar(torch.ones(T, hd // 2, dtype=torch.float64),
                          torch.arange(T)[:, None] * theta)
        rotated = (torch.complex(t[..., :hd // 2], t[..., hd // 2:]) * rot for t in (q, k))
        q, k = (torch.cat([z.real, z.imag], -1) for z in rotated)
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    if mask is not None:
        allowed = allowed & (mask[:, None, None, :] | torch.eye(T, dtype=torch.bool))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~allowed, float('-inf'))
    return attn.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, d))


@pytest.mark.parametrize('arch', ['llama', 'gpt'])
@pytest.mark.parametrize('padding', [None, 'left', 'right'])
def test_attention_matches_explicit_computation(arch, padding):
    attn = make(tiny(arch=arch)).backbone.blocks[0].mixers[0]
    x = torch.randn(2, N, D, dtype=torch.float64)
    mask = padded_batch(padding, torch.Generator().manual_seed(0))[1]
    assert torch.allclose(attn(x, mask=mask), reference_attention(x, attn, mask), atol=1e-10)


@pytest.mark.parametrize('objective', ['clm', 'autoencoder', 'bidirectional'])
@pytest.mark.parametrize('where', ['input', 'every'])
def test_position_channel_is_appended_and_the_head_never_reads_it(where, objective):
    """The blog's ablation (the author's code): blocks run at width d_model + 1, the token embedding
    whole in the first d_model channels and t - n_ctx/2 in the last (with 'every' rewritten before
    each later block); every stack hands on only the d_model token channels (lm head, hidden())."""
    model = make(tiny(pos_channel=where, objective=objective))
    idx = torch.randint(0, V, (2, N - 3))
    ins = []  # each block's input (B, T, D + 1)
    stacks = [m for m in model.modules() if isinstance(m, M.Backbone)]
    blocks = [m for m in model.modules() if isinstance(m, M.Block)]
    hooks = [b.register_forward_pre_hook(lambda mod, args: ins.append(args[0])) for b in blocks]
    moved = 100 * F.one_hot(torch.tensor(D), D + 1)  # (D + 1,): only the position channel
    hooks += [st.blocks[-1].register_forward_hook(lambda mod, a, out: out + moved) for st in stacks]
    try:
        logits = model(idx)[0]
    finally:
        for h in hooks:
            h.remove()
    centred = torch.arange(N - 3, dtype=logits.dtype) - N // 2
    assert model.lm_head.in_features == D and model.hidden(idx).shape == (2, N - 3, D)
    assert all(x.shape == (2, N - 3, D + 1) for x in ins) and len(ins) == len(blocks)
    wte = next(m for m in model.modules() if isinstance(m, nn.Embedding))
    assert torch.equal(ins[0][..., :D], wte(idx))
    is_position = [torch.equal(x[0, :, -1], centred) for x in ins]
    assert is_position == [True, where == 'every'] * len(stacks)
    assert torch.equal(model(idx)[0], logits)  # the head did not see the moved channel


def test_position_channel_keeps_the_init_loss():
    """An appended channel the head never reads leaves the loss at init where it is without one;
    read by the head (overwriting a token channel), t - n_ctx/2 raised it past the seeds' spread.
    (At n_ctx 512 the norms, which see |t - n_ctx/2| up to 256, shrink the blocks' first updates
    and the loss starts ~0.1 nearer ln V than without: the author's blocks of width d + 1 do so.)"""
    def init_loss(pos_channel, seed):
        torch.manual_seed(seed)
        cfg = ModelConfig(vocab_size=128, n_ctx=32, d_model=32, n_layers=2, pos_channel=pos_channel)
        model = build_model(cfg)
        idx = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            return model(idx, idx)[1].item()
    none = [init_loss('none', seed) for seed in range(5)]
    spread = max(none) - min(none)  # how far the init loss moves with the seed alone
    for where in ('input', 'every'):
        losses = [init_loss(where, seed) for seed in range(5)]
        assert abs(np.mean(losses) - np.mean(none)) <= spread, (where, losses, none)


def test_transformer_autoencoder_decoder_is_position_blind():
    """Attention over one vector repeated returns it whatever RoPE does: every position decodes
    alike (why it autoencodes poorly, paper fig 8). The mixer's position-specific weights do not."""
    idx = torch.randint(0, V, (2, N))
    llama, _ = make(tiny(arch='llama', objective='autoencoder'))(idx)
    assert torch.allclose(llama, llama[:, :1].expand_as(llama), atol=1e-10)
    mixer, _ = make(tiny(objective='autoencoder'))(idx)
    assert not torch.allclose(mixer, mixer[:, :1].expand_as(mixer), atol=1e-3)


@pytest.mark.parametrize('arch', ['mixer', 'llama'])
def test_bidirectional_streams_share_feedforwards_as_the_author_did(arch):
    """The author's bidirectional mixer: each block's feed-forward and its norm serve both streams;
    the mixings (or attentions) stay per stream. His bidirectional llama is two separate stacks.
    share_ffn=None (default) picks that per arch; True or False overrides it."""
    default = tiny(arch=arch, objective='bidirectional')
    assert default.share_ffn is (arch == 'mixer')  # resolved, so a checkpoint stores what was built
    other = dataclasses.asdict(dataclasses.replace(default, share_ffn=arch != 'mixer'))
    assert ModelConfig(**other).share_ffn is (arch != 'mixer')  # a stored choice rebuilds as it was
    shared, apart = (build_model(tiny(arch=arch, objective='bidirectional',
                                      share_ffn=s)) for s in (True, False))
    for f, r in zip(shared.fwd.blocks, shared.rev.blocks):
        assert f.ffn is r.ffn and f.norms[-1] is r.norms[-1] and f.mixers[0] is not r.mixers[0]
    ffn = sum(p.numel() for b in apart.fwd.blocks for p in [*b.ffn.parameters(),
                                                            *b.norms[-1].parameters()])
    # a shared parameter counts once
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(apart) - count(shared) == ffn
    # same keys, so loading checks the values:
    assert set(shared.state_dict()) == set(apart.state_dict())
    # separate feed-forwards never load as shared
    with pytest.raises(ValueError, match='share_ffn'):
        shared.load_state_dict(apart.state_dict())
    apart.load_state_dict(shared.state_dict())  # shared ones load as two equal copies
    x = torch.randint(0, V, (2, N))
    shared(x, x)[1].backward()
    assert all(p.grad is not None for p in shared.parameters())


def test_retrieval_mixer_only_position_dependence_is_its_mixing_weights():
    """Permuting the targets and the mixing weights' rows and columns alike permutes the logits."""
    torch.manual_seed(0)
    net, x = M.RetrievalMixer(D, 2, 6).double(), torch.randn(3, 6, D, dtype=torch.float64)
    logits, loss = net(x, torch.tensor([0, 2, 4]))
    assert logits.shape == (3, 5) and loss.ndim == 0
    perm = torch.tensor([0, 3, 1, 5, 2, 4])          # the query stays first, targets shuffled
    with torch.no_grad():
        for mix in (m for m in net.modules() if isinstance(m, M.Mixing)):
            mix.weight.copy_(mix.weight[..., perm, :][..., perm])
            mix.bias.copy_(mix.bias[..., perm, :])
    assert torch.allclose(net(x[:, perm])[0], logits[:, perm[1:] - 1])


def test_elita_recurrent_equals_parallel_across_scan_blocks():
    """ELiTA's O(1)-state recurrence equals its blockwise scan, from a prompt spanning a block
    boundary."""
    model = tiny_model(arch='elita', n_ctx=2 * M.ELITA_CHUNK + 22)
    idx = prompt(M.ELITA_CHUNK + 5, batch=1)
    tokens, logits = decode(model, idx, model.cfg.n_ctx - idx.shape[1], 'cache')
    full, _ = model(torch.cat([idx, tokens], 1))
    torch.testing.assert_close(logits, full[:, idx.shape[1] - 1:-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize('method', ['window', 'cache'])
def test_slide_reencodes_last_half_window(method):
    """Once the window is full, the next token comes from the last n_ctx/2 tokens placed at the
    window start (checked against a fresh generation from them); a long prompt keeps its last
    window."""
    model = tiny_model(arch='mixer', kernel=3)
    seq = model.generate(prompt(4, batch=1), N_CTX + 3, temperature=0, method=method)
    for i in (N_CTX + 1, N_CTX + 2):                               # positions after a slide
        assert model.generate(seq[:, N_CTX + 1 - N_CTX // 2:i], 1, temperature=0,
                              method=method)[0, -1] == seq[0, i]
    long = prompt(N_CTX + 7, batch=1)
    a, b = (model.generate(p, 4, temperature=0, method=method)[:, -4:]
            for p in (long, long[:, -N_CTX:]))
    assert torch.equal(a, b)


@pytest.mark.parametrize('method', ['window', 'cache'])
def test_same_seed_same_sample(method):
    model = tiny_model(arch='mixer', n_heads=2)
    kw = dict(temperature=0.9, top_k=20, top_p=0.95, method=method)
    runs = [model.generate(prompt(3), 24, generator=torch.Generator().manual_seed(s),
                           **kw) for s in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_sampling_filters():
    """top_k=1 and a tiny top_p are greedy; every top_k sample lies in the k best logits."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, VOCAB, generator=g)
    assert torch.equal(M.sample_token(logits, 1.0, top_k=1, generator=g), logits.argmax(-1))
    assert torch.equal(M.sample_token(logits, 1.0, top_p=1e-6, generator=g), logits.argmax(-1))
    best5 = logits.topk(5, dim=-1).indices
    for _ in range(10):
        assert (best5 == M.sample_token(logits, 2.0, top_k=5, generator=g)[:, None]).any(-1).all()
    assert len(M.sample_token(logits, 5.0, generator=g).unique()) > 10  # no filter: spread out


def test_checkpoints_of_the_older_layout_are_refused_in_one_line(tmp_path):
    """Weights saved when blocks were lists of sublayers ('blocks.0.layers.0...') are not
    migrated: loading them names the commit that reads them."""
    sd = {k.replace('mixers.0', 'layers.0').replace('ffn', 'layers.1'): v
          for k, v in build_model(tiny()).state_dict().items()}
    train.save_checkpoint({'kind': 'lm', 'model': sd, 'model_config': {}}, tmp_path / 'old.pt')
    with pytest.raises(ValueError, match=f'older model layout.*{train.OLD_LAYOUT}'):
        train.load_checkpoint(tmp_path / 'old.pt')


def test_param_counts_and_flops():
    """flops_per_token counts work per use: a feed-forward both streams run counts twice, shared or
    not; an expanded mixing counts the rows that run: e >= 1 computes n_ctx hidden rows whatever e
    (12 min(e, 1) n_ctx d)."""
    cfg, llama = tiny(), tiny(arch='llama')
    counts = bench.param_counts(build_model(cfg))
    assert counts['total'] == sum(p.numel() for p in build_model(cfg).parameters())
    # one n_ctx x n_ctx matrix + bias per layer
    assert counts['mixing'] == cfg.n_layers * (N * N + N)
    assert counts['feedforward'] == cfg.n_layers * (2 * 4 * D * D + 5 * D)
    assert counts['embedding'] == 2 * V * D
    # PaLM-style: 6 x (params but embedding table and mixing; lm head in) + 6 n_ctx d per mixing
    dense = counts['total'] - counts['mixing'] - V * D
    assert M.flops_per_token(cfg) == 6 * dense + 2 * 6 * N * D
    total = sum(p.numel() for p in build_model(llama).parameters())
    assert M.flops_per_token(llama) == 6 * (total - V * D) + 2 * 12 * N * D
    mtp2 = dataclasses.replace(llama, objective='mtp2')
    assert M.flops_per_token(mtp2) == 2 * M.flops_per_token(llama)
    for arch in ('mixer', 'llama'):
        shared, apart = (tiny(arch=arch, objective='bidirectional', share_ffn=s)
                         for s in (True, False))
        assert M.flops_per_token(shared) == M.flops_per_token(apart)
    e = {x: M.flops_per_token(tiny(expansion=x)) for x in (0.5, 1.0, 2.0)}
    assert e[2.0] == e[1.0] == e[0.5] + 2 * 6 * N * D  # two layers, 6 n d more than e = 0.5 each


FLOP_VARIANTS = VARIANTS + [
    dict(arch=a, objective=o) for a in ('mixer', 'llama') for o in ('autoencoder', 'half')] + [
    dict(arch=a, objective='bidirectional', share_ffn=s)
    for a in ('mixer', 'llama') for s in (True, False)
] + [dict(objective='half', arch='elita'), dict(objective='bidirectional', pos_channel='every'),
     dict(objective='autoencoder', pos_channel='input')]


@pytest.mark.parametrize('variant', FLOP_VARIANTS, ids=name)
def test_flops_per_token_is_what_one_training_step_runs(variant):
    """flops_per_token x tokens = the matmul and convolution FLOPs FlopCounterMode sees in one
    forward and backward, plus what it cannot see, counted per use: 6 x (biases, norm gains, ELiTA's
    sinusoid parameters) per token and pass. Its one miscount: a grouped conv's weight gradient
    (kernel > 1 with heads) costs heads x a dense one there (conv_backward_flop ignores groups)."""
    from torch.utils.flop_counter import FlopCounterMode
    cfg = tiny(**variant)
    model, idx = perturbed(cfg, 0.05), torch.randint(0, V, (2, N))
    with FlopCounterMode(display=False) as counter:
        model(idx, M.objective_targets(cfg.objective, idx, idx))[1].backward()
    unseen, miscount = 0, 0
    channels = {id(m): t.width // t.heads for t in model.modules() if isinstance(t, M.TokenMixing)
                for m in t.modules()}
    for _, mod in model.named_modules(remove_duplicate=False):  # a shared module runs twice
        if not isinstance(mod, (M.Mixing, nn.Embedding)):
            unseen += sum(p.numel() for k, p in mod.named_parameters(recurse=False)
                          if not (isinstance(mod, nn.Linear) and k == 'weight'))
        elif isinstance(mod, M.ConvMixing):  # its forward is 1/3 of the 6 x term
            rows, cols = (min(size, N) for size in mod.weight.shape[-2:])
            forward = 2 * mod.weight[..., 0, 0].numel() * rows * cols * channels[id(mod)] / N
            miscount += (mod.weight.shape[0] - 1) * forward
    passes, tokens = 2 if cfg.objective == 'mtp2' else 1, idx.numel()
    expected = tokens * (M.flops_per_token(cfg) - 6 * unseen * passes + miscount)
    # rel: only the float rounding of the divisions by n_ctx
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize('variant', [dict(arch=a) for a in ARCHS] + [
    dict(objective='autoencoder'), dict(objective='bidirectional'),
    dict(arch='llama', objective='bidirectional')],
    ids=name)  # not the llama autoencoder: it is position-blind (above)
def test_every_arch_overfits_one_batch(variant):
    """Within 200 AdamW steps the loss on one batch falls below a tenth of where it started."""
    cfg = tiny(d_model=32, **variant)
    torch.manual_seed(0)
    model, idx = build_model(cfg), torch.randint(0, V, (4, N + 1))
    x, targets = idx[:, :-1], M.objective_targets(cfg.objective, idx[:, :-1], idx[:, 1:])
    opt, losses = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0), []
    for _ in range(200):
        loss = model(x, targets)[1]
        losses.append(loss.item())
        if losses[-1] < 0.1 * losses[0]:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < 0.1 * losses[0]


@pytest.mark.parametrize('kw,key', [
    (dict(arch='mamba'), 'arch'), (dict(d_model=0), 'd_model'), (dict(n_ctx=-4), 'n_ctx'),
    (dict(d_model=18, n_heads=4), 'n_heads'), (dict(kernel=0), 'kernel'),
    (dict(kernel=99), 'kernel'), (dict(arch='llama', kernel=3), 'arch'),
    (dict(expansion=-1.0), 'expansion'), (dict(objective='mlm'), 'objective'),
    (dict(arch='gpt', objective='autoencoder'), 'objective'),
    (dict(arch='elita', causal=False), 'causal'),
    (dict(arch='llama', d_model=12, n_heads=4), 'n_heads'),
    (dict(expansion=2.0, n_convs=2), 'n_convs'),
    (dict(objective='bidirectional', softmax=True), 'softmax'),
    (dict(pos_channel='all'), 'pos_channel'), (dict(hybrid_order='parallel'), 'hybrid_order'),
    (dict(arch='llama', pos_channel='input'), 'pos_channel'),
    (dict(n_heads=2, pos_channel='every'), 'pos_channel'), (dict(share_ffn=False), 'share_ffn'),
    (dict(arch='hybrid', hybrid_order='attn'), 'hybrid_order'),
    (dict(objective='bidirectional', share_ffn=1), 'share_ffn')])
def test_bad_config_is_a_one_line_value_error_naming_the_field(kw, key):
    with pytest.raises(ValueError, match=key) as err:
        tiny(**kw)
    assert '\n' not in str(err.value)


def test_bad_inputs_are_value_errors():
    model = build_model(tiny())
    with pytest.raises(ValueError, match='n_ctx'):
        model(torch.zeros(1, N + 1, dtype=torch.long))
    with pytest.raises(ValueError, match='vocab_size'):
        model(torch.full((1, 4), V, dtype=torch.long))
    with pytest.raises(ValueError, match='generation'):   # the half objective cannot generate
        next(build_model(tiny(objective='half')).stream(torch.zeros(1, 2, dtype=torch.long), 1))


def test_stream_runs_one_forward_per_yielded_token():
    """A drained stream of n tokens runs the prefill and n - 1 cached steps, none after the last."""
    model, calls = tiny_model(), []

    def step(tok, pos, cache):
        calls.append(pos)
        return model.step(tok, pos, cache)
    assert len(list(model.stream(prompt(4), 3, temperature=0, step=step))) == 3
    assert calls == [4, 5]                     # the 2nd and 3rd tokens; the 1st is the prefill's


# =============================================================================
# 4. train.py

LEARNS = ([(a, o, []) for a in ARCHS for o in ('clm', 'mtp2', 'half')]
          + [(a, o, []) for a in ('mixer', 'llama') for o in ('autoencoder', 'bidirectional')]
          # padded batches, pad mask
          + [('llama', 'clm', ['--batch_mode=documents', '--padding=left'])])


@pytest.mark.parametrize('arch,objective,extra', LEARNS,
                         ids=[f'{a}-{o}' + '-docs' * bool(e) for a, o, e in LEARNS])
def test_every_arch_and_objective_learns(data, tmp_path, arch, objective, extra):
    """20 steps lower the training loss by 0.5 nats; the checkpoint rebuilds the trained model."""
    ckpt = learns(data, tmp_path, f'--arch={arch}', f'--objective={objective}', *extra)
    assert ckpt['step'] == 20 and ckpt['model_config']['objective'] == objective
    head = train.model_from_checkpoint(ckpt).state_dict()['lm_head.weight']
    assert torch.equal(head, ckpt['model']['lm_head.weight'])


def learns(data, out, *extra):
    """The checkpoint of 20 train.py steps, which lowered the training loss by 0.5 nats."""
    assert train_run(data, out, '--max_iters=20', '--eval_interval=20', *extra) == 0
    evals = records(out, 'val_loss')
    assert [r['step'] for r in evals] == [0, 20]
    assert evals[1]['train_loss'] < evals[0]['train_loss'] - 0.5
    return weights(out)


@pytest.mark.parametrize('padding', ['right', 'left'])
def test_document_batches(data, padding):
    """Each row is one n_ctx-aligned chunk of one document, padded; a short row ends its document.
    A batch is a pure function of (split, step, micro-step)."""
    n, meta = 32, train.load_meta(data)
    get = train.Batches(dict(train.DEFAULTS, n_ctx=n, batch_size=16, batch_mode='documents',
                             padding=padding, objective='clm'), meta, data)
    x, y, mask = get('train', 3, 1)
    assert torch.equal(x, get('train', 3, 1)[0]) and not torch.equal(x, get('train', 3, 0)[0])
    stream = np.fromfile(os.path.join(data, 'train.bin'), dtype=meta['dtype']).astype(np.int64)
    starts = np.load(os.path.join(data, 'train_docs.npy'))
    chunks = {(s + k): e for s, e in zip(starts, np.append(starts[1:], len(stream)))
              for k in range(0, e - s - 1, n)}
    for row in range(16):
        real = mask[row].nonzero()[:, 0]
        # one contiguous run
        assert len(real) and (real == torch.arange(real[0], real[-1] + 1)).all()
        assert (real[0] == 0) if padding == 'right' else (real[-1] == n - 1)
        assert (x[row, ~mask[row]] == meta['pad_id']).all() and (y[row, ~mask[row]] == -1).all()
        w = np.append(x[row, real].numpy(), y[row, real[-1]].item())  # inputs + the last target
        hits = [p for p, end in chunks.items()
                if p + len(w) <= end and (stream[p:p + len(w)] == w).all()]
        assert hits and (len(w) == n + 1 or chunks[hits[0]] == hits[0] + len(w))
        assert torch.equal(x[row, real[1:]], y[row, real[:-1]])  # targets are the next tokens


def test_auto_dtype_falls_back_to_float32_without_native_bf16(monkeypatch, capsys):
    """Both fallback paths, forced so that every machine tests them: NANOMIXER_NO_BF16, and a CPU
    without native bf16 (AVX2-only, mocked). An explicit bfloat16 wins, with a warning."""
    monkeypatch.setenv(train.NO_BF16_ENV, '1')
    dtype, why = train.choose_dtype(torch.device('cpu'), 'auto')
    assert dtype == torch.float32 and train.NO_BF16_ENV in why
    cpu_kind(monkeypatch, native=False)
    assert train.choose_dtype(torch.device('cpu'), 'auto') == (torch.float32, train.cpu_bf16()[1])
    assert 'bf16' in train.cpu_bf16()[1]
    dtype, _ = train.choose_dtype(torch.device('cpu'), 'bfloat16')
    assert dtype == torch.bfloat16 and 'emulated' in capsys.readouterr().err
    with pytest.raises(ValueError, match='float16'):
        train.choose_dtype(torch.device('cpu'), 'float16')


def test_auto_dtype_picks_bf16_where_it_is_native(monkeypatch):
    """On a CPU the capability query decides, with no timing that a busy machine could flip; on
    CUDA bf16 where supported, else fp16."""
    cpu_kind(monkeypatch, native=True)
    monkeypatch.setattr(torch, 'randn', None)  # no timing probe runs: one would need random inputs
    assert train.choose_dtype(torch.device('cpu'), 'auto')[0] == torch.bfloat16
    monkeypatch.undo()
    for has_bf16, expected in ((True, torch.bfloat16), (False, torch.float16)):     # CUDA, mocked
        monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda: has_bf16)
        assert train.choose_dtype(torch.device('cuda'), 'auto')[0] == expected
        # asked, but none: fp16
        assert train.choose_dtype(torch.device('cuda'), 'bfloat16')[0] == expected


def test_resume_keeps_the_recorded_dtype(data, tmp_path, monkeypatch, capsys):
    """The checkpoint records the dtype auto chose; a resume keeps it even where auto would now
    choose another (the capability flips between the run and its resume), and ends bit-identical
    to a resume that saw no flip. Another dtype is used only when asked for, and said so."""
    for out, flip in (('a', False), ('b', True)):
        cpu_kind(monkeypatch, native=False)
        assert train_run(data, tmp_path / out, '--max_iters=4', '--eval_interval=4') == 0
        assert weights(tmp_path / out)['dtype'] == 'float32'
        cpu_kind(monkeypatch, native=flip)
        capsys.readouterr()
        resume = ['--max_iters=8', '--eval_interval=4', '--init_from=resume']
        assert train_run(data, tmp_path / out, *resume) == 0
        assert 'cpu float32 (recorded by the run it resumes)' in capsys.readouterr().out
    a, b = weights(tmp_path / 'a'), weights(tmp_path / 'b')
    assert a['step'] == b['step'] == 8 and b['dtype'] == 'float32'
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])
    cpu_kind(monkeypatch, native=False)  # an explicit dtype wins on resume, logged with the record
    assert train_run(data, tmp_path / 'b', '--max_iters=9', '--init_from=resume',
                     '--dtype=bfloat16') == 0
    out = capsys.readouterr()
    assert 'cpu bfloat16 (as asked; the run it resumes was trained in float32)' in out.out
    assert 'emulated' in out.err and weights(tmp_path / 'b')['dtype'] == 'bfloat16'


@pytest.mark.parametrize('accum,batch,world', [(1, 16, 1), (1, 16, 2), (1, 16, 8), (4, 16, 2),
                                               (4, 8, 8), (3, 4, 2), (2, 6, 3)])
def test_rank_pieces_cover_every_row_once(accum, batch, world):
    """Every (micro-step, row shard) goes to exactly one rank, and every rank gets as many."""
    pieces = [p for r in range(world) for p in train.rank_pieces(accum, batch, world, r)]
    shards = pieces[0][2]
    assert sorted((m, s) for m, s, _ in pieces) == [
        (m, s) for m in range(accum) for s in range(shards)]
    assert len({len(train.rank_pieces(accum, batch, world, r)) for r in range(world)}) == 1
    assert batch % shards == 0


def test_row_shards_are_the_micro_batch(data):
    for mode in ('packed', 'documents'):
        get = train.Batches(dict(train.DEFAULTS, n_ctx=16, batch_size=4, batch_mode=mode,
                                 padding='left'), train.load_meta(data), data)
        whole, halves = get('train', 3, 1), [get('train', 3, 1, s, 2) for s in range(2)]
        # inputs, targets
        assert all(torch.equal(whole[k], torch.cat([h[k] for h in halves])) for k in (0, 1))


DDP_ATOL = 2 * 4 * 1e-2 * 2 ** -8  # 2*k*lr*d, k = 4 steps at TINY's lr: 3.1e-4; a bug moves ~lr


@pytest.mark.parametrize('extra', [['--grad_accum=2'], [], ['--batch_mode=documents']],
                         ids=['accum2', 'shards', 'documents'])  # []: grad_accum=1, so row shards
def test_ddp_two_processes_equal_one(data, tmp_path, extra):
    """torchrun with 2 processes reaches the one-process weights (DDP_ATOL) after 4 clipped steps:
    whole micro-batches, row shards of them, and row shards of padded documents that hold different
    numbers of real targets (each weighted by its share of the micro-batch's)."""
    common = [*TINY, f'--data_dir={data}', '--dtype=float32', *extra, '--max_iters=4',
              '--eval_interval=4', '--grad_clip=0.5']
    if '--batch_mode=documents' in extra:  # the row shards of step 0 do hold different counts
        get = train.Batches(train.parse_args(common, train.DEFAULTS), train.load_meta(data), data)
        counts = [int((get('train', 0, 0, s, 2)[1] != -1).sum()) for s in range(2)]
        assert counts[0] != counts[1], counts
    assert '2 process(es)' in torchrun('train.py', [*common, f'--out_dir={tmp_path}/ddp']).stdout
    assert train.main([*common, f'--out_dir={tmp_path}/one']) == 0
    a, b = weights(tmp_path / 'ddp'), weights(tmp_path / 'one')
    assert a['step'] == b['step'] == 4 and a['tokens_seen'] == b['tokens_seen']
    for k, v in a['model'].items():
        torch.testing.assert_close(v, b['model'][k], rtol=0, atol=DDP_ATOL)
    # seed 1337 init: they moved
    start = train.build_model(train.ModelConfig(**a['model_config'])).state_dict()
    assert any(not torch.allclose(v, start[k]) for k, v in a['model'].items())


def test_ddp_refusal_reaches_every_rank(data, tmp_path):
    """Two ranks at a folder that holds a run: both exit 2 with one error line and no traceback,
    the run untouched. Launched with the variables torchrun sets (torchrun itself reports a
    failed child with a traceback of its own, and stops the others when one exits), then by it."""
    run = tmp_path / 'run'
    run.mkdir()
    (run / 'ckpt.pt').write_bytes(b'a long run')
    argv = [os.path.join(HERE, 'train.py'), f'--data_dir={data}', *TINY, '--max_iters=2',
            f'--out_dir={run}']
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    env = dict(ENV, WORLD_SIZE='2', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = [subprocess.Popen([sys.executable, *argv], **pipes,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]
    try:
        err = ''.join(p.communicate(timeout=120)[1] for p in procs)
    finally:
        for p in procs:
            p.kill()
    errors = [line for line in err.splitlines() if line.startswith('error:')]
    assert [p.returncode for p in procs] == [2, 2] and 'Traceback' not in err, err
    assert len(errors) == 1 and 'already holds a run' in errors[0], err
    proc = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone',
                           '--nproc_per_node=2', *argv], env=ENV, capture_output=True, text=True,
                          timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
    assert proc.returncode and len(errors) == 1, proc.stderr
    assert '[rank' not in proc.stderr, proc.stderr            # no rank's traceback
    assert os.listdir(run) == ['ckpt.pt'] and (run / 'ckpt.pt').read_bytes() == b'a long run'


def test_kill9_then_resume_is_bit_identical(data, tmp_path):
    """kill -9 at an arbitrary step (not at a checkpoint), then --init_from=resume: the weights,
    the optimizer state and the log equal those of an uninterrupted run, bit for bit."""
    args = [f'--data_dir={data}', *TINY, '--arch=mixer', '--max_iters=300', '--eval_interval=25',
            '--log_interval=1']
    a, b = interrupted_and_resumed(args, tmp_path)
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])
    assert torch.equal(a['optimizer']['state'][0]['exp_avg_sq'],
                       b['optimizer']['state'][0]['exp_avg_sq'])


def interrupted_and_resumed(args, tmp_path):
    """Final checkpoints of train.py args run whole (in tmp_path/a) and killed -9 after its first
    checkpoint, then resumed (in tmp_path/b). Checks the counters and that the log was mended."""
    assert train.main([*args, f'--out_dir={tmp_path}/a']) == 0
    out_b = tmp_path / 'b'
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, 'train.py'), *args,
                             f'--out_dir={out_b}'],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (out_b / 'ckpt.pt').exists():
            time.sleep(0.01)
        time.sleep(0.137)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
    killed_at = max(json.loads(line)['step'] for line in open(out_b / 'log.jsonl')
                    if line.endswith('\n'))
    assert 25 <= weights(out_b)['step'] < 300 and killed_at < 300, "not interrupted mid-way"
    assert train.main([*args, f'--out_dir={out_b}', '--init_from=resume']) == 0
    a, b = weights(tmp_path / 'a'), weights(out_b)
    assert a['step'] == b['step'] == 300 and a['tokens_seen'] == b['tokens_seen']
    steps = [r['step'] for r in records(out_b, 'loss')]
    # log trimmed, then appended
    assert steps == sorted(steps) and len(steps) == len(set(steps)) == 300
    return a, b


def test_max_time_is_honoured(data, tmp_path):
    """--max_time ends the run on time, with a final eval and checkpoint; the lr decays with the
    time."""
    t0 = time.time()
    assert train_run(data, tmp_path, '--max_iters=0', '--max_time=1.5',
                     '--eval_interval=1000000') == 0
    last = records(tmp_path, 'val_loss')[-1]
    assert 1.5 <= last['time'] < 2.5 and time.time() - t0 < 15
    assert weights(tmp_path)['step'] == last['step'] > 10
    lrs = [r['lr'] for r in records(tmp_path, 'loss')]
    assert lrs == sorted(lrs, reverse=True) and lrs[-1] < 0.5e-2


def test_divergence_stops_and_keeps_last_checkpoint(data, tmp_path, capsys):
    assert train_run(data, tmp_path, '--max_iters=10', '--eval_interval=10') == 0
    before = (tmp_path / 'ckpt.pt').read_bytes()
    assert train_run(data, tmp_path, '--max_iters=40', '--eval_interval=10', '--lr=1e30',
                     '--grad_clip=0', '--init_from=resume') == 1
    err = capsys.readouterr().err
    # the step it kept
    assert 'error:' in err and 'step 10' in err and ('nan' in err or 'inf' in err)
    assert (tmp_path / 'ckpt.pt').read_bytes() == before


def test_parse_args_presets_and_overrides(tmp_path):
    """A preset is Python (later lines read earlier ones); --key=value overrides it, typed as the
    default."""
    preset = tmp_path / 'p.py'
    preset.write_text('"""doc"""\nn_ctx = 128  # comment\nbatch_size = 65536 // n_ctx\n'
                      'lr = 1\ncompile = True\n')
    cfg = train.parse_args([str(preset), '--lr=3e-4', '--compile=false', '--d_model=64'],
                           train.DEFAULTS)
    assert (cfg['n_ctx'], cfg['batch_size'], cfg['lr'], cfg['compile'],
            cfg['d_model']) == (128, 512, 3e-4, False, 64)
    assert type(train.parse_args([str(preset)], train.DEFAULTS)['lr']) is float
    # a typo is answered with the key meant
    with pytest.raises(ValueError, match='--batch_size'):
        train.parse_args(['--batchsize=3'], train.DEFAULTS)
    with pytest.raises(ValueError, match='n_ctx'):
        train.parse_args(['--n_ctx=big'], train.DEFAULTS)
    with pytest.raises(ValueError, match='schedule'):
        train.parse_args(['--schedule=step'], train.DEFAULTS, train.CHOICES)
    share = [train.parse_args([f'--share_ffn={v}'], train.DEFAULTS)['share_ffn']
             for v in ('0', 'auto')]
    assert share == [False, None] and train.DEFAULTS['share_ffn'] is None  # None: as ModelConfig
    with pytest.raises(ValueError, match='true, false, auto'):
        train.parse_args(['--share_ffn=maybe'], train.DEFAULTS)
    preset.write_text('n_ctx = undefined_name * 2\n')
    with pytest.raises(ValueError, match=r'p.py:1'):
        train.parse_args([str(preset)], train.DEFAULTS)


@pytest.mark.parametrize('preset', sorted(os.listdir(os.path.join(HERE, 'config'))))
def test_every_preset_names_its_source_and_builds(preset):
    """A preset names the paper table or section it follows (or says it is not a paper run) and
    builds."""
    path = os.path.join(HERE, 'config', preset)
    doc = ast.get_docstring(ast.parse(open(path).read())) or ''
    assert re.search(r'Table S?\d|§\d', doc) or doc.startswith('Not a paper run'), doc
    cfg = train.parse_args([path], train.DEFAULTS, train.CHOICES)
    ModelConfig(vocab_size=8000, **{k: cfg[k] for k in train.MODEL_KEYS})


@pytest.mark.parametrize('arch', ['llama', 'gpt'])
def test_tinystories_transformer_presets_one_per_lr_source(arch):
    """Table S6's caption (5e-3) and the author's code with §9.5 (2e-4) disagree: one preset for
    each, the same run otherwise, each docstring naming the source it follows."""
    runs, docs = {}, {}
    for name in (f'tinystories_{arch}', f'tinystories_{arch}_s6'):
        path = os.path.join(HERE, 'config', name + '.py')
        docs[name] = ast.get_docstring(ast.parse(open(path).read()))
        runs[name] = train.parse_args([path], train.DEFAULTS, train.CHOICES)
    code, s6 = runs[f'tinystories_{arch}'], runs[f'tinystories_{arch}_s6']
    assert (code['lr'], s6['lr']) == (2e-4, 5e-3) and code['out_dir'] != s6['out_dir']
    assert {k for k in code if code[k] != s6[k]} == {'lr', 'out_dir'}
    assert "follows the author's code" in docs[f'tinystories_{arch}']
    assert "follows Table S6's caption" in docs[f'tinystories_{arch}_s6']


def test_lr_schedule():
    cfg = dict(train.DEFAULTS, lr=1.0, min_lr=0.1, warmup_iters=9)
    assert train.get_lr(cfg, 0, 0.0) == pytest.approx(0.1) and train.get_lr(cfg, 9, 0.0) == 1.0
    assert train.get_lr(cfg, 50, 0.5) == pytest.approx(0.55)
    assert train.get_lr(cfg, 99, 1.0) == pytest.approx(0.1)
    assert train.get_lr(dict(cfg, schedule='cosine'), 50, 0.5) == pytest.approx(0.55)
    assert train.get_lr(dict(cfg, schedule='cosine'), 50, 0.25) > train.get_lr(cfg, 50, 0.25)


def test_demo_preset_is_a_step_budget_so_its_result_does_not_depend_on_the_machine():
    """A wall-clock budget trains for fewer steps on a busy machine; a step budget does not."""
    cfg = prepare.parse_args([os.path.join(HERE, 'config', 'demo.py')], train.DEFAULTS)
    assert cfg['max_time'] == 0 and cfg['max_iters'] > 0


def test_step_line_shows_elapsed_time_and_what_is_left(data, tmp_path, monkeypatch, capsys):
    """Each step line ends with the wall time so far and the training time left, from the step or
    time budget, whichever ends first. A slow evaluation shows its progress, fast ones do not."""
    assert train_run(data, tmp_path / 'a', '--max_iters=10', '--eval_interval=10') == 0
    out, err = capsys.readouterr()
    assert 'evaluating' not in err
    monkeypatch.setattr(train, 'EVAL_QUIET_S', 0.0)  # as if every batch took long
    assert train_run(data, tmp_path / 'b', '--max_iters=2', '--eval_interval=2') == 0
    assert 'evaluating val: batch 2 of 2' in capsys.readouterr().err
    lines = [l for l in out.splitlines() if l.startswith('step 5 |')]
    assert len(lines) == 1 and re.search(r'\| \d+:\d\d elapsed, ~\d+:\d\d left$', lines[0]), lines
    cfg = dict(max_iters=100, max_time=0.0)
    assert train.time_left(cfg, 50, 1e3, 2.0) == 100.0                    # steps: 50 at 2 s
    assert train.time_left({**cfg, 'max_time': 60.0}, 50, 50.0, 2.0) == 10.0   # time ends first
    assert train.clock(3723) == '1:02:03' and train.clock(59.9) == '0:59'


@pytest.mark.parametrize('preset,says', [(None, ['config/demo.py', 'GPU']),
                                          ('tinystories_mixer', ['python prepare.py tinystories']),
                                          ('fineweb_llama', ['python prepare.py fineweb-edu'])])
def test_train_without_arguments_on_a_cpu_names_the_demo(preset, says, tmp_path, monkeypatch,
                                                         capsys):
    """The defaults are GPU-sized: on a CPU a bare `python train.py` says what to run instead, at
    once, rather than training for hours; a preset without its data names its prepare command (run
    where there is no data, which neither must reach)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    argv = [os.path.join(HERE, 'config', f'{preset}.py')] if preset else []
    code, _, err = run_main(capsys, 'train', *argv)
    assert code == 2 and all(w in err for w in says) and not os.listdir(tmp_path), err


def test_ctrl_c_says_whether_anything_was_saved(data, tmp_path, monkeypatch, capsys):
    """Before the first checkpoint nothing can be resumed: the message says to rerun with
    --overwrite (the folder holds a log); after it, to resume."""
    evaluate = train.evaluate

    def interrupt_at(step):
        def fake(cfg, *args):
            if fake.calls == step:
                raise KeyboardInterrupt
            fake.calls += 1
            return evaluate(cfg, *args)
        fake.calls = 0
        return fake
    monkeypatch.setattr(train, 'evaluate', interrupt_at(0))
    code, _, err = run_main(capsys, 'train', f'--data_dir={data}', f'--out_dir={tmp_path}', *TINY,
                            '--max_iters=8', '--eval_interval=4')
    assert code == 130 and 'nothing was saved' in err and '--overwrite' in err, err
    assert 'resume' not in err
    monkeypatch.setattr(train, 'evaluate', interrupt_at(2))    # after step 4's checkpoint
    code, _, err = run_main(capsys, 'train', f'--data_dir={data}', f'--out_dir={tmp_path}', *TINY,
                            '--max_iters=8', '--eval_interval=4', '--overwrite')
    assert code == 130 and '--init_from=resume' in err, err


def test_resume_and_fresh_runs_name_the_way_out(data, tmp_path, monkeypatch, capsys):
    """No checkpoint to resume: start afresh with --overwrite. A folder holding a log but no
    checkpoint: --overwrite only; one holding a checkpoint: resume or --overwrite, nothing touched.
    Resuming a spent budget says so at once, naming --max_iters and --max_time, and evaluates
    nothing again. --overwrite starts the run afresh."""
    argv = [f'--data_dir={data}', f'--out_dir={tmp_path}', *TINY, '--max_iters=4']
    refused(capsys, 'train', [*argv, '--init_from=resume'], '--overwrite')
    (tmp_path / 'log.jsonl').write_text('')
    code, _, err = run_main(capsys, 'train', *argv)
    assert code == 2 and '--overwrite' in err and '--init_from=resume' not in err, err
    assert train_run(data, tmp_path, '--max_iters=4', '--eval_interval=4', '--overwrite') == 0
    assert '--init_from=resume' in refused(capsys, 'train', argv, '--overwrite', keep=[tmp_path])
    log = (tmp_path / 'log.jsonl').read_text()
    monkeypatch.setattr(train, 'evaluate', None)  # would raise if called
    code, out, err = run_main(capsys, 'train', *argv, '--init_from=resume')
    assert code == 2 and 'spent' in err and '--max_iters' in err and '--max_time' in err, err
    assert (tmp_path / 'log.jsonl').read_text() == log
    monkeypatch.undo()
    assert train_run(data, tmp_path, '--max_iters=2', '--eval_interval=2', '--overwrite') == 0
    assert max(r['step'] for r in records(tmp_path, 'loss')) == 2
    assert weights(tmp_path, 'best.pt')['step'] == 2


def test_outputs_default_under_out_which_git_ignores():
    """Every training output lands in out/, which git ignores, as it does retrieve's runs and index,
    a downloaded peer's models/ folder and the bench outputs the README names."""
    assert train.DEFAULTS['out_dir'] == sample.DEFAULTS['out_dir'] == 'out'
    ignored = [p.strip().lstrip('/') for p in open(os.path.join(HERE, '.gitignore')) if p.strip()]
    assert 'out*/' in ignored or 'out/' in ignored
    folders = (retrieve.INDEX['index'], retrieve.TRAIN['out_dir'], retrieve.INDIRECT['out_dir'],
               'models')
    for name in [f.split('/')[0] + '/' for f in folders] + ['bench.json', 'bench.png']:
        assert any(fnmatch.fnmatch(name, p) for p in ignored), name


# =============================================================================
# 5. sample.py (and the decoding speed-ups it holds)

@pytest.mark.parametrize('variant', VARIANTS, ids=name)
def test_decode_layout_changes_strides_not_tokens(variant):
    """decode_layout (sample.py and bench.py call it) stores wide Linear weights column-major for
    faster batch-1 GEMVs: the same greedy tokens, logits equal up to summation order."""
    model = tiny_model(**variant)
    idx = prompt(5)
    before = decode(model, idx, N_CTX, 'cache')
    sample.decode_layout(model)
    wide = [m.weight for m in model.modules()
            if isinstance(m, torch.nn.Linear) and m.out_features > m.in_features]
    assert wide and all(w.t().is_contiguous() for w in wide)
    after = decode(model, idx, N_CTX, 'cache')
    assert torch.equal(before[0], after[0])
    torch.testing.assert_close(before[1], after[1], atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize('arch', ['mixer', 'llama'])
def test_compiled_decode_step_traces_once_for_all_positions(arch):
    """A compiled model.step: one dynamic-shape graph for every position, the same tokens and
    logits. The 'eager' backend checks the tracing in seconds; inductor's code is left to bench.py
    --compile."""
    from torch._dynamo.utils import counters
    model = tiny_model(arch=arch)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(model.step, dynamic=True, backend='eager')
    steps = N_CTX + N_CTX // 2                                      # through a slide
    tok_c, logit_c = decode(model, prompt(5), steps, 'cache', step=step)
    tok_e, logit_e = decode(model, prompt(5), steps, 'cache')
    assert torch.equal(tok_c, tok_e) and torch.equal(logit_c, logit_e)
    # not one per position
    assert 1 <= counters['stats']['unique_graphs'] <= 2, dict(counters['stats'])
    torch._dynamo.reset()


def test_compiled_decode_step_freezes_each_models_weights():
    """sample.compiled_step on CPU: inductor with the weights frozen in as constants (max-autotune's
    own GEMVs). Two models compiled side by side each decode their own eager tokens; changed weights
    are refused."""
    torch._dynamo.reset()
    models = [perturbed(ModelConfig(vocab_size=VOCAB, n_ctx=N_CTX, d_model=16, n_layers=1), 0.1,
                        seed).eval() for seed in (0, 1)]
    # one choice: no timing runs
    with torch._inductor.config.patch(max_autotune_gemm_backends='CPP'):
        steps = [sample.compiled_step(model) for model in models]
        # the second round runs each model's graph again, after the other's compile
        for _ in range(2):
            for model, step in zip(models, steps):
                tok_c, logit_c = decode(model, prompt(5), 6, 'cache', step=step)
                tok_e, logit_e = decode(model, prompt(5), 6, 'cache')
                assert torch.equal(tok_c, tok_e)
                torch.testing.assert_close(logit_c, logit_e, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        models[0].lm_head.weight.add_(1.0)
    with pytest.raises(ValueError, match='weights changed'):
        decode(models[0], prompt(5), 2, 'cache', step=steps[0])
    torch._dynamo.reset()


def test_cli_seeds_batches_and_prompts(trained, data, tmp_path, capsys):
    """Same seed, same sample (from out_dir's best.pt); --num_samples=N decodes N rows in one batch,
    different at temperature 1, each the batch-1 sample when greedy. No prompt starts from BOS;
    FILE: reads a file; a long prompt keeps its last n_ctx - 1 tokens, announced."""
    argv = [f'--out_dir={trained}', '--prompt=def f1_', '--max_new_tokens=40', '--seed=3']
    code, out, err = run_main(capsys, 'sample', *argv)
    assert code == 0 and 'best.pt' in err and out.startswith('def f1_')
    assert len(out) > len('def f1_\n')
    assert run_main(capsys, 'sample', *argv)[1] == out
    assert run_main(capsys, 'sample', *argv[:-1], '--seed=4')[1] != out
    two = run_main(capsys, 'sample', *argv, '--num_samples=2')[1]
    first, second = two.split('\n' + '-' * 40 + '\n')
    assert first.startswith('def f1_') and second.startswith('def f1_') and first != second
    assert run_main(capsys, 'sample', *argv, '--num_samples=2')[1] == two
    one = run_main(capsys, 'sample', *argv, '--temperature=0')[1]
    three = run_main(capsys, 'sample', *argv, '--temperature=0', '--num_samples=3')[1]
    assert three == (one + '-' * 40 + '\n') * 2 + one
    code, out, err = run_main(capsys, 'sample', f'--out_dir={trained}', '--max_new_tokens=10')
    assert code == 0 and out.strip()
    (tmp_path / 'p.txt').write_text('def f7_1(x):\n')
    code, out, _ = run_main(capsys, 'sample', f'--out_dir={trained}',
                            f'--prompt=FILE:{tmp_path}/p.txt', '--max_new_tokens=5')
    assert code == 0 and out.startswith('def f7_1(x):\n')
    long = 'def f3_1(x):\n    return x\n' * 40
    code, out, err = run_main(capsys, 'sample', f'--out_dir={trained}', f'--prompt={long}',
                              '--max_new_tokens=5')
    assert code == 0 and '31' in without_paths(err)
    tok = Tokenizer.from_dir(data)
    kept = tok.decode(tok.encode(long)[-31:])
    assert long.endswith(kept) and out.startswith(kept) and len(out) > len(kept) + 1


@pytest.mark.parametrize('native', [False, True], ids=['avx2', 'native-bf16'])
@pytest.mark.parametrize('arch', ['mixer', 'llama'])
def test_cli_greedy_window_equals_cache(arch, native, trained, tmp_path, monkeypatch, capsys):
    """Through the CLI at the default flags and past the 32-token window, on either kind of CPU
    (mocked): the trained mixer, and a llama checkpoint (fresh weights) with its KV cache and
    without. The bfloat16 weights path runs too."""
    cpu_kind(monkeypatch, native)
    ckpt = trained / 'ckpt.pt'
    if arch == 'llama':
        saved = train.load_checkpoint(ckpt)
        cfg = ModelConfig(**{**saved['model_config'], 'arch': 'llama'})
        ckpt = tmp_path / 'llama.pt'
        train.save_checkpoint({**saved, 'model_config': dataclasses.asdict(cfg),
                               'model': perturbed(cfg, 0.2).state_dict()}, ckpt)
    argv = [f'--ckpt={ckpt}', '--prompt=def f2_1(x):', '--max_new_tokens=70', '--temperature=0']
    code, cached, _ = run_main(capsys, 'sample', *argv)
    assert code == 0 and len(cached) > len('def f2_1(x):\n')
    assert run_main(capsys, 'sample', *argv, '--method=window')[1] == cached
    code, out, _ = run_main(capsys, 'sample', *argv, '--dtype=bfloat16')
    assert code == 0 and out.startswith('def f2_1(x):') and len(out) > len(cached) // 2


def test_sample_compile_keeps_the_terminal_clean(data, tmp_path, capsys):
    """sample.py --compile, first use (an empty inductor cache, so max-autotune times its kernels):
    no autotune tables on stderr, the compile time on a line of its own, then the usual tokens/s
    line, and the eager run's text. Costs ~30-60 s on 2 busy cores (inductor builds C++ kernels)."""
    ckpt = make_ckpt(tmp_path / 'tiny.pt', data, d_model=16, n_layers=1)
    argv = [f'--ckpt={ckpt}', '--prompt=def f', '--max_new_tokens=6', '--temperature=0']
    eager = run_main(capsys, 'sample', *argv)[1]
    fresh = dict(ENV, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / 'inductor'))
    r = subprocess.run([sys.executable, 'sample.py', *argv, '--compile'], capture_output=True,
                       text=True, cwd=HERE, env=fresh, timeout=600)
    lines = r.stderr.splitlines()
    assert r.returncode == 0 and len(lines) == 3 and lines[0].startswith('sampling from'), r.stderr
    assert re.fullmatch(r'compiled the cached step in \d+\.\d s .*', lines[1]), r.stderr
    assert re.fullmatch(r'\d+ tokens .* in \d+\.\d+ s \(\d+\.\d tokens/s\)', lines[2]), r.stderr
    assert r.stdout == eager


def test_stream_prints_whole_characters_and_each_row_stops_at_its_eos(capsys):
    """Tokens are UTF-8 bytes here, so a character can span tokens (as with byte-fallback BPE
    pieces): no U+FFFD pieces of it print; nothing after a row's end of document (the batch stops
    when all rows have); a sample ending inside a character prints all it decodes to."""
    text, eos, x = 'naïve ✓ 😀!', 256, ord('x')
    tok = types.SimpleNamespace(eos_id=eos,
                                decode=lambda ids: bytes(i for i in ids if i < 256).decode(
        'utf-8', errors='replace'))

    def write(rows, prompt, *argv):
        # one fixed row per sequence, whatever the sampling arguments
        def stream(idx, max_new_tokens, **kw):
            assert len(idx) == len(rows)
            for step in zip(*rows):
                yield torch.tensor(step), None
        return sample.write_samples(types.SimpleNamespace(stream=stream), tok, list(prompt),
                                    sample.parse_args(['--max_new_tokens=100', *argv]),
                                    torch.Generator())
    assert write([list(text.encode()) + [eos, x]], b'') == len(text.encode())
    assert capsys.readouterr().out == text + '\n'
    write([list(b'ok\xe2\x9c')], b'>')
    assert capsys.readouterr().out == '>ok\ufffd\n'
    rows = [list(b'ab') + [eos, x, x, x], list(b'abcd') + [eos, x], list(b'a') + [eos, x, x, x, x]]
    assert write(rows, b'>', '--num_samples=3') == 2 + 4 + 1
    assert capsys.readouterr().out == '\n'.join(['>ab', '-' * 40, '>abcd', '-' * 40, '>a', ''])


def test_reading_a_checkpoint_never_picks_an_emulated_dtype(trained, tmp_path, monkeypatch, capsys):
    """sample.py and retrieve.py read a checkpoint in the dtype it was trained in where the device
    has it natively, else in float32: a bf16 checkpoint (from a GPU) on an AVX2 CPU runs in fp32.
    sample.py decodes in fp32 on any CPU, by either method; --dtype=bfloat16 is honoured by both."""
    saved = train.load_checkpoint(trained / 'ckpt.pt')
    for recorded in ('bfloat16', 'float32', 'float16'):
        train.save_checkpoint({**saved, 'dtype': recorded}, tmp_path / f'{recorded}.pt')
    cpu = torch.device('cpu')
    f32, b16 = torch.float32, torch.bfloat16
    for native, recorded, want in ((False, 'bfloat16', f32), (True, 'bfloat16', b16),
                                   (True, 'float32', f32), (True, 'float16', f32)):
        cpu_kind(monkeypatch, native)
        ckpt = tmp_path / f'{recorded}.pt'
        assert train.reading_dtype(cpu, 'auto', recorded)[0] == want
        assert retrieve.Embedder(ckpt, 'cpu').dtype == want
        for method in ('cache', 'window'):
            code, _, err = run_main(capsys, 'sample', f'--ckpt={ckpt}', '--max_new_tokens=2',
                                    '--device=cpu', f'--method={method}')
            assert code == 0 and 'cpu float32' in err, err          # a CPU decodes in fp32 (README)
    for method in ('cache', 'window'):                           # on the native kind still
        code, _, err = run_main(capsys, 'sample', f'--ckpt={tmp_path}/float32.pt', '--device=cpu',
                                '--max_new_tokens=2', '--dtype=bfloat16', f'--method={method}')
        assert code == 0 and 'cpu bfloat16' in err, err
    assert retrieve.Embedder(tmp_path / 'bfloat16.pt', 'cpu', 'float32').dtype == torch.float32
    for has_bf16, want in ((False, torch.float32), (True, torch.bfloat16)):   # CUDA, mocked
        monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda: has_bf16)
        assert train.reading_dtype(torch.device('cuda'), 'auto', 'bfloat16')[0] == want
        assert train.reading_dtype(torch.device('cuda'), 'auto', 'float16')[0] == torch.float16


# =============================================================================
# 6. retrieve.py: InfoNCE (eq. 7), the Algorithm 1 samplers, the many-candidate eval,
# indirect retrieval, index/search, on pairs the tests write (fixture `corpus`)

def test_info_nce_is_eq7():
    """-log f(q, t+) / (f(q, t+) + sum f(q, t-)), f = exp(cos / tau) (eq. 8), by hand: over in-batch
    targets, over groups of 31 candidates, and symmetric (mean with target-to-query), also for a row
    shard."""
    tau, f = 0.02, lambda a, b: math.exp(float(a @ b / (a.norm() * b.norm())) / 0.02)  # noqa: E731
    q, t = unit(6, 16, seed=1), unit(6, 16, seed=2)
    by_hand = [-math.log(f(q[i], t[i]) / sum(f(q[i], t[j]) for j in range(6))) for i in range(6)]
    got = retrieve.info_nce(q, t, torch.arange(6), tau).item()
    assert got == pytest.approx(np.mean(by_hand), rel=1e-9)
    q3, cands, labels = unit(3, 16, seed=3), unit(3, 31, 16, seed=4), torch.tensor([0, 17, 30])
    by_hand = [-math.log(f(q3[b], cands[b, labels[b]]) / sum(f(q3[b], c) for c in cands[b]))
               for b in range(3)]
    got = retrieve.info_nce(q3, cands, labels, tau).item()
    assert got == pytest.approx(np.mean(by_hand), rel=1e-9)
    nce = lambda *a: retrieve.info_nce(*a, tau).item()  # noqa: E731
    both = retrieve.info_nce(q, t, torch.arange(6), tau, symmetric=True).item()
    assert both == pytest.approx((nce(q, t, torch.arange(6)) + nce(t, q, torch.arange(6))) / 2,
                                 rel=1e-12)
    shard = torch.tensor([2, 3])
    # its queries vs all targets, its targets vs its queries
    expect = (nce(q[shard], t, shard) + nce(t[shard], q[shard], torch.arange(2))) / 2
    assert retrieve.info_nce(q[shard], t, shard, tau,
                             symmetric=True).item() == pytest.approx(expect, rel=1e-12)


@pytest.mark.parametrize('negatives', ['inbatch', 'paper'])
def test_info_nce_of_row_shards_averages_to_the_batch(corpus, negatives):
    """A row shard keeps its queries and every in-batch target: the shard losses average to the
    batch's."""
    tok = Tokenizer.from_dir(str(corpus.data))
    get = retrieve.PairBatches(dict(train.LOOP_DEFAULTS, data_dir=str(corpus.data),
                                    negatives=negatives, batch_size=4), tok, 32)
    emb = torch.nn.Embedding(tok.vocab_size, 8)

    def loss(batch):
        idx, _, labels = batch
        e = F.normalize(emb(idx).mean(1), dim=-1)
        q, rest = e[:len(labels)], e[len(labels):]
        targets = rest if negatives == 'inbatch' else rest.view(len(labels), -1, 8)
        return retrieve.info_nce(q, targets, labels)
    torch.testing.assert_close(loss(get('train', 2, 0)),
                               sum(loss(get('train', 2, 0, s, 2)) for s in range(2)) / 2)


TRIM = [dict(), dict(n_heads=2, kernel=3, n_convs=2), dict(expansion=1.5), dict(expansion=0.5),
        dict(softmax=True, pos_emb=True), dict(arch='gmlp'), dict(arch='llama'),
        dict(objective='autoencoder'), dict(arch='llama', objective='autoencoder'),
        dict(objective='half'), dict(arch='llama', objective='half'), dict(arch='gpt'),
        dict(arch='hybrid'), dict(arch='elita'), dict(causal=False), dict(pos_channel='every')]


@pytest.mark.parametrize('variant', TRIM, ids=name)
@pytest.mark.parametrize('embed_pos', [-1, -2])
def test_trimmed_padding_equals_the_full_window(variant, embed_pos):
    """TextEncoder's trim (shared pad states for causal mixers, dropped pad columns for llama) gives
    the full window's embeddings and InfoNCE gradients, running fewer rows where it applies."""
    n = 24
    model = make(tiny(n_ctx=n, **variant))
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 3, 17, 5, 2, 9, 4, 12]  # short queries, longer targets, none fills the window
    idx, mask = retrieve.left_pad([torch.randint(4, V, (k,),
                                                 generator=gen).tolist() for k in lengths], n, 3)
    rows = []
    stack = model.encoder if variant.get('objective') == 'autoencoder' else model.backbone
    first_ffn = stack.blocks[0]
    first_ffn = first_ffn.ffn or first_ffn.mixers[-1]  # gmlp: the gated MLP is the block
    hook = first_ffn.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[:2].numel()))
    results = {}
    for trim in (False, True):
        enc, rows[:] = retrieve.TextEncoder(model, embed_pos, trim), []
        model.zero_grad()
        e = enc(idx, mask)
        retrieve.info_nce(e[:4], e[4:], torch.arange(4), symmetric=True).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results[trim] = e.detach(), grads, sum(rows)
    hook.remove()
    (e0, g0, rows0), (e1, g1, rows1) = results[False], results[True]
    # float64 models; RoPE's tables are float32
    torch.testing.assert_close(e1, e0, rtol=1e-6, atol=1e-6)
    scale = max(float(a.abs().max()) for a in g0)
    assert len(g0) == len(g1)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7 * scale)
    # half blanks from half the input's length: a shorter pass moves it
    trims = variant.get('arch', 'mixer') in ('mixer', 'gmlp', 'llama') \
        and variant.get('causal', True) and variant.get('objective') != 'half'
    assert retrieve.TextEncoder(model, embed_pos).trim == trims
    assert rows0 == 8 * n and (rows1 < 8 * 17 if trims else rows1 == rows0), (rows0, rows1)


def test_tail_refuses_real_tokens_in_the_dropped_columns():
    model = make(tiny())
    idx, mask = retrieve.left_pad([[5, 6, 7], [8] * 6], N, 3)
    torch.testing.assert_close(model.hidden(idx, mask, keep=6), model.hidden(idx, mask)[:, -6:])
    with pytest.raises(ValueError, match='padding'):
        model.hidden(idx, mask, keep=4)
    idx[1, 0] = 9                                        # not the same pad id in every row
    with pytest.raises(ValueError, match='padding'):
        model.hidden(idx, None, keep=6)


def chi2(labels, k):
    counts = torch.bincount(labels, minlength=k).double()
    return float(((counts - len(labels) / k) ** 2 / (len(labels) / k)).sum())


def test_samplers_place_the_match_once_uniformly_among_distinct_negatives():
    """The paper's candidates; Algorithm 1's: the query first, then c-1 targets, c-2 of them
    non-matching."""
    gen, n_pool, k, draws = torch.Generator().manual_seed(0), 50, 8, 4000
    match = torch.randint(0, n_pool, (draws,), generator=gen)
    cands, labels = retrieve.sample_candidates(match, n_pool, k, gen)
    assert cands.shape == (draws, k) and torch.equal(cands[torch.arange(draws), labels], match)
    assert ((cands == match[:, None]).sum(1) == 1).all()                 # the match exactly once
    assert all(len(set(row)) == k for row in cands.tolist())  # negatives without replacement
    assert chi2(labels, k) < 24.3  # p = 0.001 for 7 degrees of freedom
    negs = cands[torch.arange(k)[None] != labels[:, None]]
    # negatives spread over the pool
    freq = torch.bincount(negs, minlength=n_pool).double() / len(negs)
    assert freq.min() > 0.5 / n_pool and freq.max() < 1.5 / n_pool
    q, t, c = unit(40, 8, seed=7), unit(40, 8, seed=8), 6
    gen = torch.Generator().manual_seed(0)
    match = torch.randint(0, 40, (3000,), generator=gen)
    x, labels, rows = retrieve.algorithm1(q, t, match, c, gen)
    assert x.shape == (3000, c, 8) and torch.equal(x[:, 0], q[match])
    assert torch.equal(x[torch.arange(3000), 1 + labels], t[match])
    others = rows[:, 1:][torch.arange(c - 1)[None] != labels[:, None]].view(3000, c - 2)
    assert (others != match[:, None]).all() and all(len(set(r)) == c - 2 for r in others.tolist())
    assert chi2(labels, c - 1) < 18.5                                    # p = 0.001, 4 dof


def test_pair_batches_layout(corpus):
    """paper: B queries then B groups of 31 candidates, the match at its label; inbatch: B + B rows.
    Left padding; a pure function of its arguments."""
    tok = Tokenizer.from_dir(str(corpus.data))
    cfg = dict(train.LOOP_DEFAULTS, data_dir=str(corpus.data), negatives='paper', batch_size=2)
    batches = retrieve.PairBatches(cfg, tok, 32)
    idx, mask, labels = batches('train', 5, 0)
    assert idx.shape == (2 + 2 * 31, 32) and labels.shape == (2,)
    assert torch.equal(idx, batches('train', 5, 0)[0])
    queries, targets = batches.pairs['train']
    for b in range(2):
        row = 2 + 31 * b + labels[b]
        assert idx[row][mask[row]].tolist() == targets[queries.index(idx[b][mask[b]].tolist())][:32]
    assert mask[:, -1].all() and not mask[:, 0].all()
    idx, mask, labels = retrieve.PairBatches(dict(cfg, negatives='inbatch', batch_size=4), tok,
                                             32)('val', None, 1)
    assert idx.shape == (8, 32) and torch.equal(labels, torch.arange(4))


def test_eval_identical_texts_is_100_percent_and_n_is_capped(corpus, capsys, tmp_path):
    """Untrained but deterministic encoders find a target identical to its query at every n; n
    past the pair count is capped at it + 1 (the query and every target), announced."""
    write_pairs(tmp_path / 'same.jsonl',
                [(t, t) for _, t in (pair_texts(random.Random(1), i) for i in range(40))])
    for ckpt in (corpus.mixer, corpus.llama, corpus.ae):
        code, out, err = run_main(capsys, 'retrieve', 'eval', f'--ckpt={ckpt}',
                                  f'--pairs={tmp_path}/same.jsonl',
                                  '--n=8,16,32', f'--json={tmp_path}/m.json')
        m = json.loads((tmp_path / 'm.json').read_text())
        assert code == 0 and set(m) == {'top1', 'mrr@10', 'recall@k', 'n_pairs'}
        assert m['n_pairs'] == 40
        assert m['top1'] == {'8': 100.0, '16': 100.0, '32': 100.0} and m['mrr@10'] == 1.0
        assert m['recall@k'] == {'1': 100.0, '5': 100.0, '10': 100.0}
    code, out, err = run_main(capsys, 'retrieve', 'eval', f'--ckpt={corpus.mixer}',
                              f'--pairs={corpus.data}/pairs_val.jsonl', '--n=16,64,128',
                              f'--json={tmp_path}/m.json')
    assert code == 0 and '49' in without_paths(err)
    assert list(json.loads((tmp_path / 'm.json').read_text())['top1']) == ['16', '49']


def test_eval_random_scores_are_one_in_n_minus_one():
    """Table 1's n: one query, its target and n-2 non-matching targets, so chance is 1/(n-1)."""
    pairs = 3000
    m = retrieve.retrieval_metrics(unit(pairs, 64, seed=5).float(), unit(pairs, 64, seed=6).float(),
                                   (3, 8, 32), seed=0)
    for n in (3, 8, 32):
        p, sd = 100 / (n - 1), 100 * math.sqrt((1 / (n - 1)) * (1 - 1 / (n - 1)) / pairs)
        assert abs(m['top1'][str(n)] - p) < 4 * sd, (n, m['top1'])
    assert abs(m['recall@k']['10'] - 100 * 10 / pairs) < 0.5


class FakeSentenceTransformer:
    """sentence-transformers' interface (constructor, encode) over a bag of letters: a stand-in
    peer."""

    def __init__(self, name, device='cpu', local_files_only=False):
        if name == 'missing':
            raise OSError("missing is not a local folder and not a model on the hub\nmore")

    def encode(self, texts, batch_size=32, convert_to_numpy=True):
        return np.array([[text.lower().count(chr(97 + i)) for i in range(26)] for text in texts],
                        dtype=np.float32)


def test_eval_peer_scores_a_sentence_transformer_on_the_same_pairs(corpus, capsys, tmp_path,
                                                                    monkeypatch):
    """--peer scores a sentence-transformers model by the same metric on the same pairs, beside the
    checkpoint."""
    pairs = corpus.data / 'pairs_val.jsonl'
    fake = types.SimpleNamespace(SentenceTransformer=FakeSentenceTransformer)
    monkeypatch.setitem(sys.modules, 'sentence_transformers', fake)
    code, out, err = run_main(capsys, 'retrieve', 'eval', f'--ckpt={corpus.mixer}',
                              '--peer=fake-peer',
                              f'--pairs={pairs}', '--n=8,16', f'--json={tmp_path}/m.json')
    assert code == 0, err
    m = json.loads((tmp_path / 'm.json').read_text())
    peer = FakeSentenceTransformer('fake-peer')
    expect = retrieve.retrieval_metrics(*(F.normalize(torch.from_numpy(peer.encode(x)), dim=-1)
                                          for x in retrieve.read_pairs(str(pairs))), (8, 16), 0)
    assert m['peer'] == expect and set(m['ckpt']) == set(expect)
    assert out.count('top-1%') == 2 and 'fake-peer: 48 pairs' in out
    refused(capsys, 'retrieve', ['eval', '--peer=missing', f'--pairs={pairs}', '--n=8'], 'missing')
    # not installed: say how to install it
    monkeypatch.setitem(sys.modules, 'sentence_transformers', None)
    refused(capsys, 'retrieve', ['eval', '--peer=all-MiniLM-L6-v2', f'--pairs={pairs}'],
            'pip install sentence-transf')


def test_retrieval_mixer_learns_algorithm1_inputs():
    """The label points at the match: on embeddings that carry the match, a RetrievalMixer learns
    it."""
    torch.manual_seed(0)
    t = torch.randn(400, 32)
    q = t + 0.3 * torch.randn(400, 32)  # a query is its target, noised
    model, gen = M.RetrievalMixer(32, 2, 8), torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(300):
        x, labels, _ = retrieve.algorithm1(q, t, torch.randint(0, 400, (64,), generator=gen), 8,
                                           gen)
        opt.zero_grad()
        model(x, labels)[1].backward()
        opt.step()
    x, labels, _ = retrieve.algorithm1(q, t, torch.arange(400), 8, gen)
    assert (model(x)[0].argmax(-1) == labels).float().mean() > 0.8     # chance: 1 in 7


def test_indirect_trains_and_reports(corpus, capsys, tmp_path, monkeypatch):
    """One RetrievalMixer per c, each an 'indirect' checkpoint; embedding reports progress on
    stderr; each c's training and result lines say which c."""
    monkeypatch.setattr(retrieve, 'PROGRESS_S', 0.0)      # a line per batch, not per 5 s
    code, out, err = run_main(capsys, 'retrieve', 'indirect', f'--ckpt={corpus.mixer}',
                              f'--data_dir={corpus.data}', f'--out_dir={tmp_path}/ind', '--c=4,8',
                              '--n_layers=1', '--max_iters=6', '--eval_interval=6',
                              '--eval_iters=1', '--log_interval=2', '--batch_size=16',
                              f'--json={tmp_path}/ind.json')
    assert code == 0, err
    assert 'embedding: 32/160 texts' in err and 'embedding: 32/48 texts' in err
    steps = [line for line in out.splitlines() if 'step ' in line]
    for c in (4, 8):
        assert sum(line.startswith(f'c={c}: step ') for line in steps) >= 3, out
        assert re.search(rf'^c={c}: top-1 [\d.]+%', out, re.M), out
    assert all(line.startswith(('c=4: ', 'c=8: ')) for line in steps), out
    res = json.loads((tmp_path / 'ind.json').read_text())['c']
    assert set(res) == {'4', '8'}
    assert all(0 <= r['top1'] <= 100 and r['loss'] > 0 for r in res.values())
    ckpt = train.load_checkpoint(tmp_path / 'ind/c8/ckpt.pt')
    assert ckpt['kind'] == 'indirect'
    assert ckpt['retrieval_mixer'] == dict(d_model=32, n_layers=1, c=8)
    assert ckpt['embedder']['ckpt'] == os.path.abspath(corpus.mixer)


@pytest.mark.parametrize('normalize', [False, True])
def test_indirect_feeds_raw_hidden_states(corpus, capsys, tmp_path, monkeypatch, normalize):
    """As the author's code: the RetrievalMixer reads the frozen model's last hidden states as they
    are; --normalize=True gives unit rows x sqrt(d_model) instead."""
    seen = []

    class Recording(M.RetrievalMixer):
        def forward(self, x, labels=None):
            seen.append(x.detach().clone())
            return super().forward(x, labels)

    monkeypatch.setattr(retrieve, 'RetrievalMixer', Recording)
    code, _, err = run_main(capsys, 'retrieve', 'indirect', f'--ckpt={corpus.mixer}',
                            f'--data_dir={corpus.data}', f'--out_dir={tmp_path}/ind', '--c=4',
                            '--n_layers=1', '--max_iters=1', '--eval_iters=1', '--batch_size=8',
                            '--dtype=float32', '--device=cpu', f'--normalize={normalize}')
    assert code == 0, err
    ckpt = train.load_checkpoint(corpus.mixer)      # the full window, here, not through TextEncoder
    model = train.model_from_checkpoint(ckpt).eval()
    tok = prepare.Tokenizer.from_meta(ckpt['data']['meta'], str(corpus.data))
    texts = [t for s in train.SPLITS
             for side in retrieve.read_pairs(corpus.data / f'pairs_{s}.jsonl') for t in side]
    idx, mask = retrieve.left_pad([tok.encode(t, bos=True)[:32] for t in texts], 32, tok.pad_id)
    with torch.no_grad():
        h = model.hidden(idx, mask)[:, -1]                                          # (N, 32)
    pool = F.normalize(h, dim=-1) * math.sqrt(32) if normalize else h
    rows = torch.cat(seen).flatten(0, 1)                                    # every input row
    dist = torch.cdist(rows, pool, compute_mode='donot_use_mm_for_euclid_dist').min(1).values
    # trimmed vs full window in fp32: eps 1.2e-7 x norms ~10 x a few ops; the other form is >= 1 off
    assert dist.max() < 1e-4
    assert not torch.allclose(h.norm(dim=-1), h.norm(dim=-1).mean())   # raw rows: no common norm


def test_index_and_search(corpus, capsys, tmp_path, monkeypatch):
    """A document's own text finds it first, at cosine 1 (binary files skipped). An index answers
    only queries embedded by its own weights, and no empty ones; --overwrite rebuilds it for other
    weights. index and search need no --index."""
    data, mixer, llama = corpus.data, corpus.mixer, corpus.llama
    rng, index = random.Random(2), tmp_path / 'index'
    texts = [''.join(pair_texts(rng, 100 + i)) for i in range(12)]
    (tmp_path / 'docs').mkdir()
    for i, text in enumerate(texts):
        (tmp_path / f'docs/d{i}.py').write_text(text)
    (tmp_path / 'docs/blob.bin').write_bytes(b'\0\1\2')
    code, out, err = run_main(capsys, 'retrieve', 'index', f'--ckpt={mixer}',
                              f'--docs={tmp_path}/docs', f'--index={index}', '--dtype=float32')
    manifest = json.loads((index / 'manifest.json').read_text())
    assert code == 0 and manifest['n_documents'] == 12
    assert np.load(index / manifest['embeddings']).shape[0] == manifest['n_chunks']
    for i in (3, 7):
        code, out, err = run_main(capsys, 'retrieve', 'search', f'--index={index}',
                                  f'--query={texts[i]}', '--k=3', '--dtype=float32')
        first = out.splitlines()[0]
        assert code == 0 and first.startswith('1. 1.000')
        assert first.split()[2] == str(tmp_path / f'docs/d{i}.py')
    refused(capsys, 'retrieve', ['search', f'--index={index}', '--query=sort the load',
                                 f'--ckpt={llama}'], 'llama.pt', keep=[index])
    refused(capsys, 'retrieve', ['search', f'--index={index}', '--query=  '], 'query')
    assert run_main(capsys, 'retrieve', 'index', f'--ckpt={llama}',
                    f'--docs={data}/pairs_val.jsonl',
                    f'--index={index}', '--overwrite')[0] == 0
    code, out, _ = run_main(capsys, 'retrieve', 'search', f'--index={index}', '--query=sort',
                            f'--ckpt={llama}')
    assert code == 0 and out.startswith('1. ')
    names = sorted(p.name.split('.')[0] for p in index.iterdir())
    assert names == ['chunks', 'embeddings', 'manifest']  # no leftovers
    monkeypatch.chdir(tmp_path)  # no --index: it defaults under out/ (which git ignores, section 4)
    assert run_main(capsys, 'retrieve', 'index', f'--ckpt={mixer}',
                    f'--docs={data}/pairs_val.jsonl')[0] == 0
    assert (tmp_path / 'out/index/manifest.json').is_file()
    code, out, err = run_main(capsys, 'retrieve', 'search', '--query=sort the load', '--k=2')
    assert code == 0 and out.startswith('1. '), err


GOOD_MANIFEST = dict(ckpt='x.pt', fingerprint='ab12', embed_pos=-1, n_ctx=32, n_chunks=4,
                     n_documents=2, embeddings='embeddings.ab12.npy', chunks='chunks.ab12.jsonl')


BROKEN_INDEXES = {   # manifest.json's text, and what the other files are cut to
    'truncated': (json.dumps(GOOD_MANIFEST)[:30], {}), 'list': ('[1, 2]', {}),
    **{f'no-{k}': (json.dumps({n: v for n, v in GOOD_MANIFEST.items() if n != k}), {})
       for k in GOOD_MANIFEST if k not in ('n_ctx', 'n_documents')},   # the fields search reads
    'n_chunks-str': (json.dumps({**GOOD_MANIFEST, 'n_chunks': '4'}), {}),
    'deleted-npy': (json.dumps(GOOD_MANIFEST), {'embeddings.ab12.npy': None}),
    'cut-npy': (json.dumps(GOOD_MANIFEST), {'embeddings.ab12.npy': 100}),
    'empty-npy': (json.dumps(GOOD_MANIFEST), {'embeddings.ab12.npy': 0}),
    'deleted-jsonl': (json.dumps(GOOD_MANIFEST), {'chunks.ab12.jsonl': None}),
}


@pytest.mark.parametrize('broken', BROKEN_INDEXES)
def test_search_broken_index(broken, capsys, tmp_path):
    """An index whose manifest or data files are damaged: one error line naming the file and the
    command that rebuilds the index, exit 2, nothing changed."""
    text, cuts = BROKEN_INDEXES[broken]
    index = tmp_path / 'index'
    index.mkdir()
    buf = io.BytesIO()
    np.save(buf, np.zeros((4, 8), np.float32))
    files = {'manifest.json': text.encode(), 'embeddings.ab12.npy': buf.getvalue(),
             'chunks.ab12.jsonl': b'{"source": "a", "offset": 0, "text": "x"}\n' * 4}
    for name, data in files.items():
        if cuts.get(name, len(data)) is not None:
            (index / name).write_bytes(data[:cuts.get(name, len(data))])
    culprit = next((n for n in cuts), 'manifest.json')
    refused(capsys, 'retrieve', ['search', f'--index={index}', '--query=x'], str(index / culprit),
            keep=[tmp_path])
    code, _, err = run_main(capsys, 'retrieve', 'search', f'--index={index}', '--query=x')
    assert f'retrieve.py index --ckpt=CKPT --docs=PATH --index={index} --overwrite' in err
    assert broken[3:] not in GOOD_MANIFEST or repr(broken[3:]) in err, err   # the field named


def test_short_train_learns_retrieval_and_resumes(corpus, capsys, tmp_path):
    """60 InfoNCE steps from an untrained LM beat chance 3x; the lm head stays frozen; the result is
    an ordinary model checkpoint, and --init_from=resume continues it."""
    data, mixer = corpus.data, corpus.mixer
    out_dir = tmp_path / 'ret'
    common = [f'--data_dir={data}', f'--out_dir={out_dir}', '--batch_size=16', '--lr=2e-3',
              '--warmup_iters=2',
              '--eval_interval=20', '--eval_iters=3', '--log_interval=10', '--dtype=float32']
    code, out, err = run_main(capsys, 'retrieve', 'train', f'--init_from={mixer}', '--max_iters=60',
                              *common)
    assert code == 0, err
    evals = records(out_dir, 'val_loss')
    assert evals[0]['step'] == 0 and evals[-1]['step'] == 60
    # below log(16), the loss of embeddings collapsed to one point: the queries found their targets
    assert evals[-1]['val_loss'] < min(evals[0]['val_loss'], math.log(16)) - 0.1, evals
    run_main(capsys, 'retrieve', 'eval', f'--ckpt={out_dir}/ckpt.pt',
             f'--pairs={data}/pairs_val.jsonl', '--n=48', f'--json={tmp_path}/m.json')
    # chance is 1 in 47
    assert json.loads((tmp_path / 'm.json').read_text())['top1']['48'] > 3 * 100 / 47
    ckpt = train.load_checkpoint(out_dir / 'ckpt.pt')
    before = torch.load(mixer, weights_only=True)['model']
    assert ckpt['kind'] == 'retrieval' and ckpt['embed_pos'] == -1
    assert ckpt['init_from'] == os.path.abspath(mixer)
    assert set(train.model_from_checkpoint(ckpt).state_dict()) == set(before)
    assert torch.equal(ckpt['model']['lm_head.weight'], before['lm_head.weight'])
    assert run_main(capsys, 'retrieve', 'train', '--init_from=resume', '--max_iters=70',
                    *common)[0] == 0
    assert train.load_checkpoint(out_dir / 'ckpt.pt')['step'] == 70


def test_retrieval_ddp_row_shards_equal_one_process(corpus, capsys, tmp_path):
    """torchrun, grad_accum=1: each rank embeds half the queries and every target; the step is one
    process's."""
    common = ['train', f'--init_from={corpus.mixer}', f'--data_dir={corpus.data}', '--batch_size=8',
              '--lr=2e-3',
              '--max_iters=1', '--eval_interval=1', '--eval_iters=1', '--dtype=float32']
    torchrun('retrieve.py', [*common, f'--out_dir={tmp_path}/ddp'])
    assert run_main(capsys, 'retrieve', *common, f'--out_dir={tmp_path}/one')[0] == 0
    (ddp,), (one,) = records(tmp_path / 'ddp', 'loss'), records(tmp_path / 'one', 'loss')
    # the step's loss: mean of the shard losses
    assert ddp['loss'] == pytest.approx(one['loss'], rel=1e-5)
    a, b = weights(tmp_path / 'ddp'), weights(tmp_path / 'one')
    # Adam's first step is ~lr * sign(grad): near-zero gradients may differ
    for k, v in a['model'].items():
        torch.testing.assert_close(v, b['model'][k], rtol=0, atol=0.5 * 2e-3 / 21)


def test_train_paper_negatives_and_autoencoder_encoder(corpus, capsys, tmp_path):
    """Paper negatives with grad_accum train a llama; an autoencoder trains its encoder only."""
    for ckpt, extra in ((corpus.llama, ['--negatives=paper', '--batch_size=1', '--grad_accum=2']),
                        (corpus.ae, [])):
        out_dir = tmp_path / os.path.basename(ckpt)
        code, out, err = run_main(capsys, 'retrieve', 'train', f'--init_from={ckpt}',
                                  f'--data_dir={corpus.data}', f'--out_dir={out_dir}',
                                  '--max_iters=2', '--eval_interval=2', '--eval_iters=1', *extra)
        assert code == 0, err
        before = torch.load(ckpt, weights_only=True)['model']
        after = train.load_checkpoint(out_dir / 'ckpt.pt')
        changed = {k for k in before if not torch.equal(before[k], after['model'][k])}
        if ckpt == corpus.ae:
            assert changed and all(k.startswith('encoder.') for k in changed)
        else:
            assert after['config']['negatives'] == 'paper' and 'backbone.wte.weight' in changed


def test_index_joins_a_short_last_chunk_to_its_neighbour(corpus, capsys, tmp_path):
    """A document's last chunk of a few tokens (which cosines rank first) joins the chunk before
    it, whose embedding still reads its own window; --min_chunk=0 keeps every window apart."""
    tok, words = Tokenizer.from_dir(str(corpus.data)), PAIR_WORDS * 8
    for end in range(40, len(words)):          # 31 tokens a chunk (n_ctx 32 less bos); tail 1-3
        text = ' '.join(words[:end]) + '\n'
        if len(tok.encode(text)) > 62 and 1 <= len(tok.encode(text)) % 31 <= 3:
            break
    n = len(tok.encode(text))
    (tmp_path / 'docs').mkdir()
    (tmp_path / 'docs/long.txt').write_text(text)
    for min_chunk, offsets in ((16, list(range(0, n - n % 31, 31))), (0, list(range(0, n, 31)))):
        argv = [f'--ckpt={corpus.mixer}', f'--docs={tmp_path}/docs', f'--index={tmp_path}/i',
                f'--min_chunk={min_chunk}', '--overwrite', '--dtype=float32']
        assert run_main(capsys, 'retrieve', 'index', *argv)[0] == 0
        manifest = json.loads((tmp_path / 'i/manifest.json').read_text())
        chunks = [json.loads(line) for line in (tmp_path / 'i' / manifest['chunks']).open()]
        assert [c['offset'] for c in chunks] == offsets, (n, min_chunk)
        assert tok.decode(tok.encode(text)[-(n % 31):]).strip() in chunks[-1]['text']


class HubOnlyPeer:
    """A sentence-transformers stand-in whose model is on the hub only, never in the cache."""
    calls = []

    def __init__(self, name, device='cpu', local_files_only=False):
        HubOnlyPeer.calls.append(local_files_only)
        raise OSError(f"{name} is not in the cache" if local_files_only else
                      "the hub client retried for 75 s")


def test_peer_by_name_fails_fast_without_the_hub(corpus, capsys, monkeypatch):
    """A hub name with the hub out of reach (a closed port) reads the cache only and says to pass
    a folder, with sentence-transformers named as optional; so does the package missing."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        dead = f'http://127.0.0.1:{s.getsockname()[1]}'  # closed once the block ends
    installed = importlib.util.find_spec('sentence_transformers') is not None
    monkeypatch.setenv('HF_ENDPOINT', dead)
    monkeypatch.delenv('HF_HUB_OFFLINE', raising=False)
    monkeypatch.setitem(sys.modules, 'sentence_transformers',
                        types.SimpleNamespace(SentenceTransformer=HubOnlyPeer))
    HubOnlyPeer.calls.clear()
    argv = ['eval', '--peer=all-MiniLM-L6-v2', f'--pairs={corpus.data}/pairs_val.jsonl', '--n=8']
    refused(capsys, 'retrieve', argv, '--peer=PATH')
    assert HubOnlyPeer.calls == [True]                    # never asked to reach the hub
    _, _, err = run_main(capsys, 'retrieve', *argv)
    assert dead in err and 'sentence-transformers is optional' in err
    if installed:
        monkeypatch.setitem(sys.modules, 'sentence_transformers', None)   # as if not installed
    else:
        monkeypatch.delitem(sys.modules, 'sentence_transformers')         # this machine's case
    refused(capsys, 'retrieve', argv, 'pip install sentence-transformers')
    assert 'optional' in run_main(capsys, 'retrieve', *argv)[2]


# =============================================================================
# 7. prepare.py (the hub datasets from a local stand-in server, fixture `hub`)

def test_pystdlib_subset_agrees_with_meta_and_splits_by_module(stdlib_dir, capsys):
    """Every document is one module, verbatim, in its hash-assigned split; docstring pairs follow
    the module split; an unchanged rerun is a no-op that touches no file."""
    meta, docs, pairs = read_folder(stdlib_dir)
    assert meta['dataset'] == 'pystdlib' and meta['vocab_size'] == 400 and meta['train_docs'] == 150
    assert meta['val_docs'] > 0 and meta['source']['python'] == platform.python_version()
    assert meta['source']['files'] == meta['train_docs'] + meta['val_docs']
    root, files = prepare.stdlib_files()
    assert not any(part in ('test', 'tests',
                            'site-packages') for f in files for part in f.split('/')[:-1])
    sources = {open(os.path.join(root, f), encoding='utf-8').read(): f for f in files[:400]}
    assert all(prepare.split_of(sources[d], 0.05) == s for s in docs for d in docs[s])
    # no val module's code among the train targets (a few small helpers exist verbatim in two
    # modules, e.g. asyncio's write_eof, so compare against what train modules hold)
    from_val = {t for d in docs['val'] for _, t in docstring_pairs(d)}
    from_train = {t for d in docs['train'] for _, t in docstring_pairs(d)}
    train_targets = {p['target'] for p in pairs['train']}
    assert from_val == {p['target'] for p in pairs['val']} and from_val
    assert train_targets == from_train
    assert not train_targets & (from_val - from_train)
    mtimes = lambda: {n: os.stat(os.path.join(stdlib_dir, n)).st_mtime_ns  # noqa: E731
                      for n in os.listdir(stdlib_dir)}
    before = mtimes()
    assert prepare.main(['pystdlib', '--max_docs=150', '--vocab_size=400',
                         f'--out_dir={stdlib_dir}']) == 0
    assert 'up to date' in capsys.readouterr().out and mtimes() == before


def test_tokenizer_round_trips_any_text(stdlib_dir, tmp_path):
    tok = Tokenizer.from_dir(stdlib_dir)
    texts = ['naïve café, Ærøskøbing', 'emoji 🎉🚀 👩‍👩‍👧 ✔️',
             '中文字符 ∀x∈ℝ: x² ≥ 0', 'ʘ‿ʘ ☃ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢',
             '  lead\t\ttabs\n\n  trailing  \r\n\x00\x01\x7f', '<s></s><pad><unk><|endoftext|>', '',
             ' ', '\n']
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids) == text and not set(ids) & {tok.bos_id, tok.eos_id, tok.pad_id}
    # unseen: byte pieces, no <unk>
    assert any(tok.sp.id_to_piece(i).startswith('<0x') for i in tok.encode('☃'))
    assert tok.encode('x', bos=True, eos=True) == [tok.bos_id] + tok.encode('x') + [tok.eos_id]
    assert tok.decode([tok.bos_id, *tok.encode('hi'), tok.eos_id, tok.pad_id]) == 'hi'
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    meta = json.load(open(os.path.join(stdlib_dir, 'meta.json')))
    from_meta = Tokenizer.from_meta(meta, stdlib_dir)
    assert from_meta.encode('def f(): pass') == tok.encode('def f(): pass')
    with pytest.raises(FileNotFoundError, match='meta.json'):
        Tokenizer.from_dir(tmp_path)


def test_killed_mid_encode_then_rerun_matches_uninterrupted(tmp_path, stdlib_dir):
    rng = random.Random(0)
    (tmp_path / 'corpus').mkdir()
    for i in range(24):  # ~6 MB: a second of encoding on 2 cores, plenty to kill it in the middle
        part = '\n<|endoftext|>\n'.join(prose(rng, 60) for _ in range(90))
        (tmp_path / f'corpus/part{i:02d}.txt').write_text(part)
    args = ['text', f'--input={tmp_path}/corpus', '--pairs=ict',
            f"--tokenizer={stdlib_dir}/tokenizer.model"]
    assert prepare.main([*args, f'--out_dir={tmp_path}/a']) == 0
    out = tmp_path / 'b'
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, 'prepare.py'), *args,
                             f'--out_dir={out}'], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 60
    while not (out / 'train.bin.tmp').exists() or (out / 'train.bin.tmp').stat().st_size == 0:
        assert proc.poll() is None and time.time() < deadline, 'finished before interrupted'
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # really killed mid-encode
    assert not (out / 'meta.json').exists() and not (out / 'train.bin').exists()
    assert prepare_cli(*args, f'--out_dir={out}').returncode == 0
    snapshot = lambda d: {n: (d / n).read_bytes() for n in sorted(os.listdir(d))}  # noqa: E731
    assert snapshot(out) == snapshot(tmp_path / 'a')
    meta, docs, pairs = read_folder(str(out))
    assert meta['train_docs'] + meta['val_docs'] == 24 * 90 and pairs['train'] and pairs['val']


FIXTURE_PY = '''\
import functools


@functools.cache
def area(r):
    """Area of a circle
    of radius r.

    Uses pi from math.
    """
    return 3.14159 * r * r


class Stack:
    """A last-in first-out stack."""

    def push(self, x):
        """Put x on top."""
        self.items.append(x)


def inline(): """Docstring on the def line."""


def plain(x):
    return x
'''


def test_docstring_and_ict_pairs():
    """A docstring's first paragraph, joined, queries its code without the docstring (decorators
    kept); an ICT query is one sentence of a 6-sentence window, its target the others, separators
    kept."""
    assert docstring_pairs(FIXTURE_PY) == [
        ('Area of a circle of radius r.',
         '@functools.cache\ndef area(r):\n    return 3.14159 * r * r'),
        ('A last-in first-out stack.',
         'class Stack:\n\n    def push(self, x):\n        self.items.append(x)'),
        ('Put x on top.', 'def push(self, x):\n    self.items.append(x)')]
    assert docstring_pairs('def broken(:\n    """Nope."""\n') == []
    sentences = [f'Sentence number {i} has words.' for i in range(8)]
    text = ' '.join(sentences[:4]) + '\n\n' + ' '.join(sentences[4:])
    pairs = ict_pairs(text, 'doc')
    # deterministic; the 2-sentence tail is too short
    assert len(pairs) == 1 and pairs == ict_pairs(text, 'doc')
    query, target = pairs[0]
    assert query in sentences[:6] and query not in target
    assert ('\n\n' in target or query == sentences[3])
    assert target.split() == ' '.join(s for s in sentences[:6] if s != query).split()
    assert ict_pairs('Too short. Only two.', 'x') == []


def test_text_dataset_pairs(tmp_path, stdlib_dir):
    """A folder (binary files skipped) or a glob becomes documents with their docstring or ICT
    pairs."""
    (tmp_path / 'src').mkdir()
    for i in range(12):
        (tmp_path / f'src/mod{i}.py').write_text(FIXTURE_PY.replace('Stack', f'Stack{i}'))
        (tmp_path / f'src/notes{i}.txt').write_text(prose(random.Random(i), 14))
    (tmp_path / 'src/blob.bin').write_bytes(b'\0\1\2' * 100)
    tok = f'--tokenizer={stdlib_dir}/tokenizer.model'
    assert prepare.main(['text', f'--input={tmp_path}/src', '--pairs=docstring', tok,
                         f'--out_dir={tmp_path}/d']) == 0
    meta, docs, pairs = read_folder(tmp_path / 'd')
    assert meta['train_docs'] + meta['val_docs'] == 24
    assert sorted((p['query'], p['target']) for s in pairs for p in pairs[s]) == sorted(
        p for i in range(12) for p in docstring_pairs(FIXTURE_PY.replace('Stack', f'Stack{i}')))
    assert prepare.main(['text', f'--input={tmp_path}/src/*.txt', '--pairs=ict', tok,
                         f'--out_dir={tmp_path}/i']) == 0
    meta, docs, pairs = read_folder(tmp_path / 'i')
    assert meta['train_docs'] + meta['val_docs'] == 12
    key = {(tmp_path / f'src/notes{i}.txt').read_text(): f'notes{i}.txt' for i in range(12)}
    for s in pairs:
        want = [p for d in docs[s] for p in ict_pairs(d, key[d])]
        assert [(p['query'], p['target']) for p in pairs[s]] == want


def test_tokenizer_training_reads_only_its_sample_and_is_deterministic(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, 'TOKENIZER_SAMPLE', 20_000)
    pulled = []

    def documents():
        rng = random.Random(0)
        for i in range(100_000):
            pulled.append(i)
            yield 'train' if i % 10 else 'val', str(i), prose(rng, 10), None
    prepare.train_tokenizer(documents, 2, 400, tmp_path / 'a.model')
    assert 40 < len(pulled) < 400  # ~20 kB of every other training document, not the whole stream
    prepare.train_tokenizer(documents, 2, 400, tmp_path / 'b.model')
    assert (tmp_path / 'a.model').read_bytes() == (tmp_path / 'b.model').read_bytes()


def test_tiktoken_tokenizer_or_clear_offline_error(tmp_path, capsys):
    for i in range(10):
        (tmp_path / f'{i}.txt').write_text(f'Hello world {i}. ' * 50)
    code, _, err = run_main(capsys, 'prepare', 'text', f'--input={tmp_path}/*.txt',
                            '--tokenizer=gpt2', f'--out_dir={tmp_path}/out')
    if code == 0:  # online, or the vocabulary is cached
        meta, docs, _ = read_folder(tmp_path / 'out')
        assert meta['tokenizer'] == {'kind': 'tiktoken', 'name': 'gpt2'}
        assert meta['vocab_size'] == 50257
        assert not (tmp_path / 'out/tokenizer.model').exists()
    else:
        assert code == 2 and len(err.strip().splitlines()) == 1 and 'gpt2' in err


def test_hub_text_datasets(tmp_path, hub):
    """TinyStories downloads into --download_dir (--max_docs cuts train only); TinyStories-Instruct,
    found through $HF_ENDPOINT, keeps the stories and pairs each Summary with its story."""
    r = hub_cli(tmp_path, 'tinystories', f'--hub_url={hub["url"]}', '--max_docs=30')
    assert r.returncode == 0, r.stderr
    train_txt = '/datasets/roneneldan/TinyStories/resolve/main/TinyStories-train.txt'
    assert ('HEAD', train_txt) in hub['served']
    assert (tmp_path / 'downloads/TinyStories/TinyStories-train.txt').read_bytes() == \
        hub['files']['roneneldan/TinyStories/TinyStories-train.txt']
    meta, docs, _ = read_folder(tmp_path / 'data/tinystories')
    assert docs['train'] == hub['stories'][:30] and docs['val'] == hub['stories'][40:]
    assert meta['source']['repo'] == 'roneneldan/TinyStories'
    r = hub_cli(tmp_path, 'tinystories-instruct', env={'HF_ENDPOINT': hub['url']})
    assert r.returncode == 0, r.stderr
    meta, docs, pairs = read_folder(tmp_path / 'data/tinystories-instruct')
    for split, records in (('train', hub['itrain']), ('val', hub['ivalid'])):
        assert docs[split] == [s for _, s, _ in records]
        summaries = [(f[len('Summary: '):], s) for _, s,
                     fields in records for f in fields if f.startswith('Summary:')]
        assert [(p['query'], p['target']) for p in pairs[split]] == summaries


def test_hub_parquet_shards(tmp_path, hub):
    """fineweb-edu reads only sample/10BT's shards, in order, stopping at --max_tokens; finemath its
    folder."""
    r = hub_cli(tmp_path, 'fineweb-edu', f'--hub_url={hub["url"]}', '--pairs=ict',
                '--max_tokens=6000')
    assert r.returncode == 0, r.stderr
    meta, docs, pairs = read_folder(tmp_path / 'data/fineweb-edu')
    texts, used = hub['shards'][0] + hub['shards'][1], docs['train'] + docs['val']
    assert set(used) < set(texts) and sorted(used, key=texts.index) == texts[:len(used)]
    assert len(used) > 30
    last = len(Tokenizer.from_dir(tmp_path / 'data/fineweb-edu').encode(docs['train'][-1])) + 2
    assert meta['train_tokens'] >= 6000 > meta['train_tokens'] - last and meta['dtype'] == 'uint16'
    assert pairs['train'] and all(p['query'] not in p['target'] for p in pairs['train'])
    r = hub_cli(tmp_path, 'finemath', f'--hub_url={hub["url"]}')
    assert r.returncode == 0, r.stderr
    meta, docs, pairs = read_folder(tmp_path / 'data/finemath')
    assert sorted(docs['train'] + docs['val']) == sorted(hub['shards'][1]) and not pairs
    assert meta['vocab_size'] <= 400 and meta['source']['folder'] == 'finemath-4plus'


def test_hub_unreachable_says_what_to_download(tmp_path, hub):
    """Out of reach, prepare fails in seconds naming each file's URL and where to put it; following
    that works offline, and a prepared folder then reruns as a no-op without the hub."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        dead = f'http://127.0.0.1:{s.getsockname()[1]}'  # closed once the block ends
    t0 = time.time()
    r = hub_cli(tmp_path, 'tinystories', f'--hub_url={dead}')
    assert r.returncode == 2 and time.time() - t0 < 20 and r.stderr.count('\n') == 1
    assert r.stderr.startswith('error: ')
    for name in ('TinyStories-valid.txt', 'TinyStories-train.txt'):
        wanted = tmp_path / 'downloads/TinyStories' / name
        assert f'{dead}/datasets/roneneldan/TinyStories/resolve/main/{name}' in r.stderr
        assert str(wanted) in r.stderr
        wanted.parent.mkdir(parents=True, exist_ok=True)
        wanted.write_bytes(hub['files'][f'roneneldan/TinyStories/{name}'])
    r = hub_cli(tmp_path, 'tinystories', f'--hub_url={dead}')
    assert r.returncode == 0, r.stderr
    assert read_folder(tmp_path / 'data/tinystories')[1]['val'] == hub['stories'][40:]
    r = hub_cli(tmp_path, 'tinystories', f'--hub_url={dead}')
    assert r.returncode == 0 and 'up to date' in r.stdout
    r = hub_cli(tmp_path, 'fineweb-edu', f'--hub_url={dead}')
    assert r.returncode == 2 and r.stderr.count('\n') == 1 and 'sample/10BT' in r.stderr


def help_line(out, key):
    """The --help line of one key: `--key=default  its comment`."""
    return next(line.strip() for line in out.splitlines() if line.strip().startswith(f'--{key}='))


def test_help_shows_each_keys_comment_from_the_source(capsys):
    code, out, _ = run_main(capsys, 'train', '--help')
    assert code == 0
    assert 'context window' in help_line(out, 'n_ctx')                   # ModelConfig's comment
    assert 'sequences per micro-batch' in help_line(out, 'batch_size')   # LOOP_DEFAULTS' comment
    assert 'packed: random windows' in help_line(out, 'batch_mode')      # DEFAULTS' own
    code, out, _ = run_main(capsys, 'sample', '-h')
    assert code == 0 and 'nucleus sampling' in help_line(out, 'top_p')


def test_help_shows_the_modes_own_defaults(capsys):
    """bench.py memory --help lists memory's sizes, not throughput's; retrieve's commands
    their own."""
    code, out, _ = run_main(capsys, 'bench', 'memory', '--help')
    assert code == 0 and help_line(out, 'd_model').split()[0] == '--d_model=1024'
    assert help_line(out, 'n_ctx').split()[0] == "--n_ctx='512,1024,2048'"
    assert 'tokens of the prompt' in help_line(out, 'prompt')           # a line holding two keys
    _, out, _ = run_main(capsys, 'bench', 'throughput', '--help')
    assert help_line(out, 'd_model').split()[0] == '--d_model=256'
    _, out, _ = run_main(capsys, 'retrieve', 'indirect', '--help')
    assert help_line(out, 'batch_size').startswith('--batch_size=64') and 'retrieval inputs' in out
    _, out, _ = run_main(capsys, 'retrieve', 'eval', '--help')
    assert 'texts per forward pass' in help_line(out, 'batch_size')


def test_the_command_line_layer_knows_no_scripts_ranges():
    """parse_args types values; ranges are each script's (a key of one script means nothing to
    another)."""
    assert prepare.parse_args(['--batch_size=0', '--lr=-1.0'], dict(batch_size=4, lr=0.1)) == \
        dict(batch_size=0, lr=-1.0)
    with pytest.raises(ValueError, match='2\\*\\*63'):  # beyond what torch and numpy can hold
        prepare.parse_args([f'--seed={2 ** 64}'], dict(seed=0))


# =============================================================================
# 8. bench.py: every mode at tiny sizes, the representation metric on models whose answer is
# known by construction, MFU bounds

BENCH_TINY = ['--d_model=32', '--n_layers=1', '--n_ctx=16', '--vocab_size=128', '--batch_size=2',
              '--dtype=float32', '--device=cpu']


def test_bench_throughput_rows_and_mfu(tmp_path):
    rows = bench.main(['throughput', '--archs=mixer,llama', *BENCH_TINY, '--warmup=1',
                       '--repeats=2',
                       f'--json={tmp_path}/rows.json'])
    assert [r['arch'] for r in rows] == ['mixer', 'llama']
    assert json.loads((tmp_path / 'rows.json').read_text()) == rows
    for r in rows:
        assert 0 < r['mfu'] <= 1 and r['tokens_per_s'] > 0 and r['peak_flops'] > 1e8
        assert r['tokens_per_s'] == pytest.approx(2 * 16 / (r['ms_per_step'] / 1e3))


def test_bench_throughput_oom_row_and_json_as_rows_finish(tmp_path, monkeypatch, capsys):
    """A model that cannot be allocated is an OOM row, as in memory mode; --json holds each row as
    soon as it is measured, so an interrupt after two rows leaves both."""
    build = bench.build_model

    def build_or_fail(cfg):
        if cfg.n_ctx == 24:   # what torch's CPU allocator raises past `ulimit -v`
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")
        if cfg.n_ctx == 32:
            raise KeyboardInterrupt
        return build(cfg)
    monkeypatch.setattr(bench, 'build_model', build_or_fail)
    tiny = [a for a in BENCH_TINY if not a.startswith('--n_ctx')]
    argv = ['throughput', '--archs=mixer', *tiny, '--warmup=1', '--repeats=1',
            f'--json={tmp_path}/rows.json']
    code, out, err = run_main(capsys, 'bench', *argv, '--n_ctx=16,24,32')
    rows = json.loads((tmp_path / 'rows.json').read_text())
    assert code == 130 and 'Traceback' not in err and 'mixer n_ctx=24: OOM' in out, (code, err)
    assert [(r['n_ctx'], r['tokens_per_s'] is None, r['mfu'] is None) for r in rows] == [
        (16, False, False), (24, True, True)]
    rows = bench.main(argv + ['--n_ctx=24,16'])   # a whole run: an OOM row, then a measured one
    assert [r['ms_per_step'] is None for r in rows] == [True, False]
    assert json.loads((tmp_path / 'rows.json').read_text()) == rows
    assert '| mixer | 24 | 32 | 1 | 2 | float32 | OOM | OOM | OOM |' in capsys.readouterr().out


def test_bench_retrieval_times_full_and_trimmed_steps(corpus):
    rows = bench.main(['retrieval', '--archs=mixer,llama', '--d_model=32', '--n_layers=1',
                       '--n_ctx=32', '--batch_size=4', '--dtype=float32',
                       f'--data_dir={corpus.data}', '--warmup=1', '--repeats=1'])
    assert [(r['arch'], r['padding']) for r in rows] == [('mixer', 'full'), ('mixer', 'trimmed'),
                                                         ('llama', 'full'), ('llama', 'trimmed')]
    assert all(r['ms_per_step'] > 0 and 0 < r['real_tokens'] < 1 for r in rows)


@pytest.mark.parametrize('where', ['nowhere', 'no pairs'])
def test_bench_retrieval_refusal_says_it_once(where, data, capsys, tmp_path):
    """No prepared data, or data without pairs: one error naming it, its advice given once."""
    data_dir = tmp_path / 'nothing' if where == 'nowhere' else data
    refused(capsys, 'bench', ['retrieval', f'--data_dir={data_dir}'], str(data_dir))
    err = run_main(capsys, 'bench', 'retrieval', f'--data_dir={data_dir}')[2].splitlines()[-1]
    assert err.count('python prepare.py') == 1 and err.count('--data_dir') == 1, err


def test_bench_memory(capsys):
    """A cell's peak grows with the model, is laid out like Tables S9/S10, and is None (OOM) past
    --mem_limit. --n_heads reaches llama's cells (Table S10 used 32 heads) but not a mixer's."""
    big = ['--archs=mixer', '--d_model=256', '--n_layers=2', '--n_ctx=256', '--dtype=float32']
    rows = bench.main(['memory', *big])
    # parameters + gradients alone are 2 x 4 bytes x ~2.2M (two 256x1024 MLPs per layer, the
    # 4096 x 256 token table, two 256x256 mixings) = ~17 MB
    assert len(rows) == 1 and 15 < rows[0]['mb'] < 200
    assert '| n_layers=2 |' in capsys.readouterr().out
    assert bench.run_cell(bench.settings(['memory', *big, '--mem_limit=1'], 'memory'),
                          'mixer', 2, 256) is None
    small = ['--d_model=64', '--n_layers=2', '--n_ctx=512', '--dtype=float32', '--batch_size=2']
    one, eight = (bench.settings(['memory', *small, f'--n_heads={h}'], 'memory') for h in (1, 8))
    assert [cfg.n_heads for cfg in bench.grid(eight)] == [1, 8]  # the default archs: mixer, llama
    # the 7 more heads' attention weights kept for backward alone: 7 x 2 rows x 512^2 x 4 bytes x 2
    # layers = 29 MB (peak RSS shows 55 to 100 MB more, depending on the allocator's reuse)
    assert bench.run_cell(eight, 'llama', 2,
                          512) - bench.run_cell(one, 'llama', 2, 512) > 25 * 2**20


def test_bench_generate_methods_batches_and_ceiling(monkeypatch):
    """window at the first batch size, cache at each; every row beside its bandwidth ceiling."""
    monkeypatch.setattr(bench, 'last_level_cache', lambda dev: 0)  # every step past the cache
    rows = bench.main(['generate', '--archs=mixer,llama', *BENCH_TINY, '--batch_size=1,3',
                       '--prompt=4', '--new_tokens=6'])
    runs = (('window', 1), ('cache', 1), ('cache', 3))
    assert [(r['arch'], r['method'], r['batch_size']) for r in rows] == [
        (a, m, b) for a in ('mixer', 'llama') for m, b in runs]
    for r in rows:
        assert r['tokens_per_s'] > 0 and r['prefill_ms'] > 0 and r['gb_per_s'] > 0.1
        ceiling = r['batch_size'] * r['gb_per_s'] * 1e9 / (r['mb_per_step'] * 1e6)
        assert r['ceiling_tokens_per_s'] == pytest.approx(ceiling)
        assert r['fraction'] == pytest.approx(r['tokens_per_s'] / ceiling)


def test_decode_bytes_weights_once_cache_rows_per_sequence():
    """A cached step reads each weight once (embeddings: a row; mixings: row pos) and, per sequence,
    the cache up to pos: one position more adds a cache row per layer (and a mixing weight)."""
    d, L, vocab = 32, 2, 128
    for arch, per_pos in (('mixer', L * (d + 1) * 4), ('llama', L * 2 * d * 4),
                          ('gpt', L * 2 * d * 4)):
        torch.manual_seed(0)
        model = build_model(ModelConfig(arch=arch, vocab_size=vocab, n_ctx=16, d_model=d,
                                        n_layers=L))
        one = bench.decode_bytes(model, 5)
        assert bench.decode_bytes(model, 6) - one == per_pos
        cache = (L * 6 * d if arch == 'mixer' else L * 2 * 6 * d) * 4
        per_seq = cache + d * 4 * (2 if arch == 'gpt' else 1)
        assert bench.decode_bytes(model, 5, batch=3) - one == 2 * per_seq
        every = sum(p.numel() for p in model.parameters()) * 4
        assert one < every == bench.decode_bytes(model, 5, cached=False)
        assert bench.decode_bytes(model.to(torch.bfloat16), 5) * 2 == one  # weights and cache halve
    tied = build_model(ModelConfig(vocab_size=vocab, n_ctx=16, d_model=d, n_layers=L,
                                   tie_weights=True))
    assert bench.decode_bytes(tied, 5) > vocab * d * 4  # the lm head reads the table


def bench_mixer(vocab=128, **kw):
    torch.manual_seed(0)
    return build_model(ModelConfig(**{**dict(vocab_size=vocab, n_ctx=16, d_model=32, n_layers=2),
                                      **kw}))


def bench_tokens(vocab, shape=(2, 16)):
    return torch.randint(vocab, shape, generator=torch.Generator().manual_seed(1))


class ConstantBlock(nn.Module):
    """A block whose output ignores its input."""

    def forward(self, x, pos=0, cache=None, mask=None):
        return x * 0 + 1


def test_bench_represent_recovers_what_reaches_the_layer():
    """Zeroed blocks are identities, so O_l(e) = e: every token comes back (from the last position
    alone, none of the others). A constant block passes nothing: chance, 1 - 1/vocab. Pads are not
    counted (eq. 6)."""
    model = bench_mixer()
    with torch.no_grad():
        for p in model.backbone.blocks.parameters():
            p.zero_()
    rows = bench.represent_rows(model, bench_tokens(128), [1, 2], steps=500, lr=0.05)
    by = {(r['layer'], r['positions']): r for r in rows}
    assert by[2, 'all']['hamming'] == 0 and by[1, 'all']['hamming'] == 0
    assert by[2, 'last']['hamming'] > 0.8
    assert by[2, 'all']['converged'] == 1 and by[2, 'all']['loss'] < by[2, 'all']['epsilon']
    model = bench_mixer(vocab=64)
    model.backbone.blocks = nn.ModuleList([ConstantBlock()])
    for r in bench.represent_rows(model, bench_tokens(64, (8, 16)), [1], steps=50, lr=0.05):
        assert r['hamming'] == pytest.approx(1 - 1 / 64, abs=0.04)
    x, y = torch.tensor([[5, 6, 0, 0]]), torch.tensor([[5, 7, 1, 1]])
    assert bench.hamming(x, y, pad_id=0) == 0.5 and bench.hamming(x, y) == 0.75


def test_bench_represent_untrained_mixer_beats_llama():
    """The paper's §3.3 finding, in small: an untrained mixer's last layer gives its input back, a
    llama's does not."""
    rows = bench.main(['represent', '--d_model=128', '--n_layers=2', '--n_ctx=16',
                       '--vocab_size=256'])
    h = {(r['arch'], r['positions']): r['hamming'] for r in rows}
    assert h['mixer', 'all'] < 0.05 and h['llama', 'all'] > 0.5
    assert all(r['layer'] == 2 for r in rows)


def test_bench_represent_other_objectives_and_checkpoints(trained, data):
    """Autoencoders are probed through their encoder, half-sequence models through their own
    forward; the two-stream bidirectional model has no single backbone to invert. A checkpoint is
    probed on its data."""
    for objective in ('autoencoder', 'half'):
        rows = bench.represent_rows(bench_mixer(64, n_ctx=8, d_model=16, objective=objective),
                                    bench_tokens(64, (1, 8)), [2], steps=3, lr=0.05)
        assert len(rows) == 2 and all(0 <= r['hamming'] <= 1 for r in rows)
    with pytest.raises(ValueError, match='embedding'):
        bench.represent_rows(bench_mixer(64, n_ctx=8, d_model=16, objective='bidirectional'),
                             bench_tokens(64, (1, 8)), [1], steps=3, lr=0.05)
    rows = bench.main(['represent', f'--ckpt={trained}/ckpt.pt', f'--data_dir={data}',
                       '--layer=1,2', '--steps=50'])
    assert [(r['layer'], r['positions']) for r in rows] == [(1, 'all'), (1, 'last'), (2, 'all'),
                                                            (2, 'last')]
    assert all(r['arch'] == 'mixer' and 0 <= r['hamming'] <= 1 for r in rows)


def test_bench_all_prints_tables_writes_json_and_plot(tmp_path, capsys):
    """`all` runs every mode; the plot is checked where the optional matplotlib is installed."""
    try:
        import matplotlib  # noqa: F401
        has_plot = True
    except ImportError:
        has_plot = False
    js, png = tmp_path / 'all.json', tmp_path / 'all.png'
    rows = bench.main(['all', '--archs=mixer', *BENCH_TINY, '--prompt=4', '--new_tokens=4',
                       '--steps=20', '--warmup=1', '--repeats=1', f'--json={js}',
                       *([f'--plot={png}'] if has_plot else [])])
    out = capsys.readouterr().out
    assert {r['mode'] for r in rows} == {'throughput', 'memory', 'generate', 'represent'}
    assert all(f'## {mode}' in out for mode in ('throughput', 'memory', 'generate', 'represent'))
    assert '| arch |' in out and '| n_layers=1 |' in out
    assert json.loads(js.read_text()) == rows
    assert not has_plot or (png.read_bytes()[:4] == b'\x89PNG'
                            and not os.path.exists(f'{png}.tmp.png'))


RACE_TINY = ['--d_model=16', '--n_layers=1', '--n_ctx=16', '--batch_size=2', '--eval_iters=1',
             '--log_interval=5', '--warmup_iters=0', '--device=cpu']


def test_train_evaluates_at_marks_of_training_time(data, tmp_path):
    """eval_seconds > 0 evaluates once per mark of training time (not every eval_interval steps),
    logging the training seconds and tokens seen; the budget's last evaluation closes the run."""
    assert train.main([f'--data_dir={data}', f'--out_dir={tmp_path}', *RACE_TINY, '--max_iters=0',
                       '--max_time=1.2', '--eval_seconds=0.3', '--eval_interval=100000']) == 0
    evals = [json.loads(line) for line in open(tmp_path / 'log.jsonl') if 'val_loss' in line]
    marks = [int(e['time'] // 0.3) for e in evals[:-1]]  # the last one is the budget's
    assert evals[0]['time'] == 0 and marks == sorted(set(marks)) and len(evals) >= 3
    assert all(e['tokens_seen'] > 0 for e in evals[1:]) and evals[-1]['time'] >= 1.2


@pytest.fixture(scope='module')
def tiny_race(data, tmp_path_factory):
    """A race of a mixer and a llama, 1.5 s of training each, and its rows."""
    out = tmp_path_factory.mktemp('race')
    rows = bench.main(['race', f'--data_dir={data}', f'--out_dir={out}', *RACE_TINY,
                       '--max_time=1.5', '--eval_seconds=0.5'])
    return out, rows, data


def test_race_writes_table_json_and_picture(tiny_race, capsys):
    import matplotlib.image
    out, rows, data = tiny_race
    assert [r['arch'] for r in rows] == ['mixer', 'llama']
    assert all(r['steps'] > 0 and r['tokens_per_s'] > 0 for r in rows)
    assert all(r['best_val'] <= r['final_val'] for r in rows)
    assert 's_to_llama_best' in rows[0] and 's_to_mixer_best' in rows[1]
    assert '| mixer |' in (out / 'race.md').read_text()
    result = json.loads((out / 'race.json').read_text())
    assert all(len(result['curves'][a]) >= 3 for a in ('mixer', 'llama'))  # step 0, a mark, the end
    assert matplotlib.image.imread(out / 'race.png').ndim == 3
    capsys.readouterr()
    # one more race into the same out_dir would replace it: refused before any work
    assert bench.main(['race', f'--out_dir={out}', f'--data_dir={data}', '--max_time=1']) == 2
    assert '--overwrite' in capsys.readouterr().err


def test_race_runs_overlap_in_time_on_cpu(tiny_race):
    """On a CPU the runs train at the same time: each starts before the other one ends."""
    runs = json.loads((tiny_race[0] / 'race.json').read_text())['settings']['status']
    mixer, llama = runs['mixer'], runs['llama']
    assert mixer['exit'] == llama['exit'] == 0
    assert mixer['started'] < llama['ended'] and llama['started'] < mixer['ended']


@pytest.mark.parametrize('argv, says', [
    (['--max_time=0'], '--max_time=0'),
    (['--archs=mixer,transformer'], "unknown arch 'transformer'")])
def test_race_bad_budget_or_arch_is_one_line_error(argv, says, capsys):
    assert bench.main(['race', *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('error: ') and says in err[0]


def race_children(out):
    """Live processes whose command line names a folder under out (the race's runs)."""
    found = []
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{pid}/cmdline', 'rb') as f:
                cmd = f.read().decode(errors='replace')
        except OSError:
            continue
        if f'--out_dir={out}/' in cmd:
            found.append(int(pid))
    return found


@pytest.mark.skipif(not os.path.isdir('/proc'), reason='reads /proc')
def test_race_ctrl_c_leaves_no_child_behind(data, tmp_path):
    """SIGINT to the race alone stops every run (in sessions of their own, they get it from the
    race), exits 130 and still writes what was measured."""
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, 'bench.py'), 'race', *RACE_TINY,
                             f'--data_dir={data}', f'--out_dir={tmp_path}', '--max_time=600',
                             '--eval_seconds=300'], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, start_new_session=True)
    try:
        def evaluated(arch):  # step 0 is evaluated: the run is training
            log = tmp_path / arch / 'log.jsonl'
            return log.exists() and 'val_loss' in log.read_text()
        deadline = time.time() + 120
        while time.time() < deadline and not (evaluated('mixer') and evaluated('llama')):
            time.sleep(0.2)
        assert len(race_children(tmp_path)) == 2
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and 'interrupted' in err
    assert race_children(tmp_path) == []
    result = json.loads((tmp_path / 'race.json').read_text())
    assert result['settings']['interrupted']
    assert all(result['curves'][a] for a in ('mixer', 'llama'))  # step 0's evaluations



def test_bench_ratios_are_medians_over_rounds_with_their_range(capsys):
    """Each ratio is taken within a round and shown as the median over the rounds with its
    min-max; a cell's row is its median round, whole, so that its columns agree."""
    def rows(mixer, gpt):  # one round's throughput rows
        return [dict(mode='throughput', arch=a, n_layers=4, n_ctx=128, batch_size=4,
                     tokens_per_s=t) for a, t in (('mixer', mixer), ('gpt', gpt))]
    out = bench.ratios([rows(2.0, 1.0), rows(6.0, 2.0), rows(1.0, 1.0)])
    assert out == "throughput mixer/gpt at n_layers=4 n_ctx=128: 2.00x (1.00-3.00)"
    assert bench.ratios([rows(2.0, 1.0)]).endswith(": 2.00x (one run)")
    cells = [dict(tokens_per_s=t, ms_per_step=1 / t) for t in (3.0, 1.0, 2.0, 4.0)]
    assert bench.median_round(cells, 'tokens_per_s') == dict(cells[2], repeats=4)
    rows = bench.main(['throughput', '--archs=mixer,gpt', *BENCH_TINY, '--warmup=0', '--repeats=3'])
    out = capsys.readouterr().out
    assert 'round 3 of 3' in out and all(r['repeats'] == 3 for r in rows)
    assert re.search(r'throughput mixer/gpt at n_layers=1 n_ctx=16: [\d.]+x \([\d.]+-[\d.]+\)', out)


def test_bench_generate_fraction_only_where_the_dram_ceiling_binds(monkeypatch, tmp_path, capsys):
    """The last-level cache is the largest in sysfs (None where unreadable); the bandwidth probe
    streams more than it holds; a step that fits in it, or an unknown cache, gets no fraction."""
    for i, size in enumerate(('32K', '32768K', '1M', 'odd')):
        (tmp_path / f'index{i}').mkdir()
        (tmp_path / f'index{i}' / 'size').write_text(size + '\n')
    (tmp_path / 'uevent').write_text('')
    cpu = torch.device('cpu')
    assert bench.last_level_cache(cpu, str(tmp_path)) == 32 * 2**20
    assert bench.last_level_cache(cpu, str(tmp_path / 'absent')) is None
    probes = []
    monkeypatch.setattr(bench, 'measure_read_bandwidth',
                        lambda dev, mib: probes.append(mib) or 1e10)
    argv = ['generate', '--archs=mixer', *BENCH_TINY, '--batch_size=1', '--prompt=4',
            '--new_tokens=4', '--methods=cache', '--repeats=1']
    for llc, bound in ((None, 'unknown'), (10**9, 'cache'), (1, 'dram')):
        monkeypatch.setattr(bench, 'last_level_cache', lambda dev: llc)
        (r,) = bench.main(argv)
        assert r['bound'] == bound and (r['fraction'] is None) == (bound != 'dram')
        assert probes[-1] * 2**20 > (llc or 0)
    out = capsys.readouterr().out
    assert 'cache size is unknown' in out and 'fits the 954 MiB last-level cache' in out
    assert '| cache | - |' in out


def test_bench_plot_refused_before_any_work_where_no_row_is_drawn(monkeypatch, capsys, tmp_path):
    """represent and retrieval make no row --plot draws: refused at once, matplotlib or not."""
    monkeypatch.setattr(bench, 'pyplot', lambda: None)
    for mode in ('represent', 'retrieval'):
        monkeypatch.setitem(bench.MEASURE, mode, lambda s: pytest.fail('measured first'))
        refused(capsys, 'bench', [mode, f'--plot={tmp_path}/b.png'], 'plot', keep=[tmp_path])


# =============================================================================
# 9. CUDA: the GPU code paths (skipped without a GPU; on one: python -m pytest -q -k cuda)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')


AMP = {'float32': contextlib.nullcontext,
       'bfloat16': lambda: torch.autocast('cuda', torch.bfloat16),
       'float16': lambda: torch.autocast('cuda', torch.float16)}


@cuda
@pytest.mark.parametrize('amp', ['float32', 'bfloat16'])
@pytest.mark.parametrize('variant,padding', [(v, None) for v in VARIANTS] + PADDED,
                         ids=lambda x: name(x) if isinstance(x, dict) else str(x))
def test_cuda_future_tokens_never_reach_past_logits(variant, padding, amp):
    """Section 1's causality test on the GPU's kernels (cuBLAS, SDPA), in fp32 and under bf16
    autocast."""
    gen = torch.Generator().manual_seed(1)
    idx, mask = padded_batch(padding, gen)
    model = perturbed(tiny(**variant), 0.05).cuda()
    assert_causal(model, idx.cuda(), None if mask is None else mask.cuda(), gen, AMP[amp])


@cuda
@pytest.mark.parametrize('kernel,amp,padding',
                         [('flash', 'bfloat16', None), ('flash', 'float16', None),
                                                ('efficient', 'float32', None),
                                                ('efficient', 'float32', 'left'),
                                                ('efficient', 'bfloat16', 'right')])
@pytest.mark.parametrize('arch', ['llama', 'gpt'])
def test_cuda_sdpa_kernels_match_explicit_attention(arch, kernel, amp, padding, no_tf32):
    """SDPA's flash and memory-efficient kernels, each forced (an unusable one raises), against the
    attention written out in float64: the GPU models compute the same function as the references."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    # head dim 32
    cfg = ModelConfig(arch=arch, vocab_size=V, n_ctx=64, d_model=128, n_layers=1, n_heads=4)
    attn = perturbed(cfg, 0.05).backbone.blocks[0].mixers[0]
    x = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(0))
    mask = None
    if padding:  # row 1 loses 9 tokens on the left or the right
        mask = torch.ones(2, 64, dtype=torch.bool)
        mask[1, slice(0, 9) if padding == 'left' else slice(55, 64)] = False
    want = reference_attention(x.double(), attn.double(), mask)
    attn.float().cuda()
    backend = {'flash': SDPBackend.FLASH_ATTENTION,
               'efficient': SDPBackend.EFFICIENT_ATTENTION}[kernel]
    with sdpa_kernel(backend), AMP[amp]():
        got = attn(x.cuda(), mask=None if mask is None else mask.cuda())
    tol = 1e-5 if amp == 'float32' else 3e-2
    torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)


@cuda
@pytest.mark.parametrize('variant', VARIANTS, ids=name)
def test_cuda_window_equals_cache(variant, no_tf32):
    """Section 1's window == cache on the GPU (fp32): the same greedy tokens through a slide."""
    window_equals_cache(tiny_model(**variant).cuda(), prompt(5).cuda())


@cuda
@pytest.mark.parametrize('arch', ['mixer', 'llama'])
def test_cuda_compiled_decode_step_equals_eager(arch, no_tf32):
    """sample.compiled_step through inductor's GPU kernels: the eager step's tokens, its logits to
    1e-4."""
    model = tiny_model(arch=arch).cuda()
    torch._dynamo.reset()
    step = sample.compiled_step(model)
    tok_c, logit_c = decode(model, prompt(5).cuda(), N_CTX + N_CTX // 2, 'cache', step=step)
    tok_e, logit_e = decode(model, prompt(5).cuda(), N_CTX + N_CTX // 2, 'cache')
    assert torch.equal(tok_c, tok_e)
    torch.testing.assert_close(logit_c, logit_e, atol=1e-4, rtol=0)
    torch._dynamo.reset()


@cuda
@pytest.mark.parametrize('dtype', ['float16', 'bfloat16', 'float32'])
@pytest.mark.parametrize('arch', ['mixer', 'llama', 'gpt'])
def test_cuda_training_learns(data, tmp_path, arch, dtype):
    """train.py on the GPU in each dtype lowers the loss; fp16 runs with a GradScaler whose state is
    saved."""
    ckpt = learns(data, tmp_path, '--device=cuda', f'--dtype={dtype}', f'--arch={arch}')
    scaler = ckpt['scaler']
    assert (scaler is not None and scaler['scale'] > 0) == (dtype == 'float16')


@cuda
@pytest.mark.parametrize('arch', ['mixer', 'llama'])
def test_cuda_compile_follows_the_eager_loss_curve(data, tmp_path, arch):
    """train.py --compile on the GPU: the eager run's losses, step for step, within 1 %."""
    curves = []
    for run, extra in (('eager', []), ('compiled', ['--compile'])):
        assert train_run(data, tmp_path / run, '--device=cuda', '--dtype=bfloat16',
                         f'--arch={arch}',
                         '--max_iters=20', '--eval_interval=20', *extra) == 0
        curves.append([r['loss'] for r in records(tmp_path / run, 'loss')])
    assert len(curves[0]) == 4
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), rtol=1e-2, atol=0)


@cuda
def test_cuda_torchrun_one_process_is_ddp_over_nccl(data, tmp_path):
    """torchrun --nproc_per_node=1 wraps the model in DDP over nccl (as on N GPUs) and trains."""
    proc = torchrun('train.py', [*TINY, f'--data_dir={data}', f'--out_dir={tmp_path}',
                                 '--device=cuda', '--max_iters=10', '--eval_interval=10'], nproc=1)
    assert 'DDP over nccl, 1 process(es)' in proc.stdout
    evals = records(tmp_path, 'val_loss')
    assert evals[-1]['step'] == 10 and evals[-1]['train_loss'] < evals[0]['train_loss']


@cuda
def test_cuda_kill9_then_resume_continues_the_run(data, tmp_path):
    """kill -9 mid-run and --init_from=resume on the GPU: the uninterrupted run's weights and losses
    (to float tolerance, not bit for bit: CUDA's embedding backward adds with atomics, in any
    order)."""
    args = [f'--data_dir={data}', *TINY, '--device=cuda', '--dtype=float32', '--max_iters=300',
            '--eval_interval=25', '--log_interval=1']
    a, b = interrupted_and_resumed(args, tmp_path)
    for k in a['model']:
        torch.testing.assert_close(b['model'][k], a['model'][k], atol=1e-4, rtol=1e-3)
    for x, y in zip(records(tmp_path / 'a', 'loss'), records(tmp_path / 'b', 'loss')):
        assert x['step'] == y['step'] and abs(x['loss'] - y['loss']) < 1e-3


@cuda
def test_cuda_sample_and_bench(trained, capsys):
    """sample.py on the GPU (window == cache, greedy, fp32 weights) and each bench.py mode's GPU
    path: MFU against the measured peak, peaks from max_memory_allocated, decoding beside its
    ceiling."""
    argv = [f'--ckpt={trained}/ckpt.pt', '--prompt=def f2_1(x):', '--max_new_tokens=40',
            '--temperature=0', '--device=cuda', '--dtype=float32']
    code, cached, _ = run_main(capsys, 'sample', *argv)
    assert code == 0 and run_main(capsys, 'sample', *argv, '--method=window')[1] == cached
    gpu = ['--d_model=64', '--n_layers=1', '--vocab_size=128', '--device=cuda', '--dtype=bfloat16']
    rows = bench.main(['throughput', *gpu, '--n_ctx=64', '--batch_size=2', '--warmup=1',
                       '--repeats=2'])
    assert len(rows) == 3 and all(0 < r['mfu'] < 1 and r['peak_flops'] > 1e12 for r in rows)
    rows = bench.main(['memory', *gpu, '--archs=mixer', '--n_ctx=256,1024'])
    assert 0 < rows[0]['mb'] < rows[1]['mb']
    rows = bench.main(['generate', *gpu, '--n_ctx=64', '--prompt=16', '--new_tokens=8',
                       '--batch_size=1,4'])
    assert len(rows) == 3 * 3 and all(r['tokens_per_s'] > 0 for r in rows)
    # a fraction only where the step reads more than the GPU's L2 holds
    assert all((r['fraction'] is None) == (r['bound'] != 'dram') for r in rows)


# =============================================================================
# 10. fixtures and helpers: tiny models, the tiny corpus prepared by prepare.py and a tiny
# mixer trained on it by train.py, the scripts run as a user runs them, the local hub server

@pytest.fixture(autouse=True, scope='session')
def one_thread():
    """Tiny models run faster on one thread (and far faster than on two busy shared cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(**kw):
    return ModelConfig(**{**dict(vocab_size=V, n_ctx=N, d_model=D, n_layers=2), **kw})


def perturbed(cfg, scale, seed=0):
    """A model with every parameter moved off its init, so that no structure (zeros, ones,
    symmetry) can hide a leak or make two computations agree by accident."""
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


def make(cfg):
    return perturbed(cfg, 0.05).double()


def embedding_grad(model, idx, mask, out_fn):
    """d out_fn(logits) / d token embeddings, read by a hook on the token embedding's output."""
    wte = model.backbone.wte if hasattr(model, 'backbone') else \
        getattr(model, 'wte', None) or model.encoder.wte
    seen = []
    # returns None
    hook = wte.register_forward_hook(lambda mod, inp, out: seen.append(out) or out.retain_grad())
    try:
        out_fn(model(idx, mask=mask)[0]).backward()
    finally:
        hook.remove()
    return seen[-1].grad


def padded_batch(padding, gen):
    """Two sequences of lengths N and N - 4, padded on the right or the left (or not: mask None)."""
    idx = torch.randint(0, V, (2, N), generator=gen)
    if padding is None:
        return idx, None
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[1, N - 4:] = padding != 'right'
    mask[1, :4] = padding != 'left'
    idx[~mask] = 0
    return idx, mask


def tiny_model(n_ctx=N_CTX, **kw):
    return perturbed(ModelConfig(vocab_size=VOCAB, n_ctx=n_ctx, d_model=32, n_layers=2, **kw),
                     0.1).eval()


def prompt(length, seed=1, batch=2):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def decode(model, idx, steps, method, **kw):
    """Greedy by default: (tokens (B, steps), logits (B, steps, vocab)) from model.stream."""
    toks, logits = zip(*model.stream(idx, steps, method=method, **{'temperature': 0.0, **kw}))
    return torch.stack(toks, 1), torch.stack(logits, 1)


TINY = ['--d_model=32', '--n_layers=2', '--n_ctx=32', '--batch_size=4', '--eval_iters=2',
        '--log_interval=5',
        # the CPU's numbers on a GPU machine too (section 10: CUDA)
        '--warmup_iters=0', '--lr=1e-2', '--device=cpu']


ENV = dict(os.environ, OMP_NUM_THREADS='1')


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    """A tiny Python-like corpus tokenized by prepare.py (its `text` dataset, 300-token BPE)."""
    root = tmp_path_factory.mktemp('corpus')
    docs = [''.join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(1 + i % 7))
            for i in range(150)]
    (root / 'corpus.txt').write_text('\n<|endoftext|>\n'.join(docs))
    assert prepare.main(['text', f'--input={root}/corpus.txt', f'--out_dir={root}/data',
                         '--vocab_size=300']) == 0
    return f'{root}/data'


@pytest.fixture(scope='module')
def trained(data, tmp_path_factory):
    """The out_dir of a tiny mixer trained for 25 steps on `data`."""
    out = tmp_path_factory.mktemp('trained')
    assert train.main([f'--data_dir={data}', f'--out_dir={out}', *TINY, '--batch_size=8',
                       '--max_iters=25', '--lr=3e-3', '--warmup_iters=2', '--eval_interval=25',
                       '--eval_iters=1']) == 0
    return out


def train_run(data, out, *extra):
    return train.main([f'--data_dir={data}', f'--out_dir={out}', *TINY, *extra])


def records(out_dir, key):
    return [r for r in map(json.loads, open(os.path.join(out_dir, 'log.jsonl'))) if key in r]


def weights(out_dir, name='ckpt.pt'):
    return torch.load(os.path.join(out_dir, name), map_location='cpu', weights_only=True)


def run_main(capsys, script, *argv):
    """(exit status, stdout, stderr) of a script's main(argv), as a user would see them."""
    try:
        code = MAINS[script]([str(a) for a in argv])
    except SystemExit as e:  # bench.main exits
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def refused(capsys, script, argv, culprit, keep=()):
    """script's main refuses argv: status 2, one `error:` line (the last on stderr, returned)
    naming the culprit, no traceback, every file under keep's folders as it was (none added)."""
    tree = lambda folder: {os.path.join(d, n): open(os.path.join(d, n), 'rb').read()  # noqa: E731
                           for d, _, names in os.walk(folder) for n in names}
    before = [tree(k) for k in keep]
    code, out, err = run_main(capsys, script, *argv)
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith('error:')]
    assert code == 2 and errors == lines[-1:] and 'Traceback' not in err, (code, err)
    assert culprit in errors[0], (culprit, errors[0])
    assert [tree(k) for k in keep] == before
    return errors[0]


def without_paths(text):
    return re.sub(r'\S*/\S*', '', text)


def cpu_kind(monkeypatch, native):
    """Make this CPU answer the bf16 capability query as either kind does (AVX512-BF16/AMX:
    native; AVX2-only: emulated), so each kind's dtype choices are tested on any machine."""
    monkeypatch.delenv(train.NO_BF16_ENV, raising=False)
    monkeypatch.setattr(torch.ops.mkldnn, '_is_mkldnn_bf16_supported', lambda: native)


def torchrun(script, argv, nproc=2):
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone',
           f'--nproc_per_node={nproc}', os.path.join(HERE, script), *argv]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    if proc.returncode:  # shown in full with the failure (an assert message would be cut short)
        print(proc.stdout[-1500:], proc.stderr[-5000:], sep='\n')
    assert proc.returncode == 0
    return proc


@pytest.fixture
def no_tf32():
    """Exact comparisons need true fp32 matmuls; train.py turns TF32 on for every later test of the
    process."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


PAIR_WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega parse load save "
              "merge split join sort count").split()


def pair_texts(rng, tag):
    """A query and its target that share two words, like a docstring and its function."""
    a, b = rng.sample(PAIR_WORDS, 2)
    query = f"{a.capitalize()} the {b} of x."
    return query, f"def {a}_{b}_{tag}(x):\n    return {a}({b}(x)) + {tag}\n"


def write_pairs(path, pairs):
    path.write_text(''.join(json.dumps({'query': q, 'target': t}) + '\n' for q, t in pairs))


def make_ckpt(path, data_dir, **kw):
    """An untrained train.py checkpoint ('lm' kind) of a tiny model on data_dir's tokenizer."""
    meta = train.load_meta(str(data_dir))
    cfg = ModelConfig(**{**dict(n_ctx=32, d_model=32, n_layers=2), **kw,
                         'vocab_size': meta['vocab_size']})
    torch.manual_seed(0)
    train.save_checkpoint({'kind': 'lm', 'model_config': dataclasses.asdict(cfg),
                           'data': {'data_dir': str(data_dir),
                           'meta': meta}, 'model': build_model(cfg).state_dict()}, str(path))
    return str(path)


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    """A data dir with a 400-piece tokenizer, 160 training and 48 val pairs; untrained mixer, llama
    and mixer autoencoder checkpoints on it."""
    root = tmp_path_factory.mktemp('retrieve')
    rng = random.Random(0)
    pairs = [pair_texts(rng, i) for i in range(208)]
    (root / 'src').mkdir()
    for k in range(4):
        (root / f'src/doc{k}.txt').write_text(''.join(q + '\n' + t + '\n' for q, t in pairs[k::4]))
    data = root / 'data'
    assert prepare.main(['text', f'--input={root}/src', f'--out_dir={data}',
                         '--vocab_size=400']) == 0
    write_pairs(data / 'pairs_train.jsonl', pairs[:160])
    write_pairs(data / 'pairs_val.jsonl', pairs[160:])
    return types.SimpleNamespace(root=root, data=data, mixer=make_ckpt(root / 'mixer.pt', data),
                                 llama=make_ckpt(root / 'llama.pt', data, arch='llama'),
                                 ae=make_ckpt(root / 'ae.pt', data, objective='autoencoder'))


def unit(*shape, seed=0):
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                                   dtype=torch.float64), dim=-1)


def read_folder(out):
    """meta, documents and pairs of a prepared folder, checked against meta.json: every document is
    BOS ... EOS at its recorded offset, every count and id agrees."""
    meta = json.load(open(os.path.join(out, 'meta.json')))
    assert meta['dtype'] == ('uint16' if meta['vocab_size'] < 65536 else 'uint32')
    tok, keys = Tokenizer.from_dir(out), ('vocab_size', 'bos_id', 'eos_id', 'pad_id')
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == tuple(meta[k] for k in keys)
    assert all(isinstance(meta[k], int) for k in keys)
    docs, pairs = {}, {}
    for s in ('train', 'val'):
        # np.memmap refuses empty files (a tiny corpus may have no val)
        path = os.path.join(out, f'{s}.bin')
        ids = np.memmap(path, dtype=meta['dtype'],
                        mode='r') if os.path.getsize(path) else np.zeros(0, meta['dtype'])
        starts = np.load(os.path.join(out, f'{s}_docs.npy'))
        assert starts.dtype == np.int64 and len(ids) == meta[f'{s}_tokens']
        assert len(starts) == meta[f'{s}_docs']
        ends = np.append(starts[1:], len(ids))
        if len(starts):
            assert starts[0] == 0 and np.all(ends > starts + 1) and ids.max() < meta['vocab_size']
            assert np.all(ids[starts] == meta['bos_id']) and np.all(ids[ends - 1] == meta['eos_id'])
        docs[s] = [tok.decode(ids[a:b]) for a, b in zip(starts, ends)]
        if f'n_pairs_{s}' in meta:
            pairs[s] = [json.loads(line) for line in open(os.path.join(out, f'pairs_{s}.jsonl'),
                                                          encoding='utf-8')]
            assert len(pairs[s]) == meta[f'n_pairs_{s}']
            assert all(set(p) == {'query',
                                  'target'} and p['query'] and p['target'] for p in pairs[s])
    return meta, docs, pairs


@pytest.fixture(scope='module')
def stdlib_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp('pystdlib'))
    assert prepare.main(['pystdlib', '--max_docs=150', '--vocab_size=400', f'--out_dir={out}']) == 0
    return out


PROSE_WORDS = ('the a cat dog sun moon tree river small big red green happy quiet runs jumps sees '
               'finds under over near bright old young garden house friend little').split()


def prose(rng, sentences):
    return ' '.join(' '.join(rng.choices(PROSE_WORDS,
                                         k=rng.randint(4, 12))).capitalize() + rng.choice('.!?')
                    for _ in range(sentences))


def prepare_cli(*argv, env=None, cwd=None):
    """Run `python prepare.py ...` exactly as a user does."""
    env = {**{k: v for k, v in os.environ.items() if k not in ('HF_ENDPOINT', 'HF_HUB_OFFLINE')},
           **(env or {})}
    return subprocess.run([sys.executable, os.path.join(HERE, 'prepare.py'), *argv],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def instruct(rng, n):
    """TinyStories-Instruct records (text, story, fields): shuffled fields, a Summary in 3 of 4, the
    story last."""
    records = []
    for i in range(n):
        s = prose(rng, 6) + '\n\n' + prose(rng, 4)
        fields = ['Features: Dialogue', f'Words: {" ".join(rng.sample(PROSE_WORDS, 3))}',
                  *([f'Summary: {prose(rng, 1)}'] if i % 4 else []),
                  f'Random sentence: {prose(rng, 1)}']
        rng.shuffle(fields)
        records.append(('\n'.join(fields) + f'\nStory: \n\n{s}', s, fields))
    return records


@pytest.fixture(scope='module')
def hub():
    """A stand-in for the Hugging Face hub on 127.0.0.1: the resolve/ and tree/ endpoints
    huggingface_hub calls."""
    rng = random.Random(1)
    stories = [prose(rng, 7) + '\n\n' + prose(rng, 4) for _ in range(46)]
    itrain, ivalid = instruct(rng, 40), instruct(rng, 8)
    shards = [[prose(rng, 12) for _ in range(30)] for _ in range(2)]
    eot = lambda docs: ''.join(d + '\n<|endoftext|>\n' for d in docs).encode()  # noqa: E731

    def parquet(texts):
        buf = io.BytesIO()
        pq.write_table(pa.table({'text': texts, 'id': [str(i) for i in range(len(texts))]}), buf)
        return buf.getvalue()
    files = {
        'roneneldan/TinyStories/TinyStories-train.txt': eot(stories[:40]),
        'roneneldan/TinyStories/TinyStories-valid.txt': eot(stories[40:]),
        'roneneldan/TinyStoriesInstruct/TinyStories-Instruct-train.txt':
            eot(r for r, _, _ in itrain),
        'roneneldan/TinyStoriesInstruct/TinyStories-Instruct-valid.txt':
            eot(r for r, _, _ in ivalid),
        'HuggingFaceFW/fineweb-edu/sample/10BT/000_00000.parquet': parquet(shards[0]),
        'HuggingFaceFW/fineweb-edu/sample/10BT/001_00000.parquet': parquet(shards[1]),
        'HuggingFaceFW/fineweb-edu/data/CC-MAIN-2024-10/000_00000.parquet':
            parquet(['not in the sample']),
        'HuggingFaceTB/finemath/finemath-4plus/train-00000-of-00064.parquet': parquet(shards[1])}
    served = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.do_GET(body=False)

        def do_GET(self, body=True):
            path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
            served.append((self.command, path))
            resolve = re.fullmatch(r'/datasets/([^/]+/[^/]+)/resolve/main/(.+)', path)
            tree = re.fullmatch(r'/api/datasets/([^/]+/[^/]+)/tree/main/?(.*)', path)
            if resolve and f'{resolve[1]}/{resolve[2]}' in files:
                data = files[f'{resolve[1]}/{resolve[2]}']
                headers = {'ETag': f'"{hashlib.sha256(data).hexdigest()}"',
                           'X-Repo-Commit': 'c0ffee' * 6 + 'abcd',
                           'Content-Type': 'application/octet-stream'}
            elif tree:
                prefix = f'{tree[1]}/{tree[2]}/'.replace('//', '/')
                data = json.dumps([{'type': 'file', 'path': k[len(tree[1]) + 1:], 'size': len(v),
                                    'oid': hashlib.sha1(v).hexdigest()} for k, v in files.items()
                                   if k.startswith(prefix) and '/' not in k[len(prefix):]]).encode()
                headers = {'Content-Type': 'application/json'}
            else:
                data, headers = b'not found', {'X-Error-Code': 'EntryNotFound'}
            self.send_response(200 if 'Content-Type' in headers else 404)
            for k, v in {**headers, 'Content-Length': str(len(data))}.items():
                self.send_header(k, v)
            self.end_headers()
            if body:
                self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield dict(url=f'http://127.0.0.1:{server.server_port}', served=served, files=files,
               stories=stories, itrain=itrain, ivalid=ivalid, shards=shards)
    server.shutdown()


def hub_cli(tmp_path, *argv, env=None):
    env = {'HF_HOME': str(tmp_path / 'hf_home'), 'NO_PROXY': '127.0.0.1', 'no_proxy': '127.0.0.1',
           **(env or {})}
    return prepare_cli(*argv, f'--download_dir={tmp_path}/downloads', '--vocab_size=400',
                       cwd=tmp_path, env=env)


# =============================================================================
# 11. refusals. Every flag is checked before any work, every input file against what describes
# it, every output location before the work that fills it. A refusal exits with status 2 and prints
# one `error:` line (the last on stderr) naming the culprit (a flag, a value or a path), no
# traceback, and leaves every file as it was (and writes none).

TRAIN = ['--data_dir={data}', '--out_dir={tmp}/out', *TINY]
SAMPLE = ['--out_dir={trained}']
EVAL = ['eval', '--ckpt={mixer}', '--pairs={pairs}/pairs_val.jsonl']
OUT = '--out_dir={tmp}/out'
RESUME = ['--data_dir={data}', '--out_dir={trained}', *TINY, '--init_from=resume']

# (script, argv, culprit). Placeholders: {tmp} (the files of scratch() below), {data} (train's
# data),
# {trained} (a finished run), {mixer} and {ae} (retrieve's checkpoints), {pairs} (retrieve's data)
REFUSALS = [
    # an unknown key, a value of the wrong type, out of range or not among the choices
    # a typo is answered with the key meant
    ('train', ['--max_iter=3'], '--max_iters'),
    *[('train', [*TRAIN, f'--{k}={v}'], k) for k, v in [
        ('max_iters', -1), ('eval_interval', 0), ('log_interval', 0), ('grad_accum', 0),
        ('eval_iters', 0), ('batch_size', 0), ('lr', 'nan'), ('min_lr', 1), ('n_ctx', 1),
        ('seed', -1)]],
    ('train', [*TRAIN, '--device=gpu0'], 'gpu0'),
    ('train', [*TRAIN, '--dtype=float16', '--device=cpu'], 'float16'),
    *[('sample', [*SAMPLE, f'--{k}={v}'], k) for k, v in [
        ('temperature', -1), ('temperature', 'nan'), ('temperature', 1e-45), ('top_k', 0),
        ('top_p', 0), ('top_p', 1.5), ('num_samples', 0)]],
    *[('sample', [*SAMPLE, arg], arg.split('=')[1])
      for arg in ['--method=beam', '--dtype=int8', '--device=tpu9']],
    ('sample', [*SAMPLE, '--bogus=1'], 'bogus'), ('prepare', ['wikipedia', OUT], 'wikipedia'),
    ('prepare', ['pystdlib', '--max_docs=zero', OUT], 'max_docs'),
    ('prepare', ['pystdlib', '--bogus=1', OUT], 'bogus'),
    ('prepare', ['pystdlib', '--tokenizer=p50k_nope', OUT], 'p50k_nope'),
    ('prepare', ['tinystories', '--pairs=docstring', OUT], 'docstring'),
    ('prepare', ['text', '--input={tmp}/latin1.txt', '--vocab_size=1', OUT], 'vocab_size'),
    # < its 94 characters
    ('prepare', ['text', '--input={tmp}/ascii.txt', '--vocab_size=262', OUT], 'vocab_size'),
    ('retrieve', ['frobnicate'], 'frobnicate'), ('retrieve', [*EVAL, '--n=1x'], '1x'),
    ('retrieve', [*EVAL, '--n=2,32'], '2,32'),
    ('retrieve', ['eval', '--ckpt={tmp}/x.pt', '--pairs={tmp}/y.jsonl', '--batch_size=0'],
     'batch_size'),
    ('retrieve', ['indirect', '--ckpt={mixer}', '--data_dir={pairs}', '--c=2'], 'c='),
    ('retrieve', ['train', '--init_from={mixer}', '--data_dir={pairs}', '--negatives=hard'],
     'hard'),
    ('retrieve', ['train', '--init_from={mixer}', '--data_dir={pairs}', '--batch_sise=4'],
     'batch_sise'),
    ('retrieve', ['train', '--init_from={tmp}/x.pt', '--warmup_iters=-2'], 'warmup_iters'),
    ('bench', ['sideways'], 'sideways'), ('bench', ['throughput', '--n_ctx=abc'], 'n_ctx'),
    ('bench', ['throughput', '--batch_size=1,16'], 'batch_size'),  # a list only in generate
    ('bench', ['throughput', '--archs=rnn'], 'rnn'),
    ('bench', ['throughput', *BENCH_TINY, '--repeats=0'], 'repeats'),
    ('bench', ['generate', *BENCH_TINY, '--new_tokens=0'], 'new_tokens'),
    ('bench', ['generate', *BENCH_TINY, '--prompt=2', '--new_tokens=2', '--methods=beam'], 'beam'),
    ('bench', ['generate', *BENCH_TINY, '--prompt=12', '--new_tokens=8'], 'n_ctx'),
    ('bench', ['represent', *BENCH_TINY, '--layer=last'], 'layer'),
    ('bench', ['represent', '--ckpt={trained}/ckpt.pt', '--layer=3'], 'layer'),
    # each script's own ranges (the command-line layer knows none, section 7)
    *[('train', ['--data_dir=/nonexistent', arg], arg.split('=')[0]) for arg in [
        '--warmup_iters=-1', '--max_time=-1', '--weight_decay=-0.1', '--grad_clip=-1', '--lr=0']],
    ('sample', ['--seed=-1'], 'seed'),
    ('prepare', ['pystdlib', '--max_docs=-1'], 'max_docs'),
    ('prepare', ['pystdlib', '--max_tokens=-5'], 'max_tokens'),
    *[('bench', ['represent', arg], arg.split('=')[0]) for arg in [
        '--warmup=-1', '--mem_limit=-1', '--prompt=0', '--steps=0', '--seed=-1', '--lr=0',
        '--n_layers=0']],
    ('retrieve', ['search', '--index=x', '--k=0'], 'k'),
    ('retrieve', ['search', '--index=x', '--show=-1'], 'show'),
    ('retrieve', ['eval', '--ckpt=x', '--pairs=y', '--seed=-1'], 'seed'),
    ('retrieve', ['indirect', '--ckpt=x', '--n_layers=0'], 'n_layers'),
    ('retrieve', ['train', '--init_from=x', '--eval_iters=0'], 'eval_iters'),
    # a required flag missing, or two that exclude each other
    ('prepare', ['text', OUT], 'input'), ('retrieve', [*EVAL[:2]], 'pairs'),
    ('retrieve', ['eval', '--pairs={pairs}/pairs_val.jsonl'], 'ckpt'),
    ('retrieve', ['train', '--data_dir={pairs}'], 'init_from'),
    ('sample', [*SAMPLE, '--ckpt={trained}/ckpt.pt'], 'ckpt'),
    # input files: missing, empty, unreadable, or not what they should be
    ('train', ['--data_dir={tmp}/nope', OUT], '{tmp}/nope'),
    ('train', ['--data_dir={data}', '--out_dir={tmp}/none', '--init_from=resume'], '{tmp}/none'),
    ('train', ['{tmp}/notpreset.py'], 'notpreset.py'),  # a preset holds assignments only
    ('train', ['--out_dir={trained}', '{tmp}/latin1.txt'], 'latin1.txt'),
    ('sample', ['--out_dir={tmp}/none'], '{tmp}/none'),
            ('sample', ['--ckpt={tmp}/cut/ckpt.pt'], '{tmp}/cut/ckpt.pt'),
    ('sample', ['--ckpt={tmp}/retrieval.pt'], 'retrieval'),
            ('sample', ['--ckpt={ae}'], 'autoencoder'),
    ('sample', ['--ckpt={tmp}/n1.pt'], 'n_ctx=1'),
    ('sample', [*SAMPLE, '--prompt=FILE:/nonexistent/p.txt'], '/nonexistent/p.txt'),
    ('sample', [*SAMPLE, '--prompt=FILE:{tmp}/latin1.txt'], 'latin1.txt'),
    ('prepare', ['text', '--input=does/not/exist', OUT], 'does/not/exist'),
    ('prepare', ['text', '--input={tmp}/empty', OUT], '{tmp}/empty'),
    ('prepare', ['text', '--input={tmp}/blank.txt', OUT], 'empty'),
    ('prepare', ['pystdlib', '--tokenizer=missing.model', OUT], 'missing.model'),
    ('prepare', ['pystdlib', '--tokenizer={tmp}/blank.txt', OUT], 'blank.txt'),
    ('retrieve', ['eval', '--ckpt={mixer}', '--pairs={tmp}/bad.jsonl'], 'bad.jsonl:3'),
    ('retrieve', ['eval', '--ckpt={mixer}', '--pairs={tmp}/latin1.jsonl'], 'latin1.jsonl'),
    ('retrieve', ['eval', '--ckpt={tmp}/none.pt', '--pairs={pairs}/pairs_val.jsonl'], 'none.pt'),
    ('retrieve', ['eval', '--ckpt={tmp}/indirect.pt', '--pairs={pairs}/pairs_val.jsonl'],
     'indirect'),
    ('retrieve', ['index', '--ckpt={mixer}', '--docs={tmp}/missing', '--index={tmp}/i'], 'missing'),
    ('retrieve', ['search', '--index={tmp}/nothing', '--query=x'], 'nothing'),
    ('bench', ['retrieval', '--data_dir=/nonexistent'], '/nonexistent'),
    ('bench', ['represent', '--ckpt={tmp}/nope.pt'], 'nope.pt'),
    ('bench', ['represent', '--ckpt={trained}/ckpt.pt', '--data_dir={tmp}'], 'val.bin'),
    # a resume that cannot continue: another architecture or n_ctx, a truncated checkpoint
    *[('train', [*RESUME, arg], arg[2:].split('=')[0]) for arg in ['--arch=llama', '--n_ctx=16']],
    ('train', ['--data_dir={data}', '--out_dir={tmp}/cut', *TINY, '--init_from=resume'], 'ckpt.pt'),
    # a finished run, replaced only when asked: the refusal names the flag that continues or
    # replaces it
    ('train', ['--data_dir={data}', '--out_dir={trained}', *TINY], '--init_from=resume'),
    ('retrieve', ['train', '--init_from={mixer}', '--data_dir={pairs}', '--out_dir={tmp}/run'],
     '--overwrite'),
    ('retrieve', ['indirect', '--ckpt={mixer}', '--data_dir={pairs}', '--out_dir={tmp}/run',
                  '--c=4'], '--overwrite'),
    ('retrieve', ['index', '--ckpt={mixer}', '--docs={pairs}/pairs_val.jsonl', '--index={tmp}/run'],
     '--overwrite'),
    # output locations, checked before the work that fills them ({tmp}/file is a file)
    ('train', ['--data_dir={data}', '--out_dir={tmp}/file/out', *TINY], '{tmp}/file'),
    ('prepare', ['pystdlib', '--out_dir={tmp}/file'], '{tmp}/file'),
    ('retrieve', ['eval', '--ckpt={tmp}/x.pt', '--pairs={tmp}/y.jsonl', '--json={tmp}/file/m.json'],
     'json'),
    ('retrieve', ['index', '--ckpt={tmp}/x.pt', '--docs={pairs}/pairs_val.jsonl',
                  '--index={tmp}/file'], 'index'),
    ('bench', ['throughput', *BENCH_TINY, '--json={tmp}/file/rows.json'], 'json'),
    ('bench', ['memory', *BENCH_TINY, '--plot={tmp}'], 'plot'),
]


def scratch(tmp_path, data_dir):
    """The small files the refusal table names, each wrong in its own way."""
    for name, content in [('file', b'in the way'), ('blank.txt', b'  \n'),
                          ('notpreset.py', b'import os\nn_ctx = 64\n'),
                          ('latin1.txt', 'déjà vu, naïve café\n'.encode('latin-1')),
                          ('latin1.jsonl',
                           '{"query": "café", "target": "naïve"}\n'.encode('latin-1') * 3),
                          ('ascii.txt', bytes(range(33, 127)) * 20),
                          ('bad.jsonl',
                           b'{"query": "a", "target": "b"}\n' * 2 + b'{"query": oops}\n'),
                          ('run/ckpt.pt', b'a long run'), ('run/log.jsonl', b'{"step": 1}\n'),
                          ('run/manifest.json', b'{}'), ('run/c4/ckpt.pt', b'a long run')]:
        (tmp_path / name).parent.mkdir(exist_ok=True, parents=True)
        (tmp_path / name).write_bytes(content)
    (tmp_path / 'empty').mkdir()
    buf = io.BytesIO()
    torch.save({'model': {'w': torch.zeros(1000)}}, buf)
    (tmp_path / 'cut').mkdir()
    # as a kill -9 during a save leaves it
    (tmp_path / 'cut/ckpt.pt').write_bytes(buf.getvalue()[:1000])
    for kind in ('indirect', 'retrieval'):
        train.save_checkpoint({'kind': kind, 'model': {}}, str(tmp_path / f'{kind}.pt'))
    make_ckpt(tmp_path / 'n1.pt', data_dir, n_ctx=1)


@pytest.mark.parametrize('script,argv,culprit', REFUSALS, ids=[f'{s}:{c}' for s, _, c in REFUSALS])
def test_refusal(script, argv, culprit, corpus, request, tmp_path, capsys):
    scratch(tmp_path, corpus.data)
    keep = [tmp_path, corpus.root]

    def value(m):
        # their folders are kept too: train's corpus, the finished run
        if m[1] in ('data', 'trained'):
            path = str(request.getfixturevalue(m[1]))
            keep.append(os.path.dirname(path) if m[1] == 'data' else path)
            return path
        return str({'tmp': tmp_path, 'mixer': corpus.mixer, 'pairs': corpus.data,
                    'ae': corpus.ae}[m[1]])
    fill = lambda text: re.sub(r'\{(\w+)\}', value, str(text))  # noqa: E731
    refused(capsys, script, [fill(a) for a in argv], fill(culprit), keep=keep)
    assert script != 'train' or not (tmp_path / 'out').exists()  # train makes no out_dir either


@pytest.mark.parametrize('script,words',
                         [('train', ['n_ctx']), ('sample', ['method']),
                          ('retrieve', ['eval', 'index']),
                                          ('prepare', ['max_tokens', *prepare.DATASETS]),
                                          ('bench', ['throughput'])])
def test_help(script, words, capsys):
    code, out, err = run_main(capsys, script, '--help')
    assert code == 0 and all(w in out for w in words), out


@pytest.mark.parametrize('argv,says', [
    (['sample.py', '--ckpt=/nonexistent/ckpt.pt'], 'error: no checkpoint at /nonexistent/ckpt.pt'),
    (['bench.py', 'race', '--max_time=-5'], 'error: --max_time=-5')], ids=['sample', 'race'])
def test_sample_run_from_the_shell_exits_2_without_traceback(argv, says, tmp_path):
    """As a user runs them (from another folder): status 2 and one `error:` line, no traceback."""
    r = subprocess.run([sys.executable, os.path.join(HERE, argv[0]), *argv[1:]], cwd=tmp_path,
                       capture_output=True, text=True, env=ENV)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and r.stderr.startswith(says), r


def test_a_batch_two_processes_cannot_share_is_refused_before_any_process_group(data, capsys,
                                                                                 monkeypatch):
    monkeypatch.setenv('WORLD_SIZE', '2')
    refused(capsys, 'train', [f'--data_dir={data}', '--batch_size=3'], 'batch_size')


@pytest.mark.parametrize('name,damage',
                         [('train.bin', lambda b: b[:-64]), ('train.bin', lambda b: b + b'\0'),
                                         ('meta.json', lambda b: b[:len(b) // 2]),
                                         ('val_docs.npy', None)])
def test_data_files_must_agree_with_meta(name, damage, data, tmp_path, capsys):
    """A truncated or odd-sized token file, a corrupt meta.json, a missing offsets file: each is
    refused by name."""
    shutil.copytree(data, tmp_path / 'data')
    path = tmp_path / 'data' / name
    path.write_bytes(damage(path.read_bytes())) if damage else path.unlink()
    refused(capsys, 'train', [f'--data_dir={tmp_path}/data', f'--out_dir={tmp_path}/out', *TINY,
                              '--max_iters=2', '--batch_mode=documents'],
            name, keep=[tmp_path / 'data'])


@pytest.mark.parametrize('n_files', [1, 12])
def test_small_corpus_gets_a_val_split(n_files, tmp_path, capsys):
    """Even one file prepares into a train and a val split that train.py can use; a corpus too small
    is refused."""
    (tmp_path / 'src').mkdir()
    for i in range(n_files):
        code = ''.join(f"def f{i}_{j}(x):\n    return x + {j}\n\n" for j in range(40))
        (tmp_path / f'src/m{i}.py').write_text(code)
    assert prepare.main(['text', f'--input={tmp_path}/src', f'--out_dir={tmp_path}/data',
                         '--vocab_size=300']) == 0
    meta, docs, _ = read_folder(tmp_path / 'data')
    assert meta['val_tokens'] > 0 and meta['train_tokens'] > meta['val_tokens']
    assert train_run(tmp_path / 'data', tmp_path / 'out', '--n_ctx=16', '--max_iters=2',
                     '--eval_interval=2') == 0
    (tmp_path / 'src/tiny.txt').write_text('x')
    refused(capsys, 'prepare',
            ['text', f'--input={tmp_path}/src/tiny.txt', f'--out_dir={tmp_path}/data'], 'too small',
            keep=[tmp_path / 'data'])


def test_lossy_input_and_a_smaller_vocabulary_are_announced(tmp_path, capsys):
    (tmp_path / 'src').mkdir()
    for i in range(3):
        (tmp_path / f'src/{i}.txt').write_text(f'plain text number {i}, ' * 200)
    (tmp_path / 'src/latin1.txt').write_bytes('déjà vu, naïve café\n'.encode('latin-1') * 50)
    assert prepare.main(['text', f'--input={tmp_path}/src', '--vocab_size=100000',
                         f'--out_dir={tmp_path}/d']) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines()
                if line.startswith('warning: ')]
    assert len(warnings) == 2, warnings
    assert 'latin1.txt' in warnings[0] and 'vocab_size' in warnings[1], warnings


def test_leftovers_are_cleaned_up(data, tmp_path, capsys):
    """A killed save's temporary file is removed; a failed prepare leaves no temporary files; a
    prepared folder inside its own input is not read back as new input."""
    (tmp_path / 'out').mkdir()
    dead = subprocess.Popen([sys.executable, '-c', ''])
    dead.wait()
    # kill -9 during a save
    (tmp_path / f'out/best.pt.tmp{dead.pid}').write_bytes(b'half a checkpoint')
    assert train_run(data, tmp_path / 'out', '--max_iters=2', '--eval_interval=2') == 0
    assert sorted(os.listdir(tmp_path / 'out')) == ['best.pt', 'ckpt.pt', 'log.jsonl']
    (tmp_path / 'garbage.model').write_bytes(b'not a tokenizer')
    refused(capsys, 'prepare', ['text', f'--input={data}/../corpus.txt',
                                f'--tokenizer={tmp_path}/garbage.model', f'--out_dir={tmp_path}/d'],
            'garbage.model', keep=[os.path.dirname(data)])
    assert not [n for n in os.listdir(tmp_path / 'd') if '.tmp' in n]
    (tmp_path / 'src').mkdir()
    for i in range(20):
        (tmp_path / f'src/{i}.py').write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    args = ['text', f'--input={tmp_path}/src', f'--out_dir={tmp_path}/src/data', '--vocab_size=300']
    assert prepare.main(args) == 0
    assert prepare.main(args) == 0 and 'up to date' in capsys.readouterr().out
