"""prepare.py: the default corpus, tokenizers, retrieval pairs, the hub datasets from a local
stand-in server (fixture `hub`)."""
import codecs, hashlib, http.server, io, json, os, platform, random, re, signal, socket, subprocess
import shutil, sys, threading, time, types, urllib.parse

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import configurator, prepare
from prepare import Tokenizer, docstring_pairs, ict_pairs
from tests.conftest import HERE, tokenizer, train_run, run_main, refused


def test_pystdlib_subset_agrees_with_meta_and_splits_by_module(stdlib_dir, capsys):
    """Every document is one module, verbatim, in its hash-assigned split; docstring pairs follow
    the module split; test folders and generated tables are left out; an unchanged rerun is a no-op
    that touches no file."""
    meta, docs, pairs = read_folder(stdlib_dir)
    assert meta['dataset'] == 'pystdlib' and meta['vocab_size'] == 400 and meta['train_docs'] == 150
    assert meta['val_docs'] > 0 and meta['source']['python'] == platform.python_version()
    assert meta['source']['files'] == meta['train_docs'] + meta['val_docs']
    root, files = prepare.stdlib_files()
    assert not {'test', 'tests', 'site-packages'} & {p for f in files for p in f.split('/')[:-1]}
    generated = {'encodings/cp1252.py', 'pydoc_data/topics.py'}  # tables, not code: left out
    assert 'encodings/utf_8.py' in files and not generated & set(files)
    sources = {open(os.path.join(root, f), encoding='utf-8').read(): f for f in files}
    assert all(prepare.split_of(sources[d], 0.05) == s for s in docs for d in docs[s])
    # no val module's code among the train targets (a few small helpers exist verbatim in two
    # modules, e.g. asyncio's write_eof, so compare against what train modules hold)
    from_val = {t for d in docs['val'] for _, t in docstring_pairs(d)}
    from_train = {t for d in docs['train'] for _, t in docstring_pairs(d)}
    train_targets = {p['target'] for p in pairs['train']}
    assert from_val == {p['target'] for p in pairs['val']} and from_val
    assert train_targets == from_train and not train_targets & (from_val - from_train)
    mtimes = lambda: {n: os.stat(os.path.join(stdlib_dir, n)).st_mtime_ns  # noqa: E731
                      for n in os.listdir(stdlib_dir)}
    before = mtimes()
    assert prepare.main(['pystdlib', '--max_docs=150', '--vocab_size=400',
                         f'--out_dir={stdlib_dir}']) == 0
    assert 'up to date' in capsys.readouterr().out and mtimes() == before


def test_tokenizer_round_trips_and_trains_deterministically(stdlib_dir, tmp_path, monkeypatch):
    """Any text round-trips (unseen characters as byte pieces), by the folder's model or the spec
    that holds it (a checkpoint's); a folder without its model is refused, naming it; training reads
    only its sample of the stream and makes the same model twice."""
    tok = tokenizer(stdlib_dir)
    texts = ['naïve café, Ærøskøbing', 'emoji 🎉🚀 👩‍👩‍👧 ✔️',
             '中文字符 ∀x∈ℝ: x² ≥ 0', 'ʘ‿ʘ ☃ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢',
             '  lead\t\ttabs\n\n  trailing  \r\n\x00\x01\x7f', '<s></s><pad><unk><|endoftext|>', '',
             ' ', '\n']
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids) == text and not set(ids) & {tok.bos_id, tok.eos_id, tok.pad_id}
    assert any(tok.sp.id_to_piece(i).startswith('<0x') for i in tok.encode('☃'))
    assert tok.encode('x', bos=True, eos=True) == [tok.bos_id] + tok.encode('x') + [tok.eos_id]
    assert tok.encode('x', eos=True) == tok.encode('x') + [tok.eos_id] != tok.encode('x', bos=True)
    assert tok.decode([tok.bos_id, *tok.encode('hi'), tok.eos_id, tok.pad_id]) == 'hi'
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert Tokenizer(tok.spec).encode_batch(texts) == tok.encode_batch(texts)
    with pytest.raises(ValueError, match='no prepared data'):
        tokenizer(tmp_path)
    (tmp_path / 'lost').mkdir()
    shutil.copy(os.path.join(stdlib_dir, 'meta.json'), tmp_path / 'lost')
    with pytest.raises(ValueError, match='lost/tokenizer.model not found: prepare the data again'):
        tokenizer(tmp_path / 'lost')
    monkeypatch.setattr(prepare, 'TOKENIZER_SAMPLE', 20_000)
    pulled = []

    def documents():
        rng = random.Random(0)
        for i in range(100_000):
            pulled.append(i)
            yield 'train' if i % 10 else 'val', str(i), prose(rng, 10)
    prepare.train_tokenizer(documents, 2, 400, tmp_path / 'a.model')
    assert 80 < len(pulled) < 140  # ~20 kB of every other training document (54 of all of them)
    prepare.train_tokenizer(documents, 2, 400, tmp_path / 'b.model')
    assert (tmp_path / 'a.model').read_bytes() == (tmp_path / 'b.model').read_bytes()


