"""
Prepare a corpus for nanomixer: token streams, document offsets, a tokenizer and retrieval pairs.

    python prepare.py                                 # this interpreter's standard library, offline
    python prepare.py tinystories --max_docs=2000000  # the paper's TinyStories setup
    python prepare.py text --input='notes/*.md' --pairs=ict   # your own files

Writes to --out_dir (default data/DATASET): train.bin and val.bin (raw uint16/uint32 token ids,
every document wrapped in BOS ... EOS), train_docs.npy and val_docs.npy (int64 start offset of each
document), tokenizer.model, pairs_train.jsonl and pairs_val.jsonl ({"query", "target"} per line)
when the dataset has pairs, and meta.json. Files are written under .tmp names and renamed when
complete; meta.json goes last and holds a fingerprint of the inputs and options, so an unchanged
rerun does nothing.
"""
import ast, codecs, collections, difflib, glob, hashlib, io, json, math, multiprocessing, os
import platform, re, shutil, socket, sys, sysconfig, textwrap, time
from itertools import chain, islice
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

# ------------------------------------------------------------------------ command lines and files
# Every script's command line and file safety; it knows no script's keys (each checks its own).

def parse_args(argv, defaults, choices=None, doc=None, positional=None, modes=None):
    """nanoGPT's configurator: defaults, then presets (bare words) and --key=value in argv order,
    each typed like its default. A leading bare word sets `positional` (a script's mode), whose own
    defaults `modes[mode]` then apply. --help prints doc and every key with its comment."""
    cfg, args = dict(defaults), list(sys.argv[1:] if argv is None else argv)
    if positional and args and not args[0].startswith('-') and not args[0].endswith('.py'):
        defaults = dict(defaults, **(modes or {}).get(args[0], {}))
        cfg = dict(defaults, **{positional: args.pop(0)})
    while args:
        arg = args.pop(0)
        if arg in ('-h', '--help'):
            script = sys._getframe(1).f_globals.get('__file__') or __file__  # (the caller's file)
            print(doc or sys.modules['__main__'].__doc__, help_text(defaults, script), sep='\n')
            raise SystemExit(0)
        if not arg.startswith('--'):
            cfg.update({k: typed(k, v, defaults, arg) for k, v in read_preset(arg, cfg).items()})
            continue
        key, eq, value = arg[2:].partition('=')
        key = key.replace('-', '_')
        if not eq:  # --key value, or a bare --flag for booleans
            given = bool(args) and not args[0].startswith('--')
            if not given and not isinstance(defaults.get(key), bool):
                raise ValueError(f"--{key} needs a value: write --{key}=VALUE")
            value = args.pop(0) if given else 'true'
        cfg[key] = typed(key, value, defaults, 'the command line')
    for key, allowed in (choices or {}).items():
        if cfg[key] not in allowed:
            raise ValueError(f"--{key}={cfg[key]!r} is invalid: use one of {', '.join(allowed)}")
    return cfg


def help_text(defaults, script):
    """`--key=default  comment` per key, the comment beside `key=value` (or `key: type = value`)
    in script's source, else in those of the modules it imports from this folder; a line whose
    value is this default first (a mode's sizes over another mode's)."""
    here = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.abspath(script)] + [os.path.join(here, f'{m}.py') for m in re.findall(
        r'^(?:from|import) (\w+)', Path(script).read_text(encoding='utf-8'), re.M)]
    notes = collections.defaultdict(list)  # key: [[its value's text, comment], ...] in files' order
    for path in filter(os.path.isfile, files):
        keys = []
        for line in Path(path).read_text(encoding='utf-8').splitlines():
            code, _, note = line.partition('# ')
            code = re.sub(r'(\w+)\s*:\s*\w+\s*=\s*', r'\1=', code).replace(' ', '')
            if code:
                pairs = re.findall(r'(?:^|[(,])(\w+)=(?!=)(.+?)(?=,\w+=|[,)]*$)', code)
                for key, text in pairs:
                    notes[key].append([text, note.strip()])
                keys = [key for key, _ in pairs] if note else []
            elif note and keys:  # the comment goes on on the next line
                for key in keys:
                    notes[key][-1][1] += ' ' + note.strip()
            else:
                keys = []
    lines = ['keys and defaults:']
    for key, value in defaults.items():
        found = [n for t, n in notes.get(key, []) if same(t, value)] + [n for _, n in notes[key]]
        lines.append(f'  --{key}={value!r}'.ljust(30) + '  ' + (found or [''])[0])
    return '\n'.join(line.rstrip() for line in lines)


