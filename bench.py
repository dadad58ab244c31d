"""
bench.py: the paper's measurements, re-run on your own hardware in one command.

    python bench.py MODE [--key=value ...] [--json=FILE]

MODE is one of
  throughput  training steps (forward, backward, AdamW): ms/step, tokens/s, MFU (known GPUs)
  memory      peak memory of one forward + backward, no lm head (the paper's Tables S9/S10)
  generate    decoding tokens/s, fixed window vs cache, at batch 1 and 16
  represent   input recovery from a layer's activations by gradient descent (paper §3.1-3.3)
  weights     a checkpoint's masked mixing matrices, tril(W) per layer and head, as one picture
              and a table of how much weight lies near the diagonal
  race        archs trained for the same wall-clock budget by train.py, val loss vs time as a
              table and a picture (python bench.py race --help: its own keys)

--archs, --n_ctx and --n_layers take comma lists and every mode but race runs their product
(--batch_size too, in generate). Sizes default per mode (`MODE --help` lists them), minutes each on
2 CPU cores; --full swaps in the paper's grid; the command line wins over both. The paper's memory
settings: --batch_size=16 --n_heads=32.
"""
import contextlib, importlib.util, inspect, json, os, platform, re, resource, signal, statistics
import subprocess, sys, time, timeit
from pathlib import Path
from types import SimpleNamespace

import torch

from model import ARCHS, Backbone, Mixing, ModelConfig, allowed, build_model, flops_per_token
from configurator import (check_output_file, int_list, parse_args, read_preset, run_main,
                          write_atomic)
from prepare import Tokenizer
from sample import compiled_step, decode_layout
from train import (CHOICES, DEFAULTS as TRAIN_DEFAULTS, EVAL_KEYS, MODEL_KEYS, Batches,
                   autocast, check_loop, check_run_dir, choose_dtype, configure_optimizer,
                   load_checkpoint, load_meta, model_from_checkpoint, peak_flops, resolve_device,
                   sync)

DEFAULTS = dict(
    mode='',                # the MODE, the first bare word
    archs='mixer,llama,gpt',  # comma list of model archs
    d_model=256,
    n_layers='4',           # comma list
    n_ctx='128,256,512',    # comma list
    batch_size='4',         # rows per step; a comma list in generate
    n_heads=0,              # heads of llama/gpt/hybrid/elita (0: ModelConfig's, 4); mixers keep 1
    vocab_size=4096,        # the paper's TinyStories tokenizer size
    full=False,             # the paper's sizes (slow on a CPU)
    device='auto',          # auto (cuda if present), cpu or cuda[:i]
    dtype='auto',           # autocast (auto: as train.py); generate casts weights (as sample.py)
    seed=0,
    json='',                # write every row to this JSON file
    repeats=3,              # timed runs of a throughput or generate cell; its row: their median
    compile=False,          # torch.compile the model (generate: the cached step, warm-up apart)
    mem_limit=12288,        # memory: MB a cell may use before OOM (the paper's 12 GB; 0: none)
    prompt=128,             # generate: tokens of the prompt
    new_tokens=64,          # generate: tokens decoded after it
    methods='window,cache',  # generate: comma list of window and/or cache
    ckpt='',                # represent (default: untrained models), weights: a train.py checkpoint
    data_dir='',            # represent: inputs from its val.bin (default: random tokens)
    layer='',               # represent: comma list of layers l whose output is inverted (last)
    steps=500,              # represent: gradient descent steps
    lr=0.05,                # represent: step size, decaying to lr/10
    positions=0,            # weights: the first this many positions drawn (0: n_ctx, at most 128)
    out='',                 # weights: the picture, as its suffix says (default: weights.png)
    overwrite=False,        # replace what exists: --json's, --out's file (race: its out_dir's)
)
MODE_DEFAULTS = {  # each mode's sizes over DEFAULTS (which hold throughput's)
    'memory': dict(archs='mixer,llama', d_model=1024, n_layers='4,8', n_ctx='512,1024,2048',
                   batch_size='1'),
    'generate': dict(n_ctx='256', batch_size='1,16'),
    'represent': dict(archs='mixer,llama', n_ctx='32', batch_size='2'),
}
FULL = {  # --full: the paper's settings (or the README's headline ones)
    'throughput': dict(d_model=512, n_layers='8', n_ctx='128,256,512,1024'),
    'memory': dict(n_layers='4,8,16', n_ctx='512,1024,2048,4096,8192'),
    'generate': dict(n_layers='8', n_ctx='512', prompt=256, new_tokens=256),
    'represent': dict(d_model=512, n_layers='8'),
}


