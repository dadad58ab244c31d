"""
retrieve.py: retrieval with masked mixers and transformers (paper §6), in one file.

    # InfoNCE fine-tuning of a pretrained checkpoint (§6.3, eqs 7-8)
    python retrieve.py train --init_from=out/ckpt.pt --data_dir=data/pystdlib
    # top-1 for many n (Tables 1, 3, 4) and MRR@10; --peer=bm25,MODEL: known retrievers too
    python retrieve.py eval --ckpt=out-retrieval/ckpt.pt --pairs=data/pystdlib/pairs_val.jsonl
    # a RetrievalMixer per c on the frozen model's last hidden states (§6.2, Algorithm 1)
    python retrieve.py indirect --ckpt=out/ckpt.pt --data_dir=data/pystdlib --c=32,128
    # the functions, methods and runs of lines of folders closest to a query
    python retrieve.py search --ckpt=out-retrieval/ckpt.pt --docs=src/ --query="parse an ISO date"

python retrieve.py COMMAND --help lists its keys; train and indirect run train.py's loop
(DDP under torchrun, AMP, budgets, log.jsonl; train resumes with --init_from=resume).
n counts as Table 1's caption does: one query, its matching target and n-2 non-matching targets,
so n-1 candidates (chance 1/(n-1)); indirect's c and train's paper negatives count the same way.
"""
import hashlib, json, math, os, re, shlex, sys

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import train
from model import RetrievalMixer
from configurator import check_output_file, int_list, parse_args, run_main, write_atomic
from prepare import Tokenizer, binary, chunks_of, read_pairs, source_lines, visible_files

TAU = 0.02             # InfoNCE temperature (eq. 8)
PAPER_N = 32           # --negatives=paper: a query, its target and 30 non-matching ones (§6.3)


# ----------------------------------------------------------------------------- each command's keys

EMBED = dict(  # Embedder's arguments, every command's
    device='auto',          # auto (cuda if present), cpu or cuda[:i]
    dtype='auto',           # auto: train as train.py; embed CPU fp32, GPU the trained (autocast)
    batch_size=32,          # texts per forward pass (train: queries per micro-batch)
    pool='',                # last: the state of a text's last token (the paper) | mean: the
                            # mean of its tokens' states; '': the checkpoint's (else last)
    padding='',             # right: a text starts at position 0 | left: it ends at n_ctx - 1 (the
                            # paper's §6.1); '': the checkpoint's (else right)
)
FIT = dict(train.LOOP_DEFAULTS, **EMBED, warmup_iters=20, eval_interval=100, eval_iters=10,
           data_dir='')  # holds pairs_train.jsonl and pairs_val.jsonl; '': the checkpoint's
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
    json='',                # also write the results to this JSON file (doc/usage.md: keys)
)
EVAL = dict(
    EMBED,
    ckpt='',
    peer='',                # also (or only) known retrievers, comma-separated: bm25, hybrid (RRF
                            # of --ckpt and bm25), sentence-transformers model folders
    pairs='',               # a pairs JSONL file ({"query": ..., "target": ...} per line)
    n=','.join(str(2 ** k) for k in range(5, 14)),  # Table 1's n (32 ... 8192), at most pairs + 1
    seed=0,                 # seed of the sampled negatives
    json='',                # also write the results to this JSON file (doc/usage.md: keys)
    overwrite=False,        # replace what exists: out_dir's run (train, indirect), --json's file
)
SEARCH = dict(
    EMBED,
    ckpt='',
    docs='',                # comma-separated folders and text files
    exclude='',             # names or globs left out of --docs' folders: venv,*.min.js
    query='',               # the text to look for
    k=5,                    # how many chunks to print
    show=4,                 # lines of each chunk to print
    index='',               # the chunk embeddings kept between calls; '': CKPT.index beside it
    hybrid=False,           # rank by reciprocal-rank fusion with BM25 (eval --peer=hybrid)
)


# ----------------------------------------------------------------------------- pairs, embeddings

def pad(seqs, n_ctx, pad_id, left=False):
    """Token lists -> idx (B, n_ctx) and mask (B, n_ctx), True on real tokens. A text keeps its
    first n_ctx tokens; its pads follow it, or come first (left, the paper's §6.1)."""
    idx = torch.full((len(seqs), n_ctx), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), n_ctx, dtype=torch.bool)
    for i, s in enumerate(seqs):
        s = list(s)[:n_ctx]
        cols = slice(n_ctx - len(s), n_ctx) if left else slice(0, len(s))
        idx[i, cols], mask[i, cols] = torch.tensor(s, dtype=torch.long), True
    return idx, mask


