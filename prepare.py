"""
Prepare a corpus for nanomixer: token streams, document offsets, a tokenizer and retrieval pairs.

    python prepare.py                                   # Python standard library of this interpreter, offline
    python prepare.py tinystories --max_docs=2000000    # the paper's TinyStories setup
    python prepare.py text --input='notes/*.md' --pairs=ict --tokenizer=data/pystdlib/tokenizer.model

Writes to --out_dir (default data/DATASET): train.bin and val.bin (raw uint16/uint32 token ids, every
document wrapped in BOS ... EOS), train_docs.npy and val_docs.npy (int64 start offset of each document),
tokenizer.model, pairs_train.jsonl and pairs_val.jsonl ({"query", "target"} per line) when the dataset
has pairs, and meta.json. Files are written under .tmp names and renamed when complete; meta.json goes
last and holds a fingerprint of the inputs and options, so an unchanged rerun does nothing.
"""
import argparse, ast, collections, glob, hashlib, io, json, multiprocessing, os, platform, re, shutil
import socket, sys, sysconfig, textwrap, time
from itertools import chain, islice
from urllib.parse import urlsplit

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

FORMAT = 1                   # bump when outputs change meaning, so older folders are rebuilt
TOKENIZER_SAMPLE = 32 << 20  # bytes of training text the BPE tokenizer learns from (about 5 s)
JOB_DOCS = 64                # documents per encoding job
EOT = '<|endoftext|>'        # a line holding only this separates documents (TinyStories, `text` inputs)
SPLITS = ('train', 'val')
OUTPUTS = ('train.bin', 'val.bin', 'train_docs.npy', 'val_docs.npy', 'tokenizer.model',
           'pairs_train.jsonl', 'pairs_val.jsonl')
# name: (what it is, default vocabulary, share of documents sent to val by a hash of their key, or None
# where the dataset has its own validation file, default pairs)
DATASETS = {
    'pystdlib': ('Python standard library source of this interpreter (offline)', 4096, 0.05, 'docstring'),
    'tinystories': ('roneneldan/TinyStories, TinyStories-{train,valid}.txt', 4096, None, None),
    'tinystories-instruct': ('roneneldan/TinyStoriesInstruct stories; pairs Summary -> story', 4096, None, 'summary'),
    'fineweb-edu': ('HuggingFaceFW/fineweb-edu, sample/10BT parquet shards', 8000, 0.005, None),
    'finemath': ('HuggingFaceTB/finemath, finemath-4plus parquet shards', 8000, 0.005, None),
    'text': ('local files, folders or globs given with --input', 4096, 0.05, None),
}
HUB = {  # dataset: (repo, {split: file} or the folder whose parquet shards are streamed in order)
    'tinystories': ('roneneldan/TinyStories', {'val': 'TinyStories-valid.txt', 'train': 'TinyStories-train.txt'}),
    'tinystories-instruct': ('roneneldan/TinyStoriesInstruct',
                             {'val': 'TinyStories-Instruct-valid.txt', 'train': 'TinyStories-Instruct-train.txt'}),
    'fineweb-edu': ('HuggingFaceFW/fineweb-edu', 'sample/10BT'),
    'finemath': ('HuggingFaceTB/finemath', 'finemath-4plus'),
}
STDLIB_SKIP = {'site-packages', 'dist-packages', '__pycache__', 'test', 'tests', 'idle_test'}


class UserError(Exception):
    """A problem with the command line or the inputs: reported as one line, without a traceback."""


