"""The command line of every script, as nanoGPT's configurator.py: defaults, then presets (bare
words: files of `key = value` lines) and --key=value flags in order, each typed like its default
(a preset may not undo a flag before it); and the boundaries: bad input is one `error:` line and
status 2, files are written whole or not."""
import ast, contextlib, difflib, os, sys, tempfile, time
from pathlib import Path

BOOLS = {'true': True, '1': True, 'yes': True, 'false': False, '0': False, 'no': False}


def parse_args(argv, defaults, doc, choices=None, positional=None, modes=None):
    """argv -> {key: value}. A leading bare word sets the key `positional` (bench.py MODE,
    prepare.py DATASET) and brings its own defaults, modes[word]."""
    args = list(sys.argv[1:] if argv is None else argv)
    if positional and args and not args[0].startswith('-') and not args[0].endswith('.py'):
        defaults = {**defaults, **(modes or {}).get(args[0], {}), positional: args.pop(0)}
    cfg, flagged = dict(defaults), set()  # flagged: keys set by a --flag so far
    while args:
        arg = args.pop(0)
        if arg in ('-h', '--help'):
            print(doc, help_text(cfg, sys._getframe(1).f_globals['__file__']), sep='\n')
            raise SystemExit(0)
        if positional and arg in (choices or {}).get(positional, ()):
            raise ValueError(f"{arg} is the {positional}: write it first, before the flags")
        if not arg.startswith('--'):
            preset = read_preset(arg, cfg)
            late = ', '.join(f'--{k}' for k in sorted(flagged & preset.keys()))
            if late:  # in order, it would silently undo what was typed
                raise ValueError(f"{arg} sets {late}, given before it: put the preset first")
            try:
                cfg.update({k: typed(k, v, defaults) for k, v in preset.items()})
            except ValueError as e:  # the key is the file's, not one typed on the command line
                raise ValueError(f"{arg}: {e}") from None
            continue
        key, eq, value = arg[2:].partition('=')
        key = key.replace('-', '_')
        if not eq and key in defaults:  # --key value, or a bare --flag for a boolean
            flag = isinstance(defaults[key], bool) and not (args and args[0].lower() in BOOLS)
            assert flag or args and not args[0].startswith('--'), \
                f"--{key} needs a value: write --{key}=VALUE"
            value = 'true' if flag else args.pop(0)
        cfg[key] = typed(key, value, defaults)
        flagged.add(key)
    for key, allowed in (choices or {}).items():  # of the keys this script has
        if key in cfg and cfg[key] not in allowed:
            raise ValueError(f"--{key}={cfg[key]!r} is not one of "
                             f"{', '.join(a or repr(a) for a in allowed)}")
    return cfg


def typed(key, value, defaults):
    """value (a flag's text or a preset's Python value) as the type of the key's default; a None
    default is an optional boolean, and auto (None) lets the script choose."""
    if key not in defaults:
        close = ', '.join('--' + c for c in difflib.get_close_matches(key, defaults, n=3))
        raise ValueError(f"unknown key --{key}: " + (f"did you mean {close}?" if close else
                                                     "see --help"))
    default = defaults[key]
    # argv's bytes that are not UTF-8 reach Python as lone surrogates, which no tokenizer takes
    if isinstance(value, str) and any('\udc80' <= c <= '\udcff' for c in value):
        raise ValueError(f"--{key}: its text is not UTF-8: set a UTF-8 locale, or use a UTF-8 file")
    if default is None and str(value).lower() in ('auto', 'none'):
        return None
    kind = bool if default is None else type(default)
    if isinstance(value, str) and kind is not str or (kind, type(value)) == (float, int):
        with contextlib.suppress(KeyError, ValueError):  # left as it was: refused below
            value = BOOLS[value.lower()] if kind is bool else kind(value)
    if type(value) is not kind:
        like = 'true, false or auto' if default is None else repr(default)
        raise ValueError(f"--{key}={value!r} is not of {kind.__name__} type, like {like}")
    return value


def read_preset(path, cfg):
    """A preset's `key = value` lines as a dict; a value may use earlier keys (n_ctx * 2)."""
    if path.endswith('.pt'):  # python sample.py out/ckpt.pt
        raise ValueError(f"{path} is a checkpoint, not a preset: pass it as --ckpt={path}")
    if ('=' in path or path[:1] == '-') and not os.path.exists(path):  # max_iters=3, -max_iters
        raise ValueError(f"{path} is no preset file: a flag is written --{path.lstrip('-')}")
    if not path.endswith('.py') and not os.path.exists(path):  # --n_ctx=128 256, --prompt a b
        raise ValueError(f"{path!r} stands alone: a list takes commas (--n_ctx=128,256), a text "
                         f"with spaces quotes (--prompt='def main'); a preset is a .py file")
    try:
        tree = ast.parse(read_text_file(path, 'preset file (see config/)'), path)
    except SyntaxError as e:
        raise ValueError(f"{path}:{e.lineno}: {e.msg}") from None
    scope, out = dict(cfg), {}
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring (a comparison, such as key == value, is no assignment)
        if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)):
            raise ValueError(f"{path}:{node.lineno}: a preset holds only `key = value` lines")
        try:
            value = eval(compile(ast.Expression(node.value), path, 'eval'), {}, scope)
        except Exception as e:
            raise ValueError(f"{path}:{node.lineno}: {type(e).__name__}: {e}") from None
        scope[node.targets[0].id] = out[node.targets[0].id] = value
    return out


