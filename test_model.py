"""nanomixer tests: CPU, tiny models, fixtures made here. Run: python -m pytest -q"""
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import model as M
from model import ModelConfig, build_model

V, N, D = 40, 12, 16  # vocab, n_ctx, d_model of the tiny test models


def tiny(**kw):
    base = dict(vocab_size=V, n_ctx=N, d_model=D, n_layers=2)
    return ModelConfig(**{**base, **kw})


# every causal variant: each arch, each mixer variant and combinations, each causal objective
CAUSAL = [
    dict(arch='mixer'), dict(arch='mixer', kernel=3), dict(arch='mixer', kernel=2),
    dict(arch='mixer', expansion=2.0), dict(arch='mixer', expansion=0.5), dict(arch='mixer', n_convs=3),
    dict(arch='mixer', n_heads=2), dict(arch='mixer', softmax=True), dict(arch='mixer', pos_emb=True),
    dict(arch='mixer', n_heads=2, kernel=3, softmax=True, n_convs=2), dict(arch='mixer', tie_weights=True),
    dict(arch='llama'), dict(arch='gpt'), dict(arch='hybrid'), dict(arch='hybrid', kernel=2, n_convs=2),
    dict(arch='gmlp'), dict(arch='elita'),
    dict(arch='mixer', objective='mtp2'), dict(arch='llama', objective='mtp2'), dict(arch='elita', objective='mtp2'),
]
PADDED = ['mixer', 'llama', 'gpt', 'hybrid', 'gmlp', 'elita']


def make(cfg, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    m = build_model(cfg).to(dtype)
    with torch.no_grad():  # perturb every parameter so no structure (zeros, ones) hides a leak
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


def embedding_grad(model, idx, mask, out_fn):
    """d out_fn(logits) / d token embeddings, via a hook on the token embedding's output."""
    store = {}
    wte = model.backbone.wte if hasattr(model, 'backbone') else getattr(model, 'wte', None) or model.encoder.wte

    def hook(mod, inp, out):
        out.retain_grad()
        store['e'] = out
    h = wte.register_forward_hook(hook)
    try:
        logits, _ = model(idx, mask=mask)
        out_fn(logits).backward()
    finally:
        h.remove()
    return store['e'].grad


def padded_batch(padding, gen):
    """Two sequences of lengths N and N - 4, padded on the right or the left; mask True on tokens."""
    idx = torch.randint(0, V, (2, N), generator=gen)
    mask = torch.ones(2, N, dtype=torch.bool)
    if padding == 'right':
        mask[1, N - 4:] = False
    elif padding == 'left':
        mask[1, :4] = False
    idx[~mask] = 0
    return idx, mask


@pytest.mark.parametrize('variant', CAUSAL, ids=lambda v: '-'.join(f'{k}={x}' for k, x in v.items()))
def test_future_tokens_never_reach_past_logits(variant):
    model = make(tiny(**variant))
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, V, (3, N), generator=gen)
    logits, _ = model(idx)
    for t in (0, 4, N - 2):
        other = idx.clone()
        other[:, t + 1:] = torch.randint(0, V, (3, N - t - 1), generator=gen)
        assert torch.equal(model(other)[0][:, :t + 1], logits[:, :t + 1])
        grad = embedding_grad(model, idx, None, lambda lg: lg[:, t].pow(2).sum())
        assert torch.count_nonzero(grad[:, t + 1:]) == 0       # exactly zero, not just small
        assert torch.count_nonzero(grad[:, :t + 1]) > 0        # and the past does matter


@pytest.mark.parametrize('padding', ['right', 'left'])
@pytest.mark.parametrize('arch', PADDED)
def test_causal_with_padding(arch, padding):
    model = make(tiny(arch=arch))
    gen = torch.Generator().manual_seed(2)
    idx, mask = padded_batch(padding, gen)
    logits, _ = model(idx, mask=mask)
    assert torch.isfinite(logits).all()
    t = 6
    other = idx.clone()
    other[:, t + 1:] = torch.randint(0, V, (2, N - t - 1), generator=gen)
    assert torch.equal(model(other, mask=mask)[0][:, :t + 1], logits[:, :t + 1])
    grad = embedding_grad(model, idx, mask, lambda lg: lg[:, t].pow(2).sum())
    assert torch.count_nonzero(grad[:, t + 1:]) == 0