class TextEncoder(torch.nn.Module):
    """A language model as a text encoder: padded texts idx (B, n_ctx), mask (B, n_ctx) True on
    their tokens -> (B, d_model) unit rows (normalize=False: raw), pooled from the last hidden
    states of a text's own tokens: the last one's (pool last) or their mean (pool mean).

    What happens to the pads. Right padding (the default): a text starts at position 0 and its pads
    come after it. No token of a causal encoder reads a later position, so the pads change nothing,
    and the batch runs only as far as its longest text: each embedding is that of the text alone
    (up to float rounding). Other encoders (causal=False, objective bidirectional: the pads after
    the text are read by mixings, masked by attention; half blanks from the middle) run the whole
    window: an embedding never depends on its batch's other texts. Left padding (the paper's §6.1)
    ends every text at window position n_ctx - 1, one position for a mixer's per-position weights;
    there the text reads the pads before it (attention masks them as keys; masked mixings, a
    hybrid's too, gMLP and ELiTA mix them in, as the paper's mixer does), and the whole window runs.
    Its state_dict is the model's, so its checkpoints are ordinary model checkpoints."""

    def __init__(self, model, pool='last', padding='right', normalize=True):
        super().__init__()
        self.model, self.pool, self.padding, self.normalize = model, pool, padding, normalize
        causal = model.cfg.causal and model.cfg.objective in ('clm', 'mtp2', 'autoencoder')
        self.cut = padding == 'right' and causal

    def forward(self, idx, mask):
        if self.cut:  # the columns after the longest text hold pads only
            longest = int(mask.sum(1).max())
            idx, mask = idx[:, :longest], mask[:, :longest]
        h = self.model.hidden(idx, mask).float()                 # (B, T, d_model)
        if self.pool == 'mean':
            m = mask[..., None].float()
            h = (h * m).sum(1) / m.sum(1)
        else:  # the last token of each text: where its count of tokens first peaks
            h = h[torch.arange(len(h)), mask.cumsum(1).argmax(1)]
        return F.normalize(h, dim=-1) if self.normalize else h

    def state_dict(self, *args, **kwargs):
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.model.load_state_dict(*args, **kwargs)


