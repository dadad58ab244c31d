"""bench.py: every mode at tiny sizes, the representation metric on models whose answer is known
by construction, the race."""
import contextlib, dataclasses, json, os, signal, subprocess, sys, time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import bench, configurator, train
from model import ModelConfig, build_model
from tests.conftest import HERE, BENCH_TINY, ENV, refused, run_main


def tiny(vocab=128, **kw):
    """A seeded model: a 2-layer mixer of width 32 over 16 positions unless kw says otherwise."""
    torch.manual_seed(0)
    return build_model(ModelConfig(**{**dict(vocab_size=vocab, n_ctx=16, d_model=32, n_layers=2),
                                      **kw}))


def tokens(vocab, shape=(2, 16)):
    return torch.randint(vocab, shape, generator=torch.Generator().manual_seed(1))


def test_bench_throughput_json_holds_each_row_as_it_finishes(tmp_path, monkeypatch, capsys):
    """An interrupt after two rows leaves both in --json, and printed under one table header; a
    row's tokens/s follows from its ms/step (no MFU on a CPU: no datasheet peak). Each cell's model
    compiles afresh (torch's recompile limit would turn later cells eager). A file --overwrite
    replaces holds none of its earlier rows, even if the run stops before its first."""
    build, resets = bench.build_model, []
    monkeypatch.setattr(torch._dynamo, 'reset', lambda: resets.append(1))

    def build_or_stop(cfg):
        if cfg.n_ctx == 32:
            raise KeyboardInterrupt
        return build(cfg)
    monkeypatch.setattr(bench, 'build_model', build_or_stop)
    code, out, err = run_main(capsys, 'bench', 'throughput', '--archs=mixer', *BENCH_TINY,
                              '--n_ctx=16,24,32', '--repeats=2', f'--json={tmp_path}/r.json')
    rows = json.loads((tmp_path / 'r.json').read_text())
    assert code == 130 and 'Traceback' not in err and [r['n_ctx'] for r in rows] == [16, 24]
    assert out.count('| arch |') == 1 and out.count('| mixer |') == 2
    for r in rows:
        assert 'mfu' not in r
        assert r['tokens_per_s'] == pytest.approx(2 * r['n_ctx'] / (r['ms_per_step'] / 1e3))
    assert len(resets) == 2
    code, out, err = run_main(capsys, 'bench', 'throughput', '--archs=mixer', *BENCH_TINY,
                              '--n_ctx=32', f'--json={tmp_path}/r.json', '--overwrite')
    assert code == 130 and json.loads((tmp_path / 'r.json').read_text()) == []


def test_bench_grid_is_archs_by_layers_by_ctx_and_n_heads_reaches_every_attention_arch():
    """Rows come arch by arch, then n_layers, then n_ctx (the table's and --json's order); --n_heads
    sets the heads of every arch with attention, mixers keep their one."""
    archs = ['mixer', 'llama', 'gpt', 'hybrid', 'gmlp', 'elita']
    s = bench.settings(['throughput', f'--archs={",".join(archs)}', '--n_layers=1,2',
                        '--n_ctx=16,32', '--n_heads=2'])
    assert [(c.arch, c.n_layers, c.n_ctx) for c in s.cfgs] == [
        (a, n, t) for a in archs for n in (1, 2) for t in (16, 32)]
    heads = {c.arch: c.n_heads for c in s.cfgs}
    assert heads == dict(mixer=1, llama=2, gpt=2, hybrid=2, gmlp=1, elita=2)


def test_bench_throughput_times_one_step_after_two_untimed_and_waits_for_the_device(monkeypatch):
    """A stand-in device: each optimizer step queues work that sync() waits for, 0.6 s for the two
    untimed steps (a compile's, the allocator's), then 0.2 s. --repeats=1: ms/step is the one timed
    step's 200 ms plus the tiny model's own (~1 ms on the suite's one thread; 150 ms of slack for
    a loaded machine). Timing the second warm-up too gives 400, two steps per timing 400, a clock
    that stops before sync ~1, one run fewer no timed step at all."""
    pending, steps, configure = [], [], bench.configure_optimizer

    def queuing_optimizer(*args):
        opt = configure(*args)
        step = opt.step

        def step_and_queue():
            steps.append(1)
            pending.append(0.6 if len(steps) <= 2 else 0.2)
            return step()
        opt.step = step_and_queue
        return opt
    monkeypatch.setattr(bench, 'configure_optimizer', queuing_optimizer)
    monkeypatch.setattr(bench, 'sync', lambda dev: time.sleep(sum(pending)) or pending.clear())
    rows = bench.main(['throughput', '--archs=mixer', *BENCH_TINY, '--repeats=1'])
    assert len(steps) == 3 and 200 <= rows[0]['ms_per_step'] < 350, (steps, rows)


