"""retrieve.py: InfoNCE (eq. 7), the Algorithm 1 samplers, the many-candidate eval, indirect
retrieval, search, training."""
import codecs, json, math, os, random, re, shlex, shutil, sys, types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import model as M, prepare, retrieve, train
from prepare import Tokenizer
from tests.conftest import (V, name, tiny, make, records, weights, run_main, refused,
                            torchrun, PAIR_WORDS, pair_texts, write_pairs, tokenizer)


def test_info_nce_is_eq7():
    """-log f(q, t+) / (f(q, t+) + sum f(q, t-)), f = exp(cos / 0.02) (eq. 8), by hand: in-batch, in
    groups of 31, and symmetric (the mean with target-to-query), also for a row shard."""
    f = lambda a, b: math.exp(float(a @ b / (a.norm() * b.norm())) / 0.02)  # noqa: E731
    q, t = unit(6, 16, seed=1), unit(6, 16, seed=2)
    by_hand = [-math.log(f(q[i], t[i]) / sum(f(q[i], t[j]) for j in range(6))) for i in range(6)]
    got = retrieve.info_nce(q, t, torch.arange(6)).item()
    assert got == pytest.approx(np.mean(by_hand), rel=1e-9)
    q3, cands, labels = unit(3, 16, seed=3), unit(3, 31, 16, seed=4), torch.tensor([0, 17, 30])
    by_hand = [-math.log(f(q3[b], cands[b, labels[b]]) / sum(f(q3[b], c) for c in cands[b]))
               for b in range(3)]
    got = retrieve.info_nce(q3, cands, labels).item()
    assert got == pytest.approx(np.mean(by_hand), rel=1e-9)
    nce = lambda *a: retrieve.info_nce(*a).item()  # noqa: E731
    both = retrieve.info_nce(q, t, torch.arange(6), symmetric=True).item()
    assert both == pytest.approx((nce(q, t, torch.arange(6)) + nce(t, q, torch.arange(6))) / 2,
                                 rel=1e-12)
    shard = torch.tensor([2, 3])
    # its queries vs all targets, its targets vs its queries
    expect = (nce(q[shard], t, shard) + nce(t[shard], q[shard], torch.arange(2))) / 2
    got = retrieve.info_nce(q[shard], t, shard, symmetric=True).item()
    assert got == pytest.approx(expect, rel=1e-12)


def builds(variant):  # ModelConfig refuses combinations that do not exist
    try:
        tiny(**variant)
    except AssertionError:
        return False
    return True


# every arch x objective x causality x way of giving positions that builds, then the mixing's
# own variants
POSITIONS = [dict(), dict(pos_emb=True), dict(pos_channel='input'), dict(pos_channel='every')]
ENCODERS = [v for v in (dict(arch=a, objective=o, causal=c, **p) for a in M.ARCHS
                        for o in ('clm', 'mtp2', 'autoencoder', 'half') for c in (True, False)
                        for p in POSITIONS) if builds(v)]
ENCODERS += [dict(n_heads=2, kernel=3, n_convs=2), dict(softmax=True), dict(expansion=0.5),
             dict(expansion=2.0, kernel=3)]


@pytest.mark.parametrize('variant', ENCODERS, ids=name)
@pytest.mark.parametrize('pool', ['last', 'mean'])
def test_a_right_padded_text_embeds_as_the_text_alone(variant, pool):
    """What happens to pads: in a causal encoder a text in a batch, its pads after it, gets the
    embedding and the InfoNCE gradients of the text alone, unpadded, and the batch runs only to
    its longest text; an encoder that reads ahead runs the whole window, the same for a text
    whatever else is in its batch. Left-padded, a text is pooled from its own positions alone."""
    n, lengths = 24, [1, 3, 17, 5, 2, 9, 4, 12]  # short queries, longer targets, none fills n
    model = make(tiny(n_ctx=n, **variant))
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(4, V, (k,), generator=gen).tolist() for k in lengths]
    enc = retrieve.TextEncoder(model, pool)
    stack = model.encoder if variant.get('objective') == 'autoencoder' else model.backbone
    first_ffn = stack.blocks[0].ffn or stack.blocks[0].mixers[-1]  # gmlp: the gated MLP
    rows = []
    hook = first_ffn.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[:2].numel()))
    results = []
    for batch in ([seqs], [[s] for s in seqs]):            # together, then each alone
        model.zero_grad()
        rows.clear()
        e = torch.cat([enc(*retrieve.pad(b, n, 3)) for b in batch])
        retrieve.info_nce(e[:4], e[4:], torch.arange(4), symmetric=True).backward()
        results.append((e.detach(), [p.grad.clone() for p in model.parameters()
                                     if p.grad is not None], sum(rows)))
    hook.remove()
    (e0, g0, rows0), (e1, g1, rows1) = results
    # float64 models pooled in float32 (the encoder's output dtype): float32's rounding
    torch.testing.assert_close(e0, e1, rtol=1e-6, atol=1e-6)
    scale = max(float(a.abs().max()) for a in g0)
    assert len(g0) == len(g1)
    for a, b in zip(g0, g1):   # through InfoNCE at tau 0.02, in float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7 * scale)
    reads_ahead = not variant.get('causal', True) or variant.get('objective') == 'half'
    assert enc.cut != reads_ahead
    assert rows0 == 8 * (n if reads_ahead else 17)
    assert rows1 == 8 * n if reads_ahead else rows1 == sum(lengths)
    for s, e in zip(seqs, e0):   # alone and unpadded, pooled by hand
        h = model.hidden(torch.tensor([s]))[0].detach().float()        # (len, d_model)
        want = F.normalize(h[-1] if pool == 'last' else h.mean(0), dim=-1)
        if not reads_ahead:
            torch.testing.assert_close(e, want, rtol=1e-6, atol=1e-6)
    left = retrieve.TextEncoder(model, pool, 'left', normalize=False)  # texts end at n - 1
    idx, mask = retrieve.pad(seqs, n, 3, left=True)
    h = model.hidden(idx, mask).detach().float()                        # (8, n, d_model)
    m = mask[..., None].float()
    want = h[:, -1] if pool == 'last' else (h * m).sum(1) / m.sum(1)   # pads pooled never
    torch.testing.assert_close(left(idx, mask).detach(), want, rtol=1e-6, atol=1e-6)