def settings(argv):
    """argv's settings: DEFAULTS, its mode's sizes (the paper's with --full), then argv itself."""
    s = parse_args(argv, DEFAULTS, __doc__, BENCH_CHOICES, 'mode', MODE_DEFAULTS)
    if s['full']:  # parsed again so that argv's own values still win over the paper's
        full = {mode: dict(MODE_DEFAULTS.get(mode, {}), **FULL[mode]) for mode in FULL}
        s = parse_args(argv, DEFAULTS, __doc__, BENCH_CHOICES, 'mode', full)
    if s['mode'] == 'race':  # given as --mode=race: race reads its own keys
        raise ValueError("race takes its own keys: write it first, python bench.py race ...")
    assert s['repeats'] >= 1, f"--repeats={s['repeats']}: use 1 or more"
    assert s['steps'] >= 1, f"--steps={s['steps']}: use 1 or more"
    assert s['mem_limit'] >= 0, f"--mem_limit={s['mem_limit']}: use MB >= 0 (0: no limit)"
    s = SimpleNamespace(**s)
    for key in ('n_layers', 'n_ctx', 'batch_size'):
        setattr(s, key, int_list(getattr(s, key), key))
    if s.mode != 'generate':
        assert len(s.batch_size) == 1, f"--batch_size: one value in {s.mode}, a list in generate"
        s.batch_size = s.batch_size[0]
    s.dev = resolve_device(s.device)
    s.torch_dtype, why = ((torch.float32, f'{s.mode} runs in float32')  # inverts, or reads
                          if s.mode in ('represent', 'weights') else  # generate: as sample.py
                          choose_dtype(s.dev, s.dtype, reading=s.mode == 'generate'))
    s.device, s.dtype = str(s.dev), str(s.torch_dtype)[6:]  # what runs, as memory cells inherit it
    print(f"{s.mode}: {s.device} {s.dtype} ({why})", file=sys.stderr)
    # every (arch, n_layers, n_ctx) the mode measures: a bad arch or size fails here, before any
    # work. --n_heads counts attention heads; a mixer's would count mixing heads: mixers keep one
    s.cfgs = [ModelConfig(arch=arch, vocab_size=s.vocab_size, n_ctx=n_ctx, d_model=s.d_model,
                          n_layers=n_layers, n_heads=0 if arch in ('mixer', 'gmlp') else s.n_heads)
              for arch in s.archs.split(',') for n_layers in s.n_layers for n_ctx in s.n_ctx]
    return s


def flags(keys):
    return [f"--{k}={v}" for k, v in keys.items()]


def row(s, cfg, **measured):
    return dict(mode=s.mode, arch=cfg.arch, d_model=cfg.d_model, n_layers=cfg.n_layers,
                n_ctx=cfg.n_ctx, dtype=s.dtype, **measured)


# ----------------------------------------------------------------------------- throughput

def bench_throughput(s):
    """ms per training step of a fresh model per cell: the median of --repeats timed steps after
    two untimed ones (the allocator's first requests and, with --compile, the compile)."""
    peak = peak_flops(s.dev, s.torch_dtype)
    gen = torch.Generator().manual_seed(s.seed)
    for cfg in s.cfgs:
        xy = torch.randint(cfg.vocab_size, (s.batch_size, cfg.n_ctx + 1), generator=gen).to(s.dev)
        torch.manual_seed(s.seed)
        model = build_model(cfg).to(s.dev).train()
        torch._dynamo.reset()  # each cell's model, one more graph: stay under the recompile limit
        step = torch.compile(model) if s.compile else model
        opt = configure_optimizer(model, 1e-4, 0.01)

        def train_step():
            with autocast(s.dev, s.torch_dtype):
                loss = step(xy[:, :-1], xy[:, 1:])[1]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(s.dev)  # the clock stops when the GPU is done

        # gc stays on, as in training (timeit would switch it off)
        times = timeit.repeat(train_step, 'gc.enable()', number=1, repeat=2 + s.repeats)
        ms = 1e3 * statistics.median(times[2:])
        tps = s.batch_size * cfg.n_ctx / (ms / 1e3)
        mfu = {'mfu': flops_per_token(cfg) * tps / peak} if peak else {}  # a known GPU's
        yield row(s, cfg, batch_size=s.batch_size, ms_per_step=ms, tokens_per_s=tps, **mfu)


# ----------------------------------------------------------------------------- memory

def proc_status(key):
    """A /proc/self/status entry in bytes (Linux): VmHWM, the peak resident set (unlike ru_maxrss
    it starts afresh at exec: a child's is not its parent's), or VmSize, what this process maps."""
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ':'))


def memory_cell(s):
    """bench_memory's child: one forward + backward of s.cfgs[0]'s backbone (no lm head); prints
    its peak MB as JSON, on a CPU over those the interpreter and torch held before it."""
    torch.ones(64, 64) @ torch.ones(64, 64)   # start the thread pool: the baseline holds it
    cuda = s.dev.type == 'cuda'
    base = 0 if cuda else proc_status('VmHWM')
    if s.mem_limit and cuda:
        total = torch.cuda.get_device_properties(s.dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, s.mem_limit * 2**20 / total), s.dev)
    elif s.mem_limit:
        limit = proc_status('VmSize') + s.mem_limit * 2**20   # what this process maps, plus it
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    try:
        cfg = s.cfgs[0]
        backbone = Backbone(cfg).to(s.dev)
        idx = torch.randint(cfg.vocab_size, (s.batch_size, cfg.n_ctx), device=s.dev)
        with autocast(s.dev, s.torch_dtype):
            h = backbone(idx)                                           # (B, n_ctx, d_model)
        h.float().sum().backward()
        sync(s.dev)
        peak = (torch.cuda.max_memory_allocated(s.dev) if cuda else proc_status('VmHWM')) - base
    except (RuntimeError, MemoryError) as e:
        # torch's allocators raise RuntimeError; oneDNN's bf16 ones "could not create a primitive"
        why = str(e).lower()
        if isinstance(e, RuntimeError) and 'memory' not in why and 'create a primitive' not in why:
            raise
        peak = None
    print(json.dumps({'mb': None if peak is None else peak / 2**20}))