def test_killed_mid_encode_then_rerun_matches_uninterrupted(tmp_path, stdlib_dir):
    rng = random.Random(0)
    (tmp_path / 'corpus').mkdir()
    for i in range(24):  # ~6 MB: a second of encoding on 2 cores, plenty to kill it in the middle
        part = '\n<|endoftext|>\n'.join(prose(rng, 60) for _ in range(90))
        (tmp_path / f'corpus/part{i:02d}.txt').write_text(part)
    args = ['text', f'--input={tmp_path}/corpus', '--pairs=ict',
            f"--tokenizer={stdlib_dir}/tokenizer.model"]
    assert prepare.main([*args, f'--out_dir={tmp_path}/a']) == 0
    out = tmp_path / 'b'
    cmd = [sys.executable, os.path.join(HERE, 'prepare.py'), *args, f'--out_dir={out}']
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 60
    while not (out / 'train.bin.tmp').exists() or (out / 'train.bin.tmp').stat().st_size == 0:
        assert proc.poll() is None and time.time() < deadline, 'finished before interrupted'
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / 'meta.json').exists() and not (out / 'train.bin').exists()
    assert prepare.main([*args, f'--out_dir={out}']) == 0
    snapshot = lambda d: {n: (d / n).read_bytes() for n in sorted(os.listdir(d))}  # noqa: E731
    assert snapshot(out) == snapshot(tmp_path / 'a')
    meta, docs, pairs = read_folder(out)
    assert meta['train_docs'] + meta['val_docs'] == 24 * 90 and pairs['train'] and pairs['val']


FIXTURE_PY = '''\
@functools.cache
def area(r):
    """Area of a circle
    of radius r.

    Uses pi from math.
    """
    return 3.14159 * r * r

class Stack:
    """A last-in first-out stack."""

    def push(self, x):
        """Put x on top."""
        self.items.append(x)

def inline(): """Docstring on the def line."""

def plain(x):
    return x
'''


def test_docstring_and_ict_pairs():
    """A docstring's first paragraph, joined, queries its code without the docstring (decorators
    kept); an ICT query is one sentence of a 6-sentence window, its target the others, separators
    kept."""
    assert list(docstring_pairs(FIXTURE_PY)) == [
        ('Area of a circle of radius r.',
         '@functools.cache\ndef area(r):\n    return 3.14159 * r * r'),
        ('A last-in first-out stack.',
         'class Stack:\n\n    def push(self, x):\n        self.items.append(x)'),
        ('Put x on top.', 'def push(self, x):\n    self.items.append(x)')]
    assert list(docstring_pairs('def broken(:\n    """Nope."""\n')) == []
    assert list(docstring_pairs('async def get():\n    """Fetch."""\n    return 1\n')) == [
        ('Fetch.', 'async def get():\n    return 1')]  # an async def is a def too
    sentences = [f'Sentence number {i} has words.' for i in range(8)]
    text = ' '.join(sentences[:4]) + '\n\n' + ' '.join(sentences[4:])
    pairs = list(ict_pairs(text, 'doc'))
    # deterministic; the 2-sentence tail is too short
    assert len(pairs) == 1 and pairs == list(ict_pairs(text, 'doc'))
    query, target = pairs[0]
    assert query in sentences[:6] and query not in target
    assert '\n\n' in target or query == sentences[3]
    assert target.split() == ' '.join(s for s in sentences[:6] if s != query).split()
    assert list(ict_pairs('Too short. Only two.', 'x')) == []


def test_text_dataset_pairs(tmp_path, stdlib_dir, capsys):
    """A folder (binary files skipped, bytes not UTF-8 read as U+FFFD) or a glob becomes documents
    with their docstring or ICT pairs (a file matched twice: once; none: a warning); --tokenizer
    takes a prepared folder's; a prepared folder inside its input is not read back. Only regular
    files are read: a pipe would block, a broken link fail (listed, never opened here)."""
    (tmp_path / 'src').mkdir()
    for i in range(12):
        (tmp_path / f'src/mod{i}.py').write_text(FIXTURE_PY.replace('Stack', f'Stack{i}'))
        (tmp_path / f'src/notes{i}.txt').write_text(prose(random.Random(i), 14))
    (tmp_path / 'src/blob.bin').write_bytes(b'\0\1\2' * 100)
    (tmp_path / 'src/latin1.md').write_bytes('déjà vu, naïve café\n'.encode('latin-1'))
    os.mkfifo(tmp_path / 'pipe')
    os.symlink(tmp_path / 'nowhere', tmp_path / 'dangling')
    root, rels = prepare.text_files([f'{tmp_path}/*', f'{tmp_path}/src', f'{tmp_path}/src/../src'],
                                    f'{tmp_path}/out')
    assert root == str(tmp_path / 'src') and 'blob.bin' in rels  # the pipe and the link: left out
    assert len(rels) == len(set(rels)) == 26  # src/* matched three times, two spellings: once
    # in the order matched (globs and folders sorted), never a set's: the fingerprint lists the
    # files in this order, so a hash-seeded one would make every rerun look like new inputs
    assert rels == sorted(rels)
    tok = f'--tokenizer={stdlib_dir}/tokenizer.model'
    args = ['text', f'--input={tmp_path}/src', '--pairs=docstring', f'--tokenizer={stdlib_dir}',
            f'--out_dir={tmp_path}/src/d']  # a prepared folder's tokenizer, as its file's
    assert prepare.main(args) == 0
    meta, docs, pairs = read_folder(tmp_path / 'src/d')
    assert meta['train_docs'] + meta['val_docs'] == 25
    assert 'd\ufffdj\ufffd vu, na\ufffdve caf\ufffd\n' in docs['train'] + docs['val']
    assert sorted((p['query'], p['target']) for s in pairs for p in pairs[s]) == sorted(
        p for i in range(12) for p in docstring_pairs(FIXTURE_PY.replace('Stack', f'Stack{i}')))
    assert prepare.main(args) == 0 and 'up to date' in capsys.readouterr().out
    assert prepare.main(['text', f'--input={tmp_path}/src/*.txt', '--pairs=docstring', tok,
                         f'--out_dir={tmp_path}/none']) == 0  # prose holds no docstrings
    assert 'warning: --pairs=docstring made 0 train and 0 val pairs' in capsys.readouterr().err
    assert prepare.main(['text', f'--input={tmp_path}/src/*.txt', '--pairs=ict', tok,
                         f'--out_dir={tmp_path}/i']) == 0
    meta, docs, pairs = read_folder(tmp_path / 'i')
    assert meta['train_docs'] + meta['val_docs'] == 12
    key = {(tmp_path / f'src/notes{i}.txt').read_text(): f'notes{i}.txt' for i in range(12)}
    for s in pairs:
        want = [p for d in docs[s] for p in ict_pairs(d, key[d])]
        assert [(p['query'], p['target']) for p in pairs[s]] == want


