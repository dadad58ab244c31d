"""The command line and the boundaries: presets and flags, --help, and the refusal table: every
mistake users make exits with status 2 and one `error:` line naming the culprit, no traceback,
every file left as it was."""
import os, re, shlex, subprocess, sys
from pathlib import Path

import pytest
import torch

import bench, configurator, prepare, retrieve, sample, train
from tests.conftest import HERE, BENCH_TINY, TINY, ENV, run_main, refused, make_ckpt


def test_parse_args_presets_and_overrides(tmp_path):
    """A preset is Python (later lines read earlier ones); --key=value overrides it, typed as the
    default."""
    preset = tmp_path / 'p.py'
    preset.write_text('"""doc"""\nn_ctx = 128  # comment\nbatch_size = 65536 // n_ctx\n'
                      'lr = 1\ncompile = True\n')
    cfg = configurator.parse_args([str(preset), '--lr=3e-4', '--compile=false', '--d_model=64'],
                                  train.DEFAULTS, '')
    assert (cfg['n_ctx'], cfg['batch_size'], cfg['lr'], cfg['compile'],
            cfg['d_model']) == (128, 512, 3e-4, False, 64)
    assert type(configurator.parse_args([str(preset)], train.DEFAULTS, '')['lr']) is float
    # a boolean reads alike in --key=value and --key value, in any case; bare, it is true
    for argv in (['--compile=False'], ['--compile', 'False'], ['--compile', 'NO']):
        assert configurator.parse_args([str(preset), *argv], train.DEFAULTS, '')['compile'] is False
    assert configurator.parse_args(['--compile', '--lr=1'], train.DEFAULTS, '')['compile'] is True
    assert configurator.parse_args(['--out_dir', 'o'], train.DEFAULTS, '')['out_dir'] == 'o'
    with pytest.raises(AssertionError, match='--out_dir needs a value'):  # not the next flag
        configurator.parse_args(['--out_dir', '--overwrite'], train.DEFAULTS, '')
    # a typo is answered with the key meant
    with pytest.raises(ValueError, match='--batch_size'):
        configurator.parse_args(['--batchsize=3'], train.DEFAULTS, '')
    with pytest.raises(ValueError, match='n_ctx'):
        configurator.parse_args(['--n_ctx=big'], train.DEFAULTS, '')
    with pytest.raises(ValueError, match='schedule'):
        configurator.parse_args(['--schedule=step'], train.DEFAULTS, '', train.CHOICES)
    share = [configurator.parse_args([f'--share_ffn={v}'], train.DEFAULTS, '')['share_ffn']
             for v in ('0', 'auto', 'None')]
    assert share == [False, None, None] and train.DEFAULTS['share_ffn'] is None  # as ModelConfig
    # auto is a value of its own for a key whose default is a string
    assert configurator.parse_args(['--device=auto'], train.DEFAULTS, '')['device'] == 'auto'
    with pytest.raises(ValueError, match='true, false or auto'):
        configurator.parse_args(['--share_ffn=maybe'], train.DEFAULTS, '')
    preset.write_text('n_ctx = undefined_name * 2\n')
    with pytest.raises(ValueError, match=r'p.py:1'):
        configurator.parse_args([str(preset)], train.DEFAULTS, '')
    preset.write_text('n_ctx = 64\nbatch_size = = 2\n')  # a syntax error: its line too
    with pytest.raises(ValueError, match=r'p.py:2: invalid syntax'):
        configurator.parse_args([str(preset)], train.DEFAULTS, '')
    # it types values; ranges are each script's (a key of one script means nothing to another)
    assert configurator.parse_args(['--batch_size=0', '--lr=-1'], dict(batch_size=4, lr=0.1),
                                   '') == dict(batch_size=0, lr=-1.0)


def help_text(capsys, *argv):
    """A script's --help text, and {key: its line, `--key=default  its comment`}."""
    code, out, _ = run_main(capsys, *argv)
    assert code == 0
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith('--')]
    return out, {line[2:].split('=')[0]: line for line in lines}


