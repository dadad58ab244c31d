"""
bench.py: the paper's measurements, re-run on your own hardware in one command.

    python bench.py MODE [--key=value ...] [--json=FILE] [--plot=FILE.png]

MODE is one of
  throughput  training steps (forward, backward, AdamW): ms/step, tokens/s and MFU
  memory      peak memory of one forward + backward, no lm head (the paper's Tables S9/S10)
  generate    decoding tokens/s, fixed window vs cache, at batch 1 and 16, as a fraction of the
              memory-bandwidth ceiling where that ceiling binds
  represent   input recovery from a layer's activations by gradient descent (paper §3.1-3.3)
  retrieval   InfoNCE training steps on prepared pairs: full left-padded windows vs trimmed
  all         every mode but retrieval at its default sizes, printed as markdown tables
  race        archs trained for the same wall-clock budget by train.py, val loss vs time as a
              table and a picture (python bench.py race --help: its own keys)

--archs, --n_ctx and --n_layers take comma lists and every mode runs their product (--batch_size
too, in generate). Sizes default per mode (`MODE --help` lists them), small enough for `all` in
minutes on 2 CPU cores; --full swaps in the paper's grid; the command line wins over both. Timed
modes run --repeats rounds: a table shows each cell's median round, a ratio its median over the
rounds (min-max). Models are untrained unless represent gets --ckpt; inputs are random tokens
unless --data_dir. The paper's memory settings: --batch_size=16 --n_heads=32.
"""
import contextlib, json, os, platform, re, resource, signal, statistics, subprocess, sys, time
from types import SimpleNamespace

import numpy as np
import torch

from model import (ARCHS, Attention, Backbone, ELiTAAttention, ELiTAFeedForward, GatedMLP, MLP,
                   Mixing, ModelConfig, SwiGLU, TokenMixing, allowed, build_model, flops_per_token)
from configurator import (check_out_dir, check_output_file, int_list, parse_args, run_main,
                          write_atomic)
from prepare import Tokenizer
from retrieve import PairBatches, TextEncoder, info_nce
from sample import compiled_step, decode_layout
from train import (CHOICES, DEFAULTS as TRAIN_DEFAULTS, autocast, choose_dtype, peak_flops,
                   check_run_dir, configure_optimizer, load_checkpoint, load_meta,
                   model_from_checkpoint, resolve_device)

MODES = ('throughput', 'memory', 'generate', 'represent', 'retrieval', 'all', 'race')

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
    dtype='auto',           # autocast dtype (auto: as train.py chooses); generate casts the
                            # weights instead; represent always runs in float32
    seed=0,
    json='',                # write every row to this JSON file
    plot='',                # draw throughput/memory/generate rows to this .png (needs matplotlib)
    warmup=2,               # throughput, retrieval: untimed steps before each timed one
    repeats=3,              # rounds of a timed mode's grid; a cell's row is its median round
    compile=False,          # torch.compile the model (generate: the cached step, warm-up apart)
    mem_limit=12288,        # memory: MB a cell may use before OOM (the paper's 12 GB; 0: none)
    prompt=128, new_tokens=64,  # generate: tokens of the prompt, tokens decoded after it
    methods='window,cache',  # generate: comma list of window and/or cache
    ckpt='',                # represent: a train.py checkpoint to probe (default: untrained models)
    data_dir='',            # represent: inputs from its val.bin (default: random); retrieval: pairs
    layer='',               # represent: comma list of layers l whose output is inverted (last)
    steps=500, lr=0.05,     # represent: gradient descent steps; step size, decaying to lr/10
    arch='none',            # memory_cell (memory's subprocess): its one arch; none = the baseline
)
MODE_DEFAULTS = {  # each mode's sizes over DEFAULTS (which hold throughput's)
    'throughput': {},
    'memory': dict(archs='mixer,llama', d_model=1024, n_layers='4,8', n_ctx='512,1024,2048',
                   batch_size='1'),
    'generate': dict(n_ctx='256', batch_size='1,16'),
    'represent': dict(archs='mixer,llama', n_ctx='32', batch_size='2'),
    'retrieval': dict(archs='mixer,llama', n_ctx='256', batch_size='32'),
}
FULL = {  # --full: the paper's settings (or the README's headline ones)
    'throughput': dict(d_model=512, n_layers='8', n_ctx='128,256,512,1024'),
    'memory': dict(n_layers='4,8,16', n_ctx='512,1024,2048,4096,8192'),
    'generate': dict(n_layers='8', n_ctx='512', prompt=256, new_tokens=256),
    'represent': dict(d_model=512, n_layers='8'),
    'retrieval': dict(n_layers='8', n_ctx='256,512'),
}
BENCH_CHOICES = dict(mode=MODES + ('memory_cell',), dtype=CHOICES['dtype'])
# the timed modes, and the key that picks each cell's median round and makes the ratios
TIMED = {'throughput': 'tokens_per_s', 'generate': 'tokens_per_s', 'retrieval': 'ms_per_step'}


def settings(argv, mode):
    """argv's settings for one mode: DEFAULTS, the mode's sizes (the paper's with --full), then argv
    itself; comma lists split, the device and dtype resolved."""
    defaults = dict(DEFAULTS, **MODE_DEFAULTS[mode])
    s = parse_args(argv, defaults, __doc__, BENCH_CHOICES, positional='mode')
    if s['full']:  # parsed again so that argv's own values still win over the paper's
        s = parse_args(argv, dict(defaults, **FULL[mode]), __doc__, BENCH_CHOICES, 'mode')
    s['archs'] = s['archs'].split(',')
    for key, low in dict(n_layers=1, n_ctx=2, batch_size=1).items():
        s[key] = int_list(s[key], key, low)
    lowest = dict(warmup=0, repeats=1, mem_limit=0, prompt=1, new_tokens=1, steps=1, seed=0)
    for key, low in lowest.items():
        if s[key] < low:
            raise ValueError(f"--{key}={s[key]} is out of range: use a value >= {low}")
    if s['lr'] <= 0:
        raise ValueError(f"--lr={s['lr']} must be > 0")
    if mode != 'generate':
        if len(s['batch_size']) != 1:
            raise ValueError(f"--batch_size takes one integer in {mode}; a list only in generate")
        s['batch_size'] = s['batch_size'][0]
    s['dev'] = resolve_device(s['device'])
    s['torch_dtype'], why = choose_dtype(s['dev'], s['dtype'])
    # what runs, as memory cells inherit it
    s['device'], s['dtype'] = str(s['dev']), str(s['torch_dtype'])[6:]
    if s['mode'] != 'memory_cell':
        print(f"{mode}: {s['device']} {s['dtype']} ({why})", file=sys.stderr)
    s = SimpleNamespace(**dict(s, mode=mode))
    grid(s)  # a bad arch or size fails here, before any mode runs
    return s


def grid(s):
    """Every (arch, n_layers, n_ctx) the mode should measure, as ModelConfigs."""
    return [model_config(s, arch, n_layers, n_ctx)
            for arch in s.archs for n_layers in s.n_layers for n_ctx in s.n_ctx]