def test_exclude_and_holdout(tmp_path, stdlib_dir, capsys):
    """--exclude leaves a matching folder out of every output; a --holdout package is in no token
    stream and no train or val pair, and its pairs are pairs_heldout.jsonl; a glob that matches
    nothing is refused (a typo would otherwise train on the package meant for testing); --max_docs
    and --max_tokens cut the training documents, not the held-out ones that come after them."""
    for pkg in ('keep', 'keep/tests', 'zheld'):
        (tmp_path / 'site' / pkg).mkdir(parents=True)
        for i in range(6):
            code = FIXTURE_PY.replace('Stack', f"Stack{pkg.replace('/', '_')}{i}")
            (tmp_path / 'site' / pkg / f'm{i}.py').write_text(code)
    args = ['text', f'--input={tmp_path}/site', '--pairs=docstring', '--exclude=tests/',  # a name
            f'--tokenizer={stdlib_dir}/tokenizer.model', f'--out_dir={tmp_path}/d']  # may end in /
    assert prepare.main(args + ['--holdout=zhel*']) == 0
    meta, docs, pairs = read_folder(tmp_path / 'd')
    seen = json.dumps([docs, pairs])
    assert 'Stackkeep0' in seen and 'Stackkeep_tests' not in seen and 'Stackzheld' not in seen
    held = [json.loads(line) for line in open(tmp_path / 'd/pairs_heldout.jsonl')]
    assert sorted((p['query'], p['target']) for p in held) == sorted(
        p for i in range(6) for p in docstring_pairs(FIXTURE_PY.replace('Stack', f'Stackzheld{i}')))
    assert meta['n_pairs_heldout'] == len(held)
    for cap in ('--max_docs=2', '--max_tokens=10'):
        capped = [*args[:-1], f'--out_dir={tmp_path}/{cap[6:9]}', '--holdout=zhel*', cap]
        assert prepare.main(capped) == 0
        meta = read_folder(tmp_path / cap[6:9])[0]
        assert meta['n_pairs_heldout'] == len(held) and meta['train_docs'] < 6, (cap, meta)
    refused(capsys, 'prepare', args + ['--holdout=helt'], "'helt' matches no file",
            keep=[tmp_path / 'd'])


def test_tiktoken_tokenizer_or_clear_offline_error(tmp_path, capsys):
    for i in range(10):
        (tmp_path / f'{i}.txt').write_text(f'Hello world {i}. ' * 50)
    code, _, err = run_main(capsys, 'prepare', 'text', f'--input={tmp_path}/*.txt',
                            '--tokenizer=gpt2', f'--out_dir={tmp_path}/out')
    if code == 0:  # online, or the vocabulary is cached
        meta, docs, _ = read_folder(tmp_path / 'out')
        assert meta['tokenizer'] == {'kind': 'tiktoken', 'name': 'gpt2'}
        assert meta['vocab_size'] == 50257 and not (tmp_path / 'out/tokenizer.model').exists()
    else:
        assert code == 2 and len(err.strip().splitlines()) == 1 and 'gpt2' in err


def test_tiktoken_specials_offline(monkeypatch):
    """The tiktoken branch, its vocabulary stood in for (no download): GPT's one <|endoftext|> is
    BOS, EOS and pad alike, and decode drops only it, so every other token (id 0, '!', too) and
    text that looks like the special token come back."""
    import tiktoken
    ranks = {bytes([(i + 33) % 256]): i for i in range(256)}  # byte-level; id 0 is '!', as in gpt2
    enc = tiktoken.Encoding('gpt2', pat_str=r"\S+|\s+", mergeable_ranks=ranks,
                            special_tokens={'<|endoftext|>': 256})
    monkeypatch.setattr(tiktoken, 'get_encoding', lambda name: enc)
    tok = Tokenizer({'kind': 'tiktoken', 'name': 'gpt2'})
    assert tok.bos_id == tok.eos_id == tok.pad_id == 256 and tok.vocab_size == 257
    ids = tok.encode('Hi! <|endoftext|>', bos=True, eos=True)
    assert ids[0] == ids[-1] == 256 not in ids[1:-1] and 0 in ids
    assert tok.decode(ids + [tok.pad_id]) == 'Hi! <|endoftext|>'