def test_bench_memory(tmp_path, capsys):
    """A cell's peak grows with the model, is a row of the table and of --json, and is None (OOM)
    past --mem_limit. --n_heads reaches llama's cells (Table S10 used 32 heads), not a mixer's.
    --full swaps in the paper's grid (throughput's too), the command line still winning."""
    big = ['memory', '--archs=mixer', '--d_model=256', '--n_layers=2', '--n_ctx=256',
           '--dtype=float32']
    rows = bench.main([*big, f'--json={tmp_path}/m.json'])
    # parameters + gradients alone are 2 x 4 bytes x ~2.2M (two 256x1024 MLPs per layer, the
    # 4096 x 256 token table, two 256x256 mixings) = ~17 MB
    assert len(rows) == 1 and 15 < rows[0]['mb'] < 200
    assert json.loads((tmp_path / 'm.json').read_text()) == rows
    out = capsys.readouterr().out
    assert '| arch | d_model | n_layers | n_ctx | dtype | n_heads | batch_size | mb |' in out
    assert bench.main([*big, '--mem_limit=1'])[0]['mb'] is None
    assert '| mixer | 256 | 2 | 256 | float32 | 1 | 1 | OOM |' in capsys.readouterr().out
    # bf16 on a CPU with oneDNN's kernels: its failed allocation ("could not create a primitive")
    assert bench.main(['memory', '--archs=llama', *big[2:-1], '--dtype=bfloat16',
                       '--mem_limit=20'])[0]['mb'] is None
    small = ['--d_model=64', '--n_layers=2', '--n_ctx=512', '--dtype=float32', '--batch_size=2']
    full = bench.settings(['memory', '--full', '--n_layers=2'])  # the paper's grid, argv winning
    assert (full.d_model, full.n_layers, full.n_ctx[-1]) == (1024, [2], 8192)
    assert bench.settings(['throughput', '--full']).n_ctx == [128, 256, 512, 1024]
    eight = bench.settings(['memory', *small, '--n_heads=8'])
    assert [cfg.n_heads for cfg in eight.cfgs] == [1, 8]  # the default archs: mixer, llama
    eight = bench.settings(['memory', *small, '--n_heads=8', '--archs=gmlp,llama'])
    assert [cfg.n_heads for cfg in eight.cfgs] == [1, 8]  # gmlp's one spatial projection
    # the 7 more heads' attention weights kept for backward alone: 7 x 2 rows x 512^2 x 4 bytes x 2
    # layers = 29 MB (peak RSS shows 55 to 100 MB more, depending on the allocator's reuse)
    mb1, mb8 = (bench.main(['memory', *small, '--archs=llama', f'--n_heads={h}'])[0]['mb']
                for h in (1, 8))
    assert mb8 - mb1 > 25


def test_bench_generate_methods_and_batches():
    """window at the first batch size, cache at each (by default batch 1 and 16); every row a
    decoding rate."""
    assert bench.settings(['generate']).batch_size == [1, 16]
    assert bench.settings(['generate', '--device=cpu']).dtype == 'float32'  # as sample.py's
    rows = bench.main(['generate', '--archs=mixer,llama', *BENCH_TINY, '--batch_size=1,3',
                       '--prompt=4', '--new_tokens=6'])
    runs = (('window', 1), ('cache', 1), ('cache', 3))
    assert [(r['arch'], r['method'], r['batch_size']) for r in rows] == [
        (a, m, b) for a in ('mixer', 'llama') for m, b in runs]
    assert all(r['tokens_per_s'] > 0 for r in rows)


