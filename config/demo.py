"""Not a paper run: the README's main command, a small masked mixer on the Python standard
library, on CPU.
python prepare.py && python train.py config/demo.py && python sample.py --prompt='def main('
A step budget (max_iters), not a wall-clock one, so that the val loss it ends at is the same on
every machine however busy, and only the time varies: about 6 minutes on 2 idle AVX2 cores.
float32 everywhere (not dtype=auto, which takes bf16 where a CPU has it), for the same reason.
Of seven small settings tried for a five-minute budget, the smallest model won: more steps beat
more width here."""
data_dir = 'data/pystdlib'
out_dir = 'out'           # sample.py's default, so the README's three commands need no flags
arch = 'mixer'
d_model = 192
n_layers = 4
n_ctx = 128
batch_size = 16
lr = 1e-2                  # a small model on a short budget: a far larger rate than the paper's
warmup_iters = 50
max_iters = 800            # the budget: steps, so the result does not depend on the machine's load
max_time = 0.0
dtype = 'float32'          # the same arithmetic on every CPU kind
eval_interval = 200
eval_iters = 10
log_interval = 25
