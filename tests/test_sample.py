"""sample.py: the command line, greedy window == cache, compiled decoding, streaming."""
import dataclasses, re, subprocess, sys, types

import pytest
import torch

import retrieve, sample, train
from model import ModelConfig
from prepare import Tokenizer
from tests.conftest import (HERE, VOCAB, N_CTX, name, VARIANTS, perturbed, tiny_model, prompt,
                            decode, ENV, run_main, without_paths, cpu_kind, make_ckpt)


@pytest.mark.parametrize('variant', VARIANTS, ids=name)
def test_decode_layout_changes_strides_not_tokens(variant):
    """decode_layout (sample.py and bench.py call it) stores wide Linear weights column-major for
    faster batch-1 GEMVs: the same greedy tokens, logits equal up to summation order."""
    model = tiny_model(**variant)
    idx = prompt(5)
    before = decode(model, idx, N_CTX, 'cache')
    sample.decode_layout(model)
    wide = [m.weight for m in model.modules()
            if isinstance(m, torch.nn.Linear) and m.out_features > m.in_features]
    assert wide and all(w.t().is_contiguous() for w in wide)
    after = decode(model, idx, N_CTX, 'cache')
    assert torch.equal(before[0], after[0])
    torch.testing.assert_close(before[1], after[1], atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize('arch', ['mixer', 'llama'])
def test_compiled_decode_step_traces_once_for_all_positions(arch):
    """A compiled model.step: one dynamic-shape graph for every position, the same tokens and
    logits. The 'eager' backend checks the tracing in seconds; inductor's code is left to bench.py
    --compile."""
    from torch._dynamo.utils import counters
    model = tiny_model(arch=arch)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(model.step, dynamic=True, backend='eager')
    steps = N_CTX + N_CTX // 2                                      # through a slide
    tok_c, logit_c = decode(model, prompt(5), steps, 'cache', step=step)
    tok_e, logit_e = decode(model, prompt(5), steps, 'cache')
    assert torch.equal(tok_c, tok_e) and torch.equal(logit_c, logit_e)
    # not one per position
    assert 1 <= counters['stats']['unique_graphs'] <= 2, dict(counters['stats'])
    torch._dynamo.reset()


def test_compiled_decode_step_freezes_each_models_weights():
    """sample.compiled_step on CPU: inductor with the weights frozen in as constants (max-autotune's
    own GEMVs). Two models compiled side by side each decode their own eager tokens; changed weights
    are refused."""
    torch._dynamo.reset()
    models = [perturbed(ModelConfig(vocab_size=VOCAB, n_ctx=N_CTX, d_model=16, n_layers=1), 0.1,
                        seed).eval() for seed in (0, 1)]
    # one choice: no timing runs
    with torch._inductor.config.patch(max_autotune_gemm_backends='CPP'):
        steps = [sample.compiled_step(model) for model in models]
        # the second round runs each model's graph again, after the other's compile
        for _ in range(2):
            for model, step in zip(models, steps):
                tok_c, logit_c = decode(model, prompt(5), 6, 'cache', step=step)
                tok_e, logit_e = decode(model, prompt(5), 6, 'cache')
                assert torch.equal(tok_c, tok_e)
                torch.testing.assert_close(logit_c, logit_e, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        models[0].lm_head.weight.add_(1.0)
    with pytest.raises(ValueError, match='weights changed'):
        decode(models[0], prompt(5), 2, 'cache', step=steps[0])
    torch._dynamo.reset()


def test_cli_seeds_batches_and_prompts(trained, data, tmp_path, capsys):
    """Same seed, same sample (from out_dir's best.pt); --num_samples=N decodes N rows in one batch,
    different at temperature 1, each the batch-1 sample when greedy. No prompt starts from BOS;
    FILE: reads a file; a long prompt keeps its last n_ctx - 1 tokens, announced."""
    argv = [f'--out_dir={trained}', '--prompt=def f1_', '--max_new_tokens=40', '--seed=3']
    code, out, err = run_main(capsys, 'sample', *argv)
    assert code == 0 and 'best.pt' in err and out.startswith('def f1_')
    assert len(out) > len('def f1_\n')
    assert run_main(capsys, 'sample', *argv)[1] == out
    assert run_main(capsys, 'sample', *argv[:-1], '--seed=4')[1] != out
    two = run_main(capsys, 'sample', *argv, '--num_samples=2')[1]
    first, second = two.split('\n' + '-' * 40 + '\n')
    assert first.startswith('def f1_') and second.startswith('def f1_') and first != second
    assert run_main(capsys, 'sample', *argv, '--num_samples=2')[1] == two
    one = run_main(capsys, 'sample', *argv, '--temperature=0')[1]
    three = run_main(capsys, 'sample', *argv, '--temperature=0', '--num_samples=3')[1]
    assert three == (one + '-' * 40 + '\n') * 2 + one
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
    tok = Tokenizer.from_dir(data)
    kept = tok.decode(tok.encode(long)[-31:])
    assert long.endswith(kept) and out.startswith(kept) and len(out) > len(kept) + 1


@pytest.mark.parametrize('native', [False, True], ids=['avx2', 'native-bf16'])
@pytest.mark.parametrize('arch', ['mixer', 'llama'])
def test_cli_greedy_window_equals_cache(arch, native, trained, tmp_path, monkeypatch, capsys):
    """Through the CLI at the default flags and past the 32-token window, on either kind of CPU
    (mocked): the trained mixer, and a llama checkpoint (fresh weights) with its KV cache and
    without. The bfloat16 weights path runs too."""
    cpu_kind(monkeypatch, native)
    ckpt = trained / 'ckpt.pt'
    if arch == 'llama':
        saved = train.load_checkpoint(ckpt)
        cfg = ModelConfig(**{**saved['model_config'], 'arch': 'llama'})
        ckpt = tmp_path / 'llama.pt'
        train.save_checkpoint({**saved, 'model_config': dataclasses.asdict(cfg),
                               'model': perturbed(cfg, 0.2).state_dict()}, ckpt)
    argv = [f'--ckpt={ckpt}', '--prompt=def f2_1(x):', '--max_new_tokens=70', '--temperature=0']
    code, cached, _ = run_main(capsys, 'sample', *argv)
    assert code == 0 and len(cached) > len('def f2_1(x):\n')
    assert run_main(capsys, 'sample', *argv, '--method=window')[1] == cached
    code, out, _ = run_main(capsys, 'sample', *argv, '--dtype=bfloat16')
    assert code == 0 and out.startswith('def f2_1(x):') and len(out) > len(cached) // 2


def test_sample_compile_keeps_the_terminal_clean(data, tmp_path, capsys):
    """sample.py --compile, first use (an empty inductor cache, so max-autotune times its kernels):
    no autotune tables on stderr, the compile time on a line of its own, then the usual tokens/s
    line, and the eager run's text. Costs ~30-60 s on 2 busy cores (inductor builds C++ kernels)."""
    ckpt = make_ckpt(tmp_path / 'tiny.pt', data, d_model=16, n_layers=1)
    argv = [f'--ckpt={ckpt}', '--prompt=def f', '--max_new_tokens=6', '--temperature=0']
    eager = run_main(capsys, 'sample', *argv)[1]
    fresh = dict(ENV, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / 'inductor'))
    r = subprocess.run([sys.executable, 'sample.py', *argv, '--compile'], capture_output=True,
                       text=True, cwd=HERE, env=fresh, timeout=600)
    lines = r.stderr.splitlines()
    assert r.returncode == 0 and len(lines) == 3 and lines[0].startswith('sampling from'), r.stderr
    assert re.fullmatch(r'compiled the cached step in \d+\.\d s .*', lines[1]), r.stderr
    assert re.fullmatch(r'\d+ tokens .* in \d+\.\d+ s \(\d+\.\d tokens/s\)', lines[2]), r.stderr
    assert r.stdout == eager


def test_stream_prints_whole_characters_and_each_row_stops_at_its_eos(capsys):
    """Tokens are UTF-8 bytes here, so a character can span tokens (as with byte-fallback BPE
    pieces): no U+FFFD pieces of it print; nothing after a row's end of document (the batch stops
    when all rows have); a sample ending inside a character prints all it decodes to."""
    text, eos, x = 'naïve ✓ 😀!', 256, ord('x')
    tok = types.SimpleNamespace(eos_id=eos,
                                decode=lambda ids: bytes(i for i in ids if i < 256).decode(
        'utf-8', errors='replace'))

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
    was trained in, so both decoding methods print the same text; --dtype=bfloat16 is honoured."""
    saved = train.load_checkpoint(trained / 'ckpt.pt')
    for recorded in ('bfloat16', 'float16'):
        train.save_checkpoint({**saved, 'dtype': recorded}, tmp_path / f'{recorded}.pt')
    for native, recorded in ((False, 'bfloat16'), (True, 'bfloat16'), (True, 'float16')):
        cpu_kind(monkeypatch, native)
        ckpt = tmp_path / f'{recorded}.pt'
        assert retrieve.Embedder(ckpt, 'cpu').dtype == torch.float32
        for method in ('cache', 'window'):
            code, _, err = run_main(capsys, 'sample', f'--ckpt={ckpt}', '--max_new_tokens=2',
                                    '--device=cpu', f'--method={method}')
            assert code == 0 and 'cpu float32' in err, err
    for method in ('cache', 'window'):
        code, _, err = run_main(capsys, 'sample', f'--ckpt={tmp_path}/float16.pt', '--device=cpu',
                                '--max_new_tokens=2', '--dtype=bfloat16', f'--method={method}')
        assert code == 0 and 'cpu bfloat16' in err, err
    assert retrieve.Embedder(tmp_path / 'float16.pt', 'cpu', 'bfloat16').dtype == torch.bfloat16
