"""nanomixer's tests of the model, written to be read top to bottom: each protects one property,
named by the test or its docstring. Tiny models on the CPU, every fixture made by the tests
themselves (tests/conftest.py, imported below). Run: python -m pytest -q (this file and tests/).
  1. the three teaching tests: a `Mixing` is tril(W) @ x + b written out by hand; no future token
     reaches a past logit (by perturbation and by exact-zero gradients, every causal variant, with
     a control that does leak); decoding with the cache equals re-running the window
  2. the golden run: train.py for 30 steps from a fixed seed, its losses and a greedy sample pinned
  3. model.py: the models against written-out references, their other masks, decoding,
     accounting, configuration
Each script's own tests are in tests/ (test_train.py, test_sample.py, ...), the GPU's in
tests/test_cuda.py (skipped without one).
"""
import dataclasses, math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import model as M, train
from model import ModelConfig, build_model
from tests.conftest import (V, N, D, ARCHS, VOCAB, N_CTX, name, VARIANTS, PADDED, assert_causal,
                            window_equals_cache, reference_attention, tiny, perturbed, make,
                            embedding_grad, padded_batch, tiny_model, prompt, decode, train_run,
                            records, weights, tokenizer)
from tests.conftest import data, one_thread  # noqa: F401 (fixtures: a parameter names one)


# ==================================================================================================
# 1. the three teaching tests

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


def test_non_causal_mixer_does_mix_backwards():
    """The control: on a model that mixes both ways the causality test above fails, by
    perturbation and by gradient."""
    gen = torch.Generator().manual_seed(1)
    with pytest.raises(AssertionError):
        assert_causal(make(tiny(causal=False)), *padded_batch(None, gen), gen)
    grad = embedding_grad(make(tiny(causal=False)), torch.randint(0, V, (2, N)), None,
                          lambda lg: lg[:, 0].pow(2).sum())
    assert torch.count_nonzero(grad[:, 1:]) > 0


def test_every_model_key_is_in_a_variant_the_tests_above_run():
    """A new ModelConfig key fails here until an entry of VARIANTS (tests/conftest.py) sets it:
    then causality and window == cache cover it. Sizes, causal=False (the control above) and
    share_ffn (the bidirectional test's) are tested on their own."""
    keys = {f.name for f in dataclasses.fields(ModelConfig)} - {k for v in VARIANTS for k in v}
    assert keys == {'vocab_size', 'n_ctx', 'd_model', 'n_layers', 'causal', 'share_ffn'}


@pytest.mark.parametrize('variant', VARIANTS, ids=name)
def test_window_equals_cache_equals_full_forward(variant):
    """The paper's window (re-run whole each step), the cache (one position a step) and the training
    forward: the same greedy tokens for 2.5 windows (both slide alike), the same logits in the
    first."""
    model, idx = tiny_model(**variant), prompt(5)
    logit_c, tok_c = window_equals_cache(model, idx)
    full, _ = model(torch.cat([idx, tok_c[:, :N_CTX - 5]], 1))      # (B, N_CTX, vocab)
    torch.testing.assert_close(logit_c[:, :N_CTX - 5], full[:, 4:-1], atol=1e-4, rtol=0)


def test_a_window_position_past_0_needs_the_cache():
    """Without a cache, inputs count from position 0 while outputs sit at [pos, pos + T): output
    pos would read token pos + 1. So pos > 0 is refused without the cache that holds [0, pos)."""
    with pytest.raises(AssertionError, match='cache'):
        make(tiny())(torch.zeros(1, 2, dtype=torch.long), pos=2)


# ==================================================================================================
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
    bos = torch.tensor([[tokenizer(data).bos_id]])
    tokens, logits = decode(model, bos, len(GOLDEN_TOKENS), 'cache')   # (1, K), (1, K, vocab)
    top2 = logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > GOLDEN_MARGIN
    assert tokens[0].tolist() == GOLDEN_TOKENS