def test_bench_represent_recovers_what_reaches_the_layer():
    """Zeroed blocks are identities, so O_l(e) = e: every token comes back (from the last position
    alone, none of the others). A constant block passes nothing: chance, 1 - 1/vocab. Pads are not
    counted (eq. 6)."""
    model = tiny()
    with torch.no_grad():
        for p in model.backbone.blocks.parameters():
            p.zero_()
    rows = bench.represent_rows(model, tokens(128), [1, 2], steps=500, lr=0.05)
    by = {(r['layer'], r['positions']): r for r in rows}
    assert by[2, 'all']['hamming'] == 0 and by[1, 'all']['hamming'] == 0
    assert by[2, 'last']['hamming'] > 0.8
    assert by[2, 'all']['converged'] == 1 and by[2, 'all']['loss'] < by[2, 'all']['epsilon']
    model = tiny(vocab=64, n_layers=1)
    model.backbone.blocks[0].forward = lambda x, *args, **kw: x * 0 + 1  # ignores x
    for r in bench.represent_rows(model, tokens(64, (8, 16)), [1], steps=50, lr=0.05):
        assert r['hamming'] == pytest.approx(1 - 1 / 64, abs=0.04)
    x, y = torch.tensor([[5, 6, 0, 0]]), torch.tensor([[5, 7, 1, 1]])
    assert bench.hamming(x, y, pad_id=0) == 0.5 and bench.hamming(x, y) == 0.75


def test_bench_represent_mixer_beats_llama_other_objectives_and_checkpoints(trained, data,
                                                                          capsys):
    """The paper's §3.3 finding, in small: an untrained mixer's last layer gives its input back, a
    llama's does not. Autoencoders are probed through their encoder, half-sequence models through
    their own forward; the two-stream bidirectional model has no single backbone to invert. A
    checkpoint is probed on its data. The dtype printed is the one that runs, float32."""
    rows = bench.main(['represent', '--d_model=128', '--n_layers=2', '--n_ctx=16',
                       '--vocab_size=256', '--dtype=bfloat16'])
    assert 'represent: cpu float32' in capsys.readouterr().err
    h = {(r['arch'], r['positions']): r['hamming'] for r in rows}
    assert h['mixer', 'all'] < 0.05 and h['llama', 'all'] > 0.5
    assert all(r['layer'] == 2 for r in rows)
    for objective in ('autoencoder', 'half'):
        rows = list(bench.represent_rows(tiny(64, n_ctx=8, d_model=16, objective=objective),
                                         tokens(64, (1, 8)), [2], steps=3, lr=0.05))
        assert len(rows) == 2 and all(0 <= r['hamming'] <= 1 for r in rows)
    with pytest.raises(ValueError, match='embedding'):
        list(bench.represent_rows(tiny(64, n_ctx=8, d_model=16, objective='bidirectional'),
                                  tokens(64, (1, 8)), [1], steps=3, lr=0.05))
    rows = bench.main(['represent', f'--ckpt={trained}/ckpt.pt', f'--data_dir={data}',
                       '--layer=1,2', '--steps=50'])
    assert [(r['layer'], r['positions']) for r in rows] == [(1, 'all'), (1, 'last'), (2, 'all'),
                                                            (2, 'last')]
    assert all(r['arch'] == 'mixer' and 0 <= r['hamming'] <= 1 for r in rows)


RACE_TINY = ['--d_model=16', '--n_layers=1', '--n_ctx=16', '--batch_size=2', '--eval_iters=1',
             '--log_interval=5', '--warmup_iters=0', '--device=cpu']


@pytest.fixture(scope='module')
def tiny_race(data, tmp_path_factory):
    """A race of a mixer and a llama, 1.5 s of training each, and its rows."""
    out = tmp_path_factory.mktemp('race')
    rows = bench.main(['race', f'--data_dir={data}', f'--out_dir={out}', *RACE_TINY,
                       '--max_time=1.5', '--eval_seconds=0.5'])
    return out, rows, data


