"""
Train a nanomixer model: one loop for every arch and objective, on one device or a DDP node.

  python train.py config/demo.py                    # the CPU demo (the defaults are GPU-sized)
  python train.py --init_from=resume --out_dir=out  # continue out/ckpt.pt exactly (flags win)
  torchrun --standalone --nproc_per_node=4 train.py config/fineweb_mixer.py     # one node

A step averages grad_accum micro-batches of batch_size sequences whatever the number of processes,
and each micro-batch is a pure function of (seed, split, step, micro): a preset is the same
experiment on 1 GPU or 8, and a resumed CPU run ends bit-identical (a max_time budget reads the
clock: there only the batches repeat). The run stops at max_iters steps or max_time seconds of
training, whichever comes first; the learning rate decays as that budget is used. out_dir gets
ckpt.pt (last), best.pt (lowest val loss) and log.jsonl (a JSON object a line).
"""
import json, math, os, sys, time
from contextlib import nullcontext
from dataclasses import asdict, fields
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import ModelConfig, build_model, flops_per_token, objective_targets
from configurator import check_out_dir, parse_args, run_main, write_atomic
from prepare import DATASETS, SPLITS, Tokenizer


# ----------------------------------------------------------------------------- configuration

LOOP_DEFAULTS = dict(
    out_dir='out',
    batch_size=16,          # sequences per micro-batch, not per rank (4 ranks: 4 rows each)
    grad_accum=1,           # micro-batches per optimizer step (each rank runs its rows of each)
    lr=5e-4,                # paper: 5e-4 masked mixers, 2e-4 transformers
    min_lr=0.0,             # where the decay ends
    warmup_iters=100,
    schedule='linear',      # linear (paper) | cosine
    weight_decay=0.0,       # none: the paper's (HF Trainer's default), not torch AdamW's 0.01
    grad_clip=1.0,          # 0 = off
    max_iters=5000,         # step budget, 0 = none
    max_time=0.0,           # seconds of training (evaluation excluded), 0 = none
    eval_interval=250,
    eval_seconds=0.0,       # > 0: evaluate every this many seconds of training instead
    eval_iters=20,
    log_interval=10,
    dtype='auto',           # auto: bf16 where native (CUDA, some CPUs), else fp32 (old GPUs: fp16);
                            # a resume keeps the run's
    device='auto',          # auto = cuda if available, else cpu
    compile=False,
    seed=1337,              # the initial weights and every batch
    overwrite=False,        # a scratch run may replace the run already in out_dir
)
MODEL_KEYS = {f.name: f.default for f in fields(ModelConfig) if f.name != 'vocab_size'}
DEFAULTS = dict(
    data_dir='data/pystdlib',
    batch_mode='packed',    # packed: random windows of the token stream | documents: padded chunks
    padding='right',        # documents: pads after the text (paper's CLM runs) or before it (§6.1)
    init_from='scratch',    # scratch | resume (out_dir/ckpt.pt, with the run's keys)
    **MODEL_KEYS,           # ModelConfig's fields but vocab_size, which meta.json gives
    **LOOP_DEFAULTS,
)
CHOICES = dict(batch_mode=('packed', 'documents'), padding=('right', 'left'),
               schedule=('linear', 'cosine'), init_from=('scratch', 'resume'),
               dtype=('auto', 'bfloat16', 'float16', 'float32'))