def chi2(labels, k):
    counts = torch.bincount(labels, minlength=k).double()
    return float(((counts - len(labels) / k) ** 2 / (len(labels) / k)).sum())


def test_samplers_place_the_match_once_uniformly_among_distinct_negatives():
    """The paper's candidates; Algorithm 1's: the query first, then c-1 targets, c-2 of them
    non-matching."""
    gen, n_pool, k, draws = torch.Generator().manual_seed(0), 50, 8, 4000
    match = torch.randint(0, n_pool, (draws,), generator=gen)
    cands, labels = retrieve.sample_candidates(match, n_pool, k, gen)
    assert cands.shape == (draws, k) and torch.equal(cands[torch.arange(draws), labels], match)
    assert ((cands == match[:, None]).sum(1) == 1).all()                 # the match exactly once
    assert all(len(set(row)) == k for row in cands.tolist())  # negatives without replacement
    assert chi2(labels, k) < 24.3  # p = 0.001 for 7 degrees of freedom
    negs = cands[torch.arange(k)[None] != labels[:, None]]
    # negatives spread over the pool
    freq = torch.bincount(negs, minlength=n_pool).double() / len(negs)
    assert freq.min() > 0.5 / n_pool and freq.max() < 1.5 / n_pool
    q, t, c = unit(40, 8, seed=7), unit(40, 8, seed=8), 6
    gen = torch.Generator().manual_seed(0)
    match = torch.randint(0, 40, (3000,), generator=gen)
    x, labels, rows = retrieve.algorithm1(q, t, match, c, gen)
    assert x.shape == (3000, c, 8) and torch.equal(x[:, 0], q[match])
    assert torch.equal(x[torch.arange(3000), 1 + labels], t[match])
    others = rows[:, 1:][torch.arange(c - 1)[None] != labels[:, None]].view(3000, c - 2)
    assert (others != match[:, None]).all() and all(len(set(r)) == c - 2 for r in others.tolist())
    assert chi2(labels, c - 1) < 18.5                                    # p = 0.001, 4 dof
    whole, labels = retrieve.sample_candidates(torch.arange(8).repeat(25), 8, 8, gen)  # k = pool
    assert (whole.sort(1).values == torch.arange(8)).all()  # the match once, with the 7 others
    assert torch.equal(whole[torch.arange(200), labels], torch.arange(8).repeat(25))


@pytest.mark.parametrize('negatives', ['inbatch', 'paper'])
def test_pair_batches_layout_and_row_shards(corpus, negatives):
    """B queries, then B targets (inbatch) or B groups of 31 candidates (paper), the match at its
    label, each text from position 0; a pure function of its arguments. A row shard keeps its
    queries and every in-batch target: the shard losses average to the batch's."""
    tok = tokenizer(str(corpus.data))
    get = retrieve.PairBatches(dict(train.LOOP_DEFAULTS, data_dir=str(corpus.data),
                                    negatives=negatives, batch_size=4), tok, 32)
    idx, mask, labels = get('val', None, 1)
    group = 31 if negatives == 'paper' else 0
    assert idx.shape == (4 + 4 * max(group, 1), 32) and torch.equal(idx, get('val', None, 1)[0])
    assert mask[:, 0].all() and not mask[:, -1].all()
    assert group or torch.equal(labels, torch.arange(4))
    pairs = [(q[:32], t[:32]) for q, t in zip(*get.pairs['val'])]
    for b in range(4):
        row = 4 + group * b + labels[b]
        assert (idx[b][mask[b]].tolist(), idx[row][mask[row]].tolist()) in pairs
    emb = torch.nn.Embedding(tok.vocab_size, 8)

    def loss(batch):
        idx, _, labels = batch
        e = F.normalize(emb(idx).mean(1), dim=-1)
        q, rest = e[:len(labels)], e[len(labels):]
        targets = rest.view(len(labels), -1, 8) if group else rest
        return retrieve.info_nce(q, targets, labels)
    torch.testing.assert_close(loss(get('train', 2, 0)),
                               sum(loss(get('train', 2, 0, s, 2)) for s in range(2)) / 2)


def test_eval_identical_texts_is_100_percent_and_n_is_capped(corpus, capsys, tmp_path):
    """Untrained but deterministic encoders find a target identical to its query at every n; n
    past the pair count is capped at it + 1 (the query and every target), a column of its own."""
    write_pairs(tmp_path / 'same.jsonl',
                [(t, t) for _, t in (pair_texts(random.Random(1), i) for i in range(40))])
    for ckpt in (corpus.mixer, corpus.llama, corpus.ae):
        code, out, err = run_main(capsys, 'retrieve', 'eval', f'--ckpt={ckpt}',
                                  f'--pairs={tmp_path}/same.jsonl',
                                  '--n=8,16,32', f'--json={tmp_path}/m.json', '--overwrite')
        assert code == 0 and json.loads((tmp_path / 'm.json').read_text()) == {
            'top1': {'8': 100.0, '16': 100.0, '32': 100.0}, 'mrr@10': 1.0, 'n_pairs': 40}
    code, out, err = run_main(capsys, 'retrieve', 'eval', f'--ckpt={corpus.mixer}',
                              f'--pairs={corpus.data}/pairs_val.jsonl', '--n=16,64,128',
                              f'--json={tmp_path}/m.json', '--overwrite')
    assert code == 0 and re.search(r'^n +16 +49  MRR@10', out, re.M), out
    assert list(json.loads((tmp_path / 'm.json').read_text())['top1']) == ['16', '49']


