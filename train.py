"""
Train a nanomixer model: one loop for every arch and objective, on one device or a DDP node.

  python train.py config/demo.py                    # the CPU demo (the defaults are GPU-sized)
  python train.py config/demo.py --init_from=resume # continue out_dir/ckpt.pt exactly
  torchrun --standalone --nproc_per_node=4 train.py config/fineweb_mixer.py     # one node

A step averages grad_accum micro-batches of batch_size sequences whatever the number of processes
(rank_pieces), and micro-batch j of step s is a pure function of (seed, split, s, j): a preset is
the same experiment on 1 GPU or 8, and a resumed run ends bit-identical (no model has dropout).
The run stops at max_iters steps or max_time seconds of training, whichever comes first; the
learning rate decays as that budget is used. --dtype=auto picks bf16 where the hardware has it
natively, else float32 (fp16 on old GPUs); the checkpoint records it and a resume keeps it.
out_dir gets ckpt.pt (last), best.pt (lowest val loss) and log.jsonl (one JSON object per line).
"""
import functools, json, math, os, sys, time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import ModelConfig, build_model, flops_per_token, objective_targets
from configurator import check_out_dir, parse_args, run_main, write_atomic
from prepare import DATASETS, SPLITS


# ----------------------------------------------------------------------------- configuration

LOOP_DEFAULTS = dict(
    out_dir='out',
    batch_size=16,          # sequences per micro-batch (per process)
    grad_accum=1,           # micro-batches per optimizer step, split over the DDP ranks
    lr=5e-4,                # paper: 5e-4 masked mixers, 2e-4 transformers
    min_lr=0.0,             # where the decay ends
    warmup_iters=100,
    schedule='linear',      # linear (paper) | cosine
    weight_decay=0.0,       # AdamW defaults, as in the paper
    grad_clip=1.0,          # 0 = off
    max_iters=5000,         # step budget, 0 = none
    max_time=0.0,           # seconds of training (evaluation excluded), 0 = none
    eval_interval=250,
    eval_seconds=0.0,       # > 0: evaluate every this many seconds of training instead
    eval_iters=20,
    log_interval=10,
    dtype='auto',           # auto: bf16 where native (CUDA, some CPUs), else fp32 (old GPUs: fp16)
    device='auto',          # auto = cuda if available, else cpu
    compile=False,
    seed=1337,
    overwrite=False,        # a scratch run may replace the run already in out_dir
)
DEFAULTS = dict(
    data_dir='data/pystdlib',
    batch_mode='packed',    # packed: random windows of the token stream | documents: padded chunks
    padding='right',        # documents: pads after the text (paper's CLM runs) or before it (§6.1)
    init_from='scratch',    # scratch | resume (out_dir/ckpt.pt)
    **{f.name: f.default for f in fields(ModelConfig) if f.name != 'vocab_size'},  # vocab: meta
    **LOOP_DEFAULTS,
)
CHOICES = dict(batch_mode=('packed', 'documents'), padding=('right', 'left'),
               schedule=('linear', 'cosine'), init_from=('scratch', 'resume'),
               dtype=('auto', 'bfloat16', 'float16', 'float32'))
MODEL_KEYS = [f.name for f in fields(ModelConfig) if f.name != 'vocab_size']


def check_loop(cfg):
    """The loop keys' ranges (train.py's and retrieve.py's runs), checked before any work."""
    for key in ('batch_size', 'grad_accum', 'eval_interval', 'eval_iters', 'log_interval'):
        if cfg[key] < 1:
            raise ValueError(f"--{key}={cfg[key]} is out of range: use a value >= 1")
    for key in ('warmup_iters', 'max_iters', 'max_time', 'min_lr', 'weight_decay', 'grad_clip',
                'seed'):
        if cfg[key] < 0:
            raise ValueError(f"--{key}={cfg[key]} is out of range: use a value >= 0")
    if not 0 < cfg['lr'] >= cfg['min_lr']:
        raise ValueError(f"--lr={cfg['lr']} must be > 0 and >= --min_lr={cfg['min_lr']}")
    budget_used(cfg, 0, 0.0)  # a run needs a budget


# ----------------------------------------------------------------------------- device, dtype, DDP

# Dense bf16/fp16 tensor-core peaks from NVIDIA datasheets (TFLOP/s, first match in this order);
# other GPUs, CPUs and float32 are measured (peak_flops).
GPU_PEAK_TFLOPS = {'H200': 989, 'H100 PCIe': 756, 'H100': 989, 'A100': 312, 'L40S': 362,
                   'V100': 125}
NO_BF16_ENV = 'NANOMIXER_NO_BF16'  # set: act as a CPU without native bf16 (tests the fallback)