def single_target_loss_grad(model, idx, j):
    """Loss with one target (at position j) and its gradient w.r.t. the token embeddings."""
    targets = torch.full_like(idx, -1)
    targets[:, j] = 3
    return embedding_grad(model, idx, None, lambda lg: model(idx, targets)[1])


@pytest.mark.parametrize('objective,arch', [('clm', 'mixer'), ('mtp2', 'mixer'), ('mtp2', 'llama'),
                                            ('half', 'mixer'), ('half', 'llama'), ('half', 'elita')])
def test_objective_loss_is_causal(objective, arch):
    """Each loss term predicts from the past only: a loss with a single target at j is unchanged
    by tokens after j (half: by tokens in the second half) and has exactly zero gradient there."""
    model = make(tiny(arch=arch, objective=objective))
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(0, V, (2, N), generator=gen)
    j = N - 3
    first_unseen = N // 2 if objective == 'half' else j + 1
    targets = torch.full_like(idx, -1)
    targets[:, j] = 3
    other = idx.clone()
    other[:, first_unseen:] = torch.randint(0, V, (2, N - first_unseen), generator=gen)
    assert torch.equal(model(idx, targets)[1], model(other, targets)[1])
    grad = single_target_loss_grad(model, idx, j)
    assert torch.count_nonzero(grad[:, first_unseen:]) == 0
    assert torch.count_nonzero(grad[:, :first_unseen]) > 0


def test_objective_targets():
    x = torch.arange(8).view(1, 8)
    y = torch.arange(1, 9).view(1, 8)
    mask = torch.tensor([[True] * 6 + [False] * 2])
    assert torch.equal(M.objective_targets('clm', x, y, mask), y)
    assert M.objective_targets('autoencoder', x, y, mask).tolist() == [[0, 1, 2, 3, 4, 5, -1, -1]]
    assert M.objective_targets('half', x, y, mask).tolist() == [[-1, -1, -1, -1, 4, 5, -1, -1]]


def test_non_causal_mixer_does_mix_backwards():
    model = make(tiny(arch='mixer', causal=False))
    idx = torch.randint(0, V, (2, N))
    grad = embedding_grad(model, idx, None, lambda lg: lg[:, 0].pow(2).sum())
    assert torch.count_nonzero(grad[:, 1:]) > 0  # the causal tests above can fail


@pytest.mark.parametrize('variant', [dict(), dict(kernel=3), dict(n_heads=2), dict(softmax=True),
                                     dict(expansion=2.0), dict(expansion=0.5), dict(n_convs=2)])
def test_masked_weights_get_exactly_zero_gradient(variant):
    model = make(tiny(arch='mixer', **variant))
    model(torch.randint(0, V, (2, N)), torch.randint(0, V, (2, N)))[1].backward()
    for mix in (m for m in model.modules() if isinstance(m, M.Mixing)):
        keep = M.allowed_positions('causal', mix.n_out, mix.n_in, 0, 'cpu')
        g = mix.weight.grad                                   # (P, H, k, n_out, n_in)
        assert torch.count_nonzero(g * ~keep) == 0
        used = keep.clone()
        used[N:] = False  # e > 1: hidden rows past n_ctx are never read, so they get no gradient
        if mix.softmax:
            used[0] = False  # a softmax over one allowed entry is the constant 1
        assert torch.count_nonzero(g * used) == used.sum() * g.shape[0] * g.shape[1] * g.shape[2]


def test_expanded_mixer_below_one_loses_tokens():
    """Paper fig S3: with e < 1 the hidden has e*n rows, so tokens at positions >= e*n never reach
    another position (only their own, through the residual)."""
    model = make(tiny(arch='mixer', expansion=0.5, n_layers=1))
    idx = torch.randint(0, V, (2, N))
    grad = embedding_grad(model, idx, None, lambda lg: lg[:, N - 1].pow(2).sum())
    hidden_rows = N // 2
    assert torch.count_nonzero(grad[:, hidden_rows:N - 1]) == 0
    assert torch.count_nonzero(grad[:, :hidden_rows]) > 0