def test_help_shows_each_keys_default_and_comment_from_the_source(capsys):
    """Each key with its default and the comment beside it where the default is defined; a mode
    (bench.py memory, retrieve.py indirect) with its own defaults; after a preset, its values; the
    commands and datasets."""
    _, keys = help_text(capsys, 'train', '--help')
    assert 'context window' in keys['n_ctx']                    # ModelConfig's comment
    _, keys = help_text(capsys, 'train', os.path.join(HERE, 'config/demo.py'), '--help')
    assert keys['max_iters'].split()[0] == '--max_iters=800'   # config/demo.py's, not 5000
    assert 'sequences per micro-batch' in keys['batch_size']    # LOOP_DEFAULTS' comment
    assert 'packed: random windows' in keys['batch_mode']       # DEFAULTS' own
    _, keys = help_text(capsys, 'sample', '-h')
    assert 'nucleus sampling' in keys['top_p']
    _, keys = help_text(capsys, 'bench', 'memory', '--help')
    assert keys['d_model'].split()[0] == '--d_model=1024'
    assert keys['n_ctx'].split()[0] == "--n_ctx='512,1024,2048'"
    assert 'tokens of the prompt' in keys['prompt']             # a line holding two keys
    _, keys = help_text(capsys, 'bench', 'throughput', '--help')
    assert keys['d_model'].split()[0] == '--d_model=256'
    out, keys = help_text(capsys, 'retrieve', 'indirect', '--help')
    assert keys['batch_size'].startswith('--batch_size=64') and 'retrieval inputs' in out
    _, keys = help_text(capsys, 'retrieve', 'eval', '--help')
    assert 'texts per forward pass' in keys['batch_size']
    out, _ = help_text(capsys, 'retrieve', '--help')
    assert 'eval' in out and 'search' in out
    out, keys = help_text(capsys, 'prepare', '--help')
    assert 'max_tokens' in keys and all(name in out for name in prepare.DATASETS)
    assert 'throughput' in help_text(capsys, 'bench', '--help')[0]


def test_help_takes_the_note_beside_a_strings_value(capsys):
    """A key defined in several dict(...)s (out_dir: train's, indirect's) shows the note beside the
    value it has, a string's as its source spells it ('out-indirect')."""
    _, keys = help_text(capsys, 'retrieve', 'indirect', '--help')
    line = keys['out_dir']
    assert line.startswith("--out_dir='out-indirect'") and 'one run per c' in line


def test_help_joins_a_comment_continued_below_its_key(capsys):
    """A note continued on the indented `# ...` lines under its key is one line, whole."""
    _, keys = help_text(capsys, 'retrieve', 'eval', '--help')
    assert keys['pool'].endswith("mean: the mean of its tokens' states; '': the checkpoint's "
                                 "(else last)")


def test_check_output_file_takes_a_bare_name_and_refuses_a_folders(tmp_path, monkeypatch):
    """A bare file name is written in the current folder; a name ending in a separator is a folder,
    refused before any work, even where it does not exist yet."""
    monkeypatch.chdir(tmp_path)
    configurator.check_output_file('rows.json', 'json')
    with pytest.raises(ValueError, match='is a folder'):
        configurator.check_output_file(f'{tmp_path}/new{os.sep}', 'json')
    assert not (tmp_path / 'new').exists()


def test_out_of_memory_is_one_line_other_torch_errors_keep_their_traceback(capsys):
    """torch's allocators (CPU and CUDA) and Python's MemoryError end a script with one `error:`
    line naming the sizes to lower, status 2; any other RuntimeError is a bug: raised whole."""
    for e, says in ((RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to "
                                  "allocate 40000000000 bytes."), 'allocate 40000000000'),
                    (torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2 GiB'), 'CUDA'),
                    (MemoryError(), 'out of memory')):
        assert configurator.run_main(lambda: (_ for _ in ()).throw(e)) == 2
        err = capsys.readouterr().err
        assert err.startswith('error: ') and says in err and err.count('\n') == 1
        assert err.endswith(": lower --batch_size, --n_ctx or the model's size\n")
    with pytest.raises(RuntimeError, match='mat1 and mat2'):
        configurator.run_main(lambda: (_ for _ in ()).throw(RuntimeError('mat1 and mat2 shapes')))
    configurator.run_main(lambda: (_ for _ in ()).throw(AssertionError()))  # a library's bare one
    assert capsys.readouterr().err == 'error: AssertionError()\n'  # not called out of memory


TRAIN = ['--data_dir={data}', '--out_dir={tmp}/out', *TINY]
SAMPLE = ['--out_dir={trained}']
EVAL = ['eval', '--ckpt={mixer}', '--pairs={pairs}/pairs_val.jsonl']
OUT = '--out_dir={tmp}/out'
RESUME = ['--data_dir={data}', '--out_dir={trained}', *TINY, '--init_from=resume']


