"""train.py: the loop, DDP == one process, kill -9 + resume, the dtype rule, presets, refusals."""
import ast, json, os, re, resource, shutil, subprocess, sys, time, types

import numpy as np
import pytest
import torch

import configurator, train
from model import ModelConfig
from tests.conftest import (HERE, ARCHS, learns, interrupted_and_resumed, TINY, ENV, train_run,
                            records, weights, run_main, refused, cpu_kind, torchrun)


LEARNS = ([(a, o, []) for a in ARCHS for o in ('clm', 'mtp2', 'half')]
          + [(a, o, []) for a in ('mixer', 'llama') for o in ('autoencoder', 'bidirectional')]
          + [('llama', 'clm', ['--batch_mode=documents', '--padding=left'])])  # padded, pad mask


@pytest.mark.parametrize('arch,objective,extra', LEARNS,
                         ids=[f'{a}-{o}' + '-docs' * bool(e) for a, o, e in LEARNS])
def test_every_arch_and_objective_learns(data, tmp_path, arch, objective, extra):
    """20 steps lower the training loss by 0.5 nats; the checkpoint rebuilds the trained model."""
    ckpt = learns(data, tmp_path, f'--arch={arch}', f'--objective={objective}', *extra)
    assert ckpt['step'] == 20 and ckpt['model_config']['objective'] == objective
    head = train.model_from_checkpoint(ckpt).state_dict()['lm_head.weight']
    assert torch.equal(head, ckpt['model']['lm_head.weight'])


@pytest.mark.parametrize('padding', ['right', 'left'])
def test_document_batches(data, padding):
    """Each row is one n_ctx-aligned chunk of one document, padded; a short row ends its document.
    A batch is a pure function of (split, step, micro-step)."""
    n, meta = 32, train.load_meta(data)
    get = train.Batches(dict(train.DEFAULTS, n_ctx=n, batch_size=16, batch_mode='documents',
                             padding=padding, objective='clm'), meta, data)
    x, y, mask = get('train', 3, 1)
    assert torch.equal(x, get('train', 3, 1)[0]) and not torch.equal(x, get('train', 3, 0)[0])
    stream = np.fromfile(os.path.join(data, 'train.bin'), dtype=meta['dtype']).astype(np.int64)
    starts = np.load(os.path.join(data, 'train_docs.npy'))
    chunks = {(s + k): e for s, e in zip(starts, np.append(starts[1:], len(stream)))
              for k in range(0, e - s - 1, n)}
    for row in range(16):
        real = mask[row].nonzero()[:, 0]
        assert len(real) and (real == torch.arange(real[0], real[-1] + 1)).all()  # one run
        assert (real[0] == 0) if padding == 'right' else (real[-1] == n - 1)
        assert (x[row, ~mask[row]] == meta['pad_id']).all() and (y[row, ~mask[row]] == -1).all()
        w = np.append(x[row, real].numpy(), y[row, real[-1]].item())  # inputs + the last target
        hits = [p for p, end in chunks.items()
                if p + len(w) <= end and (stream[p:p + len(w)] == w).all()]
        assert hits and (len(w) == n + 1 or chunks[hits[0]] == hits[0] + len(w))
        assert torch.equal(x[row, real[1:]], y[row, real[:-1]])  # targets are the next tokens


CPU, GPU = torch.device('cpu'), torch.device('cuda')
F32, B16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPE_RULE = [  # device, native bf16?, --dtype, the checkpoint's dtype, reading it? -> dtype
    (CPU, False, 'auto', None, False, F32), (CPU, True, 'auto', None, False, B16),
    (GPU, True, 'auto', None, False, B16), (GPU, False, 'auto', None, False, F16),
    (CPU, False, 'bfloat16', None, False, B16),          # asked for: used (and warned, below)
    (CPU, True, 'auto', 'float32', False, F32),          # a resume keeps its dtype ...
    (CPU, False, 'auto', 'bfloat16', False, F32),        # ... where the device runs it natively
    (GPU, True, 'auto', 'float16', False, F16),
    (CPU, True, 'auto', 'bfloat16', True, F32),          # reading a checkpoint: fp32 on a CPU
    (GPU, True, 'auto', 'float32', True, F32), (GPU, False, 'auto', 'float16', True, F16),
]