class Tokenizer:
    """The vocabulary a data folder was prepared with; train.py, sample.py and retrieve.py use it."""

    def __init__(self, spec, data_dir='.'):
        if spec['kind'] == 'tiktoken':
            self.enc = load_tiktoken(spec['name'])
            self.vocab_size = self.enc.n_vocab
            self.bos_id = self.eos_id = self.pad_id = self.enc.eot_token  # GPT-style: one <|endoftext|>
        elif spec['kind'] != 'sentencepiece':
            raise ValueError(f"unknown tokenizer kind {spec['kind']!r}")
        else:
            path = os.path.join(data_dir, spec['path'])
            if not os.path.isfile(path):
                raise FileNotFoundError(f'tokenizer model {path} not found')
            self.enc, self.sp = None, spm.SentencePieceProcessor(model_file=path)
            self.vocab_size, self.bos_id, self.eos_id = self.sp.get_piece_size(), self.sp.bos_id(), self.sp.eos_id()
            self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eos_id
            if min(self.bos_id, self.eos_id) < 0:
                raise ValueError(f'tokenizer model {path} has no BOS/EOS pieces')
            # merges cannot cross a line break no piece contains, so lines encode independently: same
            # ids, 1.5x faster on long documents
            pieces = map(self.sp.id_to_piece, range(self.vocab_size))
            self.by_line = all(''.join(p.splitlines()) == p for p in pieces)
        self.specials = [self.bos_id, self.eos_id, self.pad_id]

    @classmethod
    def from_meta(cls, meta, data_dir):
        return cls(meta['tokenizer'], data_dir)

    @classmethod
    def from_dir(cls, data_dir):
        path = os.path.join(data_dir, 'meta.json')
        if not os.path.isfile(path):
            raise FileNotFoundError(f'{path} not found: prepare the data first (python prepare.py)')
        with open(path) as f:
            return cls.from_meta(json.load(f), data_dir)

    def encode(self, text, bos=False, eos=False):
        if self.enc:
            ids = self.enc.encode_ordinary(text)  # text that looks like a special token stays text
        elif self.by_line:
            ids = list(chain.from_iterable(self.sp.encode(text.splitlines(True))))
        else:
            ids = self.sp.encode(text)
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def encode_batch(self, texts):
        return self.enc.encode_ordinary_batch(list(texts)) if self.enc else self.sp.encode(list(texts))

    def decode(self, ids):
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[~np.isin(ids, self.specials)].tolist()
        return self.enc.decode(ids) if self.enc else self.sp.decode(ids)


def load_tiktoken(name):
    import tiktoken
    if name not in tiktoken.list_encoding_names():
        raise UserError(f"unknown tiktoken encoding {name!r}; known: {', '.join(tiktoken.list_encoding_names())}")
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # the first use downloads the vocabulary
        raise UserError(f'tiktoken could not fetch the {name!r} vocabulary ({type(e).__name__}); run once with '
                        'network access (it is then cached in $TIKTOKEN_CACHE_DIR) or use a .model file')


# ----------------------------------------------------------------------------- documents
# A reader returns (documents, inputs, total, source): documents() yields (split, key, text, summary) in
# a fixed order, inputs identify what was read (for the fingerprint), total is the size in bytes if known.

def split_of(key, val_share):
    """Deterministic train/val assignment by a hash of the document's key (a file's path)."""
    return 'val' if int(hashlib.md5(key.encode()).hexdigest()[:8], 16) % 10000 < val_share * 10000 else 'train'


def eot_documents(path):
    """The documents of a text file, split at lines holding only <|endoftext|>."""
    lines = []
    with open(path, encoding='utf-8', errors='replace') as f:
        for line in f:
            if line.strip() == EOT:
                yield ''.join(lines)
                lines = []
            else:
                lines.append(line)
    yield ''.join(lines)


def stdlib_files():
    """The standard library's modules, sorted; its test suites are left out (see the notes)."""
    root, files = sysconfig.get_paths()['stdlib'], []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in STDLIB_SKIP]
        files += [os.path.relpath(os.path.join(folder, f), root) for f in names if f.endswith('.py')]
    return root, sorted(f.replace(os.sep, '/') for f in files)


def text_files(patterns):
    """Files named by --input (files, folders, globs), as the folder they share and paths within it."""
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if any(c in pattern for c in '*?[') else [pattern]
        if not matches or not all(map(os.path.exists, matches)):
            raise UserError(f'--input {pattern!r} matches no files')
        for m in matches:
            files += [m] if not os.path.isdir(m) else []
            for folder, dirs, names in os.walk(m):  # hidden files and folders are skipped
                dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
                files += [os.path.join(folder, f) for f in sorted(names) if not f.startswith('.')]
    files = [os.path.abspath(f) for f in dict.fromkeys(files)]
    if not files:
        raise UserError(f"--input {' '.join(patterns)} holds no files")
    if unreadable := [f for f in files if not os.access(f, os.R_OK)]:
        raise UserError(f'cannot read --input file {unreadable[0]}')
    root = os.path.commonpath([os.path.dirname(f) for f in files])
    return root, [os.path.relpath(f, root).replace(os.sep, '/') for f in files]