def bench_memory(s):
    """Each cell's peak MB, a fresh interpreter's (memory_cell), or None if it ran out of memory."""
    keys = {k: getattr(s, k) for k in ('d_model', 'batch_size', 'n_heads', 'vocab_size', 'device',
                                       'dtype', 'mem_limit')}
    for cfg in s.cfgs:
        cell = dict(keys, archs=cfg.arch, n_layers=cfg.n_layers, n_ctx=cfg.n_ctx)
        code = f"import bench; bench.memory_cell(bench.settings({['memory', *flags(cell)]!r}))"
        proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)))
        mb = None  # stays if killed by a signal: the kernel's OOM killer, or an allocator's abort
        if proc.returncode >= 0:
            assert proc.returncode == 0, f"memory cell {flags(cell)} failed: {proc.stderr.strip()}"
            mb = json.loads(proc.stdout.strip().splitlines()[-1])['mb']
        yield row(s, cfg, n_heads=cfg.n_heads, batch_size=s.batch_size, mb=mb)


# ----------------------------------------------------------------------------- generate

def decode_stamps(model, prompt, new_tokens, method, step, s):
    """Seconds from the start to each token of greedy generation (the first holds the prefill)."""
    sync(s.dev)
    t0, stamps = time.perf_counter(), []
    for _ in model.stream(prompt, new_tokens, temperature=0, method=method, step=step):
        sync(s.dev)
        stamps.append(time.perf_counter() - t0)
    return stamps


def bench_generate(s):
    """Greedy decoding tokens/s per arch, method and batch size. Weights are cast to the dtype, not
    autocast: a step is bound by reading them. window runs at the first batch size only
    (compute-bound: batch B costs B forwards)."""
    if s.prompt < 1 or s.new_tokens < 2:  # a stream starts from a token; a rate needs two stamps
        raise ValueError(f"--prompt={s.prompt} --new_tokens={s.new_tokens}: time a prompt of 1 "
                         f"token or more and 2 new tokens or more")
    bad = set(s.methods.split(',')) - {'window', 'cache'}
    assert not bad, f"--methods={s.methods}: a comma list of window and cache, not {bad}"
    if s.prompt + s.new_tokens > min(s.n_ctx):  # before any cell runs
        raise ValueError(f"--prompt={s.prompt} plus --new_tokens={s.new_tokens} exceeds "
                         f"n_ctx={min(s.n_ctx)}: shorten them or raise --n_ctx")
    gen = torch.Generator().manual_seed(s.seed)
    for cfg in s.cfgs:
        torch.manual_seed(s.seed)
        model = decode_layout(build_model(cfg).to(s.dev, s.torch_dtype).eval())
        torch._dynamo.reset()  # each cell's step, one more graph: stay under the recompile limit
        step = compiled_step(model) if s.compile else None
        for batch in s.batch_size:
            prompt = torch.randint(cfg.vocab_size, (batch, s.prompt), generator=gen).to(s.dev)
            for method in s.methods.split(','):
                if method == 'window' and batch != s.batch_size[0]:
                    continue
                # warm-up: two tokens; compiled, every timed position (its compile, CUDA graph)
                warm = s.new_tokens if step and method == 'cache' else 2
                warmup = decode_stamps(model, prompt, warm, method, step, s)[-1]
                runs = [decode_stamps(model, prompt, s.new_tokens, method, step, s)
                        for _ in range(s.repeats)]
                per_token = statistics.median((t[-1] - t[0]) / (len(t) - 1) for t in runs)
                yield row(s, cfg, method=method, prompt=s.prompt, new_tokens=s.new_tokens,
                          batch_size=batch, compile=s.compile and method == 'cache',
                          warmup_s=warmup, tokens_per_s=batch / per_token)  # a token per row


# ----------------------------------------------------------------------------- represent

def layer_output_fn(backbone, idx, layer):
    """O_l: token embeddings e (B, T, d) -> block l's output (B, T, d), by the backbone's forward
    with the embedding lookup's result swapped for e (so positions, RoPE and masks apply)."""
    if not 1 <= layer <= len(backbone.blocks):
        raise ValueError(f"--layer={layer} is out of range: the model has layers "
                         f"1..{len(backbone.blocks)}")

    def O(e):
        out = {}
        with (backbone.wte.register_forward_hook(lambda mod, inp, res: e),  # removed on exit
              backbone.blocks[layer - 1].register_forward_hook(
                  lambda mod, inp, res: out.update(x=res))):
            backbone(idx)
        return out['x']
    return O


def l1_per_sequence(a, b):
    return (a - b).abs().flatten(1).sum(1)  # (B,)


def invert(O, e, steps, lr, gen):
    """Paper eq. 2: gradient descent on the L1 distance of O(e_n) to O(e) from e_0 ~ N(1/2, 1/20),
    the step size decaying linearly from lr to lr/10. Returns e_N and its per-sequence distance."""
    target = O(e).detach()
    e_n = (0.5 + torch.randn(e.shape, generator=gen).to(e.device) / 20).requires_grad_()
    for n in range(steps):
        grad, = torch.autograd.grad(l1_per_sequence(O(e_n), target).sum(), e_n)
        with torch.no_grad():
            e_n -= lr * (1 - 0.9 * n / max(1, steps - 1)) * grad
    with torch.no_grad():
        return e_n.detach(), l1_per_sequence(O(e_n), target)


def hamming(x, y, pad_id=None):
    """Paper eq. 6: fraction of the input's non-pad positions where the recovered token differs."""
    real = torch.ones_like(x, dtype=torch.bool) if pad_id is None else x != pad_id
    return ((x != y) & real).sum().item() / max(1, real.sum().item())


