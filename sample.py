"""
Sample text from a model trained with train.py; tokens stream to stdout as they are generated.

    python sample.py --prompt="def main("                       # out/best.pt (else out/ckpt.pt)
    python sample.py --ckpt=out/ckpt.pt --prompt=FILE:start.py --num_samples=3 --top_k=50
    python sample.py --prompt="def main(" --temperature=0       # greedy
    python sample.py --prompt="def main(" --method=window       # the paper's generation, for comparison
    python sample.py --prompt="def main(" --compile             # compiled cached steps (after a compile)

A masked mixer has position-specific weights over a fixed window of n_ctx positions, so it
decodes inside that window. Both methods live in model.py (LanguageModel.stream):
  window  the paper's method (§4.2): the prompt sits at the start of the window, each new token is
          written at the next position and the whole window is run again. One forward costs
          O(n^2 d) for the mixing (plus O(n d^2) for the rest), so a window of n tokens costs O(n^3 d).
  cache   (default) position t's output depends only on positions <= t, so each layer keeps the
          inputs its mixing has already seen and a new token needs only its own row of every
          mixing: O(n d) per layer and token, O(n^2 d) per window — the analog of a transformer's
          KV cache. It computes the same numbers as `window` (tests check tokens and logits).
When the window is full, both keep its last n_ctx/2 tokens, re-encode them at the window start
and continue. Transformers use their KV cache (ELiTA: its recurrent running sums) for `cache`,
and plain full recomputation of the window for `window`.
--num_samples=N decodes the N samples as one batch: a cached step at batch 1 is bound by reading
the weights, so N rows cost little more than one (the same seed and N give the same samples).
"""
import argparse
import math
import os
import sys
import time

import torch

from prepare import Tokenizer
from prepare import read_text_file
from train import CHOICES, choose_dtype, load_checkpoint, model_from_checkpoint, resolve_device


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump: main() prints it as "error: ..."
        raise ValueError(message)


def parse_args(argv):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
               epilog='Temperature 0 is greedy. top_k and top_p filter before sampling; both may be given.')
    p.add_argument('--out_dir', help="train.py's out_dir: samples from best.pt, else ckpt.pt (default out)")
    p.add_argument('--ckpt', help='a checkpoint file (instead of --out_dir)')
    p.add_argument('--prompt', default='', help='text to continue, or FILE:path to read it from a file '
                   '(default empty: start a new document)')
    p.add_argument('--num_samples', type=int, default=1, help='decoded as one batch; the first streams, the '
                   'others print when the batch is done, between lines of dashes (default 1)')
    p.add_argument('--max_new_tokens', type=int, default=256, help='at most (default 256); a sample ends '
                   'earlier when the model ends the document')
    p.add_argument('--temperature', type=float, default=0.8, help='>= 0; 0 = greedy (default 0.8)')
    p.add_argument('--top_k', type=int, default=None, help='keep the k most likely tokens (>= 1)')
    p.add_argument('--top_p', type=float, default=1.0, help='nucleus sampling mass in (0, 1]; 1 = off')
    p.add_argument('--seed', type=int, default=1337, help='same seed, same samples (default 1337)')
    p.add_argument('--method', choices=('cache', 'window'), default='cache',
                   help='cache (exact, O(n^2 d) per window) or window (the paper, O(n^3 d)); '
                        'for transformers, window is full recomputation without the KV cache')
    p.add_argument('--compile', action='store_true', help='torch.compile the cached decoding step: faster '
                   'steps after a one-time compile of seconds to a minute (see README, Sampling)')
    p.add_argument('--device', default='auto', help='auto = cuda if available, else cpu')
    p.add_argument('--dtype', choices=CHOICES['dtype'], default='auto',
                   help='dtype the weights are cast to for decoding (auto: bf16 on CUDA and on CPUs with native '
                        'bf16, else float32, as train.py decides)')
    args = p.parse_args(argv)
    if args.out_dir and args.ckpt:
        raise ValueError('give --out_dir or --ckpt, not both')
    if not (args.temperature == 0 or 1e-3 <= args.temperature < math.inf):
        raise ValueError(f'--temperature={args.temperature} must be 0 (greedy) or a number >= 0.001')
    if args.top_k is not None and args.top_k < 1:
        raise ValueError(f'--top_k={args.top_k} must be >= 1 (leave it out to keep every token)')
    if not 0 < args.top_p <= 1:
        raise ValueError(f'--top_p={args.top_p} must lie in (0, 1] (1 = off)')
    if args.num_samples < 1 or args.max_new_tokens < 0:
        raise ValueError('--num_samples must be >= 1 and --max_new_tokens >= 0')
    if not 0 <= args.seed < 2 ** 63:
        raise ValueError(f'--seed={args.seed} must lie in [0, 2**63)')
    return args