def model_config(s, arch, n_layers, n_ctx):
    # --n_heads counts attention heads; a mixer's would count mixing heads, so mixers keep one
    return ModelConfig(arch=arch, vocab_size=s.vocab_size, n_ctx=n_ctx, d_model=s.d_model,
                       n_layers=n_layers, n_heads=0 if arch in ('mixer', 'gmlp') else s.n_heads)


def flags(keys):
    """{key: value} -> ['--key=value', ...], a script's command line."""
    return [f"--{k}={v}" for k, v in keys.items()]


def last_line(stderr):
    """What a failed subprocess said last: its error line."""
    return (stderr.strip().splitlines() or ['no output'])[-1]


def sync(dev):
    if dev.type == 'cuda':
        torch.cuda.synchronize()


def row(s, cfg, **measured):
    """One result: the mode, the model's sizes, the dtype, then what was measured."""
    return dict(mode=s.mode, arch=cfg.arch, d_model=cfg.d_model, n_layers=cfg.n_layers,
                n_ctx=cfg.n_ctx, dtype=s.dtype, **measured)


def out_of_memory(e):
    """True for a failed allocation: torch raises RuntimeError (OutOfMemoryError on CUDA)."""
    return isinstance(e, MemoryError) or 'memory' in str(e).lower()


def training_step_seconds(s, model, batches, loss_fn):
    """Seconds of one full training step (forward under autocast, backward, AdamW) after s.warmup
    untimed ones; batches[i] (s.warmup + 1 of them) feeds step i."""
    opt = configure_optimizer(model, 1e-4, 0.01, s.dev.type)
    for batch in batches:
        sync(s.dev)
        t0 = time.perf_counter()
        with autocast(s.dev, s.torch_dtype):
            loss = loss_fn(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(s.dev)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- throughput

def bench_throughput(s):
    peak = peak_flops(s.dev, s.torch_dtype)
    print(f"peak: {peak / 1e9:.0f} GFLOP/s ({s.dtype} on {s.device}: train.peak_flops)")
    gen = torch.Generator().manual_seed(s.seed)
    for cfg in grid(s):
        xy = torch.randint(cfg.vocab_size, (s.batch_size, cfg.n_ctx + 1), generator=gen)
        ms = tps = mfu = None                     # an OOM row, as memory mode gives
        try:
            ms = 1e3 * throughput_step_seconds(s, cfg, xy.to(s.dev))
            tps = s.batch_size * cfg.n_ctx / (ms / 1e3)
            mfu = flops_per_token(cfg) * tps / peak
        except (RuntimeError, MemoryError) as e:  # the model or its step does not fit
            if not out_of_memory(e):
                raise
            torch.cuda.empty_cache()  # a no-op unless CUDA is in use
        print(f"  {cfg.arch} n_ctx={cfg.n_ctx}: "
              + ('OOM' if ms is None else f"{ms:.0f} ms/step, {tps:.0f} tokens/s"), flush=True)
        yield row(s, cfg, batch_size=s.batch_size, ms_per_step=ms, tokens_per_s=tps, mfu=mfu,
                  peak_flops=peak)


def throughput_step_seconds(s, cfg, xy):
    """Seconds of a training step of a fresh cfg model on xy (B, n_ctx + 1); the model is freed
    on return, so a failed allocation leaves the next one its memory."""
    torch.manual_seed(s.seed)
    model = build_model(cfg).to(s.dev).train()
    step = torch.compile(model) if s.compile else model
    return training_step_seconds(s, model, [xy] * (s.warmup + 1),
                                 lambda b: step(b[:, :-1], b[:, 1:])[1])


# ----------------------------------------------------------------------------- memory

def proc_status(key):
    """A /proc/self/status entry in bytes: VmHWM is this process's peak resident set (unlike
    ru_maxrss it starts afresh at exec, so a child does not inherit its parent's peak), VmSize
    what it has mapped."""
    try:
        with open('/proc/self/status') as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ':'))
    except (OSError, StopIteration):
        raise ValueError("CPU memory cells read /proc/self/status (Linux): run memory on Linux "
                         "or on CUDA") from None


def memory_cell(s):
    """Subprocess body: one forward + backward of a backbone (no lm head); prints peak bytes as
    JSON. --arch=none builds nothing and gives the interpreter + torch baseline."""
    torch.ones(64, 64) @ torch.ones(64, 64)   # start the thread pool, as every cell does
    # allocations past --mem_limit fail: CUDA's by a memory fraction, the CPU's by an address cap
    if s.mem_limit and s.dev.type == 'cuda':
        total = torch.cuda.get_device_properties(s.dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, s.mem_limit * 2**20 / total), s.dev)
    elif s.mem_limit:
        limit = proc_status('VmSize') + s.mem_limit * 2**20   # what this process maps, plus it
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    try:
        if s.arch != 'none':
            cfg = model_config(s, s.arch, s.n_layers[0], s.n_ctx[0])
            backbone = Backbone(cfg).to(s.dev)
            idx = torch.randint(cfg.vocab_size, (s.batch_size, cfg.n_ctx), device=s.dev)
            with autocast(s.dev, s.torch_dtype):
                h = backbone(idx)                                       # (B, n_ctx, d_model)
            h.float().sum().backward()
            sync(s.dev)
        cuda = s.dev.type == 'cuda'
        peak = torch.cuda.max_memory_allocated(s.dev) if cuda else proc_status('VmHWM')
    except (RuntimeError, MemoryError) as e:
        if not out_of_memory(e):
            raise
        peak = None
    print(json.dumps({'peak_bytes': peak}))


