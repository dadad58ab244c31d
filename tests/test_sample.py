"""sample.py: the command line, greedy window == cache, compiled decoding and its CUDA graphs'
bookkeeping, streaming."""
import contextlib, dataclasses, os, re, shutil, types

import pytest
import torch

import retrieve, sample, train
from model import ModelConfig
from tests.conftest import (N_CTX, name, VARIANTS, perturbed, tiny_model, prompt, decode, run_main,
                            without_paths, cpu_kind, train_run, tokenizer, make_ckpt)


@pytest.mark.parametrize('variant', VARIANTS, ids=name)
def test_decode_layout_changes_strides_not_tokens(variant):
    """decode_layout (sample.py and bench.py call it) stores wide Linear weights column-major for
    faster batch-1 GEMVs (square and tall ones left alone): the same greedy tokens, logits equal up
    to summation order."""
    model = tiny_model(**variant)
    before = decode(model, prompt(5), N_CTX, 'cache')
    sample.decode_layout(model)
    wide = [m.weight for m in model.modules()
            if isinstance(m, torch.nn.Linear) and m.out_features > m.in_features]
    assert wide and all(w.t().is_contiguous() for w in wide)
    rest = [m.weight for m in model.modules()  # square and tall ones: as they were
            if isinstance(m, torch.nn.Linear) and m.out_features <= m.in_features]
    assert rest and all(w.is_contiguous() for w in rest)
    after = decode(model, prompt(5), N_CTX, 'cache')
    assert torch.equal(before[0], after[0])
    torch.testing.assert_close(before[1], after[1], atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize('arch', ['mixer', 'llama'])
def test_compiled_step_decodes_as_eager_without_a_graph_per_position(arch):
    """sample.compiled_step (inductor's CPU code) through a slide: dynamic shapes, so not a graph
    per position; the eager step's greedy tokens, its fp32 logits up to summation order."""
    from torch._dynamo.utils import counters
    model = tiny_model(arch=arch)
    torch._dynamo.reset()
    counters.clear()
    steps = N_CTX + N_CTX // 2
    tok_c, logit_c = decode(model, prompt(5), steps, 'cache', step=sample.compiled_step(model))
    tok_e, logit_e = decode(model, prompt(5), steps, 'cache')
    assert torch.equal(tok_c, tok_e)
    torch.testing.assert_close(logit_c, logit_e, atol=1e-5, rtol=1e-5)
    # not one per position: a window's last one gets its own
    assert counters['stats']['unique_graphs'] <= 2, dict(counters['stats'])


class FakeGraph:
    """torch.cuda's graphs and streams stood in for on a CPU: a capture keeps the step's call (its
    arguments: the token tensor and the buffers the Cache held then); a replay repeats it."""
    capturing = []

    def replay(self):
        self.out.copy_(self.step(*self.args))

    def wait_stream(self, other):  # as a stream: a CPU runs everything in order
        pass

    @classmethod
    def recorded(cls, step):
        def call(idx, pos, cache):
            from torch._dynamo.utils import counters
            compiled = counters['stats']['unique_graphs']
            out = step(idx, pos, cache)
            if cls.capturing:  # a GPU cannot compile inside a capture: the warm-up must have
                assert counters['stats']['unique_graphs'] == compiled, f'compiled at {pos}'
                graph, buffers = cls.capturing[-1], type(cache)(cache.n_ctx)
                buffers.update(cache)
                graph.step, graph.args, graph.out = step, (idx, pos, buffers), out
            return out
        return call


@pytest.mark.parametrize('variant,compiled', [(dict(arch='mixer'), True),
                                              (dict(arch='llama'), False),
                                              (dict(arch='mixer', expansion=0.5), False),
                                              (dict(arch='hybrid'), False)], ids=str)
def test_graph_step_bookkeeping(variant, compiled, monkeypatch):
    """sample.GraphStep on a CPU, its graphs faked (tests/test_cuda.py runs the real ones): the
    eager tokens and logits through slides, for a first stream, a second (its buffers adopted)
    and another batch size, and no compile inside a capture."""
    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        FakeGraph.capturing.append(g)
        yield
        FakeGraph.capturing.pop()
    fakes = dict(CUDAGraph=FakeGraph, graph=graph, graph_pool_handle=lambda: None,
                 Stream=FakeGraph, current_stream=FakeGraph, stream=contextlib.nullcontext)
    for key, value in fakes.items():
        monkeypatch.setattr(torch.cuda, key, value)
    model = tiny_model(**variant)
    torch._dynamo.reset()
    step = torch.compile(model.step, dynamic=True) if compiled else model.step
    step = sample.GraphStep(FakeGraph.recorded(step))
    for idx in (prompt(5), prompt(5, seed=2), prompt(3, seed=3, batch=1)):
        got = decode(model, idx, 2 * N_CTX, 'cache', step=step)
        want = decode(model, idx, 2 * N_CTX, 'cache')
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-6)  # inductor's sums
    torch._dynamo.reset()