def check_loop(cfg, resume=None):
    """Refuse loop keys that would fail or mislead, and a resumed run whose budget is spent."""
    lows = dict(batch_size=1, grad_accum=1, eval_iters=1, eval_interval=1, log_interval=1,
                max_iters=0, max_time=0, eval_seconds=0, grad_clip=0, seed=0, warmup_iters=0,
                lr=0, min_lr=0, weight_decay=0)
    for key, low in lows.items():
        if not low <= cfg[key] < math.inf:  # (nan too; an infinite budget would never end)
            raise ValueError(f"--{key}={cfg[key]}: use {low} or more")
    if not (cfg['max_iters'] or cfg['max_time']):
        raise ValueError("no budget: set --max_iters and/or --max_time (s)")
    if resume and budget_used(cfg, resume['step'], resume['train_time']) >= 1:
        step, seconds = resume['step'], resume['train_time']
        done = dict(max_iters=step, max_time=seconds)
        spent = ' and '.join(f"--{k}={cfg[k]:g}" for k in done if 0 < cfg[k] <= done[k])
        raise ValueError(f"the run in {cfg['out_dir']} has spent its budget (step {step}, "
                         f"{seconds:.1f} s of training): to train on, raise {spent} (a resume "
                         f"keeps the run's other keys)")


# ----------------------------------------------------------------------------- device, dtype, DDP

# Dense bf16/fp16 peaks from NVIDIA datasheets (TFLOP/s, first match)
GPU_PEAK_TFLOPS = {'H200': 989, 'H100 PCIe': 756, 'H100': 989, 'A100': 312, 'L40S': 362,
                   'V100': 125}
NO_BF16_ENV = 'NANOMIXER_NO_BF16'  # set: act as a CPU without native bf16 (tests the fallback)


def choose_dtype(device, requested='auto', recorded=None, reading=False):
    """The one dtype rule, as (torch dtype, why): an explicit --dtype as asked; auto keeps the dtype
    a resumed run `recorded` where it is native, else bf16 where native (GPUs of compute capability
    8.0 on; CPUs where oneDNN has bf16 kernels: AVX-512 BW, VL and DQ, or better), fp16 on older
    GPUs, float32 on other CPUs. Reading a checkpoint (sample.py, retrieve.py): fp32 on a CPU.
    Applied two ways: training and retrieve.py's embeddings autocast over float32 weights (AdamW
    steps float32; autocast picks each op's dtype); decoding (sample.py, bench.py generate) casts
    the weights themselves, as a decoding step's time is spent reading them."""
    cuda = device.type == 'cuda'
    cpu_native = torch.ops.mkldnn._is_mkldnn_bf16_supported() and not os.environ.get(NO_BF16_ENV)
    gpu_bf16 = cuda and torch.cuda.is_bf16_supported(including_emulation=False)
    native = dict(float32=True, float16=cuda, bfloat16=gpu_bf16 if cuda else cpu_native)
    if requested != 'auto':
        if not native[requested]:
            print(f"warning: --dtype={requested} is emulated on this {device.type}: hundreds of "
                  f"times slower than float32 (--dtype=float32)", file=sys.stderr)
        return getattr(torch, requested), 'as asked'
    if reading and not cuda:
        return torch.float32, 'a CPU decodes and embeds in float32'
    if native.get(recorded):
        return getattr(torch, recorded), f'the {recorded} of the run it continues'
    if cuda:
        fp16 = torch.float16, 'fp16 with a GradScaler: this GPU has no native bf16'
        return (torch.bfloat16, 'bf16 on this GPU') if native['bfloat16'] else fp16
    cap = torch.backends.cpu.get_cpu_capability()
    fp32 = torch.float32, f'no native bf16 on this CPU ({cap})'
    return (torch.bfloat16, f'native bf16 on this CPU ({cap})') if native['bfloat16'] else fp32


def resolve_device(name):
    if name == 'auto':
        name = 'cuda' if torch.cuda.is_available() else 'cpu'
    if name.split(':')[0] not in ('cpu', 'cuda'):
        raise ValueError(f"--device={name}: use auto, cpu, cuda or cuda:N")
    device = torch.device(name)
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise ValueError(f"--device={name} but no CUDA GPU is visible: use --device=cpu (or auto)")
    if device.type == 'cuda' and device.index is None:  # some CUDA calls (memory limits) need one
        device = torch.device('cuda', torch.cuda.current_device())
    return device


def autocast(device, dtype):
    return nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype)