def choose_dtype(device, requested='auto', recorded=None, reading=False):
    """The one dtype rule, as (torch dtype, why). An explicit --dtype is used as asked (bf16 that
    this CPU would emulate, hundreds of times slower, is warned). auto: a resumed run keeps the
    dtype it `recorded` where this device runs it natively; a new run takes bf16 on a GPU that
    has it (else fp16, with a GradScaler), bf16 on a CPU with native bf16 (AVX512-BF16, AMX),
    else float32. Reading a checkpoint (reading=True: sample.py, retrieve.py) is float32 on a CPU
    and the recorded dtype on CUDA."""
    cuda = device.type == 'cuda'
    cpu_native = torch.ops.mkldnn._is_mkldnn_bf16_supported() and not os.environ.get(NO_BF16_ENV)
    native = dict(float32=True, float16=cuda,
                  bfloat16=torch.cuda.is_bf16_supported() if cuda else cpu_native)
    if requested != 'auto':
        if not native[requested]:
            print(f"warning: --dtype={requested} is emulated on this {device.type}: hundreds of "
                  f"times slower than float32 (--dtype=float32)", file=sys.stderr)
        return getattr(torch, requested), 'as asked'
    if reading and not cuda:
        return torch.float32, 'a CPU reads checkpoints in float32'
    if native.get(recorded):
        return getattr(torch, recorded), f'the {recorded} of the run it continues'
    if cuda:
        fp16 = torch.float16, 'fp16 with a GradScaler: this GPU has no bf16'
        return (torch.bfloat16, 'bf16 on this GPU') if native['bfloat16'] else fp16
    cap = torch.backends.cpu.get_cpu_capability()
    fp32 = torch.float32, f'no native bf16 on this CPU ({cap})'
    return (torch.bfloat16, f'native bf16 on this CPU ({cap})') if native['bfloat16'] else fp32


def resolve_device(name):
    """'auto' (CUDA if present, else CPU), 'cpu', 'cuda' or 'cuda:N' as a usable torch.device."""
    if name == 'auto':
        name = 'cuda' if torch.cuda.is_available() else 'cpu'
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device={name} is not a torch device: use auto, cpu, cuda or cuda:N") \
            from None
    if device.type not in ('cpu', 'cuda'):
        raise ValueError(f"--device={name}: nanomixer runs on cpu or cuda (or auto)")
    if device.type == 'cpu':
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"--device={name} but no CUDA GPU is visible: use --device=cpu (or auto)")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device={name}: this machine has {torch.cuda.device_count()} "
                         f"GPU(s), cuda:0 and up")
    return torch.device('cuda', index)  # with an index, as some CUDA calls (memory limits) need


def autocast(device, dtype):
    """bf16/fp16 autocast on device; float32 runs as is."""
    return nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype)


@functools.cache
def peak_flops(device, dtype, budget=0.25):
    """MFU's denominator, its one definition (train.py's log and bench.py throughput): the
    datasheet peak of a known GPU in bf16/fp16, else the best FLOP/s of a square matmul in dtype,
    measured once per process: the size doubles from 128 (up to 4096) while the next fits in what
    is left of `budget` seconds. On a CPU one thread is timed and scaled by the thread count:
    small matmuls on several threads measure wake-ups, not arithmetic."""
    cuda = device.type == 'cuda'
    name = torch.cuda.get_device_name(device) if cuda else ''
    table = [v for k, v in GPU_PEAK_TFLOPS.items() if k in name and dtype != torch.float32]
    if table:
        return table[0] * 1e12
    threads = torch.get_num_threads()
    deadline, best, n = time.perf_counter() + budget, 0.0, 128
    torch.set_num_threads(threads if cuda else 1)
    try:
        while True:
            a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
            dt = float('inf')
            for _ in range(4):  # the first run warms up; keep the best of all
                sync(device)
                t0 = time.perf_counter()
                a @ b
                sync(device)
                dt = min(dt, time.perf_counter() - t0)
            best = max(best, 2 * n ** 3 / dt)
            if n >= 4096 or time.perf_counter() + 4 * 8 * dt > deadline:  # 2n costs 8x
                return best * (1 if cuda else threads)
            n *= 2
    finally:
        torch.set_num_threads(threads)


def sync(device):
    """Wait for the GPU's queued work, so that a clock reads what it did."""
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