def represent_rows(model, idx, layers, steps, lr, pad_id=None, seed=0):
    """Invert each layer from all positions' activations ('all') and from the last position's only
    ('last', the non-self representation): Hamming distance, final L1 loss and the paper's epsilon,
    the L1 shift that N(0, 1/20) noise on e causes (converged: loss <= eps)."""
    model, cfg = model.float().eval().requires_grad_(False), model.cfg
    # the token embeddings inverted: a LanguageModel's backbone's, an Autoencoder's encoder's
    backbone = getattr(model, 'backbone', None) or getattr(model, 'encoder', None)
    if backbone is None:
        raise ValueError(f"represent needs one token embedding feeding one backbone; "
                         f"{type(model).__name__} has not: probe a model of objective clm, "
                         f"mtp2, half or autoencoder")
    wte = backbone.wte.weight  # eq. 3: a_N = W^+ e_N, W = table^T: W^+ = pinv(table)^T
    e, w_pinv = wte[idx], torch.linalg.pinv(wte)                     # (B, T, d), (d, vocab)
    for layer in layers:
        O_all = layer_output_fn(backbone, idx, layer)
        for which, O in (('all', O_all), ('last', lambda v: O_all(v)[:, -1:])):
            gen = torch.Generator().manual_seed(seed)
            e_n, loss = invert(O, e, steps, lr, gen)
            with torch.no_grad():
                noise = torch.randn(e.shape, generator=gen).to(e.device) / 20
                eps = l1_per_sequence(O(e + noise), O(e))
            yield dict(mode='represent', arch=cfg.arch, d_model=cfg.d_model, n_layers=cfg.n_layers,
                       n_ctx=cfg.n_ctx, layer=layer, positions=which,
                       hamming=hamming(idx, (e_n @ w_pinv).argmax(-1), pad_id),  # a_N's
                       loss=loss.mean().item(), epsilon=eps.mean().item(),
                       converged=(loss <= eps).float().mean().item())


def bench_represent(s):
    gen = torch.Generator().manual_seed(s.seed)
    for cfg in [None] if s.ckpt else s.cfgs:
        torch.manual_seed(s.seed)
        ckpt = load_checkpoint(s.ckpt) if s.ckpt else None
        model = model_from_checkpoint(ckpt) if ckpt else build_model(cfg)
        cfg, pad_id = model.cfg, None
        if s.data_dir:  # validation windows as train.py draws them, its checks of the data too
            meta = load_meta(s.data_dir)
            if ckpt:  # another tokenizer's ids would be other text
                theirs = Tokenizer(meta['tokenizer'], s.data_dir).spec
                assert Tokenizer.from_checkpoint(ckpt).spec == theirs, \
                    f"--data_dir={s.data_dir} was tokenized otherwise than {s.ckpt}'s data"
            assert meta['vocab_size'] <= cfg.vocab_size, \
                f"--data_dir={s.data_dir}: its vocab of {meta['vocab_size']} exceeds the model's"
            keys = dict(TRAIN_DEFAULTS, n_ctx=cfg.n_ctx, batch_size=s.batch_size, seed=s.seed)
            idx, pad_id = Batches(keys, meta, s.data_dir)('val', None, 0)[0], meta['pad_id']
        else:
            idx = torch.randint(cfg.vocab_size, (s.batch_size, cfg.n_ctx), generator=gen)  # (B, T)
        layers = int_list(s.layer, 'layer') if s.layer else [cfg.n_layers]
        yield from represent_rows(model.to(s.dev), idx.to(s.dev), layers, s.steps, s.lr, pad_id,
                                  s.seed)


# ----------------------------------------------------------------------------- weights

def mixing_matrices(model):
    """(layer, panel, matrix (rows, cols)) per Mixing and head, as the model uses it; kernel > 1:
    the norm over its taps (masked alike). Expanded: mix (hidden, n_ctx), mix2 (n_ctx, hidden)."""
    for name, m in model.named_modules():
        if isinstance(m, Mixing):  # 'backbone.blocks.0.mixers.0.mix.1': layer 1, mix.1
            stack, i, leaf = re.fullmatch(r'(.*?)blocks\.(\d+)\.mixers\.[\d.]*(.+)', name).groups()
            # (H, R, S) or (H, kernel, R, S); rows past n_ctx (an expanded mix's) are never computed
            W = m.weight.detach().float()[..., :model.cfg.n_ctx, :]
            W = W.masked_fill(~allowed(m.direction, W, 0), -torch.inf if m.softmax else 0)
            W = W.softmax(-1) if m.softmax else W
            taps = f" (norm over {W.shape[1]} taps)" if W.dim() == 4 else ''
            for h, M in enumerate(W.norm(dim=1) if taps else W):
                yield (f"{stack.replace('backbone.', '')}layer {int(i) + 1}",
                       leaf + f" head {h}" * (len(W) > 1) + taps, M)


def near_mass(M, k):
    """The fraction of row t's |weight| at inputs s with |t - s| < k (causal: the last k positions,
    t's own included), averaged over the rows t that hold any weight."""
    A = M.abs()                                                             # (R, S)
    t, s = torch.arange(A.shape[0])[:, None], torch.arange(A.shape[1])
    total, near = A.sum(1), (A * ((t - s).abs() < k)).sum(1)
    return (near[total > 0] / total[total > 0]).mean().item()