def peak_flops(device, dtype):
    """MFU's denominator: a known GPU's datasheet peak in bf16/fp16, else None (no MFU, as
    nanoGPT, which knows the A100's only)."""
    name = torch.cuda.get_device_name(device) if device.type == 'cuda' else ''
    peaks = [v * 1e12 for k, v in GPU_PEAK_TFLOPS.items() if k in name and dtype != torch.float32]
    return peaks[0] if peaks else None


def sync(device):
    """Wait for the GPU's queued work, so that a clock reads what it did."""
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def rank_batches(get_batch, step, grad_accum, rank, world, real_targets=None):
    """This rank's part of optimizer step `step` as (batch, scale) pairs: its B/world rows of each
    of the grad_accum micro-batches of B rows; it backpropagates each batch's loss x scale. Why N
    ranks make one process's step: one backpropagates sum_m L_m / grad_accum, L_m the mean loss
    over micro-batch m's targets. A rank's rows hold a share of those targets (1/world for full
    rows; real_targets counts them where padded rows differ), so L_m sums share x mean loss over the
    ranks, and DDP averages (/ world) their gradients: scale = share x world / grad_accum. Not exact
    in one case: mtp2 on padded documents, whose second term (a target fewer a row) takes the
    first's share."""
    for micro in range(grad_accum):
        batch = get_batch('train', step, micro, rank, world)
        share_x_world = 1.0  # full rows: share = 1/world, and 1.0 keeps the loss exact
        if world > 1 and real_targets:  # a rank can draw the whole micro-batch: no collective
            whole = real_targets(get_batch('train', step, micro))
            share_x_world = world * real_targets(batch) / max(whole, 1)  # none: lm_loss is 0
        yield batch, share_x_world / grad_accum


class Runtime:
    """Where this process trains: device, dtype (recorded: a resumed run's), DDP rank and world
    size. Refuses a device or a batch the ranks cannot use; the process group starts in fit."""

    def __init__(self, cfg, recorded=None):
        self.distributed = 'RANK' in os.environ  # torchrun: a process group and DDP, even for one
        self.rank = int(os.environ.get('RANK', 0))
        self.world = int(os.environ.get('WORLD_SIZE', 1))
        self.master = self.rank == 0  # the process that logs and saves
        if cfg['batch_size'] % self.world:  # before the process group starts (rank_batches)
            raise ValueError(f"{self.world} processes cannot share batch_size={cfg['batch_size']}"
                             f" rows: use a batch_size divisible by {self.world}")
        self.device = resolve_device(cfg['device'])
        self.dtype, self.why = choose_dtype(self.device, cfg['dtype'], recorded)
        self.backend = 'nccl' if self.device.type == 'cuda' else 'gloo'
        if self.device.type == 'cuda':
            if self.distributed:
                self.device = torch.device('cuda', int(os.environ.get('LOCAL_RANK', 0)))
            torch.cuda.set_device(self.device)
            # float32 matmuls in TF32 where the GPU has it, as nanoGPT (training runs only)
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        torch.manual_seed(cfg['seed'])  # identical initial weights on every rank

    def describe(self):
        ddp = f", DDP over {self.backend}" if self.distributed else ''
        return f"{self.device} {str(self.dtype)[6:]} ({self.why}){ddp}"

    def close(self):
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- the loop

def configure_optimizer(model, lr, weight_decay):
    """AdamW with the paper's betas; as nanoGPT, no weight decay on biases or norms."""
    decay, spare = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:  # by name: a mixing's bias, (heads, n_ctx, 1), has 3 dims
            (decay if p.dim() >= 2 and not name.endswith('bias') else spare).append(p)
    groups = [dict(params=decay, weight_decay=weight_decay), dict(params=spare, weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), fused=True)


def get_lr(cfg, step, progress):
    if step < cfg['warmup_iters']:
        return cfg['lr'] * (step + 1) / (cfg['warmup_iters'] + 1)
    decay = 1 - progress if cfg['schedule'] == 'linear' else (1 + math.cos(math.pi * progress)) / 2
    return cfg['min_lr'] + (cfg['lr'] - cfg['min_lr']) * decay