def test_race_writes_table_json_and_picture(tiny_race):
    """Each run evaluates once per 0.5 s mark of training time and at the end of its budget, and
    exits 0 (that the runs train at the same time on a CPU: the Ctrl-C test finds both alive)."""
    import matplotlib.image
    out, rows, _ = tiny_race
    assert [r['arch'] for r in rows] == ['mixer', 'llama']
    assert all(r['steps'] > 0 and r['tokens_per_s'] > 0 and r['best_val'] <= r['final_val']
               for r in rows)
    assert 's_to_llama_best' in rows[0] and 's_to_mixer_best' in rows[1]
    assert '| mixer |' in (out / 'race.md').read_text()
    assert matplotlib.image.imread(out / 'race.png').ndim == 3
    result = json.loads((out / 'race.json').read_text())
    for curve in result['curves'].values():
        marks = [int(e['time'] // 0.5) for e in curve[:-1]]  # the last one is the budget's
        assert curve[0]['time'] == 0 and marks == sorted(set(marks)) and len(curve) >= 3
        assert curve[-1]['time'] >= 1.5 and all(e['tokens_seen'] > 0 for e in curve[1:])
    assert result['settings']['status'] == {'mixer': 0, 'llama': 0}


def test_race_replaces_an_earlier_race_only_with_overwrite(tiny_race, capsys):
    """Without --overwrite: refused before any run. With it, each run starts afresh: the curves
    are the new race's alone (not the earlier race's log read on). --help shows the race's keys."""
    out, _, data = tiny_race
    argv = ['race', f'--data_dir={data}', f'--out_dir={out}', *RACE_TINY, '--max_time=0.5']
    assert bench.main(argv) == 2 and '--overwrite' in capsys.readouterr().err
    code, text, _ = run_main(capsys, 'bench', 'race', '--help')  # the race's own keys
    assert code == 0 and 'same wall-clock budget' in text and '--max_time=420.0' in text
    assert len(bench.main([*argv, '--overwrite'])) == 2
    for curve in json.loads((out / 'race.json').read_text())['curves'].values():
        steps = [e['step'] for e in curve]
        assert steps[0] == 0 and steps == sorted(set(steps)) and curve[-1]['time'] < 1.5


def test_race_exits_1_when_a_run_fails(data, tmp_path, capsys):
    """A run that diverges (lr 1e30) stops; the race still writes its table, says which run
    stopped, and exits 1 though the other run ended well, so that a script running it learns the
    comparison is incomplete."""
    code = bench.main(['race', f'--data_dir={data}', f'--out_dir={tmp_path}', *RACE_TINY,
                       '--max_time=1', '--mixer.lr=1e30'])
    assert code == 1 and 'mixer stopped (exit 1)' in capsys.readouterr().out
    assert json.loads((tmp_path / 'race.json').read_text())['settings']['status'] == {
        'mixer': 1, 'llama': 0}


def race_children(out):
    """Live processes whose command line names a folder under out (the race's runs)."""
    cmds = {}
    for pid in filter(str.isdigit, os.listdir('/proc')):
        with contextlib.suppress(OSError):  # it ended meanwhile
            cmds[pid] = Path(f'/proc/{pid}/cmdline').read_bytes()
    return [pid for pid, cmd in cmds.items() if f'--out_dir={out}/'.encode() in cmd]


@pytest.mark.skipif(not os.path.isdir('/proc'), reason='reads /proc')
@pytest.mark.parametrize('stop', [signal.SIGINT, signal.SIGTERM], ids=['ctrl-c', 'kill'])
def test_race_ctrl_c_leaves_no_child_behind(data, tmp_path, stop):
    """SIGINT (or a kill's SIGTERM) to the race alone stops every run (in sessions of their own,
    they get SIGINT from the race), exits 130 and still writes what was measured."""
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, 'bench.py'), 'race', *RACE_TINY,
                             f'--data_dir={data}', f'--out_dir={tmp_path}', '--max_time=600',
                             '--eval_seconds=300'], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, start_new_session=True,
                            # a suite started in the background (cmd &) inherits SIGINT ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    logs = [tmp_path / arch / 'log.jsonl' for arch in ('mixer', 'llama')]
    try:
        deadline = time.time() + 120
        # step 0 evaluated: the run is training
        while time.time() < deadline and not all(log.exists() and 'val_loss' in log.read_text()
                                                 for log in logs):
            time.sleep(0.2)
        assert len(race_children(tmp_path)) == 2
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and 'interrupted' in err
    assert race_children(tmp_path) == []
    result = json.loads((tmp_path / 'race.json').read_text())
    assert result['settings']['interrupted']
    assert result['settings']['status'] == {'mixer': 130, 'llama': 130}  # SIGINT: as a Ctrl-C
    assert all(result['curves'][a] for a in ('mixer', 'llama'))  # step 0's evaluations


def ckpt_of(path, model):
    """A train.py-like checkpoint of model at path, its path."""
    torch.save({'kind': 'lm', 'model_config': dataclasses.asdict(model.cfg),
                'model': model.state_dict()}, str(path))
    return str(path)