def same(text, value):
    """Whether a default's source text (5e-4, 'out') spells this value."""
    try:
        return text == repr(value) or float(text) == value
    except ValueError:
        return False


def int_list(text, key, low=1):
    """--key=32,64,128 -> [32, 64, 128], each >= low."""
    try:
        values = [int(v) for v in str(text).split(',') if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < low:
        raise ValueError(f"--{key}={text!r}: give comma-separated integers >= {low}")
    return values


def read_preset(path, cfg):
    """A preset's `key = value` lines as a dict; values may use earlier keys (n_ctx * 2)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no preset file {path}: see config/ for the presets")
    try:
        tree = ast.parse(read_text_file(path, 'preset'), path)
    except SyntaxError as e:
        raise ValueError(f"{path}:{e.lineno}: {e.msg}") from None
    scope, out = dict(cfg), {}
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # docstring
        target = node.targets[0] if isinstance(node, ast.Assign) else None
        if len(getattr(node, 'targets', ())) != 1 or not isinstance(target, ast.Name):
            raise ValueError(f"{path}:{node.lineno}: presets hold only `key = value` lines")
        try:
            expr = compile(ast.Expression(node.value), path, 'eval')
            value = eval(expr, {'__builtins__': {}}, scope)
        except Exception as e:
            raise ValueError(f"{path}:{node.lineno}: {type(e).__name__}: {e}") from None
        scope[target.id] = out[target.id] = value
    return out


def typed(key, value, defaults, source):
    """value (a str from the command line, a Python value from a preset) as the default's type."""
    if key not in defaults:
        close = difflib.get_close_matches(key, defaults, n=3)
        hint = f"did you mean {', '.join('--' + c for c in close)}?" if close else "see --help"
        raise ValueError(f"unknown key --{key} in {source}: {hint}")
    if defaults[key] is None and (value is None or str(value).lower() in ('auto', 'none')):
        return None  # a None default is an optional bool: auto (None) lets the script choose
    kind = bool if defaults[key] is None else type(defaults[key])
    if isinstance(value, str) and kind is not str:
        words = {'true': True, '1': True, 'yes': True, 'false': False, '0': False, 'no': False}
        try:
            value = words[value.lower()] if kind is bool else kind(value)
        except (KeyError, ValueError):
            hint = "true, false, auto" if defaults[key] is None else f"default {defaults[key]!r}"
            raise ValueError(f"--{key}={value!r} is not a valid {kind.__name__} ({hint})") from None
    if kind is float and type(value) in (int, float):
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"--{key}={value!r} in {source} is not a finite number")
    if type(value) is not kind:
        raise ValueError(f"{key}={value!r} in {source} should be a {kind.__name__} "
                         f"like {defaults[key]!r}")
    if kind is int and not -2 ** 63 <= value < 2 ** 63:  # torch and numpy take 64-bit integers
        raise ValueError(f"--{key}={value} in {source} is out of range: it must lie within ±2**63")
    return value


