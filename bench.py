"""
bench.py: the paper's measurements, re-run on your own hardware in one command.

    python bench.py MODE [--key=value ...] [--json=FILE] [--plot=FILE.png]

MODE is one of
  throughput  full training steps (forward, backward, AdamW): ms/step, tokens/s and MFU
  memory      peak memory of one forward + backward, no lm head (paper Tables S9/S10: --batch_size=16
              --n_heads=32 are its settings; the defaults, batch 1 and 4 heads, fit a small CPU)
  generate    decoding tokens/s: the paper's fixed-window generation vs cached decoding, at batch 1
              and 16, beside the memory-bandwidth ceiling (tokens/s if every step only streamed its bytes)
  represent   input recovery from a layer's activations by gradient descent (paper §3.1-3.3)
  retrieval   InfoNCE training steps on prepared pairs: full left-padded windows vs trimmed padding
  all         every mode but retrieval at its default sizes, printed as markdown tables

--archs, --n_ctx and --n_layers take comma lists and every mode runs their product.
--full swaps the small defaults (sized for `all` in minutes on 2 CPU cores) for the paper's grid.
Models are untrained unless represent gets --ckpt; inputs are random tokens unless --data_dir.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from model import Backbone, Context, ModelConfig, build_model, decode_bytes, flops_per_token, measure_peak_flops
from prepare import check_output_file
from train import CHOICES, autocast, choose_dtype, resolve_device

MODES = ('throughput', 'memory', 'generate', 'represent', 'retrieval', 'all')

# Per-mode defaults; --full replaces them with the paper's (or the headline) settings.
DEFAULTS = {
    'throughput': dict(archs='mixer,llama,gpt', d_model=256, n_layers='4', n_ctx='128,256,512', batch_size=4),
    'memory': dict(archs='mixer,llama', d_model=1024, n_layers='4,8', n_ctx='512,1024,2048', batch_size=1),
    'generate': dict(archs='mixer,llama,gpt', d_model=256, n_layers='4', n_ctx='256', batch_size='1,16',
                     prompt=128, new_tokens=64),
    'represent': dict(archs='mixer,llama', d_model=256, n_layers='4', n_ctx='32', batch_size=2),
    'retrieval': dict(archs='mixer,llama', d_model=256, n_layers='4', n_ctx='256', batch_size=32),
}
FULL = {
    'throughput': dict(d_model=512, n_layers='8', n_ctx='128,256,512,1024'),
    'memory': dict(n_layers='4,8,16', n_ctx='512,1024,2048,4096,8192'),
    'generate': dict(n_layers='8', n_ctx='512', prompt=256, new_tokens=256),
    'represent': dict(d_model=512, n_layers='8'),
    'retrieval': dict(n_layers='8', n_ctx='256,512'),
}


def fail(msg):
    """Bad input, as in every script: a ValueError that main() prints as one `error: ...` line, exit status 2."""
    raise ValueError(msg)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = fail
    p.add_argument('mode', metavar='MODE', choices=MODES + ('memory_cell',), help=' | '.join(MODES))
    p.add_argument('--archs', help="comma list of model archs (default per mode)")
    p.add_argument('--d_model', type=int)
    p.add_argument('--n_layers', help="comma list")
    p.add_argument('--n_ctx', help="comma list")
    p.add_argument('--batch_size', help="rows per step; a comma list in generate (default 1,16)")
    p.add_argument('--n_heads', type=int, default=0,
                   help="attention heads of llama/gpt/hybrid/elita (default 0: ModelConfig's, 4); mixers keep one")
    p.add_argument('--vocab_size', type=int, default=4096, help="the paper's TinyStories tokenizer size")
    p.add_argument('--full', action='store_true', help="the paper's sizes (slow on a CPU)")
    p.add_argument('--device', default='auto', help="auto (cuda if present), cpu or cuda[:i]")
    p.add_argument('--dtype', default='auto', choices=CHOICES['dtype'],
                   help="autocast dtype (auto: bf16 on CUDA and on CPUs with native bf16, else float32); "
                        "generate casts the weights to it instead; represent always runs in float32")
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--json', help="write every row to this JSON file")
    p.add_argument('--plot', help="draw throughput/memory/generation vs n_ctx to this .png (needs matplotlib)")
    g = p.add_argument_group('throughput')
    g.add_argument('--warmup', type=int, default=2, help="untimed steps before the timed ones")
    g.add_argument('--repeats', type=int, default=5, help="timed steps; the median is reported")
    g.add_argument('--compile', action='store_true',
                   help="torch.compile the model first (generate: the cached decoding step, warm-up reported)")
    g = p.add_argument_group('memory')
    g.add_argument('--mem_limit', type=int, default=12288,
                   help="MB a cell may use before it counts as OOM (default: the paper's 12 GB RTX 3060; 0 = none)")
    g = p.add_argument_group('generate')
    g.add_argument('--prompt', type=int, help="prompt length in tokens")
    g.add_argument('--new_tokens', type=int)
    g.add_argument('--methods', default='window,cache', help="comma list of window and/or cache")
    g = p.add_argument_group('represent')
    g.add_argument('--ckpt', help="a train.py checkpoint to probe (default: an untrained model per arch)")
    g.add_argument('--data_dir', help="take inputs from this data dir's val.bin (default: random tokens); "
                   "retrieval: its pairs_train.jsonl (default data/pystdlib)")
    g.add_argument('--layer', help="comma list of layers l whose output O_l is inverted (default: the last)")
    g.add_argument('--steps', type=int, default=500, help="gradient descent steps N")
    g.add_argument('--lr', type=float, default=0.05, help="initial step size; decays linearly to lr/10")
    g.add_argument('--arch', help=argparse.SUPPRESS)  # memory_cell: the one cell to run
    args = p.parse_args(argv)
    for key, low in dict(d_model=1, vocab_size=2, warmup=0, repeats=1, mem_limit=0, prompt=1,
                         new_tokens=1, steps=1).items():
        if getattr(args, key) is not None and getattr(args, key) < low:
            fail(f"--{key}={getattr(args, key)} is out of range: use a value >= {low}")
    if not 0 < args.lr < float('inf'):
        fail(f"--lr={args.lr} must be a finite number > 0")
    for key in ('json', 'plot'):  # before the benchmark, not after it
        if getattr(args, key):
            check_output_file(getattr(args, key), key)
    return args


def settings(args, mode):
    """args with the mode's defaults filled in (explicit flags win) and comma lists split."""
    s = dict(vars(args), mode=mode)
    for k, v in dict(DEFAULTS[mode], **(FULL[mode] if args.full else {})).items():
        s[k] = v if s[k] is None else s[k]
    s['archs'] = s['archs'].split(',')
    for key in ('n_layers', 'n_ctx', 'batch_size'):
        try:
            s[key] = [int(v) for v in str(s[key]).split(',')]
        except ValueError:
            fail(f"--{key}={s[key]} must be a comma list of integers, e.g. --{key}=256,512")
        if min(s[key]) < 1:
            fail(f"--{key}={','.join(map(str, s[key]))} is out of range: use values >= 1")
    if mode != 'generate':
        if len(s['batch_size']) != 1:
            fail(f"--batch_size takes one integer in {mode}; a comma list only in generate")
        s['batch_size'] = s['batch_size'][0]
    try:
        s['dev'] = resolve_device(s['device'])
        s['torch_dtype'], why = choose_dtype(s['dev'], s['dtype'])
    except ValueError as e:
        fail(str(e))
    s['device'], s['dtype'] = str(s['dev']), str(s['torch_dtype'])[6:]  # what runs (memory cells inherit it)
    if args.mode != 'memory_cell':
        print(f"{mode}: {s['device']} {s['dtype']} ({why})", file=sys.stderr)
    return argparse.Namespace(**s)