def local_documents(args, val_share):
    """pystdlib (one document per module) and text (files, cut at <|endoftext|> lines)."""
    if args.dataset == 'pystdlib':
        (root, rels), source = stdlib_files(), {'python': platform.python_version()}
    else:
        (root, rels), source = text_files(args.input), {'input': args.input}
    stats = [(rel, st.st_size, st.st_mtime_ns) for rel in rels for st in [os.stat(os.path.join(root, rel))]]

    def documents():
        for rel in rels:
            path = os.path.join(root, rel)
            with open(path, 'rb') as f:
                if b'\0' in f.read(4096):  # a binary file found in a folder or glob
                    continue
            docs = list(eot_documents(path))  # (no stdlib module holds an <|endoftext|> line)
            for i, text in enumerate(docs):
                key = rel if len(docs) == 1 else f'{rel}#{i}'
                if text.strip():
                    yield split_of(key, val_share), key, text, None
    return documents, stats, sum(size for _, size, _ in stats), source


def check_online(url, hint):
    """Fail in seconds, not after the hub client's minute of retries, when the hub is out of reach."""
    u = urlsplit(url)
    try:
        socket.create_connection((u.hostname, u.port or (443 if u.scheme == 'https' else 80)), timeout=5).close()
    except (OSError, ValueError) as e:
        raise UserError(f'cannot reach {url} ({getattr(e, "strerror", None) or e}); {hint}')


def hub_download(args, repo, names):
    """Local paths of hub files: already in --download_dir, else downloaded there (cached, resumable)."""
    local_dir = os.path.join(args.download_dir, repo.split('/')[1])
    paths = [os.path.join(local_dir, name) for name in names]
    missing = [(name, path) for name, path in zip(names, paths) if not os.path.isfile(path)]
    if missing:
        hint = 'for an offline run save ' + ' and '.join(
            f'{args.hub_url}/datasets/{repo}/resolve/main/{name} as {path}' for name, path in missing)
        check_online(args.hub_url, hint)
        from huggingface_hub import hf_hub_download
        for name, _ in missing:
            try:
                hf_hub_download(repo, name, repo_type='dataset', local_dir=local_dir, endpoint=args.hub_url)
            except Exception as e:
                raise UserError(f"downloading {name} failed ({type(e).__name__}: "
                                f"{str(e).strip().splitlines()[0][:200]}); {hint}")
    return paths


def hub_shards(args, repo, folder):
    """The parquet shards of a hub folder, in order; offline, the ones already downloaded."""
    local = os.path.join(args.download_dir, repo.split('/')[1], folder)
    hint = (f'for an offline run download the .parquet files of {args.hub_url}/datasets/{repo}/tree/main/'
            f'{folder} into {local}/')
    try:
        check_online(args.hub_url, hint)
        from huggingface_hub import HfApi
        tree = HfApi(endpoint=args.hub_url).list_repo_tree(repo, path_in_repo=folder, repo_type='dataset')
        names = sorted(f.path for f in tree if f.path.endswith('.parquet'))
    except Exception as e:
        names = sorted(f'{folder}/{f}' for f in os.listdir(local) if f.endswith('.parquet')) \
            if os.path.isdir(local) else []
        if not names:
            raise e if isinstance(e, UserError) else UserError(f'listing {repo}/{folder} failed ({e}); {hint}')
        print(f'hub out of reach: using the {len(names)} shards already in {local}', file=sys.stderr)
    if not names:
        raise UserError(f'no parquet files in {args.hub_url}/datasets/{repo}/tree/main/{folder}')
    return names


INSTRUCT_FIELD = re.compile(r'^(Features|Words|Summary|Random sentence|Story):[ \t]*', re.M)


