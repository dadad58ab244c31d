"""Fixtures and helpers shared by test_model.py and tests/: tiny models, the tiny corpus prepared
by prepare.py and a tiny mixer trained on it by train.py, the scripts run as a user runs them.
test_model.py imports what it uses from here; pytest hands the fixtures to tests/ by itself."""
import contextlib, dataclasses, importlib, json, math, os, random, re, subprocess, sys, time, types

import pytest
import torch
import torch.nn.functional as F

import prepare, train
from model import ModelConfig, build_model


HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo: scripts run here
V, N, D = 40, 12, 16       # vocab, n_ctx, d_model of the tiny test models
ARCHS = ('mixer', 'llama', 'gpt', 'hybrid', 'gmlp', 'elita')
VOCAB, N_CTX = 97, 16      # the decoding tests' (tiny_model's) vocab and n_ctx
# train.py's tiny run; --device=cpu: the CPU's numbers on a GPU machine too
TINY = ['--d_model=32', '--n_layers=2', '--n_ctx=32', '--batch_size=4', '--eval_iters=2',
        '--log_interval=5', '--warmup_iters=0', '--lr=1e-2', '--device=cpu']
BENCH_TINY = ['--d_model=32', '--n_layers=1', '--n_ctx=16', '--vocab_size=128', '--batch_size=2',
              '--dtype=float32', '--device=cpu']
ENV = dict(os.environ, OMP_NUM_THREADS='1')
PAIR_WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega parse load save "
              "merge split join sort count").split()
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')


def name(variant):
    return '-'.join(f'{k}={x}' for k, x in variant.items()) or 'default'


# every causal model: each arch, each mixer variant and combinations, each causal objective; each
# is also a cached decoding path (test_model.py section 1)
VARIANTS = [
    dict(arch='mixer'), dict(arch='mixer', kernel=3),
    dict(arch='mixer', kernel=2),                                  # asymmetric 'same' padding
    dict(arch='mixer', expansion=2.0), dict(arch='mixer', expansion=0.5),  # rows past / short of n
    dict(arch='mixer', expansion=1.5, kernel=3), dict(arch='mixer', n_convs=3),
    dict(arch='mixer', expansion=0.5, kernel=3),                   # a step past its hidden rows
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


def assert_causal(model, idx, mask, gen, amp=contextlib.nullcontext):
    """No logit at t, nor its gradient, depends on a token after t: on idx's device, each forward
    and backward under the context amp()."""
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


def window_equals_cache(model, idx):
    """Greedy decoding for 2.5 windows both ways: the same tokens, logits within 1e-4."""
    tok_w, logit_w = decode(model, idx, 2 * N_CTX + N_CTX // 2, 'window')
    tok_c, logit_c = decode(model, idx, 2 * N_CTX + N_CTX // 2, 'cache')
    assert torch.equal(tok_w, tok_c) and len(tok_c.unique()) > 3    # > 3: not a trivial comparison
    torch.testing.assert_close(logit_c, logit_w, atol=1e-4, rtol=0)
    return logit_c, tok_c


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


def learns(data, out, *extra):
    """The checkpoint of 20 train.py steps, which lowered the training loss by 0.5 nats."""
    assert train_run(data, out, '--max_iters=20', '--eval_interval=20', *extra) == 0
    evals = records(out, 'val_loss')
    assert [r['step'] for r in evals] == [0, 20]
    assert evals[1]['train_loss'] < evals[0]['train_loss'] - 0.5
    return weights(out)


def interrupted_and_resumed(args, tmp_path):
    """Final checkpoints of train.py args run whole (in tmp_path/a) and killed -9 after its first
    checkpoint, then resumed (in tmp_path/b). Checks the counters, that the log was mended and that
    a killed save's temp file is gone."""
    assert train.main([*args, f'--out_dir={tmp_path}/a']) == 0
    out_b = tmp_path / 'b'
    cmd = [sys.executable, os.path.join(HERE, 'train.py'), *args, f'--out_dir={out_b}']
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and not (out_b / 'ckpt.pt').exists():
        time.sleep(0.01)
    time.sleep(0.137)
    proc.kill()  # SIGKILL: kill -9
    proc.wait()
    killed_at = max(json.loads(line)['step'] for line in open(out_b / 'log.jsonl')
                    if line.endswith('\n'))
    assert 25 <= weights(out_b)['step'] < 300 and killed_at < 300, "not interrupted mid-way"
    (out_b / 'ckpt.pt.tmp4242').write_bytes(b'cut short')  # as a kill during a save leaves it
    assert train.main([*args, f'--out_dir={out_b}', '--init_from=resume']) == 0
    assert not list(out_b.glob('*.tmp*'))  # the resume dropped it
    a, b = weights(tmp_path / 'a'), weights(out_b)
    assert a['step'] == b['step'] == 300 and a['tokens_seen'] == b['tokens_seen']
    steps = [r['step'] for r in records(out_b, 'loss')]
    # log trimmed, then appended
    assert steps == sorted(steps) and len(steps) == len(set(steps)) == 300
    return a, b


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
    # the hook returns None: the output itself flows on
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
    return perturbed(tiny(vocab_size=VOCAB, n_ctx=n_ctx, d_model=32, **kw), 0.1).eval()


def prompt(length, seed=1, batch=2):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def decode(model, idx, steps, method, **kw):
    """Greedy by default: (tokens (B, steps), logits (B, steps, vocab)) from model.stream."""
    toks, logits = zip(*model.stream(idx, steps, method=method, **{'temperature': 0.0, **kw}))
    return torch.stack(toks, 1), torch.stack(logits, 1)


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


def tokenizer(data_dir):
    """The tokenizer prepare.py wrote into data_dir, as train.py reads it."""
    return prepare.Tokenizer(train.load_meta(data_dir)['tokenizer'], str(data_dir))


def weights(out_dir, name='ckpt.pt'):
    return torch.load(os.path.join(out_dir, name), map_location='cpu', weights_only=True)


def run_main(capsys, script, *argv):
    """(exit status, stdout, stderr) of a script's main(argv), as a user would see them."""
    try:
        code = importlib.import_module(script).main([str(a) for a in argv])
    except SystemExit as e:  # --help exits
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
    torch.save({'kind': 'lm', 'model_config': dataclasses.asdict(cfg),
                'tokenizer': prepare.Tokenizer(meta['tokenizer'], str(data_dir)).spec,
                'data': {'data_dir': str(data_dir), 'meta': meta},
                'model': build_model(cfg).state_dict()}, str(path))
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