class Embedder:
    """An 'lm' or 'retrieval' checkpoint's TextEncoder and tokenizer: texts -> unit embeddings
    (N, d_model), batched, no grad (normalize=False: raw)."""

    def __init__(self, ckpt_path, device='auto', dtype='auto', batch_size=32, pool='',
                 padding='', normalize=True):
        ckpt = train.load_checkpoint(ckpt_path)
        self.info = {k: v for k, v in ckpt.items() if k not in ('model', 'optimizer')}
        if ckpt['kind'] not in ('lm', 'retrieval'):
            raise ValueError(f"{ckpt_path} is of kind {ckpt['kind']!r}: embeddings come from "
                             f"an 'lm' (train.py) or 'retrieval' (retrieve.py train) checkpoint")
        # retrieval checkpoints that record no padding (they record embed_pos) were left-padded
        padding = padding or ckpt.get('padding', 'left' if 'embed_pos' in ckpt else 'right')
        self.encoder = TextEncoder(train.model_from_checkpoint(ckpt),
                                   pool or ckpt.get('pool', 'last'), padding, normalize)
        self.device = train.resolve_device(str(device))
        self.dtype, _ = train.choose_dtype(self.device, dtype, ckpt.get('dtype'), reading=True)
        self.batch_size, self.n_ctx = batch_size, self.encoder.model.cfg.n_ctx
        self.encoder.to(self.device).eval()
        self.tok = Tokenizer.from_checkpoint(ckpt)

    @torch.no_grad()
    def embed_tokens(self, seqs):
        """Token lists -> (N, d_model), batched in order of length (a batch runs to its longest)."""
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        out = torch.empty(len(seqs), self.encoder.model.cfg.d_model)
        with tqdm(total=len(seqs), desc='embedding', unit='text', leave=False,
                  disable=len(seqs) <= self.batch_size or os.environ.get('RANK', '0') != '0'
                  ) as bar:  # one batch, or DDP's other ranks: no bar
            for a in range(0, len(seqs), self.batch_size):
                rows = order[a:a + self.batch_size]
                idx, mask = pad([seqs[i] for i in rows], self.n_ctx, self.tok.pad_id,
                                self.encoder.padding == 'left')
                with train.autocast(self.device, self.dtype):
                    out[rows] = self.encoder(idx.to(self.device), mask.to(self.device)).cpu()
                bar.update(len(rows))
        return out

    def __call__(self, texts):  # str list -> (N, d_model) float32; bos first, as in pretraining
        return self.embed_tokens([[self.tok.bos_id] + ids for ids in self.tok.encode_batch(texts)])


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

    def __init__(self, cfg, tok, n_ctx, left=False):
        self.cfg, self.n_ctx, self.pad, self.left, self.pairs = cfg, n_ctx, tok.pad_id, left, {}
        need = max(cfg['batch_size'], PAPER_N - 1 if cfg['negatives'] == 'paper' else 1)
        for split in train.SPLITS:
            path = os.path.join(cfg['data_dir'], f'pairs_{split}.jsonl')
            queries, targets = read_pairs(path)
            fix = '--negatives=inbatch' if need > cfg['batch_size'] else 'lower --batch_size'
            assert len(queries) >= need, f"{path} holds {len(queries)} pairs, fewer than the " \
                f"{need} a batch needs (negatives={cfg['negatives']}): use {fix}, or more pairs"
            self.pairs[split] = tuple([[tok.bos_id] + ids for ids in tok.encode_batch(texts)]
                                      for texts in (queries, targets))

    def __call__(self, split, step, micro, shard=0, shards=1):
        """A row shard (shards > 1) keeps its share of the queries and, with in-batch negatives,
        all B targets: each query meets the same candidates as in the whole micro-batch."""
        cfg, (queries, targets), B = self.cfg, self.pairs[split], self.cfg['batch_size']
        rng = train.batch_rng(cfg, split, step, micro)
        match = torch.from_numpy(rng.choice(len(queries), B, replace=False))
        mine = slice(shard * B // shards, (shard + 1) * B // shards)
        if cfg['negatives'] == 'inbatch':
            rows, labels = match, torch.arange(B)[mine]
        else:
            gen = torch.Generator().manual_seed(int(rng.integers(2 ** 62)))
            cands, labels = sample_candidates(match, len(targets), PAPER_N - 1, gen)
            rows, labels = cands[mine].flatten().tolist(), labels[mine]
        seqs = [queries[i] for i in match[mine]] + [targets[i] for i in rows]
        return (*pad(seqs, self.n_ctx, self.pad, self.left), labels)


def cmd_train(cfg):
    """InfoNCE fine-tuning (paper §6.3) on train.py's loop: DDP, AMP, budgets, exact resume."""
    if cfg['symmetric'] and cfg['negatives'] != 'inbatch':
        raise ValueError("--symmetric=True needs --negatives=inbatch (a paper group has one query)")
    assert cfg['tau'] > 0, f"--tau={cfg['tau']}: a temperature above 0 (the paper's: 0.02)"
    resuming = cfg['init_from'] == 'resume'
    path = os.path.join(cfg['out_dir'], 'ckpt.pt') if resuming else cfg['init_from']
    embedder = Embedder(path, 'cpu', pool=cfg['pool'], padding=cfg['padding'])  # fit: device
    src, encoder, n_ctx = embedder.info, embedder.encoder, embedder.n_ctx
    cfg['data_dir'] = cfg['data_dir'] or src.get('pairs_dir') or src['data']['data_dir']
    if resuming and src['kind'] != 'retrieval':
        raise ValueError(f"{path} is of kind {src['kind']!r}, not one of retrieve.py train's: "
                         f"use another --out_dir, or replace it: --init_from=CKPT --overwrite")
    for key in ('pool', 'padding'):  # a resumed run keeps what defines its embeddings
        if resuming and getattr(encoder, key) != src[key]:
            raise ValueError(f"--{key}={getattr(encoder, key)} contradicts {path}, trained with "
                             f"{key}={src[key]}: drop the flag, or train into a new --out_dir")
    resume = train.load_checkpoint(path) if resuming else None     # with its optimizer state
    init_from = src['init_from'] if resuming else os.path.abspath(path)
    train.check_loop(cfg, resume)
    train.check_run_dir(cfg['out_dir'], resume is None, cfg['overwrite'])
    rt = train.Runtime(cfg, resume and resume.get('dtype'))  # a resumed run keeps its dtype
    if cfg['symmetric'] and rt.world > 1:  # each rank holds its rows of every micro-batch
        raise ValueError("--symmetric scores whole micro-batches: train it in one process")
    try:
        get_batch = PairBatches(cfg, embedder.tok, n_ctx, encoder.padding == 'left')
        # freeze what embeddings do not use (lm head, a decoder): AdamW and DDP skip it
        encoder(*pad([[0] * n_ctx], n_ctx, 0)).sum().backward()   # a window of token 0
        for p in encoder.parameters():
            p.requires_grad_(p.grad is not None)
            p.grad = None
        if rt.master:
            n = sum(p.numel() for p in encoder.parameters() if p.requires_grad)
            print(f"InfoNCE from {init_from}: {n / 1e6:.2f}M trainable parameters, {rt.describe()}")

        def loss_fn(model, batch):
            idx, mask, labels = batch             # the queries, then their candidate targets
            b = len(labels)                       # two passes: each runs to its own longest text
            q, t = model(idx[:b], mask[:b]), model(idx[b:], mask[b:])     # (b, d), (M - b, d)
            if cfg['negatives'] == 'paper':                  # symmetric is False here
                t = t.view(len(labels), -1, t.shape[-1])     # (B, 31, d_model): each query's group
            return info_nce(q, t, labels, symmetric=cfg['symmetric'], tau=cfg['tau'])

        extra = {'kind': 'retrieval', 'model_config': src['model_config'], 'data': src['data'],
                 'tokenizer': embedder.tok.spec,  # Tokenizer.from_checkpoint's
                 'pool': encoder.pool, 'padding': encoder.padding, 'init_from': init_from,
                 'pairs_dir': os.path.abspath(cfg['data_dir'])}
        stats = train.fit(cfg, rt, encoder, get_batch, loss_fn, extra, resume)
    finally:
        rt.close()
    if rt.master and stats['stopped'] != 'diverged':
        then = ['python', 'retrieve.py', 'eval', f"--ckpt={cfg['out_dir']}/ckpt.pt",
                f"--pairs={cfg['data_dir']}/pairs_val.jsonl"]
        print(f"done: evaluate with {shlex.join(then)}")  # quoted: a path may hold spaces
    return 1 if stats['stopped'] == 'diverged' else 0


# ----------------------------------------------------------------------------- eval

def retrieval_metrics(score, N, ns, seed):
    """Top-1 accuracy (%) for each n of Table 1 (n-1 candidates: the query's target and n-2 others,
    without replacement), and MRR@10 against all N targets. score(rows): the scores (b, N) of
    queries `rows`, query i's match being target i. Each query draws one seeded order of the other
    targets, whose first n-2 are its negatives for n: the candidate sets are nested, and every
    retriever scored with one seed meets the same ones. A tie with a negative is a miss."""
    gen = torch.Generator().manual_seed(seed)
    hits, rank = {n: 0 for n in ns}, torch.empty(N, dtype=torch.long)
    for rows in torch.arange(N).split(512):                        # 512 queries at a time
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
            'n_pairs': N}