def test_hub_text_datasets(tmp_path, hub):
    """TinyStories, found through $HF_ENDPOINT, downloads into --download_dir (--max_docs cuts
    train only; a corpus with as many pieces as asked for: no warning)."""
    r = hub_cli(tmp_path, 'tinystories', '--max_docs=30', env={'HF_ENDPOINT': hub.url})
    assert r.returncode == 0, r.stderr
    name = 'TinyStories/TinyStories-train.txt'
    assert (tmp_path / 'downloads' / name).read_bytes() == hub.files[f'roneneldan/{name}']
    meta, docs, _ = read_folder(tmp_path / 'data/tinystories')
    assert docs['train'] == hub.stories[:30] and docs['val'] == hub.stories[40:]
    assert meta['source']['repo'] == 'roneneldan/TinyStories'
    assert meta['vocab_size'] == 400 and 'warning' not in r.stderr  # as many pieces as asked for


def test_hub_parquet_shards(tmp_path, hub):
    """fineweb-edu reads only sample/10BT's shards, in order, stopping at --max_tokens (refused
    where that leaves val empty), the column named text, skipping empty texts; --max_docs stops
    before the next shard is downloaded; finemath its folder."""
    r = hub_cli(tmp_path, 'fineweb-edu', f'--hub_url={hub.url}', '--pairs=ict', '--max_tokens=6000')
    assert r.returncode == 0, r.stderr
    meta, docs, pairs = read_folder(tmp_path / 'data/fineweb-edu')
    texts, used = hub.shards[0] + hub.shards[1], docs['train'] + docs['val']
    assert set(used) < set(texts) and sorted(used, key=texts.index) == texts[:len(used)]
    assert len(used) > 30
    last = len(tokenizer(tmp_path / 'data/fineweb-edu').encode(docs['train'][-1])) + 2
    assert meta['train_tokens'] >= 6000 > meta['train_tokens'] - last and meta['dtype'] == 'uint16'
    assert pairs['train'] and all(p['query'] not in p['target'] for p in pairs['train'])
    r = hub_cli(tmp_path, 'fineweb-edu', f'--hub_url={hub.url}', '--max_tokens=10', '--out_dir=x')
    assert r.returncode == 2 and 'before its first val document' in r.stderr   # the stream stopped
    (tmp_path / 'cut').mkdir()  # --max_docs stops the stream: the next shard is not downloaded
    r = hub_cli(tmp_path / 'cut', 'fineweb-edu', f'--hub_url={hub.url}', '--max_docs=5')
    assert r.returncode == 0, r.stderr
    assert os.listdir(tmp_path / 'cut/downloads/fineweb-edu/sample/10BT') == ['000_00000.parquet']
    r = hub_cli(tmp_path, 'finemath', f'--hub_url={hub.url}')
    assert r.returncode == 0, r.stderr
    meta, docs, pairs = read_folder(tmp_path / 'data/finemath')
    assert sorted(docs['train'] + docs['val']) == sorted(hub.shards[1]) and not pairs
    assert meta['vocab_size'] <= 400 and meta['source']['folder'] == 'finemath-4plus'