@pytest.mark.parametrize('variant, matrices', [
    (dict(), ['mix']), (dict(n_heads=2), ['mix head 0', 'mix head 1']),
    (dict(kernel=3), ['mix (norm over 3 taps)']), (dict(expansion=2.0), ['mix', 'mix2']),
    (dict(n_convs=2), ['mix.0', 'mix.1']), (dict(softmax=True), ['mix']),
    (dict(arch='hybrid', hybrid_order='parallel'), ['mix']), (dict(arch='gmlp'), ['spatial'])])
def test_bench_weights_draws_every_mixing_matrix(tmp_path, variant, matrices):
    """A panel per layer, mixing and head, in one PNG beside the checkpoint; a table row each."""
    rows = bench.main(['weights', f'--ckpt={ckpt_of(tmp_path / "ckpt.pt", tiny(**variant))}'])
    assert [(r['layer'], r['matrix']) for r in rows] == [
        (f'layer {i}', m) for i in (1, 2) for m in matrices]
    assert (tmp_path / 'weights.png').read_bytes()[:4] == b'\x89PNG'
    model = tiny(**variant)  # the rows a model computes, not an expanded mix's rows past n_ctx
    assert all(M.shape[0] <= model.cfg.n_ctx for *_, M in bench.mixing_matrices(model))
    for r in rows:  # each fraction grows with k; n_ctx 16 < 64: all of it
        assert 0 <= r['within_1'] <= r['within_8'] <= r['within_64'] == pytest.approx(1)


def test_bench_weights_fractions_near_the_diagonal(tmp_path, capsys):
    """Identity W: all of a row's weight is at its own position. Uniform tril W: row t spreads it
    over its t + 1 inputs, min(k, t + 1) of them within the last k; softmax rows of equal logits
    are that uniform W. The table prints what the rows hold. --overwrite replaces the picture;
    --out's suffix names its format."""
    n = 16
    uniform = {k: sum(min(k, t + 1) / (t + 1) for t in range(n)) / n for k in (1, 8)}
    for W, softmax, within in ((torch.eye(n), False, {1: 1.0, 8: 1.0}), (torch.ones(n, n), False,
                               uniform), (torch.zeros(n, n), True, uniform)):
        model = tiny(n_layers=1, softmax=softmax)
        model.backbone.blocks[0].mixers[0].mix.weight.data[:] = W
        rows, out, _ = run_main(capsys, 'bench', 'weights', f'--out={tmp_path}/w.png',
                                f'--ckpt={ckpt_of(tmp_path / "ckpt.pt", model)}', '--positions=8',
                                '--overwrite')
        r, = rows
        assert (r['within_1'], r['within_8']) == pytest.approx((within[1], within[8]))
        assert r['within_64'] == pytest.approx(1) and 'the last k positions' in out
        assert f"| {bench.fmt(r['within_1'])} | {bench.fmt(r['within_8'])} | 1 |" in out
    assert (tmp_path / 'w.png').read_bytes()[:4] == b'\x89PNG'
    assert bench.main(['weights', f'--ckpt={tmp_path}/ckpt.pt', f'--out={tmp_path}/w.svg'])
    assert (tmp_path / 'w.svg').read_text().startswith('<?xml')  # the format its suffix names


def test_bench_weights_refuses_attention_and_no_ckpt(tmp_path, capsys):
    """Attention has no matrix of its own (it depends on the input): one error line, status 2."""
    llama = ckpt_of(tmp_path / 'llama.pt', tiny(arch='llama'))
    err = refused(capsys, 'bench', ['weights', f'--ckpt={llama}'], 'llama')
    assert 'depends on the input' in err and not (tmp_path / 'weights.png').exists()
    refused(capsys, 'bench', ['weights'], '--ckpt')