def hub_documents(args, val_share):
    """TinyStories files (val file first, so --max_docs and --max_tokens cut train only) or parquet shards."""
    repo, files = HUB[args.dataset]
    shards = []

    def documents():
        if isinstance(files, str):
            import pyarrow.parquet as pq
            shards[:] = shards or hub_shards(args, repo, files)
            for name in shards:  # streamed shard by shard: a shard is downloaded when it is reached
                batches = pq.ParquetFile(hub_download(args, repo, [name])[0]).iter_batches(1024, columns=['text'])
                for i, text in enumerate(chain.from_iterable(b.column(0).to_pylist() for b in batches)):
                    if text and text.strip():
                        yield split_of(f'{name}#{i}', val_share), f'{name}#{i}', text, None
            return
        for (split, name), path in zip(files.items(), hub_download(args, repo, list(files.values()))):
            for i, text in enumerate(eot_documents(path)):
                summary = None
                if args.dataset == 'tinystories-instruct':  # "Field: value" lines, the story last
                    parts = INSTRUCT_FIELD.split(text)
                    fields = dict(zip(parts[1::2], parts[2::2]))
                    text, summary = fields.get('Story', ''), fields.get('Summary', '').strip()
                if text.strip():
                    yield split, f'{name}#{i}', text.strip(), summary
    return documents, [repo, files], None, {'repo': repo, 'files' if isinstance(files, dict) else 'folder': files}


# ----------------------------------------------------------------------------- retrieval pairs

def definitions(body):
    """Every def and class in a list of statements, nested ones included (expressions are not visited)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node
        for field in ('body', 'orelse', 'finalbody', 'handlers', 'cases'):
            yield from definitions(getattr(node, field, ()))


def docstring_pairs(source):
    """(first paragraph of its docstring, its source without docstrings) for each documented def/class."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    raw = source.encode().splitlines(True)  # bytes split where the parser does; ast offsets count bytes
    nodes, doc_lines = [], set()
    for node in definitions(tree.body):
        d = node.body[0]
        if ast.get_docstring(node) and not (raw[d.lineno - 1][:d.col_offset].strip()
                                            or raw[d.end_lineno - 1][d.end_col_offset:].strip()):
            nodes.append(node)  # (a docstring sharing a line with code is left alone)
            doc_lines.update(range(d.lineno - 1, d.end_lineno))
    pairs = []
    for node in sorted(nodes, key=lambda n: n.lineno):
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        code = b''.join(raw[i] for i in range(start, node.end_lineno) if i not in doc_lines).decode()
        pairs.append((' '.join(ast.get_docstring(node).split('\n\n')[0].split()), textwrap.dedent(code).rstrip()))
    return pairs


SENTENCE_END = re.compile(r'(?<=[.!?])(\s+)')


def ict_pairs(text, key, size=6):
    """Inverse cloze: for each passage of `size` sentences, one sentence -> the passage without it."""
    parts = SENTENCE_END.split(text.strip())
    sents, seps, pairs = parts[0::2], parts[1::2] + [''], []
    for i in range(0, len(sents), size):
        passage = range(i, min(i + size, len(sents)))
        picks = [j for j in passage if len(sents[j].split()) >= 4]  # a query of a few words at least
        if len(passage) >= 3 and picks:
            j = picks[int(hashlib.md5(f'{key}#{i}'.encode()).hexdigest()[:8], 16) % len(picks)]
            pairs.append((sents[j], ''.join(sents[k] + seps[k] for k in passage if k != j).strip()))
    return pairs


def document_pairs(kind, key, text, summary):
    if kind == 'docstring':
        return docstring_pairs(text) if key.split('#')[0].endswith('.py') else []
    if kind == 'summary':
        return [(summary, text)] if summary else []
    return ict_pairs(text, key) if kind == 'ict' else []


# ----------------------------------------------------------------------------- tokenizer and encoding

