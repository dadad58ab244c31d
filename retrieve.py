"""
retrieve.py: retrieval with masked mixers and transformers (paper §6), in one file.

    python retrieve.py train    --init_from=out/ckpt.pt --data_dir=data/pystdlib --out_dir=out-retrieval
    python retrieve.py eval     --ckpt=out-retrieval/ckpt.pt --pairs=data/pystdlib/pairs_val.jsonl [--peer=all-MiniLM-L6-v2]
    python retrieve.py indirect --ckpt=out/ckpt.pt --data_dir=data/pystdlib --c=32,128
    python retrieve.py index    --ckpt=out-retrieval/ckpt.pt --docs=src/ notes.txt --index=my-index
    python retrieve.py search   --index=my-index --query="parse an ISO date" --k=5

Subcommands
  train     InfoNCE fine-tuning of a pretrained checkpoint on pairs_train.jsonl (§6.3, eqs 7-8)
  eval      top-1 accuracy for many n (Tables 1, 3, 4), plus MRR@10 and recall@1/5/10 against all
            targets. n counts as Table 1's caption does: one query, its matching target and n-2
            non-matching targets, so n-1 candidates (chance 1/(n-1)). `indirect`'s c and the
            paper negatives of `train` count the same way. --peer scores a sentence-transformers
            model on the same pairs, table for table.
  indirect  a RetrievalMixer trained on the frozen model's embeddings (§6.2, Algorithm 1)
  index     embed your documents, in n_ctx-token chunks, into an index directory
  search    the best chunks of an index for a query

Embedding of a text (every subcommand). The text is tokenized with the checkpoint's tokenizer,
bos first; a text longer than n_ctx tokens keeps its first n_ctx (the start of a target carries
its topic; indexed documents are chunked instead of truncated). The tokens are left-padded to
exactly n_ctx, because a masked mixer has a weight per position and the paper pretrains and
retrieves with left padding (§6.1); transformers get the pad mask, mixers ignore it. Texts are
grouped by length and each group skips its pad columns exactly (TextEncoder's trim): a causal
mixer's all-pad positions are the same in every row, so they are computed once and shared; llama
drops them (masked keys, relative positions). The
embedding is the last hidden state at window position `embed_pos`, L2-normalised, so that a dot
product is the cosine of eq. 9. With left padding, embed_pos=-1 is the last real token of every
text. The paper took the second-to-last (-2) because its models shifted the targets inside the
model and never trained the last position; train.py's loader does the shift, so every position
of the window is trained and -1 is the default. Autoencoder checkpoints embed with their encoder
(the paper's §6.4: its last position). Embedding runs without gradients, in batches, under
autocast to --dtype (auto: bf16 on CUDA and on CPUs with native bf16, else float32, as train.py
decides); similarities are computed in float32.

Training. `train` and `indirect` run train.py's `fit`, so they take its loop keys (--lr,
--batch_size, --grad_accum, --max_iters, --max_time, --dtype, --device, --compile, ...) and give
its DDP (torchrun --standalone --nproc_per_node=4 retrieve.py train ...), AMP, time budgets,
atomic ckpt.pt/best.pt, log.jsonl and exact resume (--init_from=resume). In `train`, batch_size
counts queries: a micro-batch embeds 2 x batch_size sequences with in-batch negatives, or
32 x batch_size with the paper's 30 sampled negatives (its setting: --batch_size=1 --grad_accum=4).
"""
import argparse
import hashlib
import io
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import train
from model import RetrievalMixer
from prepare import Tokenizer, check_out_dir, check_output_file, read_text_file

TAU = 0.02             # InfoNCE temperature (eq. 8)
PAPER_N = 32           # --negatives=paper: n = 32 sequences, a query, its target and 30 non-matching ones (§6.3)
DEFAULT_NS = tuple(2 ** k for k in range(5, 14))   # 32, 64, ..., 8192: the columns of Table 1


# ----------------------------------------------------------------------------- text files

def read_jsonl(path):
    """(line number, JSON value) for each non-blank line of a .jsonl file; a bad line is an error naming file:line."""
    rows = []
    for lineno, line in enumerate(read_text_file(path, 'JSONL file').split('\n'), 1):
        if not line.strip():
            continue
        try:
            rows.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg}): fix or delete that line") from None
    return rows


def read_pairs(path):
    """(queries, targets) from a pairs file of {"query": ..., "target": ...} lines."""
    queries, targets = [], []
    for lineno, row in read_jsonl(path):
        if not (isinstance(row, dict) and isinstance(row.get('query'), str) and isinstance(row.get('target'), str)):
            raise ValueError(f"{path}:{lineno}: not an object with string fields 'query' and 'target'")
        queries.append(row['query'])
        targets.append(row['target'])
    if len(queries) < 2:
        raise ValueError(f"{path} holds {len(queries)} pair(s): retrieval needs at least 2")
    return queries, targets