def read_text_file(path, what):
    """A UTF-8 text file's contents; a missing or non-UTF-8 file is a one-line error naming it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path} not found")
    data = Path(path).read_bytes()
    try:
        return data.decode('utf-8')
    except UnicodeDecodeError as e:
        byte = f"byte {e.start} is {data[e.start]:#04x}"
        raise ValueError(f"{what} {path} is not UTF-8 text ({byte}): save it as UTF-8, "
                         f"e.g. iconv -f latin1 -t utf-8") from None


def write_atomic(path, data):
    """str, bytes or what data(f) writes, to a temp file renamed into place: a crash leaves the
    old file whole."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, 'wb') as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def check_out_dir(out_dir, flag='out_dir'):
    """Fail before any work if out_dir cannot be created or written."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        open(probe := os.path.join(out_dir, f'.write_test{os.getpid()}'), 'w').close()
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"cannot write to {flag} {out_dir} ({e.strerror or e}): "
                         f"pass a writable --{flag}") from None


def check_output_file(path, flag):
    """Fail before the work that fills an output file, not after it, if it cannot be written."""
    if os.path.isdir(path):
        raise ValueError(f"--{flag}={path} is a folder: name a file")
    probe = f"{path}.tmp{os.getpid()}"
    try:
        open(probe, 'w').close()
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"cannot write --{flag}={path} ({e.strerror or e}): "
                         f"name a file in a writable folder") from None


def run_main(body, interrupted='interrupted'):
    """Every script's main(): bad input prints one `error: ...` line and returns 2, Ctrl-C returns
    130 with `interrupted` (what survives and how to go on), --help returns 0."""
    try:
        return body() or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code or 0
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130


# ----------------------------------------------------------------------------- corpora

FORMAT = 1                   # bump when outputs change meaning, so older folders are rebuilt
TOKENIZER_SAMPLE = 32 << 20  # bytes of training text the BPE tokenizer learns from (about 5 s)
JOB_DOCS = 64                # documents per encoding job
EOT = '<|endoftext|>'        # a line holding only this separates documents (TinyStories, text)
SPLITS = ('train', 'val')
OUTPUTS = ('train.bin', 'val.bin', 'train_docs.npy', 'val_docs.npy', 'tokenizer.model',
           'pairs_train.jsonl', 'pairs_val.jsonl')
# name: (what it is, default vocabulary, share of documents sent to val by a hash of their key, or
# None where the dataset has its own validation file, default pairs)
DATASETS = {
    'pystdlib': ('Python standard library source of this interpreter (offline)', 4096, 0.05,
                 'docstring'),
    'tinystories': ('roneneldan/TinyStories, TinyStories-{train,valid}.txt', 4096, None, None),
    'tinystories-instruct': ('roneneldan/TinyStoriesInstruct stories; pairs Summary -> story', 4096,
                             None, 'summary'),
    'fineweb-edu': ('HuggingFaceFW/fineweb-edu, sample/10BT parquet shards', 8000, 0.005, None),
    'finemath': ('HuggingFaceTB/finemath, finemath-4plus parquet shards', 8000, 0.005, None),
    'text': ('local files, folders or globs given with --input', 4096, 0.05, None),
}
HUB = {  # dataset: (repo, {split: file} or the folder whose parquet shards are streamed in order)
    'tinystories': ('roneneldan/TinyStories',
                    {'val': 'TinyStories-valid.txt', 'train': 'TinyStories-train.txt'}),
    'tinystories-instruct': ('roneneldan/TinyStoriesInstruct',
                             {'val': 'TinyStories-Instruct-valid.txt',
                              'train': 'TinyStories-Instruct-train.txt'}),
    'fineweb-edu': ('HuggingFaceFW/fineweb-edu', 'sample/10BT'),
    'finemath': ('HuggingFaceTB/finemath', 'finemath-4plus'),
}
STDLIB_SKIP = {'site-packages', 'dist-packages', '__pycache__', 'test', 'tests', 'idle_test'}
# machine-made tables, not code: charmap codecs, the Sphinx topic dump, sysconfig's data
STDLIB_GENERATED = re.compile(rb'gencodec\.py|Autogenerated by Sphinx|system configuration gener')


class Tokenizer:
    """The vocabulary a data folder was prepared with (train.py, sample.py, retrieve.py use it)."""

    def __init__(self, spec, data_dir='.'):
        if spec['kind'] == 'tiktoken':
            import tiktoken
            name, names = spec['name'], tiktoken.list_encoding_names()
            if name not in names:
                raise ValueError(f"unknown tiktoken encoding {name!r}; known: {', '.join(names)}")
            try:
                self.enc = tiktoken.get_encoding(name)
            except Exception as e:  # the first use downloads the vocabulary
                raise ValueError(f"tiktoken could not fetch the {name!r} vocabulary "
                                 f"({type(e).__name__}): run once with network access (it is then "
                                 f"cached in $TIKTOKEN_CACHE_DIR) or use a .model file")
            self.vocab_size = self.enc.n_vocab
            self.bos_id = self.eos_id = self.pad_id = self.enc.eot_token  # GPT's one <|endoftext|>
        elif spec['kind'] != 'sentencepiece':
            raise ValueError(f"unknown tokenizer kind {spec['kind']!r}")
        else:
            path = os.path.join(data_dir, spec['path'])
            if not os.path.isfile(path):
                raise FileNotFoundError(f'tokenizer model {path} not found')
            self.enc, self.sp = None, spm.SentencePieceProcessor(model_file=path)
            self.vocab_size = self.sp.get_piece_size()
            self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()
            self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eos_id
            if min(self.bos_id, self.eos_id) < 0:
                raise ValueError(f'tokenizer model {path} has no BOS/EOS pieces')
            # no piece holds a line break, so lines encode independently (1.5x faster)
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
        return cls.from_meta(json.loads(Path(path).read_text()), data_dir)

    def encode(self, text, bos=False, eos=False):
        if self.enc:
            ids = self.enc.encode_ordinary(text)  # text that looks like a special token stays text
        elif self.by_line:
            ids = list(chain.from_iterable(self.sp.encode(text.splitlines(True))))
        else:
            ids = self.sp.encode(text)
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def encode_batch(self, texts):
        texts = list(texts)
        return self.enc.encode_ordinary_batch(texts) if self.enc else self.sp.encode(texts)

    def decode(self, ids):
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[~np.isin(ids, self.specials)].tolist()
        return self.enc.decode(ids) if self.enc else self.sp.decode(ids)


# ----------------------------------------------------------------------------- documents
# A reader returns (documents, inputs, total, source): documents() yields (split, key, text,
# summary) in a fixed order, inputs identify what was read (for the fingerprint), total is the size
# in bytes if known.

def split_of(key, val_share):
    """Deterministic train/val assignment by a hash of the document's key (a file's path)."""
    bucket = int(hashlib.md5(key.encode()).hexdigest()[:8], 16) % 10000
    return 'val' if bucket < val_share * 10000 else 'train'


def count_replace(e):  # errors='replace', counted for the warning
    count_replace.runs += 1
    return '\ufffd', e.end


count_replace.runs, WARNED = 0, set()  # undecodable byte runs met so far; files warned about
codecs.register_error('count-replace', count_replace)


def eot_documents(path):
    """A text file's documents, cut at <|endoftext|> lines; bytes not UTF-8 become U+FFFD."""
    lines, replaced = [], count_replace.runs
    with open(path, encoding='utf-8', errors='count-replace') as f:
        for line in f:
            if line.strip() == EOT:
                yield ''.join(lines)
                lines = []
            else:
                lines.append(line)
    yield ''.join(lines)
    if (runs := count_replace.runs - replaced) and path not in WARNED:
        WARNED.add(path)
        tqdm.write(f'warning: {path} is not UTF-8 text: its {runs} undecodable byte run(s) became '
                   f'U+FFFD; convert it first (e.g. iconv -f latin1 -t utf-8) to keep them',
                   file=sys.stderr)


