"""Retrieval on pystdlib in one CPU hour (paper §6), transformer side: config/retrieval_mixer.py's
run (same data, left padding, size, batch and wall-clock budget) with a Llama-style model at its
own rate.
OMP_NUM_THREADS=1 python train.py config/retrieval_llama.py
OMP_NUM_THREADS=1 python retrieve.py train --init_from=out/retrieval_llama/ckpt.pt \
    --out_dir=out/retrieval_llama_nce ..."""
data_dir = 'data/pystdlib'
out_dir = 'out/retrieval_llama'
arch = 'llama'
n_heads = 4
d_model = 256
n_layers = 4
n_ctx = 128
batch_mode = 'documents'
padding = 'left'
batch_size = 16
lr = 1.5e-3
warmup_iters = 50
max_iters = 0
max_time = 1980.0          # 33 minutes of training, evaluation excluded
eval_interval = 250
eval_iters = 10
log_interval = 25