def grid(s):
    """Every (arch, n_layers, n_ctx) the mode should measure, as ModelConfigs."""
    for arch in s.archs:
        for n_layers in s.n_layers:
            for n_ctx in s.n_ctx:
                try:
                    yield ModelConfig(arch=arch, vocab_size=s.vocab_size, n_ctx=n_ctx, d_model=s.d_model,
                                      n_layers=n_layers, n_heads=attention_heads(s, arch))
                except ValueError as e:
                    fail(str(e))


def attention_heads(s, arch):
    """--n_heads is the attention head count; a mixer's n_heads means mixing heads, left at one."""
    return 0 if arch in ('mixer', 'gmlp') else s.n_heads


def sync(dev):
    if dev.type == 'cuda':
        torch.cuda.synchronize()


def random_tokens(cfg, batch, length, gen):
    return torch.randint(cfg.vocab_size, (batch, length), generator=gen)


# ----------------------------------------------------------------------------- throughput

def training_step_times(model, opt, x, y, s):
    """Seconds per full training step (forward with targets, backward, AdamW), timed steps only."""
    times = []
    for i in range(s.warmup + s.repeats):
        sync(s.dev)
        t0 = time.perf_counter()
        with autocast(s.dev, s.torch_dtype):
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(s.dev)
        if i >= s.warmup:
            times.append(time.perf_counter() - t0)
    return times