def test_eval_random_scores_are_one_in_n_minus_one():
    """Table 1's n: one query, its target and n-2 non-matching targets, so chance is 1/(n-1)."""
    pairs = 3000
    q, t = unit(pairs, 64, seed=5).float(), unit(pairs, 64, seed=6).float()
    m = retrieve.retrieval_metrics(lambda rows: q[rows] @ t.T, pairs, (3, 8, 32), seed=0)
    for n in (3, 8, 32):
        p, sd = 100 / (n - 1), 100 * math.sqrt((1 / (n - 1)) * (1 - 1 / (n - 1)) / pairs)
        assert abs(m['top1'][str(n)] - p) < 4 * sd, (n, m['top1'])
    # the match's rank is uniform over 1..pairs: MRR@10 = sum_{r<=10} 1/r / pairs = 0.00098, and
    # one query's sd, sqrt(sum_{r<=10} 1/r^2 / pairs) = 0.023, over 3000 queries is 0.00042
    assert abs(m['mrr@10'] - sum(1 / r for r in range(1, 11)) / pairs) < 4 * 0.00042
    tied = retrieve.retrieval_metrics(lambda rows: torch.zeros(len(rows), 40), 40, (3, 32), 0)
    assert tied['top1'] == {'3': 0.0, '32': 0.0}  # a tie with a negative is a miss
    # --seed draws other negatives
    assert retrieve.retrieval_metrics(lambda rows: q[rows] @ t.T, pairs, (3, 8, 32), 1) != m
    # query i's match ranks i + 1 (targets j < i score higher): MRR@10 counts ranks 1 to 10
    ladder = lambda rows: ((torch.arange(20) < rows[:, None]).float()  # noqa: E731
                           + 0.5 * (torch.arange(20) == rows[:, None]))
    assert retrieve.retrieval_metrics(ladder, 20, (3,), 0)['mrr@10'] == pytest.approx(
        sum(1 / r for r in range(1, 11)) / 20, abs=1e-4)


def test_bm25_terms_split_identifiers():
    """BM25 meets code halfway: snake_case, CamelCase and acronyms split into lowercase words;
    targets with no word it reads (other scripts, stopwords) all score 0."""
    assert retrieve.code_words('read_file(ReadFile)') == ['read', 'file', 'read', 'file']
    assert retrieve.code_words('HTTPServer.get2()') == ['http', 'server', 'get', '2']
    pytest.importorskip('bm25s')
    scores = retrieve.bm25_scorer(['日本', 'the'], ['日本語の文', 'of the'])([0, 1])
    assert scores.tolist() == [[0.0, 0.0], [0.0, 0.0]]


class FakePeer:
    """sentence-transformers' interface (constructor, encode) over a bag of letters."""

    def __init__(self, name, device='cpu', local_files_only=False):
        assert local_files_only, "a peer is read from its folder, never fetched"

    def encode(self, texts, batch_size=32):
        return np.array([[text.lower().count(chr(97 + i)) for i in range(26)] for text in texts],
                        dtype=np.float32)


def test_eval_peer(corpus, capsys, tmp_path, monkeypatch):
    """--peer=bm25,FOLDER scores BM25 and a sentence-transformers model on the same pairs against
    the same candidates (one seed draws them for every row), beside the checkpoint. A name that is
    not a folder is refused with the way to get one; so is a missing package, bm25s's included."""
    pairs = corpus.data / 'pairs_val.jsonl'
    monkeypatch.setitem(sys.modules, 'sentence_transformers',
                        types.SimpleNamespace(SentenceTransformer=FakePeer))
    code, out, err = run_main(capsys, 'retrieve', 'eval', f'--ckpt={corpus.mixer}',
                              f'--peer=bm25,{tmp_path}', f'--pairs={pairs}', '--n=8,16',
                              f'--json={tmp_path}/m.json')
    assert code == 0, err
    m = json.loads((tmp_path / 'm.json').read_text())
    queries, targets = prepare.read_pairs(str(pairs))
    q, t = (F.normalize(torch.from_numpy(FakePeer(str(tmp_path), local_files_only=True)
                                         .encode(x)), dim=-1) for x in (queries, targets))
    expect = retrieve.retrieval_metrics(lambda rows: q[rows] @ t.T, len(q), (8, 16), 0)
    bm25 = retrieve.retrieval_metrics(retrieve.bm25_scorer(queries, targets), len(q), (8, 16), 0)
    assert m[str(tmp_path)] == expect and m['bm25'] == bm25
    assert set(m[str(corpus.mixer)]) == set(bm25)
    assert bm25['top1']['16'] > 50               # the fixture's pairs share their words
    assert len(out.splitlines()) == 5 and out.startswith('48 pairs from')
    assert len({len(line) for line in out.splitlines()[1:]}) == 1   # the table's columns line up
    monkeypatch.setitem(sys.modules, 'bm25s', None)
    refused(capsys, 'retrieve', ['eval', '--peer=bm25', f'--pairs={pairs}'], 'pip install bm25s')
    argv = ['eval', '--peer=all-MiniLM-L6-v2', f'--pairs={pairs}', '--n=8']
    err = refused(capsys, 'retrieve', argv, '--peer=all-MiniLM-L6-v2')
    assert 'not a model folder' in err and 'doc/usage.md' in err
    monkeypatch.setitem(sys.modules, 'sentence_transformers', None)   # as if not installed
    refused(capsys, 'retrieve', ['eval', f'--peer={tmp_path}', f'--pairs={pairs}'],
            'pip install sentence-transformers')