def budget_used(cfg, step, train_time):
    steps = step / cfg['max_iters'] if cfg['max_iters'] else 0.0
    return max(steps, train_time / cfg['max_time'] if cfg['max_time'] else 0.0)


def report(log, line, **record):
    """On rank 0 (log: log.jsonl's path) print line, append record as JSON (NaN and inf: null)."""
    if log:
        print(line)
        with open(log, 'a') as f:
            f.write(json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                                for k, v in record.items()}) + '\n')


@torch.no_grad()
def evaluate(cfg, runtime, model, get_batch, loss_fn):
    """Mean loss over the eval_iters fixed batches of each split (shared out over the ranks)."""
    model.eval()
    totals = torch.zeros(len(SPLITS), device=runtime.device, dtype=torch.float64)  # of the losses
    for j, split in enumerate(SPLITS):
        for i in range(runtime.rank, cfg['eval_iters'], runtime.world):
            with autocast(runtime.device, runtime.dtype):
                batch = to_device(get_batch(split, None, i), runtime.device)
                totals[j] += loss_fn(model, batch).double()
    if runtime.distributed:
        dist.all_reduce(totals)
    model.train()
    return dict(zip(SPLITS, (totals / cfg['eval_iters']).tolist()))


def to_device(batch, device):
    pin = device.type == 'cuda'  # pinned: the copy does not wait for the GPU's queued work
    return tuple(None if t is None else (t.pin_memory() if pin else t).to(device, non_blocking=pin)
                 for t in batch)


