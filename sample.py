"""Sample text from a model trained with train.py; tokens stream to stdout as they are generated.

    python sample.py --prompt="def main("                       # out/best.pt (else out/ckpt.pt)
    python sample.py --ckpt=out/ckpt.pt --prompt=FILE:start.py --num_samples=3 --top_k=50
    python sample.py --prompt="def main(" --temperature=0 --method=window  # greedy, the paper's
    python sample.py --prompt="def main(" --compile            # compiled steps (GPU: CUDA graphs)

Both --method decoders (model.py's LanguageModel.stream) compute the same logits up to float
rounding, so they print the same tokens but at a near-tie; a full window keeps its last n_ctx/2
tokens and goes on.
"""
import os, sys, time
from types import SimpleNamespace

import torch

import prepare
from configurator import parse_args, read_text_file, run_main
from train import CHOICES, choose_dtype, load_checkpoint, model_from_checkpoint, resolve_device

DEFAULTS = dict(
    out_dir='out',          # train.py's out_dir: samples from best.pt, else ckpt.pt
    ckpt='',                # a checkpoint file; given, --out_dir is not read
    prompt='',              # text to continue, or FILE:path; empty: start a new document
    num_samples=1,          # decoded as one batch; the first streams, the others print at the end
    max_new_tokens=256,     # at most: a sample ends earlier where the model ends the document
    temperature=0.8,        # 0 = greedy
    top_k=0,                # keep the k most likely tokens; 0 = keep all
    top_p=1.0,              # nucleus sampling mass in (0, 1]; 1 = off
    seed=1337,              # the same seed gives the same samples
    method='cache',         # cache (the window's logits, to rounding; O(n^2 d)) | window (O(n^3 d))
    compile=False,          # torch.compile the cached step (GPU: as CUDA graphs), after a warm-up
    device='auto',          # auto = cuda if available, else cpu
    dtype='auto',           # auto: fp32 on a CPU; on a GPU the trained dtype (fp16 if not native)
)


def sample_args(argv):
    choices = dict(method=('cache', 'window'), dtype=CHOICES['dtype'])
    args = SimpleNamespace(**parse_args(argv, DEFAULTS, __doc__, choices))
    assert args.temperature >= 0, f'--temperature={args.temperature}: use 0 (greedy) or more'
    assert args.num_samples >= 1, f'--num_samples={args.num_samples}: use 1 or more'
    assert args.max_new_tokens >= 0, f'--max_new_tokens={args.max_new_tokens}: use 0 or more'
    assert args.top_k >= 0, f'--top_k={args.top_k}: use 0 (keep all) or more'
    assert 0 < args.top_p <= 1, f'--top_p={args.top_p}: use a mass in (0, 1] (1 = off)'
    assert not (args.compile and args.method == 'window'), '--compile compiles the cached step: ' \
        'drop it, or use --method=cache'
    return args


def load(path, device, requested):
    """(model, tokenizer, why) of a train.py language-model checkpoint, the weights cast once to
    the decoding dtype and laid out for batch-1 GEMVs (a step is bound by reading the weights)."""
    ckpt = load_checkpoint(path)
    if ckpt['kind'] != 'lm':
        raise ValueError(f"{path} is of kind {ckpt['kind']!r}: sample from a train.py checkpoint")
    mcfg = ckpt['model_config']
    if mcfg['objective'] not in ('clm', 'mtp2') or not mcfg['causal'] or mcfg['n_ctx'] < 2:
        raise ValueError(f"{path} holds a model of objective {mcfg['objective']} (causal="
                         f"{mcfg['causal']}, n_ctx={mcfg['n_ctx']}): only causal clm/mtp2 ones, "
                         f"n_ctx >= 2, generate")
    tok = prepare.Tokenizer.from_checkpoint(ckpt)
    assert tok.vocab_size == mcfg['vocab_size'], (
        f"{path}: a tokenizer of {tok.vocab_size} pieces for a model of {mcfg['vocab_size']}: its "
        f"data_dir was prepared again since")
    dtype, why = choose_dtype(device, requested, ckpt.get('dtype'), reading=True)
    return decode_layout(model_from_checkpoint(ckpt).to(device, dtype)), tok, why


def decode_layout(model):
    """Store each CPU Linear weight with its longer side contiguous (same values; returns model).
    A batch-1 step is one GEMV per weight, and MKL streams a weight ~2x faster along its long side
    (AVX2 EPYC: the 8000 x 256 lm_head at 10 GB/s row-major, 26 GB/s column-major)."""
    for w in [mod.weight for mod in model.modules() if isinstance(mod, torch.nn.Linear)]:
        if w.device.type == 'cpu' and w.shape[0] > w.shape[1]:
            w.data = w.data.t().contiguous().t()
    return model


def compiled_step(model):
    """model.step through torch.compile, dynamic shapes: one graph serves the positions of a
    window (its last one gets a second). On a GPU those steps are then captured as CUDA graphs
    (GraphStep), but ELiTA's: its cache holds running sums replaced each step, not buffers."""
    step = torch.compile(model.step, dynamic=True)
    cuda = next(model.parameters()).is_cuda
    return GraphStep(step) if cuda and model.cfg.arch != 'elita' else step