def bench_throughput(s):
    from train import configure_optimizer
    peak = measure_peak_flops(s.dev, s.torch_dtype)
    print(f"peak: {peak / 1e9:.0f} GFLOP/s (best {s.dtype} square matmul on {s.device})")
    rows, gen = [], torch.Generator().manual_seed(s.seed)
    for cfg in grid(s):
        torch.manual_seed(s.seed)
        model = build_model(cfg).to(s.dev).train()
        opt = configure_optimizer(model, 1e-4, 0.01, s.dev.type)
        step = torch.compile(model) if s.compile else model
        xy = random_tokens(cfg, s.batch_size, cfg.n_ctx + 1, gen).to(s.dev)
        sec = statistics.median(training_step_times(step, opt, xy[:, :-1], xy[:, 1:], s))
        tps = s.batch_size * cfg.n_ctx / sec
        rows.append(dict(mode='throughput', arch=cfg.arch, d_model=cfg.d_model, n_layers=cfg.n_layers,
                         n_ctx=cfg.n_ctx, batch_size=s.batch_size, dtype=s.dtype, ms_per_step=1e3 * sec,
                         tokens_per_s=tps, mfu=flops_per_token(cfg) * tps / peak, peak_flops=peak))
        print(f"  {cfg.arch} n_ctx={cfg.n_ctx}: {1e3 * sec:.0f} ms/step, {tps:.0f} tokens/s", flush=True)
    return rows


# ----------------------------------------------------------------------------- memory

def proc_status(key):
    """A /proc/self/status entry in bytes: VmHWM is this process's peak resident set (unlike
    ru_maxrss it starts afresh at exec, so a child does not inherit its parent's peak), VmSize
    what it has mapped."""
    try:
        with open('/proc/self/status') as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ':'))
    except (OSError, StopIteration):
        fail("CPU memory cells read /proc/self/status (Linux): run memory on Linux or on CUDA")


def limit_memory(s):
    """Make allocations past --mem_limit fail: CUDA by a memory fraction, CPU by capping the
    address space at what this process maps now plus the limit."""
    if not s.mem_limit:
        return
    if s.dev.type == 'cuda':
        total = torch.cuda.get_device_properties(s.dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, s.mem_limit * 2**20 / total), s.dev)
    else:
        limit = proc_status('VmSize') + s.mem_limit * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))


def memory_cell(args):
    """Subprocess body: one forward + backward of a backbone (no lm head); prints peak bytes as JSON.
    --arch=none builds nothing and gives the interpreter + torch baseline."""
    s = settings(args, 'memory')
    torch.ones(64, 64) @ torch.ones(64, 64)   # start the thread pool, as every cell does
    limit_memory(s)
    peak = 0
    try:
        if args.arch != 'none':
            cfg = ModelConfig(arch=args.arch, vocab_size=s.vocab_size, n_ctx=s.n_ctx[0], d_model=s.d_model,
                              n_layers=s.n_layers[0], n_heads=attention_heads(s, args.arch))
            backbone = Backbone(cfg).to(s.dev)
            idx = torch.randint(cfg.vocab_size, (s.batch_size, cfg.n_ctx), device=s.dev)
            with autocast(s.dev, s.torch_dtype):
                h = backbone(idx, Context())                            # (B, n_ctx, d_model)
            h.float().sum().backward()
            sync(s.dev)
        peak = torch.cuda.max_memory_allocated(s.dev) if s.dev.type == 'cuda' else proc_status('VmHWM')
    except (RuntimeError, MemoryError) as e:  # torch reports failed allocations as RuntimeError
        if 'memory' not in str(e).lower() and not isinstance(e, MemoryError):
            raise
        peak = None
    print(json.dumps({'peak_bytes': peak}))


