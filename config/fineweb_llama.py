"""FineWeb-edu 10BT, paper §4.3 and fig 4 (the n_ctx 512 point):
Llama-style transformer, d_model 512, 16 layers, 4 heads, n_ctx 512.
Data: python prepare.py fineweb-edu (8000-token BPE).
Batch: §4.3's rule n_ctx x batch = 65,536 tokens per optimizer step for the node:
n_ctx x batch_size x grad_accum = 512 x 32 x 4.
  torchrun --standalone --nproc_per_node=4 train.py config/fineweb_llama.py  # 32 per GPU
  python train.py config/fineweb_llama.py                 # 4 micro-batches of 32 on 1 GPU
Budget: §4's 20 h on the 4x V100, or 200k steps (the author's FineWeb training scripts),
whichever comes first."""
data_dir = 'data/fineweb-edu'
out_dir = 'out/fineweb_llama'
arch = 'llama'
d_model = 512
n_layers = 16
n_heads = 4                # fig S10: 4 heads gave the lowest FineWeb loss
n_ctx = 512
batch_mode = 'documents'   # documents cut into n_ctx chunks, the last right-padded (paper)
batch_size = 32
grad_accum = 4
lr = 2e-4                  # paper §9.5: transformers
warmup_iters = 1000
max_iters = 200000
max_time = 72000.0         # 20 h
eval_interval = 2000
eval_iters = 50
log_interval = 100