class GraphStep:
    """A cached step (B, 1) -> logits (B, vocab) replayed as CUDA graphs, one per window position.
    At batch 1 a step is a hundred or more small kernels whose launches cost more than their work; a
    graph launches them all at once. Exact: a step's shapes depend only on its position, so the
    graph captured at position p is the step at p, kernel for kernel, and it reads fixed memory:
    the token in self.idx and the Cache's buffers (n_ctx long, written in place). A new stream's
    buffers (or a slid window's) are copied into the captured ones, which then stand in for them;
    another batch size or model starts afresh. A position's first visit warms up, then captures."""

    def __init__(self, step):
        self.step, self.graphs, self.buffers = step, {}, {}
        self.pool = torch.cuda.graph_pool_handle()  # graphs replay one at a time: one pool
        self.stream = torch.cuda.Stream()  # warm-ups and captures: a stream's lazy set-up (such
        # as its cuBLAS workspace) cannot happen inside a capture, so the warm-up on it does it

    def __call__(self, idx, pos, cache):
        if cache.keys() != self.buffers.keys() or any(
                cache[k] is not buf for k, buf in self.buffers.items()):  # not the captured ones
            if {k: (v.shape, v.dtype) for k, v in cache.items()} != \
                    {k: (v.shape, v.dtype) for k, v in self.buffers.items()}:
                self.graphs, self.buffers = {}, dict(cache)  # captured from now on
            else:  # copied into the captured buffers, which stand in for the cache's own
                for key, buf in self.buffers.items():
                    buf.copy_(cache[key])
                    cache[key] = buf
        if pos not in self.graphs:  # the warm-up gets the capture's very arguments (no recompile)
            self.idx = self.idx.copy_(idx) if self.graphs else idx.clone()  # the graphs' input
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                logits = self.step(self.idx, pos, cache)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                self.graphs[pos] = graph, self.step(self.idx, pos, cache)
            torch.cuda.current_stream().wait_stream(self.stream)
            return logits
        graph, logits = self.graphs[pos]
        self.idx.copy_(idx)
        graph.replay()
        return logits.clone()  # the next replay at pos overwrites the graph's own


def write_samples(model, tok, ids, args, generator, step=None):
    """Decode args.num_samples continuations of the prompt ids in one batch (a step is bound by
    reading the weights: N rows cost about one) and print them. Returns how many tokens are new."""
    samples, ended = [list(ids) for _ in range(args.num_samples)], [False] * args.num_samples
    idx = torch.tensor(samples, dtype=torch.long, device=generator.device)     # (num_samples, T0)
    shown = tok.decode(ids)
    sys.stdout.write(shown)
    for tokens, _ in model.stream(idx, args.max_new_tokens, temperature=args.temperature,
                                  method=args.method, top_k=args.top_k or None,
                                  top_p=args.top_p, generator=generator, step=step):
        for i, token in enumerate(tokens.tolist()):                      # tokens (num_samples,)
            ended[i] = ended[i] or token == tok.eos_id
            if not ended[i]:
                samples[i].append(token)
        text = tok.decode(samples[0]).rstrip('\ufffd')  # a split character prints once whole
        if len(text) > len(shown):
            print(text[len(shown):], end='', flush=True)
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
    if args.prompt.startswith('FILE:'):
        args.prompt = read_text_file(args.prompt[len('FILE:'):], '--prompt=FILE: file')
    ids, keep = tok.encode(args.prompt, bos=True), model.cfg.n_ctx - 1  # room for a new token
    if len(ids) > keep:
        print(f'warning: the prompt has {len(ids)} tokens; keeping its last {keep} (the window '
              f'holds n_ctx={keep + 1})', file=sys.stderr)
        ids = ids[-keep:]
    print(f'sampling from {path} ({model.cfg.arch}, method {args.method}, {device} '
          f'{str(next(model.parameters()).dtype)[6:]}: {why})', file=sys.stderr)
    step = compiled_step(model) if args.compile else None  # (sample_args: --method=cache)
    if step:  # it compiles on its first calls (a window's last position apart): timed apart
        t0 = time.perf_counter()
        warm = torch.tensor([ids] * args.num_samples, device=device)  # the samples' batch shape
        list(model.stream(warm, model.cfg.n_ctx, temperature=0, step=step))  # a whole window
        print(f'compiled the cached step in {time.perf_counter() - t0:.1f} s (once per process; '
              f'not in the tokens/s below)', file=sys.stderr)
    t0 = time.perf_counter()
    generator = torch.Generator(device=device).manual_seed(args.seed)
    n_new = write_samples(model, tok, ids, args, generator, step)  # | head: see run_main
    dt = time.perf_counter() - t0
    print(f'{n_new} tokens ({args.num_samples} sample{"s" * (args.num_samples > 1)} in one batch) '
          f'in {dt:.2f} s ({n_new / max(dt, 1e-9):.1f} tokens/s)', file=sys.stderr)


def main(argv=None):
    return run_main(lambda: sample(argv), 'interrupted')  # what was printed stays


if __name__ == '__main__':
    sys.exit(main())