def test_race_over_context_lengths(data, tmp_path, capsys):
    """--n_ctx=8,16: a race in each of ctx8/ and ctx16/, the second at half the first's batch
    (tokens per step held) unless --batch_size lists one per n_ctx, then context.md and
    context.png; a batch that does not divide, or a --batch_size list of another length, is
    refused before any run."""
    argv = ['race', f'--data_dir={data}', f'--out_dir={tmp_path}', *RACE_TINY, '--max_time=1',
            '--eval_seconds=0.5', '--batch_size=4']
    refused(capsys, 'bench', [*argv, '--n_ctx=8,12'], '--n_ctx=12')
    refused(capsys, 'bench', [*argv, '--n_ctx=8,16', '--batch_size=4,2,1'], '--batch_size')
    cells = bench.race_cells([*argv, '--n_ctx=8,16', '--batch_size=3,5'])  # settings, no run
    assert [(c.n_ctx, c.batch_size, c.out_dir) for c in cells] == [
        (8, 3, f'{tmp_path}/ctx8'), (16, 5, f'{tmp_path}/ctx16')]
    one, = bench.race_cells([*argv, '--n_ctx=8'])  # one n_ctx: the race as it always was
    assert (one.n_ctx, one.batch_size, one.out_dir) == (8, 4, str(tmp_path))
    rows = bench.main([*argv, '--n_ctx=8,16'])
    assert [(r['n_ctx'], r['batch_size']) for r in rows] == [(8, 4), (16, 2)]
    assert all(r['mixer_steps'] > 0 and isinstance(r['llama-mixer'], float) for r in rows)
    for n, batch in ((8, 4), (16, 2)):
        race = json.loads((tmp_path / f'ctx{n}/race.json').read_text())
        assert all(r['tokens'] == 32 * r['steps'] for r in race['table'])  # batch x n_ctx
        assert (tmp_path / f'ctx{n}/race.png').read_bytes()[:4] == b'\x89PNG'
    assert '| n_ctx | batch_size | mixer_steps |' in (tmp_path / 'context.md').read_text()
    assert (tmp_path / 'context.png').read_bytes()[:4] == b'\x89PNG'
    assert 'context sweep' in capsys.readouterr().out
    refused(capsys, 'bench', [*argv, '--n_ctx=32,64'], 'earlier sweep')  # context.md: not unasked


def test_race_sweep_exits_with_its_worst_race(data, tmp_path, monkeypatch):
    """A sweep's status is its worst race's: 1 if a run failed (a later race's 0 does not hide
    it), 130 at an interrupt, which stops the sweep."""
    argv = ['race', f'--data_dir={data}', f'--out_dir={tmp_path}', *RACE_TINY, '--max_time=1',
            '--n_ctx=8,16', '--overwrite']
    for codes, status in ([1, 0], 1), ([0, 1], 1), ([130, 1], 130):
        ran = []
        monkeypatch.setattr(bench, 'race_cell',
                            lambda c: ran.append(c.n_ctx) or ([], codes[len(ran) - 1]))
        assert bench.main(argv) == status and ran == ([8] if status == 130 else [8, 16])


def test_race_reads_only_whole_log_lines(tmp_path, monkeypatch):
    """A run's log read as it is written: an evaluation cut short at its end waits for the next
    read (no JSON error). The race's SIGTERM handler is put back after it (here: pytest's)."""
    class Run:  # a train.py that logged an evaluation and half the next, then exited 0
        returncode, pid = 0, -1  # no process group: os.killpg refuses it (EINVAL)

        def __init__(self, *args, **kw):
            (tmp_path / 'mixer').mkdir(exist_ok=True)
            (tmp_path / 'mixer/log.jsonl').write_text(json.dumps(dict(
                step=0, time=0.0, tokens_seen=0, val_loss=5.0)) + '\n{"step": 5, "val_loss": 4.')

        def poll(self):
            return 0
    monkeypatch.setattr(bench.subprocess, 'Popen', Run)
    s = SimpleNamespace(dev=torch.device('cpu'), archs=['mixer'], out_dir=str(tmp_path),
                        runs={'mixer': []})
    before = signal.getsignal(signal.SIGTERM)
    curves, status, interrupted = bench.race_runs(s)
    assert [e['step'] for e in curves['mixer']] == [0] and status == {'mixer': 0}
    assert signal.getsignal(signal.SIGTERM) is before


def test_race_table_seconds_to_each_best():
    """s_to_X_best: the training seconds at which a run first reaches X's best val loss (its own
    best included, reached at its best evaluation), else never."""
    ev = lambda step, time, loss: dict(step=step, time=time, tokens_seen=10 * step,  # noqa: E731
                                       val_loss=loss)
    curves = {'mixer': [ev(0, 0.0, 9.0), ev(10, 5.0, 4.0), ev(20, 10.0, 3.0)],
              'llama': [ev(0, 0.0, 9.0), ev(10, 5.0, 4.0), ev(20, 10.0, 3.5)]}
    rows = {r['arch']: r for r in bench.race_table(curves)}
    assert rows['mixer']['s_to_mixer_best'] == 10.0 and rows['mixer']['s_to_llama_best'] == 10.0
    assert rows['llama']['s_to_llama_best'] == 10.0 and rows['llama']['s_to_mixer_best'] == 'never'
    assert rows['mixer']['best_val'] == 3.0 and rows['llama']['final_val'] == 3.5
    assert rows['mixer']['tokens_per_s'] == 20.0