def test_cli_seeds_batches_and_prompts(trained, data, tmp_path, capsys):
    """Same seed, same sample (from out_dir's best.pt); --num_samples=N decodes N rows in one batch,
    different at temperature 1, each the batch-1 sample when greedy. No prompt starts from BOS;
    FILE: reads a file; a long prompt keeps its last n_ctx - 1 tokens, announced. --compile prints
    the greedy tokens, its compile time on a line apart from the tokens/s (new tokens / seconds)."""
    argv = [f'--out_dir={trained}', '--prompt=def f1_', '--max_new_tokens=40', '--seed=3']
    code, out, err = run_main(capsys, 'sample', *argv)
    assert code == 0 and 'best.pt' in err and out.startswith('def f1_') and len(out) > 8
    assert run_main(capsys, 'sample', *argv)[1] == out
    assert run_main(capsys, 'sample', *argv[:-1], '--seed=4')[1] != out
    two = run_main(capsys, 'sample', *argv, '--num_samples=2')[1]
    first, second = two.split('\n' + '-' * 40 + '\n')
    assert first.startswith('def f1_') and second.startswith('def f1_') and first != second
    one = run_main(capsys, 'sample', *argv, '--temperature=0')[1]
    _, three, err = run_main(capsys, 'sample', *argv, '--temperature=0', '--num_samples=3')
    assert three == (one + '-' * 40 + '\n') * 2 + one
    n, dt, rate = map(float, re.search(  # tokens/s: the new tokens over the seconds
        r'^(\d+) tokens \(3 samples in one batch\) in ([\d.]+) s \(([\d.]+) tokens/s\)$', err,
        re.M).groups())
    assert n > 0 and abs(rate * dt - n) <= 0.006 * rate + 1, err
    code, out, err = run_main(capsys, 'sample', *argv, '--temperature=0', '--compile')
    assert code == 0 and out == one, err
    assert err.splitlines()[-2].startswith('compiled the cached step in'), err
    code, out, err = run_main(capsys, 'sample', f'--out_dir={trained}', '--max_new_tokens=10')
    assert code == 0 and out.strip()
    (tmp_path / 'p.txt').write_text('def f7_1(x):\n')
    code, out, _ = run_main(capsys, 'sample', f'--out_dir={trained}',
                            f'--prompt=FILE:{tmp_path}/p.txt', '--max_new_tokens=5')
    assert code == 0 and out.startswith('def f7_1(x):\n')
    long = 'def f3_1(x):\n    return x\n' * 40
    code, out, err = run_main(capsys, 'sample', f'--out_dir={trained}', f'--prompt={long}',
                              '--max_new_tokens=5')
    assert code == 0 and '31' in without_paths(err)
    tok = tokenizer(data)
    kept = tok.decode(tok.encode(long)[-31:])
    assert long.endswith(kept) and out.startswith(kept) and len(out) > len(kept) + 1


def test_load_takes_causal_clm_and_mtp2_checkpoints_only(data, tmp_path):
    """sample.load rebuilds a clm or an mtp2 model (both predict the next token) and refuses, each
    by name, an unmasked one (it reads the token it predicts), one of objective half, and a window
    of one token (no room for a new one), before any token is printed."""
    cpu = torch.device('cpu')
    for objective in ('clm', 'mtp2'):
        model, tok, _ = sample.load(make_ckpt(tmp_path / 'ok.pt', data, objective=objective), cpu,
                                    'auto')
        assert model.cfg.objective == objective and tok.vocab_size == model.cfg.vocab_size
    for kw, says in ((dict(causal=False), 'causal=False'), (dict(objective='half'), 'half'),
                     (dict(n_ctx=1), 'n_ctx=1')):
        with pytest.raises(ValueError, match=says):
            sample.load(make_ckpt(tmp_path / 'no.pt', data, **kw), cpu, 'auto')


def test_a_checkpoint_carries_its_tokenizer(data, tmp_path, capsys):
    """train.py's checkpoint holds the tokenizer model its data was prepared with: sampling from it
    alone, the data folder deleted, prints what it printed with the folder there."""
    shutil.copytree(data, tmp_path / 'data')
    assert train_run(tmp_path / 'data', tmp_path / 'out', '--max_iters=2', '--eval_interval=2') == 0
    capsys.readouterr()
    carried = train.load_checkpoint(tmp_path / 'out/ckpt.pt')['tokenizer']
    assert carried['model'] == open(os.path.join(data, 'tokenizer.model'), 'rb').read()
    argv = [f'--ckpt={tmp_path}/out/ckpt.pt', '--prompt=def f3_', '--max_new_tokens=20',
            '--temperature=0']
    before = run_main(capsys, 'sample', *argv)
    shutil.rmtree(tmp_path / 'data')
    assert run_main(capsys, 'sample', *argv)[:2] == before[:2] == (0, before[1])
    assert before[1].startswith('def f3_')