def visible_files(folder, skip=()):
    """Every file under folder, sorted; hidden files and folders (and those in skip) left out."""
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith('.') and d not in skip)
        files += [os.path.join(root, n) for n in sorted(names) if not n.startswith('.')]
    return files


def stdlib_files():
    """The standard library's modules, sorted; test suites and generated tables are left out."""
    root = sysconfig.get_paths()['stdlib']
    files = [f for f in visible_files(root, STDLIB_SKIP)
             if f.endswith('.py') and not STDLIB_GENERATED.search(open(f, 'rb').read(400))]
    return root, sorted(os.path.relpath(f, root).replace(os.sep, '/') for f in files)


def text_files(patterns, out_dir):
    """--input's files as (the folder they share, paths within it); out_dir's (earlier outputs)
    left out."""
    files = []
    for pattern in patterns:
        is_glob = any(c in pattern for c in '*?[')
        matches = sorted(glob.glob(pattern, recursive=True)) if is_glob else [pattern]
        if not matches or not all(map(os.path.exists, matches)):
            raise ValueError(f'--input {pattern!r} matches no files')
        for m in matches:
            files += visible_files(m) if os.path.isdir(m) else [m]
    out_dir = os.path.abspath(out_dir)
    files = [f for f in map(os.path.abspath, dict.fromkeys(files))
             if os.path.commonpath([f, out_dir]) != out_dir]
    if not files:
        raise ValueError(f"--input {' '.join(patterns)} holds no files (outside --out_dir "
                         f"{out_dir})")
    if unreadable := [f for f in files if not os.access(f, os.R_OK)]:
        raise ValueError(f'cannot read --input file {unreadable[0]}')
    root = os.path.commonpath([os.path.dirname(f) for f in files])
    return root, [os.path.relpath(f, root).replace(os.sep, '/') for f in files]