def train_tokenizer(documents, stride, vocab_size, path):
    """Byte-fallback BPE on a sample of the training text: any string round-trips through it."""
    bar = tqdm(desc='tokenizer sample', total=TOKENIZER_SAMPLE, unit='B', unit_scale=True)

    def lines():
        train = (text for split, _, text, _ in documents() if split == 'train')
        for i, text in enumerate(train):
            if bar.n >= TOKENIZER_SAMPLE:
                return  # (reading on would download and scan the whole corpus)
            if i % stride == 0:
                yield from (line for line in text.splitlines() if line.strip())
                bar.update(len(text.encode()))
    model = io.BytesIO()
    try:  # no sampling inside sentencepiece and fixed threads: the same model, byte for byte, every run
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines(), model_writer=model, model_type='bpe', vocab_size=vocab_size,
            hard_vocab_limit=False, byte_fallback=True, normalization_rule_name='identity',
            remove_extra_whitespaces=False, add_dummy_prefix=False, allow_whitespace_only_pieces=True,
            split_digits=True, character_coverage=0.9995, max_sentence_length=16384, input_sentence_size=0,
            unk_id=0, bos_id=1, eos_id=2, pad_id=3, num_threads=2, minloglevel=2)
    except RuntimeError as e:
        raise UserError(f'tokenizer training failed: {str(e).strip().splitlines()[0]}')
    finally:
        bar.close()
    with open(path, 'wb') as f:
        f.write(model.getvalue())


_job = None  # (tokenizer, dtype, pair kind) in each encoding process


def start_worker(spec, data_dir, dtype, pairs):
    global _job
    _job = Tokenizer(spec, data_dir), dtype, pairs


def encode_chunk(docs):
    """Per document: split, key, BOS ids EOS, a content hash, its pairs as json lines, its size."""
    tok, dtype, kind = _job
    out = []
    for split, key, text, summary in docs:
        data = text.encode()
        lines = [json.dumps({'query': q, 'target': t}, ensure_ascii=False) + '\n'
                 for q, t in document_pairs(kind, key, text, summary)]
        out.append((split, key, np.array(tok.encode(text, bos=True, eos=True), dtype=dtype),
                    hashlib.sha256(key.encode() + b'\0' + data).digest(), lines, len(data)))
    return out


def ordered_map(fn, jobs, workers, initargs):
    """fn over jobs, results in order; on a process pool when workers > 1, with few jobs in flight."""
    if workers == 1:
        start_worker(*initargs)
        yield from map(fn, jobs)
        return
    with multiprocessing.Pool(workers, start_worker, initargs) as pool:
        pending = collections.deque()
        for job in jobs:
            pending.append(pool.apply_async(fn, (job,)))
            if len(pending) > 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def encode(args, documents, total, spec, dtype, pairs):
    """Write the .tmp token streams, offsets and pairs; return the counts and content hashes."""
    path = lambda name: os.path.join(args.out_dir, name + '.tmp')
    bins = {s: open(path(f'{s}.bin'), 'wb') for s in SPLITS}
    jsonl = {s: open(path(f'pairs_{s}.jsonl'), 'w', encoding='utf-8') for s in SPLITS} if pairs else {}
    starts, tokens, n_pairs = {s: [] for s in SPLITS}, dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0)
    content, files = hashlib.sha256(), set()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1
    workers = 1 if total is not None and total < 4 << 20 else cores  # processes pay off on big corpora
    bar = tqdm(desc='encoding', total=total, unit='B', unit_scale=True)
    docs = documents()
    jobs = iter(lambda: list(islice(docs, JOB_DOCS)), [])
    results = ordered_map(encode_chunk, jobs, workers, (spec, args.out_dir, dtype, pairs))
    try:
        for split, key, ids, digest, lines, size in chain.from_iterable(results):
            if split == 'train' and args.max_tokens and tokens['train'] >= args.max_tokens:
                break
            starts[split].append(tokens[split])
            bins[split].write(ids.tobytes())
            tokens[split] += len(ids)
            if pairs:
                jsonl[split].writelines(lines)
                n_pairs[split] += len(lines)
            content.update(digest)
            files.add(key.split('#')[0])
            bar.update(size)
    finally:
        results.close()
        bar.close()
        for f in chain(bins.values(), jsonl.values()):
            f.close()
    for s in SPLITS:
        with open(path(f'{s}_docs.npy'), 'wb') as f:
            np.save(f, np.array(starts[s], dtype=np.int64))
    counts = {f'{s}_tokens': tokens[s] for s in SPLITS} | {f'{s}_docs': len(starts[s]) for s in SPLITS}
    if pairs:
        counts |= {'pairs': pairs, 'n_pairs_train': n_pairs['train'], 'n_pairs_val': n_pairs['val']}
    file_list = hashlib.sha256('\n'.join(sorted(files)).encode()).hexdigest()
    return counts, {'files': len(files), 'file_list_sha256': file_list, 'content_sha256': content.hexdigest()}


