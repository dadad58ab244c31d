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

--archs, --n_ctx and --n_layers take comma lists and every mode runs their product (--batch_size
too, in generate). Sizes default per mode (`MODE --help` lists them), small enough for `all` in
minutes on 2 CPU cores; --full swaps in the paper's grid; the command line wins over both. Timed
modes run --repeats rounds: a table shows each cell's median round, a ratio its median over the
rounds (min-max). Models are untrained unless represent gets --ckpt; inputs are random tokens
unless --data_dir. The paper's memory settings: --batch_size=16 --n_heads=32.
"""
import json, os, re, resource, statistics, subprocess, sys, time
from types import SimpleNamespace

import numpy as np
import torch

from model import (Attention, Backbone, ELiTAAttention, ELiTAFeedForward, GatedMLP, MLP, Mixing,
                   ModelConfig, SwiGLU, TokenMixing, allowed, build_model, flops_per_token,
                   measure_peak_flops)
from prepare import (LOWEST, Tokenizer, check_output_file, int_list, parse_args, run_main,
                     write_atomic)
from retrieve import PairBatches, TextEncoder, info_nce
from sample import compiled_step, decode_layout
from train import (CHOICES, autocast, choose_dtype, configure_optimizer, load_checkpoint,
                   load_meta, model_from_checkpoint, resolve_device)

MODES = ('throughput', 'memory', 'generate', 'represent', 'retrieval', 'all')

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
FULL = {  # --full: the paper's (or the headline) settings
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
    s = parse_args(argv, defaults, BENCH_CHOICES, __doc__, positional='mode')
    if s['full']:  # parsed again so that argv's own values still win over the paper's
        s = parse_args(argv, dict(defaults, **FULL[mode]), BENCH_CHOICES, __doc__, 'mode')
    s['archs'] = s['archs'].split(',')
    for key in ('n_layers', 'n_ctx', 'batch_size'):
        s[key] = int_list(s[key], key, LOWEST[key])
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
    s = SimpleNamespace(**dict(s, mode=mode, keep=lambda r: r))  # run() sets keep, for --json
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
    peak = measure_peak_flops(s.dev, s.torch_dtype)
    print(f"peak: {peak / 1e9:.0f} GFLOP/s (best {s.dtype} square matmul on {s.device})")
    rows, gen = [], torch.Generator().manual_seed(s.seed)
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
            if s.dev.type == 'cuda':
                torch.cuda.empty_cache()
        rows.append(s.keep(row(s, cfg, batch_size=s.batch_size, ms_per_step=ms,
                               tokens_per_s=tps, mfu=mfu, peak_flops=peak)))
        print(f"  {cfg.arch} n_ctx={cfg.n_ctx}: "
              + ('OOM' if ms is None else f"{ms:.0f} ms/step, {tps:.0f} tokens/s"), flush=True)
    return rows


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
    peak = 0
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
    cmd = [sys.executable, os.path.abspath(__file__), 'memory_cell']
    proc = subprocess.run(cmd + [f'--{k}={v}' for k, v in keys.items()],
                          capture_output=True, text=True)
    if proc.returncode < 0:  # killed by a signal: the kernel's OOM killer, or an allocator's abort
        return None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ['no output'])[-1]
        raise ValueError(f"memory cell {arch} n_layers={n_layers} n_ctx={n_ctx} failed: {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])['peak_bytes']


def bench_memory(s):
    base = 0 if s.dev.type == 'cuda' else run_cell(s, 'none', 1, 2)
    rows = []
    for cfg in grid(s):
        peak = run_cell(s, cfg.arch, cfg.n_layers, cfg.n_ctx)
        mb = None if peak is None else (peak - base) / 2**20
        rows.append(s.keep(row(s, cfg, n_heads=cfg.n_heads, batch_size=s.batch_size,
                               device=s.device, mb=mb)))
        print(f"  {cfg.arch} n_layers={cfg.n_layers} n_ctx={cfg.n_ctx}: "
              + ('OOM' if mb is None else f"{mb:.0f} MB"), flush=True)
    return rows


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
    rows, gen = [], torch.Generator().manual_seed(s.seed)
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
                t0 = time.perf_counter()
                time_decoding(model, prompt, 2, method, s, step)  # warm-up (--compile: compile)
                warmup = time.perf_counter() - t0
                bandwidth = measure_read_bandwidth(s.dev, probe_mib)
                prefill, per_token = time_decoding(model, prompt, s.new_tokens, method, s, step)
                positions = range(s.prompt, s.prompt + s.new_tokens - 1)  # the timed steps'
                step_bytes = statistics.mean(decode_bytes(model, p, batch, method == 'cache')
                                             for p in positions)
                tps, ceiling = batch / per_token, batch * bandwidth / step_bytes
                bound = 'unknown' if llc is None else 'dram' if step_bytes > llc else 'cache'
                fraction = tps / ceiling if bound == 'dram' else None
                rows.append(s.keep(row(
                    s, cfg, method=method, prompt=s.prompt, new_tokens=s.new_tokens,
                    batch_size=batch, compile=s.compile and method == 'cache', warmup_s=warmup,
                    prefill_ms=1e3 * prefill, tokens_per_s=tps, mb_per_step=step_bytes / 1e6,
                    gb_per_s=bandwidth / 1e9, ceiling_tokens_per_s=ceiling, bound=bound,
                    fraction=fraction)))
                where = (f"{fraction:.0%} of it" if fraction is not None else "no fraction: "
                         + ("the last-level cache size is unknown" if llc is None else
                            f"the step fits the {llc / 2**20:.0f} MiB last-level cache"))
                print(f"  {cfg.arch} {method} batch {batch} (warm-up {warmup:.1f} s): "
                      f"{tps:.1f} tokens/s; DRAM ceiling {ceiling:.0f} ({step_bytes / 1e6:.1f} "
                      f"MB/step at {bandwidth / 1e9:.1f} GB/s), {where}", flush=True)
    return rows


# ----------------------------------------------------------------------------- retrieval

def bench_retrieval(s):
    """InfoNCE steps (in-batch negatives: batch_size queries + their targets, forward, backward,
    AdamW) on the same real pairs, once with every text left-padded to n_ctx and once trimmed
    (TextEncoder's trim: pad states shared by mixers, pad columns dropped by llama)."""
    data_dir = s.data_dir or 'data/pystdlib'
    try:
        tok = Tokenizer.from_meta(load_meta(data_dir), data_dir)
        pairs = PairBatches(dict(data_dir=data_dir, batch_size=s.batch_size, negatives='inbatch',
                                 seed=s.seed), tok, 0)
    except FileNotFoundError as e:  # a file of the data dir; a ValueError already names its fix
        raise ValueError(f"{e}: retrieval needs a data dir prepared with pairs (python prepare.py, "
                         f"or prepare.py text --pairs=ict), or pass --data_dir") from None
    rows = []
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
            rows.append(s.keep(row(s, cfg, batch_size=s.batch_size, real_tokens=real,
                                   ms_per_step=ms, padding=padding)))
            print(f"  {cfg.arch} n_ctx={cfg.n_ctx} {padding}: {ms:.0f} ms/step", flush=True)
    return rows


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
        hooks = [backbone.wte.register_forward_hook(lambda mod, inp, res: e),
                 backbone.blocks[layer - 1].register_forward_hook(
                     lambda mod, inp, res: out.update(x=res))]
        try:
            backbone(idx)
        finally:
            for h in hooks:
                h.remove()
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
    rows, gen = [], torch.Generator().manual_seed(s.seed)
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
            rows.append(s.keep(r))
    return rows


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
    mode = argv[0] if argv and argv[0] in MODE_DEFAULTS else ''  # --help shows its sizes
    args = parse_args(argv, dict(DEFAULTS, **MODE_DEFAULTS.get(mode, {})), BENCH_CHOICES, __doc__,
                      positional='mode')
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
        n, measured, runs = s.repeats if mode in TIMED else 1, [], []

        def keep(r):
            measured.append(r)
            save(measured)
            return r
        s.keep = keep
        for i in range(n):
            print(f"## {mode}" + (f", round {i + 1} of {n}" if n > 1 else ''), flush=True)
            runs.append(MEASURE[mode](s))
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


def main(argv=None):
    """The measured rows (a list, for tests and notebooks); bad input: one `error: ...` line,
    status 2."""
    return run_main(lambda: run(argv), "interrupted: --json holds the rows measured so far; "
                                       "--plot is drawn only at the end, so it was not")


if __name__ == '__main__':
    status = main()
    sys.exit(0 if isinstance(status, list) else status)