def local_documents(args, val_share):
    """pystdlib (one document per module) and text (files, cut at <|endoftext|> lines)."""
    if args.dataset == 'pystdlib':
        (root, rels), source = stdlib_files(), {'python': platform.python_version()}
    else:
        (root, rels), source = text_files(args.input, args.out_dir), {'input': args.input}
    stats = [(rel, st.st_size, st.st_mtime_ns)
             for rel in rels for st in [os.stat(os.path.join(root, rel))]]

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
    """Fail in seconds, not after the hub client's minute of retries, if the hub is unreachable."""
    u = urlsplit(url)
    try:
        port = u.port or (443 if u.scheme == 'https' else 80)
        socket.create_connection((u.hostname, port), timeout=5).close()
    except (OSError, ValueError) as e:
        raise ValueError(f'cannot reach {url} ({getattr(e, "strerror", None) or e}); {hint}')


def hub_download(args, repo, names):
    """Local paths of hub files: already in --download_dir, else downloaded there (resumable)."""
    local_dir = os.path.join(args.download_dir, repo.split('/')[1])
    paths = [os.path.join(local_dir, name) for name in names]
    missing = [(name, path) for name, path in zip(names, paths) if not os.path.isfile(path)]
    if missing:
        url = f'{args.hub_url}/datasets/{repo}/resolve/main'
        hint = 'for an offline run save ' + ' and '.join(f'{url}/{n} as {p}' for n, p in missing)
        check_online(args.hub_url, hint)
        from huggingface_hub import hf_hub_download
        for name, _ in missing:
            try:
                hf_hub_download(repo, name, repo_type='dataset', local_dir=local_dir,
                                endpoint=args.hub_url)
            except Exception as e:
                why = str(e).strip().splitlines()[0][:200]
                raise ValueError(f"downloading {name} failed ({type(e).__name__}: {why}); {hint}")
    return paths


def hub_shards(args, repo, folder):
    """The parquet shards of a hub folder, in order; offline, the ones already downloaded."""
    local = os.path.join(args.download_dir, repo.split('/')[1], folder)
    tree_url = f'{args.hub_url}/datasets/{repo}/tree/main/{folder}'
    hint = f'for an offline run download the .parquet files of {tree_url} into {local}/'
    try:
        check_online(args.hub_url, hint)
        from huggingface_hub import HfApi
        tree = HfApi(endpoint=args.hub_url).list_repo_tree(repo, path_in_repo=folder,
                                                           repo_type='dataset')
        names = sorted(f.path for f in tree if f.path.endswith('.parquet'))
    except Exception as e:
        found = glob.glob(os.path.join(glob.escape(local), '*.parquet'))
        names = sorted(f'{folder}/{os.path.basename(f)}' for f in found)
        if not names:  # (check_online's error already names the fix)
            raise e if isinstance(e, ValueError) else ValueError(
                f'listing {repo}/{folder} failed ({e}); {hint}')
        print(f'hub out of reach: using the {len(names)} shards already in {local}',
              file=sys.stderr)
    if not names:
        raise ValueError(f'no parquet files in {tree_url}')
    return names


INSTRUCT_FIELD = re.compile(r'^(Features|Words|Summary|Random sentence|Story):[ \t]*', re.M)


def hub_documents(args, val_share):
    """TinyStories files (val first: --max_docs, --max_tokens cut train only) or parquet shards."""
    repo, files = HUB[args.dataset]
    shards = []

    def documents():
        if isinstance(files, str):
            import pyarrow.parquet as pq
            shards[:] = shards or hub_shards(args, repo, files)
            for name in shards:  # streamed: a shard is downloaded when it is reached
                shard = pq.ParquetFile(hub_download(args, repo, [name])[0])
                batches = shard.iter_batches(1024, columns=['text'])
                texts = chain.from_iterable(b.column(0).to_pylist() for b in batches)
                for i, text in enumerate(texts):
                    if text and text.strip():
                        yield split_of(f'{name}#{i}', val_share), f'{name}#{i}', text, None
            return
        paths = hub_download(args, repo, list(files.values()))
        for (split, name), path in zip(files.items(), paths):
            for i, text in enumerate(eot_documents(path)):
                summary = None
                if args.dataset == 'tinystories-instruct':  # "Field: value" lines, the story last
                    parts = INSTRUCT_FIELD.split(text)
                    fields = dict(zip(parts[1::2], parts[2::2]))
                    text, summary = fields.get('Story', ''), fields.get('Summary', '').strip()
                if text.strip():
                    yield split, f'{name}#{i}', text.strip(), summary
    source = {'repo': repo, 'files' if isinstance(files, dict) else 'folder': files}
    return documents, [repo, files], None, source


# ----------------------------------------------------------------------------- retrieval pairs