def test_hybrid_fuses_ranks(corpus, capsys, tmp_path):
    """Reciprocal-rank fusion: 1 / (60 + rank) summed over the two rankers, so a target that both
    rank second beats one that only one ranks first; tied scores share a rank, so a ranker that
    ties everything leaves the other's order; --peer=hybrid is a row of eval, and needs --ckpt."""
    a = lambda rows: torch.tensor([[3.0, 2.0, 1.0, 0.0]])         # noqa: E731  ranks 1 2 3 4
    b = lambda rows: torch.tensor([[0.0, 3.0, 1.0, 2.0]])         # noqa: E731  ranks 4 1 3 2
    got = retrieve.fused(a, b)([0])[0]
    want = [1 / 61 + 1 / 64, 1 / 62 + 1 / 61, 1 / 63 + 1 / 63, 1 / 64 + 1 / 62]
    torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype))
    assert got.argsort(descending=True).tolist() == [1, 0, 3, 2]
    tied = lambda rows: torch.zeros(1, 4)                          # noqa: E731  ranks 1 1 1 1
    torch.testing.assert_close(retrieve.fused(tied, b)([0])[0], 1 / 61 + 1 / (60 + torch.tensor(
        [4.0, 1.0, 3.0, 2.0])))
    assert retrieve.fused(tied, tied)([0]).unique().numel() == 1   # no order from the file
    pairs = f'--pairs={corpus.data}/pairs_val.jsonl'
    code, out, err = run_main(capsys, 'retrieve', 'eval', f'--ckpt={corpus.mixer}', pairs,
                              '--peer=hybrid,bm25', '--n=8', f'--json={tmp_path}/m.json')
    assert code == 0 and set(json.loads((tmp_path / 'm.json').read_text())) == {
        corpus.mixer, 'hybrid', 'bm25'}
    refused(capsys, 'retrieve', ['eval', '--peer=hybrid', pairs], '--ckpt')


def test_retrieval_mixer_learns_algorithm1_inputs():
    """The label points at the match: on embeddings that carry the match, a RetrievalMixer learns
    it."""
    torch.manual_seed(0)
    t = torch.randn(400, 32)
    q = t + 0.3 * torch.randn(400, 32)  # a query is its target, noised
    model, gen = M.RetrievalMixer(32, 2, 8), torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(300):
        match = torch.randint(0, 400, (64,), generator=gen)
        x, labels, _ = retrieve.algorithm1(q, t, match, 8, gen)
        opt.zero_grad()
        model(x, labels)[1].backward()
        opt.step()
    x, labels, _ = retrieve.algorithm1(q, t, torch.arange(400), 8, gen)
    assert (model(x)[0].argmax(-1) == labels).float().mean() > 0.8     # chance: 1 in 7


@pytest.mark.parametrize('normalize', [False, True])
def test_indirect_trains_on_raw_hidden_states(corpus, capsys, tmp_path, monkeypatch, normalize):
    """One RetrievalMixer per c, each an 'indirect' checkpoint under a header line, reading the
    frozen model's last hidden states as they are (--normalize=True: unit rows x sqrt(d_model)), of
    the pairs of the data the model was trained on (no --data_dir given)."""
    seen = []

    class Recording(M.RetrievalMixer):
        def forward(self, x, labels=None):
            seen.append(x.detach().clone())
            return super().forward(x, labels)

    monkeypatch.setattr(retrieve, 'RetrievalMixer', Recording)
    code, out, err = run_main(capsys, 'retrieve', 'indirect', f'--ckpt={corpus.mixer}',
                              f'--out_dir={tmp_path}/ind', '--c=4,8',
                              '--n_layers=1', '--max_iters=6', '--eval_interval=6',
                              '--eval_iters=1', '--log_interval=2', '--batch_size=16',
                              '--dtype=float32', '--device=cpu', f'--normalize={normalize}',
                              f'--json={tmp_path}/ind.json')
    assert code == 0, err
    assert 'embedding:' in err and '/160' in err and '/48' in err
    parts = re.split(r'^## (c=\d+ \(n - 1 = \d+ candidates\))\n', out, flags=re.M)
    assert parts[1::2] == ['c=4 (n - 1 = 3 candidates)', 'c=8 (n - 1 = 7 candidates)'], out
    for c, run in zip((4, 8), parts[2::2]):
        assert run.count('step ') >= 3 and re.search(rf'^c={c}: top-1 [\d.]+%', run, re.M), out
    res = json.loads((tmp_path / 'ind.json').read_text())['c']
    assert set(res) == {'4', '8'} and json.loads((tmp_path / 'ind.json').read_text())['n_val'] == 48
    assert all(0 <= r['top1'] <= 100 and r['loss'] > 0 for r in res.values())
    ckpt = train.load_checkpoint(tmp_path / 'ind/c8/ckpt.pt')
    assert ckpt['kind'] == 'indirect' and ckpt['embedder']['ckpt'] == os.path.abspath(corpus.mixer)
    assert ckpt['retrieval_mixer'] == dict(d_model=32, n_layers=1, c=8)
    ckpt = train.load_checkpoint(corpus.mixer)      # each text alone, here, not through TextEncoder
    model = train.model_from_checkpoint(ckpt).eval()
    tok = Tokenizer.from_checkpoint(ckpt)
    texts = [t for s in train.SPLITS
             for side in prepare.read_pairs(corpus.data / f'pairs_{s}.jsonl') for t in side]
    with torch.no_grad():                               # the last token's state, (N, 32)
        h = torch.cat([model.hidden(torch.tensor([tok.encode(t, bos=True)[:32]]))[:, -1]
                       for t in texts])
    pool = F.normalize(h, dim=-1) * math.sqrt(32) if normalize else h
    rows = torch.cat([x.flatten(0, 1) for x in seen])                       # every input row
    dist = torch.cdist(rows, pool, compute_mode='donot_use_mm_for_euclid_dist').min(1).values
    # batched vs alone in fp32: eps 1.2e-7 x norms ~10 x a few ops; the other form is >= 1 off
    assert dist.max() < 1e-4
    assert not torch.allclose(h.norm(dim=-1), h.norm(dim=-1).mean())   # raw rows: no common norm