# ----------------------------------------------------------------------------- main

def up_to_date(out_dir, fingerprint):
    """True when meta.json carries this fingerprint and every file it lists is complete."""
    try:
        with open(os.path.join(out_dir, 'meta.json')) as f:
            meta = json.load(f)
        size, path = np.dtype(meta['dtype']).itemsize, lambda name: os.path.join(out_dir, name)
        return (meta['fingerprint'] == fingerprint and all(os.path.isfile(path(f)) for f in meta['outputs'])
                and all(os.path.getsize(path(f'{s}.bin')) == meta[f'{s}_tokens'] * size for s in SPLITS))
    except (OSError, ValueError, KeyError):
        return False


def commit(out_dir, produced, meta):
    """Move finished .tmp files into place; meta.json last, so it only ever describes a complete folder."""
    meta_path = os.path.join(out_dir, 'meta.json')
    if os.path.exists(meta_path):
        os.remove(meta_path)
    for name in OUTPUTS:
        path = os.path.join(out_dir, name)
        if name in produced:
            os.replace(path + '.tmp', path)
        for stale in [path + '.tmp'] + [path] * (name not in produced):  # left by a run with other options
            if os.path.exists(stale):
                os.remove(stale)
    with open(meta_path + '.tmp', 'w') as f:
        f.write(json.dumps(meta, indent=2) + '\n')
    os.replace(meta_path + '.tmp', meta_path)


def prepare(args):
    t0 = time.time()
    about, default_vocab, val_share, default_pairs = DATASETS[args.dataset]
    pairs, tok = args.pairs or default_pairs, args.tokenizer
    read, inputs, total, source = (hub_documents if args.dataset in HUB else local_documents)(args, val_share)

    def documents():  # the stream, cut after --max_docs training documents
        n_train = 0
        for doc in read():
            n_train += doc[0] == 'train'
            if args.max_docs and n_train > args.max_docs:
                return
            yield doc
    kind = 'train' if tok is None else 'file' if tok.endswith('.model') or os.path.isfile(tok) else 'tiktoken'
    if kind == 'file' and not os.path.isfile(tok):
        raise UserError(f'--tokenizer file {tok} does not exist')
    config = {k: getattr(args, k) for k in ('dataset', 'vocab_size', 'tokenizer', 'pairs', 'max_docs', 'max_tokens')}
    if kind == 'file':
        with open(tok, 'rb') as f:
            inputs = [inputs, hashlib.file_digest(f, 'sha256').hexdigest()]
    fingerprint = hashlib.sha256(json.dumps([FORMAT, config, inputs]).encode()).hexdigest()
    if up_to_date(args.out_dir, fingerprint):
        print(f'{args.out_dir} is up to date (same inputs and options): nothing to do')
        return
    docs = documents()  # the first document: downloads happen and empty inputs fail before any work
    if next(docs, None) is None:
        raise UserError('no text in the input (it is empty)')
    docs.close()
    os.makedirs(args.out_dir, exist_ok=True)

    spec = {'kind': 'sentencepiece', 'path': 'tokenizer.model.tmp'}
    if kind == 'train':
        vocab = args.vocab_size or default_vocab
        print(f'training a {vocab}-piece BPE tokenizer', file=sys.stderr)
        stride = max(1, round(total / TOKENIZER_SAMPLE)) if total else 1  # spread the sample over the corpus
        train_tokenizer(documents, stride, vocab, os.path.join(args.out_dir, spec['path']))
    elif kind == 'file':  # copied, so the folder is self-contained
        shutil.copyfile(tok, os.path.join(args.out_dir, spec['path']))
    else:
        spec = {'kind': 'tiktoken', 'name': tok}
    try:
        tokenizer = Tokenizer(spec, args.out_dir)
    except RuntimeError as e:
        raise UserError(f'{tok} is not a sentencepiece model ({str(e).strip().splitlines()[0]})')
    dtype = 'uint16' if tokenizer.vocab_size <= 65535 else 'uint32'

    counts, hashes = encode(args, documents, total, spec, dtype, pairs)
    if counts['train_docs'] == 0:
        raise UserError(f"no training documents: all {counts['val_docs']} went to val (split by a hash of each "
                        "file's path); give more files")
    spec = {'kind': 'sentencepiece', 'path': 'tokenizer.model'} if kind != 'tiktoken' else spec
    produced = list(OUTPUTS[:4]) + ['tokenizer.model'] * (kind != 'tiktoken') + list(OUTPUTS[5:]) * bool(pairs)
    meta = {'dataset': args.dataset, 'vocab_size': tokenizer.vocab_size, 'tokenizer': spec, 'bos_id': tokenizer.bos_id,
            'eos_id': tokenizer.eos_id, 'pad_id': tokenizer.pad_id, 'dtype': dtype, **counts,
            'source': {'description': about, **source, **hashes}, 'config': config, 'outputs': produced,
            'fingerprint': fingerprint}
    commit(args.out_dir, produced, meta)
    pair_note = f", pairs {counts['n_pairs_train']:,}/{counts['n_pairs_val']:,}" if pairs else ''
    print(f"{args.out_dir}: train {counts['train_tokens']:,} tokens in {counts['train_docs']:,} docs, val "
          f"{counts['val_tokens']:,} tokens in {counts['val_docs']:,} docs{pair_note} ({hashes['files']:,} files, "
          f"{time.time() - t0:.1f}s)")


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UserError(message)