@pytest.mark.parametrize('device,native,requested,recorded,reading,want', DTYPE_RULE)
def test_the_dtype_rule(device, native, requested, recorded, reading, want, monkeypatch, capsys):
    """train.choose_dtype on either CPU kind (the capability query mocked, no timing a busy
    machine could flip) and on a GPU with or without bf16 (mocked)."""
    cpu_kind(monkeypatch, native)
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda including_emulation=True: native)
    assert train.choose_dtype(device, requested, recorded, reading)[0] == want
    assert ('emulated' in capsys.readouterr().err) == (requested == 'bfloat16' and not native)
    monkeypatch.setenv(train.NO_BF16_ENV, '1')  # the switch that tests the fallback everywhere
    assert train.choose_dtype(CPU)[0] == F32


@pytest.mark.parametrize('major,minor,want', [(7, 0, F16), (7, 5, F16), (8, 0, B16)])
def test_auto_on_a_gpu_wants_native_bf16(major, minor, want, monkeypatch):
    """A V100 (7.0) or T4 (7.5) emulates bf16 without tensor cores: auto trains them in fp16 with a
    GradScaler; an A100 (8.0) in bf16. The GPU is faked down to the properties torch consults."""
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 0)
    monkeypatch.setattr(torch.cuda, 'get_device_properties',
                        lambda device=None: types.SimpleNamespace(major=major, minor=minor))
    monkeypatch.setattr(torch.cuda, '_check_bf16_tensor_supported', lambda device: True)
    dtype, why = train.choose_dtype(GPU)
    assert dtype == want
    assert why == ('bf16 on this GPU' if want == B16 else
                   'fp16 with a GradScaler: this GPU has no native bf16')


def test_resume_keeps_the_recorded_dtype(data, tmp_path, monkeypatch, capsys):
    """The checkpoint records the dtype auto chose; a resume keeps it even where auto would now
    choose another (the capability flips between the run and its resume), and ends bit-identical
    to a resume that saw no flip. Another dtype is used only when asked for, and said so."""
    for out, flip in (('a', False), ('b', True)):
        cpu_kind(monkeypatch, native=False)
        assert train_run(data, tmp_path / out, '--max_iters=4', '--eval_interval=4') == 0
        assert weights(tmp_path / out)['dtype'] == 'float32'
        cpu_kind(monkeypatch, native=flip)
        capsys.readouterr()
        resume = ['--max_iters=8', '--eval_interval=4', '--init_from=resume']
        assert train_run(data, tmp_path / out, *resume) == 0
        assert 'cpu float32 (the float32 of the run it continues)' in capsys.readouterr().out
    a, b = weights(tmp_path / 'a'), weights(tmp_path / 'b')
    assert a['step'] == b['step'] == 8 and b['dtype'] == 'float32'
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])
    cpu_kind(monkeypatch, native=False)  # an explicit dtype wins on resume, logged with the record
    assert train_run(data, tmp_path / 'b', '--max_iters=9', '--init_from=resume',
                     '--dtype=bfloat16') == 0
    out = capsys.readouterr()
    assert 'cpu bfloat16 (as asked)' in out.out
    assert 'emulated' in out.err and weights(tmp_path / 'b')['dtype'] == 'bfloat16'


def test_fp16_resume_restores_the_grad_scaler(data, tmp_path):
    """fp16 (emulated on a CPU) trains with a GradScaler; a resume continues its scale and its
    count of steps since the last overflow, not a fresh scaler's."""
    assert train_run(data, tmp_path, '--dtype=float16', '--max_iters=4', '--eval_interval=4') == 0
    ckpt = weights(tmp_path)
    scaler = {**ckpt['scaler'], 'scale': 512.0, '_growth_tracker': 3}  # as after an overflow
    torch.save({**ckpt, 'scaler': scaler}, tmp_path / 'ckpt.pt')
    assert train_run(data, tmp_path, '--dtype=float16', '--max_iters=8', '--eval_interval=4',
                     '--init_from=resume') == 0
    scaler = weights(tmp_path)['scaler']
    assert (scaler['scale'], scaler['_growth_tracker']) == (512.0, 7)


