"""Not a paper run: the README's main command, a small masked mixer on the Python standard library, on CPU.
python prepare.py && python train.py config/demo.py && python sample.py --prompt='def main('
Five minutes of training (max_time) on 2 cores, in bf16 where the CPU has it natively, else in
float32 (dtype=auto). Of seven small settings tried for this budget on a native-bf16 CPU, the
smallest model won: more steps beat more width here."""
data_dir = 'data/pystdlib'
out_dir = 'out'           # sample.py's default, so the README's three commands need no flags
arch = 'mixer'
d_model = 192
n_layers = 4
n_ctx = 128
batch_size = 16
lr = 1e-2                   # a small model on a short budget takes a far larger rate than the paper's 5e-4
warmup_iters = 50
max_iters = 0
max_time = 300.0           # seconds of training; evaluation is not counted
eval_interval = 250
eval_iters = 10
log_interval = 25