def bench_weights(s):
    """--ckpt's mixing matrices in one PNG, a row of panels per layer; a near_mass row each."""
    assert s.ckpt, "weights draws a checkpoint's mixing matrices: pass --ckpt=CKPT"
    assert s.positions >= 0, f"--positions={s.positions}: draw 1 or more (0: up to 128)"
    model = model_from_checkpoint(load_checkpoint(s.ckpt))
    out, layers = s.out or os.path.join(os.path.dirname(s.ckpt), 'weights.png'), {}
    check_output_file(out, 'out', s.overwrite)
    for layer, panel, M in mixing_matrices(model):
        layers.setdefault(layer, []).append((panel, M))
    if not layers:
        raise ValueError(f"{s.ckpt} holds a {model.cfg.arch} model: its attention depends on the "
                         f"input, no matrix to draw (weights draws mixers, hybrids and gmlp)")
    n = min(s.positions or 128, model.cfg.n_ctx)
    rows, cols = len(layers), max(map(len, layers.values()))
    if cols == 1:  # a matrix a layer: the layers side by side
        rows, cols = 1, rows
    from matplotlib.figure import Figure  # no pyplot: no window, no backend to choose
    fig = Figure(figsize=(3.2 * cols + 1, 3 * rows + 0.4), layout='constrained')
    axes_rows = fig.subplots(rows, cols, squeeze=False).reshape(len(layers), -1)  # a row a layer
    for axes, (layer, panels) in zip(axes_rows, layers.items()):
        vmax = max(M[:n, :n].abs().max().item() for _, M in panels) or 1.0  # one scale a layer
        for ax, (panel, M) in zip(axes, panels):
            im = ax.imshow(M[:n, :n].numpy(), cmap='RdBu_r', vmin=-vmax, vmax=vmax)
            ax.set_title(f"{layer} {panel}", fontsize=8)
            ax.set(xlabel='input position', ylabel='output position')
        fig.colorbar(im, ax=axes.tolist(), shrink=0.8)
    fig.suptitle(f"{s.ckpt}: tril(W) as the model uses it, first {n} positions", fontsize=10)
    write_atomic(out, lambda f: fig.savefig(f, format=Path(out).suffix[1:] or 'png', dpi=80))
    print(f"wrote {out}\nwithin_k: the fraction of each row's |weight| at inputs s with |t - s| < k"
          f" (causal: the last k positions, t's own included), averaged over the rows t")
    for layer, panels in layers.items():
        for panel, M in panels:
            yield dict(mode=s.mode, arch=model.cfg.arch, layer=layer, matrix=panel,
                       **{f"within_{k}": near_mass(M, k) for k in (1, 8, 64)})


# ----------------------------------------------------------------------------- tables

def fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return 'OOM' if v is None else str(v)  # None: a cell that ran out of memory


def markdown(rows, cols, head=True):
    lines = ['| ' + ' | '.join(cols) + ' |', '|' + '---|' * len(cols)] if head else []
    return '\n'.join(lines + ['| ' + ' | '.join(fmt(r[c]) for c in cols) + ' |' for r in rows])


MEASURE = {'throughput': bench_throughput, 'memory': bench_memory, 'generate': bench_generate,
           'represent': bench_represent, 'weights': bench_weights}
BENCH_CHOICES = dict(mode=(*MEASURE, 'race'), dtype=CHOICES['dtype'])