def fit(cfg, runtime, model, get_batch, loss_fn, ckpt_extra, resume=None, flops_per_token=None,
        real_targets=None):
    """Train `model` until the budget is spent, evaluating and checkpointing on the way (under
    torchrun the ranks meet here). get_batch(split, step, micro, shard=0, shards=1) -> a tuple of
    CPU tensors (the first's numel counts as tokens), a pure function of its arguments (step None:
    evaluation batch micro); loss_fn(model, batch) -> the loss, through model(...) where DDP's hooks
    are; real_targets: see rank_batches. Every checkpoint holds ckpt_extra; resume (a checkpoint) is
    continued exactly, else out_dir's run is replaced. stopped: 'diverged' at a non-finite loss."""
    out_dir, device, master = cfg['out_dir'], runtime.device, runtime.master
    log = os.path.join(out_dir, 'log.jsonl') if master else None
    if runtime.distributed and not dist.is_initialized():  # the ranks meet: none refuses after it
        dist.init_process_group(runtime.backend)
    # a fresh run replaces the run check_run_dir let it replace; any run drops the temp files a
    # write killed midway left (write_atomic's)
    for name in RUN_FILES if master else ():
        if resume is None:
            Path(out_dir, name).unlink(missing_ok=True)
        for tmp in Path(out_dir).glob(f'{name}.tmp*'):
            tmp.unlink()
    raw = model.to(device)
    optimizer = configure_optimizer(raw, cfg['lr'], cfg['weight_decay'])
    scaler = torch.amp.GradScaler(device.type, enabled=runtime.dtype == torch.float16)
    step, tokens_seen, train_time, best_val = 0, 0, 0.0, float('inf')
    if resume is not None:  # what the checkpoints below hold
        raw.load_state_dict(resume['model'])
        optimizer.load_state_dict(resume['optimizer'])
        if scaler.is_enabled() and resume['scaler']:
            scaler.load_state_dict(resume['scaler'])
        step, tokens_seen, train_time, best_val = (
            resume[k] for k in ('step', 'tokens_seen', 'train_time', 'best_val'))
        if any(cfg.get(k) != resume['config'].get(k) for k in EVAL_KEYS):  # evaluated otherwise
            best_val = float('inf')  # now: best.pt is chosen afresh, not against another loss
        if master and os.path.exists(log):  # drop what a run killed after this checkpoint logged
            lines = Path(log).read_text().splitlines(keepends=True)  # kill -9 may cut the last
            kept = [r for r in lines if r.endswith('\n') and json.loads(r)['step'] <= step]
            write_atomic(log, ''.join(kept))
    net = torch.compile(raw) if cfg['compile'] else raw
    ddp = DDP(net) if runtime.distributed else net  # on the device of the model's weights
    peak = peak_flops(device, runtime.dtype) if flops_per_token else None
    saved = step if resume is not None else None  # the step of the last checkpoint
    val_loss, diverged = float('nan'), ''
    loss_sum = torch.zeros((), device=device)  # of the scaled losses since the last log line
    logged_step, logged_tokens, logged_time = step, tokens_seen, train_time  # at the last log line
    began = time.perf_counter()  # wall clock of this process, evaluation included
    every = cfg['eval_seconds']  # > 0: evaluate at marks of training time, not of steps
    mark = lambda: train_time // every if every else step // cfg['eval_interval']  # noqa: E731
    evaluated = mark() if resume is not None else -1  # the mark of the last evaluation
    raw.train()
    while True:
        progress = budget_used(cfg, step, train_time)
        if progress >= 1 or mark() > evaluated:
            evaluated = mark()
            losses = evaluate(cfg, runtime, net, get_batch, loss_fn)
            train_loss, val_loss = losses['train'], losses['val']
            if not math.isfinite(train_loss + val_loss):
                diverged = f"the evaluation loss is {losses}"
                break
            report(log, f"step {step}: train loss {train_loss:.4f}, val loss {val_loss:.4f}",
                   step=step, train_loss=train_loss, val_loss=val_loss, tokens_seen=tokens_seen,
                   time=round(train_time, 3))
            improved = step > 0 and val_loss < best_val  # step 0 is never saved: no best
            best_val = val_loss if improved else best_val
            # all the next step depends on (restored above): no RNG state, as the only draws are
            # the batches', keyed by step (batch_rng); step and train_time also set the lr
            if master and step > 0:
                ckpt = {**ckpt_extra, 'step': step, 'tokens_seen': tokens_seen,
                        'train_time': train_time, 'best_val': best_val, 'config': cfg,
                        'model': raw.state_dict(), 'optimizer': optimizer.state_dict(),
                        'scaler': scaler.state_dict() if scaler.is_enabled() else None,
                        'dtype': str(runtime.dtype)[6:]}  # a resume keeps it
                # best.pt first: a crash between the two leaves both whole
                for name in ('best.pt', 'ckpt.pt') if improved else ('ckpt.pt',):
                    write_atomic(os.path.join(out_dir, name), lambda f: torch.save(ckpt, f))
                saved = step
        if progress >= 1:
            break

        # one optimizer step: this rank's rows of every micro-batch (rank_batches); DDP averages
        t0 = time.perf_counter()
        lr = get_lr(cfg, step, progress)
        for group in optimizer.param_groups:
            group['lr'] = lr
        for micro, (batch, scale) in enumerate(rank_batches(
                get_batch, step, cfg['grad_accum'], runtime.rank, runtime.world, real_targets)):
            batch = to_device(batch, device)
            last = micro == cfg['grad_accum'] - 1 or not runtime.distributed  # DDP syncs the last
            with nullcontext() if last else ddp.no_sync(), autocast(device, runtime.dtype):
                loss = loss_fn(ddp, batch) * scale
            scaler.scale(loss).backward()
            loss_sum += loss.detach()  # summed over the ranks: world x the step's mean loss
            tokens_seen += batch[0].numel() * runtime.world  # processed by the ranks, alike in size
        scaler.unscale_(optimizer)  # true gradients for their norm (a no-op unless fp16)
        grad_norm = torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg['grad_clip'] or math.inf)
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
            mean_loss = loss_sum.item() / (n_steps * runtime.world)
            if not math.isfinite(mean_loss):
                diverged = f"the training loss is {mean_loss}"
                break
            tps = (tokens_seen - logged_tokens) / interval_t
            rec = dict(step=step, loss=round(mean_loss, 5), lr=lr, tokens_per_s=round(tps, 1),
                       ms_per_step=round(1000 * interval_t / n_steps, 2), tokens_seen=tokens_seen,
                       grad_norm=round(grad_norm.item(), 4))
            if peak:
                rec['mfu'] = round(flops_per_token * tps / (peak * runtime.world), 4)
            mfu = f" | mfu {rec['mfu']:.1%}" if peak else ''
            elapsed = timedelta(seconds=int(time.perf_counter() - began))  # h:mm:ss
            done = budget_used(cfg, step, train_time)  # the rest at this interval's pace
            pace = interval_t / (done - budget_used(cfg, logged_step, logged_time))
            left = timedelta(seconds=int(max(0.0, 1 - done) * pace))  # evaluation apart
            report(log, f"step {step} | loss {mean_loss:.4f} | lr {lr:.2e} | "
                   f"{rec['ms_per_step']:.0f} ms/step | {tps:,.0f} tok/s{mfu} | {elapsed} elapsed, "
                   f"{left} left", **rec)
            loss_sum.zero_()
            logged_step, logged_tokens, logged_time = step, tokens_seen, train_time
    if diverged and master:
        path = os.path.join(out_dir, 'ckpt.pt')
        last = f"{path} (step {saved})" if saved is not None else "none (nothing was saved)"
        print(f"error: {diverged} at step {step}: training stopped; the last good checkpoint is "
              f"{last}. Lower --lr or keep --grad_clip on", file=sys.stderr)
    if runtime.distributed:  # rank 0 may still be writing the checkpoint: leave together
        dist.barrier()
    return dict(step=step, train_time=train_time, best_val=best_val, val_loss=val_loss,
                stopped='diverged' if diverged else 'budget')