def test_short_train_learns_retrieval_and_resumes(corpus, capsys, tmp_path):
    """60 InfoNCE steps (mean-pooled, at another temperature) from an untrained LM, on the pairs of
    the data it was trained on (no --data_dir given; from a retrieval checkpoint, the pairs it was
    trained on), beat chance 3x; the result is an ordinary model checkpoint that records its
    pooling, and --init_from=resume continues it with the run's own keys (only --out_dir and the
    new budget given), refusing a pooling or padding other than the run's."""
    data, mixer, out_dir = corpus.data, corpus.mixer, tmp_path / 'my ret'  # a space: quoted
    common = [f'--out_dir={out_dir}', '--batch_size=16', '--lr=2e-3',
              '--warmup_iters=2', '--eval_interval=20', '--eval_iters=3', '--dtype=float32']
    code, out, err = run_main(capsys, 'retrieve', 'train', f'--init_from={mixer}',
                              '--max_iters=60', '--pool=mean', '--tau=0.05', *common)
    assert code == 0, err
    evals = records(out_dir, 'val_loss')
    assert evals[0]['step'] == 0 and evals[-1]['step'] == 60
    # below log(16), the loss of embeddings collapsed to one point: the queries found their targets
    assert evals[-1]['val_loss'] < min(evals[0]['val_loss'], math.log(16)) - 0.1, evals
    python, script, *then = shlex.split(out.split('evaluate with ')[1])  # the command it names
    assert then == ['eval', f'--ckpt={out_dir}/ckpt.pt', f'--pairs={data}/pairs_val.jsonl']
    run_main(capsys, 'retrieve', *then, '--n=48', f'--json={tmp_path}/m.json')
    # chance is 1 in 47
    assert json.loads((tmp_path / 'm.json').read_text())['top1']['48'] > 3 * 100 / 47
    ckpt = train.load_checkpoint(out_dir / 'ckpt.pt')
    assert ckpt['kind'] == 'retrieval' and ckpt['padding'] == 'right' and ckpt['pool'] == 'mean'
    assert retrieve.Embedder(out_dir / 'ckpt.pt', 'cpu').encoder.pool == 'mean'
    assert ckpt['init_from'] == os.path.abspath(mixer)
    assert ckpt['tokenizer'] == train.load_checkpoint(mixer)['tokenizer']  # it carries its own
    train.model_from_checkpoint(ckpt)                    # loads strictly: the model's own keys
    resume = ['train', '--init_from=resume', '--max_iters=70', f'--out_dir={out_dir}']
    for flag in ('--pool=last', '--padding=left'):     # other embeddings than the run trained
        refused(capsys, 'retrieve', [*resume, flag], f'{flag} contradicts', keep=[out_dir])
    code, out, err = run_main(capsys, 'retrieve', *resume)
    assert code == 0, err
    ckpt = train.load_checkpoint(out_dir / 'ckpt.pt')
    assert ckpt['step'] == 70 and ckpt['pool'] == 'mean'
    assert ckpt['init_from'] == os.path.abspath(mixer)   # the run's start, not its own ckpt.pt
    assert {k: ckpt['config'][k] for k in ('data_dir', 'batch_size', 'lr', 'tau', 'max_iters')} == \
        dict(data_dir=str(data), batch_size=16, lr=2e-3, tau=0.05, max_iters=70)
    (tmp_path / 'pairs').mkdir()  # from a retrieval checkpoint: the pairs it was trained on
    for split in ('train', 'val'):
        shutil.copy(data / f'pairs_{split}.jsonl', tmp_path / 'pairs')
    torch.save({**ckpt, 'pairs_dir': str(tmp_path / 'pairs')}, tmp_path / 'ret.pt')
    code, out, err = run_main(capsys, 'retrieve', 'train', f'--init_from={tmp_path}/ret.pt',
                              f'--out_dir={tmp_path}/again', '--max_iters=1', '--eval_iters=1',
                              '--batch_size=16', '--dtype=float32')
    assert code == 0 and f"--pairs={tmp_path}/pairs/pairs_val.jsonl" in out, err


def test_retrieval_ddp_row_shards_equal_one_process(corpus, capsys, tmp_path):
    """torchrun, grad_accum=1: each rank embeds half the queries and every target; the step is one
    process's."""
    common = ['train', f'--init_from={corpus.mixer}', f'--data_dir={corpus.data}', '--lr=2e-3',
              '--batch_size=8', '--max_iters=1', '--eval_interval=1', '--eval_iters=1',
              '--dtype=float32']
    torchrun('retrieve.py', [*common, f'--out_dir={tmp_path}/ddp'])
    assert run_main(capsys, 'retrieve', *common, f'--out_dir={tmp_path}/one')[0] == 0
    (ddp,), (one,) = records(tmp_path / 'ddp', 'loss'), records(tmp_path / 'one', 'loss')
    # the step's loss: mean of the shard losses
    assert ddp['loss'] == pytest.approx(one['loss'], rel=1e-5)
    a, b = weights(tmp_path / 'ddp'), weights(tmp_path / 'one')
    # Adam's first step is ~lr * sign(grad): near-zero gradients may differ
    for k, v in a['model'].items():
        torch.testing.assert_close(v, b['model'][k], rtol=0, atol=0.5 * 2e-3 / 21)