@pytest.mark.parametrize('accum,world', [(1, 1), (1, 2), (3, 2), (2, 4)])
def test_rank_batches_make_one_process_step(accum, world, data, monkeypatch):
    """Each rank takes its rows of every micro-batch, and the ranks all the rows once; their losses
    x scale, averaged as DDP averages gradients, are one process's mean of the micro-batch losses,
    for padded documents too (rows holding different numbers of targets). A batch the ranks cannot
    share is refused, before the process group starts."""
    cfg = dict(train.DEFAULTS, n_ctx=32, batch_size=8, batch_mode='documents', grad_accum=accum)
    get = train.Batches(cfg, train.load_meta(data), data)
    count = lambda batch: int((batch[1] != -1).sum())  # noqa: E731
    loss = lambda batch: batch[1][batch[1] != -1].double().mean()  # a mean over targets  # noqa
    ranks = [list(train.rank_batches(get, 5, accum, r, world, count)) for r in range(world)]
    for micro in range(accum):
        rows = torch.cat([pieces[micro][0][0] for pieces in ranks])
        assert torch.equal(rows, get('train', 5, micro)[0])
    counts = {count(batch) for pieces in ranks for batch, _ in pieces}
    assert world == 1 or len(counts) > 1, counts  # equal shares would not test the weighting
    one = sum(loss(get('train', 5, micro)) for micro in range(accum)) / accum
    ddp = sum(loss(batch) * scale for pieces in ranks for batch, scale in pieces) / world
    assert ddp.item() == pytest.approx(one.item(), rel=1e-12)  # float64 sums of ~200 terms
    monkeypatch.setenv('WORLD_SIZE', '2')
    with pytest.raises(ValueError, match='batch_size divisible by 2'):  # one line, at the boundary
        train.Runtime(dict(cfg, batch_size=3))


DDP_ATOL = 2 * 4 * 1e-2 * 2 ** -8  # 2*k*lr*d, k = 4 steps at TINY's lr: 3.1e-4; a bug moves ~lr


@pytest.mark.parametrize('extra', [['--grad_accum=2'], [], ['--batch_mode=documents']],
                         ids=['accum2', 'accum1', 'documents'])
def test_ddp_two_processes_equal_one(data, tmp_path, extra):
    """torchrun with 2 processes reaches the one-process weights (DDP_ATOL) after 4 clipped steps,
    each rank on half the rows of every micro-batch: one or two micro-batches a step (DDP syncs the
    last), and padded documents whose halves hold different numbers of real targets (each weighted
    by its share of the micro-batch's)."""
    common = [*TINY, f'--data_dir={data}', '--dtype=float32', *extra, '--max_iters=4',
              '--eval_interval=4', '--grad_clip=0.5', '--log_interval=1']
    if '--batch_mode=documents' in extra:  # the row shards of step 0 do hold different counts
        cfg = configurator.parse_args(common, train.DEFAULTS, '')
        get = train.Batches(cfg, train.load_meta(data), data)
        counts = [int((get('train', 0, 0, s, 2)[1] != -1).sum()) for s in range(2)]
        assert counts[0] != counts[1], counts
    assert '2 process(es)' in torchrun('train.py', [*common, f'--out_dir={tmp_path}/ddp']).stdout
    assert train.main([*common, f'--out_dir={tmp_path}/one']) == 0
    a, b = weights(tmp_path / 'ddp'), weights(tmp_path / 'one')
    assert a['step'] == b['step'] == 4 and a['tokens_seen'] == b['tokens_seen']
    first = [records(tmp_path / run, 'loss')[0] for run in ('ddp', 'one')]
    # step 1 starts from the same weights: the step's mean loss, but for the order of the sums and
    # the log's 5 decimals
    assert first[0]['step'] == 1 and first[0]['loss'] == pytest.approx(first[1]['loss'], abs=2e-5)
    # step 0's evaluation, its batches shared out over the ranks: the same means (float32 kernels
    # on 1 thread a rank sum in other orders, ~1e-7 of a loss of ~8; a bug is off by x2)
    evals = [records(tmp_path / run, 'val_loss')[0] for run in ('ddp', 'one')]
    for key in ('train_loss', 'val_loss'):
        assert evals[0][key] == pytest.approx(evals[1][key], rel=1e-5), key
    for k, v in a['model'].items():
        torch.testing.assert_close(v, b['model'][k], rtol=0, atol=DDP_ATOL)
    start = train.build_model(train.ModelConfig(**a['model_config'])).state_dict()  # they moved
    assert any(not torch.allclose(v, start[k]) for k, v in a['model'].items())


