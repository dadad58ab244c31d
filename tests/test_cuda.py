"""The GPU code paths (skipped without a GPU; on one: python -m pytest -q tests/test_cuda.py)."""
import contextlib

import pytest
import torch

import bench, sample
from model import ModelConfig
from tests.conftest import (V, N_CTX, name, VARIANTS, PADDED, assert_causal, window_equals_cache,
                            reference_attention, learns, interrupted_and_resumed, cuda, tiny,
                            perturbed, padded_batch, tiny_model, prompt, decode, TINY, train_run,
                            records, run_main, torchrun)


AMP = {'float32': contextlib.nullcontext,
       'bfloat16': lambda: torch.autocast('cuda', torch.bfloat16),
       'float16': lambda: torch.autocast('cuda', torch.float16)}


@cuda
@pytest.mark.parametrize('amp', ['float32', 'bfloat16'])
@pytest.mark.parametrize('variant,padding', [(v, None) for v in VARIANTS] + PADDED,
                         ids=lambda x: name(x) if isinstance(x, dict) else str(x))
def test_cuda_future_tokens_never_reach_past_logits(variant, padding, amp):
    """test_model.py's causality test on the GPU kernels (cuBLAS, SDPA), fp32 and bf16 autocast."""
    gen = torch.Generator().manual_seed(1)
    idx, mask = padded_batch(padding, gen)
    model = perturbed(tiny(**variant), 0.05).cuda()
    assert_causal(model, idx.cuda(), None if mask is None else mask.cuda(), gen, AMP[amp])


@cuda
@pytest.mark.parametrize('kernel,amp,padding', [
    ('flash', 'bfloat16', None), ('flash', 'float16', None), ('efficient', 'float32', None),
    ('efficient', 'float32', 'left'), ('efficient', 'bfloat16', 'right')])