def code_words(text):
    """BM25's terms for code and prose: words and identifier parts, lowercased, so that the query
    "read a file" meets read_file and ReadFile alike (both give read, file)."""
    return [w.lower() for w in re.findall(r'[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+', text)]


def bm25_scorer(queries, targets):
    """BM25 (the bm25s package, Lucene's variant) of code_words less English stopwords: a score."""
    try:
        import bm25s
    except ImportError:
        raise ValueError("BM25 needs bm25s, an optional package: pip install bm25s") from None
    stop = set(bm25s.stopwords.STOPWORDS_EN)                       # the, of, ... (33 words)
    terms = lambda text: [w for w in code_words(text) if w not in stop]  # noqa: E731
    index, corpus = bm25s.BM25(), [terms(t) for t in targets]
    words, none = [terms(q) for q in queries], np.zeros(len(targets), dtype=np.float32)
    if not any(corpus):  # no target holds a word BM25 reads (say, all in CJK): every score is 0
        return lambda rows: torch.zeros(len(rows), len(targets))
    index.index(corpus, show_progress=False)
    return lambda rows: torch.from_numpy(np.stack([index.get_scores(words[i]) if words[i] else none
                                                   for i in rows]))


def fused(*scorers, k=60):
    """Reciprocal-rank fusion (Cormack et al., 2009) as a score: for each query, the sum over the
    scorers of 1 / (k + the rank they give each of the N targets); k = 60, theirs. A target's rank
    is 1 + the targets scoring higher: tied ones share it, whatever their order in the file."""
    def rank(s):                                                   # s (b, N) -> ranks (b, N)
        return 1 + s.shape[1] - torch.searchsorted(s.sort(1).values, s, right=True)
    return lambda rows: sum(1.0 / (k + rank(s(rows).float().contiguous())) for s in scorers)