@pytest.mark.parametrize('native', [False, True], ids=['avx2', 'native-bf16'])
@pytest.mark.parametrize('arch', ['mixer', 'llama'])
def test_cli_greedy_window_equals_cache(arch, native, trained, tmp_path, monkeypatch, capsys):
    """Through the CLI past the 32-token window, on either kind of CPU (mocked): the trained mixer,
    and a llama checkpoint (fresh weights) with its KV cache and without."""
    cpu_kind(monkeypatch, native)
    ckpt = trained / 'ckpt.pt'
    if arch == 'llama':
        saved = train.load_checkpoint(ckpt)
        cfg = ModelConfig(**{**saved['model_config'], 'arch': 'llama'})
        ckpt = tmp_path / 'llama.pt'
        torch.save({**saved, 'model_config': dataclasses.asdict(cfg),
                    'model': perturbed(cfg, 0.2).state_dict()}, ckpt)
    argv = [f'--ckpt={ckpt}', '--prompt=def f2_1(x):', '--max_new_tokens=70', '--temperature=0']
    code, cached, _ = run_main(capsys, 'sample', *argv)
    assert code == 0 and len(cached) > len('def f2_1(x):\n')
    assert run_main(capsys, 'sample', *argv, '--method=window')[1] == cached


def test_stream_prints_whole_characters_and_each_row_stops_at_its_eos(capsys):
    """Tokens are UTF-8 bytes here, so a character can span tokens (as with byte-fallback BPE
    pieces): no U+FFFD pieces of it print; nothing after a row's end of document (the batch stops
    when all rows have); a sample ending inside a character prints all it decodes to."""
    text, eos, x = 'naïve ✓ 😀!', 256, ord('x')
    tok = types.SimpleNamespace(eos_id=eos, decode=lambda ids: bytes(
        i for i in ids if i < 256).decode('utf-8', errors='replace'))

    def write(rows, prompt, *argv):
        # one fixed row per sequence, whatever the sampling arguments
        def stream(idx, max_new_tokens, **kw):
            assert len(idx) == len(rows)
            for step in zip(*rows):
                yield torch.tensor(step), None
        return sample.write_samples(types.SimpleNamespace(stream=stream), tok, list(prompt),
                                    sample.sample_args(['--max_new_tokens=100', *argv]),
                                    torch.Generator())
    assert write([list(text.encode()) + [eos, x]], b'') == len(text.encode())
    assert capsys.readouterr().out == text + '\n'
    write([list(b'ok\xe2\x9c')], b'>')
    assert capsys.readouterr().out == '>ok\ufffd\n'
    rows = [list(b'ab') + [eos, x, x, x], list(b'abcd') + [eos, x], list(b'a') + [eos, x, x, x, x]]
    assert write(rows, b'>', '--num_samples=3') == 2 + 4 + 1
    assert capsys.readouterr().out == '\n'.join(['>ab', '-' * 40, '>abcd', '-' * 40, '>a', ''])


def test_a_cpu_reads_checkpoints_in_float32(trained, tmp_path, monkeypatch, capsys):
    """sample.py and retrieve.py read a checkpoint in float32 on a CPU of either kind, whatever it
    was trained in; --dtype=bfloat16 is honoured."""
    saved = train.load_checkpoint(trained / 'ckpt.pt')
    for native, recorded in ((False, 'bfloat16'), (True, 'bfloat16'), (True, 'float16')):
        cpu_kind(monkeypatch, native)
        ckpt = tmp_path / f'{recorded}.pt'
        torch.save({**saved, 'dtype': recorded}, ckpt)
        assert retrieve.Embedder(ckpt, 'cpu').dtype == torch.float32
        code, _, err = run_main(capsys, 'sample', f'--ckpt={ckpt}', '--max_new_tokens=2',
                                '--device=cpu')
        assert code == 0 and 'cpu float32' in err, err
    code, _, err = run_main(capsys, 'sample', f'--ckpt={ckpt}', '--max_new_tokens=2',
                            '--device=cpu', '--dtype=bfloat16')
    assert code == 0 and 'cpu bfloat16' in err, err
    assert retrieve.Embedder(ckpt, 'cpu', 'bfloat16').dtype == torch.bfloat16