def test_ddp_refusal_reaches_every_rank(data, tmp_path):
    """torchrun with 2 processes at a folder that holds a run: every rank refuses before the process
    group starts, one error line (rank 0's), no rank's traceback, the run untouched."""
    (tmp_path / 'ckpt.pt').write_bytes(b'a long run')
    proc = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone',
                           '--nproc_per_node=2', os.path.join(HERE, 'train.py'),
                           f'--data_dir={data}', *TINY, '--max_iters=2', f'--out_dir={tmp_path}'],
                          env=ENV, capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
    assert proc.returncode and len(errors) == 1, proc.stderr
    assert 'already holds a run' in errors[0] and '[rank' not in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == ['ckpt.pt']
    assert (tmp_path / 'ckpt.pt').read_bytes() == b'a long run'


def test_kill9_then_resume_is_bit_identical(data, tmp_path):
    """kill -9 at an arbitrary step (not at a checkpoint), then --init_from=resume: the weights,
    the optimizer state and the log equal those of an uninterrupted run, bit for bit."""
    args = [f'--data_dir={data}', *TINY, '--arch=mixer', '--max_iters=300', '--eval_interval=25',
            '--log_interval=1']
    a, b = interrupted_and_resumed(args, tmp_path)
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])
    assert torch.equal(a['optimizer']['state'][0]['exp_avg_sq'],
                       b['optimizer']['state'][0]['exp_avg_sq'])


def test_max_time_is_honoured(data, tmp_path):
    """--max_time ends the run on time, with a last eval and checkpoint; the lr decays with time."""
    t0 = time.time()
    assert train_run(data, tmp_path, '--max_iters=0', '--max_time=1.5',
                     '--eval_interval=1000000') == 0
    last = records(tmp_path, 'val_loss')[-1]
    assert 1.5 <= last['time'] < 2.5 and time.time() - t0 < 15
    assert weights(tmp_path)['step'] == last['step'] > 10
    lrs = [r['lr'] for r in records(tmp_path, 'loss')]
    assert lrs == sorted(lrs, reverse=True) and lrs[-1] < 0.5e-2


def test_divergence_stops_and_keeps_last_checkpoint(data, tmp_path, capsys, monkeypatch):
    """A training loss that blows up, or an evaluation that does (a val batch the step's batches
    never met), stops the run with status 1, naming the step of the checkpoint it keeps whole."""
    assert train_run(data, tmp_path, '--max_iters=10', '--eval_interval=10') == 0
    before = (tmp_path / 'ckpt.pt').read_bytes()
    assert train_run(data, tmp_path, '--max_iters=40', '--eval_interval=10', '--lr=1e30',
                     '--grad_clip=0', '--init_from=resume') == 1
    err = capsys.readouterr().err  # names the step it kept
    assert 'error:' in err and 'step 10' in err and ('nan' in err or 'inf' in err)
    assert (tmp_path / 'ckpt.pt').read_bytes() == before
    monkeypatch.setattr(train, 'evaluate', lambda *args: {'train': 3.0, 'val': float('inf')})
    assert train_run(data, tmp_path, '--max_iters=40', '--eval_interval=10',
                     '--init_from=resume') == 1
    err = capsys.readouterr().err
    assert 'error: the evaluation loss is' in err and 'step 10' in err
    assert (tmp_path / 'ckpt.pt').read_bytes() == before


@pytest.mark.parametrize('preset', sorted(os.listdir(os.path.join(HERE, 'config'))))
def test_every_preset_names_its_source_and_builds(preset):
    """A preset names the paper table or section it follows (or says it is not a paper run) and
    builds; the demo's budget is steps: a busy machine would train fewer in a wall-clock one."""
    path = os.path.join(HERE, 'config', preset)
    doc = ast.get_docstring(ast.parse(open(path).read())) or ''
    assert re.search(r'Table S?\d|§\d', doc) or doc.startswith('Not a paper run'), doc
    cfg = configurator.parse_args([path], train.DEFAULTS, '', train.CHOICES)
    ModelConfig(vocab_size=8000, **{k: cfg[k] for k in train.MODEL_KEYS})
    assert preset != 'demo.py' or (cfg['max_time'] == 0 and cfg['max_iters'] > 0)