def help_text(values, script):
    """A line per key: --key=value (the default, or a preset's) and the comment beside its
    `dict(...)` keyword or dataclass field in the script, train.py or model.py, one beside this
    very value first (a mode's)."""
    here, notes = os.path.dirname(os.path.abspath(__file__)), {}
    for path in (script, os.path.join(here, 'train.py'), os.path.join(here, 'model.py')):
        lines = Path(path).read_text(encoding='utf-8').splitlines()
        for node in ast.walk(ast.parse('\n'.join(lines))):
            pairs = []  # (key, value source) of a dict(...) keyword or a dataclass field
            if isinstance(node, ast.Call) and getattr(node.func, 'id', '') == 'dict':
                pairs = [(k.arg, k.value) for k in node.keywords if k.arg]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                pairs = [(node.target.id, node.value or node)]
            for key, value in pairs:
                end = value.end_lineno
                note = lines[end - 1].partition('  # ')[2]
                while note and end < len(lines) and lines[end].lstrip().startswith('# '):
                    note, end = note + ' ' + lines[end].lstrip()[2:], end + 1  # continued
                if note:  # with the value's source: a literal's is its default's repr
                    notes.setdefault(key, []).append((ast.unparse(value), note))
    keys = [f"  --{key}={value!r}".ljust(30) + '  ' + next(
        (n for v, n in notes.get(key, []) if v == repr(value)), notes.get(key, [(0, '')])[0][1])
        for key, value in values.items()]
    return '\n'.join(['keys and defaults:'] + [line.rstrip() for line in keys])


def int_list(text, key, low=1):
    """--key=32,64,128 -> [32, 64, 128], each >= low."""
    with contextlib.suppress(ValueError):
        values = [int(v) for v in str(text).split(',')]
        if min(values) >= low:
            return values
    raise ValueError(f"--{key}={text!r}: give comma-separated integers >= {low}")


def read_text_file(path, what):
    """A UTF-8 text file's contents, without a byte-order mark; missing or not UTF-8: a one-line
    error naming it."""
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path} {'is a folder' if os.path.isdir(path) else 'not found'}")
    try:
        return Path(path).read_text(encoding='utf-8-sig')
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {e.start}): save it as UTF-8, "
                         f"e.g. iconv -f latin1 -t utf-8") from None


def write_atomic(path, data):
    """str, bytes or what data(f) writes, into a temp file renamed into place: a crash or a full
    disk leaves the old file whole, and a failed write is one line naming the file."""
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
    except (OSError, RuntimeError) as e:  # torch.save wraps the OSError in a RuntimeError
        cause = e if isinstance(e, OSError) else e.__context__
        if not isinstance(cause, OSError):
            raise
        raise ValueError(f"cannot write {path} ({cause.strerror or cause}): the old file is "
                         f"kept; free some space or pass another location") from None
    finally:
        Path(tmp).unlink(missing_ok=True)


def check_out_dir(out_dir, flag='out_dir'):
    """Fail before any work if the folder cannot be created or written."""
    if os.path.isfile(out_dir):
        raise ValueError(f"{out_dir} is a file, not a folder: pass another --{flag}")
    try:
        os.makedirs(out_dir, exist_ok=True)
        tempfile.TemporaryFile(dir=out_dir).close()
    except OSError as e:  # (the folder of an output file's flag, or the flag's own folder)
        raise ValueError(f"cannot write to the folder {out_dir} ({e.strerror or e}): pass a "
                         f"--{flag} where one can write") from None


def check_output_file(path, flag, overwrite=False):
    """Fail before the work that fills an output file if it cannot be written, or would replace a
    file unasked (overwrite: it may)."""
    if os.path.isdir(path) or path.endswith(os.sep):
        raise ValueError(f"--{flag}={path} is a folder: name a file")
    if os.path.exists(path) and not overwrite:
        raise ValueError(f"--{flag}={path} exists: replace it with --overwrite, or name another")
    check_out_dir(os.path.dirname(path) or '.', flag)


def run_main(body, interrupted='interrupted'):
    """Every main(): bad input, or too little memory, is one `error:` line, status 2; Ctrl-C
    prints `interrupted`, 130."""
    try:
        return body() or 0
    except (ValueError, AssertionError, MemoryError, RuntimeError) as e:
        oom = isinstance(e, MemoryError) or 'memory' in str(e) and 'allocate' in str(e)
        if isinstance(e, RuntimeError) and not oom:  # torch's other errors keep their traceback
            raise
        if os.environ.get('RANK', '0') == '0':
            fix = ": lower --batch_size, --n_ctx or the model's size" if oom else ''
            print(f"error: {str(e) or ('out of memory' if oom else repr(e))}{fix}", file=sys.stderr)
        else:  # every rank refuses alike: rank 0 says it before torchrun stops the others
            time.sleep(1)
        return 2
    except KeyboardInterrupt:
        if os.environ.get('RANK', '0') == '0':  # Ctrl-C reaches every rank: rank 0 says it
            print(interrupted, file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (| head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