def test_bench_represent_loss_is_the_recovered_inputs_distance():
    """loss is the L1 distance of O(e_N), the recovered embeddings' output, to O(e): two steps of
    descent from e_0 ~ N(1/2, 1/20) on an identity layer leave it far above epsilon, unconverged."""
    model = tiny()
    with torch.no_grad():
        for p in model.backbone.blocks.parameters():
            p.zero_()
    for r in bench.represent_rows(model, tokens(128), [2], steps=2, lr=0.05):
        assert r['loss'] > r['epsilon'] > 0 and r['converged'] == 0


def test_bench_represent_last_inverts_from_the_last_position():
    """'last' fits the last position's output alone: with every other position a pad (not counted,
    eq. 6), an identity layer gives the last token back."""
    model = tiny()
    with torch.no_grad():
        for p in model.backbone.blocks.parameters():
            p.zero_()
    idx = tokens(128)
    idx[:, :-1] = 0
    rows = bench.represent_rows(model, idx, [2], steps=500, lr=0.05, pad_id=0)
    assert {r['positions']: r['hamming'] for r in rows} == {'all': 0, 'last': 0}


def test_bench_represent_refuses_a_layer_out_of_range():
    """Layers count from 1: layer 0 (or past the last) is refused, not read as blocks[-1]."""
    model = tiny()
    for layer in (0, 3):
        with pytest.raises(ValueError, match=f'--layer={layer} is out of range'):
            bench.layer_output_fn(model.backbone, tokens(128), layer)


def test_near_mass_averages_the_rows_that_hold_weight():
    """A row without weight (a reverse mixing's last rows, say) is left out of the mean, not NaN."""
    M = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert bench.near_mass(M, 1) == pytest.approx((1 + 0.5) / 2)


def test_bench_memory_cell_counts_a_memory_error_as_out_of_memory(monkeypatch, capsys):
    """Under --mem_limit Python's own allocations fail with MemoryError, torch's with RuntimeError:
    either is the cell's OOM (mb None), not a failed cell."""
    s = bench.settings(['memory', *BENCH_TINY, '--archs=mixer', '--mem_limit=0'])

    def no_memory(cfg):
        raise MemoryError
    monkeypatch.setattr(bench, 'Backbone', no_memory)
    capsys.readouterr()
    bench.memory_cell(s)
    assert json.loads(capsys.readouterr().out) == {'mb': None}


def test_bench_generate_rate_is_per_decoded_token_per_row(monkeypatch):
    """tokens/s: batch rows over the median seconds per token after the first (the prefill's
    stamp), here 0.5 s a token behind a 5 s prefill."""
    monkeypatch.setattr(bench, 'decode_stamps', lambda *args: [5.0, 5.5, 6.0, 6.5])
    rows = bench.main(['generate', '--archs=mixer', *BENCH_TINY, '--batch_size=1,3',
                       '--prompt=4', '--new_tokens=4'])
    assert [(r['method'], r['batch_size'], r['tokens_per_s']) for r in rows] == [
        ('window', 1, 2.0), ('cache', 1, 2.0), ('cache', 3, 6.0)]


def test_race_settings_route_shared_and_per_arch_flags_and_presets(data, tmp_path):
    """--KEY=VALUE reaches every arch and --ARCH.KEY=VALUE its own, winning over the shared one;
    --presets go one per arch in --archs order. A preset's step budget is dropped: a race is of
    time (the shipped presets hold 7,000 and 5,000 steps)."""
    for arch, width in (('mixer', 48), ('llama', 64)):
        (tmp_path / f'{arch}.py').write_text(f"arch = '{arch}'\nd_model = {width}\nmax_iters = 9\n")
    s = bench.race_settings(['race', f'--data_dir={data}', f'--out_dir={tmp_path}/race',
                             f'--presets={tmp_path}/mixer.py,{tmp_path}/llama.py', '--lr=1e-3',
                             '--llama.lr=2e-3'])
    cfg = {a: configurator.parse_args(s.runs[a], train.DEFAULTS, '', train.CHOICES)
           for a in s.archs}
    assert [(c['arch'], c['d_model'], c['lr'], c['max_iters']) for c in cfg.values()] == [
        ('mixer', 48, 1e-3, 0), ('llama', 64, 2e-3, 0)]