@pytest.mark.parametrize('arch', ['mixer', 'hybrid'])
def test_weight_decay_spares_biases_and_norms(arch):
    """configure_optimizer decays weights (matrices, embeddings, mixings), not biases, the
    mixing's (heads, n_ctx, 1) one included, nor norms."""
    model = train.build_model(ModelConfig(vocab_size=64, n_ctx=8, d_model=16, n_layers=1,
                                          n_heads=2, arch=arch))
    decay, spared = train.configure_optimizer(model, 1e-3, 0.1).param_groups
    assert (decay['weight_decay'], spared['weight_decay']) == (0.1, 0.0)
    decayed = {id(p) for p in decay['params']}
    for mod in model.modules():
        norm = isinstance(mod, (torch.nn.LayerNorm, torch.nn.RMSNorm))
        for name, p in mod.named_parameters(recurse=False):
            assert (id(p) in decayed) == (name == 'weight' and not norm), (type(mod), name)


def test_runtime_reads_its_rank_and_refuses_a_batch_the_ranks_cannot_share(monkeypatch):
    """Under torchrun (RANK, WORLD_SIZE) a process knows its rank, and that only rank 0 logs; a
    batch_size the processes cannot split evenly is refused before any process group starts."""
    monkeypatch.setenv('RANK', '1')
    monkeypatch.setenv('WORLD_SIZE', '2')
    cfg = dict(train.DEFAULTS, device='cpu', dtype='float32')
    runtime = train.Runtime(dict(cfg, batch_size=4))
    assert (runtime.distributed, runtime.rank, runtime.world) == (True, 1, 2)
    assert not runtime.master
    with pytest.raises(ValueError, match='batch_size=3'):
        train.Runtime(dict(cfg, batch_size=3))


def test_report_writes_nan_and_inf_as_null(tmp_path, capsys):
    """log.jsonl stays strict JSON, one object a line: a non-finite number is written as null."""
    log = tmp_path / 'log.jsonl'
    train.report(str(log), 'step 3', step=3, loss=float('nan'), grad_norm=float('inf'), lr=0.5)
    assert capsys.readouterr().out == 'step 3\n'
    assert json.loads(log.read_text()) == dict(step=3, loss=None, grad_norm=None, lr=0.5)


def test_lr_schedule():
    cfg = dict(train.DEFAULTS, lr=1.0, min_lr=0.1, warmup_iters=9)
    assert train.get_lr(cfg, 0, 0.0) == pytest.approx(0.1) and train.get_lr(cfg, 9, 0.0) == 1.0
    assert train.get_lr(cfg, 50, 0.5) == pytest.approx(0.55)
    assert train.get_lr(cfg, 99, 1.0) == pytest.approx(0.1)
    assert train.get_lr(dict(cfg, schedule='cosine'), 50, 0.5) == pytest.approx(0.55)
    assert train.get_lr(dict(cfg, schedule='cosine'), 50, 0.25) > train.get_lr(cfg, 50, 0.25)


def test_step_line_shows_elapsed_time(data, tmp_path, capsys):
    """Each step line ends with the wall time so far and the training time left at this pace (none
    at the last step; no MFU on a CPU); the last line, 2 steps after
    the one before, is their mean loss (not a sum over log_interval); --grad_clip=0 trains
    unclipped (not clipped to 0); an unmasked run is warned that its loss measures copying; the
    header counts the tokens of a step's micro-batches."""
    assert train_run(data, tmp_path, '--max_iters=12', '--eval_interval=12', '--grad_clip=0') == 0
    out = capsys.readouterr().out.splitlines()
    lines = [l for l in out if l.startswith('step 5 |')]
    assert len(lines) == 1 and re.search(r'tok/s \| \d:\d\d:\d\d elapsed, \d:\d\d:\d\d left$',
                                         lines[0])
    assert [l for l in out if l.startswith('step 12 |')][0].endswith('elapsed, 0:00:00 left')
    logged, evals = records(tmp_path, 'loss'), records(tmp_path, 'val_loss')
    assert [r['step'] for r in logged] == [5, 10, 12]
    # the mean of steps 11-12 is near that of 6-10 (a sum over log_interval would be 2/5 of it)
    assert logged[2]['loss'] > 0.7 * logged[1]['loss']
    # unclipped, 12 steps at TINY's lr learn (clipped to 0 nothing would move)
    assert evals[1]['train_loss'] < evals[0]['train_loss'] - 0.1
    assert 'copying' not in capsys.readouterr().err
    assert train_run(data, tmp_path, '--max_iters=2', '--causal=False', '--overwrite',
                     '--grad_accum=2') == 0
    out = capsys.readouterr()
    assert 'copying' in out.err   # unmasked clm reads what it predicts: warned
    assert '256 tokens per step' in out.out  # the header: 4 rows x 2 micro-steps x n_ctx 32