def peer_embedder(name, device, batch_size):
    """A sentence-transformers model folder as texts -> unit rows (N, d): a known retriever scored
    on the same pairs. The optional package is imported only here."""
    how = ("doc/usage.md, Retrieval, installs all-MiniLM-L6-v2 offline; sentence-transformers is "
           "optional: pip install sentence-transformers")
    if not os.path.isdir(name):
        raise ValueError(f"--peer={name} is not a model folder: pass its path ({how})")
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise ValueError(f"--peer needs sentence-transformers ({how})") from None
    model = SentenceTransformer(name, device=str(device), local_files_only=True)
    return lambda texts: F.normalize(torch.as_tensor(model.encode(texts, batch_size=batch_size))
                                     .float(), dim=-1)


def cmd_eval(cfg):
    if not (cfg['ckpt'] or cfg['peer']):
        raise ValueError("nothing to evaluate: pass --ckpt=CKPT and/or --peer=NAME_OR_PATH")
    queries, targets = read_pairs(cfg['pairs'])
    # n past the pairs means the query against every target: capped there
    ns = sorted({min(n, len(queries) + 1) for n in int_list(cfg['n'], 'n', low=3)})
    device, embedders, scores = train.resolve_device(cfg['device']), {}, {}
    if cfg['ckpt']:
        embedders[cfg['ckpt']] = Embedder(cfg['ckpt'], **{k: cfg[k] for k in EMBED})
    peers = cfg['peer'].split(',') if cfg['peer'] else []
    if 'hybrid' in peers and not cfg['ckpt']:
        raise ValueError("--peer=hybrid fuses the ranks of --ckpt and BM25: pass --ckpt=CKPT")
    for name in peers:  # each loads before any scoring
        if name not in ('bm25', 'hybrid'):
            embedders[name] = peer_embedder(name, device, cfg['batch_size'])
    for name, embed in embedders.items():
        q, t = embed(queries), embed(targets)                      # (N, d) unit rows each
        scores[name] = lambda rows, q=q, t=t: q[rows] @ t.T        # cosines
    if {'bm25', 'hybrid'} & set(peers):
        scores['bm25'] = bm25_scorer(queries, targets)
    if 'hybrid' in peers:
        scores['hybrid'] = fused(scores[cfg['ckpt']], scores['bm25'])
    results = {name: retrieval_metrics(scores[name], len(queries), ns, cfg['seed'])
               for name in [cfg['ckpt']] * bool(cfg['ckpt']) + peers}
    width = max(len(name) for name in results)
    print(f"{len(queries):,} pairs from {cfg['pairs']}: top-1 % against n - 1 candidates; "
          f"MRR@10 against all {len(queries):,} targets")
    print(f"{'n':<{width}}" + ''.join(f"{n:>7}" for n in ns) + '  MRR@10')
    for name, m in results.items():
        print(f"{name:<{width}}" + ''.join(f"{v:7.1f}" for v in m['top1'].values()) +
              f"  {m['mrr@10']:6.3f}")
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
def indirect_accuracy(model, q_emb, t_emb, c, seed, device):
    """(mean cross-entropy, top-1 %) with every query of the split once, against c-1 candidates."""
    gen, loss, hits = torch.Generator().manual_seed(seed), 0.0, 0
    for match in torch.arange(len(q_emb)).split(256):
        x, labels, _ = algorithm1(q_emb, t_emb, match, c, gen)
        logits, l = model(x.to(device), labels.to(device))
        loss += float(l) * len(labels)
        hits += int((logits.argmax(-1).cpu() == labels).sum())
    return loss / len(q_emb), 100.0 * hits / len(q_emb)