def run_cell(s, arch, n_layers, n_ctx):
    """Peak bytes of one memory cell run in a fresh interpreter, or None if it ran out of memory."""
    keys = dict(arch=arch, n_layers=n_layers, n_ctx=n_ctx, **{k: getattr(s, k) for k in (
        'd_model', 'batch_size', 'n_heads', 'vocab_size', 'device', 'dtype', 'mem_limit')})
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), 'memory_cell', *flags(keys)],
                          capture_output=True, text=True)
    if proc.returncode < 0:  # killed by a signal: the kernel's OOM killer, or an allocator's abort
        return None
    if proc.returncode != 0:
        raise ValueError(f"memory cell {arch} n_layers={n_layers} n_ctx={n_ctx} failed: "
                         f"{last_line(proc.stderr)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])['peak_bytes']


def bench_memory(s):
    base = 0 if s.dev.type == 'cuda' else run_cell(s, 'none', 1, 2)
    for cfg in grid(s):
        peak = run_cell(s, cfg.arch, cfg.n_layers, cfg.n_ctx)
        mb = None if peak is None else (peak - base) / 2**20
        print(f"  {cfg.arch} n_layers={cfg.n_layers} n_ctx={cfg.n_ctx}: "
              + ('OOM' if mb is None else f"{mb:.0f} MB"), flush=True)
        yield row(s, cfg, n_heads=cfg.n_heads, batch_size=s.batch_size, device=s.device, mb=mb)


# ----------------------------------------------------------------------------- generate

def time_decoding(model, prompt, new_tokens, method, s, step=None):
    """(prefill seconds to the first token, seconds per later token) of greedy generation."""
    stamps = []
    sync(s.dev)
    t0 = time.perf_counter()
    for _ in model.stream(prompt, new_tokens, temperature=0, method=method, step=step):
        sync(s.dev)
        stamps.append(time.perf_counter())
    return stamps[0] - t0, (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)


def last_level_cache(dev, root='/sys/devices/system/cpu/cpu0/cache'):
    """Bytes of the largest cache between the weights and the cores (a GPU's L2, or the CPU's
    largest in sysfs), or None where it cannot be read."""
    if dev.type == 'cuda':
        return getattr(torch.cuda.get_device_properties(dev), 'L2_cache_size', 0) or None
    sizes = []
    for index in os.listdir(root) if os.path.isdir(root) else []:
        try:
            with open(os.path.join(root, index, 'size')) as f:
                number, unit = re.fullmatch(r'(\d+)([KMG]?)', f.read().strip()).groups()
        except (OSError, AttributeError):   # not a cache folder, or a size in another form
            continue
        sizes.append(int(number) * 1024 ** ' KMG'.index(unit or ' '))
    return max(sizes, default=None)


def measure_read_bandwidth(device, mib, budget=0.5):
    """Bytes/s of a streaming read: sums of a mib-MiB fp32 buffer with torch's threads, for
    `budget` seconds after one warm-up. Bytes over wall time, as decoding tokens/s is: on a
    shared machine both see the same load."""
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
    """Greedy decoding tokens/s per arch, method and batch size, each next to a DRAM bandwidth
    read taken just before it: ceiling = batch x bandwidth / bytes a step reads (decode_bytes,
    averaged over the decoded positions). The ceiling binds only a step that reads more than the
    last-level cache holds (bound 'dram'); a smaller one ('cache') or an unknown cache gets no
    fraction. The weights are cast to the dtype, not autocast: a step is bound by reading them.
    window runs at the first batch size only (compute-bound: batch B costs B forwards).
    --compile compiles the cached step; its warm-up holds the compile and is timed apart."""
    methods = s.methods.split(',')
    if set(methods) - {'window', 'cache'}:
        raise ValueError(f"--methods={s.methods}: use window, cache or window,cache")
    llc = last_level_cache(s.dev)
    probe_mib = max(64, 4 * (llc or 0) // 2**20)  # streamed from DRAM, not from the cache
    gen = torch.Generator().manual_seed(s.seed)
    for cfg in grid(s):
        if s.prompt + s.new_tokens > cfg.n_ctx:
            raise ValueError(f"--prompt={s.prompt} plus --new_tokens={s.new_tokens} exceeds "
                             f"n_ctx={cfg.n_ctx}: shorten them or raise --n_ctx")
        torch.manual_seed(s.seed)
        model = decode_layout(build_model(cfg).to(s.dev, s.torch_dtype).eval())  # as sample.py
        step = None
        if s.compile:  # each model's step is one more graph: stay under the recompile limit
            torch._dynamo.reset()
            step = compiled_step(model)
        for batch in s.batch_size:
            prompt = torch.randint(cfg.vocab_size, (batch, s.prompt), generator=gen).to(s.dev)
            for method in methods if batch == s.batch_size[0] else set(methods) & {'cache'}:
                # warm-up: its two tokens' seconds, the compile's with --compile
                warmup = sum(time_decoding(model, prompt, 2, method, s, step))
                bandwidth = measure_read_bandwidth(s.dev, probe_mib)
                prefill, per_token = time_decoding(model, prompt, s.new_tokens, method, s, step)
                positions = range(s.prompt, s.prompt + s.new_tokens - 1)  # the timed steps'
                step_bytes = statistics.mean(decode_bytes(model, p, batch, method == 'cache')
                                             for p in positions)
                tps, ceiling = batch / per_token, batch * bandwidth / step_bytes
                bound = 'unknown' if llc is None else 'dram' if step_bytes > llc else 'cache'
                fraction = tps / ceiling if bound == 'dram' else None
                where = (f"{fraction:.0%} of it" if fraction is not None else "no fraction: "
                         + ("the last-level cache size is unknown" if llc is None else
                            f"the step fits the {llc / 2**20:.0f} MiB last-level cache"))
                print(f"  {cfg.arch} {method} batch {batch} (warm-up {warmup:.1f} s): "
                      f"{tps:.1f} tokens/s; DRAM ceiling {ceiling:.0f} ({step_bytes / 1e6:.1f} "
                      f"MB/step at {bandwidth / 1e9:.1f} GB/s), {where}", flush=True)
                yield row(s, cfg, method=method, prompt=s.prompt, new_tokens=s.new_tokens,
                          batch_size=batch, compile=s.compile and method == 'cache',
                          warmup_s=warmup, prefill_ms=1e3 * prefill, tokens_per_s=tps,
                          mb_per_step=step_bytes / 1e6, gb_per_s=bandwidth / 1e9,
                          ceiling_tokens_per_s=ceiling, bound=bound, fraction=fraction)


# ----------------------------------------------------------------------------- retrieval

def bench_retrieval(s):
    """InfoNCE steps (in-batch negatives: batch_size queries + their targets, forward, backward,
    AdamW) on the same real pairs, once with every text left-padded to n_ctx and once trimmed
    (TextEncoder's trim: pad states shared by mixers, pad columns dropped by llama)."""
    data_dir = s.data_dir or 'data/pystdlib'
    tok = Tokenizer.from_meta(load_meta(data_dir), data_dir)
    pairs = PairBatches(dict(data_dir=data_dir, batch_size=s.batch_size, negatives='inbatch',
                             seed=s.seed), tok, 0)
    for cfg in grid(s):
        pairs.n_ctx = cfg.n_ctx
        # both paddings' batches, and the fraction of real tokens in them
        batches = [[t.to(s.dev) for t in pairs('train', i, 0)] for i in range(s.warmup + 1)]
        real = float(np.mean([float(mask.float().mean()) for _, mask, _ in batches]))
        for trim in (False, True):
            torch.manual_seed(s.seed)
            enc = TextEncoder(build_model(cfg).to(s.dev).train(), -1, trim)

            def loss_fn(batch):
                idx, mask, labels = batch
                e = enc(idx, mask)                          # (2B, d_model): queries, targets
                return info_nce(e[:len(labels)], e[len(labels):], labels)

            ms = 1e3 * training_step_seconds(s, enc.model, batches, loss_fn)
            padding = 'trimmed' if enc.trim else 'full'
            print(f"  {cfg.arch} n_ctx={cfg.n_ctx} {padding}: {ms:.0f} ms/step", flush=True)
            yield row(s, cfg, batch_size=s.batch_size, real_tokens=real, ms_per_step=ms,
                      padding=padding)


# ----------------------------------------------------------------------------- accounting

def param_counts(model):
    """Parameters split as the paper does: token mixing (mixings, attention), feed-forward,
    embedding (token and position tables, lm head) and other (norms, heads). mixing_effective
    leaves out the mixing entries no output depends on (masked ones, never-read hidden rows)."""
    kinds = [('mixing', (TokenMixing, Mixing, Attention, ELiTAAttention)),
             ('feedforward', (MLP, SwiGLU, ELiTAFeedForward, GatedMLP)),
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
             if isinstance(t, TokenMixing) and t.mix2 is not None}
    unused = 0
    for m in (m for m in model.modules() if isinstance(m, Mixing)):
        n_out = m.weight.shape[-2]
        rows = min(n_out, reads.get(id(m), n_out))
        kept = int(allowed(m.direction, m.weight[..., :rows, :], 0).sum())
        unused += m.weight.numel() + m.bias.numel() - m.weight[..., 0, 0].numel() * kept \
            - m.bias.shape[0] * rows
    counts['mixing_effective'] = counts['mixing'] - unused
    return counts


def decode_bytes(model, pos, batch=1, cached=True):
    """Bytes one decoding step at window position pos reads: every weight once in its storage
    dtype, except that an embedding table gives a row per sequence and a masked mixing its row
    pos, plus per sequence the cache rows read (mixing inputs, keys and values); not activations
    or writes. cached=False (window): all parameter bytes, loose for a compute-bound step."""
    if not cached:
        return sum(p.numel() * p.element_size() for p in model.parameters())
    lm_head = getattr(model, 'lm_head', None)
    total, counted = 0, set()
    for mod in model.modules():
        if isinstance(mod, (TokenMixing, GatedMLP)):  # channels of the cached inputs
            width = mod.width if isinstance(mod, TokenMixing) else mod.down.in_features
            for m in (m for m in mod.modules() if isinstance(m, Mixing)):
                size, (n_out, n_in) = m.weight.element_size(), m.weight.shape[-2:]
                cols = min(pos + 1, n_in)
                if pos < n_out:  # row pos of the weights and bias, the cached inputs it mixes
                    total += (m.weight[..., 0, :cols].numel() + m.bias.shape[0]
                              + batch * cols * width) * size
                counted |= {id(m.weight), id(m.bias)}
        elif isinstance(mod, Attention):  # keys and values of positions <= pos
            total += batch * 2 * (pos + 1) * mod.qkv.in_features * mod.qkv.weight.element_size()
        elif isinstance(mod, torch.nn.Embedding) and (
                lm_head is None or mod.weight is not lm_head.weight):
            total += batch * mod.embedding_dim * mod.weight.element_size()
            counted.add(id(mod.weight))
    return total + sum(p.numel() * p.element_size() for p in model.parameters()
                       if id(p) not in counted)


# ----------------------------------------------------------------------------- represent

def embedding_backbone(model):
    """The backbone whose token embeddings are inverted: a LanguageModel's, an Autoencoder's
    encoder."""
    for name in ('backbone', 'encoder'):
        if isinstance(getattr(model, name, None), Backbone):
            return getattr(model, name)
    raise ValueError(f"represent needs one token embedding feeding one backbone; "
                     f"{type(model).__name__} has not: probe a model of objective clm, mtp2, "
                     f"half or autoencoder")


def layer_output_fn(model, idx, layer):
    """O_l: token embeddings e (B, T, d) -> block l's output (B, T, d), by the model's own forward
    with the embedding lookup's result swapped for e (so positions, RoPE and masks apply)."""
    backbone = embedding_backbone(model)
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
        loss = l1_per_sequence(O(e_n), target).sum()
        grad, = torch.autograd.grad(loss, e_n, allow_unused=True)  # None: O ignores its input
        with torch.no_grad():
            e_n -= lr * (1 - 0.9 * n / max(1, steps - 1)) * (0 if grad is None else grad)
    with torch.no_grad():
        return e_n.detach(), l1_per_sequence(O(e_n), target)


def hamming(x, y, pad_id=None):
    """Paper eq. 6: fraction of the input's non-pad positions where the recovered token differs."""
    real = torch.ones_like(x, dtype=torch.bool) if pad_id is None else x != pad_id
    return ((x != y) & real).sum().item() / max(1, real.sum().item())


def represent_rows(model, idx, layers, steps, lr, pad_id=None, seed=0):
    """Invert each layer from all positions' activations ('all') and from the last position's
    only ('last', the non-self representation); each row has the Hamming distance, the final L1
    loss and the paper's epsilon: the L1 shift that N(0, 1/20) noise on e causes (converged:
    loss <= eps)."""
    model = model.float().eval().requires_grad_(False)
    wte = embedding_backbone(model).wte.weight
    # eq. 3: a_N = W^+ e_N, W the (d, vocab) embedding map (the table transposed): pinv(table)^T
    e, w_pinv = wte[idx], torch.linalg.pinv(wte)                     # (B, T, d), (d, vocab)
    rows = []
    for layer in layers:
        O_all = layer_output_fn(model, idx, layer)
        for which, O in (('all', O_all), ('last', lambda v: O_all(v)[:, -1:])):
            gen = torch.Generator().manual_seed(seed)
            e_n, loss = invert(O, e, steps, lr, gen)
            with torch.no_grad():
                noise = torch.randn(e.shape, generator=gen).to(e.device) / 20
                eps = l1_per_sequence(O(e + noise), O(e))
            rows.append(dict(mode='represent', arch=model.cfg.arch, layer=layer, positions=which,
                             hamming=hamming(idx, (e_n @ w_pinv).argmax(-1), pad_id),  # a_N's
                             loss=loss.mean().item(), epsilon=eps.mean().item(),
                             converged=(loss <= eps).float().mean().item()))
    return rows


def represent_inputs(cfg, s, gen):
    """(B, n_ctx) token windows at random starts in data_dir's val.bin, or uniform random tokens;
    and the pad id."""
    if not s.data_dir:
        return torch.randint(cfg.vocab_size, (s.batch_size, cfg.n_ctx), generator=gen), None
    try:
        meta = load_meta(s.data_dir)
        data = np.memmap(os.path.join(s.data_dir, 'val.bin'), dtype=meta['dtype'], mode='r')
    except (OSError, ValueError) as e:  # the flag named beside load_meta's reason
        raise ValueError(f"--data_dir={s.data_dir} has no readable meta.json/val.bin "
                         f"({e})") from None
    if len(data) <= cfg.n_ctx or meta['vocab_size'] > cfg.vocab_size:
        raise ValueError(f"--data_dir={s.data_dir} does not fit the model (needs > n_ctx tokens, "
                         f"vocab <= {cfg.vocab_size})")
    starts = torch.randint(len(data) - cfg.n_ctx, (s.batch_size,), generator=gen).tolist()
    idx = torch.from_numpy(np.stack([data[i:i + cfg.n_ctx].astype(np.int64) for i in starts]))
    return idx, meta.get('pad_id')


def bench_represent(s):
    layers = int_list(s.layer, 'layer') if s.layer else None
    gen = torch.Generator().manual_seed(s.seed)
    for cfg in [None] if s.ckpt else grid(s):  # the checkpoint's model, or one per grid cell
        torch.manual_seed(s.seed)
        model = model_from_checkpoint(load_checkpoint(s.ckpt)) if s.ckpt else build_model(cfg)
        idx, pad_id = represent_inputs(model.cfg, s, gen)
        model, idx = model.to(s.dev), idx.to(s.dev)
        layers_or_last = layers or [model.cfg.n_layers]
        for r in represent_rows(model, idx, layers_or_last, s.steps, s.lr, pad_id, s.seed):
            r.update(d_model=model.cfg.d_model, n_layers=model.cfg.n_layers, n_ctx=model.cfg.n_ctx)
            print(f"  {r['arch']} layer {r['layer']} ({r['positions']}): "
                  f"hamming {r['hamming']:.3f}", flush=True)
            yield r


# ----------------------------------------------------------------------------- tables and plots

def fmt(v, col=''):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    if v is None:  # a cell that ran out of memory; generate's fraction where no ceiling binds
        return '-' if col == 'fraction' else 'OOM'
    return str(v)


def markdown(rows, cols):
    lines = ['| ' + ' | '.join(cols) + ' |', '|' + '---|' * len(cols)]
    return '\n'.join(lines + ['| ' + ' | '.join(fmt(r[c], c) for c in cols) + ' |' for r in rows])


def memory_tables(rows):
    """One table per arch laid out as the paper's S9/S10: rows n_layers, columns n_ctx, MB."""
    out = []
    for arch in dict.fromkeys(r['arch'] for r in rows):
        mine = [r for r in rows if r['arch'] == arch]
        ctxs = list(dict.fromkeys(r['n_ctx'] for r in mine))
        table = [{'': f"n_layers={n}",
                  **{f"n_ctx={r['n_ctx']}": r['mb'] for r in mine if r['n_layers'] == n}}
                 for n in dict.fromkeys(r['n_layers'] for r in mine)]
        r = mine[0]
        head = (f"{arch}, d_model={r['d_model']}, {r['n_heads']} head(s), batch "
                f"{r['batch_size']}, {r['dtype']}, {r['device']} (MB)")
        out.append(head + '\n\n' + markdown(table, [''] + [f"n_ctx={c}" for c in ctxs]))
    return '\n\n'.join(out)


def median_round(cells, key):
    """A cell's row over the rounds: the round whose `key` is the median (the lower middle of an
    even count), so that its columns agree; an OOM in any round is the row."""
    oom = [c for c in cells if c[key] is None]
    middle = oom[0] if oom else sorted(cells, key=lambda c: c[key])[(len(cells) - 1) // 2]
    return dict(middle, repeats=len(cells))


def ratios(rounds):
    """The mixer-vs-transformer comparisons the README quotes, one line each: the key of rows
    matching a over that of rows differing from them by b, at each n_layers, n_ctx and batch size
    both were run at; taken within each round, shown as the median over rounds (min-max)."""
    found = {}  # line -> the ratio in each round that has it

    def pick(rows, **want):
        return [r for r in rows if all(r.get(k) == v for k, v in want.items())]

    def compare(what, key, a, **b):
        for rows in rounds:
            for r in pick(rows, **a):
                for o in pick(rows, **dict(a, **b), n_ctx=r['n_ctx'], n_layers=r['n_layers'],
                              batch_size=r['batch_size']):
                    if r[key] and o[key]:
                        batch = f" batch={r['batch_size']}" if r['mode'] == 'generate' else ''
                        line = f"{what} at n_layers={r['n_layers']} n_ctx={r['n_ctx']}{batch}"
                        found.setdefault(line, []).append(r[key] / o[key])

    for other in ('llama', 'gpt'):
        compare(f"throughput mixer/{other}", 'tokens_per_s',
                dict(mode='throughput', arch='mixer'), arch=other)
    compare("memory llama/mixer", 'mb', dict(mode='memory', arch='llama'), arch='mixer')
    for arch in dict.fromkeys(r['arch'] for rows in rounds for r in rows):
        compare(f"retrieval {arch} step time full/trimmed", 'ms_per_step',
                dict(mode='retrieval', arch=arch, padding='full'), padding='trimmed')
        compare(f"generate {arch} cache/window", 'tokens_per_s',
                dict(mode='generate', arch=arch, method='cache'), method='window')
    compare("generate mixer cache / llama KV cache", 'tokens_per_s',
            dict(mode='generate', arch='mixer', method='cache'), arch='llama')
    return '\n'.join(
        f"{line}: {statistics.median(v):.2f}x " + (f"({min(v):.2f}-{max(v):.2f})" if len(v) > 1
                                                   else "(one run)")
        for line, v in found.items())


COLUMNS = {  # each mode's markdown table (README shows them); memory's is laid out as Tables S9/S10
    'throughput': 'arch n_ctx d_model n_layers batch_size dtype ms_per_step tokens_per_s mfu',
    'generate': 'arch method batch_size n_ctx d_model n_layers prompt new_tokens dtype compile '
                'warmup_s prefill_ms mb_per_step gb_per_s tokens_per_s ceiling_tokens_per_s bound '
                'fraction',
    'retrieval': 'arch n_ctx d_model n_layers batch_size dtype padding real_tokens ms_per_step',
    'represent': 'arch d_model n_layers n_ctx layer positions hamming loss epsilon converged',
}
PLOTTED = ('throughput', 'memory', 'generate')


def pyplot():
    """matplotlib is optional: imported only for --plot, and checked before anything runs."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib, or leave out "
                         "--plot") from None
    return plt


def plot(rows, path):
    """Throughput and memory vs n_ctx (a line per arch and depth) and generation tokens/s (bars)."""
    plt = pyplot()
    panels = [m for m in PLOTTED if any(r['mode'] == m for r in rows)]
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
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker='o',
                    label=f"{arch} n_layers={depth}")
        ax.set(xscale='log', yscale='log', xlabel='n_ctx', title=f"{mode} ({mine[0]['dtype']})",
               ylabel='MB' if key == 'mb' else 'tokens/s')
        ax.legend(fontsize=8)
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, format='png'))


MEASURE = {'throughput': bench_throughput, 'memory': bench_memory, 'generate': bench_generate,
           'represent': bench_represent, 'retrieval': bench_retrieval}


def run(argv):
    """The rows of argv's mode (all: every mode but retrieval), printed as tables, written to
    --json/--plot; every output is checked before the work."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ['race']:  # its own keys: train.py's, per arch (see RACE_DOC)
        return race(argv)
    args = parse_args(argv, DEFAULTS, __doc__, BENCH_CHOICES, 'mode', MODE_DEFAULTS)
    if args['mode'] == 'memory_cell':
        return memory_cell(settings(argv, 'memory'))
    modes = [m for m in MEASURE if m != 'retrieval'] if args['mode'] == 'all' else [args['mode']]
    for key in ('json', 'plot'):
        if args[key]:
            check_output_file(args[key], key)
    if args['plot'] and not set(modes) & set(PLOTTED):
        raise ValueError(f"--plot draws {', '.join(PLOTTED)} rows; {args['mode']} makes none: "
                         f"leave out --plot")
    if args['plot']:
        pyplot()
    done, rounds = [], {}  # every mode's finished rows; each round's rows, for the ratios

    def save(rows):  # --json holds every row as soon as it is measured: an interrupt keeps them
        if args['json']:
            write_atomic(args['json'], json.dumps(done + rows, indent=1))
    for mode, s in [(mode, settings(argv, mode)) for mode in modes]:  # all checked first
        n, runs = s.repeats if mode in TIMED else 1, []
        for i in range(n):
            print(f"## {mode}" + (f", round {i + 1} of {n}" if n > 1 else ''), flush=True)
            runs.append([])
            for r in MEASURE[mode](s):
                runs[-1].append(r)
                save(sum(runs, []))
            rounds.setdefault(i, []).extend(runs[-1])
        new = [median_round(cells, TIMED[mode]) for cells in zip(*runs)] if n > 1 else runs[0]
        done += new
        save([])
        table = memory_tables(new) if mode == 'memory' else markdown(new, COLUMNS[mode].split())
        print(f"\n{table}\n", flush=True)
    summary = ratios(list(rounds.values()))
    if summary:
        print(summary)
    if args['plot']:
        plot(done, args['plot'])
    return done


# ----------------------------------------------------------------------------- race

RACE_DOC = """
python bench.py race: language models trained for the same wall-clock budget on your data, as a
table, a JSON file and one picture of validation loss against training time (the paper's central
comparison).

    python bench.py race [--archs=mixer,llama] [--max_time=SECONDS] [--data_dir=DIR] [--out_dir=DIR]
                         [--presets=A.py,B.py] [--KEY=VALUE] [--ARCH.KEY=VALUE] [--retrieval=True]

Each arch trains through train.py (one subprocess each) for --max_time seconds of training,
evaluation excluded, as train.py counts its budget. On a CPU the runs go at the same time, one
thread each, so that they share the machine's load and finish together (more archs than cores
share the cores); on a GPU one after another, each with the whole device. Every run evaluates at
the same marks of training time (every --eval_seconds) on the same validation batches: the keys
that choose them (data_dir, n_ctx, batch_size, eval_iters, seed, batch_mode, padding, objective)
must agree across the archs.

A run's train.py keys, later ones winning: the race's sizes (d_model 256, 4 layers, n_ctx 256,
batch 16, 4 evaluation batches: about 10 minutes on 2 CPU cores) and a learning rate per arch
(mixers 5e-3, others 1.5e-3: config/retrieval_*.py's CPU-sized rates); its preset (--presets,
one per arch, in --archs order); any train.py key, for every arch (--n_layers=8, --data_dir=DIR,
--device=cuda); one arch's own (--mixer.d_model=512). --out_dir, --max_time and the evaluation
marks are the race's.

out_dir holds ARCH/ (train.py's run: log.jsonl, ckpt.pt, best.pt), ARCH.out (its console),
race.md (the table), race.json (settings, curves, table) and race.png. --retrieval=True adds the
paper's second stage: each pretrained model (ARCH/ckpt.pt) fine-tuned with InfoNCE for the same
--nce_time seconds (retrieve.py train into ARCH_nce/, batch 32, symmetric, lr 1e-3 for mixers,
5e-4 for others; --nce.KEY=VALUE passes a key to every one), then retrieve.py eval on --pairs
at each --n: top-1 columns and a second panel. Pretrain on left-padded documents for it:
--presets=config/retrieval_mixer.py,config/retrieval_llama.py. Ctrl-C stops every run (its last
checkpoint stays whole) and still writes the table, JSON and picture of what was measured.
"""
RACE_DEFAULTS = dict(
    mode='race',
    archs='mixer,llama',    # comma list of archs, each trained once
    max_time=420.0,         # seconds of training per arch, evaluation excluded
    eval_seconds=0.0,       # evaluate every this many seconds of training (0: max_time / 8)
    out_dir='out/race',
    presets='',             # comma list of train.py presets, one per arch in --archs order
    overwrite=False,        # replace the race already in out_dir
    retrieval=False,        # then InfoNCE for --nce_time seconds each and top-1 on --pairs
    nce_time=0.0,           # InfoNCE seconds of training per model (0: half of max_time)
    pairs='',               # retrieval eval pairs (default: data_dir/pairs_val.jsonl)
    n='32,64,128',          # retrieval: Table 1's n (n-1 candidates)
)
RACE_TRAIN = dict(d_model=256, n_layers=4, n_ctx=256, batch_size=16, warmup_iters=50, eval_iters=4,
                  log_interval=10, max_iters=0)
RACE_LR = {'mixer': 5e-3, 'gmlp': 5e-3}      # else 1.5e-3 (config/retrieval_*.py)
RACE_NCE = dict(batch_size=32, symmetric=True, warmup_iters=20, eval_iters=5, max_iters=0)
RACE_NCE_LR = {'mixer': 1e-3, 'gmlp': 1e-3}  # else 5e-4 (README's retrieval recipe)
SAME_BATCHES = ('data_dir', 'n_ctx', 'batch_size', 'eval_iters', 'seed', 'batch_mode', 'padding',
                'objective')
HERE = os.path.dirname(os.path.abspath(__file__))


def race_split(argv):
    """argv -> (the race's own arguments, train.py keys for every arch, {arch: its own keys},
    retrieve.py train keys): --KEY=VALUE of train.py, --ARCH.KEY=VALUE, --nce.KEY=VALUE."""
    own, shared, per_arch, nce = [], [], {}, []
    for arg in argv:
        key, eq, value = arg[2:].partition('=') if arg.startswith('--') else ('', '', '')
        key = key.replace('-', '_')
        head, dot, rest = key.partition('.')
        passed = dot or (key in TRAIN_DEFAULTS and key not in RACE_DEFAULTS)
        if passed and not eq:
            raise ValueError(f"--{key} is passed on to train.py: write --{key}=VALUE")
        if dot:
            (nce if head == 'nce' else per_arch.setdefault(head, [])).append(f"--{rest}={value}")
        elif passed:
            shared.append(f"--{key}={value}")
        else:
            own.append(arg)
    return own, shared, per_arch, nce


def race_settings(argv):
    """The race's settings, with each arch's train.py arguments (s.runs) checked: bad input fails
    here, before any work."""
    own, shared, per_arch, nce = race_split(argv)
    s = SimpleNamespace(**parse_args(own, RACE_DEFAULTS, RACE_DOC, positional='mode'))
    s.archs = [a.strip() for a in s.archs.split(',') if a.strip()]
    bad = [a for a in s.archs if a not in ARCHS]
    if bad or not s.archs:
        what = f"unknown arch {bad[0]!r}" if bad else "no arch"
        raise ValueError(f"--archs={','.join(s.archs)}: {what}: use a comma list of "
                         f"{', '.join(ARCHS)}")
    if len(set(s.archs)) < len(s.archs):
        raise ValueError(f"--archs={','.join(s.archs)} names an arch twice: each arch races once")
    stray = sorted(set(per_arch) - set(s.archs))
    if stray:
        raise ValueError(f"--{stray[0]}.KEY=VALUE is for an arch not in "
                         f"--archs={','.join(s.archs)}: add it there or drop the key")
    if not s.max_time > 0:
        raise ValueError(f"--max_time={s.max_time:g}: give every arch a budget of seconds > 0")
    presets = [p for p in s.presets.split(',') if p.strip()]
    if presets and len(presets) != len(s.archs):
        raise ValueError(f"--presets names {len(presets)} file(s) for {len(s.archs)} arch(s): "
                         f"one preset per arch, in --archs order")
    s.eval_seconds = s.eval_seconds if s.eval_seconds > 0 else s.max_time / 8
    s.nce_time = s.nce_time if s.nce_time > 0 else s.max_time / 2
    s.runs, s.cfgs = {}, {}
    for i, arch in enumerate(s.archs):
        base = dict(RACE_TRAIN, arch=arch, lr=RACE_LR.get(arch, 1.5e-3))
        forced = dict(out_dir=os.path.join(s.out_dir, arch), max_time=s.max_time,
                      eval_seconds=s.eval_seconds, overwrite=True)  # out_dir checked below
        args = flags(base) + presets[i:i + 1] + shared + per_arch.get(arch, []) + flags(forced)
        cfg = parse_args(args, TRAIN_DEFAULTS, RACE_DOC, CHOICES)
        if cfg['arch'] != arch:
            raise ValueError(f"the run named {arch} in --archs trains arch={cfg['arch']} (its "
                             f"preset or --{arch}.arch): list the presets in --archs order")
        s.runs[arch], s.cfgs[arch] = args, cfg
    first = s.cfgs[s.archs[0]]
    for arch, key in ((arch, key) for arch in s.archs[1:] for key in SAME_BATCHES):
        if s.cfgs[arch][key] != first[key]:
            raise ValueError(f"{s.archs[0]} and {arch} would evaluate on different batches "
                             f"({key} {first[key]!r} vs {s.cfgs[arch][key]!r}): "
                             f"set --{key} for all archs")
    s.data_dir, s.nce = first['data_dir'], nce
    load_meta(s.data_dir)  # prepared data, or the one-line error naming prepare.py
    s.dev = resolve_device(first['device'])
    s.torch_dtype, s.why = choose_dtype(s.dev, first['dtype'])
    s.pairs = s.pairs or os.path.join(s.data_dir, 'pairs_val.jsonl')
    s.ns = int_list(s.n, 'n', 3)
    race_check_outputs(s)
    return s


def race_check_outputs(s):
    """Every output place writable (and no earlier race replaced unasked) before any run starts."""
    check_out_dir(s.out_dir)
    for run in (arch + stage for arch in s.archs for stage in [''] + ['_nce'] * s.retrieval):
        check_run_dir(os.path.join(s.out_dir, run), fresh=True, overwrite=s.overwrite,
                      resumable=False)
    for name in ('race.md', 'race.json', 'race.png'):
        path = os.path.join(s.out_dir, name)
        if os.path.exists(path) and not s.overwrite:
            raise ValueError(f"{path} holds an earlier race: pass --overwrite, or a new --out_dir")
        check_output_file(path, 'out_dir')
    pyplot()
    if s.retrieval:
        for path in (os.path.join(s.data_dir, 'pairs_train.jsonl'), s.pairs):
            if not os.path.isfile(path):
                raise ValueError(f"--retrieval needs {path}: run python prepare.py "
                                 f"(or pass --pairs)")


def race_machine(dev):
    """The machine in words, for the picture's title."""
    if dev.type == 'cuda':
        return torch.cuda.get_device_name(dev)
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):  # no /proc/cpuinfo name: platform's
        with open('/proc/cpuinfo') as f:
            name = next(ln.split(':', 1)[1].strip() for ln in f if ln.startswith('model name'))
    return f"{name} ({torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores)"


def race_read_log(path, seen):
    """New complete lines of a growing log.jsonl past byte `seen`: (records, new seen)."""
    try:
        with open(path, 'rb') as f:
            f.seek(seen)
            chunk = f.read()
    except OSError:
        return [], seen
    done = chunk[:chunk.rfind(b'\n') + 1]
    return [json.loads(line) for line in done.splitlines() if line.strip()], seen + len(done)


def race_stop(procs):
    """SIGINT to each live run's process group (it exits as after Ctrl-C, its checkpoint whole),
    SIGKILL to any still there after 30 s."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
            os.killpg(p.pid, signal.SIGINT)
    deadline = time.time() + 30
    for p in live:
        try:
            p.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def race_jobs(s, jobs):
    """Run jobs [(name, argv, out_dir)] (argv: a script and its keys) and print a line per
    evaluation; on a CPU all at once, one thread each, so they share the cores and the machine's
    load alike; on a GPU one after another, since runs sharing a GPU get uneven slices of it that
    depend on their kernel sizes, which would be no equal budget. Returns ({name: eval records},
    {name: exit status and wall seconds since this call at its start and end}, interrupted?)."""
    cpu = s.dev.type == 'cpu'
    env = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1') if cpu else os.environ
    waves = [jobs] if cpu else [[j] for j in jobs]
    if cpu and len(jobs) > (os.cpu_count() or 1):
        print(f"note: {len(jobs)} runs share {os.cpu_count()} CPU core(s)", flush=True)
    curves, status, t0 = {name: [] for name, _, _ in jobs}, {}, time.time()
    logs = {name: [os.path.join(out, 'log.jsonl'), 0] for name, _, out in jobs}  # path, bytes read

    def read(name):  # the run's new evaluation records, a progress line each
        records, logs[name][1] = race_read_log(*logs[name])
        for r in (r for r in records if 'val_loss' in r):
            curves[name].append(r)
            print(f"  {name:<8} {r['time']:7.1f} s  step {r['step']:>6}  "
                  f"{r['tokens_seen'] / 1e6:7.3f}M tokens  val loss {r['val_loss']:.4f}",
                  flush=True)

    def ended(name, p):  # its log read after the exit: nothing is missed
        read(name)
        status[name].update(exit=p.returncode, ended=round(time.time() - t0, 2))
        if p.returncode:
            print(f"  {name} stopped (exit {p.returncode}): see "
                  f"{os.path.join(s.out_dir, name + '.out')}", flush=True)

    running, interrupted = {}, False
    try:
        for wave in waves:
            for name, argv, out in wave:
                with open(os.path.join(s.out_dir, f"{name}.out"), 'w') as console:
                    # a session of its own: a terminal's Ctrl-C reaches the race, which stops it
                    running[name] = p = subprocess.Popen(
                        [sys.executable, *argv], stdout=console, stderr=subprocess.STDOUT, env=env,
                        start_new_session=True)
                status[name] = dict(exit=None, started=round(time.time() - t0, 2))
            while running:
                time.sleep(0.5)
                for name, p in list(running.items()):
                    if p.poll() is None:
                        read(name)
                    else:
                        ended(name, running.pop(name))
    except KeyboardInterrupt:
        interrupted = True
    finally:  # whatever stopped the race stops its runs too
        race_stop(list(running.values()))
    for name, p in running.items():  # interrupted: what the stopped runs logged last
        ended(name, p)
    return curves, status, interrupted


def race_table(curves, metrics):
    """A row per arch evaluated: steps, tokens, tokens/s, best and final val loss, the training
    seconds at which its curve first reached each other arch's best (at an evaluation mark; never:
    not), then its retrieval top-1 per n."""
    rows, best = [], {a: min(r['val_loss'] for r in c) for a, c in curves.items() if c}
    for arch in best:
        c, last = curves[arch], curves[arch][-1]
        r = dict(arch=arch, steps=last['step'], tokens=last['tokens_seen'], train_s=last['time'],
                 tokens_per_s=last['tokens_seen'] / last['time'] if last['time'] else None,
                 best_val=best[arch], final_val=last['val_loss'])
        for other in best:
            if other != arch:
                hit = [e['time'] for e in c if e['val_loss'] <= best[other]]
                r[f"s_to_{other}_best"] = hit[0] if hit else 'never'
        r.update({f"top1_n{n}": v for n, v in metrics.get(arch, {}).get('top1', {}).items()})
        rows.append(r)
    return rows


def race_retrieval(s):
    """InfoNCE for s.nce_time seconds on each pretrained model (at once on a CPU), then top-1 per n
    on s.pairs: ({arch: retrieve.py eval's metrics}, interrupted?)."""
    script, jobs = os.path.join(HERE, 'retrieve.py'), []
    for arch in s.archs:
        out = os.path.join(s.out_dir, arch + '_nce')
        keys = dict(RACE_NCE, lr=RACE_NCE_LR.get(arch, 5e-4), data_dir=s.data_dir,
                    device=s.cfgs[arch]['device'], out_dir=out,
                    init_from=os.path.join(s.out_dir, arch, 'ckpt.pt'))
        forced = dict(max_time=s.nce_time, eval_seconds=s.nce_time / 4, overwrite=True)
        jobs.append((arch + '_nce', [script, 'train', *flags(keys), *s.nce, *flags(forced)], out))
    print(f"## retrieval: InfoNCE, {s.nce_time:g} s each", flush=True)
    _, status, interrupted = race_jobs(s, jobs)
    metrics = {}
    for arch in [] if interrupted else [a for a in s.archs if status[a + '_nce']['exit'] == 0]:
        out = os.path.join(s.out_dir, arch + '_eval.json')
        proc = subprocess.run([sys.executable, script, 'eval', *flags(dict(
            ckpt=os.path.join(s.out_dir, arch + '_nce', 'ckpt.pt'), pairs=s.pairs, n=s.n,
            json=out, device=s.cfgs[arch]['device']))], capture_output=True, text=True)
        if proc.returncode:
            print(f"  {arch} retrieval eval failed: {last_line(proc.stderr)}")
            continue
        with open(out) as f:
            metrics[arch] = json.load(f)
        top1 = metrics[arch]['top1']
        print(f"  {arch}: top-1 % " + ', '.join(f"n={n} {v:.1f}" for n, v in top1.items()),
              flush=True)
    return metrics, interrupted


def race_plot(s, curves, metrics, path):
    """Val loss vs training seconds and vs tokens seen, a line per arch (and top-1 vs n)."""
    plt = pyplot()
    panels = 2 + bool(metrics)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2))
    for arch, c in curves.items():
        if c:
            loss = [r['val_loss'] for r in c]
            axes[0].plot([r['time'] for r in c], loss, marker='.', label=arch)
            axes[1].plot([r['tokens_seen'] for r in c], loss, marker='.', label=arch)
    axes[0].set(xlabel='seconds of training (evaluation excluded)', ylabel='validation loss')
    axes[1].set(xlabel='tokens seen', ylabel='validation loss')
    for arch, m in metrics.items():
        axes[2].plot([int(n) for n in m['top1']], list(m['top1'].values()), marker='o', label=arch)
        axes[2].set(xscale='log', xlabel='n (n - 1 candidates)', ylabel='retrieval top-1 %',
                    title=f"after {s.nce_time:g} s of InfoNCE each")
        axes[2].set_xticks([int(n) for n in m['top1']], list(m['top1']), minor=False)
        axes[2].minorticks_off()
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    how = 'at once, 1 thread each' if s.dev.type == 'cpu' else 'one after another'
    fig.suptitle(f"{race_machine(s.dev)}, {str(s.torch_dtype)[6:]}: {s.max_time:g} s of training "
                 f"per model ({how})", fontsize=10)
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, format='png', dpi=80))
    plt.close(fig)