def test_hub_unreachable_says_what_to_download(tmp_path, hub):
    """Out of reach, prepare fails in seconds naming each file's URL and where to put it; following
    that works offline (still-missing files only are named), and a prepared folder then reruns as a
    no-op without the hub; offline, the shards already downloaded are read, in order."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        dead = f'http://127.0.0.1:{s.getsockname()[1]}'  # closed once the block ends
    t0 = time.time()
    r = hub_cli(tmp_path, 'tinystories', f'--hub_url={dead}')
    assert r.returncode == 2 and time.time() - t0 < 20 and r.stderr.count('\n') == 1
    assert r.stderr.startswith('error: ')
    for name in ('TinyStories-valid.txt', 'TinyStories-train.txt'):
        wanted = tmp_path / 'downloads/TinyStories' / name
        assert f'{dead}/datasets/roneneldan/TinyStories/resolve/main/{name}' in r.stderr
        assert str(wanted) in r.stderr
        wanted.parent.mkdir(parents=True, exist_ok=True)
        wanted.write_bytes(hub.files[f'roneneldan/TinyStories/{name}'])
        if 'valid' in name:  # only the files still missing are named
            r = hub_cli(tmp_path, 'tinystories', f'--hub_url={dead}')
            assert r.returncode == 2 and name not in r.stderr and 'train.txt' in r.stderr
    r = hub_cli(tmp_path, 'tinystories', f'--hub_url={dead}')
    assert r.returncode == 0, r.stderr
    assert read_folder(tmp_path / 'data/tinystories')[1]['val'] == hub.stories[40:]
    r = hub_cli(tmp_path, 'tinystories', f'--hub_url={dead}')
    assert r.returncode == 0 and 'up to date' in r.stdout
    r = hub_cli(tmp_path, 'fineweb-edu', f'--hub_url={dead}')
    assert r.returncode == 2 and r.stderr.count('\n') == 1 and 'sample/10BT' in r.stderr
    for name in ('001_00000.parquet', '000_00000.parquet'):  # offline: the shards there, in order
        path = tmp_path / 'downloads/fineweb-edu/sample/10BT' / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(hub.files[f'HuggingFaceFW/fineweb-edu/sample/10BT/{name}'])
    r = hub_cli(tmp_path, 'fineweb-edu', f'--hub_url={dead}')
    assert r.returncode == 0 and 'using the 2 shards' in r.stderr, r.stderr
    docs = read_folder(tmp_path / 'data/fineweb-edu')[1]
    texts = hub.shards[0] + hub.shards[1]
    assert sorted(docs['train'], key=texts.index) == docs['train'] and len(docs['train']) > 40


@pytest.mark.parametrize('n_files', [1, 12])
def test_small_corpus_gets_a_val_split(n_files, tmp_path, capsys):
    """Even one file prepares into a train and a val split that train.py can use, announcing that it
    yields fewer pieces than --vocab_size; other inputs replace it only with --overwrite; a corpus
    too small is refused."""
    (tmp_path / 'src').mkdir()
    for i in range(n_files):
        code = ''.join(f"def f{i}_{j}(x):\n    return x + {j}\n\n" for j in range(40))
        (tmp_path / f'src/m{i}.py').write_text(code)
    assert prepare.main(['text', f'--input={tmp_path}/src', f'--out_dir={tmp_path}/data',
                         '--vocab_size=100000']) == 0
    out = capsys.readouterr()
    warnings = [w for w in out.err.splitlines() if w.startswith('warning: ')]
    assert len(warnings) == 1 and 'vocab_size' in warnings[0], warnings
    meta, docs, _ = read_folder(tmp_path / 'data')
    assert meta['val_tokens'] > 0 and meta['train_tokens'] > meta['val_tokens']
    if n_files == 1:  # val: the last tenth of its characters, from a line start
        val, = docs['val']
        assert code.endswith('\n' + val) and len(code) // 20 < len(val) <= len(code) // 10
    else:  # all 12 hash to train, so val is carved, before --max_docs cuts train: the same val
        assert 'val is the end of the corpus' in out.out
        assert f"train_tokens {meta['train_tokens']:,}, val_tokens" in out.out  # the report line
        assert prepare.main(['text', f'--input={tmp_path}/src', f'--out_dir={tmp_path}/two',
                             '--vocab_size=100000', '--max_docs=2']) == 0
        meta2, docs2, _ = read_folder(tmp_path / 'two')
        assert meta2['train_docs'] == 2 and docs2['val'] == docs['val']
    assert train_run(tmp_path / 'data', tmp_path / 'out', '--n_ctx=16', '--max_iters=2',
                     '--eval_interval=2') == 0
    (tmp_path / 'src/tiny.txt').write_text('x')
    argv = ['text', f'--input={tmp_path}/src/tiny.txt', f'--out_dir={tmp_path}/data']
    refused(capsys, 'prepare', argv, '--overwrite', keep=[tmp_path / 'data'])  # other inputs
    refused(capsys, 'prepare', [*argv, '--overwrite'], 'too small', keep=[tmp_path / 'data'])


def test_held_out_documents_stay_out_of_a_carved_corpus(tmp_path, stdlib_dir):
    """A --holdout file of several documents (<|endoftext|> lines: keys file#i) reaches no token
    stream and no train or val pair, also where val is carved from a corpus of one document."""
    lines = lambda tag: ''.join(f'{tag} line {i} of some text\n' for i in range(30))  # noqa: E731
    (tmp_path / 'src').mkdir()
    (tmp_path / 'src/keep.txt').write_text(lines('kept'))
    (tmp_path / 'src/held.txt').write_text(lines('heldA') + '<|endoftext|>\n' + lines('heldB'))
    tok = f'--tokenizer={stdlib_dir}/tokenizer.model'
    assert prepare.main(['text', f'--input={tmp_path}/src', '--pairs=ict', '--holdout=held.txt',
                         tok, f'--out_dir={tmp_path}/d']) == 0
    _, docs, pairs = read_folder(tmp_path / 'd')
    seen = json.dumps([docs, pairs])
    assert 'kept' in seen and 'held' not in seen and docs['val']  # carved: val from keep.txt


def test_one_file_of_long_lines_gives_val_a_tenth(tmp_path):
    """A single document's val is its last tenth in characters (counted in lines, a file of two long
    lines gave val half the text, and a form feed counted as a line break)."""
    words = ' '.join(f'w{i % 50}' for i in range(600))
    for name, text in (('lines', f'{words}\n{words}\n'), ('ff', f'{words}\f{words}')):
        (tmp_path / f'{name}.txt').write_text(text)
        assert prepare.main(['text', f'--input={tmp_path}/{name}.txt', '--vocab_size=100000',
                             f'--out_dir={tmp_path}/{name}']) == 0
        (train_text,), (val,) = (read_folder(tmp_path / name)[1][s] for s in ('train', 'val'))
        assert train_text + val == text and len(val) == len(text) // 10, name


def test_a_byte_order_mark_is_not_text(tmp_path):
    """A UTF-8 file saved with a byte-order mark reads as without one, in a corpus and in a named
    file: Python's parser refuses U+FEFF in a str, so such files had no docstring pairs."""
    src = 'def add(x):\n    """Add one."""\n    return x + 1\n'
    (tmp_path / 'bom.py').write_bytes(codecs.BOM_UTF8 + src.encode())
    assert list(prepare.eot_documents(tmp_path / 'bom.py')) == [src]
    assert configurator.read_text_file(str(tmp_path / 'bom.py'), 'file') == src
    assert list(prepare.docstring_pairs(src)) == [('Add one.', 'def add(x):\n    return x + 1')]