def cmd_indirect(cfg):
    """Frozen embeddings, a RetrievalMixer per c (paper §6.2): how much retrieval the pretrained
    embeddings carry, without changing the model that made them."""
    src = train.load_checkpoint(cfg['ckpt'])  # its pairs (a retrieval one's), else its data's
    cfg['data_dir'] = cfg['data_dir'] or src.get('pairs_dir') or src['data']['data_dir']
    pairs = {s: read_pairs(os.path.join(cfg['data_dir'], f'pairs_{s}.jsonl')) for s in train.SPLITS}
    most = min(len(pairs[s][0]) for s in pairs) + 1     # the query and every target (as eval's n)
    cs = sorted({min(c, most) for c in int_list(cfg['c'], 'c', low=3)})
    outs, n_val = {c: os.path.join(cfg['out_dir'], f'c{c}') for c in cs}, len(pairs['val'][0])
    train.check_loop(cfg)
    for folder in outs.values():   # every output location, before any embedding or training
        train.check_run_dir(folder, True, cfg['overwrite'], resumable=False)
    rt, ckpt = train.Runtime(cfg), os.path.abspath(cfg['ckpt'])
    try:
        embedder = Embedder(cfg['ckpt'], rt.device, cfg['dtype'], padding=cfg['padding'],
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
                     'embedder': dict(ckpt=ckpt, padding=embedder.encoder.padding,
                                      pool=embedder.encoder.pool, normalize=cfg['normalize'])}
            stats = train.fit(dict(cfg, out_dir=outs[c]), rt, model, get_batch,
                              lambda m, b: m(b[1], b[2])[1], extra)
            if stats['stopped'] == 'diverged':
                return 1
            loss, top1 = indirect_accuracy(model.eval(), *emb['val'], c, cfg['seed'], rt.device)
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

def search_index(embedder, files, path, key):
    """The chunks of `files` ({path: text}) and their embeddings, kept in the index file `path` from
    one call to the next: {'key': key, 'files': {absolute path: (sha256 of its text, spans (k, 2),
    embeddings (k, d_model))}}. Only texts it lacks are embedded (a moved file is found by sha256),
    then it is written back whole, less deleted files. key: the checkpoint, pool and padding."""
    index = {'key': key, 'files': {}}
    if os.path.isfile(path):  # (a folder: refused below, by check_output_file)
        try:
            held = torch.load(path, weights_only=True)
            assert set(held) == {'key', 'files'}
        except Exception as e:  # cut short, or another file
            raise ValueError(f"{path} is not a readable search index ({type(e).__name__}): pass "
                             f"another --index") from None
        if held['key'] == key:  # else stale, rebuilt: another checkpoint's, or one trained on
            index = held
    known = {(v[0], f.endswith('.py')): v for f, v in index['files'].items()}  # moved ones too
    todo, embedded = {}, 0  # path: (sha256, spans) of the files to embed; chunks embedded
    for f, text in files.items():
        sha = hashlib.sha256(text.encode()).hexdigest()
        if (sha, f.endswith('.py')) in known:  # (a .py text is cut otherwise: at definitions)
            index['files'][os.path.abspath(f)] = known[sha, f.endswith('.py')]
        else:
            todo[f] = sha, chunks_of(f, text, embedder.tok, embedder.n_ctx - 1)  # bos first
    if any(spans for _, spans in todo.values()):  # before the embedding: updated in place
        check_output_file(path, 'index', overwrite=True)
    try:  # a file at a time: Ctrl-C keeps the files embedded so far
        for f, (sha, spans) in tqdm(todo.items(), 'embedding', unit='file', leave=False):
            lines = source_lines(files[f])
            rows = embedder([''.join(lines[a - 1:b]) for a, b in spans])  # (k, d_model) unit rows
            index['files'][os.path.abspath(f)] = sha, torch.tensor(spans).view(-1, 2), rows
            embedded += len(spans)
    finally:
        if embedded:  # changed: written back whole, less the files deleted since
            index['files'] = {f: v for f, v in index['files'].items() if os.path.isfile(f)}
            write_atomic(path, lambda out: torch.save(index, out))
    return {f: index['files'][os.path.abspath(f)] for f in files}, embedded