@dataclass
class Runtime:
    """Where this process trains: device, autocast dtype (and why), GradScaler, DDP rank, world."""
    device: torch.device
    dtype: torch.dtype
    scaler: torch.amp.GradScaler
    rank: int = 0
    world: int = 1
    why: str = ''  # printed in the first log line
    distributed: bool = False  # launched by torchrun: a process group and DDP, even for one process

    master = property(lambda self: self.rank == 0)  # the process that logs and saves

    def describe(self):
        ddp = f", DDP over {dist.get_backend()}" if self.distributed else ''
        return f"{self.device} {str(self.dtype)[6:]} ({self.why}){ddp}"

    def close(self):
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def rank_pieces(grad_accum, batch_size, world, rank):
    """This rank's share of a step, as (micro, shard, shards) triples: the grad_accum
    micro-batches are dealt out to the ranks, and where the ranks outnumber them each is cut into
    `shards` equal row shards (fit weighs a shard's mean loss by its share of the micro-batch's
    real targets); DDP averages the ranks: the same step whatever the world size."""
    shards = world // math.gcd(grad_accum, world)
    if batch_size % shards:
        raise ValueError(f"{world} processes cannot share a step of grad_accum={grad_accum} x "
                         f"batch_size={batch_size}: use a batch_size divisible by {shards}, or a "
                         f"grad_accum divisible by {world}")
    per_rank = grad_accum * shards // world
    return [(p // shards, p % shards, shards)
            for p in range(rank * per_rank, (rank + 1) * per_rank)]


def setup_runtime(cfg, recorded=None):
    """Device, DDP (when launched by torchrun), AMP dtype (recorded: the dtype name of the run being
    resumed, kept under --dtype=auto) and GradScaler; seeds torch."""
    env = lambda key, default: int(os.environ.get(key, default))  # noqa: E731 (set by torchrun)
    world, rank, local_rank = env('WORLD_SIZE', 1), env('RANK', 0), env('LOCAL_RANK', 0)
    distributed = 'RANK' in os.environ
    rank_pieces(cfg['grad_accum'], cfg['batch_size'], world, rank)  # refuses early
    device = resolve_device(cfg['device'])
    dtype, why = choose_dtype(device, cfg['dtype'], recorded)
    if device.type == 'cuda':
        device = torch.device('cuda', local_rank if distributed else (device.index or 0))
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if distributed and not dist.is_initialized():
        dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo')
    torch.manual_seed(cfg['seed'])  # identical initial weights on every rank
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    return Runtime(device, dtype, scaler, rank, world, why, distributed)


def check_on_every_rank(runtime, check):
    """Run check() (a ValueError refuses) on every rank and share the refusals before any other
    collective: all ranks exit 2 together, rank 0 printing the one line (not DDP tracebacks)."""
    if not runtime.distributed:
        return check()
    try:
        check()
        error = ''
    except ValueError as e:
        error = str(e)
    errors = [None] * runtime.world
    dist.all_gather_object(errors, error)
    if any(errors):
        if runtime.master:   # before any rank exits: torchrun stops the others when one does
            print(f"error: {next(e for e in errors if e)}", file=sys.stderr, flush=True)
        dist.barrier()
        raise SystemExit(2)   # run_main returns it as the exit status


# ----------------------------------------------------------------------------- the loop

def configure_optimizer(model, lr, weight_decay, device_type, betas=(0.9, 0.999)):
    """AdamW (the paper's betas); weight decay on matrices and mixings, not on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=weight_decay),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    kernel = dict(fused=True) if device_type in ('cuda', 'cpu') else dict(foreach=True)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **kernel)


def get_lr(cfg, step, progress):
    """Linear warmup over warmup_iters steps, then linear (paper) or cosine decay to min_lr
    as progress, the used fraction of the compute budget, goes from 0 to 1."""
    if step < cfg['warmup_iters']:
        return cfg['lr'] * (step + 1) / (cfg['warmup_iters'] + 1)
    p = min(max(progress, 0.0), 1.0)
    decay = 1 - p if cfg['schedule'] == 'linear' else 0.5 * (1 + math.cos(math.pi * p))
    return cfg['min_lr'] + (cfg['lr'] - cfg['min_lr']) * decay


def budget_used(cfg, step, train_time):
    """Fraction of the budget spent: the larger of the step and time fractions."""
    if not cfg['max_iters'] and not cfg['max_time']:
        raise ValueError("no compute budget: set --max_iters and/or --max_time (seconds)")
    steps = step / cfg['max_iters'] if cfg['max_iters'] else 0.0
    return max(steps, train_time / cfg['max_time'] if cfg['max_time'] else 0.0)


def fit(cfg, runtime, model, get_batch, loss_fn, ckpt_extra, resume=None, flops_per_token=None,
        real_targets=None):
    """Train `model` until the budget is spent, evaluating and checkpointing every eval_interval.
    get_batch(split, step, micro, shard=0, shards=1) -> a tuple of CPU tensors (the first one's
    numel counts as tokens), a pure function of its arguments (step None: evaluation batch micro).
    loss_fn(model, batch) -> scalar loss, through model(...) where DDP's hooks are. ckpt_extra goes
    into every checkpoint; resume (a checkpoint dict) is continued exactly. real_targets(batch) ->
    how many targets loss_fn averages over where row shards differ (padded documents), else None.
    Returns dict(step, tokens_seen, train_time, best_val, train_loss, val_loss, stopped), stopped
    'budget' or 'diverged' (a non-finite loss: nothing more is saved, the last checkpoint stays)."""
    out_dir, device, scaler, master = cfg['out_dir'], runtime.device, runtime.scaler, runtime.master
    log_path, ckpt_path = os.path.join(out_dir, 'log.jsonl'), os.path.join(out_dir, 'ckpt.pt')
    check_on_every_rank(runtime, lambda: check_run_dir(out_dir, resume is None, cfg['overwrite'],
                                                       resumable=os.path.isfile(ckpt_path)))
    if resume is not None:
        check_budget_left(cfg, resume['step'], resume['train_time'])
    if master:
        remove_leftovers(out_dir, resume is None)
    raw = model.to(device)
    ckpt_extra = {**ckpt_extra, 'dtype': str(runtime.dtype)[6:]}  # the run's dtype: resume keeps it
    optimizer = configure_optimizer(raw, cfg['lr'], cfg['weight_decay'], device.type)
    step, tokens_seen, train_time, best_val = 0, 0, 0.0, float('inf')
    if resume is not None:  # what the checkpoints below hold
        raw.load_state_dict(resume['model'])
        optimizer.load_state_dict(resume['optimizer'])
        if scaler.is_enabled() and resume.get('scaler'):
            scaler.load_state_dict(resume['scaler'])
        step, tokens_seen, train_time, best_val = (
            resume[k] for k in ('step', 'tokens_seen', 'train_time', 'best_val'))
        if master:
            trim_log(log_path, step)
    net = torch.compile(raw) if cfg['compile'] else raw
    ddp = net if not runtime.distributed else DDP(
        net, device_ids=[device.index] if device.type == 'cuda' else None)
    log = open(log_path, 'a') if master else None
    peak = peak_flops(device, runtime.dtype) if flops_per_token else None
    pieces = rank_pieces(cfg['grad_accum'], cfg['batch_size'], runtime.world, runtime.rank)
    start, saved = step, step if resume is not None else None  # saved: the checkpoint's step
    train_loss, val_loss, stopped = float('nan'), float('nan'), 'budget'
    loss_sum = torch.zeros((), device=device)  # of the micro-batch losses since the last log line
    logged_step, logged_tokens, logged_time = step, tokens_seen, train_time  # at the last log line
    began = time.perf_counter()  # wall clock of this process, evaluation included
    raw.train()
    every = max(cfg['eval_seconds'], 0.0)  # > 0: evaluate at marks of training time
    next_eval = 0.0 if start == 0 or not every else (train_time // every + 1) * every
    while True:
        progress = budget_used(cfg, step, train_time)
        due = (train_time >= next_eval if every else
               step % cfg['eval_interval'] == 0 and (step > start or start == 0))
        if progress >= 1 or due:
            next_eval = (train_time // every + 1) * every if every else 0.0
            losses = evaluate(cfg, runtime, net, get_batch, loss_fn)
            train_loss, val_loss = losses['train'], losses['val']
            write_log(log, step=step, train_loss=train_loss, val_loss=val_loss,
                      tokens_seen=tokens_seen, time=round(train_time, 3))
            if not (math.isfinite(train_loss) and math.isfinite(val_loss)):
                stopped = diverged(master, 'the evaluation loss', losses, step, out_dir, saved)
                break
            improved, best_val = val_loss < best_val, min(best_val, val_loss)
            if master:
                print(f"step {step}: train loss {train_loss:.4f}, val loss {val_loss:.4f}")
                if step > 0:  # all the next step depends on: batches are keyed by step, no RNG
                    ckpt = {**ckpt_extra, 'step': step, 'tokens_seen': tokens_seen,
                            'train_time': train_time, 'best_val': best_val,
                            'model': raw.state_dict(), 'config': cfg,
                            'optimizer': optimizer.state_dict(),
                            'scaler': scaler.state_dict() if scaler.is_enabled() else None}
                    # best.pt first: a crash between the two leaves both whole
                    for name in ('best.pt', 'ckpt.pt') if improved else ('ckpt.pt',):
                        save_checkpoint(ckpt, os.path.join(out_dir, name))
                    saved = step
        if progress >= 1:
            break

        # one optimizer step: this rank's micro-batches (or row shards of them); DDP averages
        t0 = time.perf_counter()
        lr = get_lr(cfg, step, progress)
        for group in optimizer.param_groups:
            group['lr'] = lr
        for i, (micro, shard, shards) in enumerate(pieces):
            batch = get_batch('train', step, micro, shard, shards)
            weight = 1.0  # shards x this shard's share of the micro-batch's targets (rank_pieces)
            if shards > 1 and real_targets:  # a rank can draw the whole micro-batch: no collective
                whole = real_targets(get_batch('train', step, micro))
                weight = shards * real_targets(batch) / whole
            batch = to_device(batch, device)
            sync = i == len(pieces) - 1 or not runtime.distributed  # DDP syncs the last backward
            with nullcontext() if sync else ddp.no_sync(), autocast(device, runtime.dtype):
                loss = loss_fn(ddp, batch) * weight  # x 1.0 is exact
            scaler.scale(loss / len(pieces)).backward()
            loss_sum += loss.detach()
            tokens_seen += batch[0].numel() * runtime.world  # every rank's share is this size
        if cfg['grad_clip']:
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg['grad_clip'])
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        dt = time.perf_counter() - t0
        if (cfg['max_time'] or every) and runtime.distributed:  # ranks follow rank 0's clock
            dt_t = torch.tensor([dt], dtype=torch.float64, device=device)
            dist.broadcast(dt_t, 0)
            dt = dt_t.item()
        train_time += dt

        if step % cfg['log_interval'] == 0 or budget_used(cfg, step, train_time) >= 1:
            if runtime.distributed:
                dist.all_reduce(loss_sum)
            n_steps, interval_t = step - logged_step, train_time - logged_time
            mean_loss = loss_sum.item() / (n_steps * len(pieces) * runtime.world)
            if not math.isfinite(mean_loss):
                stopped = diverged(master, 'the training loss', mean_loss, step, out_dir, saved)
                break
            tps = (tokens_seen - logged_tokens) / interval_t
            rec = dict(loss=round(mean_loss, 5), lr=lr, tokens_per_s=round(tps, 1),
                       ms_per_step=round(1000 * interval_t / n_steps, 2), tokens_seen=tokens_seen)
            if cfg['grad_clip']:
                rec['grad_norm'] = round(grad_norm.item(), 4)
            if peak:
                rec['mfu'] = round(flops_per_token * tps / (peak * runtime.world), 4)
            write_log(log, step=step, **rec)
            if master:
                left = time_left(cfg, step, train_time, interval_t / n_steps)
                print(f"step {step} | loss {mean_loss:.4f} | lr {lr:.2e} | "
                      f"{rec['ms_per_step']:.0f} ms/step | {tps:,.0f} tok/s"
                      + (f" | mfu {rec['mfu']:.1%}" if peak else '')
                      + f" | {clock(time.perf_counter() - began)} elapsed, ~{clock(left)} left")
            loss_sum.zero_()
            logged_step, logged_tokens, logged_time = step, tokens_seen, train_time
    if log:
        log.close()
    if runtime.distributed:  # rank 0 may still be writing the checkpoint: leave together
        dist.barrier()
    return dict(step=step, tokens_seen=tokens_seen, train_time=train_time, best_val=best_val,
                train_loss=train_loss, val_loss=val_loss, stopped=stopped)


def check_budget_left(cfg, step, train_time):
    """A resumed run whose budget is spent would only evaluate again: say how to go on instead."""
    if budget_used(cfg, step, train_time) >= 1:
        raise ValueError(f"the run in {cfg['out_dir']} has spent its budget (step {step} of "
                         f"max_iters={cfg['max_iters']}, {train_time:.0f} s of max_time="
                         f"{cfg['max_time']:g}): to train on, raise --max_iters or --max_time")


def time_left(cfg, step, train_time, s_per_step):
    """Seconds of training left (evaluation excluded): the step or time budget, whichever ends
    first, steps at the last interval's pace."""
    left = [(cfg['max_iters'] - step) * s_per_step] if cfg['max_iters'] else []
    return max(min(left + ([cfg['max_time'] - train_time] if cfg['max_time'] else [])), 0.0)


def clock(seconds):
    """1:02:03 or 2:03 (h:mm:ss or m:ss)."""
    h, m, s = int(seconds) // 3600, int(seconds) // 60 % 60, int(seconds) % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def write_log(log, **record):
    """One JSON line of log.jsonl (log is None on ranks other than 0); NaN is not JSON: null."""
    if log:
        log.write(json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                              for k, v in record.items()}) + '\n')
        log.flush()