def race(argv):
    """python bench.py race (RACE_DOC): the table's rows, or 130 after Ctrl-C (what was measured
    is still written)."""
    s = race_settings(argv)
    print(f"race: {', '.join(s.archs)}, {s.max_time:g} s of training each, evaluated every "
          f"{s.eval_seconds:g} s; {s.dev} {str(s.torch_dtype)[6:]} ({s.why}); runs in {s.out_dir}",
          flush=True)
    jobs = [(arch, [os.path.join(HERE, 'train.py'), *s.runs[arch]], s.cfgs[arch]['out_dir'])
            for arch in s.archs]
    curves, status, interrupted = race_jobs(s, jobs)
    metrics = {}
    if s.retrieval and not interrupted and all(status[a]['exit'] == 0 for a in s.archs):
        metrics, interrupted = race_retrieval(s)
    rows = race_table(curves, metrics)
    cols = sorted(dict.fromkeys(k for r in rows for k in r), key=lambda c: c.startswith('top1'))
    cells = [{c: r.get(c, '') for c in cols} for r in rows]
    table = markdown(cells, cols) if rows else 'no evaluations'
    print(f"\n{table}\n", flush=True)
    settings = dict(archs=s.archs, max_time=s.max_time, eval_seconds=s.eval_seconds,
                    device=str(s.dev), dtype=str(s.torch_dtype)[6:], machine=race_machine(s.dev),
                    retrieval=s.retrieval, nce_time=s.nce_time if s.retrieval else None,
                    runs=s.runs, status=status, interrupted=interrupted)
    write_atomic(os.path.join(s.out_dir, 'race.md'), table + '\n')
    result = dict(settings=settings, table=rows, curves=curves, retrieval=metrics)
    write_atomic(os.path.join(s.out_dir, 'race.json'), json.dumps(result, indent=1))
    if rows:
        race_plot(s, curves, metrics, os.path.join(s.out_dir, 'race.png'))
    print(f"wrote {s.out_dir}/race.md, race.json" + ", race.png" * bool(rows), flush=True)
    if interrupted:
        print("interrupted: every run stopped; race.md, race.json and race.png hold what was "
              "measured, each run's last checkpoint is in its folder", file=sys.stderr)
        return 130
    return rows


def main(argv=None):
    """The measured rows (a list, for tests and notebooks); bad input: one `error: ...` line,
    status 2."""
    return run_main(lambda: run(argv), "interrupted: --json holds the rows measured so far; "
                                       "--plot is drawn only at the end, so it was not")


if __name__ == '__main__':
    status = main()
    sys.exit(0 if isinstance(status, list) else status)