def test_train_updates_only_what_embeddings_use(corpus, capsys, tmp_path):
    """Paper negatives with grad_accum train a llama, its lm head frozen; an autoencoder trains its
    encoder only."""
    for ckpt, extra in ((corpus.llama, ['--negatives=paper', '--batch_size=1', '--grad_accum=2']),
                        (corpus.ae, [])):
        out_dir = tmp_path / os.path.basename(ckpt)
        code, out, err = run_main(capsys, 'retrieve', 'train', f'--init_from={ckpt}',
                                  f'--data_dir={corpus.data}', f'--out_dir={out_dir}',
                                  '--max_iters=2', '--eval_interval=2', '--eval_iters=1', *extra)
        assert code == 0, err
        before = torch.load(ckpt, weights_only=True)['model']
        after = train.load_checkpoint(out_dir / 'ckpt.pt')
        changed = {k for k in before if not torch.equal(before[k], after['model'][k])}
        if ckpt == corpus.ae:
            assert changed and all(k.startswith('encoder.') for k in changed)
        else:
            assert after['config']['negatives'] == 'paper' and 'backbone.wte.weight' in changed
            assert 'lm_head.weight' in before and 'lm_head.weight' not in changed
        assert (after['pool'], after['padding']) == ('last', 'right')  # the defaults it used


def test_paper_negatives_score_each_query_against_its_own_group(corpus, tmp_path, monkeypatch):
    """--negatives=paper: the loss of a batch of B queries scores query b against its own 31
    candidates, target rows B + 31b to B + 31b + 30, its match at labels[b]."""
    seen = {}
    monkeypatch.setattr(train, 'fit', lambda cfg, rt, model, get_batch, loss_fn, *a: seen.update(
        model=model, get_batch=get_batch, loss_fn=loss_fn) or dict(stopped='budget'))
    assert retrieve.main(['train', f'--init_from={corpus.mixer}', f'--data_dir={corpus.data}',
                          f'--out_dir={tmp_path}', '--negatives=paper', '--batch_size=2']) == 0
    idx, mask, labels = batch = seen['get_batch']('val', None, 0)
    e = seen['model'](idx, mask).detach()
    want = sum(F.cross_entropy(e[2 + 31 * b:33 + 31 * b] @ e[b] / retrieve.TAU, labels[b])
               for b in range(2)) / 2
    torch.testing.assert_close(seen['loss_fn'](seen['model'], batch).detach(), want)