@pytest.mark.parametrize('arch', ['llama', 'gpt'])
def test_cuda_sdpa_kernels_match_explicit_attention(arch, kernel, amp, padding, no_tf32):
    """SDPA's flash and memory-efficient kernels, each forced (an unusable one raises), against the
    attention written out in float64."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    # head dim 32
    cfg = ModelConfig(arch=arch, vocab_size=V, n_ctx=64, d_model=128, n_layers=1, n_heads=4)
    attn = perturbed(cfg, 0.05).backbone.blocks[0].mixers[0]
    x = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(0))
    mask = None
    if padding:  # row 1 loses 9 tokens on the left or the right
        mask = torch.ones(2, 64, dtype=torch.bool)
        mask[1, slice(0, 9) if padding == 'left' else slice(55, 64)] = False
    want = reference_attention(x.double(), attn.double(), mask)
    attn.float().cuda()
    backend = {'flash': SDPBackend.FLASH_ATTENTION,
               'efficient': SDPBackend.EFFICIENT_ATTENTION}[kernel]
    with sdpa_kernel(backend), AMP[amp]():
        got = attn(x.cuda(), mask=None if mask is None else mask.cuda())
    tol = 1e-5 if amp == 'float32' else 3e-2
    torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)


@cuda
@pytest.mark.parametrize('variant', VARIANTS, ids=name)
def test_cuda_window_equals_cache(variant, no_tf32):
    """window == cache on the GPU (fp32): the same greedy tokens through a slide."""
    window_equals_cache(tiny_model(**variant).cuda(), prompt(5).cuda())


@cuda
@pytest.mark.parametrize('variant', [v for v in VARIANTS if v.get('arch') != 'elita'], ids=name)
def test_cuda_graph_step_replays_the_eager_step(variant, no_tf32):
    """sample.GraphStep over the eager step: the eager tokens and logits through a slide, for a
    first stream (captures), a second (its buffers adopted, replays) and another batch size."""
    model = tiny_model(**variant).cuda()
    step = sample.GraphStep(model.step)
    for idx in (prompt(5), prompt(5, seed=2), prompt(3, seed=3, batch=1)):
        got = decode(model, idx.cuda(), N_CTX + N_CTX // 2, 'cache', step=step)
        want = decode(model, idx.cuda(), N_CTX + N_CTX // 2, 'cache')
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])  # the same kernels: fp32 rounding at most


@cuda
@pytest.mark.parametrize('arch', ['mixer', 'llama'])
def test_cuda_compiled_decode_step_equals_eager(arch, no_tf32):
    """sample.compiled_step (inductor's kernels in CUDA graphs): the eager tokens and logits."""
    model = tiny_model(arch=arch).cuda()
    torch._dynamo.reset()
    step = sample.compiled_step(model)
    tok_c, logit_c = decode(model, prompt(5).cuda(), N_CTX + N_CTX // 2, 'cache', step=step)
    tok_e, logit_e = decode(model, prompt(5).cuda(), N_CTX + N_CTX // 2, 'cache')
    assert torch.equal(tok_c, tok_e)
    torch.testing.assert_close(logit_c, logit_e, atol=1e-4, rtol=0)
    torch._dynamo.reset()


@cuda
@pytest.mark.parametrize('dtype', ['float16', 'bfloat16', 'float32'])
@pytest.mark.parametrize('arch', ['mixer', 'llama', 'gpt'])
def test_cuda_training_learns(data, tmp_path, arch, dtype):
    """train.py on the GPU lowers the loss in each dtype; fp16 with a GradScaler, saved."""
    ckpt = learns(data, tmp_path, '--device=cuda', f'--dtype={dtype}', f'--arch={arch}')
    assert (ckpt['scaler'] is not None and ckpt['scaler']['scale'] > 0) == (dtype == 'float16')


@cuda
@pytest.mark.parametrize('arch', ['mixer', 'llama'])
def test_cuda_compile_follows_the_eager_loss_curve(data, tmp_path, arch):
    """train.py --compile on the GPU: the eager run's losses, step for step, within 1 %."""
    curves = []
    for run, extra in (('eager', []), ('compiled', ['--compile'])):
        assert train_run(data, tmp_path / run, '--device=cuda', '--dtype=bfloat16',
                         f'--arch={arch}', '--max_iters=20', '--eval_interval=20', *extra) == 0
        curves.append([r['loss'] for r in records(tmp_path / run, 'loss')])
    assert len(curves[0]) == 4
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), rtol=1e-2, atol=0)


@cuda
def test_cuda_torchrun_one_process_is_ddp_over_nccl(data, tmp_path):
    """torchrun --nproc_per_node=1 wraps the model in DDP over nccl (as on N GPUs) and trains."""
    proc = torchrun('train.py', [*TINY, f'--data_dir={data}', f'--out_dir={tmp_path}',
                                 '--device=cuda', '--max_iters=10', '--eval_interval=10'], nproc=1)
    assert 'DDP over nccl, 1 process(es)' in proc.stdout
    evals = records(tmp_path, 'val_loss')
    assert evals[-1]['step'] == 10 and evals[-1]['train_loss'] < evals[0]['train_loss']


@cuda
def test_cuda_kill9_then_resume_continues_the_run(data, tmp_path):
    """kill -9 mid-run and --init_from=resume on the GPU: the uninterrupted run's weights and losses
    (not bit for bit: CUDA's embedding backward adds with atomics, in any order)."""
    args = [f'--data_dir={data}', *TINY, '--device=cuda', '--dtype=float32', '--max_iters=300',
            '--eval_interval=25', '--log_interval=1']
    a, b = interrupted_and_resumed(args, tmp_path)
    for k in a['model']:
        torch.testing.assert_close(b['model'][k], a['model'][k], atol=1e-4, rtol=1e-3)
    for x, y in zip(records(tmp_path / 'a', 'loss'), records(tmp_path / 'b', 'loss')):
        assert x['step'] == y['step'] and abs(x['loss'] - y['loss']) < 1e-3


@cuda
def test_cuda_sample_and_bench(trained, capsys):
    """sample.py on the GPU (window == cache, greedy, fp32 weights) and each bench.py mode's GPU
    path: MFU against train.peak_flops, peaks from max_memory_allocated, decoding rates."""
    argv = [f'--ckpt={trained}/ckpt.pt', '--prompt=def f2_1(x):', '--max_new_tokens=40',
            '--temperature=0', '--device=cuda', '--dtype=float32']
    code, cached, _ = run_main(capsys, 'sample', *argv)
    assert code == 0 and run_main(capsys, 'sample', *argv, '--method=window')[1] == cached
    assert run_main(capsys, 'sample', *argv, '--compile')[1] == cached
    gpu = ['--d_model=64', '--n_layers=1', '--vocab_size=128', '--device=cuda', '--dtype=bfloat16']
    rows = bench.main(['throughput', *gpu, '--n_ctx=64', '--batch_size=2', '--repeats=2'])
    assert len(rows) == 3 and all(0 < r['mfu'] < 1 for r in rows)
    rows = bench.main(['memory', *gpu, '--archs=mixer', '--n_ctx=256,1024'])
    assert 0 < rows[0]['mb'] < rows[1]['mb']
    rows = bench.main(['generate', *gpu, '--n_ctx=64', '--prompt=16', '--new_tokens=8',
                       '--batch_size=1,4'])
    assert len(rows) == 3 * 3 and all(r['tokens_per_s'] > 0 for r in rows)


@pytest.fixture
def no_tf32():
    """Exact comparisons need true fp32 matmuls (train.py turns TF32 on for the whole process)."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