def test_step_line_time_left_is_the_rest_of_the_budget_at_this_pace(data, tmp_path, capsys,
                                                                    monkeypatch):
    """The time left is the training time the rest of the budget takes at the pace so far: on a
    clock where each step takes 10 s, 20 steps leave 150 s after 5 (not the total, 200 s); a time
    budget overshot by the last step leaves none (not a negative time)."""
    ticks = iter(range(0, 10 ** 6, 10))  # each reading 10 s after the last; a step reads its
    # start and its end, back to back: 10 s of training time each
    monkeypatch.setattr(train, 'time', types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    assert train_run(data, tmp_path, '--max_iters=20', '--eval_interval=20') == 0
    left = [l.split(', ')[-1] for l in capsys.readouterr().out.splitlines() if ' left' in l]
    assert left == ['0:02:30 left', '0:01:40 left', '0:00:50 left', '0:00:00 left']
    assert train_run(data, tmp_path / 'timed', '--max_iters=0', '--max_time=195') == 0
    left = [l.split(', ')[-1] for l in capsys.readouterr().out.splitlines() if ' left' in l]
    assert left[-1] == '0:00:00 left', left


@pytest.mark.parametrize('argv,says', [
    ([], ['config/demo.py', 'GPU']),
    (['config/tinystories_mixer.py'], ['python prepare.py tinystories']),
    (['config/fineweb_llama.py'], ['python prepare.py fineweb-edu']),
    (['--device=cuda', '--data_dir={data}'], ['no CUDA GPU', '--device=cpu'])])
def test_a_cpu_names_the_demo_the_prepare_command_and_the_device(argv, says, data, tmp_path,
                                                                  monkeypatch, capsys):
    """The defaults are GPU-sized: on a CPU a bare `python train.py` says what to run instead, at
    once, rather than training for hours; a preset without its data names its prepare command (run
    where there is no data); --device=cuda without CUDA names the way out. None makes a folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    argv = [os.path.join(HERE, a) if a.endswith('.py') else a.format(data=data) for a in argv]
    code, _, err = run_main(capsys, 'train', *argv)
    assert code == 2 and all(w in err for w in says) and not os.listdir(tmp_path), err


def test_a_bare_run_with_a_gpu_is_not_refused(tmp_path, monkeypatch, capsys):
    """Only a CPU refuses a bare `python train.py`: with a GPU it goes on (here to the missing data,
    named with its prepare command)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    code, _, err = run_main(capsys, 'train')
    assert code == 2 and 'python prepare.py' in err and 'config/demo.py' not in err, err


def test_uint32_token_files_read_as_their_uint16_twins(data, tmp_path):
    """Batches reads a folder of uint32 ids (a vocabulary past 65535): sized by its dtype."""
    meta = train.load_meta(data)
    shutil.copytree(data, tmp_path / 'd')
    for s in ('train', 'val'):
        np.fromfile(f'{data}/{s}.bin', np.uint16).astype(np.uint32).tofile(tmp_path / f'd/{s}.bin')
    cfg = dict(train.DEFAULTS, n_ctx=16, batch_size=2)
    want = train.Batches(cfg, meta, data)('val', None, 0)[0]
    got = train.Batches(cfg, {**meta, 'dtype': 'uint32'}, tmp_path / 'd')('val', None, 0)[0]
    assert torch.equal(want, got)


def test_resume_and_fresh_runs_name_the_way_out(data, tmp_path, monkeypatch, capsys):
    """No checkpoint to resume: start afresh (--init_from=scratch --overwrite, which a folder left
    by a run stopped before its first checkpoint needs). A folder holding a log but no
    checkpoint: --overwrite only. Resuming a spent budget says so at once, naming the budget
    spent (a resume keeps the other), and evaluates nothing again. --overwrite starts the run
    afresh. A run that never beats its first evaluation (lr 0) still writes best.pt: step 0's
    weights are never saved, and best.pt is written only on improvement (a tie is none), before
    ckpt.pt. A resume that evaluates otherwise (--eval_iters) chooses best.pt afresh, not against a
    best measured on other batches; else the checkpoint keeps the best it resumed with."""
    argv = [f'--data_dir={data}', f'--out_dir={tmp_path}', *TINY, '--max_iters=4']
    refused(capsys, 'train', [*argv, '--init_from=resume'],
            'start afresh: --init_from=scratch --overwrite')
    (tmp_path / 'log.jsonl').write_text('')
    code, _, err = run_main(capsys, 'train', *argv)
    assert code == 2 and '--overwrite' in err and '--init_from=resume' not in err, err
    assert train_run(data, tmp_path, '--max_iters=4', '--eval_interval=4', '--overwrite') == 0
    log = (tmp_path / 'log.jsonl').read_text()
    monkeypatch.setattr(train, 'evaluate', None)  # would raise if called
    code, out, err = run_main(capsys, 'train', *argv, '--init_from=resume')
    assert code == 2 and 'spent' in err and 'raise --max_iters=4 ' in err, err
    refused(capsys, 'train', [*argv, '--init_from=resume', '--max_iters=9', '--max_time=1e-3'],
            'raise --max_time=0.001 (')  # the budget spent, not the one raised
    assert (tmp_path / 'log.jsonl').read_text() == log
    monkeypatch.undo()
    assert train_run(data, tmp_path, '--max_iters=2', '--eval_interval=2', '--overwrite') == 0
    assert max(r['step'] for r in records(tmp_path, 'loss')) == 2
    assert weights(tmp_path, 'best.pt')['step'] == 2
    written, write = [], train.write_atomic
    monkeypatch.setattr(train, 'write_atomic', lambda path, data: written.append(
        os.path.basename(path)) or write(path, data))
    assert train_run(data, tmp_path, '--lr=0', '--max_iters=4', '--eval_interval=2',
                     '--overwrite') == 0
    assert weights(tmp_path, 'best.pt')['step'] == 2  # step 4's equal loss is no improvement
    assert written == ['best.pt', 'ckpt.pt', 'ckpt.pt']  # steps 2 and 4, none at step 0
    for max_iters, extra, best in (6, [], 2), (8, ['--eval_iters=3'], 8):
        torch.save({**weights(tmp_path), 'best_val': -1.0}, tmp_path / 'ckpt.pt')  # unbeatable
        assert train_run(data, tmp_path, '--init_from=resume', f'--max_iters={max_iters}',
                         '--eval_interval=2', *extra) == 0
        assert weights(tmp_path, 'best.pt')['step'] == best
        assert (weights(tmp_path)['best_val'] == -1.0) == (not extra)


def test_resume_takes_the_run_from_its_checkpoint(data, tmp_path, capsys):
    """--init_from=resume and the folder continue a run of any preset: model, data and loop keys
    come from the checkpoint, a flag given here wins (even one set to train.py's default); data
    prepared again since is refused."""
    assert train_run(data, tmp_path, '--arch=gpt', '--max_iters=4', '--eval_interval=4',
                     '--warmup_iters=2') == 0
    assert train.main([f'--out_dir={tmp_path}', '--init_from=resume', '--max_iters=6',
                       f"--warmup_iters={train.DEFAULTS['warmup_iters']}"]) == 0
    ckpt = weights(tmp_path)
    assert ckpt['step'] == 6 and ckpt['model_config']['arch'] == 'gpt'
    assert ckpt['tokens_seen'] == 6 * 4 * 32  # steps x TINY's batch_size x n_ctx, across the resume
    assert ckpt['config']['warmup_iters'] == train.DEFAULTS['warmup_iters']
    assert ckpt['config']['d_model'] == 32 and ckpt['config']['lr'] == 1e-2   # TINY's, not defaults
    shutil.copytree(data, tmp_path / 'again')  # the same tokens, but as if prepared anew
    meta = json.loads((tmp_path / 'again/meta.json').read_text())
    (tmp_path / 'again/meta.json').write_text(json.dumps({**meta, 'fingerprint': 'other'}))
    refused(capsys, 'train', [f'--out_dir={tmp_path}', '--init_from=resume', '--max_iters=8',
                              f'--data_dir={tmp_path}/again'], 'prepared again')


def test_a_failed_save_is_one_line_and_keeps_the_last_checkpoint(data, tmp_path):
    """A disk that fills during a save (here a file size limit: Python ignores SIGXFSZ, so the write
    fails with EFBIG): one error line naming the file, status 2, the last checkpoints whole."""
    assert train_run(data, tmp_path, '--max_iters=4', '--eval_interval=4') == 0
    before = {name: (tmp_path / name).read_bytes() for name in ('ckpt.pt', 'best.pt')}
    limit = len(before['ckpt.pt']) // 2
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, 'train.py'), f'--out_dir={tmp_path}',
         '--init_from=resume', '--max_iters=8'], env=ENV, capture_output=True, text=True,
        timeout=120, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert proc.returncode == 2 and proc.stderr.count('\n') == 1, proc.stderr
    assert re.match(r'error: cannot write \S+(best|ckpt)\.pt \(File too large\)', proc.stderr)
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert sorted(os.listdir(tmp_path)) == ['best.pt', 'ckpt.pt', 'log.jsonl']  # no temp file