def atomic_write(path, data):
    """Write str or bytes to a temp file, then rename it into place: a crash leaves the old file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, 'wb') as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path, obj):
    atomic_write(path, json.dumps(obj, indent=1) + '\n')


# ----------------------------------------------------------------------------- embeddings

def left_pad(seqs, n_ctx, pad_id):
    """Token lists -> idx (B, n_ctx) with the pads first, mask (B, n_ctx) True on real tokens."""
    idx = torch.full((len(seqs), n_ctx), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), n_ctx, dtype=torch.bool)
    for i, s in enumerate(seqs):
        s = list(s)[:n_ctx]                       # keep the start of long texts
        if s:
            idx[i, n_ctx - len(s):] = torch.tensor(s)
            mask[i, n_ctx - len(s):] = True
    return idx, mask


def length_groups(lengths, overhead):
    """Rows sorted by length, cut into runs that minimise sum(rows x longest + overhead) (dynamic
    programming): a batch of short queries and long targets is not padded to its longest text.
    Returns the order (B,) and the (start, end) of each run in it."""
    order = torch.argsort(lengths)
    l = lengths[order].double().numpy()
    best, cut = np.zeros(len(l) + 1), np.zeros(len(l) + 1, dtype=np.int64)
    for j in range(1, len(l) + 1):       # best[j]: rows [0, j) grouped; the last run starts at cut[j]
        cost = best[:j] + (j - np.arange(j)) * l[j - 1] + overhead
        cut[j] = int(cost.argmin())
        best[j] = cost[cut[j]]
    runs, j = [], len(l)
    while j:
        runs.append((int(cut[j]), j))
        j = cut[j]
    return order, runs[::-1]


class TextEncoder(nn.Module):
    """A language model seen as a text encoder: forward gives unit embeddings (B, d_model), the last
    hidden state at window position embed_pos. Its state_dict is the model's own, so checkpoints
    of retrieval training stay ordinary model checkpoints (model_from_checkpoint rebuilds them).
    trim: rows are grouped by length and each group runs only its own real columns (model.hidden's
    keep: the pad states shared in masked mixers, the pad columns dropped in llama), the same
    embeddings as the full window for a fraction of the compute on short texts."""

    def __init__(self, model, embed_pos=-1, trim=True):
        super().__init__()
        self.model, self.embed_pos = model, embed_pos
        backbone = getattr(model, 'backbone', getattr(model, 'encoder', None))
        self.trim = trim and getattr(backbone, 'trims', False)
        if not -model.cfg.n_ctx <= embed_pos < model.cfg.n_ctx:
            raise ValueError(f"embed_pos={embed_pos} is outside the n_ctx={model.cfg.n_ctx} window: use -1 or -2")

    def forward(self, idx, mask):  # (B, n_ctx) left-padded tokens -> (B, d_model) unit rows
        if not self.trim:
            return F.normalize(self.model.hidden(idx, mask)[:, self.embed_pos].float(), dim=-1)
        n = idx.shape[1]
        at = self.embed_pos % n                                   # the embedding's window position
        order, runs = length_groups(mask.sum(1).clamp(min=n - at).cpu(), overhead=n)
        order = order.to(idx.device)
        h = []
        for a, b in runs:
            rows = order[a:b]
            keep = max(n - at, int(mask[rows].sum(1).max()))       # real columns of the group's longest
            h.append(self.model.hidden(idx[rows], mask[rows], keep)[:, at - n])   # (b - a, d_model)
        h = torch.cat(h)[torch.argsort(order)]                    # back to the batch's order
        return F.normalize(h.float(), dim=-1)

    def state_dict(self, *args, **kwargs):
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)


class Embedder:
    """A checkpoint's encoder + tokenizer: texts -> unit embeddings (N, d_model), batched, no grad."""

    def __init__(self, ckpt_path, device='auto', dtype='auto', batch_size=32, embed_pos=None):
        ckpt = train.load_checkpoint(ckpt_path, map_location='cpu')
        if ckpt.get('kind') not in ('lm', 'retrieval'):
            raise ValueError(f"{ckpt_path} is a {ckpt.get('kind')!r} checkpoint: embeddings come from an "
                             f"'lm' (train.py) or 'retrieval' (retrieve.py train) checkpoint")
        if dtype not in train.CHOICES['dtype']:
            raise ValueError(f"--dtype={dtype}: use one of {', '.join(train.CHOICES['dtype'])}")
        self.path = os.path.abspath(ckpt_path)
        self.fingerprint = weights_fingerprint(ckpt['model'])
        self.device = device if isinstance(device, torch.device) else train.resolve_device(device)
        self.dtype, self.why = train.choose_dtype(self.device, dtype)
        self.batch_size = batch_size
        pos = ckpt.get('embed_pos', -1) if embed_pos is None else embed_pos
        self.encoder = TextEncoder(train.model_from_checkpoint(ckpt), pos).to(self.device).eval()
        self.n_ctx, self.d_model = self.encoder.model.cfg.n_ctx, self.encoder.model.cfg.d_model
        self.data = ckpt['data']                                     # data_dir and meta: the tokenizer
        self.tok = Tokenizer.from_meta(self.data['meta'], self.data['data_dir'])

    def tokenize(self, text):
        return self.tok.encode(text, bos=True)[:self.n_ctx]   # bos as in pretraining; keep the start

    @torch.no_grad()
    def embed_tokens(self, seqs):
        out = [torch.zeros(0, self.d_model)]
        for i in range(0, len(seqs), self.batch_size):
            idx, mask = left_pad(seqs[i:i + self.batch_size], self.n_ctx, self.tok.pad_id)
            with train.autocast(self.device, self.dtype):
                out.append(self.encoder(idx.to(self.device), mask.to(self.device)).float().cpu())
        return torch.cat(out)

    def __call__(self, texts):  # list of str -> (N, d_model) float32, unit rows
        return self.embed_tokens([self.tokenize(t) for t in texts])