def test_a_file_of_several_documents_keys_each_one(tmp_path):
    """A file cut at <|endoftext|> lines gives documents keyed file#i, each split by its own key's
    hash; blank documents are skipped (their numbers kept); a file of one document is keyed file."""
    (tmp_path / 'many.txt').write_text('one\n<|endoftext|>\n  \n<|endoftext|>\ntwo\n')
    (tmp_path / 'solo.txt').write_text('solo\n')
    args = types.SimpleNamespace(dataset='text', input=[str(tmp_path)], out_dir=f'{tmp_path}/out',
                                 exclude=[], holdout=[])
    docs = list(prepare.local_documents(args, 0.5)[0]())
    assert [(k, t) for _, k, t in docs] == [('many.txt#0', 'one\n'), ('many.txt#2', 'two\n'),
                                           ('solo.txt', 'solo\n')]
    assert all(s == prepare.split_of(k, 0.5) for s, k, _ in docs)


def test_a_vocabulary_past_uint16_is_stored_as_uint32(tmp_path, stdlib_dir, monkeypatch):
    """Past 65535 pieces the token files are uint32 (uint16 would wrap the larger ids)."""
    init = prepare.Tokenizer.__init__

    def big(self, *args):
        init(self, *args)
        self.vocab_size = 70_000
    monkeypatch.setattr(prepare.Tokenizer, '__init__', big)
    (tmp_path / 'a.txt').write_text('some text\n' * 50)
    assert prepare.main(['text', f'--input={tmp_path}/a.txt', f'--out_dir={tmp_path}/d',
                         f'--tokenizer={stdlib_dir}/tokenizer.model']) == 0
    meta = json.loads((tmp_path / 'd/meta.json').read_text())
    assert meta['dtype'] == 'uint32' and meta['vocab_size'] == 70_000
    assert os.path.getsize(tmp_path / 'd/train.bin') == 4 * meta['train_tokens']


def test_a_failed_prepare_leaves_no_temporary_files(tmp_path, capsys):
    (tmp_path / 'a.txt').write_text('some text\n' * 50)
    (tmp_path / 'garbage.model').write_bytes(b'not a tokenizer')
    refused(capsys, 'prepare', ['text', f'--input={tmp_path}/a.txt', f'--out_dir={tmp_path}/d',
                                f'--tokenizer={tmp_path}/garbage.model'], 'garbage.model')
    assert os.listdir(tmp_path / 'd') == []


def read_folder(out):
    """meta, documents and pairs of a prepared folder, checked against meta.json: every document is
    BOS ... EOS at its recorded offset, every count and id agrees."""
    meta = json.load(open(os.path.join(out, 'meta.json')))
    assert meta['dtype'] == ('uint16' if meta['vocab_size'] < 65536 else 'uint32')
    tok = tokenizer(out)
    for k in ('vocab_size', 'bos_id', 'eos_id', 'pad_id'):
        assert isinstance(meta[k], int) and getattr(tok, k) == meta[k]
    docs, pairs = {}, {}
    for s in ('train', 'val'):
        ids = np.fromfile(os.path.join(out, f'{s}.bin'), dtype=meta['dtype'])
        starts = np.load(os.path.join(out, f'{s}_docs.npy'))
        assert starts.dtype == np.int64 and len(ids) == meta[f'{s}_tokens']
        assert len(starts) == meta[f'{s}_docs']
        ends = np.append(starts[1:], len(ids))
        if len(starts):
            assert starts[0] == 0 and np.all(ends > starts + 1) and ids.max() < meta['vocab_size']
            assert np.all(ids[starts] == meta['bos_id']) and np.all(ids[ends - 1] == meta['eos_id'])
        docs[s] = [tok.decode(ids[a:b]) for a, b in zip(starts, ends)]
        if f'n_pairs_{s}' in meta:
            with open(os.path.join(out, f'pairs_{s}.jsonl'), encoding='utf-8') as f:
                pairs[s] = [json.loads(line) for line in f]
            assert len(pairs[s]) == meta[f'n_pairs_{s}']
            assert all(set(p) == {'query', 'target', 'path'} and p['query'] and p['target']
                       for p in pairs[s])
    # a Python file (one document) has its pairs in its own split only
    files = [{p['path'] for p in pairs[s] if p['path'].endswith('.py')} for s in pairs]
    assert len(files) < 2 or not files[0] & files[1]
    return meta, docs, pairs


@pytest.fixture(scope='module')
def stdlib_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp('pystdlib'))
    assert prepare.main(['pystdlib', '--max_docs=150', '--vocab_size=400', f'--out_dir={out}']) == 0
    return out


PROSE_WORDS = ('the a cat dog sun moon tree river small big red green happy quiet runs jumps sees '
               'finds under over near bright old young garden house friend little').split()


def prose(rng, sentences):
    return ' '.join(' '.join(rng.choices(PROSE_WORDS, k=rng.randint(4, 12))).capitalize()
                    + rng.choice('.!?') for _ in range(sentences))


def parquet(texts):
    buf = io.BytesIO()
    ids = [str(i) for i in range(len(texts))]  # text not first: finemath's is not either
    pq.write_table(pa.table({'id': ids, 'text': texts}), buf)
    return buf.getvalue()