def diverged(master, what, value, step, out_dir, saved):
    """Say that training blew up, and where the last good checkpoint is; fit's `stopped`."""
    if master:
        last = (f"{os.path.join(out_dir, 'ckpt.pt')} (step {saved})" if saved is not None
                else "none (nothing was saved)")
        print(f"error: {what} is {value} at step {step}: training stopped; the last good "
              f"checkpoint is {last}. Lower --lr or keep --grad_clip on", file=sys.stderr)
    return 'diverged'


EVAL_QUIET_S = 3.0  # an evaluation that lasts longer shows its progress on stderr


@torch.no_grad()
def evaluate(cfg, runtime, model, get_batch, loss_fn):
    """Mean loss over the eval_iters fixed batches of each split (shared out over the ranks)."""
    model.eval()
    out, began, shown = {}, time.perf_counter(), False
    for split in SPLITS:
        total = torch.zeros(2, device=runtime.device, dtype=torch.float64)  # (sum of losses, count)
        for i in range(runtime.rank, cfg['eval_iters'], runtime.world):
            with autocast(runtime.device, runtime.dtype):
                batch = to_device(get_batch(split, None, i), runtime.device)
                total[0] += loss_fn(model, batch).double()
            total[1] += 1
            if runtime.master and time.perf_counter() - began > EVAL_QUIET_S:
                shown = print(f"\revaluating {split}: batch {i + 1} of {cfg['eval_iters']}",
                              end='', file=sys.stderr, flush=True) or True
        if runtime.distributed:
            dist.all_reduce(total)
        out[split] = (total[0] / total[1]).item()
    if shown:  # the next line starts clean
        print('\r\033[K', end='', file=sys.stderr, flush=True)
    model.train()
    return out