def checkpoint_path(args):
    """--ckpt, else out_dir/best.pt (lowest val loss) if train.py wrote one, else out_dir/ckpt.pt."""
    if args.ckpt:
        return args.ckpt
    out_dir = args.out_dir or 'out'
    best = os.path.join(out_dir, 'best.pt')
    return best if os.path.isfile(best) else os.path.join(out_dir, 'ckpt.pt')


def load(path, device, dtype):
    """(model, tokenizer) of a train.py language-model checkpoint."""
    ckpt = load_checkpoint(path, map_location='cpu')
    if ckpt['kind'] != 'lm':
        raise ValueError(f"{path} is a {ckpt['kind']!r} checkpoint: sample from a train.py checkpoint")
    mcfg = ckpt['model_config']
    if mcfg['objective'] not in ('clm', 'mtp2') or not mcfg['causal']:
        raise ValueError(f"{path} holds a model trained with objective={mcfg['objective']}, "
                         f"causal={mcfg['causal']}: only causal next-token models (clm, mtp2) generate text")
    if mcfg['n_ctx'] < 2:
        raise ValueError(f"{path} holds a model with n_ctx={mcfg['n_ctx']}: its window has no room for a new "
                         f"token after the first; train with --n_ctx >= 2")
    try:
        tok = Tokenizer.from_meta(ckpt['data']['meta'], ckpt['data']['data_dir'])
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}: {path} reads its tokenizer from the data_dir it was trained on; "
                                f"prepare that data again there") from None
    # Weights are cast once, not autocast: a decoding step is bound by reading the weights, and a
    # model stored in bf16 reads half the bytes and keeps no fp32 master copy.
    return model_from_checkpoint(ckpt).to(device, dtype), tok


def read_prompt(spec, tok, n_ctx):
    """Prompt token ids: BOS + text (documents start with BOS in prepare.py's streams), at most
    n_ctx - 1 of them so the first new token still fits in the window."""
    if spec.startswith('FILE:'):
        spec = read_text_file(spec[len('FILE:'):], '--prompt=FILE: file')
    ids = tok.encode(spec, bos=True)
    if len(ids) > n_ctx - 1:
        print(f'warning: the prompt has {len(ids)} tokens; keeping its last {n_ctx - 1} '
              f'(the window holds n_ctx={n_ctx})', file=sys.stderr)
        ids = ids[-(n_ctx - 1):]
    return ids


def write_samples(model, tok, ids, args, generator):
    """Decode args.num_samples samples of the prompt as one batch (a step reads the weights once
    for all of them); print the first as it is generated and the others when the batch is done,
    between lines of dashes. A sample ends at its end of document, the batch when all have.
    Returns the number of new tokens. The first sample is decoded whole at each step and only the
    new suffix printed, so pieces that are parts of one multi-byte character print once complete."""
    samples = [list(ids) for _ in range(args.num_samples)]
    idx = torch.tensor(samples, dtype=torch.long, device=generator.device)     # (num_samples, T0)
    ended = [False] * len(samples)
    shown = tok.decode(ids)
    sys.stdout.write(shown)
    steps = model.stream(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, method=args.method, generator=generator, compile=args.compile)
    for tokens, _ in steps:
        for i, token in enumerate(tokens.tolist()):
            ended[i] = ended[i] or token == tok.eos_id
            if not ended[i]:
                samples[i].append(token)
        text = tok.decode(samples[0]).rstrip('\ufffd')  # hold back an incomplete character
        if len(text) > len(shown):
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
        if all(ended):
            break
    sys.stdout.write(tok.decode(samples[0])[len(shown):] + '\n')  # what was held back, if anything
    for sample in samples[1:]:
        sys.stdout.write('-' * 40 + '\n' + tok.decode(sample) + '\n')
    return sum(len(sample) - len(ids) for sample in samples)


def main(argv=None):
    try:
        args = parse_args(argv)
        device = resolve_device(args.device)
        dtype, why = choose_dtype(device, args.dtype)
        path = checkpoint_path(args)
        model, tok = load(path, device, dtype)
        prompt = read_prompt(args.prompt, tok, model.cfg.n_ctx)
        print(f'sampling from {path} ({model.cfg.arch}, method {args.method}, {device} {str(dtype)[6:]}: {why})',
              file=sys.stderr)
        generator = torch.Generator(device=device).manual_seed(args.seed)
        t0 = time.perf_counter()
        n_new = write_samples(model, tok, prompt, args, generator)
    except (ValueError, FileNotFoundError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code or 0
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (| head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    dt = time.perf_counter() - t0
    print(f'{n_new} tokens ({args.num_samples} sample{"s" * (args.num_samples > 1)} in one batch) in {dt:.2f} s '
          f'({n_new / max(dt, 1e-9):.1f} tokens/s)', file=sys.stderr)
    return 0


if __name__ == '__main__':
    sys.exit(main())