# (script, argv, culprit). Placeholders: {tmp} (the files of scratch() below), {data} (train's
# data), {trained} (a finished run), {mixer}, {ae} and {pairs} (retrieve's checkpoints and data)
REFUSALS = [
    # a key unknown (the key meant is named), a value mistyped, out of range or not a choice
    ('train', ['--max_iter=3'], '--max_iters'),
    *[('train', [*TRAIN, f'--{k}={v}'], f'--{k}={v}') for k, v in [
        ('max_iters', -1), ('eval_iters', 0), ('eval_interval', 0), ('log_interval', 0),
        ('grad_accum', 0), ('batch_size', 0), ('seed', -1), ('grad_clip', -1.0),
        ('warmup_iters', -1), ('lr', -1.0), ('min_lr', -0.001), ('weight_decay', -0.1)]],
    ('retrieve', ['train', '--init_from={mixer}', '--data_dir={pairs}', '--log_interval=0'],
     '--log_interval=0'),
    ('sample', [*SAMPLE, '--temperature=-1'], 'temperature'),
    ('sample', [*SAMPLE, '--num_samples=0'], 'num_samples'),
    *[('sample', [*SAMPLE, f'--{k}={v}'], k)
      for k, v in [('top_k', -1), ('top_p', 0), ('top_p', 2)]],
    ('sample', [*SAMPLE, '--method=beam'], 'beam'),
    ('sample', [*SAMPLE, '--device=gpu0'], 'gpu0'),
    ('sample', [*SAMPLE, '--compile', '--method=window'], 'compile'),
    ('sample', [*SAMPLE, '--max_new_tokens=-1'], 'max_new_tokens'),
    ('train', [*TRAIN, '--max_time=nan'], 'max_time'),
    ('train', [*TRAIN, '--padding=left'], 'batch_mode'),  # packed windows have no pads to place
    ('prepare', ['pystdlib', '--max_tokens=-1', OUT], 'max_tokens'),
    ('bench', ['--mode=race'], 'race'), ('bench', ['throughput', '--repeats=0'], 'repeats'),
    ('bench', ['represent', '--steps=0'], 'steps'),
    ('bench', ['--full', 'throughput'], 'throughput is the mode: write it first'),
    ('retrieve', [*EVAL, '--pool=max'], "'', last, mean"),
    ('retrieve', [*EVAL, '--padding=lfet'], 'lfet'),
    ('retrieve', ['search', '--ckpt={mixer}', '--docs={pairs}', '--query=x', '--k=0'], '--k'),
    ('prepare', ['wikipedia', OUT], 'wikipedia'),
    ('prepare', ['pystdlib', '--tokenizer=p50k_nope', OUT], 'p50k_nope'),
    ('prepare', ['tinystories', '--pairs=docstring', OUT], 'docstring'),
    ('prepare', ['tinystories', '--exclude=x', OUT], '--exclude'),  # files of a local corpus
    ('prepare', ['text', '--input={tmp}/ascii.txt', '--holdout=ascii.txt', OUT], '--pairs'),
    # < 260 + its 94 characters
    ('prepare', ['text', '--input={tmp}/ascii.txt', '--vocab_size=262', OUT], 'vocab_size'),
    ('retrieve', ['frobnicate'], 'frobnicate'), ('retrieve', [*EVAL, '--n=2,32'], '2,32'),
    ('retrieve', ['train', '--init_from={mixer}', '--data_dir={pairs}', '--negatives=hard'],
     'hard'),
    ('bench', ['sideways'], 'sideways'), ('bench', ['throughput', '--n_ctx=abc'], 'n_ctx'),
    ('bench', ['throughput', '--batch_size=1,16'], 'batch_size'),  # a list only in generate
    ('bench', ['throughput', '--archs=rnn'], 'rnn'),
    ('bench', ['race', '--archs=mixer,rnn'], "'rnn'"),
    ('bench', ['race', '--data_dir', 'data/x'], '--data_dir=data/x'),  # race routes --KEY=VALUE
    ('sample', ['--prompt=caf\udce9'], '--prompt: its text is not UTF-8'),  # a latin-1 terminal's
    ('bench', ['generate', *BENCH_TINY, '--prompt=12', '--new_tokens=8'], 'n_ctx'),
    ('bench', ['generate', *BENCH_TINY, '--prompt=4', '--new_tokens=1'], 'new_tokens'),
    ('bench', ['generate', *BENCH_TINY, '--prompt=0', '--new_tokens=4'], 'prompt'),
    ('bench', ['represent', '--ckpt={trained}/ckpt.pt', '--layer=3'], 'layer'),
    # each script's own ranges (the command-line layer knows none)
    ('train', ['--data_dir=/nonexistent', '--max_time=-1'], 'max_time'),
    # a required flag missing, or two that exclude each other
    ('prepare', ['text', OUT], 'input'), ('prepare', ['pystdlib', '--input=x.txt', OUT], 'input'),
    ('retrieve', [*EVAL[:2]], 'pairs'),
    ('retrieve', [*EVAL, '--batch_size=0'], 'batch_size=0'),
    ('retrieve', ['eval', '--pairs={pairs}/pairs_val.jsonl'], 'ckpt'),
    ('retrieve', ['train', '--data_dir={pairs}'], 'init_from'),
    # --data_dir, when given, is read, not the pairs of the checkpoint's data
    *[('retrieve', [cmd, key, '--data_dir={tmp}/empty', '--out_dir={tmp}/fit', '--max_iters=1'],
       '{tmp}/empty/pairs_train.jsonl') for cmd, key in [('train', '--init_from={mixer}'),
                                                         ('indirect', '--ckpt={mixer}')]],
    ('retrieve', ['search', '--ckpt={mixer}', '--docs={pairs}/pairs_val.jsonl'], 'query'),
    ('retrieve', ['search', '--ckpt={mixer}', '--docs={pairs}/pairs_val.jsonl', '--query= '],
     'query'),  # blank
    ('retrieve', ['train', '--init_from={mixer}', '--data_dir={pairs}', '--negatives=paper',
                  '--symmetric=True'], 'symmetric'),
    # input files: missing, empty, unreadable, or not what they should be
    ('train', ['--data_dir={tmp}/nope', OUT], '{tmp}/nope'),
    ('train', ['--data_dir={tmp}', OUT], '--out_dir=data/NAME'),  # not into the user's own files
    ('train', ['--data_dir={tmp}/ascii.txt', OUT], '--out_dir=data/NAME'),  # nor onto their text
    # a preset's folder (there or not) is where its prepare command writes
    ('train', ['--data_dir={tmp}/pystdlib', OUT], 'prepare.py pystdlib --out_dir={tmp}/pystdlib'),
    ('train', ['--data_dir={data}', '--out_dir={tmp}/none', '--init_from=resume'], '{tmp}/none'),
    ('train', ['{tmp}/notpreset.py'], 'notpreset.py'),  # a preset holds assignments only
    ('train', ['{tmp}/compare.py'], 'compare.py:2'),  # == for =: not silently skipped
    ('train', ['{tmp}/typo.py'], 'typo.py: unknown key --max_iter: did you mean --max_iters'),
    ('train', ['{tmp}/badvalue.py'], "badvalue.py: --max_iters='many' is not of int type"),
    ('sample', ['{tmp}/cut/ckpt.pt'], '--ckpt={tmp}/cut/ckpt.pt'),  # a checkpoint as a preset
    ('train', ['--overwite'], 'did you mean --overwrite'),  # a flag's typo, not "needs a value"
    ('train', ['-max_iters=3'], 'a flag is written --max_iters=3'),  # not "preset not found"
    ('train', ['-q'], '-q is no preset file: a flag is written --q'),
    ('bench', ['throughput', '--n_ctx=128', '256'], "'256' stands alone: a list takes commas"),
    ('sample', ['--prompt', 'def', 'main'], "'main' stands alone"),  # unquoted text
    # in order, a preset would undo the flag typed before it: refused, not silently applied
    ('train', ['--n_layers=3', '{tmp}/small.py'], 'small.py sets --n_layers, given before it'),
    ('train', [*TRAIN, '--max_time=inf', '--max_iters=0'], 'max_time'),  # it would never end
    ('train', [*TRAIN, '--max_iters=0'], 'no budget'),
    ('bench', ['memory', '--mem_limit=-5'], 'mem_limit'),
    ('bench', ['generate', *BENCH_TINY, '--methods=cache,windw'], 'windw'),  # before any cell
    *[('bench', ['race', '--data_dir={data}', '--out_dir={tmp}/race', '--max_time=1', arg], key)
      for arg, key in [('--llama.n_heads=3', 'n_heads=3'), ('--eval_iters=0', 'eval_iters'),
                       ('--max_iters=5', '--max_iters=5: the race sets it for every run'),
                       ('--max-iters=5', '--max-iters=5: the race sets it'),
                       ('--mixer.max_time=5', '--max_time=5: the race sets it'),
                       ('--gpt.n_heads=2', 'gpt is not in --archs=mixer,llama')]],
    ('train', ['--out_dir={trained}', '{tmp}/latin1.txt'], 'latin1.txt'),
    ('sample', ['--out_dir={tmp}/none'], '{tmp}/none'),
    ('sample', ['--out_dir={tmp}/file'], '{tmp}/file is a file'),  # not "no {tmp}/file/ckpt.pt"
    ('sample', ['--ckpt={tmp}/cut/ckpt.pt'], '{tmp}/cut/ckpt.pt'),
    ('sample', ['--ckpt={tmp}/retrieval.pt'], 'retrieval'),
    ('sample', ['--ckpt={ae}'], 'autoencoder'),
    ('sample', ['--ckpt={tmp}/n1.pt'], 'n_ctx=1'),
    ('sample', [*SAMPLE, '--prompt=FILE:/nonexistent/p.txt'], '/nonexistent/p.txt'),
    ('sample', [*SAMPLE, '--prompt=FILE:{tmp}/latin1.txt'], 'latin1.txt'),
    ('sample', ['--ckpt={tmp}/moved.pt'], '{tmp}/moved/tokenizer.model'),
    ('sample', ['--ckpt={tmp}/gone.pt'], '{tmp}/gone'),
    ('sample', ['--ckpt={tmp}/vocab999.pt'], '999'),
    ('prepare', ['text', '--input=does/not/exist', OUT], 'does/not/exist'),
    ('prepare', ['text', '--input={tmp}/empty', OUT], '{tmp}/empty'),
    ('prepare', ['text', '--input={tmp}/blank.txt', OUT], 'empty'),
    ('prepare', ['text', '--input={tmp}/ascii.txt', '--vocab_size=2', OUT], '--vocab_size=2'),
    ('prepare', ['text', '--input={tmp}/ascii.txt', '--vocab_size=300', '--tokenizer=gpt2', OUT],
     '--vocab_size'),
    ('prepare', ['pystdlib', '--tokenizer=missing.model', OUT], 'missing.model'),
    ('prepare', ['pystdlib', '--tokenizer={tmp}/blank.txt', OUT], 'blank.txt'),
    ('retrieve', ['search', '--ckpt={mixer}', '--docs={tmp}/ascii.txt', '--query=x',
                  '--index={tmp}/file'], 'not a readable search index'),
    ('retrieve', ['search', '--ckpt={mixer}', '--docs={tmp}/ascii.txt', '--query=x',
                  '--index={mixer}'], 'not a readable search index'),  # never "delete" a ckpt
    ('retrieve', ['eval', '--ckpt={mixer}', '--pairs={tmp}/none.jsonl'], 'none.jsonl'),
    ('retrieve', ['eval', '--ckpt={mixer}', '--pairs={tmp}/bad.jsonl'], 'bad.jsonl:3'),
    ('retrieve', ['eval', '--ckpt={mixer}', '--pairs={tmp}/latin1.jsonl'], 'latin1.jsonl'),
    ('retrieve', ['eval', '--ckpt={tmp}/none.pt', '--pairs={pairs}/pairs_val.jsonl'], 'none.pt'),
    ('retrieve', ['eval', '--ckpt={tmp}/cut/ckpt.pt', '--pairs={pairs}/pairs_val.jsonl'],
     '{tmp}/cut/ckpt.pt'),
    ('retrieve', ['eval', '--ckpt={tmp}/indirect.pt', '--pairs={pairs}/pairs_val.jsonl'],
     'indirect'),
    ('retrieve', ['search', '--ckpt={mixer}', '--docs={tmp}/missing', '--query=x'], 'missing'),
    ('bench', ['race', '--data_dir={tmp}/nope'], '{tmp}/nope'),
    ('bench', ['represent', '--ckpt={tmp}/nope.pt'], 'nope.pt'),
    ('bench', ['represent', '--ckpt={trained}/ckpt.pt', '--data_dir={tmp}'], '{tmp}'),
    ('bench', ['represent', '--ckpt={mixer}', '--data_dir={data}'], 'tokenized otherwise'),
    # a resume that cannot continue: a model flag against its checkpoint, a cut or foreign one
    *[('train', [*RESUME, arg], arg[2:].split('=')[0]) for arg in ['--arch=llama', '--n_ctx=16']],
    ('train', ['--data_dir={data}', '--out_dir={tmp}/cut', *TINY, '--init_from=resume'], 'ckpt.pt'),
    ('train', ['--out_dir={tmp}/nce', '--init_from=resume'],
     "of kind 'retrieval', not one of train.py's: use another --out_dir, or replace it: "
     "--init_from=scratch --overwrite"),
    ('retrieve', ['train', '--init_from=resume', '--data_dir={pairs}', '--out_dir={trained}'],
     "of kind 'lm', not one of retrieve.py train's: use another --out_dir, or replace it: "
     "--init_from=CKPT --overwrite"),
    # a finished run, replaced only when asked: the refusal names the flag to continue or replace it
    ('train', ['--data_dir={data}', '--out_dir={trained}', *TINY], '--init_from=resume'),
    ('retrieve', ['train', '--init_from={mixer}', '--data_dir={pairs}', '--out_dir={tmp}/run'],
     '--overwrite'),
    # stopped before its first checkpoint: nothing to resume, so no advice to
    ('retrieve', ['train', '--init_from={mixer}', '--data_dir={pairs}', '--out_dir={tmp}/log'],
     '(log.jsonl): replace it with --overwrite'),
    ('retrieve', ['indirect', '--ckpt={mixer}', '--data_dir={pairs}', '--out_dir={tmp}/run',
                  '--c=4'], '--overwrite'),
    # output locations, checked before the work that fills them ({tmp}/file is a file)
    ('train', ['--data_dir={data}', '--out_dir={tmp}/file/out', *TINY], '{tmp}/file'),
    ('train', ['--data_dir={data}', '--out_dir={tmp}/file', *TINY], '{tmp}/file is a file'),
    ('sample', ['--ckpt={mixer}', '--prompt=FILE:{tmp}/empty'], '{tmp}/empty is a folder'),
    ('sample', ['--ckpt={tmp}/empty'], '{tmp}/empty is a folder: pass the checkpoint file'),
    ('prepare', ['pystdlib', '--out_dir={tmp}/file'], '{tmp}/file'),
    ('prepare', ['text', '--input={tmp}/ascii.txt', '--out_dir={tmp}/foreign'], 'train.bin'),
    ('retrieve', ['eval', '--ckpt={tmp}/x.pt', '--pairs={tmp}/y.jsonl', '--json={tmp}/file/m.json'],
     'json'),
    ('bench', ['throughput', *BENCH_TINY, '--json={tmp}/file/rows.json'], 'json'),
    ('bench', ['race', '--data_dir={data}', '--out_dir={tmp}/file/race'], '{tmp}/file'),
    ('bench', ['race', '--data_dir={data}', '--out_dir={tmp}/raced'], 'earlier race'),
    # a file that exists (here a checkpoint's name) is replaced only when asked
    ('bench', ['weights', '--ckpt={mixer}', '--out={tmp}/run/ckpt.pt'], '--overwrite'),
    ('retrieve', ['eval', '--ckpt={mixer}', '--pairs={pairs}/pairs_val.jsonl',
                  '--json={tmp}/run/ckpt.pt'], '--overwrite'),
]


