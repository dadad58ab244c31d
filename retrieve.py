"""
retrieve.py: retrieval with masked mixers and transformers (paper §6), in one file.

    # InfoNCE fine-tuning of a pretrained checkpoint (§6.3, eqs 7-8)
    python retrieve.py train --init_from=out/ckpt.pt --data_dir=data/pystdlib
    # top-1 for many n (Tables 1, 3, 4), MRR@10, recall@k; --peer=bm25,MODEL: known retrievers too
    python retrieve.py eval --ckpt=out-retrieval/ckpt.pt --pairs=data/pystdlib/pairs_val.jsonl
    # a RetrievalMixer per c on the frozen model's last hidden states (§6.2, Algorithm 1)
    python retrieve.py indirect --ckpt=out/ckpt.pt --data_dir=data/pystdlib --c=32,128
    # the n_ctx-token chunks of folders and text files closest to a query
    python retrieve.py search --ckpt=out-retrieval/ckpt.pt --docs=src/ --query="parse an ISO date"

python retrieve.py COMMAND --help lists its keys; train and indirect run train.py's loop
(DDP under torchrun, AMP, budgets, log.jsonl; train resumes with --init_from=resume).
n counts as Table 1's caption does: one query, its matching target and n-2 non-matching targets,
so n-1 candidates (chance 1/(n-1)); indirect's c and train's paper negatives count the same way.
"""
import contextlib, json, math, os, re, sys

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import train
from model import Cache, RetrievalMixer
from configurator import (check_output_file, int_list, parse_args, read_text_file, run_main,
                          write_atomic)
from prepare import Tokenizer, check_online, visible_files

TAU = 0.02             # InfoNCE temperature (eq. 8)
PAPER_N = 32           # --negatives=paper: a query, its target and 30 non-matching ones (§6.3)


# ----------------------------------------------------------------------------- each command's keys

EMBED = dict(
    device='auto',          # auto (cuda if present), cpu or cuda[:i]
    dtype='auto',           # autocast; auto: bf16 where native, else fp32 (embed: the trained one)
    batch_size=32,          # texts per forward pass (train: queries per micro-batch)
    embed_pos=0,            # window position of the embedding; 0: the checkpoint's (else -1)
    pool='',                # last: the state at embed_pos (the paper) | mean: the mean of the
                            # text's states; '': the checkpoint's (else last)
)
FIT = dict(train.LOOP_DEFAULTS, **EMBED, warmup_iters=20, eval_interval=100, eval_iters=10,
           data_dir='data/pystdlib')  # holds pairs_train.jsonl and pairs_val.jsonl
TRAIN = dict(
    FIT,
    init_from='',           # train.py's ckpt.pt or best.pt, or resume (continue out_dir/ckpt.pt)
    out_dir='out-retrieval',  # ckpt.pt (a retrieval checkpoint, eval's --ckpt), log.jsonl
    negatives='inbatch',    # inbatch: B x B logits | paper: each query vs its target + 30 others
                            # (eq. 7), 32B sequences (paper: --batch_size=1 --grad_accum=4)
    symmetric=False,        # inbatch: also each target vs the B queries (CLIP's two-way loss)
    tau=TAU,                # the temperature of eq. 8 (the paper's 0.02)
    lr=1e-4,                # the paper's retrieval learning rate
    max_iters=1000,
)
INDIRECT = dict(
    FIT,
    ckpt='',                # the embedding model: an 'lm' or 'retrieval' checkpoint
    out_dir='out-indirect',  # one run per c in out_dir/c{c}/
    c='32,128',             # comparison sizes, counted as Table 1's n (the query, its target, c-2)
    n_layers=8,             # RetrievalMixer depth; d_model is the embedding model's
    batch_size=64,          # retrieval inputs per micro-batch (the paper used 512)
    lr=1e-3,                # paper: 1e-4 at batch 512 for many epochs; 1e-3 learns in CPU runs
    max_iters=500,
    normalize=False,        # False: raw hidden states, as the author's code; True: unit rows x √d
    json='',                # also write {"c": {"32": {"loss": .., "top1": ..}, ..}} here
)
EVAL = dict(
    EMBED,
    ckpt='',
    peer='',                # also (or only) known retrievers: bm25 and sentence-transformers
                            # models (a folder or a hub name), comma-separated
    pairs='',               # a pairs JSONL file ({"query": ..., "target": ...} per line)
    n=','.join(str(2 ** k) for k in range(5, 14)),  # Table 1's n (32 ... 8192), at most pairs + 1
    seed=0,                 # seed of the sampled negatives
    json='',                # also write the metrics to this JSON file
)
SEARCH = dict(
    EMBED,
    ckpt='',
    docs='',                # comma-separated folders and text files
    query='',               # the text to look for
    k=5,                    # how many chunks to print
    show=300,               # characters of each chunk to print
    min_chunk=16,           # a document's last chunk under this many tokens joins the one before
)


