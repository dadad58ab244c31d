"""
Sample text from a model trained with train.py; tokens stream to stdout as they are generated.

    python sample.py --prompt="def main("                       # out/best.pt (else out/ckpt.pt)
    python sample.py --ckpt=out/ckpt.pt --prompt=FILE:start.py --num_samples=3 --top_k=50
    python sample.py --prompt="def main(" --temperature=0 --method=window  # greedy, the paper's
    python sample.py --prompt="def main(" --compile            # compiled cached steps

--method picks a decoder of model.py's LanguageModel.stream. `window` is the paper's (§4.2): each
new token goes to the next position of the n_ctx window and the whole window runs again, O(n^3 d)
for n tokens. `cache` (default) keeps what each mixing has seen (position t depends only on
positions <= t), so a new token costs one row of every mixing, O(n^2 d) per window; transformers
use their KV cache. Both run in one dtype (auto: fp32 on a CPU), so they print the same tokens
(tested greedy). A full window keeps its last n_ctx/2 tokens and goes on.
"""
import os, sys, time, warnings
from types import SimpleNamespace

import torch

import prepare
from configurator import parse_args, read_text_file, run_main
from train import CHOICES, choose_dtype, load_checkpoint, model_from_checkpoint, resolve_device

DEFAULTS = dict(
    out_dir='out',          # train.py's out_dir: samples from best.pt, else ckpt.pt
    ckpt='',                # a checkpoint file, instead of --out_dir
    prompt='',              # text to continue, or FILE:path; empty: start a new document
    num_samples=1,          # decoded as one batch; the first streams, the others print at the end
    max_new_tokens=256,     # at most: a sample ends earlier where the model ends the document
    temperature=0.8,        # 0 = greedy
    top_k=-1,               # keep the k most likely tokens (>= 1); -1 = keep all
    top_p=1.0,              # nucleus sampling mass in (0, 1]; 1 = off
    seed=1337,              # the same seed gives the same samples
    method='cache',         # cache (exact, O(n^2 d) per window) | window (the paper's, O(n^3 d))
    compile=False,          # torch.compile the cached step: faster after a one-time compile
    device='auto',          # auto = cuda if available, else cpu
    dtype='auto',           # the weights' dtype; auto: fp32 on a CPU, else the trained one
)


def sample_args(argv):
    choices = dict(method=('cache', 'window'), dtype=CHOICES['dtype'])
    args = SimpleNamespace(**parse_args(argv, DEFAULTS, __doc__, choices))
    if args.ckpt and args.out_dir != DEFAULTS['out_dir']:
        raise ValueError('give --out_dir or --ckpt, not both')
    if not (args.temperature == 0 or args.temperature >= 1e-3):  # (parse_args refuses nan and inf)
        raise ValueError(f'--temperature={args.temperature} must be 0 (greedy) or >= 0.001')
    if not (args.top_k >= 1 or args.top_k == -1):
        raise ValueError(f'--top_k={args.top_k} must be >= 1 (or -1, the default: every token)')
    if not 0 < args.top_p <= 1:
        raise ValueError(f'--top_p={args.top_p} must lie in (0, 1] (1 = off)')
    if args.num_samples < 1 or args.max_new_tokens < 0:
        raise ValueError('--num_samples must be >= 1 and --max_new_tokens >= 0')
    if args.seed < 0:
        raise ValueError(f'--seed={args.seed} is out of range: use a value >= 0')
    return args


def load(path, device, requested='auto'):
    """(model, tokenizer, why) of a train.py language-model checkpoint, the weights cast once to
    the decoding dtype and laid out for batch-1 GEMVs (a step is bound by reading the weights)."""
    ckpt = load_checkpoint(path)
    if ckpt['kind'] != 'lm':
        raise ValueError(f"{path} is a {ckpt['kind']!r} checkpoint: sample from a train.py one")
    mcfg = ckpt['model_config']
    if mcfg['objective'] not in ('clm', 'mtp2') or not mcfg['causal'] or mcfg['n_ctx'] < 2:
        raise ValueError(f"{path} holds a model with objective={mcfg['objective']}, "
                         f"causal={mcfg['causal']}, n_ctx={mcfg['n_ctx']}: only causal next-token "
                         f"models (clm, mtp2), n_ctx >= 2, generate text")
    try:
        tok = prepare.Tokenizer.from_meta(ckpt['data']['meta'], ckpt['data']['data_dir'])
    except ValueError as e:
        raise ValueError(f"{e}: {path} reads its tokenizer from the data_dir it was trained on; "
                         f"prepare that data again there") from None
    dtype, why = choose_dtype(device, requested, ckpt.get('dtype'), reading=True)
    return decode_layout(model_from_checkpoint(ckpt).to(device, dtype)), tok, why


# ----------------------------------------------------------------------------- fast CPU decoding

# max-autotune writes a table of timings per tuned op to stderr as it compiles: off, unless
# asked for with inductor's own environment variables (TORCHINDUCTOR_ and the key in capitals)
QUIET_AUTOTUNE = {key: value for key, value in dict(autotune_num_choices_displayed=0,
                                                    max_autotune_report_choices_stats=False).items()
                  if f'TORCHINDUCTOR_{key.upper()}' not in os.environ}