def scratch(tmp_path, data_dir):
    """The small files the refusal table names, each wrong in its own way."""
    for name, content in [('file', b'in the way'), ('blank.txt', b'  \n'),
                          ('notpreset.py', b'import os\nn_ctx = 64\n'),
                          ('small.py', b'n_layers = 2\n'), ('typo.py', b'max_iter = 5\n'),
                          ('badvalue.py', b"max_iters = 'many'\n"),
                          ('compare.py', b'"""doc"""\nmax_iters == 3\n'),
                          ('latin1.txt', 'déjà vu, naïve café\n'.encode('latin-1')),
                          ('latin1.jsonl',
                           '{"query": "café", "target": "naïve"}\n'.encode('latin-1') * 3),
                          ('ascii.txt', (bytes(range(33, 127)) + b'\n') * 20),
                          ('bad.jsonl',
                           b'{"query": "a", "target": "b"}\n' * 2 + b'{"query": oops}\n'),
                          ('run/ckpt.pt', b'a long run'), ('run/log.jsonl', b'{"step": 1}\n'),
                          ('run/c4/ckpt.pt', b'a long run'), ('log/log.jsonl', b''),
                          ('raced/race.json', b'{}'),
                          ('foreign/train.bin', b'not prepare.py\'s: --overwrite to replace')]:
        (tmp_path / name).parent.mkdir(exist_ok=True, parents=True)
        (tmp_path / name).write_bytes(content)
    (tmp_path / 'empty').mkdir()
    (tmp_path / 'pystdlib').mkdir()  # unprepared
    (tmp_path / 'cut').mkdir()
    torch.save({'model': {'w': torch.zeros(1000)}}, tmp_path / 'cut/ckpt.pt')
    os.truncate(tmp_path / 'cut/ckpt.pt', 1000)  # as a kill -9 during a save leaves it
    for kind in ('indirect', 'retrieval'):
        torch.save({'kind': kind, 'model': {}}, str(tmp_path / f'{kind}.pt'))
    (tmp_path / 'nce').mkdir()  # a retrieve.py train run's folder
    torch.save({'kind': 'retrieval', 'model': {}}, str(tmp_path / 'nce/ckpt.pt'))
    make_ckpt(tmp_path / 'n1.pt', data_dir, n_ctx=1)
    lm = train.load_checkpoint(make_ckpt(tmp_path / 'lm.pt', data_dir))
    torch.save({**lm, 'model_config': {**lm['model_config'], 'vocab_size': 999}},
               str(tmp_path / 'vocab999.pt'))  # not its tokenizer's vocabulary
    # checkpoints older than carried tokenizers, their data_dir without its model, or gone
    (tmp_path / 'moved').mkdir()
    for name in ('moved', 'gone'):
        torch.save({**{k: v for k, v in lm.items() if k != 'tokenizer'},
                    'data': {**lm['data'], 'data_dir': str(tmp_path / name)}},
                   str(tmp_path / f'{name}.pt'))