def test_a_split_shorter_than_a_window_is_refused(data, tmp_path, capsys):
    """A packed window is n_ctx + 1 tokens: a split holding only n_ctx is refused as the data loads,
    by name, with its count and the way out; one more token is enough."""
    meta = train.load_meta(data)
    n = meta['val_tokens']
    error = refused(capsys, 'train', [f'--data_dir={data}', f'--out_dir={tmp_path}/out', *TINY,
                                      f'--n_ctx={n}'], '--n_ctx', keep=[data])
    assert 'val split' in error and f'{n:,} tokens' in error and f'n_ctx={n}' in error, error
    assert not (tmp_path / 'out').exists()
    get = train.Batches(dict(train.DEFAULTS, n_ctx=n - 1, batch_size=2), meta, data)
    assert get('val', None, 0)[0].shape == (2, n - 1)


@pytest.mark.parametrize('name,damage', [('train.bin', lambda b: b[:-64]), ('val_docs.npy', None),
                                         ('val.bin', lambda b: b + b[:64]),
                                         ('meta.json', lambda b: b[:len(b) // 2]),
                                         ('meta.json', lambda b: b'{"foo": 1}'),
                                         ('meta.json', lambda b: b'[1, 2]'),
                                         ('tokenizer.model', lambda b: b'not a model')])
def test_data_files_must_agree_with_meta(name, damage, data, tmp_path, capsys):
    """A truncated or overlong token file, a corrupt or foreign meta.json, a missing offsets file, a
    damaged tokenizer: each refused by name."""
    shutil.copytree(data, tmp_path / 'data')
    path = tmp_path / 'data' / name
    path.write_bytes(damage(path.read_bytes())) if damage else path.unlink()
    refused(capsys, 'train', [f'--data_dir={tmp_path}/data', f'--out_dir={tmp_path}/out', *TINY,
                              '--max_iters=2', '--batch_mode=documents'],
            name, keep=[tmp_path / 'data'])


def test_documents_have_exactly_ceil_len_minus_one_over_n_chunks(tmp_path):
    """A document of L tokens has ceil((L - 1) / n_ctx) chunks (L - 1 targets): one whose L - 1 is
    a multiple of n_ctx has no extra, empty chunk; every row holds a target."""
    n, docs = 4, [list(range(1, 6)), list(range(10, 19)), [30, 31, 32]]  # L 5, 9, 3: 1 + 2 + 1
    meta = dict(vocab_size=100, dtype='uint16', pad_id=0, tokenizer={'kind': 'none'})
    for split in train.SPLITS:  # as prepare.py lays them out
        np.concatenate(docs).astype(np.uint16).tofile(tmp_path / f'{split}.bin')
        np.save(tmp_path / f'{split}_docs.npy', np.cumsum([0, 5, 9]).astype(np.int64))
        meta[f'{split}_tokens'] = 17
    get = train.Batches(dict(train.DEFAULTS, n_ctx=n, batch_size=256, batch_mode='documents',
                             objective='clm'), meta, tmp_path)
    x, y, mask = get('train', 0, 0)
    assert mask.any(1).all(), "an empty chunk was drawn"
    rows = {tuple(r) for r in torch.cat([x, y], 1).tolist()}
    assert rows == {(1, 2, 3, 4, 2, 3, 4, 5), (10, 11, 12, 13, 11, 12, 13, 14),
                    (14, 15, 16, 17, 15, 16, 17, 18), (30, 31, 0, 0, 31, 32, -1, -1)}