def weights_fingerprint(state_dict):
    """A short hash of a model's weights: an index remembers which model embedded it."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous().reshape(-1)
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------- candidates and losses

def sample_candidates(match, n_pool, k, generator=None):
    """Algorithm 1 (§6.2) for a batch: for each match index (B,), k candidate indices into a pool of
    n_pool: k-1 distinct non-matching ones in random order, the match at a uniformly random slot.
    Returns cands (B, k) and labels (B,), the match's slot."""
    B = match.shape[0]
    if not 2 <= k <= n_pool:
        raise ValueError(f"{k} candidates per query need 2 <= k <= {n_pool} (the pool size)")
    keys = torch.rand(B, n_pool, generator=generator)
    keys[torch.arange(B), match] = 2.0                                 # never drawn as a negative
    cands = torch.cat([keys.topk(k - 1, dim=1, largest=False).indices, match[:, None]], dim=1)
    labels = torch.randint(0, k, (B,), generator=generator)
    rows = torch.arange(B)
    cands[rows, k - 1] = cands[rows, labels]                           # swap the match into its slot
    cands[rows, labels] = match
    return cands, labels


def info_nce(q, t, labels, tau=TAU, symmetric=False):
    """Eq. 7 with f = exp(cos / tau) (eq. 8), averaged over queries. q (B, d) and t unit rows;
    t (M, d) is shared by all queries (in-batch negatives) or (B, k, d) per query (paper groups);
    labels (B,) index each query's match among its candidates. symmetric (in-batch only, as in
    CLIP): the mean with the reverse direction, each matching target picking its query among the B."""
    logits = q @ t.T if t.dim() == 2 else torch.einsum('bd,bkd->bk', q, t)
    loss = F.cross_entropy(logits / tau, labels)
    if symmetric:
        loss = (loss + F.cross_entropy((t[labels] @ q.T) / tau, torch.arange(len(labels), device=labels.device))) / 2
    return loss


# ----------------------------------------------------------------------------- InfoNCE training

TRAIN_DEFAULTS = dict(
    train.LOOP_DEFAULTS,
    init_from='',           # a pretrained checkpoint (train.py's ckpt.pt or best.pt), or resume (out_dir/ckpt.pt)
    data_dir='data/pystdlib',  # holds pairs_train.jsonl and pairs_val.jsonl
    out_dir='out-retrieval',
    negatives='inbatch',    # inbatch: B x B logits | paper: each query vs its target + 30 others (eq. 7)
    symmetric=False,        # inbatch: also each target vs the B queries (CLIP's two-way loss)
    embed_pos='',           # '' = the checkpoint's (retrieval checkpoints record theirs), else -1
    batch_size=32,          # queries per micro-batch: 2 x 32 sequences (inbatch), 32 x 32 (paper)
    lr=1e-4,                # the paper's retrieval learning rate
    warmup_iters=20,
    max_iters=1000,
    eval_interval=100,
    eval_iters=10,
)
TRAIN_CHOICES = dict(negatives=('inbatch', 'paper'), dtype=train.CHOICES['dtype'], schedule=train.CHOICES['schedule'])


def embed_pos_arg(value):
    """--embed_pos of the parse_args-based subcommands: '' (the checkpoint's) or an int."""
    try:
        return None if value == '' else int(value)
    except ValueError:
        raise ValueError(f"--embed_pos={value!r} is not an integer: use -1 (last token) or -2") from None


def batch_rng(cfg, split, step, micro):
    """The generator of one micro-batch (step None: evaluation batch `micro`): a pure function of
    its arguments, so DDP ranks draw disjoint batches and a resumed run draws the same ones."""
    return np.random.default_rng([cfg['seed'], train.SPLITS.index(split), int(step is not None), step or 0, micro])