@pytest.fixture(scope='module')
def hub():
    """A stand-in for the Hugging Face hub on 127.0.0.1: the resolve/ (files) and tree/ (folder
    listings) endpoints huggingface_hub calls."""
    rng = random.Random(1)
    stories = [prose(rng, 7) + '\n\n' + prose(rng, 4) for _ in range(46)]
    shards = [[prose(rng, 12) for _ in range(30)] for _ in range(2)]
    eot = lambda docs: ''.join(d + '\n<|endoftext|>\n' for d in docs).encode()  # noqa: E731
    files = {
        'roneneldan/TinyStories/TinyStories-train.txt': eot(stories[:40]),
        'roneneldan/TinyStories/TinyStories-valid.txt': eot(stories[40:]),
        'HuggingFaceFW/fineweb-edu/sample/10BT/000_00000.parquet':  # empty texts: skipped
            parquet(shards[0] + ['', ' \n', None]),
        'HuggingFaceFW/fineweb-edu/sample/10BT/001_00000.parquet': parquet(shards[1]),
        'HuggingFaceFW/fineweb-edu/data/CC-MAIN-2024-10/000_00000.parquet': parquet(['not in it']),
        'HuggingFaceTB/finemath/finemath-4plus/train-00000-of-00064.parquet': parquet(shards[1])}

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
            resolve = re.fullmatch(r'/datasets/(\w+/[\w-]+)/resolve/main/(.+)', path)
            tree = re.fullmatch(r'/api/datasets/(\w+/[\w-]+)/tree/main/(.+)', path)
            if resolve and '/'.join(resolve.groups()) in files:
                data = files['/'.join(resolve.groups())]
                headers = {'ETag': f'"{hashlib.sha256(data).hexdigest()}"',
                           'X-Repo-Commit': 'c0ffee' * 6 + 'abcd'}
            elif tree:  # the files directly in the folder
                repo, folder = tree[1], '/'.join(tree.groups()).rstrip('/')
                data = json.dumps([{'type': 'file', 'path': k[len(repo) + 1:], 'size': len(v),
                                    'oid': hashlib.sha1(v).hexdigest()}
                                   for k, v in files.items() if os.path.dirname(k) == folder])
                data, headers = data.encode(), {'Content-Type': 'application/json'}
            else:
                return self.send_error(404)
            self.send_response(200)
            for k, v in {**headers, 'Content-Length': str(len(data))}.items():
                self.send_header(k, v)
            self.end_headers()
            if self.command == 'GET':
                self.wfile.write(data)

        do_HEAD = do_GET

    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield types.SimpleNamespace(url=f'http://127.0.0.1:{server.server_port}', files=files,
                                stories=stories, shards=shards)
    server.shutdown()