# ==================================================================================================
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
    ff = make(tiny(arch='elita')).backbone.blocks[0].ffn   # W3 (silu(W1 x) outer silu(W2 x))
    outer = F.silu(ff.w1(x))[:, :, None] * F.silu(ff.w2(x))[:, None, :]     # (3, D, 8)
    assert torch.allclose(ff(x), ff.w3(outer.flatten(1)))


def param_counts(model):
    """Parameters split as the paper does: token mixing (mixings, attention), feed-forward,
    embedding (token and position tables, lm head) and other (norms, heads). mixing_effective
    leaves out the mixing entries no output depends on (masked ones, never-read hidden rows)."""
    kinds = [('mixing', (M.TokenMixing, M.Mixing, M.Attention, M.ELiTAAttention)),
             ('feedforward', (M.MLP, M.SwiGLU, M.ELiTAFeedForward, M.GatedMLP)),
             ('embedding', torch.nn.Embedding)]
    counts, seen = {}, set()
    for kind, types in kinds:  # a parameter counts once, in the first kind that claims it
        claimed = {id(p): p.numel() for name, mod in model.named_modules() for p in mod.parameters()
                   if isinstance(mod, types) or (kind == 'embedding' and name.endswith('lm_head'))}
        counts[kind] = sum(n for i, n in claimed.items() if i not in seen)
        seen |= claimed.keys()
    counts['other'] = sum(p.numel() for p in model.parameters() if id(p) not in seen)
    counts['total'] = sum(counts.values())
    reads = {id(t.mix): t.mix2.weight.shape[-2] for t in model.modules()  # rows mix2 reads
             if isinstance(t, M.TokenMixing) and t.mix2 is not None}
    unused = 0
    for m in (m for m in model.modules() if isinstance(m, M.Mixing)):
        n_out = m.weight.shape[-2]
        rows = min(n_out, reads.get(id(m), n_out))
        kept = int(M.allowed(m.direction, m.weight[..., :rows, :], 0).sum())
        unused += m.weight.numel() + m.bias.numel() - m.weight[..., 0, 0].numel() * kept \
            - m.bias.shape[0] * rows
    counts['mixing_effective'] = counts['mixing'] - unused
    return counts


@pytest.mark.parametrize('variant', [dict(), dict(kernel=3), dict(n_heads=2, kernel=3),
                                     dict(softmax=True), dict(expansion=2.0), dict(expansion=0.5),
                                     dict(n_convs=3), dict(arch='hybrid'), dict(arch='gmlp')],
                         ids=name)
def test_masked_weights_get_exactly_zero_gradient(variant):
    """Above the diagonal a mixing weight gets no gradient; every allowed entry that is read gets
    one. param_counts' mixing_effective (no masked entries, no never-read hidden rows) counts just
    those."""
    model = make(tiny(**variant))
    counts = param_counts(model)
    model(torch.randint(0, V, (2, N)), torch.randint(0, V, (2, N)))[1].backward()
    mixings = [m for m in model.modules() if isinstance(m, M.Mixing)]
    for mix in mixings:
        keep = torch.ones(mix.weight.shape[-2:], dtype=torch.bool).tril()  # not model.allowed
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
    # a short document leaves half nothing to predict: its loss is 0, not 0/0, and trains nothing
    short = M.objective_targets('half', x, y, torch.tensor([[True] * 3 + [False] * 5]))
    logits = torch.randn(1, 8, 16, requires_grad=True)
    loss = M.lm_loss(logits, short)
    loss.backward()
    assert loss.item() == 0 and not logits.grad.any()


