"""TinyStories at paper Table S6's setting (4x V100, 2.25 h; its column "GPT, b = 32", train 1.82
and eval 1.77, §4.4 and fig 5, ran at the caption's rate): GPT-1 (learned positions, post-norm,
tanh GELU), d_model 512, 8 layers, 4 heads.
Learning rate: this preset follows the author's code, 2e-4, the rate of its transformer trainers
(the GPT-1 model is a commented-out option of llama_trainer.py, which runs at 2e-4) and of §9.5.
Table S6's caption says 0.005 instead: config/tinystories_gpt_s6.py is the same run at that rate.
Unlike GPT-1 (and the Hugging Face model the paper ran) there is no dropout, and the head is
untied unless --tie_weights=True (GPT-1 tied it).
Batch: 32 per GPU, as the blog's DDP runs (128 per update on 4 GPUs).
Data: python prepare.py tinystories --max_docs=2000000 (the paper's first 2M stories, 4096 BPE).
Budget: torchrun --standalone --nproc_per_node=4 train.py config/tinystories_gpt.py; the 3060
runs were 12 h on one GPU (--max_time=43200)."""
data_dir = 'data/tinystories'
out_dir = 'out/tinystories_gpt'
arch = 'gpt'
d_model = 512
n_layers = 8
n_heads = 4                # head number tuned as for the Llama baseline
n_ctx = 512
batch_mode = 'documents'   # one story per row, right-padded; pads masked out of attention and loss
batch_size = 32            # per micro-batch: Table S6's b = 32 (per GPU of 4)
grad_accum = 4             # on N GPUs each runs its 32/N rows of each (doc/usage.md)
lr = 2e-4                  # the author's transformer trainers and §9.5 (S6's caption: 5e-3)
warmup_iters = 500
max_iters = 0
max_time = 8100.0          # seconds of training: 2.25 h
eval_interval = 1000
eval_iters = 50
log_interval = 50