def to_device(batch, device):
    pin = device.type == 'cuda'
    return tuple(None if t is None else (t.pin_memory() if pin else t).to(device, non_blocking=pin)
                 for t in batch)


# ----------------------------------------------------------------------------- checkpoints

OLD_LAYOUT = 'be76ede'  # the last commit whose blocks were lists of sublayers


def save_checkpoint(obj, path):
    """Atomic (configurator.write_atomic): a crash never leaves a half-written checkpoint."""
    write_atomic(path, lambda f: torch.save(obj, f))


def load_checkpoint(path):
    """A checkpoint's dict, on the CPU, after checking that it is one of nanomixer's."""
    if not os.path.isfile(path):
        raise ValueError(f"no checkpoint at {path}: train one with python train.py (or pass the "
                         f"right out_dir)")
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:  # truncated zip, wrong file, pickled classes: all the same to the user
        why = (str(e).strip().splitlines() or [''])[0][:160]
        raise ValueError(f"{path} is not a readable nanomixer checkpoint "
                         f"({type(e).__name__}: {why})") from None
    if not isinstance(ckpt, dict) or not {'kind', 'model'} <= ckpt.keys():
        raise ValueError(f"{path} is not a readable nanomixer checkpoint (no 'kind'/'model' "
                         f"entries)")
    if any('.layers.' in key for key in ckpt['model']):  # blocks were lists of sublayers then
        raise ValueError(f"{path} has an older model layout: read it with nanomixer at commit "
                         f"{OLD_LAYOUT} (git checkout {OLD_LAYOUT}), or train again")
    return ckpt