def cmd_search(cfg):
    """The chunks of --docs (functions, methods, runs of lines) nearest the query."""
    embedder = Embedder(cfg['ckpt'], **{k: cfg[k] for k in EMBED})
    assert cfg['k'] >= 1 and cfg['show'] >= 0, "--k: 1 chunk or more; --show: 0 lines or more"
    files = {}   # path: text, read as prepare.py reads; binary files, hidden ones, pipes left out
    for path in filter(None, cfg['docs'].split(',')):  # (a trailing comma names nothing)
        if not os.path.exists(path):
            raise ValueError(f"--docs {path} not found")
        for f in visible_files(path, cfg['exclude'].split(',')) if os.path.isdir(path) else [path]:
            if os.path.isfile(f) and not binary(f):  # (a pipe would block the read)
                with open(f, encoding='utf-8-sig', errors='replace') as text:
                    files[os.path.normpath(f)] = text.read()  # one file spelled two ways: once
    with open(cfg['ckpt'], 'rb') as f:
        key = ' '.join([hashlib.file_digest(f, 'sha256').hexdigest(), embedder.encoder.pool,
                        embedder.encoder.padding])
    found, embedded = search_index(embedder, files, cfg['index'] or cfg['ckpt'] + '.index', key)
    hits = [(f, span) for f, (_, spans, _) in found.items() for span in spans.tolist()]
    assert hits, f"no text in --docs={cfg['docs']}"
    emb = torch.cat([rows for _, _, rows in found.values()])     # (chunks, d_model) unit rows
    cosines = emb @ embedder([cfg['query']])[0]                   # (chunks,)
    score = lambda rows: cosines[None]                             # noqa: E731 (one query)
    if cfg['hybrid']:  # fused with BM25's ranks of the same chunks (eval --peer=hybrid)
        lines = {f: source_lines(text) for f, text in files.items()}  # as chunks_of numbers them
        texts = [''.join(lines[f][a - 1:b]) for f, (a, b) in hits]
        score = fused(score, bm25_scorer([cfg['query']], texts))
    top = score([0])[0].topk(min(cfg['k'], len(hits)))
    fusion = '; scores: reciprocal-rank fusion with BM25' if cfg['hybrid'] else ''  # not cosines
    print(f"{len(hits):,} chunks in {len(files):,} files ({embedded:,} embedded now){fusion}")
    for rank, (value, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
        f, (a, b) = hits[i]
        print(f"{rank}. {value:.3f}  {f}:{a}-{b}")
        for line in source_lines(files[f])[a - 1:min(b, a - 1 + cfg['show'])]:
            print('   ' + line.rstrip('\r\n')[:200])  # (a minified file's one line: its start)
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
               padding=('', 'right', 'left'), dtype=train.CHOICES['dtype'],
               schedule=train.CHOICES['schedule'])


def run(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ('-h', '--help'):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        raise ValueError(f"unknown subcommand {argv[0]!r}: use one of {', '.join(COMMANDS)}")
    command, defaults, required = COMMANDS[argv[0]]
    cfg = parse_args(argv[1:], defaults, __doc__, CHOICES)
    if cfg.get('init_from') == 'resume':  # the run's own keys are the defaults now; flags win
        run = train.load_checkpoint(os.path.join(cfg['out_dir'], 'ckpt.pt'), "to resume, pass "
                                    "the run's --out_dir")['config']
        cfg = parse_args(argv[1:], {**defaults, **run, 'out_dir': cfg['out_dir']}, __doc__, CHOICES)
    for example in required:
        if not str(cfg[example.split('=')[0]]).strip():  # (a blank query too)
            raise ValueError(f"retrieve.py {argv[0]} needs --{example} (see python retrieve.py "
                             f"{argv[0]} --help)")
    assert cfg['batch_size'] >= 1, f"--batch_size={cfg['batch_size']}: use 1 or more"
    if cfg.get('json'):  # before the work that fills it
        check_output_file(cfg['json'], 'json', cfg['overwrite'])
    return command(cfg)


def main(argv=None):
    return run_main(lambda: run(argv), "interrupted: finished outputs are whole (train: continue "
                    "with --init_from=resume; before its first checkpoint: rerun with --overwrite)")


if __name__ == '__main__':
    sys.exit(main())