@pytest.mark.parametrize('script,argv,culprit', REFUSALS, ids=[f'{s}:{c}' for s, _, c in REFUSALS])
def test_refusal(script, argv, culprit, corpus, request, tmp_path, capsys):
    scratch(tmp_path, corpus.data)
    keep = [tmp_path, corpus.root]

    def value(m):
        # their folders are kept too: train's corpus, the finished run
        if m[1] in ('data', 'trained'):
            path = str(request.getfixturevalue(m[1]))
            keep.append(os.path.dirname(path) if m[1] == 'data' else path)
            return path
        return str({'tmp': tmp_path, 'mixer': corpus.mixer, 'pairs': corpus.data,
                    'ae': corpus.ae}[m[1]])
    fill = lambda text: re.sub(r'\{(\w+)\}', value, str(text))  # noqa: E731
    refused(capsys, script, [fill(a) for a in argv], fill(culprit), keep=keep)
    assert script != 'train' or not (tmp_path / 'out').exists()  # train makes no out_dir either


@pytest.mark.parametrize('argv,says', [
    (['sample.py', '--ckpt=/nonexistent/ckpt.pt'], 'error: no checkpoint at /nonexistent/ckpt.pt'),
    (['bench.py', 'race', '--max_time=-5'], 'error: --max_time=-5')], ids=['sample', 'race'])