def model_from_checkpoint(ckpt):
    """The checkpoint's model, weights loaded, in eval mode (on CPU; move it where you need it)."""
    if 'model_config' not in ckpt:
        raise ValueError(f"a {ckpt.get('kind')!r} checkpoint without model_config cannot be "
                         f"rebuilt here")
    model = build_model(ModelConfig(**ckpt['model_config']))
    model.load_state_dict(ckpt['model'])
    return model.eval()


RUN_FILES = ('ckpt.pt', 'best.pt', 'log.jsonl')  # what makes an out_dir hold a training run


def check_run_dir(out_dir, fresh, overwrite, resumable=True):
    """Fail before any work if out_dir is not writable, or if a fresh run would replace its run
    unasked (--overwrite)."""
    held = [f for f in RUN_FILES if os.path.isfile(os.path.join(out_dir, f))]
    writer = int(os.environ.get('RANK', 0)) == 0  # DDP: rank 0 writes; the others may look later
    if fresh and held and not overwrite and writer:
        resume = "continue it with --init_from=resume, " if resumable else ""
        raise ValueError(f"out_dir {out_dir} already holds a run ({', '.join(held)}): {resume}"
                         f"replace it with --overwrite, or pass a new --out_dir")
    check_out_dir(out_dir)


def remove_leftovers(out_dir, fresh):
    """Delete killed runs' temp files (NAME.tmpPID, the process gone) and, if fresh, the old run."""
    for name in os.listdir(out_dir):
        _, tmp, pid = name.rpartition('.tmp')
        if tmp and pid.isdigit() and not pid_alive(int(pid)) or fresh and name in RUN_FILES:
            os.remove(os.path.join(out_dir, name))


def pid_alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except OSError as e:  # PermissionError: alive, but another user's
        return not isinstance(e, ProcessLookupError)


def trim_log(path, step):
    """Drop the log records past `step`, written by a run that died after its last checkpoint
    (a last line without its newline was cut short by kill -9)."""
    if os.path.exists(path):
        lines = Path(path).read_text().splitlines(keepends=True)
        kept = [r for r in lines if r.endswith('\n') and json.loads(r)['step'] <= step]
        write_atomic(path, ''.join(kept))