def hub_cli(tmp_path, *argv, env=None):
    """`python prepare.py ...` as a user runs it, with its own hub cache."""
    env = {**{k: v for k, v in os.environ.items() if k not in ('HF_ENDPOINT', 'HF_HUB_OFFLINE')},
           'HF_HOME': str(tmp_path / 'hf_home'), 'NO_PROXY': '127.0.0.1', 'no_proxy': '127.0.0.1',
           **(env or {})}
    return subprocess.run([sys.executable, os.path.join(HERE, 'prepare.py'), *argv,
                           f'--download_dir={tmp_path}/downloads', '--vocab_size=400'],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


SOURCE = """import os

X = 1


@decorator
def f(a):
    \"\"\"Doc.\"\"\"
    return a


class C:
    \"\"\"A class.\"\"\"
    y = 2

    def m(self):
        return 1

    async def n(self):
        def inner():
            pass
        return inner
"""


class Words:
    """A tokenizer stand-in for chunks_of: a line costs one token per word, and one if blank."""
    @staticmethod
    def encode_batch(lines):
        return [line.split() or [''] for line in lines]


def test_search_chunks_are_whole_definitions_and_lines():
    """Python: each function and method with its decorators, a class without its methods, the
    module's lines between them (blank runs dropped); a long one, and other text, cut into runs of
    whole lines of at most `budget` tokens (a longer line alone), numbered as the parser does."""
    assert prepare.chunks_of('a.py', SOURCE, Words, 100) == [
        (1, 5), (6, 9), (12, 15), (16, 17), (19, 22)]
    # lines 1-5 cost 2 1 3 1 1 tokens, 6-9 1 2 1 2, 12-15 2 2 3 1, 16-17 2 2, 19-22 3 2 1 2
    assert prepare.chunks_of('a.py', SOURCE, Words, 4) == [
        (1, 2), (3, 4), (6, 8), (9, 9), (12, 13), (14, 15), (16, 17), (19, 19), (20, 21),
        (22, 22)]
    text = 'one two\nthree four five six seven\n\nsix\n'
    assert prepare.chunks_of('notes.txt', text, Words, 3) == [(1, 1), (2, 2), (3, 4)]
    assert prepare.chunks_of('bad.py', 'def (\n  x\n', Words, 3) == [(1, 2)]  # no parse: lines
    # a form feed is a character of its line, as ast counts lines (str.splitlines cuts there)
    ff = 'import os\n\x0c\ndef alpha():\n    return 1\n\x0c\n\ndef beta():\n    return 2\n'
    assert len(prepare.source_lines(ff)) == 8
    assert prepare.chunks_of('ff.py', ff, Words, 100) == [(1, 2), (3, 4), (7, 8)]


def test_a_changed_input_file_is_not_up_to_date(tmp_path, capsys):
    """The fingerprint covers what was read: the same options over an edited file prepare again
    (here refused without --overwrite), never 'up to date'."""
    src = tmp_path / 'corpus.txt'
    docs = [f"def f{i}(x):\n    return x * {i}\n" for i in range(40)]
    src.write_text('\n<|endoftext|>\n'.join(docs))
    args = ['text', f'--input={src}', f'--out_dir={tmp_path}/d', '--vocab_size=300']
    assert prepare.main(args) == 0
    assert prepare.main(args) == 0 and 'up to date' in capsys.readouterr().out
    src.write_text('\n<|endoftext|>\n'.join(docs[:20]))           # the input changed
    assert prepare.main(args) == 2
    out, err = capsys.readouterr()
    assert 'up to date' not in out and 'other inputs' in err


def test_a_folder_holds_this_runs_outputs_and_only_them(tmp_path, capsys):
    """A replacing run (--overwrite, other options) removes the outputs it did not write (here the
    first run's pairs) and never commits a killed run's temp file; a folder missing one of the
    outputs meta.json lists is not up to date (and not replaced unasked)."""
    rng = random.Random(0)
    docs = [prose(rng, 9) for _ in range(40)]
    (tmp_path / 'corpus.txt').write_text('\n<|endoftext|>\n'.join(docs))
    out = tmp_path / 'd'
    args = ['text', f'--input={tmp_path}/corpus.txt', f'--out_dir={out}', '--vocab_size=400']
    assert prepare.main([*args, '--pairs=ict']) == 0 and (out / 'pairs_train.jsonl').exists()
    (out / 'pairs_val.jsonl.tmp').write_text('{"query": "a", "target": "b"}\n')  # a killed run's
    assert prepare.main([*args, '--overwrite']) == 0
    outputs = json.loads((out / 'meta.json').read_text())['outputs']
    assert sorted(os.listdir(out)) == sorted([*outputs, 'meta.json'])
    assert not [name for name in outputs if 'pairs' in name]
    (out / 'val_docs.npy').unlink()
    assert prepare.main(args) == 2 and 'up to date' not in capsys.readouterr().out


def test_read_pairs_keeps_line_separators_inside_a_field(tmp_path):
    """encode writes pairs with ensure_ascii=False: U+2028/U+2029/U+0085 in a docstring stay raw
    inside a JSON line, and read_pairs must not cut the line there."""
    rows = [{'query': 'a\u2028b', 'target': 'c\u2029d\x85e'}, {'query': 'q', 'target': 't'}]
    path = tmp_path / 'pairs.jsonl'
    path.write_text(''.join(json.dumps(r, ensure_ascii=False) + '\n' for r in rows),
                    encoding='utf-8')
    assert prepare.read_pairs(str(path)) == (['a\u2028b', 'q'], ['c\u2029d\x85e', 't'])


def test_a_docstring_followed_by_code_on_its_line_makes_no_pair():
    """A docstring sharing its line with code after it (`'Doc.'; return 1`) is left alone, as one
    after code on its line is: removing its line would remove the code."""
    assert list(docstring_pairs('def f():\n    """Doc."""; return 1\n')) == []


def test_ict_pairs_take_a_passage_of_three_sentences():
    """A passage of 3 sentences, the shortest kept, gives a pair; one of 2, none."""
    sentences = [f'Sentence number {i} here.' for i in range(9)]   # passages of 6 and 3
    assert len(list(ict_pairs(' '.join(sentences), 'doc'))) == 2
    assert len(list(ict_pairs(' '.join(sentences[:8]), 'doc'))) == 1


def test_visible_files_leave_hidden_folders_out(tmp_path, stdlib_dir):
    """A hidden folder (.git, say) is not walked, nor a hidden file read, nor the folders nanomixer
    wrote inside (prepared data, a run: their pairs and logs are text); the rest, sorted."""
    for rel in ('.git/config', 'a/.hidden', 'a/b.txt', 'c.txt', 'out/ckpt.pt', 'out/log.jsonl',
                'nanogpt/train.bin', 'nanogpt/prepare.py'):  # (another project's data: read)
        (tmp_path / rel).parent.mkdir(exist_ok=True, parents=True)
        (tmp_path / rel).write_text('x')
    shutil.copytree(stdlib_dir, tmp_path / 'data')  # prepared: its pairs are text
    assert list(prepare.visible_files(str(tmp_path))) == [
        str(tmp_path / p) for p in ('c.txt', 'a/b.txt', 'nanogpt/prepare.py', 'nanogpt/train.bin')]


def test_matching_takes_every_glob():
    """--exclude=a,b* leaves out what any of its globs matches, by folder or file name."""
    rels = ['a/x.py', 'bz/y.py', 'c/b1.py', 'c/z.py']
    assert prepare.matching(rels, ['a', 'b*'], 'exclude') == {'a/x.py', 'bz/y.py', 'c/b1.py'}


def test_a_carved_corpus_keeps_its_held_out_pairs(tmp_path, stdlib_dir):
    """Where val is carved from the end of a small corpus, the --holdout file's pairs still make
    pairs_heldout.jsonl."""
    (tmp_path / 'src').mkdir()
    (tmp_path / 'src/keep.txt').write_text(prose(random.Random(0), 30))
    held = prose(random.Random(1), 12)
    (tmp_path / 'src/held.txt').write_text(held)
    assert prepare.main(['text', f'--input={tmp_path}/src', '--pairs=ict', '--holdout=held.txt',
                         f'--tokenizer={stdlib_dir}/tokenizer.model',
                         f'--out_dir={tmp_path}/d']) == 0
    rows = [json.loads(line) for line in open(tmp_path / 'd/pairs_heldout.jsonl')]
    assert rows and [(r['query'], r['target']) for r in rows] == list(ict_pairs(held, 'held.txt'))