def test_run_from_the_shell_exits_2_without_traceback(argv, says, tmp_path):
    """As a user runs them (from another folder): status 2 and one `error:` line, no traceback."""
    r = subprocess.run([sys.executable, os.path.join(HERE, argv[0]), *argv[1:]], cwd=tmp_path,
                       capture_output=True, text=True, env=ENV)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and r.stderr.startswith(says), r


def test_a_reader_that_goes_away_stops_a_script_quietly(data, tmp_path):
    """`python train.py ... | head -1`: the line after the reader has gone ends the run with status
    0 and no traceback (run_main, as for every script)."""
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, 'train.py'), f'--data_dir={data}',
                             f'--out_dir={tmp_path}', *TINY, '--log_interval=1', '--max_iters=0',
                             '--max_time=60'], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=ENV)
    proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=60) == 0 and b'Traceback' not in proc.stderr.read()


@pytest.mark.parametrize('rank, says', [('0', 'interrupted\n'), ('1', '')])
def test_ctrl_c_is_said_once_under_torchrun(rank, says, monkeypatch, capsys):
    """Ctrl-C reaches every rank; rank 0 alone prints the line, and every rank exits 130."""
    monkeypatch.setenv('RANK', rank)

    def body():
        raise KeyboardInterrupt
    assert configurator.run_main(body, 'interrupted') == 130 and capsys.readouterr().err == says


