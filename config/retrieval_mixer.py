"""Retrieval pretraining on pystdlib, following paper §6.1's left padding; size, lr and budget are
CPU-sized choices, not the paper's (it pretrained d_model 512-1024 models for hours on FineWeb).
Mixer side: a small masked mixer trained for causal language modelling on left-padded document
chunks, so the last real token always sits at the window's last position, where retrieve.py reads
embeddings. config/retrieval_llama.py is the same run with a transformer.
python train.py config/retrieval_mixer.py && python retrieve.py train --init_from=out/retrieval_mixer/ckpt.pt ..."""
data_dir = 'data/pystdlib'
out_dir = 'out/retrieval_mixer'
arch = 'mixer'
d_model = 256
n_layers = 4
n_ctx = 128
batch_mode = 'documents'
padding = 'left'
batch_size = 16
lr = 3e-3
warmup_iters = 50
max_iters = 0
max_time = 180.0
eval_interval = 250
eval_iters = 10
log_interval = 25