def test_softmax_mixing_rows_sum_to_one_over_the_past():
    mix = make(tiny(arch='mixer', softmax=True)).backbone.blocks[0].layers[0].mix
    m = mix.matrix(0, N, N)[0, 0]                             # (n_out, n_in) of head 0
    assert torch.allclose(m.sum(-1), torch.ones(N, dtype=m.dtype))
    assert torch.count_nonzero(m.triu(1)) == 0
    assert (m.tril() > 0).sum() == N * (N + 1) // 2


@pytest.mark.parametrize('arch', ['mixer', 'llama'])
def test_bidirectional_lm_never_sees_the_token_it_predicts(arch):
    model = make(tiny(arch=arch, objective='bidirectional'))
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
    model = make(tiny(arch=arch, objective='autoencoder'))
    idx = torch.randint(0, V, (2, N))
    logits, _ = model(idx)
    z = model.encode(idx)
    assert z.shape == (2, D)
    assert torch.allclose(model.decode(z, N), logits)
    h = model.hidden(idx).detach().requires_grad_()
    model.decode(h[:, -1], N).pow(2).sum().backward()
    assert torch.count_nonzero(h.grad[:, :-1]) == 0 and torch.count_nonzero(h.grad[:, -1]) > 0
    other = idx.clone()   # a different input with the same embedding decodes identically
    other[:, 0] = (idx[:, 0] + 1) % V
    assert not torch.equal(model.encode(other), z)


def test_retrieval_mixer_only_position_dependence_is_its_mixing_weights():
    """The head and feed-forwards are shared across positions, so permuting the targets and the
    mixing weights' rows/columns alike permutes the logits: nothing else knows positions."""
    torch.manual_seed(0)
    c = 6
    net = M.RetrievalMixer(D, 2, c).double()
    x = torch.randn(3, c, D, dtype=torch.float64)
    logits, loss = net(x, torch.tensor([0, 2, 4]))
    assert logits.shape == (3, c - 1) and loss.ndim == 0
    perm = torch.tensor([0, 3, 1, 5, 2, 4])          # query stays first, targets shuffled
    with torch.no_grad():
        for mix in (m for m in net.modules() if isinstance(m, M.Mixing)):
            mix.weight.copy_(mix.weight[..., perm, :][..., perm])
            mix.bias.copy_(mix.bias[:, perm])
    permuted, _ = net(x[:, perm])
    assert torch.allclose(permuted, logits[:, perm[1:] - 1])