def doc_commands(*docs):
    """(doc, script, argv) of every `python SCRIPT.py ...` in the code of these docs: fenced
    blocks and `inline` spans (but those of *historical* paragraphs), continued lines joined, cut
    at shell operators and comments; an [--option] is taken."""
    found = []
    for doc in docs:
        text = Path(HERE, doc).read_text()
        prose = [p for p in re.split(r'\n\n', re.sub(r'```.*?```', '', text, flags=re.S))
                 if '*historical*' not in p]  # a record of commands the scripts no longer have
        code = re.findall(r'```\w*\n(.*?)```', text, re.S) + [  # an inline span may wrap
            span.replace('\n', ' ') for p in prose for span in re.findall(r'`([^`]+)`', p)]
        for block in code:
            for line in re.sub(r'\\\n', ' ', block).splitlines():
                for part in re.split(r' && | \| |; | > | &\s*$', line):  # sh -c '...': its quote
                    m = re.search(r'(?:python|torchrun)\S* (?:--\S+ )*(\w+)\.py\b(.*)', part)
                    if m:
                        words = shlex.split(m[2].rstrip("' "), comments=True)
                        found.append((doc, m[1], [w.strip('[]') for w in words]))  # [--option]
    return found


DOC_COMMANDS = doc_commands('README.md', 'doc/usage.md', 'doc/models.md', 'doc/measurements.md')