class PairBatches:
    """get_batch for InfoNCE: (idx (M, n_ctx), mask, labels) with the B queries in the first rows and
    their candidate targets after them: B targets (inbatch) or B groups of 31 (paper, Algorithm 1
    on token sequences). Micro-batch `micro` of `step` depends on nothing else (exact resume)."""

    def __init__(self, cfg, tok, n_ctx):
        self.cfg, self.n_ctx, self.pad = cfg, n_ctx, tok.pad_id
        self.pairs = {}
        need = cfg['batch_size'] if cfg['negatives'] == 'inbatch' else max(cfg['batch_size'], PAPER_N - 1)
        for split in train.SPLITS:
            path = os.path.join(cfg['data_dir'], f'pairs_{split}.jsonl')
            queries, targets = read_pairs(path)
            if len(queries) < need:
                raise ValueError(f"{path} holds {len(queries)} pairs, fewer than the {need} a batch needs "
                                 f"(negatives={cfg['negatives']}): lower --batch_size")
            self.pairs[split] = ([tok.encode(q, bos=True) for q in queries], [tok.encode(t, bos=True) for t in targets])

    def __call__(self, split, step, micro, shard=0, shards=1):
        """A row shard (shards > 1) keeps its share of the queries and, with in-batch negatives,
        all B targets: each query is scored against the same candidates as in the whole micro-batch."""
        cfg, (queries, targets), B = self.cfg, self.pairs[split], self.cfg['batch_size']
        rng = batch_rng(cfg, split, step, micro)
        match = rng.choice(len(queries), B, replace=False)
        mine = slice(shard * B // shards, (shard + 1) * B // shards)
        if cfg['negatives'] == 'inbatch':
            rows, labels = match, torch.arange(B)[mine]
        else:
            gen = torch.Generator().manual_seed(int(rng.integers(2 ** 62)))
            cands, labels = sample_candidates(torch.from_numpy(match), len(targets), PAPER_N - 1, gen)
            rows, labels = cands[mine].flatten().tolist(), labels[mine]
        idx, mask = left_pad([queries[i] for i in match[mine]] + [targets[i] for i in rows], self.n_ctx, self.pad)
        return idx, mask, labels


def freeze_unused(encoder, n_ctx):
    """Freeze what embeddings do not depend on (lm head, an autoencoder's decoder): AdamW and DDP
    then skip those weights, and DDP does not wait for gradients that never come."""
    encoder(torch.zeros(1, n_ctx, dtype=torch.long), torch.ones(1, n_ctx, dtype=torch.bool)).sum().backward()
    for p in encoder.parameters():
        p.requires_grad_(p.grad is not None)
        p.grad = None


def cmd_train(argv):
    """InfoNCE fine-tuning (paper §6.3) through train.py's loop: DDP, AMP, budgets, exact resume."""
    cfg = train.parse_args(argv, TRAIN_DEFAULTS, TRAIN_CHOICES)
    if cfg['symmetric'] and cfg['negatives'] != 'inbatch':
        raise ValueError("--symmetric=True needs --negatives=inbatch (a paper group has one query)")
    resume = None
    if cfg['init_from'] == 'resume':
        resume = src = train.load_checkpoint(os.path.join(cfg['out_dir'], 'ckpt.pt'))
        if src['kind'] != 'retrieval':
            raise ValueError(f"{cfg['out_dir']}/ckpt.pt is a {src['kind']!r} checkpoint, not one of retrieve.py train's")
        init_from = src['init_from']
    elif cfg['init_from']:
        src, init_from = train.load_checkpoint(cfg['init_from']), os.path.abspath(cfg['init_from'])
        if src['kind'] not in ('lm', 'retrieval'):
            raise ValueError(f"{cfg['init_from']} is a {src['kind']!r} checkpoint: start from train.py's (kind 'lm')")
    else:
        raise ValueError("retrieval training starts from a pretrained model: pass --init_from=out/ckpt.pt "
                         "(or --init_from=resume to continue out_dir/ckpt.pt)")
    embed_pos = embed_pos_arg(cfg['embed_pos'])
    embed_pos = src.get('embed_pos', -1) if embed_pos is None else embed_pos
    encoder = TextEncoder(train.model_from_checkpoint(src), embed_pos)
    n_ctx = encoder.model.cfg.n_ctx
    check_out_dir(cfg['out_dir'], resume is None, cfg['overwrite'])
    get_batch = PairBatches(cfg, Tokenizer.from_meta(src['data']['meta'], src['data']['data_dir']), n_ctx)
    rt = train.setup_runtime(cfg)
    try:
        freeze_unused(encoder, n_ctx)
        if rt.master:
            print(f"InfoNCE ({cfg['negatives']} negatives, tau {TAU}) from {init_from}: "
                  f"{sum(p.numel() for p in encoder.parameters() if p.requires_grad) / 1e6:.2f}M trainable "
                  f"parameters, embed_pos {embed_pos}, {rt.describe()}")

        def loss_fn(model, batch):
            idx, mask, labels = batch
            e = model(idx, mask)                                   # (M, d_model): queries, then targets
            q, t = e[:len(labels)], e[len(labels):]
            if cfg['negatives'] == 'inbatch':
                return info_nce(q, t, labels, symmetric=cfg['symmetric'])
            return info_nce(q, t.view(len(labels), -1, t.shape[-1]), labels)

        extra = {'kind': 'retrieval', 'model_config': src['model_config'], 'data': src['data'],
                 'embed_pos': embed_pos, 'init_from': init_from, 'pairs_dir': os.path.abspath(cfg['data_dir'])}
        stats = train.fit(cfg, rt, encoder, get_batch, loss_fn, extra, resume)
    finally:
        rt.close()
    if stats['stopped'] == 'diverged':
        return 1
    if rt.master:
        print(f"done: step {stats['step']}, val InfoNCE loss {stats['val_loss']:.4f}; evaluate with python retrieve.py "
              f"eval --ckpt={cfg['out_dir']}/ckpt.pt --pairs={cfg['data_dir']}/pairs_val.jsonl")
    return 0


# ----------------------------------------------------------------------------- eval

def retrieval_metrics(q, t, ns=DEFAULT_NS, seed=0, chunk=512):
    """Top-1 accuracy (%) for each n of Table 1 (one query, its target and n-2 non-matching targets
    sampled without replacement: n-1 candidates), and MRR@10, recall@1/5/10 against all targets.
    q, t (N, d) unit rows, q[i] matches t[i]. Each query draws one random order of the other
    targets (seeded) and its first n-2 are the negatives for n, so the candidate sets are nested
    and accuracy falls with n. A tie with a negative counts as a miss."""
    N, gen = q.shape[0], torch.Generator().manual_seed(seed)
    hits = {n: 0 for n in ns}
    rank = torch.empty(N, dtype=torch.long)
    for a in range(0, N, chunk):
        rows = torch.arange(a, min(a + chunk, N))
        b = torch.arange(len(rows))
        sim = q[rows] @ t.T                                            # (b, N) cosines
        pos = sim[b, rows]                                             # (b,) the matches
        rank[rows] = (sim >= pos[:, None]).sum(1)                      # 1 + targets scoring >= the match
        keys = torch.rand(len(rows), N, generator=gen)
        keys[b, rows] = 2.0                                            # the match sorts last: never a negative
        order = keys.argsort(dim=1)[:, :N - 1]                         # (b, N-1) random order of the others
        best_neg = sim.gather(1, order).cummax(dim=1).values           # best of the first j+1 negatives
        for n in ns:
            hits[n] += int((pos > best_neg[:, n - 3]).sum())
    return {'top1': {str(n): round(100.0 * hits[n] / N, 2) for n in ns},
            'mrr@10': round(float(torch.where(rank <= 10, 1.0 / rank, 0.0).mean()), 4),
            'recall@k': {str(k): round(100.0 * float((rank <= k).float().mean()), 2) for k in (1, 5, 10)},
            'n_pairs': N}


def cap_ns(ns, n_pairs):
    """Requested n (or c) values, each at most n_pairs + 1: the query and all n_pairs targets
    (with a note when capped)."""
    top = n_pairs + 1
    capped = sorted({min(n, top) for n in ns})
    if any(n > top for n in ns):
        print(f"note: only {n_pairs} pairs, so n is capped at {top} (the query and every target; "
              f"asked for {','.join(str(n) for n in ns if n > top)})", file=sys.stderr)
    return capped


def print_metrics(m):
    ns = list(m['top1'])
    print('n      ' + ''.join(f"{n:>8}" for n in ns))
    print('top-1% ' + ''.join(f"{m['top1'][n]:8.1f}" for n in ns))
    r = m['recall@k']
    print(f"against all {m['n_pairs']} targets: MRR@10 {m['mrr@10']:.3f}, "
          f"recall@1 {r['1']:.1f}%, recall@5 {r['5']:.1f}%, recall@10 {r['10']:.1f}%")


def peer_embedder(name, device, batch_size):
    """A sentence-transformers model (a hub name or a local folder) as texts -> unit rows (N, d):
    a known retriever scored on the same pairs. The package is imported only here."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise ValueError("--peer needs sentence-transformers: pip install sentence-transformers "
                         "(README, Retrieval, has an offline install of all-MiniLM-L6-v2)") from None
    try:
        model = SentenceTransformer(name, device=str(device))
    except (OSError, ValueError) as e:
        raise ValueError(f"--peer={name}: sentence-transformers could not load it ({str(e).splitlines()[0]})") from None
    return lambda texts: F.normalize(torch.as_tensor(np.asarray(model.encode(
        texts, batch_size=batch_size, convert_to_numpy=True)), dtype=torch.float32), dim=-1)


def cmd_eval(args):
    if not (args.ckpt or args.peer):
        raise ValueError("nothing to evaluate: pass --ckpt=CKPT and/or --peer=NAME_OR_PATH")
    queries, targets = read_pairs(args.pairs)
    if args.json:
        check_output_file(args.json, 'json')
    ns, device, models, results = int_list(args.n, 'n'), train.resolve_device(args.device), {}, {}
    if args.ckpt:
        embedder = Embedder(args.ckpt, device, args.dtype, args.batch_size, args.embed_pos)
        models[args.ckpt] = embedder, f"embed_pos {embedder.encoder.embed_pos}, {str(embedder.dtype)[6:]}"
    if args.peer:
        models[args.peer] = peer_embedder(args.peer, device, args.batch_size), "sentence-transformers peer"
    ns = cap_ns(ns, len(queries))
    for name, (embedder, how) in models.items():
        t0 = time.perf_counter()
        q, t = embedder(queries), embedder(targets)
        t1 = time.perf_counter()
        m = results[name] = retrieval_metrics(q, t, ns, args.seed)
        t2 = time.perf_counter()
        print(f"{name}: {len(queries)} pairs from {args.pairs}, {how}; "
              f"embedding {t1 - t0:.1f}s ({2 * len(queries) / (t1 - t0):.0f} seq/s), ranking {t2 - t1:.2f}s")
        print_metrics(m)
    if args.json:  # one model: its metrics; with --peer: {"ckpt": ..., "peer": ...}
        write_json(args.json, results[args.ckpt] if not args.peer else
                   {k: results[v] for k, v in (('ckpt', args.ckpt), ('peer', args.peer)) if v})
    return 0


# ----------------------------------------------------------------------------- indirect retrieval

INDIRECT_DEFAULTS = dict(
    train.LOOP_DEFAULTS,
    ckpt='',                # the frozen embedding model (train.py's checkpoint)
    data_dir='data/pystdlib',
    out_dir='out-indirect',  # one run per c in out_dir/c{c}/
    c='32,128',             # comparison sizes, counted as Table 1's n: the query, its target and c - 2 others
    n_layers=8,             # RetrievalMixer depth; d_model is the embedding model's
    embed_pos='',
    batch_size=64,          # retrieval inputs per micro-batch (the paper used 512)
    lr=1e-3,                # paper: 1e-4 at batch 512 for many epochs; 1e-3 learns in CPU-sized runs
    warmup_iters=20,
    max_iters=500,
    eval_interval=100,
    eval_iters=10,
    json='',                # also write {"c": {"32": {"loss": .., "top1": ..}, ..}} here
)


def algorithm1(q_emb, t_emb, match, c, generator=None):
    """Algorithm 1 (§6.2): RetrievalMixer inputs x (B, c, d) = [query, c-1 targets], the matching
    target at a uniformly random slot labels (B,), the other c-2 distinct and non-matching.
    Also returns the rows read, (B, c): the query's, then the targets'."""
    cands, labels = sample_candidates(match, len(t_emb), c - 1, generator)
    x = torch.cat([q_emb[match][:, None], t_emb[cands]], dim=1)
    return x, labels, torch.cat([match[:, None], cands], dim=1)


@torch.no_grad()
def indirect_accuracy(model, q_emb, t_emb, c, seed, batch=256):
    """(mean cross-entropy, top-1 %) with every query of the split once, against c-1 candidates."""
    gen, loss, hits, device = torch.Generator().manual_seed(seed), 0.0, 0, next(model.parameters()).device
    for a in range(0, len(q_emb), batch):
        x, labels, _ = algorithm1(q_emb, t_emb, torch.arange(a, min(a + batch, len(q_emb))), c, gen)
        logits, l = model(x.to(device), labels.to(device))
        loss += float(l) * len(labels)
        hits += int((logits.argmax(-1).cpu() == labels).sum())
    return loss / len(q_emb), 100.0 * hits / len(q_emb)


def cmd_indirect(argv):
    """Frozen embeddings, a RetrievalMixer per c (paper §6.2): how much retrieval the pretrained
    embeddings carry, without changing the model that made them."""
    cfg = train.parse_args(argv, INDIRECT_DEFAULTS, dict(dtype=train.CHOICES['dtype']))
    if not cfg['ckpt']:
        raise ValueError("pass the embedding model: --ckpt=out/ckpt.pt")
    pairs = {s: read_pairs(os.path.join(cfg['data_dir'], f'pairs_{s}.jsonl')) for s in train.SPLITS}
    cs = cap_ns(int_list(cfg['c'], 'c'), min(len(pairs[s][0]) for s in pairs))
    for c in cs:  # every value and output location, before any embedding or training
        if c < 3:
            raise ValueError(f"--c={c}: the RetrievalMixer needs the query and at least 2 targets")
        check_out_dir(os.path.join(cfg['out_dir'], f'c{c}'), True, cfg['overwrite'], resumable=False)
    if cfg['json']:
        check_output_file(cfg['json'], 'json')
    rt = train.setup_runtime(cfg)
    try:
        embedder = Embedder(cfg['ckpt'], rt.device, cfg['dtype'], embed_pos=embed_pos_arg(cfg['embed_pos']))
        t0 = time.perf_counter()
        # unit embeddings scaled to unit RMS per component: the mixer's inputs stay O(1) whatever d_model
        emb = {s: tuple(embedder(texts) * math.sqrt(embedder.d_model) for texts in pairs[s]) for s in train.SPLITS}
        if rt.master:
            print(f"embedded {sum(2 * len(pairs[s][0]) for s in pairs)} texts with {cfg['ckpt']} in "
                  f"{time.perf_counter() - t0:.1f}s (frozen, embed_pos {embedder.encoder.embed_pos})")
        results = {}
        for c in cs:
            def get_batch(split, step, micro, shard=0, shards=1, c=c):
                rng = batch_rng(cfg, split, step, micro)
                q_emb, t_emb = emb[split]
                gen = torch.Generator().manual_seed(int(rng.integers(2 ** 62)))
                match = torch.from_numpy(rng.integers(0, len(q_emb), cfg['batch_size']))
                x, labels, rows = algorithm1(q_emb, t_emb, match, c, gen)
                mine = slice(shard * len(x) // shards, (shard + 1) * len(x) // shards)
                return rows[mine], x[mine], labels[mine]      # rows (B, c) count as the step's "tokens"

            run = dict(cfg, out_dir=os.path.join(cfg['out_dir'], f'c{c}'))
            torch.manual_seed(cfg['seed'])
            model = RetrievalMixer(embedder.d_model, cfg['n_layers'], c)
            extra = {'kind': 'indirect', 'retrieval_mixer': dict(d_model=embedder.d_model, n_layers=cfg['n_layers'], c=c),
                     'embedder': dict(ckpt=embedder.path, fingerprint=embedder.fingerprint,
                                      embed_pos=embedder.encoder.embed_pos), 'data': embedder.data}
            stats = train.fit(run, rt, model, get_batch, lambda m, b: m(b[1], b[2])[1], extra)
            if stats['stopped'] == 'diverged':
                return 1
            model.eval()
            loss, top1 = indirect_accuracy(model, *emb['val'], c, cfg['seed'])
            results[str(c)] = dict(loss=round(loss, 4), top1=round(top1, 2), steps=stats['step'])
    finally:
        rt.close()
    if rt.master:
        print(f"indirect retrieval, {len(pairs['val'][0])} val queries each against c-1 targets:")
        print('c         ' + ''.join(f"{c:>8}" for c in results))
        print('val loss  ' + ''.join(f"{r['loss']:8.3f}" for r in results.values()))
        print('top-1 %   ' + ''.join(f"{r['top1']:8.1f}" for r in results.values()))
        if cfg['json']:
            write_json(cfg['json'], {'c': results, 'n_val': len(pairs['val'][0]), 'ckpt': embedder.path})
    return 0


# ----------------------------------------------------------------------------- index and search

def collect_documents(paths):
    """(source, text) for every document under paths: a folder's text files (recursively, hidden
    entries and binary files skipped), a text file, or a .jsonl file's "text" (or "target") fields."""
    docs = []
    for path in paths:
        if os.path.isdir(path):
            files = []
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
                files += [os.path.join(root, n) for n in sorted(names) if not n.startswith('.')]
            docs += [(f, text) for f in files if (text := read_text(f)) is not None]
        elif path.endswith('.jsonl'):
            for lineno, row in read_jsonl(path):
                text = row.get('text', row.get('target')) if isinstance(row, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{lineno}: no string field 'text' (or 'target')")
                docs.append((f"{path}:{lineno}", text))
        elif os.path.isfile(path):
            text = read_text(path)
            if text is None:
                raise ValueError(f"{path} is not a UTF-8 text file")
            docs.append((path, text))
        else:
            raise FileNotFoundError(f"no such file or folder: {path}")
    return docs


def read_text(path):
    """A file's text, or None for binary (NUL bytes or not UTF-8) files."""
    with open(path, 'rb') as f:
        data = f.read()
    try:
        return None if b'\0' in data else data.decode('utf-8')
    except UnicodeDecodeError:
        return None


def chunk_document(tok, text, n_ctx):
    """(token offset, tokens) chunks of at most n_ctx - 1 tokens (bos is added when embedding)."""
    ids = tok.encode(text)
    return [(a, ids[a:a + n_ctx - 1]) for a in range(0, max(len(ids), 1), n_ctx - 1)]


def cmd_index(args):
    manifest = os.path.join(args.index, 'manifest.json')
    if os.path.isfile(manifest) and not args.overwrite:
        raise ValueError(f"--index={args.index} already holds an index: replace it with --overwrite, "
                         f"or pass a new --index folder")
    if os.path.isdir(args.index) and os.listdir(args.index) and not os.path.isfile(manifest):
        raise ValueError(f"--index={args.index} is a folder of other files, not an index: pass a new or empty folder")
    check_out_dir(args.index, flag='index')
    embedder = Embedder(args.ckpt, args.device, args.dtype, args.batch_size, args.embed_pos)
    docs = collect_documents(args.docs)
    if not docs:
        raise ValueError(f"no text documents found in {' '.join(args.docs)}")
    meta, seqs = [], []
    for source, text in docs:
        for offset, ids in chunk_document(embedder.tok, text, embedder.n_ctx):
            meta.append({'source': source, 'offset': offset, 'text': embedder.tok.decode(ids)})
            seqs.append([embedder.tok.bos_id] + ids)
    t0 = time.perf_counter()
    emb = embedder.embed_tokens(seqs).numpy()
    dt = time.perf_counter() - t0
    # the data files carry a content stamp and the manifest, replaced last, names them: a crash
    # while rebuilding leaves the previous index whole
    buf = io.BytesIO()
    np.save(buf, emb)
    stamp = hashlib.sha256(buf.getvalue()).hexdigest()[:12]
    files = {'embeddings': f'embeddings.{stamp}.npy', 'chunks': f'chunks.{stamp}.jsonl'}
    os.makedirs(args.index, exist_ok=True)
    atomic_write(os.path.join(args.index, files['embeddings']), buf.getvalue())
    atomic_write(os.path.join(args.index, files['chunks']), ''.join(json.dumps(m) + '\n' for m in meta))
    write_json(os.path.join(args.index, 'manifest.json'),
               {'ckpt': embedder.path, 'fingerprint': embedder.fingerprint, 'embed_pos': embedder.encoder.embed_pos,
                'n_ctx': embedder.n_ctx, 'n_chunks': len(meta), 'n_documents': len(docs), **files})
    for name in os.listdir(args.index):                                # the previous build's files
        if name.startswith(('embeddings.', 'chunks.')) and name not in files.values():
            os.remove(os.path.join(args.index, name))
    print(f"indexed {len(docs)} documents as {len(meta)} chunks of <= {embedder.n_ctx} tokens in {args.index} "
          f"({dt:.1f}s, {len(seqs) / dt:.0f} chunks/s)")
    return 0


def load_index(index_dir):
    """(manifest, embeddings (N, d) float32, chunk records) of an index made by `index`."""
    path = os.path.join(index_dir, 'manifest.json')
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no index at {index_dir}: build one with python retrieve.py index "
                                f"--ckpt=CKPT --docs=PATH --index={index_dir}")
    with open(path) as f:
        manifest = json.load(f)
    emb = np.load(os.path.join(index_dir, manifest['embeddings']))
    chunks = [row for _, row in read_jsonl(os.path.join(index_dir, manifest['chunks']))]
    if not len(emb) == len(chunks) == manifest['n_chunks']:
        raise ValueError(f"index {index_dir} is incomplete (embeddings and chunks disagree): rebuild it")
    return manifest, torch.from_numpy(emb), chunks