def definitions(body):
    """Every def and class in a list of statements, nested ones included (not in expressions)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node
        for field in ('body', 'orelse', 'finalbody', 'handlers', 'cases'):
            yield from definitions(getattr(node, field, ()))


def docstring_pairs(source):
    """(its docstring's first paragraph, its source without docstrings) per documented def/class."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    raw = source.encode().splitlines(True)  # split where the parser splits; ast counts bytes
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
        code = b''.join(raw[i] for i in range(start, node.end_lineno) if i not in doc_lines)
        summary = ' '.join(ast.get_docstring(node).split('\n\n')[0].split())
        pairs.append((summary, textwrap.dedent(code.decode()).rstrip()))
    return pairs


SENTENCE_END = re.compile(r'(?<=[.!?])(\s+)')


def ict_pairs(text, key, size=6):
    """Inverse cloze: per passage of `size` sentences, one sentence -> the passage without it."""
    parts = SENTENCE_END.split(text.strip())
    sents, seps, pairs = parts[0::2], parts[1::2] + [''], []
    for i in range(0, len(sents), size):
        passage = range(i, min(i + size, len(sents)))
        picks = [j for j in passage if len(sents[j].split()) >= 4]  # a query of a few words
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


# ------------------------------------------------------------------------- tokenizer and encoding

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
    try:  # no sampling inside sentencepiece, fixed threads: the same model byte for byte every run
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines(), model_writer=model, model_type='bpe', vocab_size=vocab_size,
            hard_vocab_limit=False, byte_fallback=True, normalization_rule_name='identity',
            remove_extra_whitespaces=False, add_dummy_prefix=False,
            allow_whitespace_only_pieces=True, split_digits=True, character_coverage=0.9995,
            max_sentence_length=16384, input_sentence_size=0, unk_id=0, bos_id=1, eos_id=2,
            pad_id=3, num_threads=2, minloglevel=2)
    except RuntimeError as e:
        why = str(e).strip().splitlines()[0]
        if 'required_chars' in why:
            raise ValueError(f'--vocab_size={vocab_size} is too small for this corpus: it needs '
                             f'260 pieces plus one per distinct character; raise it') from None
        raise ValueError(f'tokenizer training failed: {why}')
    finally:
        bar.close()
    Path(path).write_bytes(model.getvalue())


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
    """fn over jobs, results in order; on a process pool when workers > 1, few jobs in flight."""
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
    jsonl = {s: open(path(f'pairs_{s}.jsonl'), 'w', encoding='utf-8') for s in SPLITS * bool(pairs)}
    starts, tokens = {s: [] for s in SPLITS}, dict.fromkeys(SPLITS, 0)
    n_pairs, content, files = dict.fromkeys(SPLITS, 0), hashlib.sha256(), set()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
    workers = 1 if total is not None and total < 4 << 20 else cores or 1  # pays off on big corpora
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
            if lines:
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
    counts = {f'{s}_tokens': tokens[s] for s in SPLITS}
    counts |= {f'{s}_docs': len(starts[s]) for s in SPLITS}
    if pairs:
        counts |= {'pairs': pairs} | {f'n_pairs_{s}': n_pairs[s] for s in SPLITS}
    file_list = hashlib.sha256('\n'.join(sorted(files)).encode()).hexdigest()
    return counts, {'files': len(files), 'file_list_sha256': file_list,
                    'content_sha256': content.hexdigest()}


# ----------------------------------------------------------------------------- main

def up_to_date(out_dir, fingerprint):
    """True when meta.json carries this fingerprint and every file it lists is complete."""
    try:
        meta = json.loads(Path(out_dir, 'meta.json').read_text())
        size, path = np.dtype(meta['dtype']).itemsize, lambda name: os.path.join(out_dir, name)
        return (meta['fingerprint'] == fingerprint
                and all(os.path.isfile(path(f)) for f in meta['outputs'])
                and all(os.path.getsize(path(f'{s}.bin')) == meta[f'{s}_tokens'] * size
                        for s in SPLITS))
    except (OSError, ValueError, KeyError):
        return False


def commit(out_dir, produced, meta):
    """Move finished .tmp files into place; meta.json last: it only describes a complete folder."""
    meta_path = os.path.join(out_dir, 'meta.json')
    Path(meta_path).unlink(missing_ok=True)
    for name in OUTPUTS:
        path = os.path.join(out_dir, name)
        if name in produced:
            os.replace(path + '.tmp', path)
        elif os.path.exists(path):  # left by a run with other options
            os.remove(path)
    write_atomic(meta_path, json.dumps(meta, indent=2) + '\n')