@pytest.mark.parametrize('doc,script,argv', DOC_COMMANDS,
                         ids=[f'{d}:{s} {" ".join(a)[:40]}' for d, s, a in DOC_COMMANDS])
def test_documented_commands_parse(doc, script, argv, monkeypatch, tmp_path):
    """Every command README.md and the guides give is read by its script as written: known keys,
    values of their type, existing presets (nothing runs; placeholders in capitals are skipped)."""
    assert len(DOC_COMMANDS) > 80, "the scan lost the docs' commands (93 when this was written)"
    if script == 'SCRIPT' or any(re.fullmatch(r'[A-Z]+', w.partition('=')[2] or w)
                                 for w in argv):
        pytest.skip('a template (MODE, N, ...)')
    monkeypatch.chdir(tmp_path)  # where the checks of output folders look; config/ stays found
    os.symlink(Path(HERE, 'config'), 'config')
    if script == 'train':
        configurator.parse_args(argv, train.DEFAULTS, '', train.CHOICES)
    elif script == 'sample':
        sample.sample_args(argv)
    elif script == 'prepare':
        prepare.prepare_args(argv)
    elif script == 'retrieve':  # its command line, then a command that does nothing
        commands = {k: (lambda cfg: 0, *v[1:]) for k, v in retrieve.COMMANDS.items()}
        monkeypatch.setattr(retrieve, 'COMMANDS', commands)
        assert retrieve.run(argv) == 0
    elif argv[:1] == ['race']:  # all but its check of prepared data
        monkeypatch.setattr(bench, 'load_meta', lambda data_dir: None)
        bench.race_cells(argv)
    else:
        bench.settings(argv)


def test_a_preset_value_reads_keys_set_before_it(tmp_path):
    """A preset's value may use earlier keys: the defaults', an earlier flag's or preset's, not only
    those its own file set."""
    preset = tmp_path / 'p.py'
    preset.write_text('"""a preset"""\nbatch_size = n_ctx // 8\nlr = lr * 2\n')
    defaults = dict(n_ctx=32, batch_size=1, lr=0.5)
    assert configurator.parse_args([str(preset)], defaults, '') == dict(n_ctx=32, batch_size=4,
                                                                        lr=1.0)
    assert configurator.parse_args(['--n_ctx=64', str(preset)], defaults, '')['batch_size'] == 8
