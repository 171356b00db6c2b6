# How the peak-memory logs were made: SRC_NEW is this revision's src, SRC_OLD the revision before the singular
# rule's (6489cd2), copies on PYTHONPATH; three rounds of fresh processes alternating them, plain beside the first
# (derivative_restore/variants.sh). The held recent saves (NOTE [ Every save of a value a singular backward
# reads ]) and the kept values must not move the peaks of models that divide by no activation.
# resnet18.log and minilm_lora_sdpa_every_small_save.log: with every small save held (the first version);
# minilm_lora_sdpa.log: only the outputs of HELD_PRODUCERS.
#   bash run.sh SRC_NEW SRC_OLD
D=benchmarks/results/singular_backward
V=benchmarks/results/derivative_restore/variants.sh
cd "$(git rev-parse --show-toplevel)"
bash $V $D/minilm_lora_sdpa.log minilm_lora_sdpa 7 bits2 "$1" "$2"
