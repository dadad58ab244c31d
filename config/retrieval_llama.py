"""Retrieval pretraining on pystdlib, following paper §6.1's left padding (CPU-sized, not the
paper's sizes), transformer side: config/retrieval_mixer.py's run
(same data, left padding, size, batch and budget) with a Llama-style model, at the paper's
transformer:mixer learning-rate ratio (2e-4 : 5e-4).
python train.py config/retrieval_llama.py && python retrieve.py train --init_from=out/retrieval_llama/ckpt.pt ..."""
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
lr = 1.2e-3
warmup_iters = 50
max_iters = 0
max_time = 180.0
eval_interval = 250
eval_iters = 10
log_interval = 25