def test_search_embeds_a_folder_once(corpus, capsys, tmp_path, monkeypatch):
    """A function's own text finds it first, at cosine 1, printed as path:first-last with its first
    lines (binary files skipped, the others read as prepare.py reads them: a file with a byte-order
    mark and a Latin-1 byte is searched), and first too fused with BM25 (--hybrid). A second call
    embeds nothing; an edited file alone is embedded again, a deleted one leaves the index; another
    checkpoint's index (or its own, trained on since) is built afresh."""
    rng, texts = random.Random(2), []
    for i in range(4):   # three functions a file, at lines 1-2, 4-5 and 7-8
        names = [rng.sample(PAIR_WORDS, 2) for _ in range(3)]
        texts.append('\n'.join(f"def {a}_{b}_{i}(x):\n    return {a}_of({b}_of(x))\n"
                               for a, b in names))
    (tmp_path / 'docs').mkdir()
    for i, text in enumerate(texts[:3]):
        (tmp_path / f'docs/d{i}.py').write_text(text)
    latin1 = texts[0].replace('\n', '#\xe9\n', 1).encode('latin-1')  # not UTF-8: U+FFFD
    (tmp_path / 'docs/d0.py').write_bytes(codecs.BOM_UTF8 + latin1)  # the BOM: no text
    (tmp_path / 'docs/blob.bin').write_bytes(b'\x89PNG\r\n\x1a\n\0')
    (tmp_path / 'docs/nul.py').write_text('x = 1\0\n')  # UTF-8, but binary by prepare's rule
    (tmp_path / 'more.txt').write_text(texts[3])
    embedded = []
    embed = retrieve.Embedder.embed_tokens
    counted = lambda self, seqs: embedded.append(len(seqs)) or embed(self, seqs)  # noqa: E731
    monkeypatch.setattr(retrieve.Embedder, 'embed_tokens', counted)
    docs, index = f'--docs={tmp_path}/docs,{tmp_path}/more.txt', f'--index={tmp_path}/i.pt'

    def search(query, *extra):
        embedded.clear()
        code, out, err = run_main(capsys, 'retrieve', 'search', f'--ckpt={corpus.mixer}', docs,
                                  index, f'--query={query}', '--k=99', '--dtype=float32', *extra)
        assert code == 0, err
        return out, sum(embedded) - 1                  # less the query's
    wanted = texts[1].split('\n\n')[1]               # d1.py's second function, lines 4-5
    out, n = search(wanted.strip() + '\n', '--show=1')
    hits = re.findall(r'^\d+\. (\S+)  (\S+)\n((?: {3}.*\n)*)', out, re.M)
    assert n == 12 and len(hits) == 12 and '12 chunks in 4 files (12 embedded now)' in out
    assert hits[0][:2] == ('1.000', f'{tmp_path}/docs/d1.py:4-5'), out
    assert hits[0][2] == '   ' + wanted.splitlines()[0] + '\n' and 'blob.bin' not in out
    assert search('anything')[1] == 0                  # unchanged: nothing embedded
    out, n = search(wanted.strip() + '\n', '--hybrid')   # both rank it first: 2 / (60 + 1)
    assert n == 0 and re.search(r'^1\. 0\.033  \S+/docs/d1\.py:4-5$', out, re.M), out
    assert 'scores: reciprocal-rank fusion' in out
    (tmp_path / 'docs/d2.py').write_text(texts[2] + '\n\ndef extra():\n    pass\n')
    out, n = search('anything')
    assert n == 4 and '13 chunks in 4 files (4 embedded now)' in out
    (tmp_path / 'docs/d0.py').unlink()                 # a deleted file leaves the index
    (tmp_path / 'docs/d3.py').write_text(texts[0])
    assert search('anything')[1] == 3
    kept = torch.load(tmp_path / 'i.pt', weights_only=True)['files']
    assert {os.path.basename(f) for f in kept} == {'d1.py', 'd2.py', 'd3.py', 'more.txt'}
    (tmp_path / 'docs/__init__.py').touch()            # new, but no chunk: nothing to embed
    assert search('anything')[1] == 0
    for i in (4, 5):   # two new files of 3 chunks, embedded a file at a time
        (tmp_path / f'docs/d{i}.py').write_text(texts[3].replace('(x)', f'(x{i})'))

    def ctrl_c_in_the_second_file(self, seqs):
        embedded.append(len(seqs))
        if len([n for n in embedded if n]) == 2:  # (the empty __init__.py: a call for no chunk)
            raise KeyboardInterrupt
        return embed(self, seqs)
    monkeypatch.setattr(retrieve.Embedder, 'embed_tokens', ctrl_c_in_the_second_file)
    embedded.clear()
    code, out, err = run_main(capsys, 'retrieve', 'search', f'--ckpt={corpus.mixer}', docs, index,
                              '--query=x')
    assert code == 130 and [n for n in embedded if n] == [3, 3], (embedded, err)
    monkeypatch.setattr(retrieve.Embedder, 'embed_tokens', counted)
    assert search('anything')[1] == 3                  # d4.py was kept: d5.py's 3 chunks alone
    os.rename(tmp_path / 'docs', tmp_path / 'moved')   # found by its texts: nothing embedded,
    docs = docs.replace('/docs', '/moved')             # and nothing written (the index may be
    check = retrieve.check_output_file                 # read-only): no write check, no write
    monkeypatch.setattr(retrieve, 'check_output_file', None)
    written = os.stat(tmp_path / 'i.pt').st_mtime_ns
    out, n = search(wanted.strip() + '\n')
    monkeypatch.setattr(retrieve, 'check_output_file', check)
    assert os.stat(tmp_path / 'i.pt').st_mtime_ns == written
    assert n == 0 and re.search(r'^1\. 1\.000  \S+/moved/d1\.py:4-5$', out, re.M), out
    ckpt = tmp_path / 'run/ckpt.pt'   # its default index, ckpt.pt.index, follows the checkpoint
    ckpt.parent.mkdir()
    for trained in (corpus.mixer, corpus.llama):   # trained on since: embedded again, not refused
        shutil.copyfile(trained, ckpt)
        code, out, err = run_main(capsys, 'retrieve', 'search', f'--ckpt={ckpt}', docs, '--query=x')
        assert code == 0 and '19 chunks in 7 files (19 embedded now)' in out, (out, err)
    index = f'--index={ckpt}.index'   # named: the same
    code, out, err = run_main(capsys, 'retrieve', 'search', f'--ckpt={corpus.mixer}', docs, index,
                              '--query=x')
    assert code == 0 and '19 chunks in 7 files (19 embedded now)' in out, (out, err)


def test_search_index_is_replaced_only_once_something_is_embedded(tmp_path):
    """Another checkpoint's index (a mistyped --ckpt) stays whole if Ctrl-C comes before the
    first file is embedded; a .py file's chunks are not reused for the same text in a .txt file
    (cut otherwise: whole, not at its definitions)."""
    class Embedder:  # a token a line; Ctrl-C at once, or zero rows
        tok, n_ctx = types.SimpleNamespace(encode_batch=lambda lines: [[0]] * len(lines)), 64

        def __init__(self, ctrl_c):
            self.ctrl_c = ctrl_c

        def __call__(self, texts):
            if self.ctrl_c:
                raise KeyboardInterrupt
            return torch.zeros(len(texts), 4)
    path, text = str(tmp_path / 'i.pt'), 'def f():\n    pass\n\n\ndef g():\n    pass\n'
    py, txt = str(tmp_path / 'a.py'), str(tmp_path / 'a.txt')
    torch.save({'key': 'old', 'files': {}}, path)
    with pytest.raises(KeyboardInterrupt):
        retrieve.search_index(Embedder(ctrl_c=True), {py: text}, path, 'new')
    assert torch.load(path, weights_only=True)['key'] == 'old'
    for f in (py, txt):
        Path(f).write_text(text)
    found, n = retrieve.search_index(Embedder(ctrl_c=False), {py: text}, path, 'new')
    assert found[py][1].tolist() == [[1, 2], [5, 6]] and n == 2
    found, n = retrieve.search_index(Embedder(ctrl_c=False), {txt: text}, path, 'new')
    assert found[txt][1].tolist() == [[1, 6]] and n == 1


def test_search_index_refuses_another_file_without_advising_to_delete_it(tmp_path):
    """A file that is not an index (a checkpoint given as --index, say) is refused as such, and the
    message does not tell the user to delete it: it may be their checkpoint."""
    path = str(tmp_path / 'ckpt.pt')
    torch.save({'kind': 'lm', 'model': {}}, path)
    with pytest.raises(ValueError, match='not a readable search index') as e:
        retrieve.search_index(None, {}, path, 'key')  # refused before anything is embedded
    assert 'delete' not in str(e.value)