def parse_args(argv):
    datasets = '\n'.join(f'  {name:<22}{about}' for name, (about, *_) in DATASETS.items())
    p = Parser(description='Tokenize a dataset into data/DATASET for nanomixer.', epilog=f'datasets:\n{datasets}',
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('dataset', nargs='?', default='pystdlib', help='which corpus (default pystdlib; see below)')
    p.add_argument('--out_dir', help='output folder (default data/DATASET)')
    p.add_argument('--vocab_size', type=int, help='BPE vocabulary to train (default 4096; fineweb-edu, finemath 8000)')
    p.add_argument('--tokenizer', help='reuse PATH.model (sentencepiece) or a tiktoken encoding: gpt2, cl100k_base')
    p.add_argument('--input', action='append', help='text dataset: a file, folder or glob (repeatable)')
    p.add_argument('--pairs', help='retrieval pairs: docstring (pystdlib, text) or ict (any dataset)')
    p.add_argument('--max_docs', type=int, help='keep the first N training documents (the paper: 2000000 stories)')
    p.add_argument('--max_tokens', type=int, help='stop once the training split holds N tokens')
    p.add_argument('--hub_url', default=os.environ.get('HF_ENDPOINT', 'https://huggingface.co').rstrip('/'),
                   help='Hugging Face hub endpoint (default $HF_ENDPOINT or https://huggingface.co)')
    p.add_argument('--download_dir', default=os.path.join('data', 'downloads'),
                   help='hub files go here; put them here yourself for an offline run (default data/downloads)')
    args = p.parse_args(argv)
    if args.dataset not in DATASETS:
        raise UserError(f"unknown dataset {args.dataset!r}; known: {', '.join(DATASETS)}")
    if (args.dataset == 'text') != bool(args.input):
        raise UserError('the text dataset needs --input' if args.input is None else '--input is for the text dataset')
    code = args.dataset in ('pystdlib', 'text')
    if args.pairs not in (None, 'docstring', 'ict') or args.pairs == 'docstring' and not code:
        raise UserError(f'--pairs={args.pairs} is not available for {args.dataset}: docstring (pystdlib, text) or ict')
    if args.tokenizer and args.vocab_size:
        raise UserError('--vocab_size applies when training a tokenizer, not with --tokenizer')
    if any(v is not None and v <= 0 for v in (args.vocab_size, args.max_docs, args.max_tokens)):
        raise UserError('--vocab_size, --max_docs and --max_tokens must be positive')
    args.out_dir = args.out_dir or os.path.join('data', args.dataset)
    return args


def main(argv=None):
    try:
        prepare(parse_args(argv))
        return 0
    except UserError as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code or 0


if __name__ == '__main__':
    sys.exit(main())