def check_resumable(ckpt, path, mcfg):
    """Resuming into a different model (arch, n_ctx, vocab, ...) would fail obscurely later."""
    if ckpt['kind'] != 'lm':
        raise ValueError(f"{path} is a {ckpt['kind']!r} checkpoint, not one of train.py's")
    theirs, ours = ckpt['model_config'], asdict(mcfg)
    diff = [k for k in ours if theirs.get(k) != ours[k]]
    if diff:
        was = ', '.join(f"{k}={theirs.get(k)!r}" for k in diff)
        now = ', '.join(f"{k}={ours[k]!r}" for k in diff)
        raise ValueError(f"{path} was trained with {was} but this run asks for {now} "
                         f"(vocab_size comes from --data_dir): resume with the same preset and "
                         f"flags, or train into a new --out_dir")


# ----------------------------------------------------------------------------- data

def load_meta(data_dir):
    path = os.path.join(data_dir, 'meta.json')
    if not os.path.isfile(path):
        raise ValueError(f"no prepared data at {data_dir}: {prepare_command(data_dir)}")
    try:
        meta = json.loads(Path(path).read_text())
        np.dtype(meta['dtype'])
        if not (isinstance(meta['vocab_size'], int) and meta['vocab_size'] > 0):
            raise ValueError('vocab_size')
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is damaged ({type(e).__name__}: {e}): prepare the data again "
                         f"with prepare.py") from None
    return meta


def batch_rng(cfg, split, step, micro):
    """The numpy Generator of one micro-batch (step None: evaluation batch `micro`): a pure function
    of its arguments, so DDP ranks draw disjoint batches and a resumed run draws the same ones."""
    return np.random.default_rng([cfg['seed'], SPLITS.index(split), int(step is not None),
                                  step or 0, micro])