def run(argv):
    """The rows of argv's mode, each printed as a table row and written to --json as measured."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ['race']:  # its own keys: train.py's, per arch (see race)
        return race(argv)
    s = settings(argv)
    if s.json:
        check_output_file(s.json, 'json', s.overwrite)
        write_atomic(s.json, '[]')  # replaced now: an interrupt leaves no earlier run's rows
    rows = []
    for r in MEASURE[s.mode](s):
        print(markdown([r], list(r)[1:], head=not rows), flush=True)  # every key but the mode
        rows.append(r)
        if s.json:  # every row as soon as it is measured: an interrupt keeps them
            write_atomic(s.json, json.dumps(rows, indent=1))
    return rows


# ----------------------------------------------------------------------------- race

RACE_DEFAULTS = dict(
    mode='race',
    archs='mixer,llama',    # comma list of model archs
    max_time=420.0,         # seconds of training per arch, evaluation excluded
    eval_seconds=0.0,       # evaluate every this many seconds of training (0: max_time / 8)
    out_dir='out/race',
    presets='',             # comma list of train.py presets, one per arch in --archs order
    overwrite=False,        # replace the race already in out_dir
)
RACE_TRAIN = dict(d_model=256, n_layers=4, n_ctx=256, batch_size=16, warmup_iters=50, eval_iters=4,
                  log_interval=10, max_iters=0)
RACE_LR = {'mixer': 5e-3, 'gmlp': 5e-3}  # else 1.5e-3 (config/codesearch_*.py's CPU-sized rates)


def race(argv):
    """python bench.py race: language models trained for the same wall-clock budget on your data, as
    a table, a JSON file and a picture of validation loss against training time (the paper's
    central comparison).

        python bench.py race [--archs=mixer,llama] [--KEY=VALUE ...] [--ARCH.KEY=VALUE ...]

    Each arch trains through train.py for --max_time seconds of training (no step budget, a
    preset's dropped), evaluation excluded: on a CPU all at once, one thread each, so that they
    share the machine's load; on a GPU one after another. All evaluate every --eval_seconds of
    training on the same validation batches: data_dir, n_ctx, batch_size, eval_iters, seed,
    batch_mode, padding and objective must agree.

    A run's train.py keys, later ones winning: the race's (d_model 256, 4 layers, n_ctx 256, batch
    16, 4 evaluation batches: about 10 minutes on 2 CPU cores; lr 5e-3 for mixers, 1.5e-3 for
    others); its preset (--presets, one per arch, in --archs order); any train.py key, for every
    arch (--data_dir=DIR, --device=cuda); one arch's own (--mixer.d_model=512).

    out_dir holds ARCH/ (train.py's run, its ckpt.pt ready for retrieve.py train --init_from),
    ARCH.out (its console), race.md, race.json (settings, curves, table) and race.png. Ctrl-C (or
    a kill) stops every run (its checkpoint whole), still writes what was measured, exits 130; a run
    that fails (diverged, say: see ARCH.out) keeps its evaluations, and the race exits 1.

    --n_ctx=64,256,1024 (the paper's fig 4) runs a race per n_ctx, one after another, in
    out_dir/ctxN, with batch_size x n_ctx held at the first race's (or --batch_size=64,16,4, one
    per n_ctx), then draws out_dir/context.png (best val loss against n_ctx, a line per arch) and
    writes out_dir/context.md (per race: steps and best val loss per arch, the differences)."""
    cells = race_cells(argv)
    if len(cells) == 1:
        rows, code = race_cell(cells[0])
        return code or rows
    s, rows, folder = cells[0], [], os.path.dirname(cells[0].out_dir)
    if os.path.exists(os.path.join(folder, 'context.md')) and not s.overwrite:
        raise ValueError(f"{folder} holds an earlier sweep: pass --overwrite, or a new --out_dir")
    per = s.max_time * (1 if s.dev.type == 'cpu' else len(s.archs))  # race_runs: CPU at once
    print(f"context sweep: n_ctx {', '.join(str(c.n_ctx) for c in cells)}, {per:g} s of training "
          f"each, {len(cells) * per / 60:.1f} min in all (evaluation and start-up excluded)")
    worst = 0  # the exit status: 130 interrupted, 1 a run failed
    for c in cells:
        table, code = race_cell(c)
        worst = max(worst, code)
        got = {r['arch']: r for r in table}
        best = [got[a]['best_val'] if a in got else float('nan') for a in c.archs]  # nan: no eval
        rows.append({'n_ctx': c.n_ctx, 'batch_size': c.batch_size,  # differences > 0: first ahead
                     **{f"{a}_steps": got[a]['steps'] if a in got else 0 for a in c.archs},
                     **{f"{a}_best_val": v for a, v in zip(c.archs, best)},
                     **{f"{a}-{c.archs[0]}": v - best[0] for a, v in zip(c.archs[1:], best[1:])}})
        if code == 130:
            break
    table = markdown(rows, list(rows[0]))
    print(f"\n{table}\n", flush=True)
    write_atomic(os.path.join(folder, 'context.md'), table + '\n')
    s.interrupted = worst == 130  # the last race drawn stopped short
    n_ctxs = [r['n_ctx'] for r in rows]
    with race_png(s, Path(folder, 'context.png'), 1) as (ax,):
        for a in s.archs:
            ax.plot(n_ctxs, [r[f"{a}_best_val"] for r in rows], marker='o', label=a)
        ax.set_xscale('log', base=2)
        ax.set_xticks(n_ctxs, [str(n) for n in n_ctxs])
        ax.set(xlabel="n_ctx (each one's batch_size: context.md)", ylabel='best validation loss')
    print(f"wrote {folder}/context.md, context.png", flush=True)
    return worst or rows


def race_cells(argv):
    """Each race's settings, checked before any run: argv's, or one per n_ctx of an --n_ctx list."""
    lists, rest = {}, argv[:1]
    for prev, arg in zip(argv, argv[1:]):  # argv[0] is 'race'; each flag is routed by its key
        if not arg.startswith('--'):
            join = f": write {prev}={arg}" if prev.startswith('--') and '=' not in prev else ''
            raise ValueError(f"race reads --KEY=VALUE flags, and {arg!r} stands alone{join} "
                             f"(presets: --presets=A,B)")
        key, _, value = arg.partition('=')
        if key in ('--n_ctx', '--batch_size') and ',' in value:
            lists[key[2:]] = int_list(value, key[2:])
        else:
            rest.append(arg)
    n_ctxs, batches = lists.get('n_ctx', []), lists.get('batch_size', [])
    assert len(batches) in (0, len(n_ctxs)), "--batch_size: a list needs an --n_ctx list as long"
    assert len(set(n_ctxs)) == len(n_ctxs), "--n_ctx: a list names each length once"
    cells = [] if n_ctxs else [race_settings(argv)]
    for i, n in enumerate(n_ctxs):
        batch = [f"--batch_size={b}" for b in batches[i:i + 1]]
        cells.append(race_settings([*rest, f"--n_ctx={n}", *batch], f"ctx{n}"))
        if not batches:  # the first race's tokens per step, held
            tokens = cells[0].batch_size * n
            bad = [m for m in n_ctxs if tokens % m]
            assert not bad, (f"--n_ctx={bad[0]} does not divide the first race's {tokens} tokens "
                             f"per step: pass --batch_size=B1,B2,... (one per n_ctx)")
            batches = [tokens // m for m in n_ctxs]
    return cells


def race_cell(s):
    """One race of s (race_settings), written to its out_dir: (its table's rows, exit status)."""
    print(f"race: {', '.join(s.archs)}, {s.max_time:g} s of training each, evaluated every "
          f"{s.eval_seconds:g} s; {s.dev} {s.dtype} ({s.why}); runs in {s.out_dir}", flush=True)
    curves, status, s.interrupted = race_runs(s)
    rows = race_table(curves)
    table = markdown(rows, list(rows[0])) if rows else 'no evaluations'
    print(f"\n{table}\n", flush=True)
    write_atomic(os.path.join(s.out_dir, 'race.md'), table + '\n')
    result = dict(settings=dict(archs=s.archs, max_time=s.max_time, eval_seconds=s.eval_seconds,
                                device=str(s.dev), dtype=s.dtype, machine=s.machine, runs=s.runs,
                                status=status, interrupted=s.interrupted),
                  table=rows, curves=curves)
    write_atomic(os.path.join(s.out_dir, 'race.json'), json.dumps(result, indent=1))
    with race_png(s, Path(s.out_dir, 'race.png'), 2) as (by_time, by_tokens):
        for arch, c in curves.items():
            loss = [r['val_loss'] for r in c]
            by_time.plot([r['time'] for r in c], loss, marker='.', label=arch)
            by_tokens.plot([r['tokens_seen'] / 1e6 for r in c], loss, marker='.', label=arch)
        by_time.set(xlabel='seconds of training (evaluation excluded)', ylabel='validation loss')
        by_tokens.set(xlabel='tokens seen (millions)', ylabel='validation loss')
    print(f"wrote {s.out_dir}/race.md, race.json, race.png", flush=True)
    if s.interrupted:
        print("interrupted: every run stopped; race.md, race.json and race.png hold what was "
              "measured, each run's folder its last checkpoint (if it saved one)", file=sys.stderr)
    return rows, 130 if s.interrupted else int(any(status.values()))


def race_settings(argv, cell=''):
    """The race's settings, each arch's train.py arguments in s.runs (--KEY=VALUE: every arch's,
    --ARCH.KEY=VALUE: one's); bad input fails here, before any run. cell: its folder in out_dir."""
    own, shared, per_arch = [], [], {}
    for arg in argv:
        key, eq, value = arg[2:].partition('=') if arg.startswith('--') else ('', '', '')
        arch, dot, rest = key.replace('-', '_').partition('.')
        if dot:
            per_arch.setdefault(arch, []).append(f"--{rest}{eq}{value}")
        elif arch in TRAIN_DEFAULTS and arch not in RACE_DEFAULTS:
            shared.append(arg)
        else:
            own.append(arg)
    doc = inspect.cleandoc(race.__doc__)
    s = SimpleNamespace(**parse_args(own, RACE_DEFAULTS, doc, positional='mode'))
    s.out_dir = os.path.join(s.out_dir, cell) if cell else s.out_dir
    s.archs = s.archs.split(',')
    for arch in set(s.archs) - set(ARCHS):
        raise ValueError(f"--archs: {arch!r} is unknown: use one of {', '.join(ARCHS)}")
    assert len(set(s.archs)) == len(s.archs), f"--archs={','.join(s.archs)} names an arch twice"
    for arch in set(per_arch) - set(s.archs):
        raise ValueError(f"--{arch}.KEY: {arch} is not in --archs={','.join(s.archs)}")
    assert s.max_time > 0, f"--max_time={s.max_time:g}: give every arch a budget of seconds > 0"
    presets = s.presets.split(',') if s.presets else []
    assert len(presets) in (0, len(s.archs)), "--presets: one per arch, in --archs order"
    s.eval_seconds = s.eval_seconds or s.max_time / 8
    s.runs, cfgs = {}, {}
    for i, arch in enumerate(s.archs):
        preset = read_preset(presets[i], dict(TRAIN_DEFAULTS)) if presets else {}
        base = {k: v for k, v in dict(RACE_TRAIN, arch=arch, lr=RACE_LR.get(arch, 1.5e-3)).items()
                if k not in preset}  # the preset's own values win over the race's
        forced = dict(out_dir=os.path.join(s.out_dir, arch), max_time=s.max_time, max_iters=0,
                      eval_seconds=s.eval_seconds, overwrite=True)  # out_dir checked below
        mine = presets[i:i + 1] + shared + per_arch.get(arch, [])
        clash = [f for f in mine[len(presets[i:i + 1]):]
                 if f[2:].partition('=')[0].replace('-', '_') in forced]
        assert not clash, f"{clash[0]}: the race sets it for every run (--max_time: the budget)"
        s.runs[arch] = flags(base) + mine + flags(forced)
        cfgs[arch] = parse_args(s.runs[arch], TRAIN_DEFAULTS, doc, CHOICES)
        assert cfgs[arch]['arch'] == arch, (f"{arch}: its preset sets arch={cfgs[arch]['arch']}: "
                                            f"list --presets in --archs order, one per arch")
        ModelConfig(**{k: cfgs[arch][k] for k in MODEL_KEYS})  # bad shapes and loop keys fail
        check_loop(cfgs[arch])                                   # here, not in the runs
        for key in EVAL_KEYS:  # (retrieve.py's keys among them: None in every arch's)
            assert cfgs[arch].get(key) == cfgs[s.archs[0]].get(key), \
                f"{arch} would evaluate on other batches ({key}): set --{key} for all archs"
    first = cfgs[s.archs[0]]
    s.n_ctx, s.batch_size = first['n_ctx'], first['batch_size']
    load_meta(first['data_dir'])  # prepared data, or the one-line error naming prepare.py
    s.dev = resolve_device(first['device'])
    dtype, s.why = choose_dtype(s.dev, first['dtype'])
    s.dtype = str(dtype)[6:]
    cpu = torch.backends.cpu.get_cpu_capability()  # the vector instructions torch's kernels use
    s.machine = torch.cuda.get_device_name(s.dev) if s.dev.type == 'cuda' else \
        f"{platform.processor() or platform.machine()} ({cpu}, {os.cpu_count()} cores)"
    for arch in s.archs:
        check_run_dir(Path(s.out_dir, arch), fresh=True, overwrite=s.overwrite, resumable=False)
    if os.path.exists(os.path.join(s.out_dir, 'race.json')) and not s.overwrite:
        raise ValueError(f"{s.out_dir} holds an earlier race: pass --overwrite, or a new --out_dir")
    if importlib.util.find_spec('matplotlib') is None:  # race.png's, checked before any run
        raise ValueError("the race draws race.png with matplotlib: pip install matplotlib")
    return s


def race_runs(s):
    """Every arch's train.py (as the race's help says), each evaluation printed as it lands in its
    log: ({arch: evaluations}, {arch: exit status}, interrupted?)."""
    cpu = s.dev.type == 'cpu'
    env = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1') if cpu else os.environ
    curves, status, running, interrupted = {a: [] for a in s.archs}, {}, {}, False

    def read(arch):  # the run's new evaluations, a progress line each
        log = Path(s.out_dir, arch, 'log.jsonl')
        lines = log.read_text().splitlines(keepends=True) if log.exists() else []
        evals = [json.loads(ln) for ln in lines if ln.endswith('\n') and 'val_loss' in ln]
        for r in evals[len(curves[arch]):]:
            curves[arch].append(r)
            print(f"  {arch:<8} {r['time']:7.1f} s  step {r['step']:>6}  "
                  f"{r['tokens_seen'] / 1e6:7.3f}M tokens  val loss {r['val_loss']:.4f}",
                  flush=True)

    def ended(arch, p):  # its log read after the exit: nothing is missed
        read(arch)
        status[arch] = p.returncode
        if p.returncode:
            print(f"  {arch} stopped (exit {p.returncode}): see {s.out_dir}/{arch}.out")

    # a kill (SIGTERM) stops the race as Ctrl-C does, and so the runs, in sessions of their own
    kill = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        for wave in [s.archs] if cpu else [[a] for a in s.archs]:
            for arch in wave:
                Path(s.out_dir, arch, 'log.jsonl').unlink(missing_ok=True)  # not this race's log
                with open(os.path.join(s.out_dir, f"{arch}.out"), 'w') as console:
                    # a session of its own: a terminal's Ctrl-C reaches the race, which stops it
                    running[arch] = subprocess.Popen(
                        [sys.executable, Path(__file__).with_name('train.py'), *s.runs[arch]],
                        stdout=console, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            while running:
                time.sleep(0.5)
                for arch, p in list(running.items()):
                    read(arch)
                    if p.poll() is not None:
                        ended(arch, running.pop(arch))
    except KeyboardInterrupt:
        interrupted = True
    finally:  # whatever stopped the race stops the runs left: SIGINT to each one's process group
        signal.signal(signal.SIGTERM, kill)
        for p in running.values():  # (it exits as after Ctrl-C, its checkpoint whole)
            with contextlib.suppress(ProcessLookupError):  # its group is gone: it ended meanwhile
                os.killpg(p.pid, signal.SIGINT)
        deadline = time.time() + 30
        for arch, p in running.items():
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:  # still there after 30 s: SIGKILL, to its group too
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            ended(arch, p)  # what it logged last
    return curves, status, interrupted


def race_table(curves):
    """A row per arch evaluated; s_to_X_best: its training seconds to X's best, or never."""
    rows, best = [], {a: min(r['val_loss'] for r in c) for a, c in curves.items() if c}
    for arch in best:
        last = curves[arch][-1]
        r = dict(arch=arch, steps=last['step'], tokens=last['tokens_seen'], train_s=last['time'],
                 tokens_per_s=last['tokens_seen'] / last['time'] if last['time'] else 0.0,
                 best_val=best[arch], final_val=last['val_loss'])
        for other in best:
            hit = [e['time'] for e in curves[arch] if e['val_loss'] <= best[other]]
            r[f"s_to_{other}_best"] = hit[0] if hit else 'never'
        rows.append(r)
    return rows


@contextlib.contextmanager
def race_png(s, path, panels):
    """`panels` axes side by side to draw on; then grids, legends and the race's title, to path."""
    from matplotlib.figure import Figure  # no pyplot: no window, no backend to choose
    fig = Figure(figsize=(4 + 3.5 * panels, 4.2), layout='tight')
    axes = fig.subplots(1, panels, squeeze=False)[0]
    yield axes
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    how = 'at once, 1 thread each' if s.dev.type == 'cpu' else 'one after another'
    stopped = '; interrupted: the last runs trained less' if s.interrupted else ''
    fig.suptitle(f"{s.machine}, {s.dtype}: {s.max_time:g} s of training per model ({how}){stopped}",
                 fontsize=10)
    write_atomic(path, lambda f: fig.savefig(f, format='png', dpi=80))


def main(argv=None):
    """The measured rows (a list, for tests and notebooks), or run_main's exit status."""
    return run_main(lambda: run(argv), "interrupted: the rows printed (and --json's) are whole")


if __name__ == '__main__':
    status = main()
    sys.exit(0 if isinstance(status, list) else status)