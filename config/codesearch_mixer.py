"""Code search in one CPU hour (paper §6, Table 1), step 1 of 2 (README, Retrieval): a masked
mixer reads the installed Python packages (data/site, made by prepare.py with --holdout) as causal
language modelling on chunks of files, each starting at window position 0, as retrieve.py embeds
texts; retrieve.py train then fine-tunes it on their docstring -> code pairs (InfoNCE,
mean-pooled). The budgets are steps, so the run is the same on any machine but for the dtype
(auto: bf16 where the CPU has it natively, else float32) and the time: 7,000 here and 15,000 of
InfoNCE, about 15 + 44 minutes on 2 cores of the AVX512-BF16 kind. config/codesearch_llama.py
is the same run with a transformer. $SITE being this interpreter's site-packages:
python prepare.py text --input="$SITE/**/*.py" --exclude=tests --pairs=docstring \
    --holdout=matplotlib,mpl_toolkits,huggingface_hub,fontTools,networkx --out_dir=data/site
python train.py config/codesearch_mixer.py
python retrieve.py train --init_from=out/codesearch_mixer/ckpt.pt --data_dir=data/site \
    --out_dir=out/codesearch_mixer_nce --pool=mean --tau=0.05 --symmetric=True --lr=4e-3 \
    --max_iters=15000 --eval_interval=1500
The learning rates (LM and InfoNCE) and tau were chosen on data/site's val pairs."""
data_dir = 'data/site'
out_dir = 'out/codesearch_mixer'
arch = 'mixer'
d_model = 256
n_layers = 4
n_ctx = 128                # a docstring, and a function's first lines
batch_mode = 'documents'   # chunks of files, padded after the text (padding right)
batch_size = 16
lr = 5e-3                  # mixers take larger rates than transformers (paper 5e-4 : 2e-4)
warmup_iters = 50
max_iters = 7000           # about 15 minutes on 2 cores
max_time = 0.0
eval_interval = 1000
eval_iters = 10
log_interval = 50
