"""Retrieval on pystdlib in one CPU hour (paper §6), mixer side, step 1 of 2: causal language
modelling on left-padded document chunks (§6.1), so a text's last token sits at the window's last
position, where retrieve.py reads embeddings. config/retrieval_llama.py is the same run with a
transformer; run both at once, one thread each, so they share the machine's load (README,
Retrieval). Size, lr and budget are CPU-sized choices, not the paper's (it pretrained d_model
512-1024 models for hours on FineWeb).
OMP_NUM_THREADS=1 python train.py config/retrieval_mixer.py
OMP_NUM_THREADS=1 python retrieve.py train --init_from=out/retrieval_mixer/ckpt.pt \
    --out_dir=out/retrieval_mixer_nce ..."""
data_dir = 'data/pystdlib'
out_dir = 'out/retrieval_mixer'
arch = 'mixer'
d_model = 256
n_layers = 4
n_ctx = 128
batch_mode = 'documents'
padding = 'left'
batch_size = 16
lr = 5e-3                  # mixers take larger rates than transformers (paper 5e-4 : 2e-4)
warmup_iters = 50
max_iters = 0
max_time = 1980.0          # 33 minutes of training, evaluation excluded
eval_interval = 250
eval_iters = 10
log_interval = 25
