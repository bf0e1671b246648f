"""`python -m vaswani COMMAND ...`: the `vaswani` command, for launchers that run a module, e.g.

torchrun --nproc_per_node 2 -m vaswani finetune --model my-decoder --train_file train.txt --output_dir out
accelerate launch --config_file docs/accelerate/ddp_cpu.yaml -m vaswani finetune ...
"""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