# ----------------------------------------------------------------------------- checkpoints

def load_checkpoint(path, way_out='train one with train.py, or pass its path'):
    """A checkpoint's dict, on the CPU, after checking that it is one of nanomixer's."""
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder: pass the checkpoint file in it (ckpt.pt, best.pt)")
    if os.path.isfile(os.path.dirname(path)):  # --out_dir given a checkpoint file, say
        raise ValueError(f"{os.path.dirname(path)} is a file, not a run's folder")
    if not os.path.isfile(path):
        raise ValueError(f"no checkpoint at {path}: {way_out}")
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
        assert isinstance(ckpt, dict) and {'kind', 'model'} <= ckpt.keys(), "no 'kind'/'model'"
    except Exception as e:  # truncated zip, wrong file, pickled classes: all the same to the user
        why = (str(e).strip().splitlines() or [''])[0][:120]
        raise ValueError(f"{path} is not a readable nanomixer checkpoint ({type(e).__name__}: "
                         f"{why}): cut short, or another file; pass another (a run keeps ckpt.pt "
                         f"and best.pt)") from None
    return ckpt


def model_from_checkpoint(ckpt):
    """The checkpoint's model, weights loaded, in eval mode (on CPU; move it where you need it)."""
    assert 'model_config' in ckpt, f"a {ckpt['kind']!r} checkpoint holds no model to rebuild"
    model = build_model(ModelConfig(**ckpt['model_config']))
    model.load_state_dict(ckpt['model'])
    return model.eval()


RUN_FILES = ('ckpt.pt', 'best.pt', 'log.jsonl')  # what makes an out_dir hold a training run
EVAL_KEYS = ('data_dir', 'n_ctx', 'batch_size', 'eval_iters', 'seed', 'batch_mode', 'padding',
             'objective', 'tau', 'symmetric', 'negatives')  # what an evaluation measures