class Batches:
    """get_batch for language modelling over prepare.py's outputs (see fit)."""

    def __init__(self, cfg, meta, data_dir):
        self.cfg, self.n = cfg, cfg['n_ctx']
        if self.n < 2:  # an input token and the next one to predict
            raise ValueError(f"--n_ctx={self.n} is out of range: a language model needs n_ctx >= 2")
        self.pad = meta.get('pad_id')
        if cfg['batch_mode'] == 'documents' and self.pad is None:
            raise ValueError(f"{data_dir}/meta.json has no pad_id, which batch_mode=documents "
                             f"needs: re-run prepare.py")
        self.tokens, self.docs = {}, {}
        for split in SPLITS:
            path = os.path.join(data_dir, f'{split}.bin')
            if not os.path.isfile(path):
                raise ValueError(f"no prepared data at {path}: {prepare_command(data_dir)}")
            size, itemsize = os.path.getsize(path), np.dtype(meta['dtype']).itemsize
            if size != meta.get(f'{split}_tokens', size // itemsize) * itemsize or size % itemsize:
                raise ValueError(f"{path} has {size} bytes but {data_dir}/meta.json says "
                                 f"{meta.get(f'{split}_tokens')} {meta['dtype']} tokens: the file "
                                 f"is cut short or replaced; prepare the data again")
            if size < (self.n + 2) * itemsize:
                raise ValueError(f"{path} holds {size // itemsize} tokens, too few for "
                                 f"n_ctx={self.n}: lower --n_ctx or prepare more text")
            tokens = np.memmap(path, dtype=meta['dtype'], mode='r')
            self.tokens[split] = tokens
            if cfg['batch_mode'] == 'documents':  # rows are n_ctx-token chunks of documents
                try:
                    starts = np.load(os.path.join(data_dir, f'{split}_docs.npy')).astype(np.int64)
                except (OSError, ValueError) as e:
                    why = getattr(e, 'strerror', None) or e
                    raise ValueError(f"{data_dir}/{split}_docs.npy is missing or damaged ({why}): "
                                     f"prepare the data again") from None
                lengths = np.diff(np.append(starts, len(tokens)))
                chunks = (lengths + self.n - 2) // self.n  # ceil((length - 1) / n_ctx) with targets
                if not chunks.sum():
                    raise ValueError(f"{data_dir}: no {split} document has 2 tokens or more")
                self.docs[split] = (starts, lengths, np.cumsum(chunks))

    def __call__(self, split, step, micro, shard=0, shards=1):
        """(x, targets, mask): x (B, n_ctx) inputs, targets for the objective, mask (B, n_ctx) or
        None. With shards > 1 only rows [shard * B/shards, (shard + 1) * B/shards) of the batch."""
        cfg, n, tokens, B = self.cfg, self.n, self.tokens[split], self.cfg['batch_size']
        rng = batch_rng(cfg, split, step, micro)
        rows = slice(shard * B // shards, (shard + 1) * B // shards)
        if cfg['batch_mode'] == 'packed':  # nanoGPT: random windows of n_ctx + 1 tokens
            offsets = rng.integers(0, len(tokens) - n, size=B)[rows]
            w = torch.from_numpy(np.stack([tokens[o:o + n + 1] for o in offsets]).astype(np.int64))
            x, y, mask = w[:, :-1], w[:, 1:], None
        else:  # a random chunk of a document (its first n_ctx + 1 tokens, its next ...), padded
            starts, lengths, ends = self.docs[split]
            chunks = rng.integers(0, ends[-1], size=B)[rows]
            x = np.full((len(chunks), n), self.pad, dtype=np.int64)
            y = np.full((len(chunks), n), -1, dtype=np.int64)
            for row, c in enumerate(chunks):
                d = np.searchsorted(ends, c, side='right')    # the document holding chunk c
                at = (c - (ends[d - 1] if d else 0)) * n       # chunk start within the document
                w = tokens[starts[d] + at:starts[d] + min(lengths[d], at + n + 1)].astype(np.int64)
                k = len(w) - 1
                col = n - k if cfg['padding'] == 'left' else 0
                x[row, col:col + k], y[row, col:col + k] = w[:-1], w[1:]
            x, y = torch.from_numpy(x), torch.from_numpy(y)
            mask = y != -1  # (B, n_ctx) True on real input tokens
        return x, objective_targets(cfg['objective'], x, y, mask), mask


def prepare_command(data_dir):
    """The prepare.py command that builds data_dir (a preset's data/NAME: its dataset NAME)."""
    name = os.path.basename(os.path.normpath(data_dir))
    if name in DATASETS and os.path.normpath(data_dir) == os.path.join('data', name):
        return f"run python prepare.py {name} (a preset's docstring gives its options)"
    return f"run python prepare.py (or prepare.py DATASET --out_dir={data_dir}), or pass --data_dir"


# ----------------------------------------------------------------------------- main

def main(argv=None):
    return run_main(lambda: train_lm(argv), "interrupted")


def train_lm(argv):
    cfg = parse_args(argv, DEFAULTS, __doc__, CHOICES)
    if not (sys.argv[1:] if argv is None else argv) and resolve_device('auto').type == 'cpu':
        raise ValueError("the defaults are sized for a GPU (a 23M-parameter model, 5000 steps: "
                         "hours on a CPU): run python train.py config/demo.py (minutes), or give "
                         "flags (such as --device=cpu) to run them anyway")
    check_loop(cfg)
    meta = load_meta(cfg['data_dir'])
    mcfg = ModelConfig(vocab_size=meta['vocab_size'], **{k: cfg[k] for k in MODEL_KEYS})
    resume, path = None, os.path.join(cfg['out_dir'], 'ckpt.pt')
    if cfg['init_from'] == 'resume':
        if not os.path.isfile(path):
            raise ValueError(f"no checkpoint at {path} to resume: start afresh with "
                             f"--init_from=scratch --overwrite (or pass the run's --out_dir)")
        resume = load_checkpoint(path)
        check_resumable(resume, path, mcfg)
        check_budget_left(cfg, resume['step'], resume['train_time'])
    get_batch = Batches(cfg, meta, cfg['data_dir'])
    runtime = setup_runtime(cfg, resume and resume.get('dtype'))
    try:
        model = build_model(mcfg)
        if runtime.master:
            print(f"{mcfg.arch} {mcfg.objective}: "
                  f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
                  f"{runtime.describe()}, {runtime.world} process(es), "
                  f"{cfg['batch_size'] * cfg['grad_accum'] * mcfg.n_ctx:,} tokens per step")
        extra = {'kind': 'lm', 'model_config': asdict(mcfg),
                 'data': {'data_dir': os.path.abspath(cfg['data_dir']), 'meta': meta}}
        loss_fn = lambda model, batch: model(batch[0], targets=batch[1], mask=batch[2])[1]  # noqa
        # lm_loss averages over the targets that are not -1: padded documents give each row shard
        # its own count (mtp2's second term, one fewer a row, is weighed as the first); packed: all
        docs = cfg['batch_mode'] == 'documents'
        count = (lambda batch: int((batch[1] != -1).sum())) if docs else None
        stats = fit(cfg, runtime, model, get_batch, loss_fn, extra, resume, flops_per_token(mcfg),
                    count)
    except KeyboardInterrupt:  # checkpoints are written atomically: the last one is whole
        if runtime.master:
            print("interrupted: " + ("continue from the last checkpoint with --init_from=resume"
                                     if os.path.isfile(path) else "nothing was saved yet (no "
                                     "checkpoint before the first evaluation): rerun with "
                                     "--overwrite"), file=sys.stderr)
        return 130
    finally:
        runtime.close()
    if stats['stopped'] == 'diverged':
        return 1
    if runtime.master:
        print(f"done: step {stats['step']}, {stats['train_time']:.1f} s of training, val loss "
              f"{stats['val_loss']:.4f} (best {stats['best_val']:.4f}); checkpoint in {path}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