def run_cell(s, arch, n_layers, n_ctx):
    """Peak bytes of one memory cell run in a fresh interpreter, or None if it ran out of memory."""
    cmd = [sys.executable, os.path.abspath(__file__), 'memory_cell', f'--arch={arch}', f'--n_layers={n_layers}',
           f'--n_ctx={n_ctx}', f'--d_model={s.d_model}', f'--batch_size={s.batch_size}', f'--n_heads={s.n_heads}',
           f'--vocab_size={s.vocab_size}', f'--device={s.device}', f'--dtype={s.dtype}',
           f'--mem_limit={s.mem_limit}']
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode < 0:  # killed by a signal: the kernel's OOM killer, or an abort in an allocator
        return None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ['no output'])[-1]
        fail(f"memory cell {arch} n_layers={n_layers} n_ctx={n_ctx} failed: {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])['peak_bytes']


def bench_memory(s):
    base = 0 if s.dev.type == 'cuda' else run_cell(s, 'none', 1, 1)
    rows = []
    for cfg in grid(s):
        peak = run_cell(s, cfg.arch, cfg.n_layers, cfg.n_ctx)
        mb = None if peak is None else (peak - base) / 2**20
        rows.append(dict(mode='memory', arch=cfg.arch, d_model=cfg.d_model, n_layers=cfg.n_layers,
                         n_ctx=cfg.n_ctx, n_heads=cfg.n_heads, batch_size=s.batch_size, dtype=s.dtype,
                         device=s.device, mb=mb))
        print(f"  {cfg.arch} n_layers={cfg.n_layers} n_ctx={cfg.n_ctx}: "
              + ('OOM' if mb is None else f"{mb:.0f} MB"), flush=True)
    return rows


# ----------------------------------------------------------------------------- generate

def time_decoding(model, prompt, new_tokens, method, s):
    """(prefill seconds to the first token, seconds per later token) of greedy generation."""
    stamps = []
    sync(s.dev)
    t0 = time.perf_counter()
    for _ in model.stream(prompt, new_tokens, temperature=0, method=method, compile=s.compile):
        sync(s.dev)
        stamps.append(time.perf_counter())
    return stamps[0] - t0, (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)


def measure_read_bandwidth(device, mib=64, budget=0.5):
    """Bytes/s of a streaming read: sums of a mib-MiB fp32 buffer (larger than the 32 MB L3 of
    the CPU this was written on) with torch's threads, for `budget` seconds after one warm-up.
    Bytes over wall time, as decoding tokens/s is: on a shared machine both see the same load."""
    a = torch.ones(mib * 2**20 // 4, device=device)
    a.sum()
    sync(device)
    n, t0 = 0, time.perf_counter()
    while n < 2 or time.perf_counter() < t0 + budget:
        a.sum()
        sync(device)
        n += 1
    return n * a.numel() * 4 / (time.perf_counter() - t0)


def bench_generate(s):
    """Greedy decoding tokens/s per arch, method and batch size, each next to a bandwidth read
    taken just before it: ceiling = batch x bandwidth / bytes a step reads (model.decode_bytes,
    averaged over the decoded positions). The weights are cast to the dtype, not autocast: a
    step is bound by reading them. window runs at the first batch size only (it is compute-bound:
    a batch of B costs B full forwards). --compile compiles the cached step; the warm-up, which then
    holds the compile, is timed apart (warmup_s) and never counted in tokens/s."""
    methods = s.methods.split(',')
    if set(methods) - {'window', 'cache'}:
        fail(f"--methods={s.methods}: use window, cache or window,cache")
    rows, gen = [], torch.Generator().manual_seed(s.seed)
    for cfg in grid(s):
        if s.prompt + s.new_tokens > cfg.n_ctx:
            fail(f"--prompt={s.prompt} plus --new_tokens={s.new_tokens} exceeds n_ctx={cfg.n_ctx}: "
                 f"shorten them or raise --n_ctx")
        torch.manual_seed(s.seed)
        model = build_model(cfg).to(s.dev, s.torch_dtype).eval()
        if s.compile:  # each model's step is one more graph of decode_step: stay under the recompile limit
            torch._dynamo.reset()
        for batch in s.batch_size:
            prompt = random_tokens(cfg, batch, s.prompt, gen).to(s.dev)
            for method in methods if batch == s.batch_size[0] else [m for m in methods if m == 'cache']:
                t0 = time.perf_counter()
                time_decoding(model, prompt, 2, method, s)  # warm-up (with --compile: the compile)
                warmup = time.perf_counter() - t0
                bandwidth = measure_read_bandwidth(s.dev)
                prefill, per_token = time_decoding(model, prompt, s.new_tokens, method, s)
                positions = range(s.prompt, s.prompt + s.new_tokens - 1)  # those of the timed steps
                step_bytes = statistics.mean(decode_bytes(model, p, batch, method == 'cache') for p in positions)
                tps, ceiling = batch / per_token, batch * bandwidth / step_bytes
                rows.append(dict(mode='generate', arch=cfg.arch, method=method, d_model=cfg.d_model,
                                 n_layers=cfg.n_layers, n_ctx=cfg.n_ctx, prompt=s.prompt, new_tokens=s.new_tokens,
                                 batch_size=batch, dtype=s.dtype, compile=s.compile and method == 'cache',
                                 warmup_s=warmup, prefill_ms=1e3 * prefill, tokens_per_s=tps,
                                 mb_per_step=step_bytes / 1e6, gb_per_s=bandwidth / 1e9,
                                 ceiling_tokens_per_s=ceiling, fraction=tps / ceiling))
                print(f"  {cfg.arch} {method} batch {batch} (warm-up {warmup:.1f} s): {tps:.1f} tokens/s, "
                      f"ceiling {ceiling:.0f} ({step_bytes / 1e6:.1f} MB/step at {bandwidth / 1e9:.1f} GB/s): "
                      f"{tps / ceiling:.0%}", flush=True)
    return rows


# ----------------------------------------------------------------------------- retrieval

def bench_retrieval(s):
    """InfoNCE steps (in-batch negatives: batch_size queries + their targets, forward, backward, AdamW)
    on the same real pairs, once with every text left-padded to n_ctx and once trimmed (TextEncoder's
    trim: pad states shared by mixers, pad columns dropped by llama)."""
    from prepare import Tokenizer
    from retrieve import PairBatches, TextEncoder, info_nce
    from train import configure_optimizer, load_meta
    data_dir = s.data_dir or 'data/pystdlib'
    try:
        tok = Tokenizer.from_meta(load_meta(data_dir), data_dir)
        pairs = PairBatches(dict(data_dir=data_dir, batch_size=s.batch_size, negatives='inbatch', seed=s.seed), tok, 0)
    except (ValueError, FileNotFoundError) as e:
        fail(f"retrieval needs prepared pairs ({e}): run python prepare.py or pass --data_dir")
    rows = []
    for cfg in grid(s):
        pairs.n_ctx = cfg.n_ctx
        batches = [pairs('train', i, 0) for i in range(s.warmup + s.repeats)]      # the same for both paddings
        real = float(np.mean([float(b[1].float().mean()) for b in batches]))       # fraction of real tokens
        for trim in (False, True):
            torch.manual_seed(s.seed)
            model = build_model(cfg).to(s.dev).train()
            enc, opt = TextEncoder(model, -1, trim), configure_optimizer(model, 1e-4, 0.0, s.dev.type)
            times = []
            for i, (idx, mask, labels) in enumerate(batches):
                idx, mask, labels = idx.to(s.dev), mask.to(s.dev), labels.to(s.dev)
                sync(s.dev)
                t0 = time.perf_counter()
                with autocast(s.dev, s.torch_dtype):
                    e = enc(idx, mask)                                     # (2B, d_model) queries, targets
                info_nce(e[:len(labels)], e[len(labels):], labels).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                sync(s.dev)
                if i >= s.warmup:
                    times.append(time.perf_counter() - t0)
            sec = statistics.median(times)
            rows.append(dict(mode='retrieval', arch=cfg.arch, d_model=cfg.d_model, n_layers=cfg.n_layers,
                             n_ctx=cfg.n_ctx, batch_size=s.batch_size, dtype=s.dtype, padding='trimmed' if enc.trim
                             else 'full', real_tokens=real, ms_per_step=1e3 * sec))
            print(f"  {cfg.arch} n_ctx={cfg.n_ctx} {rows[-1]['padding']}: {1e3 * sec:.0f} ms/step", flush=True)
    return rows


# ----------------------------------------------------------------------------- represent

def embedding_backbone(model):
    """The backbone whose token embeddings are inverted: a LanguageModel's, an Autoencoder's encoder."""
    for name in ('backbone', 'encoder'):
        if isinstance(getattr(model, name, None), Backbone):
            return getattr(model, name)
    raise ValueError(f"represent needs one token embedding feeding one backbone; {type(model).__name__} has "
                     f"not: probe a model of objective clm, mtp2, half or autoencoder")


def layer_output_fn(model, idx, layer):
    """O_l: token embeddings e (B, T, d) -> block l's output (B, T, d), by the model's own forward
    with the embedding lookup's result swapped for e (so positions, RoPE and masks apply as usual)."""
    backbone = embedding_backbone(model)
    if not 1 <= layer <= len(backbone.blocks):
        raise ValueError(f"--layer={layer} is out of range: the model has layers 1..{len(backbone.blocks)}")

    def O(e):
        out = {}
        hooks = [backbone.wte.register_forward_hook(lambda mod, inp, res: e),
                 backbone.blocks[layer - 1].register_forward_hook(lambda mod, inp, res: out.update(x=res))]
        try:
            backbone(idx, Context())
        finally:
            for h in hooks:
                h.remove()
        return out['x']
    return O


def l1_per_sequence(a, b):
    return (a - b).abs().flatten(1).sum(1)  # (B,)


def invert(O, e, steps, lr, gen):
    """Paper eq. 2: gradient descent on the L1 distance of O(e_n) to O(e), from e_0 ~ N(1/2, 1/20),
    step size decaying linearly from lr to lr/10. Returns e_N and its final per-sequence distance."""
    target = O(e).detach()
    e_n = (0.5 + torch.randn(e.shape, generator=gen).to(e.device) / 20).requires_grad_()
    for n in range(steps):
        loss = l1_per_sequence(O(e_n), target).sum()
        grad, = torch.autograd.grad(loss, e_n, allow_unused=True)  # None: O ignores its input
        with torch.no_grad():
            e_n -= lr * (1 - 0.9 * n / max(1, steps - 1)) * (0 if grad is None else grad)
    with torch.no_grad():
        return e_n.detach(), l1_per_sequence(O(e_n), target)


def tokens_from_embeddings(e, w_pinv):
    """Paper eq. 3: a_N = W^+ e_N, W the (d, vocab) embedding map (the transposed nn.Embedding
    table, so W^+ = pinv(table)^T); the argmax over vocab of a_N is each position's token."""
    return (e @ w_pinv).argmax(-1)  # (B, T, d) @ (d, vocab) -> (B, T)


def hamming(x, y, pad_id=None):
    """Paper eq. 6: fraction of the input's non-pad positions where the recovered token differs."""
    real = torch.ones_like(x, dtype=torch.bool) if pad_id is None else x != pad_id
    return ((x != y) & real).sum().item() / max(1, real.sum().item())


def represent_rows(model, idx, layers, steps, lr, pad_id=None, seed=0):
    """Invert each layer from all positions' activations ('all') and from the last position's only
    ('last', the non-self representation); each row has the Hamming distance, the final L1 loss
    and the paper's epsilon: the L1 shift that N(0, 1/20) noise on e causes (converged: loss <= eps)."""
    model = model.float().eval().requires_grad_(False)
    wte = embedding_backbone(model).wte.weight
    e, w_pinv = wte[idx], torch.linalg.pinv(wte)                     # (B, T, d), (d, vocab)
    rows = []
    for layer in layers:
        O_all = layer_output_fn(model, idx, layer)
        for which, O in (('all', O_all), ('last', lambda v: O_all(v)[:, -1:])):
            gen = torch.Generator().manual_seed(seed)
            e_n, loss = invert(O, e, steps, lr, gen)
            with torch.no_grad():
                eps = l1_per_sequence(O(e + torch.randn(e.shape, generator=gen).to(e.device) / 20), O(e))
            rows.append(dict(mode='represent', arch=model.cfg.arch, layer=layer, positions=which,
                             hamming=hamming(idx, tokens_from_embeddings(e_n, w_pinv), pad_id),
                             loss=loss.mean().item(), epsilon=eps.mean().item(),
                             converged=(loss <= eps).float().mean().item()))
    return rows


def represent_inputs(cfg, s, gen):
    """(B, n_ctx) token windows: random starts in data_dir's val.bin, or uniform random tokens; pad id."""
    if not s.data_dir:
        return random_tokens(cfg, s.batch_size, cfg.n_ctx, gen), None
    try:
        with open(os.path.join(s.data_dir, 'meta.json')) as f:
            meta = json.load(f)
        data = np.memmap(os.path.join(s.data_dir, 'val.bin'), dtype=meta['dtype'], mode='r')
    except (OSError, KeyError, ValueError) as e:
        fail(f"--data_dir={s.data_dir} has no readable meta.json/val.bin ({e}): run python prepare.py first")
    if len(data) <= cfg.n_ctx or meta['vocab_size'] > cfg.vocab_size:
        fail(f"--data_dir={s.data_dir} does not fit the model (needs > n_ctx tokens, vocab <= {cfg.vocab_size})")
    starts = torch.randint(len(data) - cfg.n_ctx, (s.batch_size,), generator=gen).tolist()
    idx = torch.from_numpy(np.stack([data[i:i + cfg.n_ctx].astype(np.int64) for i in starts]))
    return idx, meta.get('pad_id')


def probed_models(s):
    """The checkpoint's model, or an untrained one per grid cell (built as they are needed)."""
    if s.ckpt:
        from train import load_checkpoint, model_from_checkpoint
        try:
            yield model_from_checkpoint(load_checkpoint(s.ckpt))
        except (ValueError, FileNotFoundError) as e:
            fail(str(e))
        return
    for cfg in grid(s):
        torch.manual_seed(s.seed)
        yield build_model(cfg)


def bench_represent(s):
    try:
        layers = [int(v) for v in s.layer.split(',')] if s.layer else None
    except ValueError:
        fail(f"--layer={s.layer} must be a comma list of integers, e.g. --layer=1,4")
    rows, gen = [], torch.Generator().manual_seed(s.seed)
    for model in probed_models(s):
        idx, pad_id = represent_inputs(model.cfg, s, gen)
        model, idx = model.to(s.dev), idx.to(s.dev)
        try:
            new = represent_rows(model, idx, layers or [model.cfg.n_layers], s.steps, s.lr, pad_id, s.seed)
        except ValueError as e:
            fail(str(e))
        for r in new:
            r.update(d_model=model.cfg.d_model, n_layers=model.cfg.n_layers, n_ctx=model.cfg.n_ctx)
            print(f"  {r['arch']} layer {r['layer']} ({r['positions']}): hamming {r['hamming']:.3f}", flush=True)
        rows += new
    return rows


# ----------------------------------------------------------------------------- tables and plots

def fmt(v):
    if v is None:
        return 'OOM'
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def markdown(rows, cols):
    lines = ['| ' + ' | '.join(cols) + ' |', '|' + '---|' * len(cols)]
    return '\n'.join(lines + ['| ' + ' | '.join(fmt(r[c]) for c in cols) + ' |' for r in rows])


def memory_tables(rows):
    """One table per arch laid out as the paper's S9/S10: rows n_layers, columns n_ctx, MB."""
    out = []
    for arch in dict.fromkeys(r['arch'] for r in rows):
        mine = [r for r in rows if r['arch'] == arch]
        ctxs = list(dict.fromkeys(r['n_ctx'] for r in mine))
        table = [{'': f"n_layers={n}", **{f"n_ctx={r['n_ctx']}": r['mb'] for r in mine if r['n_layers'] == n}}
                 for n in dict.fromkeys(r['n_layers'] for r in mine)]
        r = mine[0]
        head = (f"{arch}, d_model={r['d_model']}, {r['n_heads']} head(s), batch {r['batch_size']}, {r['dtype']}, "
                f"{r['device']} (MB)")
        out.append(head + '\n\n' + markdown(table, [''] + [f"n_ctx={c}" for c in ctxs]))
    return '\n\n'.join(out)


def ratios(rows):
    """The mixer-vs-transformer comparisons the README quotes, one line each."""
    lines = []

    def pick(mode, arch, method=None, **kw):
        return [r for r in rows if r['mode'] == mode and r['arch'] == arch and r.get('method') == method
                and all(r[k] == v for k, v in kw.items())]

    def compare(what, a, b, key):
        for r in pick(*a):
            for o in pick(*b, n_ctx=r['n_ctx'], n_layers=r['n_layers'], batch_size=r['batch_size']):
                if r[key] and o[key]:
                    batch = f" batch={r['batch_size']}" if r['mode'] == 'generate' else ''
                    lines.append(f"{what} at n_layers={r['n_layers']} n_ctx={r['n_ctx']}{batch}: "
                                 f"{r[key] / o[key]:.2f}x")

    for other in ('llama', 'gpt'):
        compare(f"throughput mixer/{other}", ('throughput', 'mixer'), ('throughput', other), 'tokens_per_s')
    compare("memory llama/mixer", ('memory', 'llama'), ('memory', 'mixer'), 'mb')
    for arch in dict.fromkeys(r['arch'] for r in rows if r['mode'] == 'retrieval'):
        for r in pick('retrieval', arch, padding='full'):
            for o in pick('retrieval', arch, padding='trimmed', n_ctx=r['n_ctx'], n_layers=r['n_layers']):
                lines.append(f"retrieval {arch} step time full/trimmed at n_layers={r['n_layers']} "
                             f"n_ctx={r['n_ctx']}: {r['ms_per_step'] / o['ms_per_step']:.2f}x")
    for arch in dict.fromkeys(r['arch'] for r in rows):
        compare(f"generate {arch} cache/window", ('generate', arch, 'cache'), ('generate', arch, 'window'),
                'tokens_per_s')
    compare("generate mixer cache / llama KV cache", ('generate', 'mixer', 'cache'), ('generate', 'llama', 'cache'),
            'tokens_per_s')
    return '\n'.join(lines)


def report(mode, rows):
    """The markdown a mode prints (and README shows)."""
    if mode == 'throughput':
        cols = ['arch', 'n_ctx', 'd_model', 'n_layers', 'batch_size', 'dtype', 'ms_per_step', 'tokens_per_s', 'mfu']
    elif mode == 'generate':
        cols = ['arch', 'method', 'batch_size', 'n_ctx', 'd_model', 'n_layers', 'prompt', 'new_tokens', 'dtype',
                'compile', 'warmup_s', 'prefill_ms', 'mb_per_step', 'gb_per_s', 'tokens_per_s', 'ceiling_tokens_per_s',
                'fraction']
    elif mode == 'retrieval':
        cols = ['arch', 'n_ctx', 'd_model', 'n_layers', 'batch_size', 'dtype', 'padding', 'real_tokens', 'ms_per_step']
    elif mode == 'represent':
        cols = ['arch', 'd_model', 'n_layers', 'n_ctx', 'layer', 'positions', 'hamming', 'loss', 'epsilon',
                'converged']
    else:
        return memory_tables(rows)
    return markdown(rows, cols)


def pyplot():
    """matplotlib is optional: imported only for --plot, and checked before anything runs."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        fail("--plot needs matplotlib: pip install matplotlib, or leave out --plot")
    return plt


def plot(rows, path):
    """Throughput and memory vs n_ctx (a line per arch and depth) and generation tokens/s (bars)."""
    plt = pyplot()
    panels = [m for m in ('throughput', 'memory', 'generate') if any(r['mode'] == m for r in rows)]
    if not panels:
        fail("--plot draws throughput, memory and generate rows; this run made none")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, mode in zip(axes[0], panels):
        mine = [r for r in rows if r['mode'] == mode]
        if mode == 'generate':
            labels = [f"{r['arch']} {r['method']} n_ctx={r['n_ctx']}" for r in mine]
            ax.barh(range(len(mine)), [r['tokens_per_s'] for r in mine], tick_label=labels)
            ax.tick_params(axis='y', labelsize=8)
            ax.invert_yaxis()
            ax.set(xscale='log', xlabel='tokens/s', title=f"generate ({mine[0]['dtype']})")
            continue
        key = 'mb' if mode == 'memory' else 'tokens_per_s'
        for arch, depth in dict.fromkeys((r['arch'], r['n_layers']) for r in mine):
            pts = sorted((r['n_ctx'], r[key]) for r in mine
                         if (r['arch'], r['n_layers']) == (arch, depth) and r[key] is not None)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker='o', label=f"{arch} n_layers={depth}")
        ax.set(xscale='log', yscale='log', xlabel='n_ctx', ylabel='MB' if key == 'mb' else 'tokens/s',
               title=f"{mode} ({mine[0]['dtype']})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path + '.tmp.png'
    fig.savefig(tmp)
    os.replace(tmp, path)


def main(argv=None):
    """The benchmark's rows; bad input prints one `error: ...` line and exits with status 2."""
    try:
        return run(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    except KeyboardInterrupt:
        raise SystemExit(130)


def run(argv):
    args = parse_args(argv)
    if args.mode == 'memory_cell':
        return memory_cell(args)
    if args.plot:
        pyplot()
    run = {'throughput': bench_throughput, 'memory': bench_memory, 'generate': bench_generate,
           'represent': bench_represent, 'retrieval': bench_retrieval}
    rows = []
    for mode in ([m for m in run if m != 'retrieval'] if args.mode == 'all' else [args.mode]):
        s = settings(args, mode)
        print(f"## {mode}", flush=True)
        new = run[mode](s)
        print('\n' + report(mode, new) + '\n', flush=True)
        rows += new
    summary = ratios(rows)
    if summary:
        print(summary)
    if args.json:
        tmp = args.json + '.tmp'
        with open(tmp, 'w') as f:
            json.dump(rows, f, indent=1)
        os.replace(tmp, args.json)
    if args.plot:
        plot(rows, args.plot)
    return rows


if __name__ == '__main__':
    main()