def check_run_dir(out_dir, fresh, overwrite, resumable=True):
    """Refuse an out_dir that is not writable, or whose run a fresh run would replace unasked."""
    held = [f for f in RUN_FILES if os.path.isfile(os.path.join(out_dir, f))]
    if fresh and held and not overwrite:
        resume = "continue it with --init_from=resume, " * (resumable and 'ckpt.pt' in held)
        raise ValueError(f"out_dir {out_dir} already holds a run ({', '.join(held)}): {resume}"
                         f"replace it with --overwrite, or pass a new --out_dir")
    check_out_dir(out_dir)


# ----------------------------------------------------------------------------- data

def load_meta(data_dir):
    """prepare.py's record of data_dir: vocab_size, dtype, token counts, tokenizer."""
    path = os.path.join(data_dir, 'meta.json')
    if not os.path.isfile(path):
        name = os.path.basename(os.path.normpath(data_dir))  # a preset's data/NAME: dataset NAME
        dataset = name if name in DATASETS else 'text --input=FILES'  # your own files
        # a folder or file that exists (your text itself?) is no place for prepare.py to write
        out = data_dir if name in DATASETS or not os.path.exists(data_dir) else 'data/NAME'
        raise ValueError(f"no prepared data at {data_dir}: run python prepare.py {dataset} "
                         f"--out_dir={out} (a preset's docstring gives the command), or "
                         f"pass --data_dir where it moved")
    try:
        meta = json.loads(Path(path).read_text())
        assert {'vocab_size', 'dtype', 'pad_id', 'tokenizer'} <= meta.keys(), 'keys are missing'
        return meta
    except (ValueError, AssertionError, AttributeError) as e:
        raise ValueError(f"{path} is damaged ({e}): prepare the data again") from None


def batch_rng(cfg, split, step, micro):
    """The numpy Generator of one micro-batch (step None: evaluation batch `micro`): a pure function
    of its arguments, so a resumed run, or one on more ranks, draws the same batches."""
    return np.random.default_rng([cfg['seed'], SPLITS.index(split), int(step is not None),
                                  step or 0, micro])


class Batches:
    """get_batch for language modelling over prepare.py's outputs (see fit)."""

    def __init__(self, cfg, meta, data_dir):
        self.cfg, self.n, self.pad = cfg, cfg['n_ctx'], meta['pad_id']
        self.tokens, self.docs = {}, {}
        for split in SPLITS:
            path = os.path.join(data_dir, f'{split}.bin')
            size = os.path.getsize(path) if os.path.isfile(path) else 0
            if size != meta[f'{split}_tokens'] * np.dtype(meta['dtype']).itemsize:
                raise ValueError(f"{path} is missing or not the {meta[f'{split}_tokens']} tokens "
                                 f"that {data_dir}/meta.json counts: prepare the data again")
            tokens = self.tokens[split] = np.memmap(path, dtype=meta['dtype'], mode='r')
            if cfg['batch_mode'] == 'packed' and len(tokens) <= self.n:  # a window + its target
                raise ValueError(f"the {split} split of {data_dir} holds {len(tokens):,} tokens, "
                                 f"fewer than a window of n_ctx={self.n} and its target: pass a "
                                 f"smaller --n_ctx, or prepare more text")
            if cfg['batch_mode'] == 'documents':  # rows are n_ctx-token chunks of documents
                docs = os.path.join(data_dir, f'{split}_docs.npy')
                if not os.path.isfile(docs):
                    raise ValueError(f"{docs} is missing: prepare the data again")
                starts = np.load(docs).astype(np.int64)
                lengths = np.diff(np.append(starts, len(tokens)))
                chunks = (lengths + self.n - 2) // self.n  # ceil((length - 1) / n_ctx) with targets
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


# ----------------------------------------------------------------------------- main

def main(argv=None):
    return run_main(lambda: train_lm(argv), "interrupted: checkpoints are written whole; continue "
                    "with --init_from=resume (before the first one: rerun with --overwrite)")