def cmd_search(args):
    if not args.query.strip():
        raise ValueError("empty query: pass the text to look for, e.g. --query=\"open a file\"")
    if args.k < 1:
        raise ValueError(f"--k={args.k}: ask for at least one result")
    manifest, emb, chunks = load_index(args.index)
    embedder = Embedder(args.ckpt or manifest['ckpt'], args.device, args.dtype, embed_pos=manifest['embed_pos'])
    if embedder.fingerprint != manifest['fingerprint']:
        raise ValueError(f"index {args.index} was built with other weights ({manifest['ckpt']}, fingerprint "
                         f"{manifest['fingerprint']}) than {embedder.path} ({embedder.fingerprint}): rebuild it "
                         f"with python retrieve.py index --ckpt={embedder.path} ...")
    scores = emb @ embedder([args.query])[0]                           # (N,) cosines
    top = scores.topk(min(args.k, len(chunks)))
    for rank, (s, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
        c = chunks[i]
        print(f"{rank}. {s:.3f}  {c['source']} @ token {c['offset']}")
        print('   ' + c['text'][:args.show].replace('\n', '\n   '))
    return 0


# ----------------------------------------------------------------------------- command line

class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block: the CLI's convention for bad input
        raise ValueError(f"{message} (see python {self.prog} --help)")


def int_list(text, name='n'):
    """'32,64,128' -> [32, 64, 128]. n and c count the query, its target and n-2 others: n >= 3."""
    try:
        values = [int(v) for v in str(text).split(',') if v.strip()]
    except ValueError:
        raise ValueError(f"--{name}={text!r}: give comma-separated integers like 32,64,128") from None
    if not values or min(values) < 3:
        raise ValueError(f"--{name}={text!r}: give comma-separated integers >= 3 like 32,64,128 "
                         f"({name} counts the query, its target and {name}-2 non-matching targets)")
    return values


def embedding_parser(cmd, doc):
    """Options shared by the subcommands that embed with a checkpoint."""
    p = Parser(prog=f'retrieve.py {cmd}', description=doc)
    p.add_argument('--device', default='auto', help='auto (cuda if present), cpu or cuda[:i]')
    p.add_argument('--dtype', default='auto', choices=train.CHOICES['dtype'],
                   help='autocast dtype of the embedding model (auto: bf16 where the hardware has it natively, else float32)')
    p.add_argument('--batch_size', type=int, default=32, help='texts embedded per forward pass')
    p.add_argument('--embed_pos', type=int, default=None,
                   help="window position of the embedding (default: the checkpoint's, else -1, the last token)")
    return p


def parse(p, argv):
    """p's arguments, the counts checked before any work."""
    args = p.parse_args(argv)
    for key, low in (('batch_size', 1), ('show', 0)):
        if getattr(args, key, low) < low:
            raise ValueError(f"--{key}={getattr(args, key)} is out of range: use a value >= {low}")
    return args


def parse_eval(argv):
    p = embedding_parser('eval', "Top-1 retrieval accuracy for Table 1's n (n-1 candidates per query; "
                                 "paper Tables 1/3/4), MRR@10, recall@k.")
    p.add_argument('--ckpt', help="an 'lm' or 'retrieval' checkpoint")
    p.add_argument('--peer', help="also (or only) a sentence-transformers model, by name or folder, on the "
                                  "same pairs (e.g. all-MiniLM-L6-v2; needs pip install sentence-transformers)")
    p.add_argument('--pairs', required=True, help='a pairs JSONL file ({"query": ..., "target": ...} per line)')
    p.add_argument('--n', default=','.join(map(str, DEFAULT_NS)),
                   help="Table 1's n: one query, its target and n-2 non-matching targets, i.e. n-1 candidates "
                        "(default 32,64,...,8192; capped at the pair count + 1)")
    p.add_argument('--seed', type=int, default=0, help='seed of the sampled negatives')
    p.add_argument('--json', help='also write the metrics to this JSON file')
    return parse(p, argv)


def parse_index(argv):
    p = embedding_parser('index', "Embed documents, in chunks of n_ctx tokens, into an index folder.")
    p.add_argument('--ckpt', required=True, help="the embedding model (best: a 'retrieval' checkpoint)")
    p.add_argument('--docs', required=True, nargs='+', help='folders, text files or .jsonl files ("text" fields)')
    p.add_argument('--index', required=True, help='the index folder to write')
    p.add_argument('--overwrite', action='store_true', help='replace the index already in --index')
    return parse(p, argv)


def parse_search(argv):
    p = embedding_parser('search', "The chunks of an index closest to a query, by cosine similarity.")
    p.add_argument('--index', required=True, help='an index folder made by retrieve.py index')
    p.add_argument('--query', required=True, help='the text to look for')
    p.add_argument('--k', type=int, default=5, help='how many results')
    p.add_argument('--ckpt', help="the index's model, if it moved (its weights must match the index's)")
    p.add_argument('--show', type=int, default=300, help='characters of each chunk to print')
    return parse(p, argv)


COMMANDS = {
    'train': cmd_train,
    'eval': lambda argv: cmd_eval(parse_eval(argv)),
    'indirect': cmd_indirect,
    'index': lambda argv: cmd_index(parse_index(argv)),
    'search': lambda argv: cmd_search(parse_search(argv)),
}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ('-h', '--help'):
        print(__doc__)
        return 0 if argv else 2
    try:
        if argv[0] not in COMMANDS:
            raise ValueError(f"unknown subcommand {argv[0]!r}: use one of {', '.join(COMMANDS)}")
        return COMMANDS[argv[0]](argv[1:])
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code or 0
    except KeyboardInterrupt:
        print("interrupted: finished outputs are whole (train: continue with --init_from=resume)", file=sys.stderr)
        return 130


if __name__ == '__main__':
    sys.exit(main())
