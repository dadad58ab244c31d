"""Code search in one CPU hour (paper §6), step 1 of 2, transformer side:
config/codesearch_mixer.py's run (same data, chunks from position 0, size and batch) with a
Llama-style model at its own rate, its step budgets sized to the mixer's minutes on 2 cores of the
AVX512-BF16 kind (the paper compares at equal compute): 5,000 here, 5,500 of InfoNCE at --lr=1e-3,
the better of four rates on data/site's val pairs:
python train.py config/codesearch_llama.py
python retrieve.py train --init_from=out/codesearch_llama/ckpt.pt --data_dir=data/site \
    --out_dir=out/codesearch_llama_nce --pool=mean --tau=0.05 --symmetric=True --lr=1e-3 \
    --max_iters=5500 --eval_interval=1100"""
data_dir = 'data/site'
out_dir = 'out/codesearch_llama'
arch = 'llama'
n_heads = 4
d_model = 256
n_layers = 4
n_ctx = 128
batch_mode = 'documents'
batch_size = 16
lr = 1.5e-3
warmup_iters = 50
max_iters = 5000           # the mixer's 7,000 steps take as long
max_time = 0.0
eval_interval = 1000
eval_iters = 10
log_interval = 50
