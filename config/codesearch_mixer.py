"""Code search in one CPU hour (paper §6, Table 1), step 1 of 2 (README, Code search): a masked
mixer reads the installed Python packages (data/site, made by prepare.py with --holdout) as causal
language modelling on left-padded chunks of files, for 15 minutes; retrieve.py train then
fine-tunes it on their docstring -> code pairs (InfoNCE, mean-pooled) for 38.
config/codesearch_llama.py is the same run with a transformer. On 2 cores, $SITE being this
interpreter's site-packages:
python prepare.py text --input="$SITE/**/*.py" --exclude=tests,test --pairs=docstring \
    --holdout=matplotlib,mpl_toolkits,huggingface_hub --out_dir=data/site
python train.py config/codesearch_mixer.py
python retrieve.py train --init_from=out/codesearch_mixer/ckpt.pt --data_dir=data/site \
    --out_dir=out/codesearch_mixer_nce --pool=mean --tau=0.05 --symmetric=True --lr=4e-3 \
    --max_time=2280 --max_iters=0 --eval_interval=500
The learning rates (LM and InfoNCE) and tau were chosen on data/site's val pairs."""
data_dir = 'data/site'
out_dir = 'out/codesearch_mixer'
arch = 'mixer'
d_model = 256
n_layers = 4
n_ctx = 128                # a docstring, and a function's first lines
batch_mode = 'documents'
padding = 'left'           # a text's last token at the window's last position, as in retrieval
batch_size = 16
lr = 5e-3                  # mixers take larger rates than transformers (paper 5e-4 : 2e-4)
warmup_iters = 50
max_iters = 0
max_time = 900.0           # 15 minutes of training, evaluation excluded
eval_interval = 1000
eval_iters = 10
log_interval = 50