def unit(*shape, seed=0):
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                                   dtype=torch.float64), dim=-1)


def test_indirect_validates_on_the_val_embeddings(corpus, tmp_path, monkeypatch):
    """indirect's get_batch(split) reads that split's embeddings: its val loss, and so best.pt,
    measures val queries against val targets. A c past the pairs is capped at them + 1."""
    seen = {}

    def fit(cfg, rt, model, get_batch, *args):
        seen['get_batch'] = get_batch
        return dict(step=0, stopped='budget')
    monkeypatch.setattr(train, 'fit', fit)
    assert retrieve.main(['indirect', f'--ckpt={corpus.mixer}', f'--data_dir={corpus.data}',
                          f'--out_dir={tmp_path}/ind', '--c=4,999', '--n_layers=1', '--max_iters=1',
                          '--batch_size=16', '--dtype=float32', '--device=cpu']) == 0
    rows, x, labels = seen['get_batch']('val', None, 0)
    assert x.shape[1] == 49    # the last c: the query and all 48 val targets
    queries, targets = prepare.read_pairs(os.path.join(corpus.data, 'pairs_val.jsonl'))
    embed = retrieve.Embedder(corpus.mixer, 'cpu', 'float32', normalize=False)
    q, t = embed(queries), embed(targets)
    torch.testing.assert_close(x[:, 0], q[rows[:, 0]])
    torch.testing.assert_close(x[:, 1:], t[rows[:, 1:]])


def test_an_old_retrieval_checkpoint_without_padding_embeds_left_padded(corpus, tmp_path):
    """Retrieval checkpoints that record no padding (they record embed_pos) were left-padded; an
    'lm' checkpoint, or one that records its padding, is read as it says (else right)."""
    ckpt = train.load_checkpoint(corpus.mixer)
    assert 'padding' not in ckpt and retrieve.Embedder(corpus.mixer).encoder.padding == 'right'
    old = {**ckpt, 'kind': 'retrieval', 'embed_pos': 'last', 'pool': 'last'}
    torch.save(old, tmp_path / 'old.pt')
    assert retrieve.Embedder(str(tmp_path / 'old.pt')).encoder.padding == 'left'
    torch.save({**old, 'padding': 'right'}, tmp_path / 'new.pt')
    assert retrieve.Embedder(str(tmp_path / 'new.pt')).encoder.padding == 'right'


def test_pad_keeps_a_texts_first_tokens_and_fills_with_pad_id():
    """pad: a text longer than n_ctx keeps its first n_ctx tokens; the rest of its row holds pad_id
    (after it, or before it with left), mask True on its own tokens only."""
    idx, mask = retrieve.pad([[5, 6, 7, 8], [9]], 3, 2)
    assert idx.tolist() == [[5, 6, 7], [9, 2, 2]]
    assert mask.tolist() == [[True, True, True], [True, False, False]]
    idx, mask = retrieve.pad([[9]], 3, 2, left=True)
    assert idx.tolist() == [[2, 2, 9]] and mask.tolist() == [[False, False, True]]


def test_indirect_accuracy_weighs_each_query_once():
    """The val loss is the mean over queries, batches of 256 and a last short one weighed by their
    size; top-1 counts the queries whose label is argmax."""
    def model(x, labels):  # always picks slot 0, at a loss of 2
        logits = torch.zeros(len(x), x.shape[1] - 1)
        logits[:, 0] = 1
        return logits, torch.tensor(2.0)
    q, t = unit(300, 8, seed=1), unit(300, 8, seed=2)
    loss, top1 = retrieve.indirect_accuracy(model, q, t, 5, 0, 'cpu')
    gen = torch.Generator().manual_seed(0)
    labels = torch.cat([retrieve.algorithm1(q, t, torch.arange(a, min(a + 256, 300)), 5, gen)[1]
                        for a in (0, 256)])
    assert loss == pytest.approx(2.0) and top1 == pytest.approx(100 * (labels == 0).sum() / 300)


def test_search_shows_at_most_a_chunks_lines_and_reuses_an_index_of_relative_paths(
        corpus, capsys, tmp_path, monkeypatch):
    """--show prints a chunk's first lines, never those past its end; --docs given relative to the
    current folder finds its files in the index on the next call (nothing embedded again). A file
    named as well as found in its folder is one file, read alike (a Latin-1 byte: U+FFFD)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'docs').mkdir()
    (tmp_path / 'docs/a.py').write_bytes(b'def one(x):\n    return x\n\n\ndef two(y):\n'
                                         b'    return y  # caf\xe9\n')
    (tmp_path / 'docs/venv').mkdir()                   # --exclude: a folder, and files by a glob
    for left_out in ('venv/lib.py', 'app.min.js'):
        (tmp_path / 'docs' / left_out).write_text('def one(x):\n    return x\n')
    argv = ['search', f'--ckpt={corpus.mixer}', '--docs=docs,./docs/a.py', '--index=i.pt', '--k=1',
            '--show=9', '--dtype=float32', '--query=def one(x):\n    return x\n',
            '--exclude=venv,*.min.js']
    code, out, err = run_main(capsys, 'retrieve', *argv)
    assert code == 0 and '(2 embedded now)' in out, err
    assert out.splitlines()[1:] == ['1. 1.000  docs/a.py:1-2', '   def one(x):', '       return x']
    code, out, err = run_main(capsys, 'retrieve', *argv)
    assert code == 0 and '2 chunks in 1 files (0 embedded now)' in out, err