def carve(read, n_docs):
    """documents() for a corpus whose split by key left one split empty: its last tenth (at least
    one document) goes to val; a lone document is cut at the line (or character) nine tenths in."""
    n_val = min(max(1, round(n_docs / 10)), n_docs - 1)

    def documents():
        for i, (_, key, text, summary) in enumerate(islice(read(), n_docs)):
            if n_docs > 1:
                yield ('val' if i >= n_docs - n_val else 'train'), key, text, summary
                continue
            parts = text.splitlines(True)
            parts = parts if len(parts) >= 10 else list(text)
            cut = min(len(parts) - 1, round(len(parts) * 0.9))
            train, val = ''.join(parts[:cut]), ''.join(parts[cut:])
            if not (train.strip() and val.strip()):
                raise ValueError('the input is too small to hold out a validation split: '
                                 'give more text')
            yield 'train', key, train, summary
            yield 'val', f'{key}#val', val, summary
    return documents


def remove_tmp(out_dir):
    """The .tmp files of a run that was killed or stopped on bad input."""
    for name in OUTPUTS + ('meta.json',):
        if os.path.isfile(path := os.path.join(out_dir, name + '.tmp')):
            os.remove(path)


def prepare(args):
    t0 = time.time()
    about, default_vocab, val_share, default_pairs = DATASETS[args.dataset]
    pairs, tok = args.pairs or default_pairs, args.tokenizer
    reader = hub_documents if args.dataset in HUB else local_documents
    read, inputs, total, source = reader(args, val_share)
    check_out_dir(args.out_dir)

    def documents():  # the stream, cut after --max_docs training documents
        n_train = 0
        for doc in read():
            n_train += doc[0] == 'train'
            if args.max_docs and n_train > args.max_docs:
                return
            yield doc
    is_file = tok.endswith('.model') or os.path.isfile(tok)
    kind = 'train' if not tok else 'file' if is_file else 'tiktoken'
    if kind == 'file' and not os.path.isfile(tok):
        raise ValueError(f'--tokenizer file {tok} does not exist')
    keys = ('dataset', 'vocab_size', 'tokenizer', 'pairs', 'max_docs', 'max_tokens')
    config = {k: getattr(args, k) for k in keys}
    if kind == 'file':
        with open(tok, 'rb') as f:
            inputs = [inputs, hashlib.file_digest(f, 'sha256').hexdigest()]
    fingerprint = hashlib.sha256(json.dumps([FORMAT, config, inputs]).encode()).hexdigest()
    if up_to_date(args.out_dir, fingerprint):
        print(f'{args.out_dir} is up to date (same inputs and options): nothing to do')
        return
    splits, n_docs = set(), 0
    for split, *_ in documents():  # downloads happen, empty inputs fail before any work; the
        splits.add(split)          # whole corpus is read only if a split stays empty (small ones)
        n_docs += 1
        if len(splits) == 2:
            break
    if not n_docs:
        raise ValueError('no text in the input (it is empty)')
    if len(splits) == 1:
        documents = carve(documents, n_docs)
    remove_tmp(args.out_dir)  # a killed run's

    spec = {'kind': 'sentencepiece', 'path': 'tokenizer.model.tmp'}
    if kind == 'train':
        vocab = args.vocab_size or default_vocab
        print(f'training a {vocab}-piece BPE tokenizer', file=sys.stderr)
        stride = max(1, round(total / TOKENIZER_SAMPLE)) if total else 1  # a sample of it all
        train_tokenizer(documents, stride, vocab, os.path.join(args.out_dir, spec['path']))
    elif kind == 'file':  # copied, so the folder is self-contained
        shutil.copyfile(tok, os.path.join(args.out_dir, spec['path']))
    else:
        spec = {'kind': 'tiktoken', 'name': tok}
    try:
        tokenizer = Tokenizer(spec, args.out_dir)
    except RuntimeError as e:
        why = str(e).strip().splitlines()[0]
        raise ValueError(f'{tok} is not a sentencepiece model ({why})')
    dtype = 'uint16' if tokenizer.vocab_size <= 65535 else 'uint32'
    if kind == 'train' and tokenizer.vocab_size < vocab:
        print(f'warning: this corpus yields only {tokenizer.vocab_size:,} pieces, so the tokenizer '
              f'has that many, not --vocab_size={vocab}', file=sys.stderr)

    counts, hashes = encode(args, documents, total, spec, dtype, pairs)
    spec = {'kind': 'sentencepiece', 'path': 'tokenizer.model'} if kind != 'tiktoken' else spec
    produced = [*OUTPUTS[:4], *OUTPUTS[4:5] * (kind != 'tiktoken'), *OUTPUTS[5:] * bool(pairs)]
    meta = {'dataset': args.dataset, 'vocab_size': tokenizer.vocab_size, 'tokenizer': spec,
            'bos_id': tokenizer.bos_id, 'eos_id': tokenizer.eos_id, 'pad_id': tokenizer.pad_id,
            'dtype': dtype, **counts, 'source': {'description': about, **source, **hashes},
            'config': config, 'outputs': produced, 'fingerprint': fingerprint}
    commit(args.out_dir, produced, meta)
    pair_note = f", pairs {counts['n_pairs_train']:,}/{counts['n_pairs_val']:,}" if pairs else ''
    if len(splits) == 1:
        pair_note += '; val is the end of the corpus, as the split by path left one split empty'
    split_note = ', val '.join(f"{counts[f'{s}_tokens']:,} tokens in {counts[f'{s}_docs']:,} docs"
                               for s in SPLITS)
    print(f"{args.out_dir}: train {split_note}{pair_note} ({hashes['files']:,} files, "
          f"{time.time() - t0:.1f}s)")