def reference_attention(x, attn, mask=None):
    """softmax(Q K^T / sqrt(d) + mask) V written out, with RoPE from its complex definition."""
    B, T, d = x.shape
    h = attn.heads
    hd = d // h
    q, k, v = (F.linear(x, w, b) for w, b in zip(attn.qkv.weight.chunk(3), (
        attn.qkv.bias.chunk(3) if attn.qkv.bias is not None else (None,) * 3)))
    q, k, v = (t.view(B, T, h, hd).transpose(1, 2) for t in (q, k, v))
    if attn.rope:  # pair (j, j + hd/2) is one complex number, rotated by angle pos * 10000^(-2j/hd)
        theta = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        rot = torch.polar(torch.ones(T, hd // 2, dtype=torch.float64), torch.arange(T)[:, None] * theta)

        def rope(t):
            z = torch.complex(t[..., :hd // 2], t[..., hd // 2:]) * rot
            return torch.cat([z.real, z.imag], -1)
        q, k = rope(q), rope(k)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    if mask is not None:
        allowed = allowed & (mask[:, None, None, :] | torch.eye(T, dtype=torch.bool))
    scores = scores.masked_fill(~allowed, float('-inf'))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, d)
    return attn.proj(y)


@pytest.mark.parametrize('arch', ['llama', 'gpt'])
@pytest.mark.parametrize('padding', [None, 'left', 'right'])
def test_attention_matches_explicit_computation(arch, padding):
    attn = make(tiny(arch=arch)).backbone.blocks[0].layers[0]
    x = torch.randn(2, N, D, dtype=torch.float64)
    mask = None if padding is None else padded_batch(padding, torch.Generator().manual_seed(0))[1]
    got = attn(x, M.Ctx(mask=mask))
    assert torch.allclose(got, reference_attention(x, attn, mask), atol=1e-10)


OVERFIT = [dict(arch=a) for a in ('mixer', 'llama', 'gpt', 'hybrid', 'gmlp', 'elita')] + [
    dict(arch='mixer', objective='autoencoder'), dict(arch='mixer', objective='bidirectional'),
    dict(arch='llama', objective='bidirectional')]  # llama autoencoder: see the position-blind test


@pytest.mark.parametrize('variant', OVERFIT, ids=lambda v: '-'.join(v.values()))
def test_every_arch_overfits_one_batch(variant):
    cfg = tiny(d_model=32, **variant)
    torch.manual_seed(0)
    model = build_model(cfg)
    idx = torch.randint(0, V, (4, N + 1))
    x, y = idx[:, :-1], idx[:, 1:]
    targets = M.objective_targets(cfg.objective, x, y)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    first = None
    for _ in range(200):
        loss = model(x, targets)[1]
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.1 * first:
            break
    assert loss.item() < 0.1 * first


@pytest.mark.parametrize('kw,msg', [
    (dict(arch='mamba'), 'arch'), (dict(d_model=0), 'd_model'), (dict(n_ctx=-4), 'n_ctx'),
    (dict(d_model=18, n_heads=4), 'n_heads'), (dict(kernel=0), 'kernel'), (dict(kernel=99), 'kernel'),
    (dict(arch='llama', kernel=3), 'arch'), (dict(expansion=-1.0), 'expansion'),
    (dict(objective='mlm'), 'objective'), (dict(arch='gpt', objective='autoencoder'), 'objective'),
    (dict(arch='elita', causal=False), 'causal'), (dict(arch='llama', d_model=12, n_heads=4), 'n_heads'),
    (dict(expansion=2.0, n_convs=2), 'n_convs'), (dict(objective='bidirectional', softmax=True), 'softmax'),
])
def test_bad_config_is_a_one_line_value_error(kw, msg):
    with pytest.raises(ValueError, match=msg) as err:
        tiny(**kw)
    assert '\n' not in str(err.value)


def test_bad_inputs_are_value_errors():
    model = build_model(tiny())
    with pytest.raises(ValueError, match='n_ctx'):
        model(torch.zeros(1, N + 1, dtype=torch.long))
    with pytest.raises(ValueError, match='vocab_size'):
        model(torch.full((1, 4), V, dtype=torch.long))
    with pytest.raises(ValueError, match='generation'):
        next(build_model(tiny(objective='half')).stream(torch.zeros(1, 2, dtype=torch.long), 1))


def test_param_counts_and_flops():
    cfg = tiny(arch='mixer')
    model = build_model(cfg)
    counts = M.param_counts(model)
    assert counts['total'] == sum(p.numel() for p in model.parameters())
    assert counts['mixing'] == cfg.n_layers * (N * N + N)      # one n_ctx x n_ctx matrix + bias per layer
    ff = cfg.n_layers * (2 * 4 * D * D + 5 * D)
    assert counts['feedforward'] == ff
    assert counts['embedding'] == 2 * V * D
    # PaLM-style: 6 x (params but embedding table and mixing; lm head in) + 6 n_ctx d_model per mixing
    assert M.flops_per_token(cfg) == 6 * (counts['total'] - counts['mixing'] - V * D) + 2 * 6 * N * D
    llama = tiny(arch='llama')
    total = sum(p.numel() for p in build_model(llama).parameters())
    assert M.flops_per_token(llama) == 6 * (total - V * D) + 2 * 12 * N * D
    assert M.flops_per_token(replace(llama, objective='mtp2')) == 2 * M.flops_per_token(llama)


def test_transformer_autoencoder_decoder_is_position_blind():
    """The paper's transformer autoencoder feeds the same vector to every decoder position; attention
    over identical values returns that value whatever RoPE does to the weights, so every position
    decodes the same distribution. This is why it autoencodes so poorly (paper fig 8); the mixer's
    position-specific weights do not have this problem."""
    idx = torch.randint(0, V, (2, N))
    llama, _ = make(tiny(arch='llama', objective='autoencoder'))(idx)
    assert torch.allclose(llama, llama[:, :1].expand_as(llama), atol=1e-10)
    mixer, _ = make(tiny(arch='mixer', objective='autoencoder'))(idx)
    assert not torch.allclose(mixer, mixer[:, :1].expand_as(mixer), atol=1e-3)