def train_lm(argv):
    cfg = parse_args(argv, DEFAULTS, __doc__, CHOICES)
    if not (sys.argv[1:] if argv is None else argv) and not torch.cuda.is_available():
        raise ValueError("the defaults are sized for a GPU (hours on a CPU): run python train.py "
                         "config/demo.py, or give flags (such as --device=cpu) to run them anyway")
    resume, path = None, os.path.join(cfg['out_dir'], 'ckpt.pt')
    if cfg['init_from'] == 'resume':
        resume = load_checkpoint(path, "to resume, pass the run's --out_dir, or start afresh: "
                                       "--init_from=scratch --overwrite")
        if resume['kind'] != 'lm':
            raise ValueError(f"{path} is of kind {resume['kind']!r}, not one of train.py's: use "
                             f"another --out_dir, or replace it: --init_from=scratch --overwrite")
        # the run's own keys are the defaults now (the folder may have moved); flags still win
        run = {**DEFAULTS, **resume['config'], 'out_dir': cfg['out_dir']}
        cfg = parse_args(argv, run, __doc__, CHOICES)
        trained = resume['model_config']
        asked = asdict(ModelConfig(**{**trained, **{k: cfg[k] for k in MODEL_KEYS}}))
        for k in (k for k in trained if asked[k] != trained[k]):
            raise ValueError(f"--{k}={asked[k]} contradicts {path}, trained with {k}="
                             f"{trained[k]!r}: drop the flag (or preset), or train into a new "
                             f"--out_dir")
    check_loop(cfg, resume)
    if cfg['padding'] == 'left' and cfg['batch_mode'] == 'packed':  # windows of a stream: no pads
        raise ValueError("--padding=left places a document's pads: add --batch_mode=documents")
    meta = load_meta(cfg['data_dir'])
    mcfg = ModelConfig(vocab_size=meta['vocab_size'], **{k: cfg[k] for k in MODEL_KEYS})
    if resume and meta.get('fingerprint') != resume['data']['meta'].get('fingerprint'):
        raise ValueError(f"{cfg['data_dir']} is not the data {path} was trained on (prepared "
                         f"again since?): pass the run's --data_dir, or train afresh")
    get_batch = Batches(cfg, meta, cfg['data_dir'])
    runtime = Runtime(cfg, resume and resume['dtype'])
    check_run_dir(cfg['out_dir'], resume is None, cfg['overwrite'])
    model = build_model(mcfg)
    if runtime.master and not mcfg.causal:  # allowed for encoders (retrieve.py train --init_from)
        print("warning: causal=False: position t reads token t + 1, the one it predicts, so the "
              "loss measures copying, not language modelling", file=sys.stderr)
    if runtime.master:
        print(f"{mcfg.arch} {mcfg.objective}: "
              f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
              f"{runtime.describe()}, {runtime.world} process(es), "
              f"{cfg['batch_size'] * cfg['grad_accum'] * mcfg.n_ctx:,} tokens per step")
    extra = {'kind': 'lm', 'model_config': asdict(mcfg),
             'tokenizer': Tokenizer(meta['tokenizer'], cfg['data_dir']).spec,  # from_checkpoint's
             'data': {'data_dir': os.path.abspath(cfg['data_dir']), 'meta': meta}}  # a record
    loss_fn = lambda model, batch: model(batch[0], targets=batch[1], mask=batch[2])[1]  # noqa
    # lm_loss averages over the targets that are not -1: row shards of padded documents differ,
    # packed rows are all full
    count = (lambda b: int((b[1] != -1).sum())) if cfg['batch_mode'] == 'documents' else None
    try:
        stats = fit(cfg, runtime, model, get_batch, loss_fn, extra, resume, flops_per_token(mcfg),
                    count)
    finally:
        runtime.close()
    if runtime.master and stats['stopped'] != 'diverged':
        print(f"done: step {stats['step']}, {stats['train_time']:.1f} s of training, val loss "
              f"{stats['val_loss']:.4f} (best {stats['best_val']:.4f}); checkpoint in {path}")
    return 1 if stats['stopped'] == 'diverged' else 0


if __name__ == '__main__':
    sys.exit(main())