def test_mtp2_adds_the_token_two_ahead():
    """mtp2 (paper §5.2): a second pass reads the model's own argmax tokens, and its logits at t
    are scored against the token two ahead of t's input: the targets shifted once more."""
    model = make(tiny(objective='mtp2'))
    idx = torch.randint(0, V, (2, N + 1), generator=torch.Generator().manual_seed(0))
    x, y = idx[:, :-1], idx[:, 1:]
    logits, loss = model(x, targets=y)
    logits2 = model.lm_head(model.backbone(logits.argmax(-1)))
    want = M.lm_loss(logits, y) + M.lm_loss(logits2[:, :-1], y[:, 1:])
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)  # the same float64 operations


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
    every token. Attention over that vector repeated returns it whatever RoPE does, so every
    position decodes alike (why llama autoencodes poorly, paper fig 8); the mixer's
    position-specific weights do not."""
    model = make(tiny(arch=arch, objective='autoencoder'))
    idx = torch.randint(0, V, (2, N))
    z, logits = model.encode(idx), model(idx)[0]
    assert z.shape == (2, D) and torch.allclose(model.decode(z, N), logits)
    assert torch.equal(z, model.hidden(idx)[:, -1])   # the last position's state
    spread = (logits - logits[:, :1]).abs().max()   # how far later positions decode from the first
    assert spread < 1e-10 if arch == 'llama' else spread > 1e-3
    h = model.hidden(idx).detach().requires_grad_()
    model.decode(h[:, -1], N).pow(2).sum().backward()
    assert torch.count_nonzero(h.grad[:, :-1]) == 0 and torch.count_nonzero(h.grad[:, -1]) > 0
    other = idx.clone()
    other[:, 0] = (idx[:, 0] + 1) % V
    assert not torch.equal(model.encode(other), z)


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


@pytest.mark.parametrize('arch', ARCHS)
def test_tied_head_starts_at_chance(arch):
    """Tied, the token table is an output layer too, at an output layer's scale: the loss at init
    is ln V, as untied (within 1 nat; a mixer's table at N(0, 1) as its head gave ~31 for 5.5)."""
    cfg = ModelConfig(arch=arch, vocab_size=256, n_ctx=16, d_model=32, n_layers=2, tie_weights=True)
    torch.manual_seed(0)
    idx, targets = torch.randint(0, 256, (2, 4, 16))
    with torch.no_grad():
        assert abs(build_model(cfg)(idx, targets)[1].item() - math.log(256)) < 1


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


def test_elita_scan_rescales_by_the_running_max_of_every_block():
    """The scan keeps its sums relative to the running max of every key so far, earlier blocks'
    included: keys 200 below the previous block's (e^200 overflows float32) give float64's
    answer, not inf or NaN."""
    L, g = 4, torch.Generator().manual_seed(0)
    key = torch.tensor([100.0] * L + [-100.0] * L)[None, None]     # (B, H, 2L): two blocks
    v = torch.randn(1, 1, 2 * L, 3, generator=g)

    def run(dt):
        state = (torch.full((1, 1), -math.inf, dtype=dt), torch.zeros(1, 1, 3, dtype=dt),
                 torch.zeros(1, 1, dtype=dt))
        ys = []
        for chunk in zip(*(t.to(dt).split(L, dim=2) for t in (key, 0 * key, 0 * key, v))):
            y, state = M.ELiTAAttention.scan(*chunk, state)
            ys.append(y)
        return torch.cat(ys, 2)
    torch.testing.assert_close(run(torch.float32), run(torch.float64).float())


def test_each_arch_builds_the_blocks_it_names():
    """n_heads=0 means 4 attention heads (llama, gpt, hybrid, elita) or one mixing head (a hybrid's
    mixing too); a kernel may span all of a head's channels; the hybrid orders its attention and
    mixing as hybrid_order says; GPT-1 is post-norm (each block's output rows normalised) with
    no final norm, as the mixer has none; objective half blanks the input of block n_layers // 2."""
    for arch, heads in dict(mixer=1, llama=4, gpt=4, hybrid=4, gmlp=1, elita=4).items():
        assert tiny(arch=arch).n_heads == heads
        assert isinstance(build_model(tiny(arch=arch)).backbone.norm, nn.Identity) \
            == (arch in ('mixer', 'gpt'))
    # a kernel as wide as the channels it slides along is accepted
    assert tiny(kernel=D).kernel == D and tiny(n_heads=2, kernel=D // 2).kernel == D // 2
    for order, kinds in (('attn_mix', [M.Attention, M.TokenMixing]),
                         ('mix_attn', [M.TokenMixing, M.Attention]),
                         ('parallel', [M.Attention, M.TokenMixing])):
        mixers = build_model(tiny(arch='hybrid', hybrid_order=order)).backbone.blocks[0].mixers
        assert [type(m) for m in (mixers[0] if order == 'parallel' else mixers)] == kinds
        assert all(m.heads == 1 for m in mixers.modules() if isinstance(m, M.TokenMixing))
    x = 3 * torch.randn(2, N, D)
    out = build_model(tiny(arch='gpt')).backbone.blocks[0](x)
    torch.testing.assert_close(out.mean(-1), torch.zeros(2, N), atol=1e-5, rtol=0)
    # LayerNorm's eps (1e-5) against rows of variance ~9 moves the variance by ~1e-6
    torch.testing.assert_close(out.var(-1, unbiased=False), torch.ones(2, N), atol=1e-3, rtol=0)
    model, ins = make(tiny(objective='half', n_layers=3)), []
    for block in model.backbone.blocks:
        block.register_forward_pre_hook(lambda mod, args: ins.append(args[0]))
    model(torch.randint(0, V, (2, N)))
    assert [bool(x[:, N // 2:].any()) for x in ins] == [True, False, True]


@pytest.mark.parametrize('arch', ARCHS)
def test_init_per_arch(arch):
    """Transformers (llama, gpt, hybrid) start every Linear and Embedding at N(0, 0.02), biases 0;
    mixers keep the paper's (Conv1d-like) init; gMLP's spatial mixing starts at W ~ 0 and b = 1
    (a plain feed-forward); tie_weights makes the head and the token table one tensor."""
    torch.manual_seed(0)
    model = build_model(tiny(arch=arch, d_model=64))
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    stds = torch.tensor([m.weight.std().item() for m in linears])
    transformer = arch in ('llama', 'gpt', 'hybrid')
    # 0.004: 20 % of 0.02, where a std of 1,000 or more weights has a standard error of 2 %
    assert ((stds - 0.02).abs() < 0.004).all() == transformer, stds
    biases = [m.bias for m in linears if getattr(m, 'bias', None) is not None]
    assert not transformer or not any(b.any() for b in biases)
    for sgu in (m for m in model.modules() if isinstance(m, M.GatedMLP)):
        assert (sgu.spatial.bias == 1).all() and sgu.spatial.weight.abs().max() <= 0.01 / N
    tied = build_model(tiny(arch=arch, tie_weights=True))
    wte = next(m for m in tied.modules() if isinstance(m, nn.Embedding))
    assert tied.lm_head.weight is wte.weight


@pytest.mark.parametrize('method', ['window', 'cache'])
def test_slide_reencodes_last_half_window(method):
    """Once the window is full, the next token comes from the last n_ctx/2 tokens placed at the
    window start (checked against a fresh generation from them); a long prompt keeps its last
    window."""
    model, idx = tiny_model(arch='mixer', kernel=3), prompt(4, batch=1)
    seq = torch.cat([idx, decode(model, idx, N_CTX + 3, method)[0]], 1)
    for i in (N_CTX + 1, N_CTX + 2):                               # positions after a slide
        assert decode(model, seq[:, N_CTX + 1 - N_CTX // 2:i], 1, method)[0] == seq[0, i]
    long = prompt(N_CTX + 7, batch=1)
    a, b = (decode(model, p, 4, method)[0] for p in (long, long[:, -N_CTX:]))
    assert torch.equal(a, b)


def test_sampling_filters_and_seed():
    """top_k=1, a tiny top_p and a tiny temperature (logits / T past float32's range, even T
    itself below it) are greedy; every top_k sample lies in the k best logits; a generator seed
    fixes the sample, with either decoder."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, VOCAB, generator=g)
    for t in (1e-45, 1e-300):
        assert torch.equal(M.sample_token(logits, t, generator=g), logits.argmax(-1))
    assert torch.equal(M.sample_token(logits, 1.0, top_k=1, generator=g), logits.argmax(-1))
    assert torch.equal(M.sample_token(logits, 1.0, top_p=1e-6, generator=g), logits.argmax(-1))
    best5 = logits.topk(5, dim=-1).indices
    for _ in range(10):
        assert (best5 == M.sample_token(logits, 2.0, top_k=5, generator=g)[:, None]).any(-1).all()
    assert len(M.sample_token(logits, 5.0, generator=g).unique()) > 10  # no filter: spread out
    model, kw = tiny_model(arch='mixer', n_heads=2), dict(temperature=0.9, top_k=20, top_p=0.95)
    for method in ('window', 'cache'):
        runs = [decode(model, prompt(3), 24, method, generator=torch.Generator().manual_seed(s),
                       **kw)[0] for s in (7, 7, 8)]
        assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_param_counts_and_flops():
    """param_counts splits the weights by role; flops_per_token written out for the mixer
    and llama (every variant against what runs: the next test)."""
    cfg, llama = tiny(), tiny(arch='llama')
    counts = param_counts(build_model(cfg))
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
    # ELiTA's scan multiplies blocks of ELITA_CHUNK positions: per token, flat past one block
    elita = [M.flops_per_token(tiny(arch='elita', n_ctx=k * M.ELITA_CHUNK)) for k in (1, 2)]
    assert elita[0] == elita[1]


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
    channels = {id(m): cfg.width // t.heads for t in model.modules() if isinstance(t, M.TokenMixing)
                for m in t.modules()}
    for _, mod in model.named_modules(remove_duplicate=False):  # a shared module runs twice
        if not isinstance(mod, (M.Mixing, nn.Embedding)):
            unseen += sum(p.numel() for k, p in mod.named_parameters(recurse=False)
                          if not (isinstance(mod, nn.Linear) and k == 'weight'))
        elif mod.weight.dim() == 4:  # a kernel's Conv1d: its forward is 1/3 of the 6 x term
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
    (dict(objective='bidirectional', share_ffn=1), 'share_ffn'),
    (dict(arch='gmlp', n_heads=2), 'n_heads'), (dict(objective='half', n_layers=1), 'n_layers')])
def test_bad_config_is_a_one_line_assertion_naming_the_field(kw, key):
    with pytest.raises(AssertionError, match=key) as err:
        tiny(**kw)
    assert '\n' not in str(err.value)


def test_bad_inputs_are_assertions():
    model = build_model(tiny())
    with pytest.raises(AssertionError, match='n_ctx'):
        model(torch.zeros(1, N + 1, dtype=torch.long))
    with pytest.raises(AssertionError, match='token ids'):
        model(torch.zeros(N, dtype=torch.long))
    with pytest.raises(AssertionError, match='generation'):   # the half objective cannot generate
        next(build_model(tiny(objective='half')).stream(torch.zeros(1, 2, dtype=torch.long), 1))


def test_stream_runs_one_forward_per_yielded_token():
    """A drained stream of n tokens runs the prefill and n - 1 cached steps, none after the last;
    a step's logits are float32 whatever the weights' dtype."""
    model, calls = tiny_model(), []

    def step(tok, pos, cache):
        calls.append(pos)
        return model.step(tok, pos, cache)
    assert len(list(model.stream(prompt(4), 3, temperature=0, step=step))) == 3
    assert calls == [4, 5]                     # the 2nd and 3rd tokens; the 1st is the prefill's
    half = tiny_model().to(torch.bfloat16)
    assert half.step(prompt(4), 0, M.Cache(N_CTX)).dtype == torch.float32