DEFAULTS = dict(
    dataset='pystdlib',   # which corpus: see DATASETS (or --help)
    out_dir='',           # '' = data/DATASET
    vocab_size=0,         # BPE pieces; 0 = the dataset's (4096; fineweb-edu, finemath 8000)
    tokenizer='',         # reuse PATH.model (sentencepiece) or a tiktoken encoding (gpt2, ...)
    input='',             # text dataset: files, folders or globs, comma-separated
    pairs='',             # retrieval pairs: docstring (pystdlib, text) or ict; '' = the dataset's
    max_docs=0,           # keep the first N training documents (the paper: 2000000); 0 = all
    max_tokens=0,         # stop once the training split holds N tokens; 0 = no limit
    hub_url=os.environ.get('HF_ENDPOINT', 'https://huggingface.co').rstrip('/'),  # hub address
    download_dir=os.path.join('data', 'downloads'),  # hub files; put them here for an offline run
)


def prepare_args(argv):
    """prepare.py's settings as a namespace; every rule that spans two keys is checked here."""
    doc = __doc__ + 'datasets:\n' + '\n'.join(f'  {name:<22}{about}'
                                              for name, (about, *_) in DATASETS.items())
    cfg = parse_args(argv, DEFAULTS, dict(dataset=tuple(DATASETS)), doc, positional='dataset')
    args = SimpleNamespace(**cfg)
    args.input = [s for s in args.input.split(',') if s]
    if (args.dataset == 'text') != bool(args.input):
        raise ValueError('--input is for the text dataset' if args.input
                         else 'the text dataset needs --input')
    code = args.dataset in ('pystdlib', 'text')
    if args.pairs not in ('', 'docstring', 'ict') or args.pairs == 'docstring' and not code:
        raise ValueError(f'--pairs={args.pairs} is not available for {args.dataset}: '
                         f'docstring (pystdlib, text) or ict')
    if min(args.max_docs, args.max_tokens) < 0:
        raise ValueError('--max_docs and --max_tokens must be >= 0 (0 = no limit)')
    if args.tokenizer and args.vocab_size:
        raise ValueError('--vocab_size applies when training a tokenizer, not with --tokenizer')
    if args.vocab_size and not 261 <= args.vocab_size < 2 ** 31:
        raise ValueError(f'--vocab_size={args.vocab_size} is out of range: the tokenizer needs 260 '
                         f'pieces for bytes and special tokens plus one per distinct character; '
                         f'try 4096')
    args.out_dir = args.out_dir or os.path.join('data', args.dataset)
    return args


def main(argv=None):
    def body():
        args = prepare_args(argv)
        try:
            prepare(args)
        except (ValueError, FileNotFoundError):  # bad input found mid-way: leave no .tmp files
            remove_tmp(args.out_dir)
            raise
    return run_main(body, 'interrupted: nothing was replaced; run the same command again')


if __name__ == '__main__':
    sys.exit(main())