def decode_layout(model):
    """Store each CPU Linear weight with its longer side contiguous (same values; returns model).
    A batch-1 step is one GEMV per weight, and MKL streams a weight ~2x faster along its long side
    (AVX2 EPYC: the 8000 x 256 lm_head at 10 GB/s row-major, 26 GB/s column-major)."""
    for mod in model.modules():
        w = getattr(mod, 'weight', None)
        if isinstance(mod, torch.nn.Linear) and w.device.type == 'cpu' and w.shape[0] > w.shape[1]:
            w.data = w.data.t().contiguous().t()
    return model


def compiled_step(model):
    """model.step through torch.compile: one dynamic-shape graph for every position. On a CPU the
    weights are frozen into it as constants (inductor's freezing), so that max-autotune repacks
    each Linear for its own GEMV kernel, bias and GELU fused in (a batch-1 step ~1.2-1.3x faster,
    README); frozen weights must not change afterwards, so the step refuses if they did."""
    if next(model.parameters()).device.type != 'cpu':
        return torch.compile(model.step, dynamic=True)
    compiled = torch.compile(model.step, dynamic=True,
                             options=dict(max_autotune=True, **QUIET_AUTOTUNE))
    # nor the deprecation warning that max-autotune's CPU benchmarks raise inside torch
    warnings.filterwarnings('ignore', 'TypedStorage is deprecated', UserWarning,
                            r'torch\._inductor')
    config, versions = torch._inductor.config, param_versions(model)

    def step(tok, pos, cache):  # dynamo reads `freezing` as it traces, inside the call
        if param_versions(model) != versions:
            raise ValueError("the weights changed after compiled_step froze them: decode eagerly, "
                             "or compile the step again")
        frozen, config.freezing = config.freezing, True
        try:
            return compiled(tok, pos, cache)
        finally:
            config.freezing = frozen
    return step


def param_versions(model):  # in-place writes to each parameter so far (optimizer steps, loads)
    return [p._version for p in model.parameters()]


def write_samples(model, tok, ids, args, generator, step=None):
    """Decode args.num_samples continuations of the prompt ids as one batch (a cached step is bound
    by reading the weights, so N rows cost little more than one); stream the first, print the others
    at the end between lines of dashes. A row ends at its end of document, the batch when all have.
    Returns the number of new tokens."""
    samples, ended = [list(ids) for _ in range(args.num_samples)], [False] * args.num_samples
    idx = torch.tensor(samples, dtype=torch.long, device=generator.device)     # (num_samples, T0)
    shown = tok.decode(ids)
    sys.stdout.write(shown)
    for tokens, _ in model.stream(idx, args.max_new_tokens, temperature=args.temperature,
                                  method=args.method, top_k=args.top_k if args.top_k > 0 else None,
                                  top_p=args.top_p, generator=generator, step=step):
        for i, token in enumerate(tokens.tolist()):                      # tokens (num_samples,)
            ended[i] = ended[i] or token == tok.eos_id
            if not ended[i]:
                samples[i].append(token)
        text = tok.decode(samples[0]).rstrip('\ufffd')  # a split character prints once whole
        if len(text) > len(shown):
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
        if all(ended):
            break
    sys.stdout.write(tok.decode(samples[0])[len(shown):] + '\n')  # what was held back, if anything
    sys.stdout.write(''.join('-' * 40 + '\n' + tok.decode(sample) + '\n' for sample in samples[1:]))
    return sum(len(sample) - len(ids) for sample in samples)


def sample(argv):
    args = sample_args(argv)
    device = resolve_device(args.device)
    best = os.path.join(args.out_dir, 'best.pt')  # the lowest val loss
    path = args.ckpt or (best if os.path.isfile(best) else os.path.join(args.out_dir, 'ckpt.pt'))
    model, tok, why = load(path, device, args.dtype)
    prompt = args.prompt
    if prompt.startswith('FILE:'):
        prompt = read_text_file(prompt[len('FILE:'):], '--prompt=FILE: file')
    ids, keep = tok.encode(prompt, bos=True), model.cfg.n_ctx - 1  # room for a new token
    if len(ids) > keep:
        print(f'warning: the prompt has {len(ids)} tokens; keeping its last {keep} (the window '
              f'holds n_ctx={keep + 1})', file=sys.stderr)
        ids = ids[-keep:]
    dtype = str(next(model.parameters()).dtype)[6:]
    print(f'sampling from {path} ({model.cfg.arch}, method {args.method}, {device} {dtype}: {why})',
          file=sys.stderr)
    step = None
    if args.compile and args.method == 'cache' and args.max_new_tokens:   # timed on its own
        t0 = time.perf_counter()
        step = compiled_step(model)  # compiled on a batch shaped like the samples', 2+ positions
        idx = torch.tensor([list(ids)] * args.num_samples, dtype=torch.long, device=device)
        list(model.stream(idx, 3, temperature=0, method='cache', step=step))  # compiles
        print(f'compiled the cached step in {time.perf_counter() - t0:.1f} s (once per process; '
              f'not in the tokens/s below)', file=sys.stderr)
    t0 = time.perf_counter()
    try:
        generator = torch.Generator(device=device).manual_seed(args.seed)
        n_new = write_samples(model, tok, ids, args, generator, step)
    except BrokenPipeError:  # the reader went away (| head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    dt = time.perf_counter() - t0
    print(f'{n_new} tokens ({args.num_samples} sample{"s" * (args.num_samples > 1)} in one batch) '
          f'in {dt:.2f} s ({n_new / max(dt, 1e-9):.1f} tokens/s)', file=sys.stderr)


def main(argv=None):
    return run_main(lambda: sample(argv), '')  # Ctrl-C: what was printed stays


if __name__ == '__main__':
    sys.exit(main())