# ----------------------------------------------------------------------------- pairs, embeddings

def read_pairs(path):
    """(queries, targets) from a JSONL file of {"query": ..., "target": ...} lines."""
    queries, targets = [], []
    for lineno, line in enumerate(read_text_file(path, 'pairs file').split('\n'), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not (isinstance(row, dict)
                and all(isinstance(row.get(k), str) for k in ('query', 'target'))):
            raise ValueError(f"{path}:{lineno}: not a JSON object with string fields query and "
                             f"target: fix or delete that line")
        queries.append(row['query'])
        targets.append(row['target'])
    assert len(queries) >= 2, f"{path} holds {len(queries)} pair(s): retrieval needs at least 2"
    return queries, targets


def left_pad(seqs, n_ctx, pad_id):
    """Token lists -> idx (B, n_ctx) with the pads first, mask (B, n_ctx) True on real tokens."""
    seqs = [list(s)[:n_ctx] for s in seqs]       # a long text keeps its start
    idx = torch.full((len(seqs), n_ctx), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        idx[i, n_ctx - len(s):] = torch.tensor(s, dtype=torch.long)
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    return idx, torch.arange(n_ctx) >= n_ctx - lengths[:, None]


def trimmable(cfg):
    """Whether trimmed_hidden skips a model's pad columns (its docstring says why it is exact).
    Not llama with pos_emb: dropping the pad columns would give each real one another position."""
    return cfg.objective in ('clm', 'mtp2', 'autoencoder') and (
        cfg.arch == 'llama' and not cfg.pos_emb or cfg.arch in ('mixer', 'gmlp') and cfg.causal)


def pooled(h, mask, at):
    """Hidden states h (B, T, d) -> (B, d): the state at position `at`, or (at None) the mean of
    the real ones, mask (B, T) True on them."""
    if at is not None:
        return h[:, at]
    m = mask[..., None].to(h.dtype)
    return (h * m).sum(1) / m.sum(1).clamp(min=1)


def trimmed_hidden(model, idx, mask, at):
    """pooled(last hidden states, mask, at) (B, d_model) of left-padded rows idx (B, n_ctx),
    equal to a full forward's, for less compute: the rows are sorted by length and cut
    into groups (by dynamic programming: least sum of rows x longest + n_ctx per group), and each
    group runs on its own real columns. Why dropping a group's pad prefix is exact (`trimmable`):
    - a causal masked mixer (mixer, gmlp) reads the pad columns only through their states, which
      are the same in every row (the same pad token at the same positions, unmasked: a masked
      mixer ignores the mask): one batch-1 pass over them fills a Cache whose rows every sequence
      of the group reads (Cache.extend concatenates them, so gradients flow through the prefix);
    - llama masks pad keys out of attention and RoPE depends on relative positions only, so the
      pad columns are dropped outright.
    InfoNCE on short texts in long windows (most columns pad) is what this makes feasible."""
    backbone, n = getattr(model, 'backbone', None) or model.encoder, idx.shape[1]
    keep = 1 if at is None else n - at % n             # a group keeps the columns from `at` on
    lengths = mask.sum(1).clamp(min=keep).cpu()
    order = torch.argsort(lengths)
    longest = lengths[order].double().numpy()
    best, start = np.zeros(len(idx) + 1), np.zeros(len(idx) + 1, dtype=np.int64)
    for j in range(1, len(idx) + 1):   # best[j]: rows [0, j) grouped; the last group from start[j]
        cost = best[:j] + (j - np.arange(j)) * longest[j - 1] + n
        start[j] = int(cost.argmin())
        best[j] = cost[start[j]]
    ends = [len(idx)]
    while ends[0]:
        ends.insert(0, int(start[ends[0]]))
    order, h = order.to(idx.device), []
    for a, b in zip(ends, ends[1:]):
        x, m = idx[order[a:b]], mask[order[a:b]]
        cut = n - int(longest[b - 1])                    # the group's shared pad columns
        assert not m[:, :cut].any() and (x[:, :cut] == x[:1, :cut]).all(), "pad the left alike"
        if cut == 0:
            out = backbone(x, mask=m)
        elif model.cfg.arch == 'llama':
            out = backbone(x[:, cut:], mask=m[:, cut:])
        else:
            cache = Cache(n)
            backbone(x[:1, :cut], 0, cache)              # the pad prefix, once
            out = backbone(x[:, cut:], cut, cache)
        h.append(pooled(out, m[:, n - out.shape[1]:], None if at is None else -keep))  # (b-a, d)
    return torch.cat(h)[torch.argsort(order)]            # back to the batch's order


class TextEncoder(torch.nn.Module):
    """A language model as a text encoder: (B, n_ctx) left-padded tokens -> (B, d_model) unit
    rows (normalize=False: raw), the last hidden state at window position embed_pos (pool last)
    or the mean of the text's last hidden states (pool mean). Left padding puts every text's last
    token at -1, a position a masked mixer (a weight per position) was trained on. trim: pad
    columns skipped where exact (trimmed_hidden). Its state_dict is the model's, so its
    checkpoints are ordinary model checkpoints."""

    def __init__(self, model, embed_pos=-1, trim=True, normalize=True, pool='last'):
        super().__init__()
        self.model, self.embed_pos, self.normalize, self.pool = model, embed_pos, normalize, pool
        self.trim = trim and trimmable(model.cfg)
        n = model.cfg.n_ctx
        assert -n <= embed_pos < n, f"embed_pos={embed_pos} is outside the n_ctx={n} window"

    def forward(self, idx, mask):
        at = self.embed_pos if self.pool == 'last' else None
        if self.trim:
            h = trimmed_hidden(self.model, idx, mask, at)
        else:
            h = pooled(self.model.hidden(idx, mask), mask, at)
        return F.normalize(h.float(), dim=-1) if self.normalize else h.float()

    def state_dict(self, *args, **kwargs):
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.model.load_state_dict(*args, **kwargs)


class Embedder:
    """An 'lm' or 'retrieval' checkpoint's TextEncoder (embed_pos 0 and pool '': those it records,
    else -1 and last) and tokenizer: texts -> unit embeddings (N, d_model), batched, no grad
    (normalize=False: raw). info: the checkpoint's entries but its weights and optimizer."""

    def __init__(self, ckpt_path, device='auto', dtype='auto', batch_size=32, embed_pos=0,
                 normalize=True, pool=''):
        ckpt = train.load_checkpoint(ckpt_path)
        self.info = {k: v for k, v in ckpt.items() if k not in ('model', 'optimizer')}
        if ckpt['kind'] not in ('lm', 'retrieval'):
            raise ValueError(f"{ckpt_path} is a {ckpt['kind']!r} checkpoint: embeddings come from "
                             f"an 'lm' (train.py) or 'retrieval' (retrieve.py train) checkpoint")
        self.encoder = TextEncoder(train.model_from_checkpoint(ckpt),
                                   embed_pos or ckpt.get('embed_pos', -1), normalize=normalize,
                                   pool=pool or ckpt.get('pool', 'last'))
        self.device = train.resolve_device(str(device))
        self.dtype, _ = train.choose_dtype(self.device, dtype, ckpt.get('dtype'), reading=True)
        self.batch_size, self.n_ctx = batch_size, self.encoder.model.cfg.n_ctx
        self.encoder.to(self.device).eval()
        self.tok = Tokenizer.from_meta(ckpt['data']['meta'], ckpt['data']['data_dir'])

    @torch.no_grad()
    def embed_tokens(self, seqs):
        out = []
        with tqdm(total=len(seqs), desc='embedding', unit='text', leave=False,
                  disable=os.environ.get('RANK', '0') != '0') as bar:  # DDP: rank 0 shows it
            for i in range(0, len(seqs), self.batch_size):
                idx, mask = left_pad(seqs[i:i + self.batch_size], self.n_ctx, self.tok.pad_id)
                with train.autocast(self.device, self.dtype):
                    out.append(self.encoder(idx.to(self.device), mask.to(self.device)).cpu())
                bar.update(len(idx))
        return torch.cat(out)

    def __call__(self, texts):  # str list -> (N, d_model) float32; bos first, as in pretraining
        return self.embed_tokens([self.tok.encode(t, bos=True) for t in texts])


# ----------------------------------------------------------------------------- candidates, losses

def sample_candidates(match, n_pool, k, generator):
    """Algorithm 1 (§6.2) for a batch: for each match index (B,), k candidate indices into a pool
    of n_pool: k-1 distinct non-matching ones in random order, the match at a uniformly random
    slot. Returns cands (B, k) and labels (B,), the match's slot."""
    rows = torch.arange(match.shape[0])
    keys = torch.rand(len(rows), n_pool, generator=generator)
    keys[rows, match] = 2.0                                        # never drawn as a negative
    cands = torch.cat([keys.topk(k - 1, dim=1, largest=False).indices, match[:, None]], dim=1)
    labels = torch.randint(0, k, (len(rows),), generator=generator)
    cands[rows, k - 1] = cands[rows, labels]                       # swap the match into its slot
    cands[rows, labels] = match
    return cands, labels


def info_nce(q, t, labels, symmetric=False, tau=TAU):
    """Eq. 7 with f = exp(cos / tau) (eq. 8), averaged over queries. q (B, d) and t unit rows;
    t (M, d) is shared by all queries (in-batch negatives) or (B, k, d) per query (paper groups);
    labels (B,) index each query's match among its candidates. symmetric (in-batch, as CLIP):
    the mean with the reverse direction, each matching target picking its query among the B."""
    logits = q @ t.T if t.dim() == 2 else torch.einsum('bd,bkd->bk', q, t)
    loss = F.cross_entropy(logits / tau, labels)
    if symmetric:
        back = torch.arange(len(labels), device=labels.device)
        loss = (loss + F.cross_entropy((t[labels] @ q.T) / tau, back)) / 2
    return loss


# ----------------------------------------------------------------------------- InfoNCE training

class PairBatches:
    """get_batch for InfoNCE: (idx (M, n_ctx), mask, labels), the B queries in the first rows and
    their candidate targets after them: B targets (inbatch) or B groups of 31 (paper, Algorithm 1
    on token sequences). Micro-batch `micro` of `step` depends on nothing else (exact resume)."""

    def __init__(self, cfg, tok, n_ctx):
        self.cfg, self.n_ctx, self.pad, self.pairs = cfg, n_ctx, tok.pad_id, {}
        need = max(cfg['batch_size'], PAPER_N - 1 if cfg['negatives'] == 'paper' else 1)
        for split in train.SPLITS:
            path = os.path.join(cfg['data_dir'], f'pairs_{split}.jsonl')
            queries, targets = read_pairs(path)
            assert len(queries) >= need, f"{path} holds {len(queries)} pairs, fewer than the " \
                f"{need} a batch needs (negatives={cfg['negatives']}): lower --batch_size"
            self.pairs[split] = tuple([tok.encode(t, bos=True) for t in texts]
                                      for texts in (queries, targets))

    def __call__(self, split, step, micro, shard=0, shards=1):
        """A row shard (shards > 1) keeps its share of the queries and, with in-batch negatives,
        all B targets: each query meets the same candidates as in the whole micro-batch."""
        cfg, (queries, targets), B = self.cfg, self.pairs[split], self.cfg['batch_size']
        rng = train.batch_rng(cfg, split, step, micro)
        match = rng.choice(len(queries), B, replace=False)
        mine = slice(shard * B // shards, (shard + 1) * B // shards)
        if cfg['negatives'] == 'inbatch':
            rows, labels = match, torch.arange(B)[mine]
        else:
            gen = torch.Generator().manual_seed(int(rng.integers(2 ** 62)))
            cands, labels = sample_candidates(torch.from_numpy(match), len(targets), PAPER_N - 1,
                                              gen)
            rows, labels = cands[mine].flatten().tolist(), labels[mine]
        seqs = [queries[i] for i in match[mine]] + [targets[i] for i in rows]
        return (*left_pad(seqs, self.n_ctx, self.pad), labels)


def cmd_train(cfg):
    """InfoNCE fine-tuning (paper §6.3) on train.py's loop: DDP, AMP, budgets, exact resume."""
    if cfg['symmetric'] and cfg['negatives'] != 'inbatch':
        raise ValueError("--symmetric=True needs --negatives=inbatch (a paper group has one query)")
    assert cfg['tau'] > 0, f"--tau={cfg['tau']}: a temperature above 0 (the paper's: 0.02)"
    resuming = cfg['init_from'] == 'resume'
    path = os.path.join(cfg['out_dir'], 'ckpt.pt') if resuming else cfg['init_from']
    embedder = Embedder(path, 'cpu', embed_pos=cfg['embed_pos'], pool=cfg['pool'])  # fit: device
    src, encoder, n_ctx = embedder.info, embedder.encoder, embedder.n_ctx
    if resuming and src['kind'] != 'retrieval':
        raise ValueError(f"{path} is a {src['kind']!r} checkpoint, not one of retrieve.py train's")
    resume = train.load_checkpoint(path) if resuming else None     # with its optimizer state
    init_from = src['init_from'] if resuming else os.path.abspath(path)
    train.check_loop(cfg, resume)
    train.check_run_dir(cfg['out_dir'], resume is None, cfg['overwrite'])
    rt = train.setup_runtime(cfg, resume and resume.get('dtype'))  # a resumed run keeps its dtype
    assert not cfg['symmetric'] or cfg['grad_accum'] % rt.world == 0, \
        "--symmetric scores whole micro-batches: use a grad_accum divisible by the processes"
    try:
        get_batch = PairBatches(cfg, embedder.tok, n_ctx)
        # freeze what embeddings do not use (lm head, a decoder): AdamW and DDP skip it
        encoder(torch.zeros(1, n_ctx, dtype=torch.long),
                torch.ones(1, n_ctx, dtype=torch.bool)).sum().backward()
        for p in encoder.parameters():
            p.requires_grad_(p.grad is not None)
            p.grad = None
        if rt.master:
            n = sum(p.numel() for p in encoder.parameters() if p.requires_grad)
            print(f"InfoNCE from {init_from}: {n / 1e6:.2f}M trainable parameters, {rt.describe()}")

        def loss_fn(model, batch):
            idx, mask, labels = batch
            e = model(idx, mask)                             # (M, d_model): queries, then targets
            q, t = e[:len(labels)], e[len(labels):]
            if cfg['negatives'] == 'paper':                  # symmetric is False here
                t = t.view(len(labels), -1, t.shape[-1])     # (B, 31, d_model): each query's group
            return info_nce(q, t, labels, symmetric=cfg['symmetric'], tau=cfg['tau'])

        extra = {'kind': 'retrieval', 'model_config': src['model_config'], 'data': src['data'],
                 'embed_pos': encoder.embed_pos, 'pool': encoder.pool, 'init_from': init_from,
                 'pairs_dir': os.path.abspath(cfg['data_dir'])}
        stats = train.fit(cfg, rt, encoder, get_batch, loss_fn, extra, resume)
    finally:
        rt.close()
    if rt.master and stats['stopped'] != 'diverged':
        print(f"done: evaluate with python retrieve.py eval --ckpt={cfg['out_dir']}/ckpt.pt "
              f"--pairs={cfg['data_dir']}/pairs_val.jsonl")
    return 1 if stats['stopped'] == 'diverged' else 0


# ----------------------------------------------------------------------------- eval

def retrieval_metrics(score, N, ns, seed):
    """Top-1 accuracy (%) for each n of Table 1 (one query, its target and n-2 non-matching targets
    sampled without replacement: n-1 candidates), and MRR@10, recall@1/5/10 against all targets.
    score(rows) gives the scores (b, N) of queries `rows` against the N targets, query i's match
    is target i. Each query draws one random order of the other targets (seeded) and its first n-2
    are the negatives for n, so the candidate sets are nested and accuracy falls with n: every
    retriever scored with one seed meets the same candidates. A tie with a negative is a miss."""
    gen = torch.Generator().manual_seed(seed)
    hits, rank = {n: 0 for n in ns}, torch.empty(N, dtype=torch.long)
    for a in range(0, N, 512):                                     # 512 queries at a time
        rows = torch.arange(a, min(a + 512, N))
        b = torch.arange(len(rows))
        sim = score(rows).float()                                  # (b, N)
        pos = sim[b, rows]                                         # (b,) the matches
        rank[rows] = (sim >= pos[:, None]).sum(1)                  # 1 + targets scoring >= match
        keys = torch.rand(len(rows), N, generator=gen)
        keys[b, rows] = 2.0                                        # the match sorts last
        order = keys.argsort(dim=1)[:, :N - 1]                     # (b, N-1) the others, shuffled
        best_neg = sim.gather(1, order).cummax(dim=1).values       # best of the first j+1
        for n in ns:
            hits[n] += int((pos > best_neg[:, n - 3]).sum())
    return {'top1': {str(n): round(100.0 * hits[n] / N, 2) for n in ns},
            'mrr@10': round(float(torch.where(rank <= 10, 1.0 / rank, 0.0).mean()), 4),
            'recall@k': {str(k): round(100.0 * float((rank <= k).float().mean()), 2)
                         for k in (1, 5, 10)},
            'n_pairs': N}


def capped(ns, key, n_pairs):
    """--n or --c values (Table 1's counts), each capped at n_pairs + 1: the query, every target."""
    top = n_pairs + 1
    if max(ns) > top:
        print(f"note: only {n_pairs} pairs, so {key} is capped at {top} (the query and every "
              f"target; asked for {','.join(str(n) for n in ns if n > top)})", file=sys.stderr)
    return sorted({min(n, top) for n in ns})


def code_words(text):
    """BM25's terms for code and prose: words and identifier parts, lowercased, so that the query
    "read a file" meets read_file and ReadFile alike (both give read, file)."""
    return [w.lower() for w in re.findall(r'[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+', text)]


def bm25_scorer(queries, targets):
    """BM25 (the bm25s package, Lucene's variant) over code_words without English stopwords, as
    eval's score."""
    try:
        import bm25s
    except ImportError:
        raise ValueError("--peer=bm25 needs bm25s, an optional package: pip install bm25s") \
            from None
    stop = set(bm25s.stopwords.STOPWORDS_EN)                       # the, of, ... (33 words)
    terms = lambda text: [w for w in code_words(text) if w not in stop]  # noqa: E731
    index = bm25s.BM25()
    index.index([terms(t) for t in targets], show_progress=False)
    words, none = [terms(q) for q in queries], np.zeros(len(targets), dtype=np.float32)
    return lambda rows: torch.from_numpy(np.stack([index.get_scores(words[i]) if words[i] else none
                                                   for i in rows]))


def peer_embedder(name, device, batch_size):
    """A sentence-transformers model (a folder or a hub name) as texts -> unit rows (N, d): a known
    retriever scored on the same pairs. The optional package is imported only here."""
    how = ("pass a model folder, --peer=PATH (doc/usage.md, Retrieval, installs all-MiniLM-L6-v2 "
           "offline); sentence-transformers is optional: pip install sentence-transformers")
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise ValueError(f"--peer needs sentence-transformers: {how}") from None
    hub, cache_only = os.environ.get('HF_ENDPOINT', 'https://huggingface.co'), {}
    try:   # the hub client retries an unreachable hub for a minute: look first, then cache only
        if not os.path.isdir(name):
            check_online(hub, '')
    except ValueError:
        cache_only = dict(local_files_only=True)
    try:
        model = SentenceTransformer(name, device=str(device), **cache_only)
    except (OSError, ValueError) as e:
        why = f"{hub} is out of reach" if cache_only else str(e).splitlines()[0]
        raise ValueError(f"--peer={name}: sentence-transformers could not load it ({why}): "
                         f"{how}") from None
    return lambda texts: F.normalize(torch.as_tensor(model.encode(texts, batch_size=batch_size))
                                     .float(), dim=-1)


def cmd_eval(cfg):
    if not (cfg['ckpt'] or cfg['peer']):
        raise ValueError("nothing to evaluate: pass --ckpt=CKPT and/or --peer=NAME_OR_PATH")
    queries, targets = read_pairs(cfg['pairs'])
    ns, device, embedders = int_list(cfg['n'], 'n', low=3), train.resolve_device(cfg['device']), {}
    if cfg['ckpt']:
        embedders[cfg['ckpt']] = Embedder(cfg['ckpt'], device, cfg['dtype'], cfg['batch_size'],
                                          cfg['embed_pos'], pool=cfg['pool'])
    for name in cfg['peer'].split(',') if cfg['peer'] else ():  # each loads before any scoring
        embedders[name] = name if name == 'bm25' else peer_embedder(name, device,
                                                                    cfg['batch_size'])
    ns, results = capped(ns, 'n', len(queries)), {}  # noted once the models have loaded
    for name, embed in embedders.items():
        if embed == 'bm25':
            score = bm25_scorer(queries, targets)
        else:
            q, t = embed(queries), embed(targets)                  # (N, d) unit rows each
            score = lambda rows: q[rows] @ t.T                     # noqa: E731 (cosines)
        results[name] = retrieval_metrics(score, len(queries), ns, cfg['seed'])
    width = max(len(name) for name in results)
    print(f"{len(queries):,} pairs from {cfg['pairs']}: top-1 % against n - 1 candidates; "
          f"MRR@10 and recall@k % against all {len(queries):,} targets")
    print(f"{'n':<{width}}" + ''.join(f"{n:>7}" for n in ns) + '  MRR@10  R@1  R@5  R@10')
    for name, m in results.items():
        r = m['recall@k']
        print(f"{name:<{width}}" + ''.join(f"{v:7.1f}" for v in m['top1'].values()) +
              f"  {m['mrr@10']:6.3f} {r['1']:4.1f} {r['5']:4.1f} {r['10']:5.1f}")
    if cfg['json']:  # one retriever: its metrics; several: {its name as given: its metrics}
        out = results if len(results) > 1 else results.popitem()[1]
        write_atomic(cfg['json'], json.dumps(out, indent=1) + '\n')
    return 0


# ----------------------------------------------------------------------------- indirect retrieval

def algorithm1(q_emb, t_emb, match, c, generator):
    """Algorithm 1 (§6.2): RetrievalMixer inputs x (B, c, d) = [query, c-1 targets], the matching
    target at a uniformly random slot labels (B,), the other c-2 distinct and non-matching.
    Also returns the rows read, (B, c): the query's, then the targets'."""
    cands, labels = sample_candidates(match, len(t_emb), c - 1, generator)
    x = torch.cat([q_emb[match][:, None], t_emb[cands]], dim=1)
    return x, labels, torch.cat([match[:, None], cands], dim=1)


@torch.no_grad()
def indirect_accuracy(model, q_emb, t_emb, c, seed):
    """(mean cross-entropy, top-1 %) with every query of the split once, against c-1 candidates."""
    gen, loss, hits = torch.Generator().manual_seed(seed), 0.0, 0
    device = next(model.parameters()).device
    for a in range(0, len(q_emb), 256):
        x, labels, _ = algorithm1(q_emb, t_emb, torch.arange(a, min(a + 256, len(q_emb))), c, gen)
        logits, l = model(x.to(device), labels.to(device))
        loss += float(l) * len(labels)
        hits += int((logits.argmax(-1).cpu() == labels).sum())
    return loss / len(q_emb), 100.0 * hits / len(q_emb)


def cmd_indirect(cfg):
    """Frozen embeddings, a RetrievalMixer per c (paper §6.2): how much retrieval the pretrained
    embeddings carry, without changing the model that made them."""
    pairs = {s: read_pairs(os.path.join(cfg['data_dir'], f'pairs_{s}.jsonl')) for s in train.SPLITS}
    cs = capped(int_list(cfg['c'], 'c', low=3), 'c', min(len(pairs[s][0]) for s in pairs))
    outs, n_val = {c: os.path.join(cfg['out_dir'], f'c{c}') for c in cs}, len(pairs['val'][0])
    train.check_loop(cfg)
    for folder in outs.values():   # every output location, before any embedding or training
        train.check_run_dir(folder, True, cfg['overwrite'], resumable=False)
    rt, ckpt = train.setup_runtime(cfg), os.path.abspath(cfg['ckpt'])
    try:
        embedder = Embedder(cfg['ckpt'], rt.device, cfg['dtype'], embed_pos=cfg['embed_pos'],
                            normalize=cfg['normalize'], pool=cfg['pool'])
        d_model = embedder.encoder.model.cfg.d_model
        # normalize: unit rows scaled to unit RMS per component, O(1) inputs whatever d_model
        scale = math.sqrt(d_model) if cfg['normalize'] else 1.0
        emb = {s: tuple(embedder(texts) * scale for texts in pairs[s]) for s in train.SPLITS}
        results = {}
        for c in cs:
            def get_batch(split, step, micro, shard=0, shards=1, c=c):
                rng = train.batch_rng(cfg, split, step, micro)
                q_emb, t_emb = emb[split]
                gen = torch.Generator().manual_seed(int(rng.integers(2 ** 62)))
                match = torch.from_numpy(rng.integers(0, len(q_emb), cfg['batch_size']))
                x, labels, rows = algorithm1(q_emb, t_emb, match, c, gen)
                mine = slice(shard * len(x) // shards, (shard + 1) * len(x) // shards)
                return rows[mine], x[mine], labels[mine]      # rows (B, c): the step's "tokens"

            if rt.master:
                print(f"## c={c} (n - 1 = {c - 1} candidates)")
            torch.manual_seed(cfg['seed'])
            mixer = dict(d_model=d_model, n_layers=cfg['n_layers'], c=c)
            model = RetrievalMixer(**mixer)
            extra = {'kind': 'indirect', 'retrieval_mixer': mixer, 'data': embedder.info['data'],
                     'embedder': dict(ckpt=ckpt, embed_pos=embedder.encoder.embed_pos,
                                      pool=embedder.encoder.pool,
                                      normalize=cfg['normalize'])}
            stats = train.fit(dict(cfg, out_dir=outs[c]), rt, model, get_batch,
                              lambda m, b: m(b[1], b[2])[1], extra)
            if stats['stopped'] == 'diverged':
                return 1
            loss, top1 = indirect_accuracy(model.eval(), *emb['val'], c, cfg['seed'])
            results[str(c)] = dict(loss=round(loss, 4), top1=round(top1, 2), steps=stats['step'])
            if rt.master:
                print(f"c={c}: top-1 {top1:.1f}% (chance {100 / (c - 1):.1f}%), val loss "
                      f"{loss:.3f}, {n_val} val queries each against c-1 targets")
    finally:
        rt.close()
    if rt.master and cfg['json']:
        out = {'c': results, 'n_val': n_val, 'ckpt': ckpt}
        write_atomic(cfg['json'], json.dumps(out, indent=1) + '\n')
    return 0


# ----------------------------------------------------------------------------- search

def cmd_search(cfg):
    """Embed the documents in memory, a chunk per window, and print the chunks nearest the query."""
    embedder = Embedder(cfg['ckpt'], cfg['device'], cfg['dtype'], cfg['batch_size'],
                        cfg['embed_pos'], pool=cfg['pool'])
    tok, step = embedder.tok, embedder.n_ctx - 1                 # bos is added to each chunk
    docs = []   # (path, text): each text file, and each UTF-8 file under each folder
    for path in cfg['docs'].split(','):
        if os.path.isdir(path):
            for f in visible_files(path):                         # hidden entries left out
                with contextlib.suppress(ValueError):             # not UTF-8: a binary file
                    docs.append((f, read_text_file(f, 'document')))
        else:
            docs.append((path, read_text_file(path, 'document')))
    chunks, seqs = [], []
    for source, text in docs:
        ids = tok.encode(text)
        starts = list(range(0, max(len(ids), 1), step))
        if len(starts) > 1 and len(ids) - starts[-1] < cfg['min_chunk']:
            starts.pop()   # a tiny tail, which cosines rank high, is shown with the chunk before it
        for a, b in zip(starts, starts[1:] + [len(ids)]):
            chunks.append((source, a, tok.decode(ids[a:b])))
            seqs.append([tok.bos_id] + ids[a:a + step])          # a chunk's embedding: its window
    assert chunks, f"no text documents in --docs={cfg['docs']}"
    emb = embedder.embed_tokens(seqs)                            # (chunks, d_model) unit rows
    top = (emb @ embedder([cfg['query']])[0]).topk(min(cfg['k'], len(chunks)))  # the best cosines
    for rank, (score, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
        source, offset, text = chunks[i]
        print(f"{rank}. {score:.3f}  {source} @ token {offset}")
        print('   ' + text[:cfg['show']].replace('\n', '\n   '))
    return 0


# ----------------------------------------------------------------------------- command line
# name: (function, its keys and defaults, the keys it cannot run without, with an example value)
COMMANDS = {
    'train': (cmd_train, TRAIN, ('init_from=out/ckpt.pt',)),
    'eval': (cmd_eval, EVAL, ('pairs=data/pystdlib/pairs_val.jsonl',)),
    'indirect': (cmd_indirect, INDIRECT, ('ckpt=out/ckpt.pt',)),
    'search': (cmd_search, SEARCH, ('ckpt=out-retrieval/ckpt.pt', 'docs=src/,notes.txt',
                                    'query="parse an ISO date"')),
}
CHOICES = dict(negatives=('inbatch', 'paper'), pool=('', 'last', 'mean'),
               dtype=train.CHOICES['dtype'], schedule=train.CHOICES['schedule'])


def run(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ('-h', '--help'):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        raise ValueError(f"unknown subcommand {argv[0]!r}: use one of {', '.join(COMMANDS)}")
    command, defaults, required = COMMANDS[argv[0]]
    cfg = parse_args(argv[1:], defaults, __doc__,
                     {k: v for k, v in CHOICES.items() if k in defaults})
    for example in required:
        if not cfg[example.split('=')[0]]:
            raise ValueError(f"retrieve.py {argv[0]} needs --{example} (see python retrieve.py "
                             f"{argv[0]} --help)")
    if cfg.get('json'):  # before the work that fills it
        check_output_file(cfg['json'], 'json')
    return command(cfg)


def main(argv=None):
    return run_main(lambda: run(argv), "interrupted: finished outputs are whole "
                                       "(train: continue with --init_from=resume)")


if __name__ == '__main__':
    sys.exit(main())
